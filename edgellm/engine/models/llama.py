"""Llama-family decoder (llama, mistral, smollm...). Qwen2 (q/k/v biases) and Qwen3 (per-head QK RMSNorm) reuse
this forward pass with their own config; the optional tensors switch those steps on.

Per layer, as llama.cpp's src/models/llama.cpp:
    h = x + W_o · attention(rope(W_q·n), rope(W_k·n), W_v·n)     n = rmsnorm(x) · attn_norm
    x = h + W_down · (silu(W_gate·m) * W_up·m)                   m = rmsnorm(h) · ffn_norm
then logits = W_out · rmsnorm(x) · output_norm, W_out = token_embd when output.weight is absent (tied).
"""

from dataclasses import dataclass
from functools import partial

import numpy as np

from edgellm.engine import ops
from edgellm.errors import ModelError
from edgellm.engine.models.base import DEFAULT_N_BATCH, Batch, DecoderModel, TokenBuffers
from edgellm.engine.models.config import ModelConfig
from edgellm.engine.models.loading import experts, matrix, vector
from edgellm.engine.models.linear import bound_gate_up, bound_matmul, bound_qkv, project_gate_up, project_qkv
from edgellm.engine.models.moe import DENSE, ExpertBuffers, ExpertConfig, expert_ffn, read_expert_keys
from edgellm.quant.aligned import zeros_aligned


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    qkv_bias: bool  # qwen2
    qk_norm: bool  # qwen3
    sliding_window: int  # every layer attends over this many positions (Mistral 7B v0.1); 0 = global
    experts: ExpertConfig  # a mixture-of-experts feed-forward (Mixtral's llama files, qwen3moe); DENSE: none

    QKV_BIAS = False
    QK_NORM = False
    REQUIRES_EXPERTS = False  # qwen3moe: a file without expert_count is refused
    # llama and mistral files may carry attention.sliding_window (Mistral 7B v0.1: 4096), which the model was
    # trained with; it is honoured. llama.cpp ignores the key, so past the window its logits are full attention's.
    # Qwen's converters never write it (their configs keep use_sliding_window off).
    READS_SLIDING_WINDOW = True

    @classmethod
    def read_keys(cls, keys) -> dict:
        window = keys("attention.sliding_window", default=0) if cls.READS_SLIDING_WINDOW else 0
        if window < 0:
            raise ModelError(f"{keys.arch}.attention.sliding_window must not be negative, got {window}")
        shared = super().read_keys(keys)
        return {**shared, "qkv_bias": cls.QKV_BIAS, "qk_norm": cls.QK_NORM, "sliding_window": window,
                "experts": read_expert_keys(keys, shared["n_ff"], required=cls.REQUIRES_EXPERTS)}

    def layer_windows(self) -> tuple:
        return (self.sliding_window,) * self.n_layer


def tensor_specs(cfg: LlamaConfig):
    d, q_dim, kv_dim = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    specs = [
        matrix("token_embd.weight", (cfg.n_vocab, d)),
        vector("output_norm.weight", d),
        matrix("output.weight", (cfg.n_vocab, d), optional=True),
        vector("rope_freqs.weight", cfg.n_rot // 2, optional=True),  # llama3 per-pair frequency factors
    ]
    for il in range(cfg.n_layer):
        blk = f"blk.{il}."
        specs += [vector(blk + "attn_norm.weight", d), *attention_specs(cfg, blk), vector(blk + "ffn_norm.weight", d),
                  *ffn_specs(cfg, blk)]
        for name, length in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            specs.append(vector(blk + name + ".bias", length, optional=not cfg.qkv_bias))
        specs += [vector(blk + "attn_q_norm.weight", cfg.head_dim, optional=not cfg.qk_norm),
                  vector(blk + "attn_k_norm.weight", cfg.head_dim, optional=not cfg.qk_norm)]
    return specs


def attention_specs(cfg, blk: str, qk_norms=()):
    """The attention's projections: q, k, v, then any QK norms, then output (the order the writers lay them out
    in, which the tiny files' recorded hashes fix)."""
    d, q_dim, kv_dim = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    return [matrix(blk + "attn_q.weight", (q_dim, d)),
            matrix(blk + "attn_k.weight", (kv_dim, d)),
            matrix(blk + "attn_v.weight", (kv_dim, d)),
            *qk_norms,
            matrix(blk + "attn_output.weight", (d, q_dim))]


def ffn_specs(cfg, blk: str):
    """The feed-forward's tensors: dense gate, up and down, or the router and the experts' stacks."""
    d, n_expert = cfg.n_embd, getattr(cfg, "experts", DENSE).n_expert
    if n_expert:
        f = cfg.experts.n_ff
        return [matrix(blk + "ffn_gate_inp.weight", (n_expert, d)),
                experts(blk + "ffn_gate_exps.weight", (n_expert, f, d)),
                experts(blk + "ffn_up_exps.weight", (n_expert, f, d)),
                experts(blk + "ffn_down_exps.weight", (n_expert, d, f))]
    return [matrix(blk + "ffn_gate.weight", (cfg.n_ff, d)),
            matrix(blk + "ffn_up.weight", (cfg.n_ff, d)),
            matrix(blk + "ffn_down.weight", (d, cfg.n_ff))]


class BlockBuffers(TokenBuffers):
    """Activations of one transformer block for T tokens; each architecture adds its rope tables."""

    def __init__(self, cfg, n_tokens: int):
        super().__init__(n_tokens)
        T, f32, hd = n_tokens, np.float32, cfg.head_dim
        self.x = zeros_aligned((T, cfg.n_embd), f32)  # [T, d] residual stream
        self.xn = zeros_aligned((T, cfg.n_embd), f32)  # [T, d] normed block input, then block output
        self.q = zeros_aligned((T, cfg.n_head * hd), f32)  # [T, H*hd]
        self.k = zeros_aligned((T, cfg.n_head_kv * hd), f32)  # [T, H_kv*hd]
        self.v = zeros_aligned((T, cfg.n_head_kv * hd), f32)  # [T, H_kv*hd]
        self.attn = zeros_aligned((T, cfg.n_head * hd), f32)  # [T, H*hd] attention output, heads side by side
        self.q_heads = self.q.reshape(T, cfg.n_head, hd)  # views of the same memory, [T, heads, hd]
        self.k_heads = self.k.reshape(T, cfg.n_head_kv, hd)
        self.v_heads = self.v.reshape(T, cfg.n_head_kv, hd)
        self.attn_heads = self.attn.reshape(T, cfg.n_head, hd)
        n_ff = 0 if getattr(cfg, "experts", DENSE).n_expert else cfg.n_ff  # experts have buffers of their own
        self.gate = zeros_aligned((T, n_ff), f32)  # [T, n_ff]
        self.up = zeros_aligned((T, n_ff), f32)  # [T, n_ff]


class WindowedBlockBuffers(BlockBuffers):
    """A block's activations with two rope tables: sliding-window layers rotate with a base of their own."""

    def __init__(self, cfg, n_tokens: int):
        super().__init__(cfg, n_tokens)
        T, f32, half = n_tokens, np.float32, cfg.n_rot // 2
        self.cos_local = np.zeros((T, half), f32)  # [T, n_rot/2] sliding-window layers' rope
        self.sin_local = np.zeros((T, half), f32)
        self.cos_global = np.zeros((T, half), f32)  # [T, n_rot/2] global layers' rope
        self.sin_global = np.zeros((T, half), f32)


class LlamaBuffers(BlockBuffers):
    def __init__(self, cfg: LlamaConfig, n_tokens: int):
        super().__init__(cfg, n_tokens)
        self.rope_cos = np.zeros((n_tokens, cfg.n_rot // 2), np.float32)  # [T, n_rot/2]
        self.rope_sin = np.zeros((n_tokens, cfg.n_rot // 2), np.float32)  # [T, n_rot/2]


class LlamaModel(DecoderModel):
    tensor_specs = staticmethod(tensor_specs)  # an architecture that shares this forward pass may give its own

    def __init__(self, gguf_file, config: LlamaConfig, n_ctx: int, n_threads: int, n_batch: int = DEFAULT_N_BATCH,
                 kv_type=None):
        super().__init__(config, n_ctx, n_threads, n_batch, kv_type)
        w = self.load_weights(gguf_file, self.tensor_specs(config))
        self.rope = ops.Rope(config.n_rot, config.rope_base, config.rope_freq_scale, w.get("rope_freqs.weight"),
                             config.rope_scaling)
        self.make_cache()
        self.buffers = LlamaBuffers(config, self.n_batch)
        self.expert_buffers = None
        if getattr(config, "experts", DENSE).n_expert:  # (configs that share this class may have no experts field)
            if type(self).forward_pass is not LlamaModel.forward_pass:
                raise ModelError(f"{config.architecture} files with experts are not supported")
            self.expert_buffers = ExpertBuffers(config.experts, config.n_embd, self.n_batch)

    def layer_rope(self, il: int):
        return self.rope.inv_freq, self.config.rope_neox

    def forward_pass(self, b: Batch):
        cfg, eps, sizes = self.config, self.config.norm_eps, b.sizes
        s = self.buffers.for_tokens(b.n_tokens)
        rope = b.rope_rows(self.rope, s.rope_cos, s.rope_sin, cfg.rope_neox)
        self.token_embd.get_rows(b.tokens, s.x)
        steps = self.decode_steps(s, b, self._bind_layer)
        for il, layer in enumerate(self.layers):
            if steps is not None:  # the same steps as below, bound to the buffers
                attn_norm, qkv, attend, w_o, ffn_norm, gate_up, act, down = steps[il]
                attn_norm()
                qkv()
                self.attend_step(attend, il, layer, s, b, rope)
                w_o()
                ffn_norm()
                gate_up()
                act()
                down()
                s.x += s.xn
                continue
            # attention block: n = norm(x); x += W_o · attention(rope(W_q n), rope(W_k n), W_v n)
            ops.rms_norm(s.x, layer.attn_norm, eps, s.xn)
            project_qkv(layer, s.xn, s.q, s.k, s.v, sizes)
            self.attend(il, layer, s, b, rope)
            layer.attn_output.matmul(s.attn, s.xn, sizes)
            ops.add_rms_norm(s.x, s.xn, layer.ffn_norm, eps, s.xn)  # the residual add, then m = norm(x)
            # feed-forward block: x += W_down · (silu(W_gate m) * W_up m), or the experts' weighted sum
            self.feed_forward(layer, s, sizes)
            s.x += s.xn
        self.logits_head(s, b)

    def _bind_layer(self, il, layer, s, scratch, sizes):
        """forward_pass's steps of layer il as callables bound to the buffers s (decode_steps): attention norm, q/k/v,
        one token's attention on self.cache (None: attend()), W_o, the residual and ffn norm, then the feed-forward as
        gate/up, activation, down (an experts' feed-forward as one call and two that do nothing)."""
        eps = self.config.norm_eps
        head = (ops.bound_rms_norm(s.x, layer.attn_norm, eps, s.xn),
                bound_qkv(layer, s.xn, s.q, s.k, s.v, scratch, sizes),
                self.bound_attention(il, layer, s, s.rope_cos, s.rope_sin),
                bound_matmul(layer.attn_output, s.attn, s.xn, scratch, sizes),
                ops.bound_add_rms_norm(s.x, s.xn, layer.ffn_norm, eps, s.xn))
        if self.expert_buffers is not None:
            return (*head, partial(self.feed_forward, layer, s, sizes), _nothing, _nothing)
        return (*head, bound_gate_up(layer, s.xn, s.gate, s.up, scratch, sizes), ops.bound_silu_mul(s.gate, s.up),
                bound_matmul(layer.ffn_down, s.gate, s.xn, scratch, sizes))

    def feed_forward(self, layer, s, sizes):
        """s.xn <- the feed-forward of s.xn: dense, or the chosen experts' (moe.expert_ffn)."""
        if self.expert_buffers is not None:
            expert_ffn(layer, s.xn, s.xn, self.config.experts, self.expert_buffers, sizes)
            return
        project_gate_up(layer, s.xn, s.gate, s.up, sizes)
        ops.silu_mul(s.gate, s.up)
        layer.ffn_down.matmul(s.gate, s.xn, sizes)

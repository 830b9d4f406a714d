"""Llama-family decoder (llama, mistral, smollm...). Qwen2 (q/k/v biases) and Qwen3 (per-head QK RMSNorm) reuse
this forward pass with their own config; the optional tensors switch those steps on.

Per layer, as llama.cpp's src/models/llama.cpp:
    h = x + W_o · attention(rope(W_q·n), rope(W_k·n), W_v·n)     n = rmsnorm(x) · attn_norm
    x = h + W_down · (silu(W_gate·m) * W_up·m)                   m = rmsnorm(h) · ffn_norm
then logits = W_out · rmsnorm(x) · output_norm, W_out = token_embd when output.weight is absent (tied).
"""

import math
from dataclasses import dataclass

import numpy as np

from edgellm.engine import ops
from edgellm.errors import ModelError
from edgellm.engine.models.base import DEFAULT_N_BATCH, DecoderModel, TokenBuffers
from edgellm.engine.models.loading import check_shape_keys, layer_weights, load_tensors, matrix, read_key, vector
from edgellm.engine.models.linear import group_projections, project_gate_up, project_qkv


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float
    rope_freq_scale: float  # 1 / linear rope scaling factor
    n_rot: int
    rope_neox: bool  # NeoX pair ordering (qwen) instead of adjacent pairs (llama)
    attn_scale: float
    qkv_bias: bool  # qwen2
    qk_norm: bool  # qwen3

    q_scale = 1.0  # not a field: llama.cpp's llama graph scales the scores (attn_scale), never q

    ROPE_NEOX = False
    QKV_BIAS = False
    QK_NORM = False

    @classmethod
    def from_gguf(cls, gguf_file):
        meta, arch = gguf_file.metadata, gguf_file.metadata.get("general.architecture")
        n_embd = read_key(meta, f"{arch}.embedding_length")
        n_head = read_key(meta, f"{arch}.attention.head_count")
        n_head_kv = read_key(meta, f"{arch}.attention.head_count_kv", default=n_head)
        if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
            raise ModelError(f"head_count {n_head} must be a positive multiple of head_count_kv {n_head_kv}")
        head_dim = read_key(meta, f"{arch}.attention.key_length", default=n_embd // n_head)
        check_shape_keys(gguf_file, arch, read_key(meta, f"{arch}.block_count"), n_embd, n_head, head_dim)
        if read_key(meta, f"{arch}.attention.value_length", default=head_dim) != head_dim:
            raise ModelError("attention.value_length differs from key_length; not supported")
        n_rot = read_key(meta, f"{arch}.rope.dimension_count", default=head_dim)
        if n_rot % 2 or n_rot > head_dim:
            raise ModelError(f"rope.dimension_count {n_rot} must be even and at most the head size {head_dim}")
        if "token_embd.weight" not in gguf_file.tensors:
            raise ModelError("GGUF file lacks tensor 'token_embd.weight'")
        return cls(
            architecture=arch,
            n_layer=read_key(meta, f"{arch}.block_count"),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=read_key(meta, f"{arch}.feed_forward_length"),
            n_vocab=int(gguf_file.tensors["token_embd.weight"].shape[0]),
            n_ctx_train=read_key(meta, f"{arch}.context_length", default=4096),
            norm_eps=read_key(meta, f"{arch}.attention.layer_norm_rms_epsilon", float),
            rope_base=read_key(meta, f"{arch}.rope.freq_base", float, default=10000.0),
            rope_freq_scale=linear_rope_scale(meta, arch),
            n_rot=n_rot,
            rope_neox=cls.ROPE_NEOX,
            attn_scale=read_key(meta, f"{arch}.attention.scale", float, default=0.0) or 1.0 / math.sqrt(head_dim),
            qkv_bias=cls.QKV_BIAS,
            qk_norm=cls.QK_NORM,
        )


def linear_rope_scale(meta, arch) -> float:
    """1/factor for linear rope scaling; other scaling schemes (yarn, longrope) are refused, not approximated."""
    kind = read_key(meta, f"{arch}.rope.scaling.type", str, default="none")
    factor = read_key(meta, f"{arch}.rope.scaling.factor", float, default=0.0)
    if kind not in ("none", "linear") and factor not in (0.0, 1.0):
        raise ModelError(f"rope scaling type {kind!r} is not supported")
    return 1.0 / factor if factor > 0.0 else 1.0


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
        specs += [
            vector(blk + "attn_norm.weight", d),
            matrix(blk + "attn_q.weight", (q_dim, d)),
            matrix(blk + "attn_k.weight", (kv_dim, d)),
            matrix(blk + "attn_v.weight", (kv_dim, d)),
            matrix(blk + "attn_output.weight", (d, q_dim)),
            vector(blk + "ffn_norm.weight", d),
            matrix(blk + "ffn_gate.weight", (cfg.n_ff, d)),
            matrix(blk + "ffn_up.weight", (cfg.n_ff, d)),
            matrix(blk + "ffn_down.weight", (d, cfg.n_ff)),
        ]
        for name, length in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            specs.append(vector(blk + name + ".bias", length, optional=not cfg.qkv_bias))
        specs += [vector(blk + "attn_q_norm.weight", cfg.head_dim, optional=not cfg.qk_norm),
                  vector(blk + "attn_k_norm.weight", cfg.head_dim, optional=not cfg.qk_norm)]
    return specs


class BlockBuffers(TokenBuffers):
    """Activations of one transformer block for T tokens; each architecture adds its rope tables."""

    def __init__(self, cfg, n_tokens: int):
        super().__init__(n_tokens)
        T, f32, hd = n_tokens, np.float32, cfg.head_dim
        self.x = np.zeros((T, cfg.n_embd), f32)  # [T, d] residual stream
        self.xn = np.zeros((T, cfg.n_embd), f32)  # [T, d] normed block input, then block output
        self.q = np.zeros((T, cfg.n_head * hd), f32)  # [T, H*hd]
        self.k = np.zeros((T, cfg.n_head_kv * hd), f32)  # [T, H_kv*hd]
        self.v = np.zeros((T, cfg.n_head_kv * hd), f32)  # [T, H_kv*hd]
        self.attn = np.zeros((T, cfg.n_head * hd), f32)  # [T, H*hd] attention output, heads side by side
        self.q_heads = self.q.reshape(T, cfg.n_head, hd)  # views of the same memory, [T, heads, hd]
        self.k_heads = self.k.reshape(T, cfg.n_head_kv, hd)
        self.v_heads = self.v.reshape(T, cfg.n_head_kv, hd)
        self.attn_heads = self.attn.reshape(T, cfg.n_head, hd)
        self.gate = np.zeros((T, cfg.n_ff), f32)  # [T, n_ff]
        self.up = np.zeros((T, cfg.n_ff), f32)  # [T, n_ff]


class LlamaBuffers(BlockBuffers):
    def __init__(self, cfg: LlamaConfig, n_tokens: int):
        super().__init__(cfg, n_tokens)
        self.rope_cos = np.zeros((n_tokens, cfg.n_rot // 2), np.float32)  # [T, n_rot/2]
        self.rope_sin = np.zeros((n_tokens, cfg.n_rot // 2), np.float32)  # [T, n_rot/2]


NONE = np.zeros(0, np.float32)  # an absent bias or norm: finish_qkv skips that step


class LlamaModel(DecoderModel):
    def __init__(self, gguf_file, config: LlamaConfig, n_ctx: int, n_threads: int, n_batch: int = DEFAULT_N_BATCH,
                 kv_type=None):
        super().__init__(config, n_ctx, n_threads, n_batch, kv_type)
        w = load_tensors(gguf_file, tensor_specs(config))
        self.token_embd = w["token_embd.weight"]
        self.output_norm = w["output_norm.weight"]
        self.output = w["output.weight"] if w["output.weight"] is not None else self.token_embd  # tied when absent
        self.layers = [layer_weights(w, il) for il in range(config.n_layer)]
        for il, layer in enumerate(self.layers):
            group_projections(layer)
            for group in (("attn_q_bias", "attn_k_bias", "attn_v_bias"), ("attn_q_norm", "attn_k_norm")):
                present = [getattr(layer, name) is not None for name in group]
                if any(present) and not all(present):
                    raise ModelError(f"layer {il} has only some of {group}; expected all or none")
                for name in group:
                    if getattr(layer, name) is None:
                        setattr(layer, name, NONE)
        rope_factors = w["rope_freqs.weight"]
        self.rope = ops.Rope(config.n_rot, config.rope_base, config.rope_freq_scale, rope_factors)
        self.make_cache([0] * config.n_layer)
        self.buffers = LlamaBuffers(config, self.n_batch)

    def layer_rope(self, il: int):
        return self.rope.inv_freq, self.config.rope_neox

    def forward_batch(self, tokens, positions, logits_out, groups=None):
        cfg, eps, T = self.config, self.config.norm_eps, len(tokens)
        groups = groups or ((0, T, self.cache),)
        # several sequences: each one's rows get the arithmetic of a batch of its own size, as if run alone
        sizes = None if len(groups) == 1 else tuple(b1 - b0 for b0, b1, _ in groups)
        s = self.buffers.for_tokens(T)
        ops.rope_tables(positions, self.rope, s.rope_cos, s.rope_sin)
        self.token_embd.get_rows(tokens, s.x)
        for il, layer in enumerate(self.layers):
            # attention block: n = norm(x); x += W_o · attention(rope(W_q n), rope(W_k n), W_v n)
            ops.rms_norm(s.x, layer.attn_norm, eps, s.xn)
            project_qkv(layer, s.xn, s.q, s.k, s.v, sizes)
            self.attend(il, s, positions, s.rope_cos, s.rope_sin, cfg.rope_neox,
                        (layer.attn_q_bias, layer.attn_k_bias, layer.attn_v_bias), (layer.attn_q_norm, layer.attn_k_norm),
                        groups)
            layer.attn_output.matmul(s.attn, s.xn, sizes)
            ops.add_rms_norm(s.x, s.xn, layer.ffn_norm, eps, s.xn)  # the residual add, then m = norm(x)
            # feed-forward block: x += W_down · (silu(W_gate m) * W_up m)
            project_gate_up(layer, s.xn, s.gate, s.up, sizes)
            ops.silu_mul(s.gate, s.up)
            layer.ffn_down.matmul(s.gate, s.xn, sizes)
            s.x += s.xn
        if logits_out is not None:
            self.logits_head(s, T, logits_out, sizes)

"""Gemma 3 decoder, as llama.cpp's src/models/gemma3.cpp (the sliding-window variant it always builds).

    x = token_embd[ids] * sqrt(n_embd)
    per layer:  n = rmsnorm(x)·attn_norm;  q, k = rmsnorm_per_head(W_q·n)·q_norm, (W_k·n)·k_norm;  v = W_v·n
                h = x + rmsnorm(W_o · attention(rope(q), rope(k), v))·post_attention_norm
                x = h + rmsnorm(W_down · (gelu_tanh(W_gate·m) * W_up·m))·post_ffw_norm,   m = rmsnorm(h)·ffn_norm
    logits = token_embd · rmsnorm(x)·output_norm   (tied; llama.cpp applies no final softcap to Gemma 3)

Five of every six layers attend over a sliding window with rope base 10000; every sixth layer (il % 6 == 5)
attends globally with the file's rope base (and its linear rope scaling, if any).
Norm weights are used as stored: the converter already folded Gemma's (1 + w) into the GGUF.
"""

import math
from dataclasses import dataclass

import numpy as np

from edgellm.engine import ops
from edgellm.errors import ModelError
from edgellm.engine.models.base import DEFAULT_N_BATCH, Batch, DecoderModel
from edgellm.engine.models.config import ModelConfig
from edgellm.engine.models.llama import WindowedBlockBuffers, attention_specs, ffn_specs
from edgellm.engine.models.linear import bound_gate_up, bound_matmul, bound_qkv, project_gate_up, project_qkv
from edgellm.engine.models.loading import matrix, vector

SWA_PERIOD_DEFAULT = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3
ROPE_BASE_LOCAL_DEFAULT = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3
N_LAYER_27B = 62  # llama.cpp scales attention by n_embd / n_head instead of head size for the 27B model


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    # rope_base and rope_freq_scale are the global layers'; attn_scale is 1 (llama.cpp's Gemma graph scales q)
    rope_base_local: float  # sliding-window layers, unscaled
    sliding_window: int
    swa_period: int  # layer il is global when il % swa_period == swa_period - 1

    N_CTX_TRAIN_DEFAULT = 32768
    ROPE_BASE_DEFAULT = 1000000.0
    ROPE_NEOX = True

    @classmethod
    def read_keys(cls, keys) -> dict:
        shared = super().read_keys(keys)
        window = keys("attention.sliding_window")
        if window <= 0:
            raise ModelError(f"{keys.arch}.attention.sliding_window must be positive, got {window}")
        n_layer, n_embd, n_head, head_dim = (shared[k] for k in ("n_layer", "n_embd", "n_head", "head_dim"))
        scale_dim = n_embd / n_head if n_layer == N_LAYER_27B else head_dim
        return {**shared,
                "n_rot": head_dim,
                "attn_scale": 1.0,
                "q_scale": 1.0 / math.sqrt(scale_dim),
                "rope_base_local": keys("rope.freq_base_swa", float, default=ROPE_BASE_LOCAL_DEFAULT),
                "sliding_window": window,
                "swa_period": keys("attention.sliding_window_pattern", default=SWA_PERIOD_DEFAULT)}

    def layer_windows(self) -> tuple:
        return tuple(self.sliding_window if il % self.swa_period < self.swa_period - 1 else 0
                     for il in range(self.n_layer))

    def is_sliding(self, il: int) -> bool:
        return self.layer_windows()[il] != 0


def tensor_specs(cfg: Gemma3Config):
    d, hd = cfg.n_embd, cfg.head_dim
    specs = [matrix("token_embd.weight", (cfg.n_vocab, d)), vector("output_norm.weight", d),
             matrix("output.weight", (cfg.n_vocab, d), optional=True)]
    for il in range(cfg.n_layer):
        blk = f"blk.{il}."
        specs += sandwich_block_specs(cfg, blk, [vector(blk + "attn_q_norm.weight", hd),
                                                 vector(blk + "attn_k_norm.weight", hd)])
    return specs


def sandwich_block_specs(cfg, blk: str, qk_norms=()):
    """A Gemma block's tensors: attention (with any QK norms) and dense feed-forward, each with a norm before and
    after."""
    d = cfg.n_embd
    return [vector(blk + "attn_norm.weight", d), *attention_specs(cfg, blk, qk_norms),
            vector(blk + "post_attention_norm.weight", d),
            vector(blk + "ffn_norm.weight", d), *ffn_specs(cfg, blk), vector(blk + "post_ffw_norm.weight", d)]


class Gemma3Model(DecoderModel):
    tensor_specs = staticmethod(tensor_specs)

    def __init__(self, gguf_file, config: Gemma3Config, n_ctx: int, n_threads: int, n_batch: int = DEFAULT_N_BATCH,
                 kv_type=None):
        super().__init__(config, n_ctx, n_threads, n_batch, kv_type)
        self.load_weights(gguf_file, self.tensor_specs(config))
        self.rope_local = ops.Rope(config.n_rot, config.rope_base_local, 1.0, None, config.rope_scaling)
        self.rope_global = ops.Rope(config.n_rot, config.rope_base, config.rope_freq_scale, None, config.rope_scaling)
        self.embd_scale = np.float32(math.sqrt(config.n_embd))
        self.windows = config.layer_windows()
        self.make_cache()
        self.buffers = WindowedBlockBuffers(config, self.n_batch)

    def layer_rope(self, il: int):
        return (self.rope_local if self.windows[il] else self.rope_global).inv_freq, self.config.rope_neox

    def forward_pass(self, b: Batch):
        cfg, eps, sizes = self.config, self.config.norm_eps, b.sizes
        s = self.buffers.for_tokens(b.n_tokens)
        rope_local = b.rope_rows(self.rope_local, s.cos_local, s.sin_local, cfg.rope_neox)
        rope_global = b.rope_rows(self.rope_global, s.cos_global, s.sin_global, cfg.rope_neox)
        self.token_embd.get_rows(b.tokens, s.x)
        s.x *= self.embd_scale
        steps = self.decode_steps(s, b, self._bind_layer)
        for il, layer in enumerate(self.layers):
            rope = rope_local if self.windows[il] else rope_global
            if steps is not None:  # the same steps as below, bound to the buffers
                attn_norm, qkv, attend, w_o, post_attn, ffn_norm, gate_up, act, down, post_ffw = steps[il]
                attn_norm()
                qkv()
                self.attend_step(attend, il, layer, s, b, rope)
                w_o()
                post_attn()
                ffn_norm()
                gate_up()
                act()
                down()
                post_ffw()
                continue
            # attention block: n = norm(x); x += post_norm(W_o · attention(rope(norm(W_q n)), rope(norm(W_k n)), W_v n))
            ops.rms_norm(s.x, layer.attn_norm, eps, s.xn)
            project_qkv(layer, s.xn, s.q, s.k, s.v, sizes)
            self.attend(il, layer, s, b, rope)
            layer.attn_output.matmul(s.attn, s.xn, sizes)
            ops.add_post_norm(s.x, s.xn, layer.post_attention_norm, eps)
            # feed-forward block: m = norm(x); x += post_norm(W_down · (gelu(W_gate m) * W_up m))
            ops.rms_norm(s.x, layer.ffn_norm, eps, s.xn)
            project_gate_up(layer, s.xn, s.gate, s.up, sizes)
            ops.gelu_tanh_mul(s.gate, s.up)
            layer.ffn_down.matmul(s.gate, s.xn, sizes)
            ops.add_post_norm(s.x, s.xn, layer.post_ffw_norm, eps)
        self.logits_head(s, b)

    def _bind_layer(self, il, layer, s, scratch, sizes):
        """forward_pass's steps of layer il as callables bound to the buffers s (decode_steps)."""
        eps = self.config.norm_eps
        cos, sin = (s.cos_local, s.sin_local) if self.windows[il] else (s.cos_global, s.sin_global)
        return (ops.bound_rms_norm(s.x, layer.attn_norm, eps, s.xn),
                bound_qkv(layer, s.xn, s.q, s.k, s.v, scratch, sizes), self.bound_attention(il, layer, s, cos, sin),
                bound_matmul(layer.attn_output, s.attn, s.xn, scratch, sizes),
                ops.bound_add_post_norm(s.x, s.xn, layer.post_attention_norm, eps),
                ops.bound_rms_norm(s.x, layer.ffn_norm, eps, s.xn),
                bound_gate_up(layer, s.xn, s.gate, s.up, scratch, sizes), ops.bound_gelu_tanh_mul(s.gate, s.up),
                bound_matmul(layer.ffn_down, s.gate, s.xn, scratch, sizes),
                ops.bound_add_post_norm(s.x, s.xn, layer.post_ffw_norm, eps))

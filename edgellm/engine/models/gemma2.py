"""Gemma 2 decoder, as llama.cpp's src/models/gemma2.cpp: Gemma 3's block without the QK norms, with soft-capped
attention scores and final logits.

    x = token_embd[ids] * sqrt(n_embd)
    per layer:  n = rmsnorm(x)·attn_norm;  q, k, v = W_q·n, W_k·n, W_v·n
                h = x + rmsnorm(W_o · attention(rope(q) * q_scale, rope(k), v))·post_attention_norm
                    with every score capped: c_a * tanh(q·k / c_a)
                x = h + rmsnorm(W_down · (gelu_tanh(W_gate·m) * W_up·m))·post_ffw_norm,   m = rmsnorm(h)·ffn_norm
    logits = c_f * tanh(token_embd · rmsnorm(x)·output_norm / c_f)   (always tied: llama.cpp reads no output.weight)

Even layers attend over a sliding window, odd layers globally (llama.cpp's pattern 2, unless the file gives
attention.sliding_window_pattern); both kinds use the file's rope base and linear scaling (rope.freq_base_swa may
give the window layers their own base).
"""

import math
from dataclasses import dataclass

from edgellm.errors import ModelError
from edgellm.engine import ops
from edgellm.engine.models.base import DEFAULT_N_BATCH, Batch
from edgellm.engine.models.config import ModelConfig
from edgellm.engine.models.gemma3 import Gemma3Model, sandwich_block_specs
from edgellm.engine.models.loading import matrix, vector

SWA_PERIOD_DEFAULT = 2  # llama.cpp: load_swa_pattern(ml, 2) for gemma2
N_LAYER_27B = 46  # llama.cpp scales q by 1/sqrt(n_embd / n_head) instead of the head size for the 27B model


@dataclass(frozen=True)
class Gemma2Config(ModelConfig):
    rope_base_local: float  # sliding-window layers' rope base; rope_freq_scale applies to both kinds
    sliding_window: int
    swa_period: int  # layer il is global when il % swa_period == swa_period - 1
    attn_softcap: float  # attn_logit_softcapping
    final_softcap: float  # final_logit_softcapping

    N_CTX_TRAIN_DEFAULT = 8192
    ROPE_NEOX = True

    @classmethod
    def read_keys(cls, keys) -> dict:
        shared = super().read_keys(keys)
        window = keys("attention.sliding_window")
        caps = {name: keys(name, float) for name in ("attn_logit_softcapping", "final_logit_softcapping")}
        for name, cap in caps.items():
            if not cap > 0.0:
                raise ModelError(f"{keys.arch}.{name} must be positive, got {cap}")
        period = keys("attention.sliding_window_pattern", default=SWA_PERIOD_DEFAULT)
        if window <= 0 or period <= 0:
            raise ModelError(f"{keys.arch}: sliding_window {window} and its pattern {period} must be positive")
        if shared["n_rot"] != shared["head_dim"]:
            raise ModelError(f"{keys.arch}.rope.dimension_count must equal the head size {shared['head_dim']}")
        n_layer, n_embd, n_head, head_dim = (shared[k] for k in ("n_layer", "n_embd", "n_head", "head_dim"))
        scale_dim = n_embd // n_head if n_layer == N_LAYER_27B else head_dim
        return {**shared,
                "attn_scale": 1.0,
                "q_scale": 1.0 / math.sqrt(scale_dim),
                "rope_base_local": keys("rope.freq_base_swa", float, default=shared["rope_base"]),
                "sliding_window": window,
                "swa_period": period,
                "attn_softcap": caps["attn_logit_softcapping"],
                "final_softcap": caps["final_logit_softcapping"]}

    def layer_windows(self) -> tuple:
        return tuple(self.sliding_window if il % self.swa_period < self.swa_period - 1 else 0
                     for il in range(self.n_layer))


def tensor_specs(cfg: Gemma2Config):
    specs = [matrix("token_embd.weight", (cfg.n_vocab, cfg.n_embd)), vector("output_norm.weight", cfg.n_embd)]
    for il in range(cfg.n_layer):
        specs += sandwich_block_specs(cfg, f"blk.{il}.")
    return specs


class Gemma2Model(Gemma3Model):
    """Gemma 3's forward pass (its QK norms absent, so skipped) with capped attention and logits."""
    tensor_specs = staticmethod(tensor_specs)

    def __init__(self, gguf_file, config: Gemma2Config, n_ctx: int, n_threads: int, n_batch: int = DEFAULT_N_BATCH,
                 kv_type=None):
        super().__init__(gguf_file, config, n_ctx, n_threads, n_batch, kv_type)
        self.rope_local = ops.Rope(config.n_rot, config.rope_base_local, config.rope_freq_scale)

    def attend(self, il: int, layer, s, b: Batch, rope) -> None:
        """DecoderModel.attend's per-sequence path with capped scores (no biases, no QK norms)."""
        cfg, none = self.config, layer.attn_q_norm  # a size-0 array: the step is skipped
        for b0, b1, cache in b.groups:
            kv = cache.layers[il]
            q, k, v, cos, sin, pos, out = (a[b0:b1] for a in (s.q_heads, s.k_heads, s.v_heads, rope.cos, rope.sin,
                                                              b.positions, s.attn_heads))
            ops.finish_qkv(q, k, v, none, none, none, none, none, cfg.norm_eps, cos, sin, rope.neox, pos, kv.k, kv.v,
                           kv.slot_pos, kv.k_scale, kv.v_scale, cfg.q_scale)
            ops.attention(q, kv.k, kv.v, kv.slot_pos, pos, kv.window, cfg.attn_scale, out, self.attn_scratch(kv),
                          kv.k_scale, kv.v_scale, cap=cfg.attn_softcap)

    def logits_head(self, s, b: Batch) -> None:
        super().logits_head(s, b)
        if b.logits_out is not None:
            ops.softcap(b.logits_out, self.config.final_softcap)

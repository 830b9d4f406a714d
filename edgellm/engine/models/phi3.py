"""Phi-3 and Phi-4-mini (GGUF architecture phi3): the llama forward pass with Q, K and V in one fused attn_qkv
matrix (or three, where a converter split them), gate and up in one ffn_up [2 n_ff, d] (gate first, SwiGLU), NeoX
rope over rope.dimension_count leading dimensions, and q scaled by 1/sqrt(head_dim) after rope instead of the scores
(llama.cpp src/models/phi3.cpp).

Long context (longrope): the file holds two per-pair divisor tensors, rope_factors_long and rope_factors_short;
llama.cpp takes the long ones when the context is longer than rope.scaling.original_context_length, else the short,
and scales cos and sin by rope.scaling.attn_factor. The sliding window some files name is ignored, as llama.cpp
ignores it for phi3 (every layer attends globally).
"""

from dataclasses import dataclass

import numpy as np

from edgellm.engine import ops
from edgellm.engine.models.base import DEFAULT_N_BATCH
from edgellm.engine.models.llama import LlamaConfig, LlamaModel
from edgellm.engine.models.loading import load_tensors, matrix, vector
from edgellm.errors import ModelError

LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    fused_qkv: bool  # attn_qkv (the converter's layout) rather than attn_q, attn_k, attn_v

    ROPE_NEOX = True
    READS_SLIDING_WINDOW = False  # as llama.cpp: phi3's window key (some files carry one) is ignored

    @classmethod
    def read_keys(cls, keys) -> dict:
        shared = super().read_keys(keys)
        # llama.cpp: ggml_scale(Qcur, 1.0f / sqrtf(n_embd_head)) after rope, the scores unscaled
        q_scale = float(np.float32(1) / np.sqrt(np.float32(shared["head_dim"])))
        fused = "blk.0.attn_q.weight" not in keys.gguf_file.tensors
        return {**shared, "attn_scale": 1.0, "q_scale": q_scale, "fused_qkv": fused}


def tensor_specs(cfg: Phi3Config):
    d, q_dim, kv_dim = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    specs = [matrix("token_embd.weight", (cfg.n_vocab, d)), vector("output_norm.weight", d),
             matrix("output.weight", (cfg.n_vocab, d), optional=True),
             vector("rope_freqs.weight", cfg.n_rot // 2, optional=True)]
    specs += [vector(name, cfg.n_rot // 2, optional=True) for name in LONGROPE]
    for il in range(cfg.n_layer):
        blk = f"blk.{il}."
        specs.append(vector(blk + "attn_norm.weight", d))
        if cfg.fused_qkv:
            specs.append(matrix(blk + "attn_qkv.weight", (q_dim + 2 * kv_dim, d)))
        else:
            specs += [matrix(blk + "attn_q.weight", (q_dim, d)), matrix(blk + "attn_k.weight", (kv_dim, d)),
                      matrix(blk + "attn_v.weight", (kv_dim, d))]
        specs += [matrix(blk + "attn_output.weight", (d, q_dim)), vector(blk + "ffn_norm.weight", d),
                  matrix(blk + "ffn_up.weight", (2 * cfg.n_ff, d)), matrix(blk + "ffn_down.weight", (d, cfg.n_ff))]
    return specs


def longrope_factors(gguf_file, cfg: Phi3Config, n_ctx: int):
    """The per-pair divisors llama.cpp's get_rope_factors picks: rope_freqs if the file has it, else the long factors
    past the original context and the short ones within it; None without any."""
    specs = [vector(name, cfg.n_rot // 2, optional=True) for name in ("rope_freqs.weight",) + LONGROPE]
    w = load_tensors(gguf_file, specs)
    if w.get("rope_freqs.weight") is not None:
        return None  # LlamaModel's rope already divides by them
    long, short = (w.get(name) for name in LONGROPE)
    if (long is None) != (short is None):
        raise ModelError("phi3 file has only one of rope_factors_long and rope_factors_short")
    if long is None:
        return None
    return long if n_ctx > cfg.rope_scaling.n_ctx_orig else short


class Phi3Model(LlamaModel):
    tensor_specs = staticmethod(tensor_specs)

    def __init__(self, gguf_file, config: Phi3Config, n_ctx: int, n_threads: int, n_batch: int = DEFAULT_N_BATCH,
                 kv_type=None):
        super().__init__(gguf_file, config, n_ctx, n_threads, n_batch, kv_type)
        factors = longrope_factors(gguf_file, config, self.n_ctx)
        if factors is not None:
            self.rope = ops.Rope(config.n_rot, config.rope_base, config.rope_freq_scale, factors, config.rope_scaling)

"""Shared transformer ops: each Numba kernel sits beside a plain numpy reference that tests compare it with.

The kernels round exactly as llama.cpp's CPU backend does (x86 AVX2/FMA and AArch64 builds, flash attention off,
its default): the same exp polynomial, float64 sums where it sums in float64, FMAs where it uses them, float16
roundings where it converts, and its summation orders. The models are chaotic enough that a last-bit
difference in one op moves later logits by tenths (docs/exactness.md), so matching llama.cpp means matching its
arithmetic, op by op; tests/test_ops_llama_exact.py checks each op against values dumped from llama.cpp.
Kernels write into caller-provided buffers (decoding allocates nothing); references return new arrays.
Shapes follow the model: activations are [T, ...] with T the tokens of the current batch.

  exp.py                llama.cpp's vectorisable float32 exp
  norms.py              RMSNorm and the fused residual + norm kernels
  rope.py               rotary embedding: angle tables (linear, per-pair, YaRN scaling) and the rotation
  cache_write.py        from the q/k/v projections to the KV cache (biases, q/k norms, rope, store)
  attention_scalar.py   attention in llama.cpp's summation orders, scalar, any cache type, capped scores, sinks
  attention_vec.py      one query row in 8-float vectors (f16/f32 caches)
  attention_rows.py     four query rows of a head together (prompt batches)
  attention_heads.py    one row's query heads that share a KV head together (batched decoding)
  attention_drivers.py  attention() / finish_attention_rows() / finish_attention_run(): scratch, kernel choice,
                        work items, the reference
  activations.py        SwiGLU, GeGLU (llama.cpp's GELU table), gpt-oss's clamped SwiGLU and the logit softcap

The models call these as ops.<name> through this package (the profiler swaps that name for timed stand-ins).
"""

from edgellm.quant import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from edgellm.engine.ops.exp import EXP_INV_LN2, EXP_LN2_HI, EXP_LN2_LO, EXP_POLY, EXP_SHIFT, fast_exp, fast_exp_array
from edgellm.engine.ops.norms import (NORM_ADD, NORM_PARALLEL_MIN_ROWS, NORM_PLAIN, NORM_POST, NORM_ROWS_PER_ITEM,
                                      add_post_norm, add_rms_norm, bound_add_post_norm, bound_add_rms_norm,
                                      bound_rms_norm, rms_norm, rms_norm_ref, rms_scale)
from edgellm.engine.ops.rope import (YARN_RAMP_MIN_WIDTH, Rope, apply_rope, rope_inv_freq, rope_mscale_ref, rope_ref,
                                     rope_tables, yarn_corr_dims_ref)
from edgellm.engine.ops.cache_write import NO_SCALES, finish_qkv, kv_store
from edgellm.engine.ops.attention_scalar import LANES_BATCH, LANES_SINGLE
from edgellm.engine.ops.attention_vec import KEY_PREFETCH_SLOTS, WEIGH_BLOCK_SLOTS
from edgellm.engine.ops.attention_rows import ROWS
from edgellm.engine.ops.attention_drivers import (ATTENTION_PARALLEL_MIN_WORK, attention, attention_ref,
                                                  attention_rows_supported, attention_scratch, attention_scratch_width,
                                                  bound_decode_attention, finish_attention_rows, finish_attention_run)
from edgellm.engine.ops.activations import (ACTIVATION_PARALLEL_MIN_ROWS, GELU_COEF_A, SQRT_2_OVER_PI,
                                            SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, bound_gelu_tanh_mul, bound_silu_mul,
                                            gelu_table, gelu_tanh_mul, gelu_tanh_mul_ref, silu_mul, silu_mul_ref,
                                            softcap, softcap_ref, swiglu_oai, swiglu_oai_ref)

__all__ = ["ACTIVATION_PARALLEL_MIN_ROWS", "ATTENTION_PARALLEL_MIN_WORK", "EXP_INV_LN2", "EXP_LN2_HI", "EXP_LN2_LO",
           "EXP_POLY", "EXP_SHIFT", "GELU_COEF_A", "KEY_PREFETCH_SLOTS", "LANES_BATCH", "LANES_SINGLE", "NORM_ADD",
           "NORM_PARALLEL_MIN_ROWS", "NORM_PLAIN", "NORM_POST", "NORM_ROWS_PER_ITEM", "NO_SCALES", "ROWS",
           "Rope", "SQRT_2_OVER_PI", "WEIGH_BLOCK_SLOTS", "YARN_RAMP_MIN_WIDTH", "add_post_norm", "add_rms_norm",
           "apply_rope", "attention", "attention_ref", "attention_rows_supported", "bound_add_post_norm",
           "bound_add_rms_norm", "bound_decode_attention", "bound_gelu_tanh_mul", "bound_rms_norm", "bound_silu_mul",
           "attention_scratch", "attention_scratch_width", "fast_exp", "fast_exp_array", "finish_qkv",
           "finish_attention_rows", "finish_attention_run", "gelu_table", "gelu_tanh_mul", "gelu_tanh_mul_ref",
           "kv_store", "rms_norm",
           "rms_norm_ref", "rms_scale", "rope_inv_freq", "rope_mscale_ref", "rope_ref", "rope_tables", "silu_mul",
           "silu_mul_ref", "softcap", "softcap_ref", "SWIGLU_OAI_ALPHA", "SWIGLU_OAI_LIMIT", "swiglu_oai",
           "swiglu_oai_ref",
           "yarn_corr_dims_ref"]

"""Numba activation quantization for the integer kernels; bit-exact with quant.reference.quantize_act_*.

Q8_0-style (32 per block) feeds the 32-element block formats, Q8_K-style (256 per block, with int sums of each 16)
feeds the K-quants. No fastmath: the int8 values and scales must be exactly the reference's (and llama.cpp's,
whose matmuls these reproduce bit for bit).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
from .simd import absmax_f32x32, quantize_f32x16_clamped, quantize_f32x32, round_f16

_F32 = np.float32

# Activations are quantized in a parallel region of their own from this many tokens on; below, serially in the
# caller (a region's start and join cost more than quantizing a few tokens: T = 8 matmuls 5-20% faster).
PARALLEL_QUANTIZE_TOKENS = 32


@njit(cache=True)
def quantize_act_q8_0(x, xq, xd, xs):
    """x f32[n] -> xq int8[n], xd f32[n/32] (scale), xs f32[n/32] (scale * sum of the block's quants); xd and xs
    hold float16 values."""
    for b in range(x.shape[0] // 32):
        amax = absmax_f32x32(x, b * 32)
        d = amax / _F32(127)
        inv = _F32(127) / amax if amax != 0 else _F32(0)
        total = quantize_f32x32(x, b * 32, inv, xq, b * 32)
        xd[b] = round_f16(d)  # llama.cpp's block_q8_0 / block_q8_1 store d and s as float16
        xs[b] = round_f16(d * _F32(total))


@njit(cache=True)
def quantize_act_q8_k(x, xq, xd, bsums, positive_wins=False):
    """x f32[n] -> xq int8[n], xd f32[n/256], bsums int32[n/16] (sum of each 16 quants).
    The scale's sign follows the first value of largest magnitude (llama.cpp's quantize_row_q8_K), or with
    positive_wins that of +max|x| whenever it occurs (its 4-row quantize_mat_q8_K_4x8, which feeds the repacked
    Q4_K gemm); the two differ only when +max|x| and -max|x| both occur."""
    for b in range(x.shape[0] // 256):
        o = b * 256
        amax = absmax_f32x32(x, o)
        for k in range(o + 32, o + 256, 32):
            amax = max(amax, absmax_f32x32(x, k))
        vmax = _F32(0)
        for j in range(o, o + 256):  # the first value of that magnitude gives the sign
            if abs(x[j]) == amax:
                vmax = x[j]
                break
        if amax == 0:
            xd[b] = 0
            xq[o:o + 256] = 0
            bsums[b * 16:b * 16 + 16] = 0
            continue
        if positive_wins:
            for j in range(o, o + 256):
                if x[j] == amax:
                    vmax = amax
                    break
        iscale = _F32(-127) / vmax
        for g in range(16):
            bsums[b * 16 + g] = quantize_f32x16_clamped(x, o + 16 * g, iscale, xq, o + 16 * g)
        xd[b] = _F32(1) / iscale

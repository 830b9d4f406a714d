"""Numba activation quantization for the integer kernels; bit-exact with quant.reference.quantize_act_*.

Q8_0-style (32 per block) feeds the legacy formats, Q8_K-style (256 per block, with int sums of each 16)
feeds the K-quants. No fastmath: the int8 values and scales must be exactly the reference's (and llama.cpp's,
whose matmuls these reproduce bit for bit).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
from .simd import round_f16

_F32 = np.float32

# Activations are quantized in a parallel region of their own from this many tokens on; below, serially in the
# caller (a region's start and join cost more than quantizing a few tokens: T = 8 matmuls 5-20% faster).
PARALLEL_QUANTIZE_TOKENS = 32


@njit(cache=True)
def quantize_act_q8_0(x, xq, xd, xs):
    """x f32[n] -> xq int8[n], xd f32[n/32] (scale), xs f32[n/32] (scale * sum of the block's quants); xd and xs
    hold float16 values."""
    for b in range(x.shape[0] // 32):
        amax = _F32(0)
        for j in range(b * 32, b * 32 + 32):
            amax = max(amax, abs(x[j]))
        d = amax / _F32(127)
        inv = _F32(127) / amax if amax != 0 else _F32(0)
        total = 0
        for j in range(b * 32, b * 32 + 32):
            q = np.int32(np.rint(x[j] * inv))
            xq[j] = q
            total += q
        xd[b] = round_f16(d)  # llama.cpp's block_q8_0 / block_q8_1 store d and s as float16
        xs[b] = round_f16(d * _F32(total))


@njit(cache=True)
def quantize_act_q8_k(x, xq, xd, bsums, positive_wins=False):
    """x f32[n] -> xq int8[n], xd f32[n/256], bsums int32[n/16] (sum of each 16 quants).
    The scale's sign follows the first value of largest magnitude (llama.cpp's quantize_row_q8_K), or with
    positive_wins that of +max|x| whenever it occurs (its 4-row quantize_mat_q8_K_4x8, which feeds the repacked
    Q4_K gemm); the two differ only when +max|x| and -max|x| both occur."""
    for b in range(x.shape[0] // 256):
        amax = _F32(0)
        vmax = _F32(0)
        for j in range(b * 256, b * 256 + 256):
            if abs(x[j]) > amax:
                amax = abs(x[j])
                vmax = x[j]
        if amax == 0:
            xd[b] = 0
            xq[b * 256:b * 256 + 256] = 0
            bsums[b * 16:b * 16 + 16] = 0
            continue
        if positive_wins:
            for j in range(b * 256, b * 256 + 256):
                if x[j] == amax:
                    vmax = amax
        iscale = _F32(-127) / vmax
        for g in range(16):
            total = 0
            for j in range(b * 256 + g * 16, b * 256 + g * 16 + 16):
                q = max(np.int32(-128), min(np.int32(127), np.int32(np.rint(x[j] * iscale))))
                xq[j] = q
                total += q
            bsums[b * 16 + g] = total
        xd[b] = _F32(1) / iscale

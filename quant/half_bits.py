"""Writing half-precision scales into quantized blocks: the two helpers every block quantizer uses, in a module of
their own so that the IQ4 formats' kernel modules (imported with any model's matmul drivers) need not import the
block quantizers of every format."""
from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True)
def _f16_bits(v):
    """float32 -> IEEE half bits, round to nearest even (GGML_FP32_TO_FP16, numpy's astype(float16))."""
    if v != v:
        return 0x7E00
    sign = 0x8000 if math.copysign(1.0, v) < 0 else 0
    a = abs(np.float64(v))
    if a >= 65520.0:  # halfway between the largest half (65504) and 2^16 rounds to even, i.e. to inf
        return sign | 0x7C00
    if a < 6.103515625e-05:  # subnormal half: a multiple of 2^-24 (1024 * 2^-24 is the smallest normal)
        return sign | int(np.rint(a * 16777216.0))
    m, e = math.frexp(a)  # a = m * 2^e, 0.5 <= m < 1: exponent e - 1, mantissa (2m - 1) * 1024, both exact
    return sign | (((e + 14) << 10) + int(np.rint(m * 2048.0 - 1024.0)))


@njit(cache=True, inline="always")
def _put_u16(out, o, bits):
    out[o] = bits & 0xFF
    out[o + 1] = (bits >> 8) & 0xFF

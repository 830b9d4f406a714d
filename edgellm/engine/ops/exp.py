"""exp in float32 as llama.cpp computes it (ggml_v_expf, from Arm's optimized-routines expf), for the softmax and
SiLU: n = round(x / ln2) by adding 1.5 * 2^23, b = x - n ln2 in two FMA steps (ln2 split in a high and a low part),
a degree-5 polynomial in b, and 2^n built in the exponent bits; |n| > 126 takes a path that scales in two steps, so
large negative x underflow to 0 and large positive x overflow to inf. Within 1.5 ulp of exp, and branch-light, so
LLVM vectorises loops over it (libm's exp is called one value at a time).
"""

import numpy as np
from numba import njit

from edgellm.quant.simd import f32_bits, f32_shl23_add, fma32

EXP_SHIFT = np.float32(float.fromhex("0x1.8p23"))
EXP_INV_LN2 = np.float32(float.fromhex("0x1.715476p+0"))
EXP_LN2_HI, EXP_LN2_LO = np.float32(float.fromhex("0x1.62e4p-1")), np.float32(float.fromhex("0x1.7f7d1cp-20"))
EXP_POLY = tuple(np.float32(float.fromhex(c)) for c in
                 ("0x1.ffffecp-1", "0x1.fffdb6p-2", "0x1.555e66p-3", "0x1.573e2ep-5", "0x1.0e4020p-7"))
_P1, _P2, _P3, _P4, _P5 = EXP_POLY
_ONE_BITS = 0x3F800000
# |n| > 126 builds 2^n in two factors: for n <= 0, (n + 125 in the exponent) * 2^-125, else (n - 127) * 2^127
_TINY_FACTOR_ADD, _TINY_S1 = 0x7E000000, np.float32(2.0 ** -125)
_BIG_S1 = np.float32(2.0 ** 127)


@njit(cache=True, error_model="numpy", inline="always")
def fast_exp(x):
    x = np.float32(x)
    z = fma32(x, EXP_INV_LN2, EXP_SHIFT)
    n = z - EXP_SHIFT
    b = fma32(-n, EXP_LN2_LO, fma32(-n, EXP_LN2_HI, x))
    zb = f32_bits(z)  # n in its low bits; shifted into the exponent field in 32-bit arithmetic (f32_shl23_add)
    u = b * b
    j = fma32(fma32(fma32(_P5, b, _P4), u, fma32(_P3, b, _P2)), u, _P1 * b)
    k = f32_shl23_add(zb, _ONE_BITS)
    normal = fma32(j, k, k)
    # |n| > 126: 2^n in two factors (kg * s1), or over/underflow past 192; selects, not branches, so that loops
    # over fast_exp vectorise. Every lane computes the far path, so a lane that does not take it gets kg = 1.0:
    # with its own far factors a positive n made kg * j subnormal, and each subnormal result costs a microcode
    # assist that costs far more than the arithmetic (docs/kernels.md). (kg = k, s1 = 1 does not do: LLVM turns the
    # multiply by a select of constants into a select of multiplies, and k * 2^-125 is subnormal for n < 0.)
    big = abs(n)
    far_lane = big > np.float32(126.0)
    tiny = n <= np.float32(0.0)
    s1 = _TINY_S1 if tiny else _BIG_S1
    kg = f32_shl23_add(zb if far_lane else np.uint32(0), (_TINY_FACTOR_ADD if tiny else 0) if far_lane else _ONE_BITS)
    scaled = fma32(kg, j, kg) * s1
    far = s1 * s1 if big > np.float32(192.0) else scaled
    return far if far_lane else normal


@njit(cache=True, error_model="numpy")
def fast_exp_array(x, out):
    """For tests: out[i] = fast_exp(x[i])."""
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])

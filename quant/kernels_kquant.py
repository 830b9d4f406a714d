"""Integer matmul kernels for the K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K.

Same scheme as the 32-element formats (quant.dots_block32) over 256-element super-blocks, with Q8_K-style
activations (int8, one float scale per 256, int sums of each 16 for the mins). Within a super-block everything
is integer, as in llama.cpp's vec_dot_<fmt>_q8_K: sub-block scales multiply int32 lanes, the super-block's
lanes are scaled by d_w * d_x once, and the mins term dmin * d_x * sum(m_s * bsum_s) is accumulated apart and
subtracted at the end of the row.

Each format supplies `_group_<fmt>(w, o, g)` (here): quants 32g..32g+31 of the super-block at byte o as
I8x32, with the scales and mins of its two 16-element halves, and `_scales_<fmt>` (d, dmin). Around them,
in quant.matmul_kquant, per format (the same few lines, written out because Numba's cache cannot take
functions as arguments):
  _superblock_<fmt>   one super-block x one token                       (decode path, T < 4)
  _decode_<fmt>       one super-block -> int8 quants + int scales/mins  (prompt path, reused by 4 tokens)
  vec_dot_<fmt>_q8_k  one row x one token
  matmul_<fmt>(w, row_bytes, x, xq, xd, bsums, out), same contract as quant.matmul_block32
      (xq int8[T*n_in], xd f32[T*n_in/256], bsums int32[T*n_in/16] are scratch).
For T >= 4 rows are decoded ROW_CHUNK at a time into a per-chunk buffer and `gemm_decoded` (here) runs the
same integer lanes and float steps per token as vec_dot, four tokens per decoded group, so matmul rows
equal matvec bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .activations import PARALLEL_QUANTIZE_TOKENS, quantize_act_q8_k
from .kernels_dequant import k_scale_min, q3_k_scale
from .simd import (dot_i8x32_2scales, f32x8_fma_i32, f32x8_hsum, f32x8_zero, i8x32_and, i8x32_or, i8x32_shl,
                   i8x32_shr, i8x32_sub, i8x32_xor, i32x8_add, i32x8_hsum, i32x8_mul, i32x8_zero, load_f16, load_f32,
                   load_i8, load_i8x32, load_i32, load_i32x8, load_u8)

_F32 = np.float32
TOKEN_TILE = 4
ROW_CHUNK = 16


@njit(cache=True)
def _quantize_token(x, xq, xd, bsums, t, positive_wins):
    n_in = x.shape[1]
    quantize_act_q8_k(x[t], xq[t * n_in:(t + 1) * n_in], xd[t * (n_in // 256):(t + 1) * (n_in // 256)],
                      bsums[t * (n_in // 16):(t + 1) * (n_in // 16)], positive_wins)


NO_KINDS = np.zeros(0, np.int8)


@njit(parallel=True, cache=True)
def _quantize_tokens_parallel(x, xq, xd, bsums, positive):
    for t in prange(x.shape[0]):
        _quantize_token(x, xq, xd, bsums, t, t < positive.shape[0] and positive[t] != 0)


@njit(cache=True)
def _quantize_tokens(x, xq, xd, bsums, positive=NO_KINDS):
    """Q8_K activations of every token; tokens with positive[t] != 0 by quantize_act_q8_k's positive_wins rule."""
    if x.shape[0] < PARALLEL_QUANTIZE_TOKENS:
        for t in range(x.shape[0]):
            _quantize_token(x, xq, xd, bsums, t, t < positive.shape[0] and positive[t] != 0)
    else:
        _quantize_tokens_parallel(x, xq, xd, bsums, positive)


# --- the formats -------------------------------------------------------------------------------------------
# Q2_K: scales[16] (low nibble scale, high nibble min) | qs[64] 2-bit | d | dmin                    84 bytes
# Q3_K: hmask[32] | qs[64] 2-bit | scales[12] (16 x 6-bit, -32) | d                                 110 bytes
# Q4_K: d | dmin | scales[12] (8 x 6-bit scale and min) | qs[128] 4-bit                            144 bytes
# Q5_K: d | dmin | scales[12] | qh[32] | qs[128]                                                   176 bytes
# Q6_K: ql[128] 4-bit | qh[64] 2-bit | scales int8[16] | d                                         210 bytes
# Q8_K: d f32 | qs int8[256] | bsums int16[16] (unused here)                                       292 bytes
# 2-bit fields: quant h*128 + 32j + l is bits 2j..2j+1 of byte h*32 + l.


@njit(cache=True, inline="always")
def _group_q2_k(w, o, g):
    h, j = g >> 2, g & 3
    q = i8x32_and(i8x32_shr(load_i8x32(w, o + 16 + 32 * h), 2 * j), 3)
    lo, hi = load_u8(w, o + 2 * g), load_u8(w, o + 2 * g + 1)
    return q, lo & 15, hi & 15, lo >> 4, hi >> 4


@njit(cache=True, inline="always")
def _group_q3_k(w, o, g):
    h, j = g >> 2, g & 3
    low = i8x32_and(i8x32_shr(load_i8x32(w, o + 32 + 32 * h), 2 * j), 3)
    high_clear = i8x32_xor(i8x32_and(i8x32_shr(load_i8x32(w, o), g), 1), 1)  # hmask bit g clear: minus 4
    q = i8x32_sub(low, i8x32_shl(high_clear, 2))
    return q, q3_k_scale(w, o + 96, 2 * g), q3_k_scale(w, o + 96, 2 * g + 1), 0, 0


@njit(cache=True, inline="always")
def _group_q4_k(w, o, g):
    # 32 bytes per pair of groups: low nibbles are group 2i, high nibbles group 2i+1
    q = i8x32_and(i8x32_shr(load_i8x32(w, o + 16 + 32 * (g >> 1)), 4 * (g & 1)), 15)
    sc, mn = k_scale_min(w, o + 4, g)
    return q, sc, sc, mn, mn


@njit(cache=True, inline="always")
def _group_q5_k(w, o, g):
    low = i8x32_and(i8x32_shr(load_i8x32(w, o + 48 + 32 * (g >> 1)), 4 * (g & 1)), 15)
    q = i8x32_or(low, i8x32_shl(i8x32_and(i8x32_shr(load_i8x32(w, o + 16), g), 1), 4))  # bit g of qh[l]
    sc, mn = k_scale_min(w, o + 4, g)
    return q, sc, sc, mn, mn


@njit(cache=True, inline="always")
def _group_q6_k(w, o, g):
    h, j = g >> 2, g & 3  # low 4 bits: nibble j//2 of ql[h*64 + (j%2)*32 + l]; high 2: bits 2j.. of qh[h*32 + l]
    low = i8x32_and(i8x32_shr(load_i8x32(w, o + 64 * h + 32 * (j & 1)), 4 * (j >> 1)), 15)
    high = i8x32_and(i8x32_shr(load_i8x32(w, o + 128 + 32 * h), 2 * j), 3)
    q = i8x32_sub(i8x32_or(low, i8x32_shl(high, 4)), 32)
    return q, load_i8(w, o + 192 + 2 * g), load_i8(w, o + 193 + 2 * g), 0, 0


@njit(cache=True, inline="always")
def _group_q8_k(w, o, g):
    return load_i8x32(w, o + 4 + 32 * g), 1, 1, 0, 0


@njit(cache=True, inline="always")
def _scales_q2_k(w, o):
    return load_f16(w, o + 80), load_f16(w, o + 82)


@njit(cache=True, inline="always")
def _scales_q3_k(w, o):
    return load_f16(w, o + 108), _F32(0)


@njit(cache=True, inline="always")
def _scales_q45_k(w, o):
    return load_f16(w, o), load_f16(w, o + 2)


@njit(cache=True, inline="always")
def _scales_q6_k(w, o):
    return load_f16(w, o + 208), _F32(0)


@njit(cache=True, inline="always")
def _scales_q8_k(w, o):
    return load_f32(w, o), _F32(0)


# --- shared pieces -------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _accumulate(acc, mins, isum, msum, d, dmin, dx):
    return f32x8_fma_i32(acc, isum, d * dx), mins + dmin * dx * _F32(msum)


@njit(cache=True)
def _row_chunk_buffers(n_in):
    nsb = n_in // 256
    return (np.empty(ROW_CHUNK * n_in, np.int8), np.empty(ROW_CHUNK * n_in // 16, np.int32),
            np.empty(ROW_CHUNK * n_in // 16, np.int32), np.empty(ROW_CHUNK * nsb, np.float32),
            np.empty(ROW_CHUNK * nsb, np.float32))


@njit(cache=True, inline="always")
def _decoded_mins(mins, so, bsums, bo):
    """sum over the super-block's 16 sub-blocks of min * activation sum (exact, as the scalar loop)."""
    lo = i32x8_mul(load_i32x8(mins, so), load_i32x8(bsums, bo))
    return i32x8_hsum(i32x8_add(lo, i32x8_mul(load_i32x8(mins, so + 8), load_i32x8(bsums, bo + 8))))


@njit(cache=True, inline="always")
def _decoded_dot(qbuf, qo, scales, xq, xo):
    isum = i32x8_zero()
    for g in range(8):
        isum = i32x8_add(isum, dot_i8x32_2scales(load_i8x32(qbuf, qo + 32 * g), load_i8x32(xq, xo + 32 * g),
                                                 load_i32(scales, qo // 16 + 2 * g),
                                                 load_i32(scales, qo // 16 + 2 * g + 1)))
    return isum


@njit(cache=True)
def _gemm_row_one_token(qbuf, scales, mins, dd, dmins, i, t, xq, xd, bsums):
    n_in = qbuf.shape[0] // ROW_CHUNK
    nsb = n_in // 256
    acc, total_mins = f32x8_zero(), _F32(0)
    for b in range(nsb):
        qo, xo = i * n_in + 256 * b, t * n_in + 256 * b
        dmin = load_f32(dmins, i * nsb + b)
        msum = _decoded_mins(mins, qo // 16, bsums, xo // 16) if dmin != 0 else 0
        acc, total_mins = _accumulate(acc, total_mins, _decoded_dot(qbuf, qo, scales, xq, xo), msum,
                                      load_f32(dd, i * nsb + b), dmin, load_f32(xd, t * nsb + b))
    return f32x8_hsum(acc) - total_mins


@njit(cache=True)
def _gemm_row_four_tokens(qbuf, scales, mins, dd, dmins, i, t, xq, xd, bsums):
    """_gemm_row_one_token for tokens t..t+3, each decoded group loaded once for the four."""
    n_in = qbuf.shape[0] // ROW_CHUNK
    nsb = n_in // 256
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    m0 = m1 = m2 = m3 = _F32(0)
    for b in range(nsb):
        qo, xo = i * n_in + 256 * b, t * n_in + 256 * b
        s0, s1, s2, s3 = i32x8_zero(), i32x8_zero(), i32x8_zero(), i32x8_zero()
        for g in range(8):
            q = load_i8x32(qbuf, qo + 32 * g)
            lo, hi = load_i32(scales, qo // 16 + 2 * g), load_i32(scales, qo // 16 + 2 * g + 1)
            s0 = i32x8_add(s0, dot_i8x32_2scales(q, load_i8x32(xq, xo + 32 * g), lo, hi))
            s1 = i32x8_add(s1, dot_i8x32_2scales(q, load_i8x32(xq, xo + n_in + 32 * g), lo, hi))
            s2 = i32x8_add(s2, dot_i8x32_2scales(q, load_i8x32(xq, xo + 2 * n_in + 32 * g), lo, hi))
            s3 = i32x8_add(s3, dot_i8x32_2scales(q, load_i8x32(xq, xo + 3 * n_in + 32 * g), lo, hi))
        d, dmin, xb = load_f32(dd, i * nsb + b), load_f32(dmins, i * nsb + b), t * nsb + b
        n0 = n1 = n2 = n3 = 0
        if dmin != 0:
            n0 = _decoded_mins(mins, qo // 16, bsums, xo // 16)
            n1 = _decoded_mins(mins, qo // 16, bsums, (xo + n_in) // 16)
            n2 = _decoded_mins(mins, qo // 16, bsums, (xo + 2 * n_in) // 16)
            n3 = _decoded_mins(mins, qo // 16, bsums, (xo + 3 * n_in) // 16)
        a0, m0 = _accumulate(a0, m0, s0, n0, d, dmin, load_f32(xd, xb))
        a1, m1 = _accumulate(a1, m1, s1, n1, d, dmin, load_f32(xd, xb + nsb))
        a2, m2 = _accumulate(a2, m2, s2, n2, d, dmin, load_f32(xd, xb + 2 * nsb))
        a3, m3 = _accumulate(a3, m3, s3, n3, d, dmin, load_f32(xd, xb + 3 * nsb))
    return f32x8_hsum(a0) - m0, f32x8_hsum(a1) - m1, f32x8_hsum(a2) - m2, f32x8_hsum(a3) - m3


@njit(cache=True)
def gemm_decoded(qbuf, scales, mins, dd, dmins, n_rows, r0, xq, xd, bsums, out):
    """out[t, r0 + i] for decoded rows i < n_rows and all tokens; per token the same steps as vec_dot."""
    n_tokens = out.shape[0]
    full = n_tokens - n_tokens % TOKEN_TILE
    for i in range(n_rows):
        for t in range(0, full, TOKEN_TILE):
            out[t, r0 + i], out[t + 1, r0 + i], out[t + 2, r0 + i], out[t + 3, r0 + i] = _gemm_row_four_tokens(
                qbuf, scales, mins, dd, dmins, i, t, xq, xd, bsums)
        for t in range(full, n_tokens):
            out[t, r0 + i] = _gemm_row_one_token(qbuf, scales, mins, dd, dmins, i, t, xq, xd, bsums)

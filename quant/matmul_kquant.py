"""Per-format K-quant row dots and matmul drivers, built from the pieces in quant.kernels_kquant.

Each format has the same four functions, differing only in the `_group_<fmt>` / `_scales_<fmt>` they call
and the block size in bytes (Numba's on-disk cache cannot take functions as arguments, so they are written
out). See kernels_kquant for the scheme and the matmul contract.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .kernels_kquant import (ROW_CHUNK, TOKEN_TILE, _accumulate, _group_q2_k, _group_q3_k, _group_q4_k,
                             _group_q5_k, _group_q6_k, _group_q8_k, _quantize_tokens, _row_chunk_buffers,
                             _scales_q2_k, _scales_q3_k, _scales_q6_k, _scales_q8_k, _scales_q45_k, gemm_decoded)
from .simd import (dot_i8x32_2scales, dot_u8x32_2scales, f32x8_hsum, f32x8_zero, i32x8_add, i32x8_zero, load_f32,
                   load_i8x32, load_i32, store_i8x32)

_F32 = np.float32

# --- Q2_K ---------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _superblock_q2_k(w, o, xq, xo, bsums, bo):
    isum, msum = i32x8_zero(), 0
    for g in range(8):
        q, s0, s1, m0, m1 = _group_q2_k(w, o, g)
        isum = i32x8_add(isum, dot_u8x32_2scales(q, load_i8x32(xq, xo + 32 * g), s0, s1))
        msum += m0 * load_i32(bsums, bo + 2 * g) + m1 * load_i32(bsums, bo + 2 * g + 1)
    return isum, msum


@njit(cache=True)
def _decode_q2_k(w, o, qbuf, qo, scales, mins, so):
    for g in range(8):
        q, scales[so + 2 * g], scales[so + 2 * g + 1], mins[so + 2 * g], mins[so + 2 * g + 1] = _group_q2_k(w, o, g)
        store_i8x32(qbuf, qo + 32 * g, q)
    return _scales_q2_k(w, o)


@njit(cache=True)
def vec_dot_q2_k_q8_k(w, o, nsb, xq, xo, xd, bsums):
    acc, mins = f32x8_zero(), _F32(0)
    for b in range(nsb):
        isum, msum = _superblock_q2_k(w, o + 84 * b, xq, xo + 256 * b, bsums, (xo + 256 * b) // 16)
        d, dmin = _scales_q2_k(w, o + 84 * b)
        acc, mins = _accumulate(acc, mins, isum, msum, d, dmin, load_f32(xd, xo // 256 + b))
    return f32x8_hsum(acc) - mins


@njit(parallel=True, cache=True)
def matmul_q2_k(w, row_bytes, x, xq, xd, bsums, out):
    _quantize_tokens(x, xq, xd, bsums)
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    if n_tokens < TOKEN_TILE:
        for r in prange(n_out):
            for t in range(n_tokens):
                out[t, r] = vec_dot_q2_k_q8_k(w, r * row_bytes, nsb, xq, t * n_in, xd, bsums)
    else:
        for c in prange((n_out + ROW_CHUNK - 1) // ROW_CHUNK):
            qbuf, scales, mins, dd, dmins = _row_chunk_buffers(n_in)
            r0 = c * ROW_CHUNK
            n_rows = min(ROW_CHUNK, n_out - r0)
            for i in range(n_rows * nsb):
                qo = (i // nsb) * n_in + 256 * (i % nsb)
                dd[i], dmins[i] = _decode_q2_k(w, (r0 + i // nsb) * row_bytes + 84 * (i % nsb), qbuf, qo,
                                               scales, mins, qo // 16)
            gemm_decoded(qbuf, scales, mins, dd, dmins, n_rows, r0, xq, xd, bsums, out)


# --- Q3_K ---------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _superblock_q3_k(w, o, xq, xo, bsums, bo):
    isum, msum = i32x8_zero(), 0
    for g in range(8):
        q, s0, s1, m0, m1 = _group_q3_k(w, o, g)
        isum = i32x8_add(isum, dot_i8x32_2scales(q, load_i8x32(xq, xo + 32 * g), s0, s1))
        msum += m0 * load_i32(bsums, bo + 2 * g) + m1 * load_i32(bsums, bo + 2 * g + 1)
    return isum, msum


@njit(cache=True)
def _decode_q3_k(w, o, qbuf, qo, scales, mins, so):
    for g in range(8):
        q, scales[so + 2 * g], scales[so + 2 * g + 1], mins[so + 2 * g], mins[so + 2 * g + 1] = _group_q3_k(w, o, g)
        store_i8x32(qbuf, qo + 32 * g, q)
    return _scales_q3_k(w, o)


@njit(cache=True)
def vec_dot_q3_k_q8_k(w, o, nsb, xq, xo, xd, bsums):
    acc, mins = f32x8_zero(), _F32(0)
    for b in range(nsb):
        isum, msum = _superblock_q3_k(w, o + 110 * b, xq, xo + 256 * b, bsums, (xo + 256 * b) // 16)
        d, dmin = _scales_q3_k(w, o + 110 * b)
        acc, mins = _accumulate(acc, mins, isum, msum, d, dmin, load_f32(xd, xo // 256 + b))
    return f32x8_hsum(acc) - mins


@njit(parallel=True, cache=True)
def matmul_q3_k(w, row_bytes, x, xq, xd, bsums, out):
    _quantize_tokens(x, xq, xd, bsums)
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    if n_tokens < TOKEN_TILE:
        for r in prange(n_out):
            for t in range(n_tokens):
                out[t, r] = vec_dot_q3_k_q8_k(w, r * row_bytes, nsb, xq, t * n_in, xd, bsums)
    else:
        for c in prange((n_out + ROW_CHUNK - 1) // ROW_CHUNK):
            qbuf, scales, mins, dd, dmins = _row_chunk_buffers(n_in)
            r0 = c * ROW_CHUNK
            n_rows = min(ROW_CHUNK, n_out - r0)
            for i in range(n_rows * nsb):
                qo = (i // nsb) * n_in + 256 * (i % nsb)
                dd[i], dmins[i] = _decode_q3_k(w, (r0 + i // nsb) * row_bytes + 110 * (i % nsb), qbuf, qo,
                                               scales, mins, qo // 16)
            gemm_decoded(qbuf, scales, mins, dd, dmins, n_rows, r0, xq, xd, bsums, out)


# --- Q4_K ---------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _superblock_q4_k(w, o, xq, xo, bsums, bo):
    isum, msum = i32x8_zero(), 0
    for g in range(8):
        q, s0, s1, m0, m1 = _group_q4_k(w, o, g)
        isum = i32x8_add(isum, dot_u8x32_2scales(q, load_i8x32(xq, xo + 32 * g), s0, s1))
        msum += m0 * load_i32(bsums, bo + 2 * g) + m1 * load_i32(bsums, bo + 2 * g + 1)
    return isum, msum


@njit(cache=True)
def _decode_q4_k(w, o, qbuf, qo, scales, mins, so):
    for g in range(8):
        q, scales[so + 2 * g], scales[so + 2 * g + 1], mins[so + 2 * g], mins[so + 2 * g + 1] = _group_q4_k(w, o, g)
        store_i8x32(qbuf, qo + 32 * g, q)
    return _scales_q45_k(w, o)


@njit(cache=True)
def vec_dot_q4_k_q8_k(w, o, nsb, xq, xo, xd, bsums):
    acc, mins = f32x8_zero(), _F32(0)
    for b in range(nsb):
        isum, msum = _superblock_q4_k(w, o + 144 * b, xq, xo + 256 * b, bsums, (xo + 256 * b) // 16)
        d, dmin = _scales_q45_k(w, o + 144 * b)
        acc, mins = _accumulate(acc, mins, isum, msum, d, dmin, load_f32(xd, xo // 256 + b))
    return f32x8_hsum(acc) - mins


@njit(parallel=True, cache=True)
def matmul_q4_k(w, row_bytes, x, xq, xd, bsums, out):
    _quantize_tokens(x, xq, xd, bsums)
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    if n_tokens < TOKEN_TILE:
        for r in prange(n_out):
            for t in range(n_tokens):
                out[t, r] = vec_dot_q4_k_q8_k(w, r * row_bytes, nsb, xq, t * n_in, xd, bsums)
    else:
        for c in prange((n_out + ROW_CHUNK - 1) // ROW_CHUNK):
            qbuf, scales, mins, dd, dmins = _row_chunk_buffers(n_in)
            r0 = c * ROW_CHUNK
            n_rows = min(ROW_CHUNK, n_out - r0)
            for i in range(n_rows * nsb):
                qo = (i // nsb) * n_in + 256 * (i % nsb)
                dd[i], dmins[i] = _decode_q4_k(w, (r0 + i // nsb) * row_bytes + 144 * (i % nsb), qbuf, qo,
                                               scales, mins, qo // 16)
            gemm_decoded(qbuf, scales, mins, dd, dmins, n_rows, r0, xq, xd, bsums, out)


# --- Q5_K ---------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _superblock_q5_k(w, o, xq, xo, bsums, bo):
    isum, msum = i32x8_zero(), 0
    for g in range(8):
        q, s0, s1, m0, m1 = _group_q5_k(w, o, g)
        isum = i32x8_add(isum, dot_u8x32_2scales(q, load_i8x32(xq, xo + 32 * g), s0, s1))
        msum += m0 * load_i32(bsums, bo + 2 * g) + m1 * load_i32(bsums, bo + 2 * g + 1)
    return isum, msum


@njit(cache=True)
def _decode_q5_k(w, o, qbuf, qo, scales, mins, so):
    for g in range(8):
        q, scales[so + 2 * g], scales[so + 2 * g + 1], mins[so + 2 * g], mins[so + 2 * g + 1] = _group_q5_k(w, o, g)
        store_i8x32(qbuf, qo + 32 * g, q)
    return _scales_q45_k(w, o)


@njit(cache=True)
def vec_dot_q5_k_q8_k(w, o, nsb, xq, xo, xd, bsums):
    acc, mins = f32x8_zero(), _F32(0)
    for b in range(nsb):
        isum, msum = _superblock_q5_k(w, o + 176 * b, xq, xo + 256 * b, bsums, (xo + 256 * b) // 16)
        d, dmin = _scales_q45_k(w, o + 176 * b)
        acc, mins = _accumulate(acc, mins, isum, msum, d, dmin, load_f32(xd, xo // 256 + b))
    return f32x8_hsum(acc) - mins


@njit(parallel=True, cache=True)
def matmul_q5_k(w, row_bytes, x, xq, xd, bsums, out):
    _quantize_tokens(x, xq, xd, bsums)
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    if n_tokens < TOKEN_TILE:
        for r in prange(n_out):
            for t in range(n_tokens):
                out[t, r] = vec_dot_q5_k_q8_k(w, r * row_bytes, nsb, xq, t * n_in, xd, bsums)
    else:
        for c in prange((n_out + ROW_CHUNK - 1) // ROW_CHUNK):
            qbuf, scales, mins, dd, dmins = _row_chunk_buffers(n_in)
            r0 = c * ROW_CHUNK
            n_rows = min(ROW_CHUNK, n_out - r0)
            for i in range(n_rows * nsb):
                qo = (i // nsb) * n_in + 256 * (i % nsb)
                dd[i], dmins[i] = _decode_q5_k(w, (r0 + i // nsb) * row_bytes + 176 * (i % nsb), qbuf, qo,
                                               scales, mins, qo // 16)
            gemm_decoded(qbuf, scales, mins, dd, dmins, n_rows, r0, xq, xd, bsums, out)


# --- Q6_K ---------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _superblock_q6_k(w, o, xq, xo, bsums, bo):
    isum, msum = i32x8_zero(), 0
    for g in range(8):
        q, s0, s1, m0, m1 = _group_q6_k(w, o, g)
        isum = i32x8_add(isum, dot_i8x32_2scales(q, load_i8x32(xq, xo + 32 * g), s0, s1))
        msum += m0 * load_i32(bsums, bo + 2 * g) + m1 * load_i32(bsums, bo + 2 * g + 1)
    return isum, msum


@njit(cache=True)
def _decode_q6_k(w, o, qbuf, qo, scales, mins, so):
    for g in range(8):
        q, scales[so + 2 * g], scales[so + 2 * g + 1], mins[so + 2 * g], mins[so + 2 * g + 1] = _group_q6_k(w, o, g)
        store_i8x32(qbuf, qo + 32 * g, q)
    return _scales_q6_k(w, o)


@njit(cache=True)
def vec_dot_q6_k_q8_k(w, o, nsb, xq, xo, xd, bsums):
    acc, mins = f32x8_zero(), _F32(0)
    for b in range(nsb):
        isum, msum = _superblock_q6_k(w, o + 210 * b, xq, xo + 256 * b, bsums, (xo + 256 * b) // 16)
        d, dmin = _scales_q6_k(w, o + 210 * b)
        acc, mins = _accumulate(acc, mins, isum, msum, d, dmin, load_f32(xd, xo // 256 + b))
    return f32x8_hsum(acc) - mins


@njit(parallel=True, cache=True)
def matmul_q6_k(w, row_bytes, x, xq, xd, bsums, out):
    _quantize_tokens(x, xq, xd, bsums)
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    if n_tokens < TOKEN_TILE:
        for r in prange(n_out):
            for t in range(n_tokens):
                out[t, r] = vec_dot_q6_k_q8_k(w, r * row_bytes, nsb, xq, t * n_in, xd, bsums)
    else:
        for c in prange((n_out + ROW_CHUNK - 1) // ROW_CHUNK):
            qbuf, scales, mins, dd, dmins = _row_chunk_buffers(n_in)
            r0 = c * ROW_CHUNK
            n_rows = min(ROW_CHUNK, n_out - r0)
            for i in range(n_rows * nsb):
                qo = (i // nsb) * n_in + 256 * (i % nsb)
                dd[i], dmins[i] = _decode_q6_k(w, (r0 + i // nsb) * row_bytes + 210 * (i % nsb), qbuf, qo,
                                               scales, mins, qo // 16)
            gemm_decoded(qbuf, scales, mins, dd, dmins, n_rows, r0, xq, xd, bsums, out)


# --- Q8_K ---------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _superblock_q8_k(w, o, xq, xo, bsums, bo):
    isum, msum = i32x8_zero(), 0
    for g in range(8):
        q, s0, s1, m0, m1 = _group_q8_k(w, o, g)
        isum = i32x8_add(isum, dot_i8x32_2scales(q, load_i8x32(xq, xo + 32 * g), s0, s1))
        msum += m0 * load_i32(bsums, bo + 2 * g) + m1 * load_i32(bsums, bo + 2 * g + 1)
    return isum, msum


@njit(cache=True)
def _decode_q8_k(w, o, qbuf, qo, scales, mins, so):
    for g in range(8):
        q, scales[so + 2 * g], scales[so + 2 * g + 1], mins[so + 2 * g], mins[so + 2 * g + 1] = _group_q8_k(w, o, g)
        store_i8x32(qbuf, qo + 32 * g, q)
    return _scales_q8_k(w, o)


@njit(cache=True)
def vec_dot_q8_k_q8_k(w, o, nsb, xq, xo, xd, bsums):
    acc, mins = f32x8_zero(), _F32(0)
    for b in range(nsb):
        isum, msum = _superblock_q8_k(w, o + 292 * b, xq, xo + 256 * b, bsums, (xo + 256 * b) // 16)
        d, dmin = _scales_q8_k(w, o + 292 * b)
        acc, mins = _accumulate(acc, mins, isum, msum, d, dmin, load_f32(xd, xo // 256 + b))
    return f32x8_hsum(acc) - mins


@njit(parallel=True, cache=True)
def matmul_q8_k(w, row_bytes, x, xq, xd, bsums, out):
    _quantize_tokens(x, xq, xd, bsums)
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    if n_tokens < TOKEN_TILE:
        for r in prange(n_out):
            for t in range(n_tokens):
                out[t, r] = vec_dot_q8_k_q8_k(w, r * row_bytes, nsb, xq, t * n_in, xd, bsums)
    else:
        for c in prange((n_out + ROW_CHUNK - 1) // ROW_CHUNK):
            qbuf, scales, mins, dd, dmins = _row_chunk_buffers(n_in)
            r0 = c * ROW_CHUNK
            n_rows = min(ROW_CHUNK, n_out - r0)
            for i in range(n_rows * nsb):
                qo = (i // nsb) * n_in + 256 * (i % nsb)
                dd[i], dmins[i] = _decode_q8_k(w, (r0 + i // nsb) * row_bytes + 292 * (i % nsb), qbuf, qo,
                                               scales, mins, qo // 16)
            gemm_decoded(qbuf, scales, mins, dd, dmins, n_rows, r0, xq, xd, bsums, out)


MATMUL = {"Q2_K": matmul_q2_k, "Q3_K": matmul_q3_k, "Q4_K": matmul_q4_k, "Q5_K": matmul_q5_k,
          "Q6_K": matmul_q6_k, "Q8_K": matmul_q8_k}

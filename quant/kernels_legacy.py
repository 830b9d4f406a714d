"""Integer matmul kernels for the 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

The weights are read in place, in GGML's own block layout (zero-copy from the mmap). Activations are
quantized to Q8_0-style int8 blocks (quant.activations). Per block, the weight quants are decoded into 32
signed bytes (quant.simd), multiplied with the activation bytes into int32 lanes, and the lanes are scaled
by d_w * d_x into float lanes that are summed once per row: llama.cpp's vec_dot_<fmt>_q8_0 scheme.

Per format:
  _quants_<fmt>(w, o)        the 32 quants of the block at byte o as I8x32 (offset removed)
  vec_dot_<fmt>_q8_0(...)    one row x one token
  vec_dot4_<fmt>_q8_0(...)   one row x four tokens: each weight block is decoded once and used four times
  vec_dot8_q5_0_q8_0(...)    Q5_0 only: eight tokens (its decode costs the most; measured no gain for the others)
  matmul_<fmt>(w, row_bytes, x, xq, xd, xs, out)
      out[t, r] = row r . x[t] for x (T, n_in); T = 1 is decode. xq int8[T*n_in], xd/xs f32[T*n_in/32]
      are caller-provided scratch. One parallel region over blocks of rows (plus one over tokens when T >= 4).
Each token's sum runs in the same order in both vec_dots, so matmul rows equal matvec bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .activations import quantize_act_q8_0
from .simd import (dot_i8x32, dot_u8x32, f32x8_fma_i32, f32x8_hsum, f32x8_zero, i8x32_or, i8x32_shl,
                   i8x32_sub,
                   load_bits32, load_f16, load_f32, load_i8x32, load_nibbles_lo_hi)

TOKEN_TILE = 4
# Long batches go in blocks of ROW_BLOCK rows x TOKEN_BLOCK tokens, so a block's activations stay in L1 while its
# rows pass over them (Q5_0 2048x640 x 512 tokens: 38 -> 42 GMAC/s on 2 threads); each (row, token) dot is the same.
ROW_BLOCK = 16
TOKEN_BLOCK = 32


@njit(cache=True)
def _quantize_tokens(x, xq, xd, xs):
    n_tokens, n_in = x.shape
    nb = n_in // 32
    if n_tokens < TOKEN_TILE:
        for t in range(n_tokens):
            quantize_act_q8_0(x[t], xq[t * n_in:(t + 1) * n_in], xd[t * nb:(t + 1) * nb], xs[t * nb:(t + 1) * nb])
    else:
        _quantize_tokens_parallel(x, xq, xd, xs)


@njit(parallel=True, cache=True)
def _quantize_tokens_parallel(x, xq, xd, xs):
    n_tokens, n_in = x.shape
    nb = n_in // 32
    for t in prange(n_tokens):
        quantize_act_q8_0(x[t], xq[t * n_in:(t + 1) * n_in], xd[t * nb:(t + 1) * nb], xs[t * nb:(t + 1) * nb])


# --- block decoders ------------------------------------------------------------------------------------------
# Q4_0: d f16 | qs[16]          Q4_1: d | m | qs[16]          Q8_0: d | qs int8[32]
# Q5_0: d | qh u32 | qs[16]     Q5_1: d | m | qh u32 | qs[16]   (bit j of qh is bit 4 of quant j)


@njit(cache=True)
def _quants_q4_0(w, o):
    return i8x32_sub(load_nibbles_lo_hi(w, o + 2), 8)


@njit(cache=True)
def _quants_q4_1(w, o):
    return load_nibbles_lo_hi(w, o + 4)


@njit(cache=True)
def _quants_q5_0(w, o):
    return i8x32_sub(i8x32_or(load_nibbles_lo_hi(w, o + 6), i8x32_shl(load_bits32(w, o + 2), 4)), 16)


@njit(cache=True)
def _quants_q5_1(w, o):
    return i8x32_or(load_nibbles_lo_hi(w, o + 8), i8x32_shl(load_bits32(w, o + 4), 4))


@njit(cache=True)
def _quants_q8_0(w, o):
    return load_i8x32(w, o + 2)


# --- Q4_0 -------------------------------------------------------------------------------------------------


@njit(cache=True)
def vec_dot_q4_0_q8_0(w, o, nb, xq, xo, xd, xdo):
    acc = f32x8_zero()
    for b in range(nb):
        isum = dot_i8x32(_quants_q4_0(w, o), load_i8x32(xq, xo + b * 32))
        acc = f32x8_fma_i32(acc, isum, load_f16(w, o) * load_f32(xd, xdo + b))
        o += 18
    return f32x8_hsum(acc)


@njit(cache=True)
def vec_dot4_q4_0_q8_0(w, o, nb, xq, xo, x_stride, xd, xdo):
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for b in range(nb):
        q, d, k = _quants_q4_0(w, o), load_f16(w, o), xo + b * 32
        a0 = f32x8_fma_i32(a0, dot_i8x32(q, load_i8x32(xq, k)), d * load_f32(xd, xdo + b))
        a1 = f32x8_fma_i32(a1, dot_i8x32(q, load_i8x32(xq, k + x_stride)), d * load_f32(xd, xdo + nb + b))
        a2 = f32x8_fma_i32(a2, dot_i8x32(q, load_i8x32(xq, k + 2 * x_stride)), d * load_f32(xd, xdo + 2 * nb + b))
        a3 = f32x8_fma_i32(a3, dot_i8x32(q, load_i8x32(xq, k + 3 * x_stride)), d * load_f32(xd, xdo + 3 * nb + b))
        o += 18
    return f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3)


@njit(parallel=True, cache=True)
def matmul_q4_0(w, row_bytes, x, xq, xd, xs, out):
    _quantize_tokens(x, xq, xd, xs)
    n_tokens, n_in = x.shape
    nb, full = n_in // 32, n_tokens - n_tokens % TOKEN_TILE
    n_out = out.shape[1]
    for rb in prange((n_out + ROW_BLOCK - 1) // ROW_BLOCK):
        r0, r1 = rb * ROW_BLOCK, min(n_out, rb * ROW_BLOCK + ROW_BLOCK)
        for t0 in range(0, full, TOKEN_BLOCK):
            for r in range(r0, r1):
                for t in range(t0, min(full, t0 + TOKEN_BLOCK), TOKEN_TILE):
                    out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_q4_0_q8_0(
                        w, r * row_bytes, nb, xq, t * n_in, n_in, xd, t * nb)
        for r in range(r0, r1):
            for t in range(full, n_tokens):
                out[t, r] = vec_dot_q4_0_q8_0(w, r * row_bytes, nb, xq, t * n_in, xd, t * nb)


# --- Q4_1: w = d*q + m, so w.x = d*dx*(q.xq) + m*(dx*sum(xq)) -------------------------------------------------


@njit(cache=True)
def vec_dot_q4_1_q8_0(w, o, nb, xq, xo, xd, xs, xdo):
    acc, mins = f32x8_zero(), np.float32(0)
    for b in range(nb):
        isum = dot_u8x32(_quants_q4_1(w, o), load_i8x32(xq, xo + b * 32))
        acc = f32x8_fma_i32(acc, isum, load_f16(w, o) * load_f32(xd, xdo + b))
        mins += load_f16(w, o + 2) * load_f32(xs, xdo + b)
        o += 20
    return f32x8_hsum(acc) + mins


@njit(cache=True)
def vec_dot4_q4_1_q8_0(w, o, nb, xq, xo, x_stride, xd, xs, xdo):
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    m0 = m1 = m2 = m3 = np.float32(0)
    for b in range(nb):
        q, d, m, k = _quants_q4_1(w, o), load_f16(w, o), load_f16(w, o + 2), xo + b * 32
        a0 = f32x8_fma_i32(a0, dot_u8x32(q, load_i8x32(xq, k)), d * load_f32(xd, xdo + b))
        a1 = f32x8_fma_i32(a1, dot_u8x32(q, load_i8x32(xq, k + x_stride)), d * load_f32(xd, xdo + nb + b))
        a2 = f32x8_fma_i32(a2, dot_u8x32(q, load_i8x32(xq, k + 2 * x_stride)), d * load_f32(xd, xdo + 2 * nb + b))
        a3 = f32x8_fma_i32(a3, dot_u8x32(q, load_i8x32(xq, k + 3 * x_stride)), d * load_f32(xd, xdo + 3 * nb + b))
        m0 += m * load_f32(xs, xdo + b)
        m1 += m * load_f32(xs, xdo + nb + b)
        m2 += m * load_f32(xs, xdo + 2 * nb + b)
        m3 += m * load_f32(xs, xdo + 3 * nb + b)
        o += 20
    return f32x8_hsum(a0) + m0, f32x8_hsum(a1) + m1, f32x8_hsum(a2) + m2, f32x8_hsum(a3) + m3


@njit(parallel=True, cache=True)
def matmul_q4_1(w, row_bytes, x, xq, xd, xs, out):
    _quantize_tokens(x, xq, xd, xs)
    n_tokens, n_in = x.shape
    nb, full = n_in // 32, n_tokens - n_tokens % TOKEN_TILE
    n_out = out.shape[1]
    for rb in prange((n_out + ROW_BLOCK - 1) // ROW_BLOCK):
        r0, r1 = rb * ROW_BLOCK, min(n_out, rb * ROW_BLOCK + ROW_BLOCK)
        for t0 in range(0, full, TOKEN_BLOCK):
            for r in range(r0, r1):
                for t in range(t0, min(full, t0 + TOKEN_BLOCK), TOKEN_TILE):
                    out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_q4_1_q8_0(
                        w, r * row_bytes, nb, xq, t * n_in, n_in, xd, xs, t * nb)
        for r in range(r0, r1):
            for t in range(full, n_tokens):
                out[t, r] = vec_dot_q4_1_q8_0(w, r * row_bytes, nb, xq, t * n_in, xd, xs, t * nb)


# --- Q5_0 -------------------------------------------------------------------------------------------------


@njit(cache=True)
def vec_dot_q5_0_q8_0(w, o, nb, xq, xo, xd, xdo):
    acc = f32x8_zero()
    for b in range(nb):
        isum = dot_i8x32(_quants_q5_0(w, o), load_i8x32(xq, xo + b * 32))
        acc = f32x8_fma_i32(acc, isum, load_f16(w, o) * load_f32(xd, xdo + b))
        o += 22
    return f32x8_hsum(acc)


@njit(cache=True)
def vec_dot4_q5_0_q8_0(w, o, nb, xq, xo, x_stride, xd, xdo):
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for b in range(nb):
        q, d, k = _quants_q5_0(w, o), load_f16(w, o), xo + b * 32
        a0 = f32x8_fma_i32(a0, dot_i8x32(q, load_i8x32(xq, k)), d * load_f32(xd, xdo + b))
        a1 = f32x8_fma_i32(a1, dot_i8x32(q, load_i8x32(xq, k + x_stride)), d * load_f32(xd, xdo + nb + b))
        a2 = f32x8_fma_i32(a2, dot_i8x32(q, load_i8x32(xq, k + 2 * x_stride)), d * load_f32(xd, xdo + 2 * nb + b))
        a3 = f32x8_fma_i32(a3, dot_i8x32(q, load_i8x32(xq, k + 3 * x_stride)), d * load_f32(xd, xdo + 3 * nb + b))
        o += 22
    return f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3)


@njit(cache=True)
def vec_dot8_q5_0_q8_0(w, o, nb, xq, xo, x_stride, xd, xdo):
    """vec_dot4 for eight tokens: Q5_0's costlier block decode (the fifth bits) shared by twice as many
    (Q5_0 2048x640 x 512 tokens: 43 -> 50 GMAC/s on 2 threads)."""
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    a4, a5, a6, a7 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    s = x_stride
    for b in range(nb):
        q, d, k = _quants_q5_0(w, o), load_f16(w, o), xo + b * 32
        a0 = f32x8_fma_i32(a0, dot_i8x32(q, load_i8x32(xq, k)), d * load_f32(xd, xdo + b))
        a1 = f32x8_fma_i32(a1, dot_i8x32(q, load_i8x32(xq, k + s)), d * load_f32(xd, xdo + nb + b))
        a2 = f32x8_fma_i32(a2, dot_i8x32(q, load_i8x32(xq, k + 2 * s)), d * load_f32(xd, xdo + 2 * nb + b))
        a3 = f32x8_fma_i32(a3, dot_i8x32(q, load_i8x32(xq, k + 3 * s)), d * load_f32(xd, xdo + 3 * nb + b))
        a4 = f32x8_fma_i32(a4, dot_i8x32(q, load_i8x32(xq, k + 4 * s)), d * load_f32(xd, xdo + 4 * nb + b))
        a5 = f32x8_fma_i32(a5, dot_i8x32(q, load_i8x32(xq, k + 5 * s)), d * load_f32(xd, xdo + 5 * nb + b))
        a6 = f32x8_fma_i32(a6, dot_i8x32(q, load_i8x32(xq, k + 6 * s)), d * load_f32(xd, xdo + 6 * nb + b))
        a7 = f32x8_fma_i32(a7, dot_i8x32(q, load_i8x32(xq, k + 7 * s)), d * load_f32(xd, xdo + 7 * nb + b))
        o += 22
    return (f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3),
            f32x8_hsum(a4), f32x8_hsum(a5), f32x8_hsum(a6), f32x8_hsum(a7))


@njit(parallel=True, cache=True)
def matmul_q5_0(w, row_bytes, x, xq, xd, xs, out):
    _quantize_tokens(x, xq, xd, xs)
    n_tokens, n_in = x.shape
    nb, full8, full = n_in // 32, n_tokens - n_tokens % 8, n_tokens - n_tokens % TOKEN_TILE
    n_out = out.shape[1]
    for rb in prange((n_out + ROW_BLOCK - 1) // ROW_BLOCK):
        r0, r1 = rb * ROW_BLOCK, min(n_out, rb * ROW_BLOCK + ROW_BLOCK)
        for t0 in range(0, full8, TOKEN_BLOCK):
            for r in range(r0, r1):
                for t in range(t0, min(full8, t0 + TOKEN_BLOCK), 8):
                    (out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r], out[t + 4, r], out[t + 5, r],
                     out[t + 6, r], out[t + 7, r]) = vec_dot8_q5_0_q8_0(w, r * row_bytes, nb, xq, t * n_in, n_in,
                                                                        xd, t * nb)
        for r in range(r0, r1):
            for t in range(full8, full, TOKEN_TILE):
                out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_q5_0_q8_0(
                    w, r * row_bytes, nb, xq, t * n_in, n_in, xd, t * nb)
            for t in range(full, n_tokens):
                out[t, r] = vec_dot_q5_0_q8_0(w, r * row_bytes, nb, xq, t * n_in, xd, t * nb)


# --- Q5_1 -------------------------------------------------------------------------------------------------


@njit(cache=True)
def vec_dot_q5_1_q8_0(w, o, nb, xq, xo, xd, xs, xdo):
    acc, mins = f32x8_zero(), np.float32(0)
    for b in range(nb):
        isum = dot_u8x32(_quants_q5_1(w, o), load_i8x32(xq, xo + b * 32))
        acc = f32x8_fma_i32(acc, isum, load_f16(w, o) * load_f32(xd, xdo + b))
        mins += load_f16(w, o + 2) * load_f32(xs, xdo + b)
        o += 24
    return f32x8_hsum(acc) + mins


@njit(cache=True)
def vec_dot4_q5_1_q8_0(w, o, nb, xq, xo, x_stride, xd, xs, xdo):
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    m0 = m1 = m2 = m3 = np.float32(0)
    for b in range(nb):
        q, d, m, k = _quants_q5_1(w, o), load_f16(w, o), load_f16(w, o + 2), xo + b * 32
        a0 = f32x8_fma_i32(a0, dot_u8x32(q, load_i8x32(xq, k)), d * load_f32(xd, xdo + b))
        a1 = f32x8_fma_i32(a1, dot_u8x32(q, load_i8x32(xq, k + x_stride)), d * load_f32(xd, xdo + nb + b))
        a2 = f32x8_fma_i32(a2, dot_u8x32(q, load_i8x32(xq, k + 2 * x_stride)), d * load_f32(xd, xdo + 2 * nb + b))
        a3 = f32x8_fma_i32(a3, dot_u8x32(q, load_i8x32(xq, k + 3 * x_stride)), d * load_f32(xd, xdo + 3 * nb + b))
        m0 += m * load_f32(xs, xdo + b)
        m1 += m * load_f32(xs, xdo + nb + b)
        m2 += m * load_f32(xs, xdo + 2 * nb + b)
        m3 += m * load_f32(xs, xdo + 3 * nb + b)
        o += 24
    return f32x8_hsum(a0) + m0, f32x8_hsum(a1) + m1, f32x8_hsum(a2) + m2, f32x8_hsum(a3) + m3


@njit(parallel=True, cache=True)
def matmul_q5_1(w, row_bytes, x, xq, xd, xs, out):
    _quantize_tokens(x, xq, xd, xs)
    n_tokens, n_in = x.shape
    nb, full = n_in // 32, n_tokens - n_tokens % TOKEN_TILE
    n_out = out.shape[1]
    for rb in prange((n_out + ROW_BLOCK - 1) // ROW_BLOCK):
        r0, r1 = rb * ROW_BLOCK, min(n_out, rb * ROW_BLOCK + ROW_BLOCK)
        for t0 in range(0, full, TOKEN_BLOCK):
            for r in range(r0, r1):
                for t in range(t0, min(full, t0 + TOKEN_BLOCK), TOKEN_TILE):
                    out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_q5_1_q8_0(
                        w, r * row_bytes, nb, xq, t * n_in, n_in, xd, xs, t * nb)
        for r in range(r0, r1):
            for t in range(full, n_tokens):
                out[t, r] = vec_dot_q5_1_q8_0(w, r * row_bytes, nb, xq, t * n_in, xd, xs, t * nb)


# --- Q8_0 -------------------------------------------------------------------------------------------------


@njit(cache=True)
def vec_dot_q8_0_q8_0(w, o, nb, xq, xo, xd, xdo):
    acc = f32x8_zero()
    for b in range(nb):
        isum = dot_i8x32(_quants_q8_0(w, o), load_i8x32(xq, xo + b * 32))
        acc = f32x8_fma_i32(acc, isum, load_f16(w, o) * load_f32(xd, xdo + b))
        o += 34
    return f32x8_hsum(acc)


@njit(cache=True)
def vec_dot4_q8_0_q8_0(w, o, nb, xq, xo, x_stride, xd, xdo):
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for b in range(nb):
        q, d, k = _quants_q8_0(w, o), load_f16(w, o), xo + b * 32
        a0 = f32x8_fma_i32(a0, dot_i8x32(q, load_i8x32(xq, k)), d * load_f32(xd, xdo + b))
        a1 = f32x8_fma_i32(a1, dot_i8x32(q, load_i8x32(xq, k + x_stride)), d * load_f32(xd, xdo + nb + b))
        a2 = f32x8_fma_i32(a2, dot_i8x32(q, load_i8x32(xq, k + 2 * x_stride)), d * load_f32(xd, xdo + 2 * nb + b))
        a3 = f32x8_fma_i32(a3, dot_i8x32(q, load_i8x32(xq, k + 3 * x_stride)), d * load_f32(xd, xdo + 3 * nb + b))
        o += 34
    return f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3)


@njit(parallel=True, cache=True)
def matmul_q8_0(w, row_bytes, x, xq, xd, xs, out):
    _quantize_tokens(x, xq, xd, xs)
    n_tokens, n_in = x.shape
    nb, full = n_in // 32, n_tokens - n_tokens % TOKEN_TILE
    n_out = out.shape[1]
    for rb in prange((n_out + ROW_BLOCK - 1) // ROW_BLOCK):
        r0, r1 = rb * ROW_BLOCK, min(n_out, rb * ROW_BLOCK + ROW_BLOCK)
        for t0 in range(0, full, TOKEN_BLOCK):
            for r in range(r0, r1):
                for t in range(t0, min(full, t0 + TOKEN_BLOCK), TOKEN_TILE):
                    out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_q8_0_q8_0(
                        w, r * row_bytes, nb, xq, t * n_in, n_in, xd, t * nb)
        for r in range(r0, r1):
            for t in range(full, n_tokens):
                out[t, r] = vec_dot_q8_0_q8_0(w, r * row_bytes, nb, xq, t * n_in, xd, t * nb)


MATMUL = {"Q4_0": matmul_q4_0, "Q4_1": matmul_q4_1, "Q5_0": matmul_q5_0, "Q5_1": matmul_q5_1, "Q8_0": matmul_q8_0}

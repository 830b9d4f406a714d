"""Q4_0 matrices of a multiple of 8 rows, as llama.cpp's x86 CPU backend computes them.

On an AVX2 machine llama.cpp repacks every Q4_0 matrix whose row count is a multiple of 8 at load (q4_0_8x8 in
ggml-cpu/repack.cpp) and multiplies it with ggml_gemv_q4_0_8x8_q8_0 (single tokens) and ggml_gemm_q4_0_8x8_q8_0
(groups of four tokens), never with ggml_vec_dot_q4_0_q8_0. Both give each (row, token) the same arithmetic: per
32-value block the exact integer dot of the signed quants (nibble - 8) with the Q8_0 activations, then
acc = fma(float(dot), d_w * d_x, acc), one float32 chain over the blocks in order. The four-token gemm quantizes its
activations as quantize_row_q8_0 does (ggml_quantize_mat_q8_0_4x8: the same scale, the same rounding), so every
token of a batch gives the bits of that token alone. Pure-Q4_0 files, the ones ARM users pick for these repacked
kernels, have such matrices everywhere, the output matrix included.

matmul_q4_0_rows8 follows quant.matmul_block32's contract (w, row_bytes, x, xq, xd, xs, out).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .dots_block32 import PREFETCH_BYTES, _quantize_tokens
from .simd import (dot_i8x32, dot_u8x32, f32x8_fma_lanes, f32x8_mul, f32x8_splat, f32x8_zero, fma32, i8x32_and,
                   i8x32_dup_hi, i8x32_dup_lo, i8x32_or, i8x32_sub, i32x8_add, i32x8_hsum, i32x8_hsum_halves4,
                   i32x8_splat, load_f16, load_f16x8_rows, load_f32, load_i8x32, load_nibbles_lo_hi,
                   load_nibbles_rows2, prefetch, store_f32x8)

_F32 = np.float32


@njit(parallel=True, cache=True)
def matmul_q4_0_rows8(w, row_bytes, x, xq, xd, xs, out):
    _quantize_tokens(x, xq, xd, xs)
    n_tokens, n_in = x.shape
    nb = n_in // 32
    for g in prange(out.shape[1] // 8):
        o = 8 * g * row_bytes
        for t in range(0, n_tokens - 1, 2):  # the eight rows (8 * nb * 18 bytes) stay in cache across the tokens
            a, b = rows8_dot2(w, o, row_bytes, nb, xq, t * n_in, xd, t * nb)
            store_f32x8(out[t], 8 * g, a)
            store_f32x8(out[t + 1], 8 * g, b)
        if n_tokens % 2:
            t = n_tokens - 1
            store_f32x8(out[t], 8 * g, rows8_dot(w, o, row_bytes, nb, xq, t * n_in, xd, t * nb))


@njit(cache=True, inline="always")
def _pair_dots(lo, hi, xlo, xhi):
    """Two rows' block dots from load_nibbles_rows2's vectors and the token's halves twice: row a's four partial
    sums in lanes 0-3, row b's in 4-7. The nibbles are 0..15, so these are the signed quants' dots plus 8 * sum(x),
    taken out once for the eight rows."""
    return i32x8_add(dot_u8x32(lo, xlo), dot_u8x32(hi, xhi))


@njit(cache=True, inline="always")
def _offset(x):
    return i32x8_splat(-8 * i32x8_hsum(dot_u8x32(i8x32_or(i8x32_and(x, 0), 1), x)))  # -8 * sum(x)


@njit(cache=True, inline="always")
def _eight_dots(p01, p23, p45, p67, x):
    """The eight rows' exact block dots with token x (row k in lane k) from their nibble pairs."""
    xlo, xhi = i8x32_dup_lo(x), i8x32_dup_hi(x)
    return i32x8_add(i32x8_hsum_halves4(_pair_dots(p01[0], p01[1], xlo, xhi), _pair_dots(p23[0], p23[1], xlo, xhi),
                                        _pair_dots(p45[0], p45[1], xlo, xhi), _pair_dots(p67[0], p67[1], xlo, xhi)),
                     _offset(x))


@njit(cache=True, inline="always")
def _nibble_pairs(w, ob, row_bytes):
    for k in range(8):  # the same block of the next eight rows, which follow these in the file
        prefetch(w, ob + (8 + k) * row_bytes)
    return (load_nibbles_rows2(w, ob + 2, ob + row_bytes + 2),
            load_nibbles_rows2(w, ob + 2 * row_bytes + 2, ob + 3 * row_bytes + 2),
            load_nibbles_rows2(w, ob + 4 * row_bytes + 2, ob + 5 * row_bytes + 2),
            load_nibbles_rows2(w, ob + 6 * row_bytes + 2, ob + 7 * row_bytes + 2))


@njit(cache=True, inline="always")
def _block_step(acc, pairs, d, xq, xo, xd, xi):
    """acc + the eight rows' block dots with the token's block at xq[xo:], times d_row * xd[xi], one FMA a lane."""
    dots = _eight_dots(pairs[0], pairs[1], pairs[2], pairs[3], load_i8x32(xq, xo))
    return f32x8_fma_lanes(acc, dots, f32x8_mul(d, f32x8_splat(load_f32(xd, xi))))


@njit(cache=True)
def rows8_dot2(w, o, row_bytes, nb, xq, xo, xd, xdo):
    """rows8_dot for two consecutive tokens (xo, xdo: the first one's), each row's nibbles loaded once for both."""
    n_in = 32 * nb
    acc, acc2 = f32x8_zero(), f32x8_zero()
    for b in range(nb):
        ob = o + 18 * b
        pairs, d = _nibble_pairs(w, ob, row_bytes), load_f16x8_rows(w, ob, row_bytes)
        acc = _block_step(acc, pairs, d, xq, xo + 32 * b, xd, xdo + b)
        acc2 = _block_step(acc2, pairs, d, xq, xo + n_in + 32 * b, xd, xdo + nb + b)
    return acc, acc2


@njit(cache=True)
def rows8_dot(w, o, row_bytes, nb, xq, xo, xd, xdo):
    """Eight rows (o: the first one's offset) x one token, row k in lane k: each lane is row_dot_rows8's chain (its
    exact integer dots, the same scale product, one FMA per block), eight of them side by side as the repacked gemv
    keeps them, so no lane waits on another's latency."""
    acc = f32x8_zero()
    for b in range(nb):
        ob = o + 18 * b
        acc = _block_step(acc, _nibble_pairs(w, ob, row_bytes), load_f16x8_rows(w, ob, row_bytes), xq, xo + 32 * b,
                          xd, xdo + b)
    return acc


@njit(cache=True, inline="always")
def row_dot_rows8(w, o, nb, xq, xo, xd, xdo):
    """One row x one token in the repacked gemv's order: one float chain, an FMA per block."""
    acc = _F32(0)
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        dot = i32x8_hsum(dot_i8x32(i8x32_sub(load_nibbles_lo_hi(w, o + 2), 8), load_i8x32(xq, xo + 32 * b)))
        acc = fma32(_F32(dot), load_f16(w, o) * load_f32(xd, xdo + b), acc)
        o += 18
    return acc


def rows8_reference(raw, n_out, n_in, xq, xd):
    """numpy: the float32 results of the chain above for one token's Q8_0 activations (xq int8 [n_in], xd float32
    [n_in / 32], d already rounded to float16): exact integer dots, one FMA per block (float64 holds the product of
    two float32 exactly, so only the sum rounds, and these magnitudes never meet double rounding)."""
    blocks = np.asarray(raw, np.uint8).reshape(n_out, n_in // 32, 18)
    d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    qs = blocks[:, :, 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.int64) - 8
    dots = (q * xq.reshape(1, -1, 32).astype(np.int64)).sum(axis=2)
    out = np.zeros(n_out, np.float32)
    for b in range(n_in // 32):
        scale = (d[:, b] * np.float32(xd[b])).astype(np.float32)
        out = (dots[:, b].astype(np.float32).astype(np.float64) * scale.astype(np.float64) + out).astype(np.float32)
    return out

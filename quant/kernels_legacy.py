"""Integer matmul kernels for the 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

The weights are read in place, in GGML's own block layout (zero-copy from the mmap). Activations are
quantized to Q8_0-style int8 blocks (quant.activations). Per block, the weight quants are decoded into 32
signed bytes (quant.simd), multiplied with the activation bytes into int32 lanes, and the lanes are scaled
by d_w * d_x into float lanes that are summed once per row: llama.cpp's vec_dot_<fmt>_q8_0 scheme.

The row dots (one row x one token, two rows x one token, one row x four tokens, eight-token tiles) are in
quant.dots_legacy; here, per format:
  _row_block_<fmt>(...)      16 rows x all tokens: eight-token tiles, four-token tiles, then single tokens in row pairs
  matmul_<fmt>(w, row_bytes, x, xq, xd, xs, out)
      out[t, r] = row r . x[t] for x (T, n_in); T = 1 is decode. Caller-provided scratch of at least
      xq int8[3*T*n_in], xd f32[6*T*n_in/32], xs f32[T*n_in/32]: the quantized activations token by token, then
      (from T*n_in and T*n_in/32) their copy laid out for the eight-token tiles, and for Q4_1/Q5_1 the single
      tokens' scales and sums in pairs (_pack_pairs), for Q5_0 their lane sums (_pack_lane_sums); from 2*T*n_in,
      for Q4_0 and Q5_0 (and Q8_0 with the 512-bit tiles), the tiles' lane sums (_lane_sums).
      One parallel region over blocks of rows (plus one over tokens when T >= PARALLEL_QUANTIZE_TOKENS).
  matmul3_<fmt>(w0, w1, w2, row_bytes, x, xq, xd, xs, out0, out1, out2)
      the same for two or three matrices on one input (Q, K and V; gate and up): one quantization, one region.
Every (row, token) sum runs in the same order whichever kernel computes it, so matmul rows equal matvec bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .activations import PARALLEL_QUANTIZE_TOKENS, quantize_act_q8_0
from .simd import store_lane_sums, store_pair64
from .dots_legacy import (Q8_0_TILE_OFFSET, vec_dot_q4_0_q8_0, vec_dot2_q4_0_q8_0, vec_dot4_q4_0_q8_0, tile8_q4_0,
                          vec_dot_q4_1_q8_0, vec_dot2_q4_1_q8_0, vec_dot4_q4_1_q8_0, tile8_q4_1, vec_dot_q5_0_q8_0,
                          vec_dot2_q5_0_q8_0, vec_dot4_q5_0_q8_0, tile8_q5_0, vec_dot_q5_1_q8_0, vec_dot2_q5_1_q8_0,
                          vec_dot4_q5_1_q8_0, tile8_q5_1, vec_dot_q8_0_q8_0, vec_dot2_q8_0_q8_0, vec_dot4_q8_0_q8_0,
                          tile8_q8_0)

TOKEN_TILE = 4
# Batches go eight tokens at a time through blocks of ROW_BLOCK rows, so the eight tokens' activations stay in L1
# while the block's rows pass over them; each (row, token) dot is the same whatever the tiling.
ROW_BLOCK = 16


@njit(cache=True)
def _quantize_tokens(x, xq, xd, xs):
    n_tokens, n_in = x.shape
    nb = n_in // 32
    if n_tokens < PARALLEL_QUANTIZE_TOKENS:
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


# --- eight-token tiles -----------------------------------------------------------------------------------------
# vpmaddwd sums within 128-bit lanes, so int32 lanes 0-3 of a block's dot come from its elements 0-15 and lanes 4-7
# from 16-31. Feeding it [w 0-15 | w 0-15] x [token A 0-15 | token B 0-15] gives A's lanes 0-3 next to B's lanes
# 0-3 in one vector; [w 16-31 | w 16-31] x [A 16-31 | B 16-31] gives their lanes 4-7. Both vectors take the same
# per-lane scale vector [d_w*d_A x4 | d_w*d_B x4], one multiply for two tokens instead of a scalar multiply and a
# broadcast per token, and Q4_1/Q5_1's min terms run eight tokens to a vector. Every lane's arithmetic (exact
# integer lanes, d_w*d_x rounded, one FMA per block in block order, the lanes summed in f32x8_hsum's order, then the
# mins) is what vec_dot does for one token, so tiles give matvec's bits.
#
# _pack_tiles8 lays the quantized activations of each group g of eight tokens out as the tiles read them, pair k =
# tokens (A, B) = (8g+2k, 8g+2k+1), block b:
#   xp[((g*nb + b)*4 + k)*64 ...]   A 0-15 | B 0-15 | A 16-31 | B 16-31     (64 int8)
#   xt[(g*nb + b)*8 + j]            d of token 8g+j                         (8 float32, the tiles' scales)
#   xt[n8*nb + (g*nb + b)*8 + j]    s of token 8g+j                         (8 float32, the min terms' sums)
# (a tile multiplies the eight d by d_w at once and spreads them to the pairs' [d_A x4 | d_B x4] by lane copies).


@njit(cache=True)
def _pack_tiles8(xq, xd, xs, n_in, n8, xp, xt):
    nb = n_in // 32
    sums = n8 * nb
    for g in range(n8 // 8):
        for b in range(nb):
            for k in range(4):
                ta, tb = 8 * g + 2 * k, 8 * g + 2 * k + 1
                store_pair64(xp, ((g * nb + b) * 4 + k) * 64, xq, ta * n_in + b * 32, tb * n_in + b * 32)
            for j in range(8):
                xt[(g * nb + b) * 8 + j] = xd[(8 * g + j) * nb + b]
                xt[sums + (g * nb + b) * 8 + j] = xs[(8 * g + j) * nb + b]


@njit(cache=True)
def _pack_pairs(xd, xs, nb, n8, n4, n_tokens, xt):
    """For the two-row dots of the formats with mins (Q4_1, Q5_1): each single token's (d, s) per block side by side,
    token t >= n4 from xt[base + 2 (t - n4) nb], after the eight-token tiles' part of xt. Returns base."""
    base = 2 * n8 * nb
    for t in range(n4, n_tokens):
        for b in range(nb):
            xt[base + 2 * ((t - n4) * nb + b)] = xd[t * nb + b]
            xt[base + 2 * ((t - n4) * nb + b) + 1] = xs[t * nb + b]
    return base


@njit(cache=True)
def _lane_sums(src, mult, dst):
    """dst[k] = mult x (src[4k] + ... + src[4k + 3]) for each int32 lane k of the int8 activations src (whole blocks
    of 32, eight lanes at a time): the starting lanes of a dot whose quants carry an offset -mult
    (simd.dot_u8x32_plus)."""
    for k in range(0, src.shape[0] // 4, 8):
        store_lane_sums(dst, k, src, 4 * k, mult)


@njit(cache=True)
def _pack_lane_sums(xq, nb, n8, n4, n_tokens):
    """For the two-row Q5_0 dot: -16 x the sum of each int32 lane's four activations, for each block of each single
    token (t >= n4), as int32 in the tiles' part of xq, which the tiles leave free from token n8 on (32 bytes a block,
    8 lanes of 4 bytes). Returns them, token t's from 8 nb (t - n4)."""
    n_in = nb * 32
    n = n_tokens * n_in
    sums = xq[n + n4 * n_in:2 * n].view(np.int32)
    _lane_sums(xq[n4 * n_in:n], -16, sums)
    return sums


@njit(cache=True)
def _tile_scratch(xq, xd, n_tokens, n_in):
    """The tiles' part of the scratch (see matmul_<fmt>): xp int8[T*n_in] after the token-by-token quants, xl
    int8[T*n_in] after that (lane sums, read as int32), xt f32[5*T*n_in/32] after the token-by-token scales."""
    n, nb = n_tokens * n_in, n_tokens * (n_in // 32)
    if xq.shape[0] < 3 * n or xd.shape[0] < 6 * nb:  # (QuantLinear sizes these; a direct caller might not)
        raise ValueError("legacy matmul scratch too small: xq needs 3*T*n_in bytes, xd 6*T*n_in/32 floats")
    return xq[n:2 * n], xq[2 * n:3 * n], xd[nb:6 * nb]


@njit(cache=True)
def _prepare(x, xq, xd, xs, offset):
    """Quantize the T tokens of x into the scratch and lay out the eight-token tiles' copy (and for a format whose
    tiles take its quants unsigned, offset > 0, their lane sums); returns (blocks per row, tokens in eight-token
    tiles, tokens in tiles of eight or four, the tiles' quants, their scales, their lane sums)."""
    n_tokens, n_in = x.shape
    nb, n8, n4 = n_in // 32, n_tokens - n_tokens % 8, n_tokens - n_tokens % TOKEN_TILE
    xp, xl, xt = _tile_scratch(xq, xd, n_tokens, n_in)
    _quantize_tokens(x, xq, xd, xs)
    _pack_tiles8(xq, xd, xs, n_in, n8, xp, xt)
    if offset:  # the tiles' lane sums, at xp's byte offsets in xl
        _lane_sums(xp[:n8 * n_in], -offset, xl[:n8 * n_in].view(np.int32))
    return nb, n8, n4, xp, xt, xl


@njit(cache=True)
def _row_blocks(out):
    return (out.shape[1] + ROW_BLOCK - 1) // ROW_BLOCK


# --- Q4_0 -------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _row_block_q4_0(w, row_bytes, rb, nb, n8, n4, xq, xd, xs, xp, xt, xl, out):
    """Rows [16 rb, 16 rb + 16) of out = W x: eight-token tiles, then four-token tiles, then single tokens two rows
    at a time."""
    n_tokens, n_out = out.shape
    n_in = nb * 32
    r0, r1 = rb * ROW_BLOCK, min(n_out, rb * ROW_BLOCK + ROW_BLOCK)
    for t in range(0, n8, 8):
        for r in range(r0, r1):
            (out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r], out[t + 4, r], out[t + 5, r], out[t + 6, r],
             out[t + 7, r]) = tile8_q4_0(w, r * row_bytes, nb, xp, t * n_in, xt, t * nb, xl)
    for r in range(r0, r1):
        for t in range(n8, n4, TOKEN_TILE):
            out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_q4_0_q8_0(
                w, r * row_bytes, nb, xq, t * n_in, n_in, xd, t * nb)
    for t in range(n4, n_tokens):
        for r in range(r0, r1 - 1, 2):
            out[t, r], out[t, r + 1] = vec_dot2_q4_0_q8_0(
                w, r * row_bytes, (r + 1) * row_bytes, nb, xq, t * n_in, xd, t * nb)
        if (r1 - r0) % 2:
            r = r1 - 1
            out[t, r] = vec_dot_q4_0_q8_0(w, r * row_bytes, nb, xq, t * n_in, xd, t * nb)


@njit(parallel=True, cache=True)
def matmul_q4_0(w, row_bytes, x, xq, xd, xs, out):
    nb, n8, n4, xp, xt, xl = _prepare(x, xq, xd, xs, 8)
    for rb in prange(_row_blocks(out)):
        _row_block_q4_0(w, row_bytes, rb, nb, n8, n4, xq, xd, xs, xp, xt, xl, out)


@njit(parallel=True, cache=True)
def matmul3_q4_0(w0, w1, w2, row_bytes, x, xq, xd, xs, out0, out1, out2):
    """matmul_q4_0 for two or three matrices of one input width on the same input (for two: w2 repeats w1, out2 has
    no columns): one activation quantization and one parallel region for all their rows."""
    nb, n8, n4, xp, xt, xl = _prepare(x, xq, xd, xs, 8)
    b0, b1, b2 = _row_blocks(out0), _row_blocks(out1), _row_blocks(out2)
    for k in prange(b0 + b1 + b2):
        if k < b0:
            _row_block_q4_0(w0, row_bytes, k, nb, n8, n4, xq, xd, xs, xp, xt, xl, out0)
        elif k < b0 + b1:
            _row_block_q4_0(w1, row_bytes, k - b0, nb, n8, n4, xq, xd, xs, xp, xt, xl, out1)
        else:
            _row_block_q4_0(w2, row_bytes, k - b0 - b1, nb, n8, n4, xq, xd, xs, xp, xt, xl, out2)


# --- Q4_1 -------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _row_block_q4_1(w, row_bytes, rb, nb, n8, n4, xq, xd, xs, xp, xt, pairs, out):
    """Rows [16 rb, 16 rb + 16) of out = W x: eight-token tiles, then four-token tiles, then single tokens two rows
    at a time."""
    n_tokens, n_out = out.shape
    n_in = nb * 32
    r0, r1 = rb * ROW_BLOCK, min(n_out, rb * ROW_BLOCK + ROW_BLOCK)
    for t in range(0, n8, 8):
        for r in range(r0, r1):
            (out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r], out[t + 4, r], out[t + 5, r], out[t + 6, r],
             out[t + 7, r]) = tile8_q4_1(w, r * row_bytes, nb, xp, t * n_in, xt, t * nb, n8 * nb + t * nb)
    for r in range(r0, r1):
        for t in range(n8, n4, TOKEN_TILE):
            out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_q4_1_q8_0(
                w, r * row_bytes, nb, xq, t * n_in, n_in, xd, xs, t * nb)
    for t in range(n4, n_tokens):
        for r in range(r0, r1 - 1, 2):
            out[t, r], out[t, r + 1] = vec_dot2_q4_1_q8_0(
                w, r * row_bytes, (r + 1) * row_bytes, nb, xq, t * n_in, xt, pairs + 2 * (t - n4) * nb)
        if (r1 - r0) % 2:
            r = r1 - 1
            out[t, r] = vec_dot_q4_1_q8_0(w, r * row_bytes, nb, xq, t * n_in, xd, xs, t * nb)


@njit(parallel=True, cache=True)
def matmul_q4_1(w, row_bytes, x, xq, xd, xs, out):
    nb, n8, n4, xp, xt, xl = _prepare(x, xq, xd, xs, 0)
    pairs = _pack_pairs(xd, xs, nb, n8, n4, x.shape[0], xt)
    for rb in prange(_row_blocks(out)):
        _row_block_q4_1(w, row_bytes, rb, nb, n8, n4, xq, xd, xs, xp, xt, pairs, out)


@njit(parallel=True, cache=True)
def matmul3_q4_1(w0, w1, w2, row_bytes, x, xq, xd, xs, out0, out1, out2):
    """matmul_q4_1 for two or three matrices of one input width on the same input (for two: w2 repeats w1, out2 has
    no columns): one activation quantization and one parallel region for all their rows."""
    nb, n8, n4, xp, xt, xl = _prepare(x, xq, xd, xs, 0)
    pairs = _pack_pairs(xd, xs, nb, n8, n4, x.shape[0], xt)
    b0, b1, b2 = _row_blocks(out0), _row_blocks(out1), _row_blocks(out2)
    for k in prange(b0 + b1 + b2):
        if k < b0:
            _row_block_q4_1(w0, row_bytes, k, nb, n8, n4, xq, xd, xs, xp, xt, pairs, out0)
        elif k < b0 + b1:
            _row_block_q4_1(w1, row_bytes, k - b0, nb, n8, n4, xq, xd, xs, xp, xt, pairs, out1)
        else:
            _row_block_q4_1(w2, row_bytes, k - b0 - b1, nb, n8, n4, xq, xd, xs, xp, xt, pairs, out2)


# --- Q5_0 -------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _row_block_q5_0(w, row_bytes, rb, nb, n8, n4, xq, xd, xs, xp, xt, xl, lane_sums, out):
    """Rows [16 rb, 16 rb + 16) of out = W x: eight-token tiles, then four-token tiles, then single tokens two rows
    at a time."""
    n_tokens, n_out = out.shape
    n_in = nb * 32
    r0, r1 = rb * ROW_BLOCK, min(n_out, rb * ROW_BLOCK + ROW_BLOCK)
    for t in range(0, n8, 8):
        for r in range(r0, r1):
            (out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r], out[t + 4, r], out[t + 5, r], out[t + 6, r],
             out[t + 7, r]) = tile8_q5_0(w, r * row_bytes, nb, xp, t * n_in, xt, t * nb, xl)
    for r in range(r0, r1):
        for t in range(n8, n4, TOKEN_TILE):
            out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_q5_0_q8_0(
                w, r * row_bytes, nb, xq, t * n_in, n_in, xd, t * nb)
    for t in range(n4, n_tokens):
        for r in range(r0, r1 - 1, 2):
            out[t, r], out[t, r + 1] = vec_dot2_q5_0_q8_0(
                w, r * row_bytes, (r + 1) * row_bytes, nb, xq, t * n_in, xd, t * nb, lane_sums, 8 * nb * (t - n4))
        if (r1 - r0) % 2:
            r = r1 - 1
            out[t, r] = vec_dot_q5_0_q8_0(w, r * row_bytes, nb, xq, t * n_in, xd, t * nb)


@njit(parallel=True, cache=True)
def matmul_q5_0(w, row_bytes, x, xq, xd, xs, out):
    nb, n8, n4, xp, xt, xl = _prepare(x, xq, xd, xs, 16)
    lane_sums = _pack_lane_sums(xq, nb, n8, n4, x.shape[0])
    for rb in prange(_row_blocks(out)):
        _row_block_q5_0(w, row_bytes, rb, nb, n8, n4, xq, xd, xs, xp, xt, xl, lane_sums, out)


@njit(parallel=True, cache=True)
def matmul3_q5_0(w0, w1, w2, row_bytes, x, xq, xd, xs, out0, out1, out2):
    """matmul_q5_0 for two or three matrices of one input width on the same input (for two: w2 repeats w1, out2 has
    no columns): one activation quantization and one parallel region for all their rows."""
    nb, n8, n4, xp, xt, xl = _prepare(x, xq, xd, xs, 16)
    lane_sums = _pack_lane_sums(xq, nb, n8, n4, x.shape[0])
    b0, b1, b2 = _row_blocks(out0), _row_blocks(out1), _row_blocks(out2)
    for k in prange(b0 + b1 + b2):
        if k < b0:
            _row_block_q5_0(w0, row_bytes, k, nb, n8, n4, xq, xd, xs, xp, xt, xl, lane_sums, out0)
        elif k < b0 + b1:
            _row_block_q5_0(w1, row_bytes, k - b0, nb, n8, n4, xq, xd, xs, xp, xt, xl, lane_sums, out1)
        else:
            _row_block_q5_0(w2, row_bytes, k - b0 - b1, nb, n8, n4, xq, xd, xs, xp, xt, xl, lane_sums, out2)


# --- Q5_1 -------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _row_block_q5_1(w, row_bytes, rb, nb, n8, n4, xq, xd, xs, xp, xt, pairs, out):
    """Rows [16 rb, 16 rb + 16) of out = W x: eight-token tiles, then four-token tiles, then single tokens two rows
    at a time."""
    n_tokens, n_out = out.shape
    n_in = nb * 32
    r0, r1 = rb * ROW_BLOCK, min(n_out, rb * ROW_BLOCK + ROW_BLOCK)
    for t in range(0, n8, 8):
        for r in range(r0, r1):
            (out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r], out[t + 4, r], out[t + 5, r], out[t + 6, r],
             out[t + 7, r]) = tile8_q5_1(w, r * row_bytes, nb, xp, t * n_in, xt, t * nb, n8 * nb + t * nb)
    for r in range(r0, r1):
        for t in range(n8, n4, TOKEN_TILE):
            out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_q5_1_q8_0(
                w, r * row_bytes, nb, xq, t * n_in, n_in, xd, xs, t * nb)
    for t in range(n4, n_tokens):
        for r in range(r0, r1 - 1, 2):
            out[t, r], out[t, r + 1] = vec_dot2_q5_1_q8_0(
                w, r * row_bytes, (r + 1) * row_bytes, nb, xq, t * n_in, xt, pairs + 2 * (t - n4) * nb)
        if (r1 - r0) % 2:
            r = r1 - 1
            out[t, r] = vec_dot_q5_1_q8_0(w, r * row_bytes, nb, xq, t * n_in, xd, xs, t * nb)


@njit(parallel=True, cache=True)
def matmul_q5_1(w, row_bytes, x, xq, xd, xs, out):
    nb, n8, n4, xp, xt, xl = _prepare(x, xq, xd, xs, 0)
    pairs = _pack_pairs(xd, xs, nb, n8, n4, x.shape[0], xt)
    for rb in prange(_row_blocks(out)):
        _row_block_q5_1(w, row_bytes, rb, nb, n8, n4, xq, xd, xs, xp, xt, pairs, out)


@njit(parallel=True, cache=True)
def matmul3_q5_1(w0, w1, w2, row_bytes, x, xq, xd, xs, out0, out1, out2):
    """matmul_q5_1 for two or three matrices of one input width on the same input (for two: w2 repeats w1, out2 has
    no columns): one activation quantization and one parallel region for all their rows."""
    nb, n8, n4, xp, xt, xl = _prepare(x, xq, xd, xs, 0)
    pairs = _pack_pairs(xd, xs, nb, n8, n4, x.shape[0], xt)
    b0, b1, b2 = _row_blocks(out0), _row_blocks(out1), _row_blocks(out2)
    for k in prange(b0 + b1 + b2):
        if k < b0:
            _row_block_q5_1(w0, row_bytes, k, nb, n8, n4, xq, xd, xs, xp, xt, pairs, out0)
        elif k < b0 + b1:
            _row_block_q5_1(w1, row_bytes, k - b0, nb, n8, n4, xq, xd, xs, xp, xt, pairs, out1)
        else:
            _row_block_q5_1(w2, row_bytes, k - b0 - b1, nb, n8, n4, xq, xd, xs, xp, xt, pairs, out2)


# --- Q8_0 -------------------------------------------------------------------------------------------------
# (the 512-bit tiles take Q8_0's quants + 128 and start from the lane sums times -128: dots_legacy.Q8_0_TILE_OFFSET)


@njit(cache=True, inline="always")
def _row_block_q8_0(w, row_bytes, rb, nb, n8, n4, xq, xd, xs, xp, xt, xl, out):
    """Rows [16 rb, 16 rb + 16) of out = W x: eight-token tiles, then four-token tiles, then single tokens two rows
    at a time."""
    n_tokens, n_out = out.shape
    n_in = nb * 32
    r0, r1 = rb * ROW_BLOCK, min(n_out, rb * ROW_BLOCK + ROW_BLOCK)
    for t in range(0, n8, 8):
        for r in range(r0, r1):
            (out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r], out[t + 4, r], out[t + 5, r], out[t + 6, r],
             out[t + 7, r]) = tile8_q8_0(w, r * row_bytes, nb, xp, t * n_in, xt, t * nb, xl)
    for r in range(r0, r1):
        for t in range(n8, n4, TOKEN_TILE):
            out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_q8_0_q8_0(
                w, r * row_bytes, nb, xq, t * n_in, n_in, xd, t * nb)
    for t in range(n4, n_tokens):
        for r in range(r0, r1 - 1, 2):
            out[t, r], out[t, r + 1] = vec_dot2_q8_0_q8_0(
                w, r * row_bytes, (r + 1) * row_bytes, nb, xq, t * n_in, xd, t * nb)
        if (r1 - r0) % 2:
            r = r1 - 1
            out[t, r] = vec_dot_q8_0_q8_0(w, r * row_bytes, nb, xq, t * n_in, xd, t * nb)


@njit(parallel=True, cache=True)
def matmul_q8_0(w, row_bytes, x, xq, xd, xs, out):
    nb, n8, n4, xp, xt, xl = _prepare(x, xq, xd, xs, Q8_0_TILE_OFFSET)
    for rb in prange(_row_blocks(out)):
        _row_block_q8_0(w, row_bytes, rb, nb, n8, n4, xq, xd, xs, xp, xt, xl, out)


@njit(parallel=True, cache=True)
def matmul3_q8_0(w0, w1, w2, row_bytes, x, xq, xd, xs, out0, out1, out2):
    """matmul_q8_0 for two or three matrices of one input width on the same input (for two: w2 repeats w1, out2 has
    no columns): one activation quantization and one parallel region for all their rows."""
    nb, n8, n4, xp, xt, xl = _prepare(x, xq, xd, xs, Q8_0_TILE_OFFSET)
    b0, b1, b2 = _row_blocks(out0), _row_blocks(out1), _row_blocks(out2)
    for k in prange(b0 + b1 + b2):
        if k < b0:
            _row_block_q8_0(w0, row_bytes, k, nb, n8, n4, xq, xd, xs, xp, xt, xl, out0)
        elif k < b0 + b1:
            _row_block_q8_0(w1, row_bytes, k - b0, nb, n8, n4, xq, xd, xs, xp, xt, xl, out1)
        else:
            _row_block_q8_0(w2, row_bytes, k - b0 - b1, nb, n8, n4, xq, xd, xs, xp, xt, xl, out2)


MATMUL = {"Q4_0": matmul_q4_0, "Q4_1": matmul_q4_1, "Q5_0": matmul_q5_0, "Q5_1": matmul_q5_1, "Q8_0": matmul_q8_0}
MATMUL3 = {"Q4_0": matmul3_q4_0, "Q4_1": matmul3_q4_1, "Q5_0": matmul3_q5_0, "Q5_1": matmul3_q5_1,
           "Q8_0": matmul3_q8_0}

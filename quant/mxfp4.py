"""MXFP4 (OCP microscaling FP4): 32-element blocks of one E8M0 scale byte and 32 four-bit E2M1 values.

Block: e u8 | qs[16] (element j < 16 is the low nibble of qs[j], element j + 16 its high nibble); the weight is
2^(e - 128) * KVALUES_MXFP4[nibble], the E2M1 values doubled to integers and the scale halved to match
(GGML_E8M0_TO_FP32_HALF). Computed against Q8_0-style activations with llama.cpp's ggml_vec_dot_mxfp4_q8_0 (AVX2)
arithmetic, IQ4_NL's scheme with another table and scale: the table lookup gives 32 signed bytes, their dot with the
activations goes into 8 exact int32 lanes, and each block's lanes are added by one FMA with d_x * 2^(e - 128) into
one of two float accumulators (even blocks, odd blocks); the two are added lane by lane and the lanes summed
(f32x8_hsum's order); an odd last block is a scalar step after that, one FMA.

Matrices of a multiple of 8 rows llama.cpp's AVX2 backend repacks at load (mxfp4_8x8) and multiplies with
ggml_gemv_mxfp4_8x8_q8_0 (one token) and ggml_gemm_mxfp4_8x8_q8_0 (four), which give each (row, token) the same bits:
per block the exact integer dot, then acc = fma(float(dot), d_x * 2^(e - 128), acc), one float32 chain over the
blocks in order (Q4_0's repacked arithmetic, quant.q4_0_rows8). matmul_mxfp4_rows8 computes that, rows8_reference
is its numpy model.

Here: block_mxfp4, the dequantizer; the four row dots quant.matmul_block32 drives (quant.dots_block32 states their
contract), so every (row, token) gives the same bits whichever computes it; matmul_mxfp4_rows8; quantize_block_mxfp4,
llama.cpp's quantize_row_mxfp4_ref with the operations of quant.reference.quantize_mxfp4.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.extending import intrinsic
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .dots_block32 import (PREFETCH_BYTES, Q8_0_TILE_KIND, Q8_0_TILE_OFFSET, _quantize_tokens, _tile8_pairs,
                           _tile8_sums_256, _tile8_zero)
# table-independent pieces: the odd block's scalar step, the tiles' sum, the value load's IR
from .iq4_nl import _table_tail, _tile8_added, table_values_codegen
from .reference import KVALUES_MXFP4, e8m0_to_f32_half
from .simd import (HAS_WIDE_TILES, I8x32, dot_i8x32, f32_from_bits, f32x8_add, f32x8_fma_i32, f32x8_hsum,
                   f32x8_splat, f32x8_zero, fma32, i32x8_hsum, i8x32_xor, load_f32, load_i8x32, prefetch)
from .simd.vector_ir import _vec

TILE_OFFSET_MXFP4 = Q8_0_TILE_OFFSET  # the tiles take the values as Q8_0's quants (signed; +128 for 512-bit)
BLOCK_BYTES = 17

_I8 = ir.IntType(8)
_TABLE = ir.Constant(_vec(_I8, 16), [int(v) for v in KVALUES_MXFP4])


@intrinsic
def load_mxfp4_values(typingctx, buf, offset):
    """MXFP4's 32 values of the block whose nibbles are at buf[offset] (iq4_nl.table_values_codegen)."""
    return I8x32(buf, offset), table_values_codegen(_TABLE)


@njit(cache=True, inline="always")
def e8m0_half(e):
    """2^(e - 128) as float32 from its bits (subnormal for e < 2): GGML_E8M0_TO_FP32_HALF."""
    e = np.uint32(e)
    return f32_from_bits(np.uint32(0x00200000) << e if e < 2 else (e - np.uint32(1)) << np.uint32(23))


@njit(cache=True)
def block_mxfp4(w, o, out, p):
    d = e8m0_half(w[o])
    for j in range(16):
        q = np.int32(w[o + 1 + j])
        out[p + j] = d * np.float32(KVALUES_MXFP4[q & 15])
        out[p + j + 16] = d * np.float32(KVALUES_MXFP4[q >> 4])


@njit(cache=True)
def vec_dot_mxfp4_q8_0(w, o, nb, xq, xo, xd, xdo):
    a1, a2 = f32x8_zero(), f32x8_zero()
    for b in range(0, nb - 1, 2):
        a1 = f32x8_fma_i32(a1, dot_i8x32(load_mxfp4_values(w, o + 1), load_i8x32(xq, xo + b * 32)),
                           load_f32(xd, xdo + b) * e8m0_half(w[o]))
        a2 = f32x8_fma_i32(a2, dot_i8x32(load_mxfp4_values(w, o + 18), load_i8x32(xq, xo + b * 32 + 32)),
                           load_f32(xd, xdo + b + 1) * e8m0_half(w[o + 17]))
        o += 2 * BLOCK_BYTES
    total = f32x8_hsum(f32x8_add(a1, a2))
    if nb % 2:
        b = nb - 1
        total = _table_tail(w, o + 1, KVALUES_MXFP4, xq, xo + 32 * b, xo + 32 * b + 16,
                            load_f32(xd, xdo + b) * e8m0_half(w[o]), total)
    return total


@njit(cache=True)
def vec_dot2_mxfp4_q8_0(w, o, o2, nb, xq, xo, xd, xdo):
    """Two rows, each with its own pair of accumulators (vec_dot's bits per row)."""
    a1, a2, c1, c2 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for b in range(0, nb - 1, 2):
        prefetch(w, o + PREFETCH_BYTES)
        prefetch(w, o2 + PREFETCH_BYTES)
        x, dx = load_i8x32(xq, xo + b * 32), load_f32(xd, xdo + b)
        x2, dx2 = load_i8x32(xq, xo + b * 32 + 32), load_f32(xd, xdo + b + 1)
        a1 = f32x8_fma_i32(a1, dot_i8x32(load_mxfp4_values(w, o + 1), x), dx * e8m0_half(w[o]))
        c1 = f32x8_fma_i32(c1, dot_i8x32(load_mxfp4_values(w, o2 + 1), x), dx * e8m0_half(w[o2]))
        a2 = f32x8_fma_i32(a2, dot_i8x32(load_mxfp4_values(w, o + 18), x2), dx2 * e8m0_half(w[o + 17]))
        c2 = f32x8_fma_i32(c2, dot_i8x32(load_mxfp4_values(w, o2 + 18), x2), dx2 * e8m0_half(w[o2 + 17]))
        o += 2 * BLOCK_BYTES
        o2 += 2 * BLOCK_BYTES
    r, r2 = f32x8_hsum(f32x8_add(a1, a2)), f32x8_hsum(f32x8_add(c1, c2))
    if nb % 2:
        b = nb - 1
        dx = load_f32(xd, xdo + b)
        r = _table_tail(w, o + 1, KVALUES_MXFP4, xq, xo + 32 * b, xo + 32 * b + 16, dx * e8m0_half(w[o]), r)
        r2 = _table_tail(w, o2 + 1, KVALUES_MXFP4, xq, xo + 32 * b, xo + 32 * b + 16, dx * e8m0_half(w[o2]), r2)
    return r, r2


@njit(cache=True, inline="always")
def _step4(acc, q, d, xq, k, x_stride, xd, xdo, nb, b):
    a0, a1, a2, a3 = acc
    return (f32x8_fma_i32(a0, dot_i8x32(q, load_i8x32(xq, k)), load_f32(xd, xdo + b) * d),
            f32x8_fma_i32(a1, dot_i8x32(q, load_i8x32(xq, k + x_stride)), load_f32(xd, xdo + nb + b) * d),
            f32x8_fma_i32(a2, dot_i8x32(q, load_i8x32(xq, k + 2 * x_stride)), load_f32(xd, xdo + 2 * nb + b) * d),
            f32x8_fma_i32(a3, dot_i8x32(q, load_i8x32(xq, k + 3 * x_stride)), load_f32(xd, xdo + 3 * nb + b) * d))


@njit(cache=True)
def vec_dot4_mxfp4_q8_0(w, o, nb, xq, xo, x_stride, xd, xdo):
    """One row x four tokens: each block decoded once, each token with its own pair of accumulators."""
    z = f32x8_zero()
    even, odd = (z, z, z, z), (z, z, z, z)
    for b in range(0, nb - 1, 2):
        prefetch(w, o + PREFETCH_BYTES)
        even = _step4(even, load_mxfp4_values(w, o + 1), e8m0_half(w[o]), xq, xo + b * 32, x_stride, xd, xdo, nb, b)
        odd = _step4(odd, load_mxfp4_values(w, o + 18), e8m0_half(w[o + 17]), xq, xo + b * 32 + 32, x_stride, xd,
                     xdo, nb, b + 1)
        o += 2 * BLOCK_BYTES
    r0, r1 = f32x8_hsum(f32x8_add(even[0], odd[0])), f32x8_hsum(f32x8_add(even[1], odd[1]))
    r2, r3 = f32x8_hsum(f32x8_add(even[2], odd[2])), f32x8_hsum(f32x8_add(even[3], odd[3]))
    if nb % 2:
        b = nb - 1
        k, d = xo + 32 * b, e8m0_half(w[o])
        r0 = _table_tail(w, o + 1, KVALUES_MXFP4, xq, k, k + 16, load_f32(xd, xdo + b) * d, r0)
        r1 = _table_tail(w, o + 1, KVALUES_MXFP4, xq, k + x_stride, k + x_stride + 16,
                         load_f32(xd, xdo + nb + b) * d, r1)
        r2 = _table_tail(w, o + 1, KVALUES_MXFP4, xq, k + 2 * x_stride, k + 2 * x_stride + 16,
                         load_f32(xd, xdo + 2 * nb + b) * d, r2)
        r3 = _table_tail(w, o + 1, KVALUES_MXFP4, xq, k + 3 * x_stride, k + 3 * x_stride + 16,
                         load_f32(xd, xdo + 3 * nb + b) * d, r3)
    return r0, r1, r2, r3


@njit(cache=True)
def _tile_values_plus128(w, o):
    """The values + 128 for the 512-bit tiles (vpdpbusd's unsigned side; the activations' lane sums times -128 take
    the offset out, as for Q8_0)."""
    return i8x32_xor(load_mxfp4_values(w, o + 1), -128)


@njit(cache=True)
def _tile_values_signed(w, o):
    return load_mxfp4_values(w, o + 1)


_tile_values = _tile_values_plus128 if HAS_WIDE_TILES else _tile_values_signed


@njit(cache=True)
def _tile_tail(w, o, xp, xo, xt, so, j, total):
    """_tail for token j of an eight-token tile (quant.dots_block32._pack_tiles8's layout: token j is half j % 2
    of pair j // 2, elements 0-15 then, 32 bytes on, 16-31)."""
    base = xo + 64 * (j // 2) + 16 * (j % 2)
    return _table_tail(w, o + 1, KVALUES_MXFP4, xp, base, base + 32, load_f32(xt, so + j) * e8m0_half(w[o]), total)


@njit(cache=True)
def tile8_mxfp4(w, o, nb, xp, xo, xt, so, xl):
    """One row x eight tokens: even blocks into one tile of accumulators, odd blocks into another."""
    even, odd = _tile8_zero(), _tile8_zero()
    for b in range(0, nb - 1, 2):
        prefetch(w, o + PREFETCH_BYTES)
        even = _tile8_pairs(even, _tile_values(w, o), f32x8_splat(e8m0_half(w[o])), xp, xo + 256 * b, xt,
                            so + 8 * b, Q8_0_TILE_KIND, xl)
        odd = _tile8_pairs(odd, _tile_values(w, o + BLOCK_BYTES), f32x8_splat(e8m0_half(w[o + BLOCK_BYTES])), xp,
                           xo + 256 * (b + 1), xt, so + 8 * (b + 1), Q8_0_TILE_KIND, xl)
        o += 2 * BLOCK_BYTES
    r = _tile8_sums_256(_tile8_added(even, odd))
    if nb % 2:
        b = nb - 1
        xo_b, so_b = xo + 256 * b, so + 8 * b
        return (_tile_tail(w, o, xp, xo_b, xt, so_b, 0, r[0]), _tile_tail(w, o, xp, xo_b, xt, so_b, 1, r[1]),
                _tile_tail(w, o, xp, xo_b, xt, so_b, 2, r[2]), _tile_tail(w, o, xp, xo_b, xt, so_b, 3, r[3]),
                _tile_tail(w, o, xp, xo_b, xt, so_b, 4, r[4]), _tile_tail(w, o, xp, xo_b, xt, so_b, 5, r[5]),
                _tile_tail(w, o, xp, xo_b, xt, so_b, 6, r[6]), _tile_tail(w, o, xp, xo_b, xt, so_b, 7, r[7]))
    return r


@njit(parallel=True, cache=True)
def matmul_mxfp4_rows8(w, row_bytes, x, xq, xd, xs, out):
    """quant.matmul_block32's contract, for a matrix llama.cpp repacks: one float chain per (row, token)."""
    _quantize_tokens(x, xq, xd, xs)
    n_tokens, n_in = x.shape
    nb = n_in // 32
    for r in prange(out.shape[1]):
        for t in range(n_tokens):  # the row (nb * 17 bytes) stays in L1 across the tokens
            out[t, r] = row_dot_rows8(w, r * row_bytes, nb, xq, t * n_in, xd, t * nb)


@njit(cache=True, inline="always")
def row_dot_rows8(w, o, nb, xq, xo, xd, xdo):
    """One row x one token in the repacked gemv's order: one float chain, an FMA per block."""
    acc = np.float32(0)
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        dot = i32x8_hsum(dot_i8x32(load_mxfp4_values(w, o + 1), load_i8x32(xq, xo + 32 * b)))
        acc = fma32(np.float32(dot), load_f32(xd, xdo + b) * e8m0_half(w[o]), acc)
        o += BLOCK_BYTES
    return acc


def rows8_reference(raw, n_out, n_in, xq, xd):
    """numpy: matmul_mxfp4_rows8's float32 results for one token's Q8_0 activations (xq int8 [n_in], xd float32
    [n_in / 32]): exact integer dots, one FMA per block (float64 holds the product of the two float32 exactly, and
    the sum is rounded once to float32, as quant.q4_0_rows8.rows8_reference argues)."""
    blocks = np.asarray(raw, np.uint8).reshape(n_out, n_in // 32, BLOCK_BYTES)
    d = e8m0_to_f32_half(blocks[:, :, 0])
    q = KVALUES_MXFP4[np.concatenate([blocks[:, :, 1:] & 15, blocks[:, :, 1:] >> 4], axis=2)].astype(np.int64)
    dots = (q * xq.reshape(1, -1, 32).astype(np.int64)).sum(axis=2)
    out = np.zeros(n_out, np.float32)
    for b in range(n_in // 32):
        scale = (np.float32(xd[b]) * d[:, b]).astype(np.float32)
        out = (dots[:, b].astype(np.float32).astype(np.float64) * scale.astype(np.float64) + out).astype(np.float32)
    return out


# --- quantizer ---------------------------------------------------------------------------------------------------


@njit(cache=True)
def quantize_block_mxfp4(x, out, q):
    """x float32[32] -> out uint8[17] (q: scratch, unused): the exponent of the largest magnitude less 2, then each
    value's nearest table entry at that scale, the first of equal errors."""
    amax = np.float32(0)
    for j in range(32):
        if amax < abs(x[j]):
            amax = abs(x[j])
    e = 0
    if amax > 0:  # floor(log2f(amax)): float64 log2 rounded to float32, as the numpy reference does
        e = int(math.floor(np.float32(math.log2(np.float64(amax))))) - 2 + 127
    out[0] = e
    d = e8m0_half(np.uint8(e))
    for j in range(16):
        out[1 + j] = _nearest(x[j], d) | (_nearest(x[j + 16], d) << 4)


@njit(cache=True, inline="always")
def _nearest(v, d):
    best, best_err = 0, abs(np.float32(KVALUES_MXFP4[0]) * d - v)
    for i in range(1, 16):
        err = abs(np.float32(KVALUES_MXFP4[i]) * d - v)
        if err < best_err:
            best, best_err = i, err
    return best

"""Row dot products for the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against Q8_0-style int8
activations: the inner loops of quant.kernels_legacy, which drives them over rows and tokens.

Per format:
  _quants_<fmt>(w, o)        the 32 quants of the block at byte o as I8x32 (offset removed)
  vec_dot_<fmt>_q8_0(...)    one row x one token (llama.cpp's vec_dot_<fmt>_q8_0 scheme: one FMA per block into
                             8 float lanes, the lanes summed at the end)
  vec_dot2_<fmt>_q8_0(...)   two rows x one token (decode); Q4_1 and Q5_1 take the token's scales and sums in
                             pairs (kernels_legacy._pack_pairs), Q5_0 its lane sums (kernels_legacy._pack_lane_sums)
  vec_dot4_<fmt>_q8_0(...)   one row x four tokens: each weight block is decoded once and used four times
  tile8_<fmt>(...)           one row x eight tokens, from activations repacked in pairs (kernels_legacy._pack_tiles8)
Every (row, token) sum runs in the same order in each of them, so they give the same bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .simd import (HAS_WIDE_TILES, dot_i8x32, dot_u8x32, dot_u8x32_plus, f32x16_halves, f32x16_pair_scales,
                   f32x16_tile_step, f32x16_zero, f32x4_add, f32x4_lane, f32x4_mul, f32x4_zero, f32x8_add,
                   f32x8_fma_i32, f32x8_fma_lanes, f32x8_hsum, f32x8_hsum_split, f32x8_lane, f32x8_mul,
                   f32x8_pair_splats, f32x8_splat, f32x8_zero, i8x32_dup_hi, i8x32_dup_lo, i8x32_or, i8x32_shl,
                   i8x32_sub, i8x32_xor, i8x64_tile_quants, load_bits32, load_f16, load_f16_pair, load_f16x2_rows,
                   load_f32, load_f32x2_twice, load_f32x8, load_i8x32, load_nibbles_lo_hi, load_nibbles_lo_hi_bcast,
                   load_nibbles_tile64, load_q5_tile64, prefetch)

# Single tokens (decode) go two rows at a time (vec_dot2_<fmt>): each row keeps its one accumulator and its block
# order, so its bits are vec_dot's, but two independent FMA chains keep the vector units busy where one row waits on
# its FMA's latency (in cache: Q8_0 1.4x). Two rows read as two interleaved streams, which the hardware prefetcher
# serves poorly (from DRAM, 4096x576 Q8_0 without a hint ran 1.5x slower than one row at a time), so the pair
# prefetches each row PREFETCH_BYTES ahead. The four- and eight-token kernels (vec_dot4, tile8) hint their one row
# the same way: a small batch (batched decoding, T = 4..16) streams each weight once, and without the hint the
# stream's latency added to the tiles' compute (SmolLM2's matrices at T = 8: 19.6 -> 13.5 ms, T = 4: 17.8 -> 9.8).
# Distance, measured on each machine kind with 2 threads: on the AVX2 kind Q8_0 did best at 512-1024 bytes and Q4_1
# at 1024-2048; on the AVX-512 kind 1024 left decode slow and 3072-6144 were alike (SmolLM2's matrices for one
# token, alternating processes: 6.9-7.4 ms at 1024, 5.0-5.7 at 3072, 4.7-5.4 at 6144; tg64 169 -> 198 t/s).
PREFETCH_BYTES = 3072


@njit(cache=True)
def _dot(w, x, signed):
    """dot_i8x32 for signed quants, dot_u8x32 (no sign flip) for 0..127 ones; `signed` is a constant at every call
    site, so the branch folds away once inlined."""
    if signed:
        return dot_i8x32(w, x)
    return dot_u8x32(w, x)


# How a tile's quants meet the activations (a constant at every call site): unsigned 0..127, signed (the sign flip
# of dot_i8x32), or unsigned with an offset taken out through the activations' lane sums (dot_u8x32_plus; xl holds
# them at xp's byte offsets, kernels_legacy._prepare).
TILE_UNSIGNED, TILE_SIGNED, TILE_OFFSET = 0, 1, 2


@njit(cache=True)
def _tile_dot(w, xp, xo, kind, xl):
    if kind == TILE_OFFSET:
        return dot_u8x32_plus(w, load_i8x32(xp, xo), xl, xo)
    return _dot(w, load_i8x32(xp, xo), kind == TILE_SIGNED)


@njit(cache=True)
def _tile8_pairs_256(acc, q, d, xp, xo, xt, so, kind, xl):
    """One weight block (q = its quants, d = its scale in 8 lanes) into the eight accumulators of a tile: acc[2k]
    holds pair k's lanes 0-3, acc[2k+1] its lanes 4-7, from [quants 0-15 twice] and [16-31 twice]. The eight tokens'
    scales d_w*d_x are one multiply, spread to each pair's [A x4 | B x4] by lane copies (a shuffle port, where the
    multiplies would take the FMA ports the dots and FMAs need)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    lo, hi = i8x32_dup_lo(q), i8x32_dup_hi(q)
    s0, s1, s2, s3 = f32x8_pair_splats(f32x8_mul(d, load_f32x8(xt, so)))
    a0 = f32x8_fma_lanes(a0, _tile_dot(lo, xp, xo, kind, xl), s0)
    a1 = f32x8_fma_lanes(a1, _tile_dot(hi, xp, xo + 32, kind, xl), s0)
    a2 = f32x8_fma_lanes(a2, _tile_dot(lo, xp, xo + 64, kind, xl), s1)
    a3 = f32x8_fma_lanes(a3, _tile_dot(hi, xp, xo + 96, kind, xl), s1)
    a4 = f32x8_fma_lanes(a4, _tile_dot(lo, xp, xo + 128, kind, xl), s2)
    a5 = f32x8_fma_lanes(a5, _tile_dot(hi, xp, xo + 160, kind, xl), s2)
    a6 = f32x8_fma_lanes(a6, _tile_dot(lo, xp, xo + 192, kind, xl), s3)
    a7 = f32x8_fma_lanes(a7, _tile_dot(hi, xp, xo + 224, kind, xl), s3)
    return a0, a1, a2, a3, a4, a5, a6, a7


@njit(cache=True)
def _tile8_zero_256():
    z = f32x8_zero()
    return z, z, z, z, z, z, z, z


@njit(cache=True)
def _tile8_sums_256(acc):
    """The eight tokens' row sums, each in f32x8_hsum's order (what vec_dot returns for a format without mins)."""
    r0, r1 = f32x8_hsum_split(acc[0], acc[1])
    r2, r3 = f32x8_hsum_split(acc[2], acc[3])
    r4, r5 = f32x8_hsum_split(acc[4], acc[5])
    r6, r7 = f32x8_hsum_split(acc[6], acc[7])
    return r0, r1, r2, r3, r4, r5, r6, r7


# The 512-bit form (simd.HAS_WIDE_TILES): accumulator k holds the 256-bit acc[2k] and acc[2k+1] side by side, fed
# [quants 0-15 twice | 16-31 twice] against the pair's 64 activation bytes in one step. Same lanes, same arithmetic.


@njit(cache=True)
def _tile_step_wide(acc, w, xp, xo, s, kind, xl):
    if kind == TILE_OFFSET:
        return f32x16_tile_step(acc, w, xp, xo, xl, xo, s)
    return f32x16_tile_step(acc, w, xp, xo, None, 0, s)


@njit(cache=True)
def _tile8_pairs_wide(acc, q, d, xp, xo, xt, so, kind, xl):
    a0, a1, a2, a3 = acc
    w = i8x64_tile_quants(q)
    s0, s1, s2, s3 = f32x16_pair_scales(f32x8_mul(d, load_f32x8(xt, so)))
    return (_tile_step_wide(a0, w, xp, xo, s0, kind, xl), _tile_step_wide(a1, w, xp, xo + 64, s1, kind, xl),
            _tile_step_wide(a2, w, xp, xo + 128, s2, kind, xl), _tile_step_wide(a3, w, xp, xo + 192, s3, kind, xl))


@njit(cache=True)
def _tile8_zero_wide():
    z = f32x16_zero()
    return z, z, z, z


@njit(cache=True)
def _tile8_sums_wide(acc):
    a0, a1 = f32x16_halves(acc[0])
    a2, a3 = f32x16_halves(acc[1])
    a4, a5 = f32x16_halves(acc[2])
    a6, a7 = f32x16_halves(acc[3])
    return _tile8_sums_256((a0, a1, a2, a3, a4, a5, a6, a7))


@njit(cache=True)
def _tile8_sums_mins(acc, mins):
    """_tile8_sums plus each token's min term (lane j of mins = token j), as vec_dot_q4_1/q5_1 return them. The
    formats without mins do not add zeros: -0.0 + 0.0 would give +0.0 where vec_dot gives -0.0."""
    r = _tile8_sums(acc)
    return (r[0] + f32x8_lane(mins, 0), r[1] + f32x8_lane(mins, 1), r[2] + f32x8_lane(mins, 2),
            r[3] + f32x8_lane(mins, 3), r[4] + f32x8_lane(mins, 4), r[5] + f32x8_lane(mins, 5),
            r[6] + f32x8_lane(mins, 6), r[7] + f32x8_lane(mins, 7))


# --- block decoders ------------------------------------------------------------------------------------------
# Q4_0: d f16 | qs[16]          Q4_1: d | m | qs[16]          Q8_0: d | qs int8[32]
# Q5_0: d | qh u32 | qs[16]     Q5_1: d | m | qh u32 | qs[16]   (bit j of qh is bit 4 of quant j)


@njit(cache=True)
def _quants_q4_0_unsigned(w, o):
    """Q4_0's quants + 8 (0..15), for the eight-token tiles (dot_u8x32_plus takes the offset out)."""
    return load_nibbles_lo_hi(w, o + 2)


@njit(cache=True)
def _quants_q4_0(w, o):
    return i8x32_sub(_quants_q4_0_unsigned(w, o), 8)


@njit(cache=True)
def _quants_q4_1(w, o):
    return load_nibbles_lo_hi(w, o + 4)


@njit(cache=True)
def _quants_q4_1_bcast(w, o):
    """_quants_q4_1 for the two-row dot (simd.load_nibbles_lo_hi_bcast)."""
    return load_nibbles_lo_hi_bcast(w, o + 4)


@njit(cache=True)
def _quants_q5_0_unsigned(w, o):
    """Q5_0's quants + 16 (0..31), for the eight-token tiles (dot_u8x32_plus takes the offset out)."""
    return i8x32_or(load_nibbles_lo_hi(w, o + 6), i8x32_shl(load_bits32(w, o + 2), 4))


@njit(cache=True)
def _quants_q5_0(w, o):
    return i8x32_sub(_quants_q5_0_unsigned(w, o), 16)


@njit(cache=True)
def _quants_q5_0_unsigned_bcast(w, o):
    """_quants_q5_0_unsigned for the two-row dot (simd.load_nibbles_lo_hi_bcast)."""
    return i8x32_or(load_nibbles_lo_hi_bcast(w, o + 6), i8x32_shl(load_bits32(w, o + 2), 4))


@njit(cache=True)
def _quants_q5_1(w, o):
    return i8x32_or(load_nibbles_lo_hi(w, o + 8), i8x32_shl(load_bits32(w, o + 4), 4))


@njit(cache=True)
def _quants_q5_1_bcast(w, o):
    return i8x32_or(load_nibbles_lo_hi_bcast(w, o + 8), i8x32_shl(load_bits32(w, o + 4), 4))


@njit(cache=True)
def _quants_q8_0(w, o):
    return load_i8x32(w, o + 2)


# The tiles' quants, unsigned: for the 256-bit tiles the 32 of a block (_tile8_pairs_256 doubles each half); for the
# 512-bit ones already as [0-15 twice | 16-31 twice], built by broadcast loads, shifts and masks without shuffles.


@njit(cache=True)
def _tile64_q4_0(w, o):
    return load_nibbles_tile64(w, o + 2)


@njit(cache=True)
def _tile64_q4_1(w, o):
    return load_nibbles_tile64(w, o + 4)


@njit(cache=True)
def _tile64_q5_0(w, o):
    return load_q5_tile64(w, o + 6, o + 2)


@njit(cache=True)
def _tile64_q5_1(w, o):
    return load_q5_tile64(w, o + 8, o + 4)


@njit(cache=True)
def _quants_q8_0_plus128(w, o):
    """Q8_0's quants + 128 (0..255) for the 512-bit tiles: vpdpbusd takes its weights unsigned, and AVX-512 has no
    vpsignb for the 256-bit tiles' sign flip; the lane sums times -128 take the offset out."""
    return i8x32_xor(_quants_q8_0(w, o), -128)


if HAS_WIDE_TILES:
    _tile8_zero, _tile8_pairs, _tile8_sums = _tile8_zero_wide, _tile8_pairs_wide, _tile8_sums_wide
    _tile_quants_q4_0, _tile_quants_q4_1, _tile_quants_q5_0, _tile_quants_q5_1, _tile_quants_q8_0 = (
        _tile64_q4_0, _tile64_q4_1, _tile64_q5_0, _tile64_q5_1, _quants_q8_0_plus128)
    Q8_0_TILE_KIND, Q8_0_TILE_OFFSET = TILE_OFFSET, 128  # (the offset: kernels_legacy._prepare's lane sums)
else:
    _tile8_zero, _tile8_pairs, _tile8_sums = _tile8_zero_256, _tile8_pairs_256, _tile8_sums_256
    _tile_quants_q4_0, _tile_quants_q4_1, _tile_quants_q5_0, _tile_quants_q5_1, _tile_quants_q8_0 = (
        _quants_q4_0_unsigned, _quants_q4_1, _quants_q5_0_unsigned, _quants_q5_1, _quants_q8_0)
    Q8_0_TILE_KIND, Q8_0_TILE_OFFSET = TILE_SIGNED, 0


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
def vec_dot2_q4_0_q8_0(w, o, o2, nb, xq, xo, xd, xdo):
    a, a2 = f32x8_zero(), f32x8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        prefetch(w, o2 + PREFETCH_BYTES)
        x, dx = load_i8x32(xq, xo + b * 32), load_f32(xd, xdo + b)
        d, d2 = load_f16_pair(w, o, o2)
        a = f32x8_fma_i32(a, dot_i8x32(_quants_q4_0(w, o), x), d * dx)
        a2 = f32x8_fma_i32(a2, dot_i8x32(_quants_q4_0(w, o2), x), d2 * dx)
        o += 18
        o2 += 18
    return f32x8_hsum(a), f32x8_hsum(a2)


@njit(cache=True)
def vec_dot4_q4_0_q8_0(w, o, nb, xq, xo, x_stride, xd, xdo):
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        q, d, k = _quants_q4_0(w, o), load_f16(w, o), xo + b * 32
        a0 = f32x8_fma_i32(a0, dot_i8x32(q, load_i8x32(xq, k)), d * load_f32(xd, xdo + b))
        a1 = f32x8_fma_i32(a1, dot_i8x32(q, load_i8x32(xq, k + x_stride)), d * load_f32(xd, xdo + nb + b))
        a2 = f32x8_fma_i32(a2, dot_i8x32(q, load_i8x32(xq, k + 2 * x_stride)), d * load_f32(xd, xdo + 2 * nb + b))
        a3 = f32x8_fma_i32(a3, dot_i8x32(q, load_i8x32(xq, k + 3 * x_stride)), d * load_f32(xd, xdo + 3 * nb + b))
        o += 18
    return f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3)


@njit(cache=True)
def tile8_q4_0(w, o, nb, xp, xo, xt, so, xl):
    """The quants unsigned (0..15); the tile's lane sums (times -8) take the offset out."""
    acc = _tile8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        q = _tile_quants_q4_0(w, o)
        acc = _tile8_pairs(acc, q, f32x8_splat(load_f16(w, o)), xp, xo + 256 * b, xt,
                           so + 8 * b, TILE_OFFSET, xl)
        o += 18
    return _tile8_sums(acc)


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
def vec_dot2_q4_1_q8_0(w, o, o2, nb, xq, xo, xds, xso):
    """Two rows: each block's two (d, m) pairs are converted, scaled by the token's (d_x, s_x) and their mins summed
    as one F32x4 (lanes d*dx, m*sx, d2*dx, m2*sx): the scalar products and sums of vec_dot, one instruction each for
    both rows. xds[xso + 2b], xds[xso + 2b + 1]: the token's d_x and s_x of block b (kernels_legacy._pack_pairs)."""
    a, a2, m = f32x8_zero(), f32x8_zero(), f32x4_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        prefetch(w, o2 + PREFETCH_BYTES)
        x = load_i8x32(xq, xo + b * 32)
        s = f32x4_mul(load_f16x2_rows(w, o, o2), load_f32x2_twice(xds, xso + 2 * b))
        m = f32x4_add(m, s)
        a = f32x8_fma_i32(a, dot_u8x32(_quants_q4_1_bcast(w, o), x), f32x4_lane(s, 0))
        a2 = f32x8_fma_i32(a2, dot_u8x32(_quants_q4_1_bcast(w, o2), x), f32x4_lane(s, 2))
        o += 20
        o2 += 20
    return f32x8_hsum(a) + f32x4_lane(m, 1), f32x8_hsum(a2) + f32x4_lane(m, 3)


@njit(cache=True)
def vec_dot4_q4_1_q8_0(w, o, nb, xq, xo, x_stride, xd, xs, xdo):
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    m0 = m1 = m2 = m3 = np.float32(0)
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
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


@njit(cache=True)
def tile8_q4_1(w, o, nb, xp, xo, xt, so, mo):
    acc = _tile8_zero()
    mins = f32x8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        q = _tile_quants_q4_1(w, o)
        mins = f32x8_add(mins, f32x8_mul(f32x8_splat(load_f16(w, o + 2)), load_f32x8(xt, mo + 8 * b)))
        acc = _tile8_pairs(acc, q, f32x8_splat(load_f16(w, o)), xp, xo + 256 * b, xt,
                           so + 8 * b, TILE_UNSIGNED, xp)
        o += 20
    return _tile8_sums_mins(acc, mins)


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
def vec_dot2_q5_0_q8_0(w, o, o2, nb, xq, xo, xd, xdo, lane_sums, lo):
    """Two rows with the quants kept unsigned (0..31): each block's lanes start from lane_sums[lo + 8b ...], the
    token's -16 x (sum of each lane's four activations) (kernels_legacy._pack_lane_sums; dot_u8x32_plus): the
    exact integers dot_i8x32(q - 16, x) gives, without the sign flip and the subtraction per row."""
    a, a2 = f32x8_zero(), f32x8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        prefetch(w, o2 + PREFETCH_BYTES)
        x, dx = load_i8x32(xq, xo + b * 32), load_f32(xd, xdo + b)
        d, d2 = load_f16_pair(w, o, o2)
        a = f32x8_fma_i32(a, dot_u8x32_plus(_quants_q5_0_unsigned_bcast(w, o), x, lane_sums, lo + 8 * b), d * dx)
        a2 = f32x8_fma_i32(a2, dot_u8x32_plus(_quants_q5_0_unsigned_bcast(w, o2), x, lane_sums, lo + 8 * b),
                           d2 * dx)
        o += 22
        o2 += 22
    return f32x8_hsum(a), f32x8_hsum(a2)


@njit(cache=True)
def vec_dot4_q5_0_q8_0(w, o, nb, xq, xo, x_stride, xd, xdo):
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        q, d, k = _quants_q5_0(w, o), load_f16(w, o), xo + b * 32
        a0 = f32x8_fma_i32(a0, dot_i8x32(q, load_i8x32(xq, k)), d * load_f32(xd, xdo + b))
        a1 = f32x8_fma_i32(a1, dot_i8x32(q, load_i8x32(xq, k + x_stride)), d * load_f32(xd, xdo + nb + b))
        a2 = f32x8_fma_i32(a2, dot_i8x32(q, load_i8x32(xq, k + 2 * x_stride)), d * load_f32(xd, xdo + 2 * nb + b))
        a3 = f32x8_fma_i32(a3, dot_i8x32(q, load_i8x32(xq, k + 3 * x_stride)), d * load_f32(xd, xdo + 3 * nb + b))
        o += 22
    return f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3)


@njit(cache=True)
def tile8_q5_0(w, o, nb, xp, xo, xt, so, xl):
    """The quants unsigned (0..31); the tile's lane sums (times -16) take the offset out."""
    acc = _tile8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        q = _tile_quants_q5_0(w, o)
        acc = _tile8_pairs(acc, q, f32x8_splat(load_f16(w, o)), xp, xo + 256 * b, xt,
                           so + 8 * b, TILE_OFFSET, xl)
        o += 22
    return _tile8_sums(acc)


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
def vec_dot2_q5_1_q8_0(w, o, o2, nb, xq, xo, xds, xso):
    """As vec_dot2_q4_1_q8_0."""
    a, a2, m = f32x8_zero(), f32x8_zero(), f32x4_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        prefetch(w, o2 + PREFETCH_BYTES)
        x = load_i8x32(xq, xo + b * 32)
        s = f32x4_mul(load_f16x2_rows(w, o, o2), load_f32x2_twice(xds, xso + 2 * b))
        m = f32x4_add(m, s)
        a = f32x8_fma_i32(a, dot_u8x32(_quants_q5_1_bcast(w, o), x), f32x4_lane(s, 0))
        a2 = f32x8_fma_i32(a2, dot_u8x32(_quants_q5_1_bcast(w, o2), x), f32x4_lane(s, 2))
        o += 24
        o2 += 24
    return f32x8_hsum(a) + f32x4_lane(m, 1), f32x8_hsum(a2) + f32x4_lane(m, 3)


@njit(cache=True)
def vec_dot4_q5_1_q8_0(w, o, nb, xq, xo, x_stride, xd, xs, xdo):
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    m0 = m1 = m2 = m3 = np.float32(0)
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
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


@njit(cache=True)
def tile8_q5_1(w, o, nb, xp, xo, xt, so, mo):
    acc = _tile8_zero()
    mins = f32x8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        q = _tile_quants_q5_1(w, o)
        mins = f32x8_add(mins, f32x8_mul(f32x8_splat(load_f16(w, o + 2)), load_f32x8(xt, mo + 8 * b)))
        acc = _tile8_pairs(acc, q, f32x8_splat(load_f16(w, o)), xp, xo + 256 * b, xt,
                           so + 8 * b, TILE_UNSIGNED, xp)
        o += 24
    return _tile8_sums_mins(acc, mins)


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
def vec_dot2_q8_0_q8_0(w, o, o2, nb, xq, xo, xd, xdo):
    a, a2 = f32x8_zero(), f32x8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        prefetch(w, o2 + PREFETCH_BYTES)
        x, dx = load_i8x32(xq, xo + b * 32), load_f32(xd, xdo + b)
        d, d2 = load_f16_pair(w, o, o2)
        a = f32x8_fma_i32(a, dot_i8x32(_quants_q8_0(w, o), x), d * dx)
        a2 = f32x8_fma_i32(a2, dot_i8x32(_quants_q8_0(w, o2), x), d2 * dx)
        o += 34
        o2 += 34
    return f32x8_hsum(a), f32x8_hsum(a2)


@njit(cache=True)
def vec_dot4_q8_0_q8_0(w, o, nb, xq, xo, x_stride, xd, xdo):
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        q, d, k = _quants_q8_0(w, o), load_f16(w, o), xo + b * 32
        a0 = f32x8_fma_i32(a0, dot_i8x32(q, load_i8x32(xq, k)), d * load_f32(xd, xdo + b))
        a1 = f32x8_fma_i32(a1, dot_i8x32(q, load_i8x32(xq, k + x_stride)), d * load_f32(xd, xdo + nb + b))
        a2 = f32x8_fma_i32(a2, dot_i8x32(q, load_i8x32(xq, k + 2 * x_stride)), d * load_f32(xd, xdo + 2 * nb + b))
        a3 = f32x8_fma_i32(a3, dot_i8x32(q, load_i8x32(xq, k + 3 * x_stride)), d * load_f32(xd, xdo + 3 * nb + b))
        o += 34
    return f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3)


@njit(cache=True)
def tile8_q8_0(w, o, nb, xp, xo, xt, so, xl):
    """256-bit: the signed quants (dot_i8x32's sign flip). 512-bit: the quants + 128 from the lane sums times -128
    (Q8_0_TILE_KIND, Q8_0_TILE_OFFSET)."""
    acc = _tile8_zero()
    for b in range(nb):
        prefetch(w, o + PREFETCH_BYTES)
        q = _tile_quants_q8_0(w, o)
        acc = _tile8_pairs(acc, q, f32x8_splat(load_f16(w, o)), xp, xo + 256 * b, xt,
                           so + 8 * b, Q8_0_TILE_KIND, xl)
        o += 34
    return _tile8_sums(acc)

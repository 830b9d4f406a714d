"""IQ4_NL: 32-element blocks of a float16 scale and 32 four-bit indices into a 16-value non-linear table.

Block: d f16 | qs[16] (element j < 16 is the low nibble of qs[j], element j + 16 its high nibble); the weight is
d * KVALUES_IQ4NL[index]. Computed against Q8_0-style activations, as llama.cpp's ggml_vec_dot_iq4_nl_q8_0 does on
AVX2: the table lookup gives 32 signed bytes, their dot with the activations goes into 8 exact int32 lanes (four
consecutive elements each), and each block's lanes are added by one FMA with d_w * d_x into one of TWO float
accumulators, even blocks into the first and odd ones into the second; the two are added lane by lane and the
lanes summed (f32x8_hsum's order). With an odd number of blocks the last one is a scalar step after that:
sum += (d_w * d_x) * float(its integer dot), one FMA.

Here: block_iq4_nl, the dequantizer; the four row dots quant.matmul_block32 drives (see quant.dots_block32 for
their contract), each with that arithmetic, so every (row, token) gives the same bits whichever computes it; and
quantize_block_iq4_nl, llama.cpp's quantizer, the operations of quant.reference.quantize_iq4_nl.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.extending import intrinsic

from .dots_block32 import (PREFETCH_BYTES, Q8_0_TILE_KIND, Q8_0_TILE_OFFSET, _tile8_pairs, _tile8_sums_256,
                           _tile8_zero)
from .half_bits import _f16_bits, _put_u16
from .reference import KVALUES_IQ4NL
from .simd import (HAS_AVX2, HAS_WIDE_TILES, I8x32, dot_i8x32, f32x8_add, f32x8_fma_i32, f32x8_hsum,
                   f32x8_zero, f32x16_halves, fma32, i8x32_xor, load_f16, load_f16_pair, load_f16_splat8, load_f32,
                   load_i8x32, prefetch)
from .simd.vector_ir import _call_intrinsic, _load, _ptr, _shuffle, _vec

TILE_OFFSET_IQ4_NL = Q8_0_TILE_OFFSET  # the tiles take the values as Q8_0's quants (signed; +128 for 512-bit)

_I8 = ir.IntType(8)
_TABLE = ir.Constant(_vec(_I8, 16), [int(v) for v in KVALUES_IQ4NL])


def table_values_codegen(table):
    """The codegen of a 4-bit table format's value load (IQ4_NL, MXFP4): the 16 bytes of nibbles at buf[offset] ->
    the 32 values of `table` (an LLVM <16 x i8> constant) as I8x32, low nibbles' values first, then high nibbles'
    (a byte shuffle with the table as its source, vpshufb, where there is one)."""
    def codegen(context, builder, sig, args):
        q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I8, 16))
        mask = ir.Constant(_vec(_I8, 16), [0x0F] * 16)
        halves = []
        for idx in (builder.and_(q, mask), builder.lshr(q, ir.Constant(_vec(_I8, 16), [4] * 16))):
            if HAS_AVX2:
                halves.append(_call_intrinsic(builder, "llvm.x86.ssse3.pshuf.b.128", idx.type, [table, idx]))
            else:  # one lookup per byte: extractelement takes a variable index
                v = ir.Constant(_vec(_I8, 16), ir.Undefined)
                for j in range(16):
                    k = builder.extract_element(idx, ir.Constant(ir.IntType(32), j))
                    v = builder.insert_element(v, builder.extract_element(table, k), ir.Constant(ir.IntType(32), j))
                halves.append(v)
        return _shuffle(builder, halves[0], halves[1], range(32))
    return codegen


@intrinsic
def load_iq4_nl_values(typingctx, buf, offset):
    """IQ4_NL's 32 values of the block whose nibbles are at buf[offset] (table_values_codegen)."""
    return I8x32(buf, offset), table_values_codegen(_TABLE)


@njit(cache=True)
def block_iq4_nl(w, o, out, p):
    d = load_f16(w, o)
    for j in range(16):
        q = np.int32(w[o + 2 + j])
        out[p + j] = d * np.float32(KVALUES_IQ4NL[q & 15])
        out[p + j + 16] = d * np.float32(KVALUES_IQ4NL[q >> 4])


@njit(cache=True)
def _table_tail(w, qo, table, x, xo_lo, xo_hi, scale, total):
    """total + scale * (the last block's integer dot): llama.cpp's scalar step for an odd block count (one FMA),
    for the 4-bit table formats (IQ4_NL, MXFP4). w[qo ...]: the block's 16 nibble bytes; table: its 16 values;
    x[xo_lo ...] and x[xo_hi ...]: the activations of elements 0-15 and 16-31."""
    sumi = 0
    for j in range(16):
        q = np.int32(w[qo + j])
        sumi += np.int32(x[xo_lo + j]) * np.int32(table[q & 15])
        sumi += np.int32(x[xo_hi + j]) * np.int32(table[q >> 4])
    return fma32(scale, np.float32(sumi), total)


@njit(cache=True)
def vec_dot_iq4_nl_q8_0(w, o, nb, xq, xo, xd, xdo):
    a1, a2 = f32x8_zero(), f32x8_zero()
    for b in range(0, nb - 1, 2):
        a1 = f32x8_fma_i32(a1, dot_i8x32(load_iq4_nl_values(w, o + 2), load_i8x32(xq, xo + b * 32)),
                           load_f16(w, o) * load_f32(xd, xdo + b))
        a2 = f32x8_fma_i32(a2, dot_i8x32(load_iq4_nl_values(w, o + 20), load_i8x32(xq, xo + b * 32 + 32)),
                           load_f16(w, o + 18) * load_f32(xd, xdo + b + 1))
        o += 36
    total = f32x8_hsum(f32x8_add(a1, a2))
    if nb % 2:
        b = nb - 1
        total = _table_tail(w, o + 2, KVALUES_IQ4NL, xq, xo + 32 * b, xo + 32 * b + 16,
                            load_f16(w, o) * load_f32(xd, xdo + b), total)
    return total


@njit(cache=True)
def vec_dot2_iq4_nl_q8_0(w, o, o2, nb, xq, xo, xd, xdo):
    """Two rows, each with its own pair of accumulators (vec_dot's bits per row)."""
    a1, a2, c1, c2 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for b in range(0, nb - 1, 2):
        prefetch(w, o + PREFETCH_BYTES)
        prefetch(w, o2 + PREFETCH_BYTES)
        x, dx = load_i8x32(xq, xo + b * 32), load_f32(xd, xdo + b)
        x2, dx2 = load_i8x32(xq, xo + b * 32 + 32), load_f32(xd, xdo + b + 1)
        d, e = load_f16_pair(w, o, o2)
        d2, e2 = load_f16_pair(w, o + 18, o2 + 18)
        a1 = f32x8_fma_i32(a1, dot_i8x32(load_iq4_nl_values(w, o + 2), x), d * dx)
        c1 = f32x8_fma_i32(c1, dot_i8x32(load_iq4_nl_values(w, o2 + 2), x), e * dx)
        a2 = f32x8_fma_i32(a2, dot_i8x32(load_iq4_nl_values(w, o + 20), x2), d2 * dx2)
        c2 = f32x8_fma_i32(c2, dot_i8x32(load_iq4_nl_values(w, o2 + 20), x2), e2 * dx2)
        o += 36
        o2 += 36
    r, r2 = f32x8_hsum(f32x8_add(a1, a2)), f32x8_hsum(f32x8_add(c1, c2))
    if nb % 2:
        b = nb - 1
        dx = load_f32(xd, xdo + b)
        r = _table_tail(w, o + 2, KVALUES_IQ4NL, xq, xo + 32 * b, xo + 32 * b + 16, load_f16(w, o) * dx, r)
        r2 = _table_tail(w, o2 + 2, KVALUES_IQ4NL, xq, xo + 32 * b, xo + 32 * b + 16, load_f16(w, o2) * dx, r2)
    return r, r2


@njit(cache=True, inline="always")
def _step4(acc, q, d, xq, k, x_stride, xd, xdo, nb, b):
    a0, a1, a2, a3 = acc
    return (f32x8_fma_i32(a0, dot_i8x32(q, load_i8x32(xq, k)), d * load_f32(xd, xdo + b)),
            f32x8_fma_i32(a1, dot_i8x32(q, load_i8x32(xq, k + x_stride)), d * load_f32(xd, xdo + nb + b)),
            f32x8_fma_i32(a2, dot_i8x32(q, load_i8x32(xq, k + 2 * x_stride)), d * load_f32(xd, xdo + 2 * nb + b)),
            f32x8_fma_i32(a3, dot_i8x32(q, load_i8x32(xq, k + 3 * x_stride)), d * load_f32(xd, xdo + 3 * nb + b)))


@njit(cache=True)
def vec_dot4_iq4_nl_q8_0(w, o, nb, xq, xo, x_stride, xd, xdo):
    """One row x four tokens: each block decoded once, each token with its own pair of accumulators."""
    z = f32x8_zero()
    even, odd = (z, z, z, z), (z, z, z, z)
    for b in range(0, nb - 1, 2):
        prefetch(w, o + PREFETCH_BYTES)
        even = _step4(even, load_iq4_nl_values(w, o + 2), load_f16(w, o), xq, xo + b * 32, x_stride, xd, xdo, nb, b)
        odd = _step4(odd, load_iq4_nl_values(w, o + 20), load_f16(w, o + 18), xq, xo + b * 32 + 32, x_stride, xd, xdo,
                     nb, b + 1)
        o += 36
    r0, r1 = f32x8_hsum(f32x8_add(even[0], odd[0])), f32x8_hsum(f32x8_add(even[1], odd[1]))
    r2, r3 = f32x8_hsum(f32x8_add(even[2], odd[2])), f32x8_hsum(f32x8_add(even[3], odd[3]))
    if nb % 2:
        b = nb - 1
        k, d = xo + 32 * b, load_f16(w, o)
        r0 = _table_tail(w, o + 2, KVALUES_IQ4NL, xq, k, k + 16, d * load_f32(xd, xdo + b), r0)
        r1 = _table_tail(w, o + 2, KVALUES_IQ4NL, xq, k + x_stride, k + x_stride + 16,
                         d * load_f32(xd, xdo + nb + b), r1)
        r2 = _table_tail(w, o + 2, KVALUES_IQ4NL, xq, k + 2 * x_stride, k + 2 * x_stride + 16,
                         d * load_f32(xd, xdo + 2 * nb + b), r2)
        r3 = _table_tail(w, o + 2, KVALUES_IQ4NL, xq, k + 3 * x_stride, k + 3 * x_stride + 16,
                         d * load_f32(xd, xdo + 3 * nb + b), r3)
    return r0, r1, r2, r3


@njit(cache=True)
def _tile_values_plus128(w, o):
    """The values + 128 for the 512-bit tiles (vpdpbusd's unsigned side; the activations' lane sums times -128 take
    the offset out, as for Q8_0)."""
    return i8x32_xor(load_iq4_nl_values(w, o + 2), -128)


@njit(cache=True)
def _tile_values_signed(w, o):
    return load_iq4_nl_values(w, o + 2)


@njit(cache=True)
def _tile8_added_wide(even, odd):
    """The two accumulators of each token added lane by lane, as the 256-bit tiles' eight F32x8."""
    e0, e1 = f32x16_halves(even[0])
    e2, e3 = f32x16_halves(even[1])
    e4, e5 = f32x16_halves(even[2])
    e6, e7 = f32x16_halves(even[3])
    o0, o1 = f32x16_halves(odd[0])
    o2, o3 = f32x16_halves(odd[1])
    o4, o5 = f32x16_halves(odd[2])
    o6, o7 = f32x16_halves(odd[3])
    return (f32x8_add(e0, o0), f32x8_add(e1, o1), f32x8_add(e2, o2), f32x8_add(e3, o3), f32x8_add(e4, o4),
            f32x8_add(e5, o5), f32x8_add(e6, o6), f32x8_add(e7, o7))


@njit(cache=True)
def _tile8_added_256(even, odd):
    return (f32x8_add(even[0], odd[0]), f32x8_add(even[1], odd[1]), f32x8_add(even[2], odd[2]),
            f32x8_add(even[3], odd[3]), f32x8_add(even[4], odd[4]), f32x8_add(even[5], odd[5]),
            f32x8_add(even[6], odd[6]), f32x8_add(even[7], odd[7]))


if HAS_WIDE_TILES:
    _tile_values, _tile8_added = _tile_values_plus128, _tile8_added_wide
else:
    _tile_values, _tile8_added = _tile_values_signed, _tile8_added_256


@njit(cache=True)
def _tile_tail(w, o, xp, xo, xt, so, j, total):
    """_tail for token j of an eight-token tile (quant.dots_block32._pack_tiles8's layout: token j is half j % 2
    of pair j // 2, elements 0-15 then, 32 bytes on, 16-31)."""
    base = xo + 64 * (j // 2) + 16 * (j % 2)
    return _table_tail(w, o + 2, KVALUES_IQ4NL, xp, base, base + 32, load_f16(w, o) * load_f32(xt, so + j), total)


@njit(cache=True)
def tile8_iq4_nl(w, o, nb, xp, xo, xt, so, xl):
    """One row x eight tokens: even blocks into one tile of accumulators, odd blocks into another."""
    even, odd = _tile8_zero(), _tile8_zero()
    for b in range(0, nb - 1, 2):
        prefetch(w, o + PREFETCH_BYTES)
        even = _tile8_pairs(even, _tile_values(w, o), load_f16_splat8(w, o), xp, xo + 256 * b, xt, so + 8 * b,
                            Q8_0_TILE_KIND, xl)
        odd = _tile8_pairs(odd, _tile_values(w, o + 18), load_f16_splat8(w, o + 18), xp, xo + 256 * (b + 1), xt,
                           so + 8 * (b + 1), Q8_0_TILE_KIND, xl)
        o += 36
    r = _tile8_sums_256(_tile8_added(even, odd))
    if nb % 2:
        b = nb - 1
        xo_b, so_b = xo + 256 * b, so + 8 * b
        return (_tile_tail(w, o, xp, xo_b, xt, so_b, 0, r[0]), _tile_tail(w, o, xp, xo_b, xt, so_b, 1, r[1]),
                _tile_tail(w, o, xp, xo_b, xt, so_b, 2, r[2]), _tile_tail(w, o, xp, xo_b, xt, so_b, 3, r[3]),
                _tile_tail(w, o, xp, xo_b, xt, so_b, 4, r[4]), _tile_tail(w, o, xp, xo_b, xt, so_b, 5, r[5]),
                _tile_tail(w, o, xp, xo_b, xt, so_b, 6, r[6]), _tile_tail(w, o, xp, xo_b, xt, so_b, 7, r[7]))
    return r


# --- quantizer ---------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _nearest_level(v):
    """best_index_int8 over the 16 levels (quant.reference._nearest_iq4nl)."""
    if v <= np.float32(KVALUES_IQ4NL[0]):
        return 0
    if v >= np.float32(KVALUES_IQ4NL[15]):
        return 15
    lo, hi = 0, 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if v < np.float32(KVALUES_IQ4NL[mid]):
            hi = mid
        else:
            lo = mid
    return hi - 1 if v - np.float32(KVALUES_IQ4NL[hi - 1]) < np.float32(KVALUES_IQ4NL[hi]) - v else hi


@njit(cache=True)
def _fit(x, inv):
    sumqx, sumq2 = np.float32(0), np.float32(0)
    for j in range(32):
        q = np.float32(KVALUES_IQ4NL[_nearest_level(inv * x[j])])
        wq = (x[j] * x[j]) * q
        sumqx += wq * x[j]
        sumq2 += wq * q
    return sumqx, sumq2


@njit(cache=True)
def block_scale_iq4_nl(x):
    """The scale llama.cpp's search picks for the 32 values x (quant.reference._iq4nl_block_scales); 0 for a block
    under GROUP_MAX_EPS. No fastmath: nothing is contracted into an FMA."""
    amax, vmax = np.float32(0), np.float32(0)
    for j in range(32):
        if abs(x[j]) > amax:
            amax, vmax = abs(x[j]), x[j]
    if amax < np.float32(1e-15):
        return np.float32(0)
    d = -vmax / np.float32(KVALUES_IQ4NL[0])
    sumqx, sumq2 = _fit(x, np.float32(1) / d)
    d = sumqx / sumq2 if sumq2 > 0 else np.float32(0)
    best = d * sumqx
    for itry in range(-7, 8):
        sumqx, sumq2 = _fit(x, np.float32(itry + np.int32(KVALUES_IQ4NL[0])) / vmax)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(cache=True, inline="always")
def nearest_level_iq4_nl(v):
    return _nearest_level(v)


@njit(cache=True)
def quantize_block_iq4_nl(x, out, q):
    """x float32[32] -> out uint8[18] (q: scratch, unused)."""
    scale = block_scale_iq4_nl(x)
    inv = np.float32(1) / scale if scale != 0 else np.float32(0)
    _put_u16(out, 0, _f16_bits(scale))
    for j in range(16):
        out[2 + j] = _nearest_level(inv * x[j]) | (_nearest_level(inv * x[j + 16]) << 4)

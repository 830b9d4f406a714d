"""Integer dot products: 32 int8 x 32 int8 -> I32x8 partial sums, lane m = elements 4m..4m+3, optionally scaled per
pair of elements and added to starting lanes. The lanes come from the host's instructions (simd.dot_x86: AVX2 or
AVX-VNNI; simd.dot_aarch64: sdot or NEON) or, elsewhere, generic widening ops computing the same integers.
"""

from numba import types
from numba.extending import intrinsic

from .dot_aarch64 import aarch64_addp, aarch64_chained_dot, aarch64_dot_lanes, aarch64_sdot_half
from .dot_x86 import avx2_dot_lanes
from .host import HAS_AVX2, HAS_DOTPROD, IS_AARCH64
from .i32x8 import bytes_i32x4, signed_bytes_i32x4
from .vector_ir import I8x32, I32x8, _I8, _I16, _I32, _load, _ptr, _shuffle, _splat, _vec


def _dot_lanes(builder, w, x, signed, pair_scales=None, base=None):
    """<8 x i32> lane m = base[m] + sum over e in 4m..4m+3 of w[e] * x[e] * scale(e), scale from the <16 x i16>
    pair_scales (one per pair of elements; None means 1), base an <8 x i32> (None means 0)."""
    if HAS_AVX2:
        return avx2_dot_lanes(builder, w, x, signed, pair_scales, base)
    if HAS_DOTPROD or IS_AARCH64:
        return aarch64_dot_lanes(builder, w, x, pair_scales, base)
    wide = (builder.sext if signed else builder.zext)(w, _vec(_I32, 32))
    p = builder.mul(wide, builder.sext(x, _vec(_I32, 32)))
    pairs = builder.add(_shuffle(builder, p, p, range(0, 32, 2)), _shuffle(builder, p, p, range(1, 32, 2)))
    if pair_scales is not None:
        pairs = builder.mul(pairs, builder.sext(pair_scales, _vec(_I32, 16)))
    even = _shuffle(builder, pairs, pairs, range(0, 16, 2))
    lanes = builder.add(even, _shuffle(builder, pairs, pairs, range(1, 16, 2)))
    return lanes if base is None else builder.add(base, lanes)


def _half_scales(builder, lo, hi):
    """<16 x i16>: lo for the pairs of elements 0..15, hi for 16..31."""
    lo, hi = _splat(builder, builder.trunc(lo, _I16), 16), _splat(builder, builder.trunc(hi, _I16), 16)
    return _shuffle(builder, lo, hi, list(range(8)) + list(range(24, 32)))


def _make_dot(name, signed, scaled, doc):
    if scaled:
        def typer(typingctx, w, x, scale_lo, scale_hi):
            if w is not I8x32 or x is not I8x32:
                return None

            def codegen(context, builder, sig, args):
                return _dot_lanes(builder, args[0], args[1], signed, _half_scales(builder, args[2], args[3]))
            return I32x8(w, x, types.int32, types.int32), codegen
    else:
        def typer(typingctx, w, x):
            if w is not I8x32 or x is not I8x32:
                return None

            def codegen(context, builder, sig, args):
                return _dot_lanes(builder, args[0], args[1], signed)
            return I32x8(w, x), codegen
    typer.__name__, typer.__doc__ = name, doc
    return intrinsic(typer)


@intrinsic
def dot_u8x32_plus(typingctx, w, x, buf, offset):
    """The 8 int32 at buf[offset] (an element offset: bytes for an int8 buffer, lanes for an int32 one) plus the
    lanes of w . x, w 0..127 (vpdpbusd's accumulator where HAS_VNNI). A format whose quants carry an offset
    (q = u - c) takes u unsigned and starts each lane at -c x the sum of its four activations: the same integers as
    the signed dot, without flipping the activations' signs per dot."""
    if w is not I8x32 or x is not I8x32 or not isinstance(offset, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        base = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3]), _vec(_I32, 8))
        return _dot_lanes(builder, args[0], args[1], False, base=base)
    return I32x8(w, x, buf, offset), codegen


dot_i8x32 = _make_dot("dot_i8x32", True, False, "Lanes of w . x, w any signed bytes (x within +-127).")
dot_u8x32 = _make_dot("dot_u8x32", False, False, "Lanes of w . x, w known to be 0..127 (saves the sign flip).")
dot_i8x32_2scales = _make_dot("dot_i8x32_2scales", True, True,
                              "Lanes of w . x with elements 0..15 times scale_lo and 16..31 times scale_hi "
                              "(int16-range scales).")
dot_u8x32_2scales = _make_dot("dot_u8x32_2scales", False, True, "dot_i8x32_2scales for w in 0..127.")



@intrinsic
def dot4_u8x32_byte_scales(typingctx, acc, w0, x0, w1, x1, w2, x2, w3, x3, word, h):
    """acc plus lanes whose total is the sum over k = 0..3 of (wk . xk) times byte 4h + k of `word` (w 0..127, h a
    compile-time constant 0 or 1): four of a Q4_K super-block's 32-element groups, for a caller that keeps only the
    lanes' total. x86 adds the four dots' lanes, each scaled by its byte. AArch64 with dotprod chains each group's
    two sdot into four lanes, folds the four groups into one vector of group totals (three addp) and scales it with
    one mul by the four widened scale bytes into acc's half h: one vector multiply for four groups."""
    vectors = (w0, x0, w1, x1, w2, x2, w3, x3)
    if acc is not I32x8 or any(v is not I8x32 for v in vectors) or not isinstance(h, types.IntegerLiteral) \
            or h.literal_value not in (0, 1):
        return None
    half = h.literal_value

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[9], sig.args[9], types.uint64)
        scales = builder.bitcast(word, _vec(_I8, 8))
        acc, pairs = args[0], [(args[1 + 2 * k], args[2 + 2 * k]) for k in range(4)]
        if not HAS_DOTPROD:  # the four scaled dots summed as a tree, then added to acc
            scales = builder.zext(scales, _vec(_I16, 8))
            lanes = [_dot_lanes(builder, w, x, False, _shuffle(builder, scales, scales, [4 * half + k] * 16))
                     for k, (w, x) in enumerate(pairs)]
            return builder.add(acc, builder.add(builder.add(lanes[0], lanes[1]), builder.add(lanes[2], lanes[3])))
        sums = [aarch64_chained_dot(builder, w, x) for w, x in pairs]
        totals = aarch64_addp(builder, aarch64_addp(builder, *sums[:2]), aarch64_addp(builder, *sums[2:]))
        part = builder.add(_shuffle(builder, acc, acc, range(4 * half, 4 * half + 4)),
                           builder.mul(totals, bytes_i32x4(builder, scales, half)))
        kept = _shuffle(builder, acc, acc, range(4 - 4 * half, 8 - 4 * half))
        return _shuffle(builder, *((part, kept) if half == 0 else (kept, part)), range(8))
    return I32x8(acc, *vectors, word, h), codegen


@intrinsic
def dot_u8x32_scale_pair(typingctx, w, x, buf, offset, g):
    """Lanes of w . x (w 0..127) with elements 0..15 times the signed byte buf[offset + 2g] and 16..31 times
    buf[offset + 2g + 1] (g a compile-time constant 0..7): dot_u8x32_2scales for a block's sixteen int8 scales,
    which are loaded and widened once for all g (a Q6_K super-block's) instead of one scalar at a time."""
    if w is not I8x32 or x is not I8x32 or not isinstance(g, types.IntegerLiteral) or not 0 <= g.literal_value < 8:
        return None
    lane = g.literal_value

    def codegen(context, builder, sig, args):
        scales = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3]), _vec(_I8, 16))
        if HAS_DOTPROD:  # each half's sdot times its scale as a lane of a widened vector: an mla by element, no dup
            halves = []
            for h, k in enumerate((2 * lane, 2 * lane + 1)):
                quad = signed_bytes_i32x4(builder, scales, k // 4)
                halves.append(builder.mul(aarch64_sdot_half(builder, args[0], args[1], h),
                                          _shuffle(builder, quad, quad, [k % 4] * 4)))
            return _shuffle(builder, halves[0], halves[1], range(8))
        scales = builder.sext(scales, _vec(_I16, 16))
        pair_scales = _shuffle(builder, scales, scales, [2 * lane] * 8 + [2 * lane + 1] * 8)
        return _dot_lanes(builder, args[0], args[1], False, pair_scales)
    return I32x8(w, x, buf, offset, g), codegen


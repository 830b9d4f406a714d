"""The int8 dot product's lanes on AArch64: two sdot where the CPU has the dot-product extension, else plain NEON's
smull + saddlp + addp. Both sum the four signed byte products of each int32 lane, the lanes of simd.dots.
"""

from llvmlite import ir

from .host import HAS_DOTPROD
from .vector_ir import _I16, _I32, _call_intrinsic, _shuffle, _vec


def aarch64_dot_lanes(builder, w, x, pair_scales, base):
    """simd.dots._dot_lanes on an AArch64 host. Signed instructions also for "unsigned" quants: they are 0..127
    (the contracts of the dot_u8x32 family)."""
    i32x8 = _vec(_I32, 8)
    if HAS_DOTPROD:
        start = base if base is not None and pair_scales is None else ir.Constant(i32x8, None)
        lanes = _sdot_i8x32(builder, start, w, x)
        if pair_scales is None:
            return lanes
    else:
        lanes = _neon_dot_i8x32(builder, w, x)
        if pair_scales is None:
            return lanes if base is None else builder.add(base, lanes)
    # every caller gives both pairs of a lane the same scale (a scale per 16 or 32 elements): lane m takes pair 2m's
    lanes = builder.mul(lanes, builder.sext(_shuffle(builder, pair_scales, pair_scales, range(0, 16, 2)), i32x8))
    return lanes if base is None else builder.add(base, lanes)


def aarch64_sdot_half(builder, w, x, h, acc=None):
    """<4 x i32> acc (None: zeros) plus lanes 4h .. 4h+3 of w . x (signed bytes): one sdot
    (llvm.aarch64.neon.sdot) on the 128-bit half h."""
    i32x4, lanes = _vec(_I32, 4), range(16 * h, 16 * h + 16)
    return _call_intrinsic(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", i32x4,
                           [ir.Constant(i32x4, None) if acc is None else acc, _shuffle(builder, w, w, lanes),
                            _shuffle(builder, x, x, lanes)])


def aarch64_chained_dot(builder, w, x):
    """<4 x i32> whose total is w . x (signed bytes): the two halves' sdot chained into one accumulator, each lane
    the sum of eight products (elements 4m..4m+3 and 16+4m..16+4m+3). For callers that only keep the total."""
    return aarch64_sdot_half(builder, w, x, 1, aarch64_sdot_half(builder, w, x, 0))


def aarch64_addp(builder, a, b):
    """<4 x i32> [a0+a1, a2+a3, b0+b1, b2+b3] (addp)."""
    return _call_intrinsic(builder, "llvm.aarch64.neon.addp.v4i32", _vec(_I32, 4), [a, b])


def _sdot_i8x32(builder, start, w, x):
    """<8 x i32> start + lanes of w . x (signed bytes) as two sdot on the 128-bit halves."""
    halves = [aarch64_sdot_half(builder, w, x, h, _shuffle(builder, start, start, range(4 * h, 4 * h + 4)))
              for h in (0, 1)]
    return _shuffle(builder, halves[0], halves[1], range(8))


def _neon_dot_i8x32(builder, w, x):
    """<8 x i32> lanes of w . x on AArch64 without dotprod: per 8 bytes smull (int16 products, |p| <= 128 x 127),
    saddlp (pairs to int32), then addp of two such (fours): 14 instructions for 32 bytes where LLVM's own lowering
    of widening multiplies took 22."""
    i16x8, i32x4 = _vec(_I16, 8), _vec(_I32, 4)
    quarters = []
    for q in range(4):
        lanes = range(8 * q, 8 * q + 8)
        p = _call_intrinsic(builder, "llvm.aarch64.neon.smull.v8i16", i16x8,
                            [_shuffle(builder, w, w, lanes), _shuffle(builder, x, x, lanes)])
        quarters.append(_call_intrinsic(builder, "llvm.aarch64.neon.saddlp.v4i32.v8i16", i32x4, [p]))
    halves = [aarch64_addp(builder, *quarters[2 * h:2 * h + 2])
              for h in (0, 1)]
    return _shuffle(builder, halves[0], halves[1], range(8))

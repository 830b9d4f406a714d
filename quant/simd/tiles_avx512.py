"""512-bit tile steps (AVX-512 with VNNI, host.HAS_WIDE_TILES): one vector holds two 256-bit tile accumulators side
by side, so each vpdpbusd, conversion and FMA does the work of two; the lanes and their arithmetic are the 256-bit
ones, so the bits are too.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .f32_lanes import _pair_splats
from .i8x32 import _nibbles_broadcast
from .vector_ir import F32x8, F32x16, I8x32, I8x64, _F32, _I1, _I8, _I32, _call_intrinsic, _load, _ptr, _shuffle, _vec


@intrinsic
def i8x64_tile_quants(typingctx, q):
    """[q 0-15 | q 0-15 | q 16-31 | q 16-31] from the 32 quants of a block (i8x32_dup_lo and _hi side by side)."""
    if q is I8x64:  # already in that form (load_nibbles_tile64)
        return I8x64(q), lambda context, builder, sig, args: args[0]
    if q is not I8x32:
        return None

    def codegen(context, builder, sig, args):
        return _shuffle(builder, args[0], args[0], list(range(16)) * 2 + list(range(16, 32)) * 2)
    return I8x64(q), codegen


def _nibbles_tile64(context, builder, sig, args):
    return _nibbles_broadcast(context, builder, sig, args, 4)


@intrinsic
def load_nibbles_tile64(typingctx, buf, offset):
    """i8x64_tile_quants(load_nibbles_lo_hi(buf, offset)) without byte shuffles: the 16 bytes in each 128-bit lane
    (a broadcast load), the upper two lanes' words shifted right by 4, then the bytes masked."""
    return I8x64(buf, offset), _nibbles_tile64


@intrinsic
def load_q5_tile64(typingctx, buf, offset, bits_offset):
    """i8x64_tile_quants of a Q5 block's 0..31 quants: load_nibbles_tile64(buf, offset) with 16 added where bit j of
    the little-endian uint32 at buf[bits_offset] is set (j the quant's index; a masked or)."""
    def codegen(context, builder, sig, args):
        q = _nibbles_tile64(context, builder, sig, args)
        i64 = ir.IntType(64)
        word = builder.zext(_load(builder, _ptr(context, builder, sig.args[0], args[0], args[2]), _I32), i64)
        lo = builder.and_(word, ir.Constant(i64, 0xFFFF))
        hi = builder.lshr(word, ir.Constant(i64, 16))
        m = builder.or_(builder.or_(lo, builder.shl(lo, ir.Constant(i64, 16))),
                        builder.or_(builder.shl(hi, ir.Constant(i64, 32)), builder.shl(hi, ir.Constant(i64, 48))))
        mask = builder.bitcast(m, _vec(_I1, 64))
        return builder.select(mask, builder.or_(q, ir.Constant(_vec(_I8, 64), [16] * 64)), q)
    return I8x64(buf, offset, bits_offset), codegen


@intrinsic
def f32x16_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_vec(_F32, 16), None)
    return F32x16(), codegen



f32x16_pair_scales = _pair_splats("f32x16_pair_scales", F32x16, 2, "Four vectors from the 8 lanes of v: the k-th is "
                                  "[v[2k] x4 | v[2k+1] x4] twice (a 512-bit tile pair's scales).")


# The tile steps convert their int32 lanes to float by adding them to the bits of 1.5 x 2^23 and subtracting
# that float: exact for |lanes| < 2^22 (every block32 dot is within 2^18), so the same value as vcvtdq2ps, and
# the start is folded into vpdpbusd's accumulator. The subtraction may issue on either vector port, where
# vcvtdq2ps (512-bit) waits for port 0 beside the dots themselves.
TILE_START = 0x4B400000
_TILE_START_FLOAT = 12582912.0


@intrinsic
def f32x16_tile_step(typingctx, acc, w, buf, offset, base, base_offset, scales):
    """acc + float(lanes) * scales with one rounding per lane, lanes = w . buf[offset:offset + 64] per group of four
    bytes (w unsigned bytes, 0..255: vpdpbusd has no int16 step to saturate), each lane starting from the 16 int32 at
    base[base_offset] less TILE_START where base is an array (its lanes hold TILE_START plus the starting sums), or
    from zero (None). |lanes| < 2^22. The 512-bit vpdpbusd, conversion and vfmadd of two 256-bit tile steps."""
    if acc is not F32x16 or w is not I8x64 or scales is not F32x16:
        return None
    with_base = isinstance(base, types.Array)

    def codegen(context, builder, sig, args):
        i32x16, f32x16 = _vec(_I32, 16), _vec(_F32, 16)
        x = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3]), _vec(_I8, 64))
        start = (_load(builder, _ptr(context, builder, sig.args[4], args[4], args[5]), i32x16) if with_base
                 else ir.Constant(i32x16, [TILE_START] * 16))
        lanes = _call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.512", i32x16,
                                [start, builder.bitcast(args[1], i32x16), builder.bitcast(x, i32x16)])
        value = builder.fsub(builder.bitcast(lanes, f32x16), ir.Constant(f32x16, [_TILE_START_FLOAT] * 16))
        return _call_intrinsic(builder, "llvm.fma.v16f32", f32x16, [value, args[6], args[0]])
    return F32x16(acc, w, buf, offset, base, base_offset, scales), codegen


@intrinsic
def f32x16_tile_sums8(typingctx, a, b, c, d):
    """Lane j: token j's sum of an eight-token 512-bit tile, pair k's accumulator the k-th argument (tokens 2k and
    2k + 1), in f32x8_hsum_split's order for each token ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), so the
    bits of the 256-bit tile's sums: the eight reduced together by shuffles between the vectors."""
    if not all(v is F32x16 for v in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        def halves(x, y):  # [2k: l0+l4 .. l3+l7 | 2k+1: ...] for x's pair, then y's
            return builder.fadd(_shuffle(builder, x, y, [*range(8), *range(16, 24)]),
                                _shuffle(builder, x, y, [*range(8, 16), *range(24, 32)]))
        t_lo, t_hi = halves(args[0], args[1]), halves(args[2], args[3])  # tokens 0-3, 4-7: four partials each
        first = [i for k in range(4) for i in (4 * k, 4 * k + 1, 16 + 4 * k, 17 + 4 * k)]
        u = builder.fadd(_shuffle(builder, t_lo, t_hi, first), _shuffle(builder, t_lo, t_hi, [i + 2 for i in first]))
        v = builder.fadd(_shuffle(builder, u, u, range(0, 16, 2)), _shuffle(builder, u, u, range(1, 16, 2)))
        return _shuffle(builder, v, v, [0, 2, 4, 6, 1, 3, 5, 7])  # v: tokens 0, 4, 1, 5, 2, 6, 3, 7
    return F32x8(a, b, c, d), codegen


@intrinsic
def f32x16_halves(typingctx, v):
    """(lanes 0-7, lanes 8-15) of v."""
    if v is not F32x16:
        return None

    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, sig.return_type, [_shuffle(builder, args[0], args[0], range(8)),
                                                             _shuffle(builder, args[0], args[0], range(8, 16))])
    return types.UniTuple(F32x8, 2)(v), codegen


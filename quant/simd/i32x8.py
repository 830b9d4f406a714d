"""I32x8: integer lane arithmetic on the int8 dots' partial sums: splats, adds, multiplies, loads, horizontal sums
(one, two, four or eight vectors at once) and the K-quants' packed scale bytes as lanes.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .dot_aarch64 import aarch64_addp
from .host import IS_AARCH64
from .vector_ir import I32x8, _I8, _I16, _I32, _call_intrinsic, _load, _ptr, _shuffle, _splat, _vec


def bytes_i32x4(builder, v, h):
    """Bytes 4h .. 4h+3 of the <8 x i8> v, zero-extended to <4 x i32> through <8 x i16> (ushll, ushll2 on AArch64):
    a <4 x i8> step would be widened by zipping with an undefined register, a false dependency on whatever it held."""
    wide = builder.zext(v, _vec(_I16, 8))
    return builder.zext(_shuffle(builder, wide, wide, range(4 * h, 4 * h + 4)), _vec(_I32, 4))


def signed_bytes_i32x4(builder, v, q):
    """Bytes 4q .. 4q+3 of the <16 x i8> v, sign-extended to <4 x i32> as (b ^ 128) zero-extended through <8 x i16>,
    minus 128: on AArch64 fewer instructions than LLVM's own lowering of a sign extension from <4 x i8> (a zip, a
    widening and two shifts, or a dup)."""
    flipped = builder.xor(v, ir.Constant(_vec(_I8, 16), [128] * 16))
    half = _shuffle(builder, flipped, flipped, range(8 * (q // 2), 8 * (q // 2) + 8))
    return builder.sub(bytes_i32x4(builder, half, q % 2), ir.Constant(_vec(_I32, 4), [128] * 4))


@intrinsic
def i32x8_mins_dot(typingctx, word, buf, offset):
    """Lanes whose total is the sum over k = 0..15 of byte k // 2 of the 64-bit `word` times the int32
    buf[offset + k]: a K-quant super-block's eight mins against its sixteen 16-element activation sums, for a caller
    that keeps only the total. x86 multiplies the sums by the mins, each min twice; AArch64 adds the
    sums in pairs first (addp) and multiplies four lanes by four mins twice, half the vector multiplies."""
    if not isinstance(offset, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[0], sig.args[0], types.uint64)
        v = builder.bitcast(word, _vec(_I8, 8))

        def at(k):
            return _ptr(context, builder, sig.args[1], args[1], builder.add(args[2], ir.Constant(args[2].type, k)))
        if not IS_AARCH64:
            total = None
            for h in (0, 1):
                prod = builder.mul(builder.zext(_shuffle(builder, v, v, [4 * h + k // 2 for k in range(8)]),
                                                _vec(_I32, 8)),
                                   _load(builder, at(8 * h), _vec(_I32, 8)))
                total = prod if total is None else builder.add(total, prod)
            return total
        i32x4 = _vec(_I32, 4)
        quarters = [_load(builder, at(4 * q), i32x4) for q in range(4)]
        total = None
        for h in (0, 1):
            pairs = aarch64_addp(builder, *quarters[2 * h:2 * h + 2])
            prod = builder.mul(pairs, bytes_i32x4(builder, v, h))
            total = prod if total is None else builder.add(total, prod)
        return _shuffle(builder, total, ir.Constant(i32x4, None), range(8))
    return I32x8(word, buf, offset), codegen


@intrinsic
def i32x8_hsum_two(typingctx, a, b):
    """(sum of a's lanes, sum of b's lanes), both reduced in one tree of vector adds (exact integers, any order)."""
    if a is not I32x8 or b is not I32x8:
        return None

    def codegen(context, builder, sig, args):
        a, b = args
        t = builder.add(_shuffle(builder, a, b, [0, 1, 2, 3, 8, 9, 10, 11]),
                        _shuffle(builder, a, b, [4, 5, 6, 7, 12, 13, 14, 15]))
        u = builder.add(_shuffle(builder, t, t, [0, 1, 4, 5]), _shuffle(builder, t, t, [2, 3, 6, 7]))
        v = builder.add(_shuffle(builder, u, u, [0, 2]), _shuffle(builder, u, u, [1, 3]))
        return context.make_tuple(builder, sig.return_type, [builder.extract_element(v, ir.Constant(_I32, i))
                                                             for i in (0, 1)])
    return types.UniTuple(types.int32, 2)(a, b), codegen


@intrinsic
def i32x8_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_vec(_I32, 8), [0] * 8)
    return I32x8(), codegen


@intrinsic
def i32x8_add(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return I32x8(a, b), codegen


@intrinsic
def i32x8_hsum4(typingctx, a, b, c, d):
    """(sum of a's 8 lanes, of b's, c's, d's) as a tuple of int32, with one transposing tree of shuffles and adds
    for the four (an integer sum: any order gives the same value)."""
    if not all(v is I32x8 for v in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        a_, b_, c_, d_ = args
        ab = builder.add(_shuffle(builder, a_, b_, [0, 1, 2, 3, 8, 9, 10, 11]),
                         _shuffle(builder, a_, b_, [4, 5, 6, 7, 12, 13, 14, 15]))  # a halves, b halves
        cd = builder.add(_shuffle(builder, c_, d_, [0, 1, 2, 3, 8, 9, 10, 11]),
                         _shuffle(builder, c_, d_, [4, 5, 6, 7, 12, 13, 14, 15]))
        q = builder.add(_shuffle(builder, ab, cd, [0, 1, 4, 5, 8, 9, 12, 13]),
                        _shuffle(builder, ab, cd, [2, 3, 6, 7, 10, 11, 14, 15]))  # a a b b c c d d
        r = builder.add(_shuffle(builder, q, q, [0, 2, 4, 6]), _shuffle(builder, q, q, [1, 3, 5, 7]))
        values = [builder.extract_element(r, ir.Constant(_I32, i)) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, values)
    return types.UniTuple(types.int32, 4)(a, b, c, d), codegen


@intrinsic
def i32x8_hsum8(typingctx, a, b, c, d, e, f, g, h):
    """An I32x8 whose lane k is the sum of the k-th argument's 8 lanes (integer sums: any order gives the same
    value), from one transposing tree of shuffles and adds."""
    args_t = (a, b, c, d, e, f, g, h)
    if not all(v is I32x8 for v in args_t):
        return None

    def codegen(context, builder, sig, args):
        def halves(x, y):  # x's and y's 128-bit halves added: x0+x4 .. x3+x7 | y0+y4 .. y3+y7
            return builder.add(_shuffle(builder, x, y, [0, 1, 2, 3, 8, 9, 10, 11]),
                               _shuffle(builder, x, y, [4, 5, 6, 7, 12, 13, 14, 15]))
        # ab = a(4) | b(4) partial sums: four vectors of two sums' halves each
        return _sum_halves4(builder, halves(args[0], args[1]), halves(args[2], args[3]), halves(args[4], args[5]),
                            halves(args[6], args[7]))
    return I32x8(*args_t), codegen


def _sum_halves4(builder, a, b, c, d):
    """Lane k: the sum of the k-th 128-bit half of a, b, c, d (a's low, a's high, b's low, ...)."""
    def pairs(x, y):  # adjacent lanes added within each half: x01 x23 y01 y23 | x45 x67 y45 y67
        return builder.add(_shuffle(builder, x, y, [0, 2, 8, 10, 4, 6, 12, 14]),
                           _shuffle(builder, x, y, [1, 3, 9, 11, 5, 7, 13, 15]))
    # pairs(a, b) = a_lo a_lo b_lo b_lo | a_hi a_hi b_hi b_hi; once more: a_lo b_lo c_lo d_lo | a_hi b_hi c_hi d_hi
    r = pairs(pairs(a, b), pairs(c, d))
    return _shuffle(builder, r, r, [0, 4, 1, 5, 2, 6, 3, 7])


@intrinsic
def i32x8_hsum_halves4(typingctx, a, b, c, d):
    """An I32x8 whose lane k is the sum of the k-th 128-bit half of a, b, c, d (a's low half, a's high half, b's low
    ...): eight sums of four lanes, e.g. two rows' partial dots per argument (integer sums: any order)."""
    if not all(v is I32x8 for v in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        return _sum_halves4(builder, *args)
    return I32x8(a, b, c, d), codegen


@intrinsic
def i32x8_splat(typingctx, x):
    """8 lanes of the integer x (truncated to int32)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        v = builder.trunc(v, _I32) if v.type.width > 32 else builder.sext(v, _I32) if v.type.width < 32 else v
        return _splat(builder, v, 8)
    return I32x8(x), codegen


@intrinsic
def i32x8_mul(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.mul(args[0], args[1])
    return I32x8(a, b), codegen


@intrinsic
def load_i32x8(typingctx, buf, offset):
    """8 int32 at buf[offset] (an element offset into an int32 array)."""
    def codegen(context, builder, sig, args):
        return _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I32, 8))
    return I32x8(buf, offset), codegen


@intrinsic
def i32x8_madd(typingctx, acc, v, scale):
    """acc + v * scale (scale an int32 scalar)."""
    def codegen(context, builder, sig, args):
        return builder.add(args[0], builder.mul(args[1], _splat(builder, args[2], 8)))
    return I32x8(acc, v, types.int32), codegen


@intrinsic
def pair_dot_i8_i32(typingctx, w, o, b, bo):
    """I32x8 lane l = w[o+2l] * b[bo+2l] + w[o+2l+1] * b[bo+2l+1]: 16 signed bytes at byte offset o of a uint8
    buffer times 16 int32 at element offset bo of an int32 array, summed in pairs."""
    def codegen(context, builder, sig, args):
        wv = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I8, 16))
        bv = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3]), _vec(_I32, 16))
        p = builder.mul(builder.sext(wv, _vec(_I32, 16)), bv)
        if IS_AARCH64:  # addp sums neighbours: one instruction per four lanes where two shuffles and an add took three
            quarters = [_shuffle(builder, p, p, range(4 * q, 4 * q + 4)) for q in range(4)]
            halves = [aarch64_addp(builder, *quarters[2 * h:2 * h + 2]) for h in (0, 1)]
            return _shuffle(builder, halves[0], halves[1], range(8))
        return builder.add(_shuffle(builder, p, p, range(0, 16, 2)), _shuffle(builder, p, p, range(1, 16, 2)))
    return I32x8(w, o, b, bo), codegen


@intrinsic
def i32x8_hsum(typingctx, v):
    def codegen(context, builder, sig, args):
        return _call_intrinsic(builder, "llvm.vector.reduce.add.v8i32", _I32, [args[0]])
    return types.int32(v), codegen

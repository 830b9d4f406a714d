"""Float lanes: F32x8 (FMAs, sums in llama.cpp's reduction orders, loads and stores, float16 and bfloat16 widening,
activation quantization), F32x4 (two rows' block scales side by side) and F32x16's loads, stores, splats, products
and FMAs (the 512-bit token lanes).

Multiply-adds are explicit llvm.fma calls (one rounding, on every target: an FMA instruction where the CPU has one,
a correctly rounded libm call where not) and nothing is reassociated, so each lane's sum keeps its order and a
kernel gives the same bits on every host and whatever the tiling around it.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .host import IS_AARCH64
from .vector_ir import (F32x4, F32x8, F32x16, I32x8, _F32, _I8, _I16, _I32, _I64, _call_intrinsic,
                        _f16_to_f32, _load, _ptr, _shuffle, _splat, _store, _vec)

@intrinsic
def f32x8_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_vec(_F32, 8), [0.0] * 8)
    return F32x8(), codegen


@intrinsic
def f32x8_fma_i32(typingctx, acc, v, scale):
    """acc + float(v) * scale with one rounding per lane (an FMA, as llama.cpp's _mm256_fmadd_ps), v an I32x8 and
    scale a float32 scalar."""
    def codegen(context, builder, sig, args):
        vf = builder.sitofp(args[1], _vec(_F32, 8))
        return _call_intrinsic(builder, "llvm.fma.v8f32", _vec(_F32, 8), [vf, _splat(builder, args[2], 8), args[0]])
    return F32x8(acc, v, types.float32), codegen


def _float_fma(vector_type, n, name):
    """An intrinsic `name`(acc, a, b): acc + a * b with one rounding per lane, all vector_type (n lanes)."""
    def typer(typingctx, acc, a, b):
        if acc is not vector_type or a is not vector_type or b is not vector_type:
            return None

        def codegen(context, builder, sig, args):
            return _call_intrinsic(builder, f"llvm.fma.v{n}f32", _vec(_F32, n), [args[1], args[2], args[0]])
        return vector_type(acc, a, b), codegen
    typer.__name__, typer.__doc__ = name, f"acc + a * b with one rounding per lane, all {vector_type.name}."
    return intrinsic(typer)


f32x8_fma = _float_fma(F32x8, 8, "f32x8_fma")
f32x16_fma = _float_fma(F32x16, 16, "f32x16_fma")


@intrinsic
def f32x8_fma_lanes(typingctx, acc, v, scales):
    """acc + float(v) * scales with one rounding per lane: f32x8_fma_i32 with a scale per lane (an F32x8)."""
    if acc is not F32x8 or v is not I32x8 or scales is not F32x8:
        return None

    def codegen(context, builder, sig, args):
        vf = builder.sitofp(args[1], _vec(_F32, 8))
        return _call_intrinsic(builder, "llvm.fma.v8f32", _vec(_F32, 8), [vf, args[2], args[0]])
    return F32x8(acc, v, scales), codegen


@intrinsic
def f32x8_hsum(typingctx, v):
    """Sum of the 8 lanes (pairwise tree, a fixed order)."""
    def codegen(context, builder, sig, args):
        v = args[0]
        for half in (4, 2, 1):
            v = builder.fadd(_shuffle(builder, v, v, range(half)), _shuffle(builder, v, v, range(half, 2 * half)))
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(v), codegen


def _float_binary(vector_type, name, op_name, doc):
    """An intrinsic `name`(a, b) for two vectors of vector_type (F32x8 or F32x4): the IR op op_name, lane by lane."""
    def typer(typingctx, a, b):
        if a is not vector_type or b is not vector_type:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, op_name)(args[0], args[1])
        return vector_type(a, b), codegen
    typer.__name__, typer.__doc__ = name, doc
    return intrinsic(typer)


f32x8_add = _float_binary(F32x8, "f32x8_add", "fadd", "a + b per lane.")
f32x8_sub = _float_binary(F32x8, "f32x8_sub", "fsub", "a - b per lane.")
f32x8_mul = _float_binary(F32x8, "f32x8_mul", "fmul",
                          "a * b per lane (one rounding each: the same bits as scalar products).")
f32x16_mul = _float_binary(F32x16, "f32x16_mul", "fmul", "a * b per lane, one rounding each.")


@intrinsic
def f32x8_from_i32(typingctx, v):
    """The 8 int32 lanes of v as float32 (rounded to nearest, as a scalar conversion)."""
    if v is not I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _vec(_F32, 8))
    return F32x8(v), codegen


def _float_lane(vector_type, n_lanes, name):
    """An intrinsic `name`(v, i): lane i of v (a vector_type of n_lanes floats; i a compile-time constant) as a
    float32."""
    def typer(typingctx, v, i):
        if v is not vector_type or not isinstance(i, types.IntegerLiteral) or not 0 <= i.literal_value < n_lanes:
            return None
        lane = i.literal_value

        def codegen(context, builder, sig, args):
            return builder.extract_element(args[0], ir.Constant(_I32, lane))
        return types.float32(v, i), codegen
    typer.__name__ = name
    typer.__doc__ = f"Lane i of v (i a compile-time constant 0..{n_lanes - 1}) as a float32."
    return intrinsic(typer)


f32x8_lane = _float_lane(F32x8, 8, "f32x8_lane")


@intrinsic
def f32x8_hsum_split(typingctx, p, q):
    """(sum of a's 8 lanes, sum of b's) where p holds lanes 0-3 of two vectors a | b and q their lanes 4-7; each
    sum in f32x8_hsum's order (lane l + lane l+4, then pairs two apart, then the last two), so it gives the bits
    f32x8_hsum would give for a and for b."""
    if p is not F32x8 or q is not F32x8:
        return None

    def codegen(context, builder, sig, args):
        t = builder.fadd(args[0], args[1])  # a0+a4 .. a3+a7 | b0+b4 .. b3+b7
        u = builder.fadd(_shuffle(builder, t, t, [0, 1, 4, 5]), _shuffle(builder, t, t, [2, 3, 6, 7]))

        def lane(k):
            return builder.extract_element(u, ir.Constant(_I32, k))
        sums = [builder.fadd(lane(0), lane(1)), builder.fadd(lane(2), lane(3))]
        return context.make_tuple(builder, sig.return_type, sums)
    return types.UniTuple(types.float32, 2)(p, q), codegen


def _float_splat(vector_type, n, name):
    """An intrinsic `name`(x): n lanes of the scalar x as float32."""
    def typer(typingctx, x):
        def codegen(context, builder, sig, args):
            return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), n)
        return vector_type(x), codegen
    typer.__name__, typer.__doc__ = name, f"{n} lanes of the scalar x as float32."
    return intrinsic(typer)


f32x8_splat = _float_splat(F32x8, 8, "f32x8_splat")
f32x16_splat = _float_splat(F32x16, 16, "f32x16_splat")


def _pair_splats(name, vector_type, times, doc):
    """An intrinsic taking an F32x8 v to four vectors, the k-th [v[2k] x4 | v[2k+1] x4] `times` times over."""
    def typer(typingctx, v):
        if v is not F32x8:
            return None

        def codegen(context, builder, sig, args):
            v = args[0]
            return context.make_tuple(builder, sig.return_type, [
                _shuffle(builder, v, v, ([2 * k] * 4 + [2 * k + 1] * 4) * times) for k in range(4)])
        return types.UniTuple(vector_type, 4)(v), codegen
    typer.__name__, typer.__doc__ = name, doc
    return intrinsic(typer)


f32x8_pair_splats = _pair_splats("f32x8_pair_splats", F32x8, 1, "Four vectors from the 8 lanes of v: the k-th is "
                                 "[v[2k] x4 | v[2k+1] x4] (a 256-bit tile pair's scales).")


@intrinsic
def f32x8_hsum_pairs(typingctx, v):
    """Sum of the 8 lanes as ggml_vec_dot_f16 reduces them (two _mm_hadd_ps): t_l = v_l + v_{l+4}, then
    (t0 + t1) + (t2 + t3). f32x8_hsum is the other order llama.cpp uses, ((t0 + t2) + (t1 + t3))."""
    def codegen(context, builder, sig, args):
        v = args[0]
        t = builder.fadd(_shuffle(builder, v, v, range(4)), _shuffle(builder, v, v, range(4, 8)))
        u = builder.fadd(_shuffle(builder, t, t, [0, 2]), _shuffle(builder, t, t, [1, 3]))
        return builder.fadd(builder.extract_element(u, ir.Constant(_I32, 0)),
                            builder.extract_element(u, ir.Constant(_I32, 1)))
    return types.float32(v), codegen


def _float_store(vector_type, n, name):
    """An intrinsic `name`(buf, offset, v): write the n lanes of v to buf[offset:offset + n] (a float32 array)."""
    def typer(typingctx, buf, offset, v):
        if v is not vector_type:
            return None

        def codegen(context, builder, sig, args):
            ptr = _ptr(context, builder, sig.args[0], args[0], args[1])
            _store(builder, ptr, args[2], align=4)
            return context.get_dummy_value()
        return types.none(buf, offset, v), codegen
    typer.__name__, typer.__doc__ = name, f"Write the {n} lanes of v to buf[offset:offset + {n}] (a float32 array)."
    return intrinsic(typer)


def _float_load(vector_type, n, name):
    """An intrinsic `name`(buf, offset): n float32 at buf[offset] (element offset for float32 arrays, byte offset for
    uint8 buffers)."""
    def typer(typingctx, buf, offset):
        def codegen(context, builder, sig, args):
            return _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_F32, n))
        return vector_type(buf, offset), codegen
    typer.__name__, typer.__doc__ = name, f"{n} float32 at buf[offset]."
    return intrinsic(typer)


store_f32x8, store_f32x16 = _float_store(F32x8, 8, "store_f32x8"), _float_store(F32x16, 16, "store_f32x16")
load_f32x8, load_f32x16 = _float_load(F32x8, 8, "load_f32x8"), _float_load(F32x16, 16, "load_f32x16")


@intrinsic
def absmax_f32x32(typingctx, buf, offset):
    """max |x| over the 32 float32 at buf[offset] (a quantization block): four 8-lane vectors, their lane-wise
    maxima, then the 8 lanes folded. The maximum of finite values is the same whatever the order, so this equals
    the scalar loop's; the scalar loop carried one max through 32 dependent steps (4 cycles each). buf: a
    C-contiguous float32 array (anything else does not type)."""
    if not (isinstance(buf, types.Array) and buf.layout == "C" and buf.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        f32x8 = _vec(_F32, 8)
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1])
        v = [_call_intrinsic(builder, "llvm.fabs.v8f32", f32x8,
                             [_load(builder, builder.gep(ptr, [ir.Constant(_I64, 8 * k)],
                                                         source_etype=_F32), f32x8)]) for k in range(4)]

        def vmax(a, b):
            return builder.select(builder.fcmp_ordered(">", b, a), b, a)
        m = vmax(vmax(v[0], v[1]), vmax(v[2], v[3]))
        for width in (4, 2, 1):
            m = vmax(m, _shuffle(builder, m, m, list(range(width, 2 * width)) + list(range(8 - width))))
        return builder.extract_element(m, ir.Constant(_I32, 0))
    return types.float32(buf, offset), codegen


def _quantize_values(name, n, clamp, doc):
    """An intrinsic (x, offset, scale, q, q_offset) -> int32: q[q_offset:q_offset + n] <- the int8 of
    rint(x[offset + j] * scale) (round half to even, as np.rint), clamped to [-128, 127] if `clamp`; returns the sum
    of the n quants. One float32 multiply and rounding per value, as the scalar loops do, in vectors. x:
    C-contiguous float32 (anything else does not type); q: int8 or uint8."""
    def typer(typingctx, x, offset, scale, q, q_offset):
        if not (isinstance(x, types.Array) and x.layout == "C" and x.dtype == types.float32):
            return None

        def codegen(context, builder, sig, args):
            f32n, i32n = _vec(_F32, n), _vec(_I32, n)
            v = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), f32n)
            scaled = builder.fmul(v, _splat(builder, args[2], n))
            ints = builder.fptosi(_call_intrinsic(builder, f"llvm.rint.v{n}f32", f32n, [scaled]), i32n)
            if clamp:
                hi, lo = ir.Constant(i32n, [127] * n), ir.Constant(i32n, [-128] * n)
                ints = builder.select(builder.icmp_signed(">", ints, hi), hi, ints)
                ints = builder.select(builder.icmp_signed("<", ints, lo), lo, ints)
            qp = _ptr(context, builder, sig.args[3], args[3], args[4])
            _store(builder, qp, builder.trunc(ints, _vec(_I8, n)))
            return _call_intrinsic(builder, f"llvm.vector.reduce.add.v{n}i32", _I32, [ints])
        return types.int32(x, offset, types.float32, q, q_offset), codegen
    typer.__name__, typer.__doc__ = name, doc
    return intrinsic(typer)


quantize_f32x32 = _quantize_values("quantize_f32x32", 32, False, "A Q8_0 activation block's 32 quants and their sum "
                                   "(the products within +-127.5: scale = 127 / max|x|, or 0).")
quantize_f32x16_clamped = _quantize_values("quantize_f32x16_clamped", 16, True, "Sixteen of a Q8_K activation "
                                           "block's quants, clamped to [-128, 127], and their sum.")


def _f16_load(vector_type, n, name, doc):
    """An intrinsic `name`(buf, offset): n float16 at `offset` widened to float32."""
    def typer(typingctx, buf, offset):
        def codegen(context, builder, sig, args):
            h = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I16, n))
            return _f16_to_f32(builder, h)
        return vector_type(buf, offset), codegen
    typer.__name__, typer.__doc__ = name, doc
    return intrinsic(typer)


load_f16x8 = _f16_load(F32x8, 8, "load_f16x8", "8 float16 at `offset` (bytes into a uint8 buffer, elements into a "
                       "uint16 array), widened to float32.")
load_f16x16 = _f16_load(F32x16, 16, "load_f16x16", "16 float16 at `offset` (elements into a uint16 array), widened "
                        "to float32.")


def _pair_load(name, elem, convert):
    """An intrinsic `name`(buf, a, b): [8 values at buf[a] | 8 values at buf[b]] as float32 (two cache rows' same
    dimensions side by side in a 512-bit vector)."""
    def typer(typingctx, buf, a, b):
        def codegen(context, builder, sig, args):
            lo = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(elem, 8))
            hi = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[2]), _vec(elem, 8))
            return convert(builder, _shuffle(builder, lo, hi, range(16)))
        return F32x16(buf, a, b), codegen
    typer.__name__, typer.__doc__ = name, f"[8 values at buf[a] | 8 values at buf[b]] as float32 ({name[5:8]} buffer)."
    return intrinsic(typer)


load_f16x8_pair = _pair_load("load_f16x8_pair", _I16, _f16_to_f32)
load_f32x8_pair = _pair_load("load_f32x8_pair", _F32, lambda builder, v: v)


@intrinsic
def load_f32x8_twice(typingctx, buf, offset):
    """The 8 float32 at buf[offset] in both halves of a 512-bit vector (a broadcast load)."""
    def codegen(context, builder, sig, args):
        v = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_F32, 8))
        return _shuffle(builder, v, v, list(range(8)) * 2)
    return F32x16(buf, offset), codegen


@intrinsic
def load_f16_splat8(typingctx, buf, offset):
    """The float16 at byte offset `offset` of a uint8 buffer, widened to float32 in all 8 lanes. On x86 broadcast as
    16-bit lanes and widened as a vector: a lone half converted as a scalar is inserted into an undefined register,
    and where LLVM picks a loop's accumulator for it every block's scale waits for that accumulator. AArch64's scalar
    convert writes its whole register and takes one vector instruction where the widening takes two."""
    def codegen(context, builder, sig, args):
        h = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _I16)
        if IS_AARCH64:
            return _splat(builder, _f16_to_f32(builder, h), 8)
        return _f16_to_f32(builder, _splat(builder, h, 8))
    return F32x8(buf, offset), codegen


@intrinsic
def load_f16x8_rows(typingctx, buf, offset, stride):
    """The float16 at byte offsets offset + k * stride (k = 0..7) of a uint8 buffer, widened to float32 in lane k:
    eight rows' block scales. Built from a zeroed vector, so no lane depends on a register's previous value."""
    if not (isinstance(offset, types.Integer) and isinstance(stride, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        o = context.cast(builder, args[1], sig.args[1], types.intp)
        step = context.cast(builder, args[2], sig.args[2], types.intp)
        v = ir.Constant(_vec(_I16, 8), [0] * 8)
        for k in range(8):
            at = builder.add(o, builder.mul(step, ir.Constant(o.type, k)))
            h = _load(builder, _ptr(context, builder, sig.args[0], args[0], at), _I16)
            v = builder.insert_element(v, h, ir.Constant(_I32, k))
        return _f16_to_f32(builder, v)
    return F32x8(buf, offset, stride), codegen


@intrinsic
def load_bf16x8(typingctx, buf, offset):
    """8 bfloat16 at byte offset `offset` of a uint8 buffer, widened to float32 (exact: a 16-bit shift)."""
    def codegen(context, builder, sig, args):
        h = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I16, 8))
        wide = builder.shl(builder.zext(h, _vec(_I32, 8)), ir.Constant(_vec(_I32, 8), [16] * 8))
        return builder.bitcast(wide, _vec(_F32, 8))
    return F32x8(buf, offset), codegen


# ---------------------------------------------------------------------------------------------------------
# F32x4: the scales of two rows' blocks in one vector, so that a two-row dot converts, multiplies and sums them
# with one instruction each instead of one per row (lane-wise IEEE arithmetic: the scalar code's bits).


@intrinsic
def load_f16x2_rows(typingctx, buf, offset_a, offset_b):
    """[f16 at a, f16 at a + 2, f16 at b, f16 at b + 2] of a uint8 buffer as float32 lanes: two rows' (d, m)."""
    def codegen(context, builder, sig, args):
        words = ir.Constant(_vec(_I32, 4), None)
        for lane, offset in enumerate(args[1:]):
            word = _load(builder, _ptr(context, builder, sig.args[0], args[0], offset), _I32)
            words = builder.insert_element(words, word, ir.Constant(_I32, lane))
        halves = builder.bitcast(words, _vec(_I16, 8))
        return _f16_to_f32(builder, _shuffle(builder, halves, halves, [0, 1, 2, 3]))
    return F32x4(buf, offset_a, offset_b), codegen


@intrinsic
def load_f32x2_twice(typingctx, buf, offset):
    """[buf[offset], buf[offset + 1]] twice: [a, b, a, b] (a float32 array)."""
    def codegen(context, builder, sig, args):
        v = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_F32, 2))
        return _shuffle(builder, v, v, [0, 1, 0, 1])
    return F32x4(buf, offset), codegen


@intrinsic
def f32x4_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_vec(_F32, 4), [0.0] * 4)
    return F32x4(), codegen


f32x4_add = _float_binary(F32x4, "f32x4_add", "fadd", "a + b per lane.")
f32x4_mul = _float_binary(F32x4, "f32x4_mul", "fmul", "a * b per lane.")
f32x4_lane = _float_lane(F32x4, 4, "f32x4_lane")

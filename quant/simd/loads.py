"""Scalar loads and conversions: float16, bfloat16, float32 and integers at an offset of a buffer (no bounds checks,
no negative-index wraparound), float16 bits <-> float32, a float32's bits, and a prefetch hint.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .host import IS_AARCH64
from .vector_ir import _F32, _I8, _I16, _I32, _f16_bits_to_f32, _f16_to_f32, _load, _ptr, _vec


@intrinsic
def load_f16(typingctx, buf, offset):
    """The little-endian float16 at buf[offset] (a byte offset into a uint8 buffer), as float32."""
    def codegen(context, builder, sig, args):
        h = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _I16)
        return _f16_to_f32(builder, h)
    return types.float32(buf, offset), codegen


def _f16_lanes_01(context, builder, sig, word):
    """The two float16 in the i32 `word` (low half first) as a float32 pair, converted together. Building the vector
    from a whole 32-bit word (a vmovd, which zeroes the rest) keeps the conversion off registers that merely happen
    to hold other values: a lone half is inserted into an undefined register, and where LLVM picks a loop's
    accumulator for it, every load waits for that accumulator (measured: a two-row Q4_1 loop ran 1.4x slower)."""
    v = builder.insert_element(ir.Constant(_vec(_I32, 4), None), word, ir.Constant(_I32, 0))
    v = builder.bitcast(v, _vec(_I16, 8))
    f = _f16_to_f32(builder, builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, 4), [0, 1, 2, 3])))
    lanes = [builder.extract_element(f, ir.Constant(_I32, i)) for i in (0, 1)]
    return context.make_tuple(builder, sig.return_type, lanes)


@intrinsic
def load_f16_pair(typingctx, buf, offset_a, offset_b):
    """The float16 at byte offsets offset_a and offset_b of a uint8 buffer (e.g. two rows' block scales), as float32.
    On AArch64 two scalar converts: no more vector instructions than the pair's widening, and no move from the
    integer registers (a scalar convert there writes its whole register, so the x86 hazard below does not arise)."""
    def codegen(context, builder, sig, args):
        if IS_AARCH64:
            lanes = [_f16_to_f32(builder, _load(builder, _ptr(context, builder, sig.args[0], args[0], offset), _I16))
                     for offset in (args[1], args[2])]
            return context.make_tuple(builder, sig.return_type, lanes)

        def half(offset):
            return builder.zext(_load(builder, _ptr(context, builder, sig.args[0], args[0], offset), _I16), _I32)
        word = builder.or_(half(args[1]), builder.shl(half(args[2]), ir.Constant(_I32, 16)))
        return _f16_lanes_01(context, builder, sig, word)
    return types.UniTuple(types.float32, 2)(buf, offset_a, offset_b), codegen


@intrinsic
def prefetch(typingctx, buf, offset):
    """Hint that buf[offset] (an element offset) will be read soon (llvm.prefetch: a prefetch instruction where the
    target has one, nothing where not). A hint never faults, so the address may lie past the buffer's end."""
    def codegen(context, builder, sig, args):
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1])  # a plain GEP (not inbounds): any address
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, _I32, _I32, _I32]), "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    if not isinstance(offset, types.Integer):
        return None
    return types.none(buf, offset), codegen


@intrinsic
def load_f16_portable(typingctx, buf, offset):
    """load_f16 through the integer-only conversion (what hosts without F16C use); exposed for tests."""
    def codegen(context, builder, sig, args):
        h = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _I16)
        return _f16_bits_to_f32(builder, h)
    return types.float32(buf, offset), codegen


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    """The float32 value of float16 bits held in an integer (e.g. an element of a uint16 array)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        h = args[0]
        h = builder.trunc(h, _I16) if h.type.width > 16 else builder.zext(h, _I16) if h.type.width < 16 else h
        return _f16_to_f32(builder, h)
    return types.float32(bits), codegen


@intrinsic
def f32_bits(typingctx, value):
    """The bit pattern of a float32, as uint32."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)
    return types.uint32(value), codegen


@intrinsic
def _f32_to_f16_native(typingctx, value):
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)
    return types.uint16(value), codegen


@intrinsic
def load_f32(typingctx, buf, offset):
    """The float32 at buf[offset]: a byte offset into a uint8 buffer, an element offset into a float32 array."""
    def codegen(context, builder, sig, args):
        return _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _F32)
    return types.float32(buf, offset), codegen


@intrinsic
def load_bf16(typingctx, buf, offset):
    """The little-endian bfloat16 at byte offset `offset` of a uint8 buffer, as float32."""
    def codegen(context, builder, sig, args):
        h = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _I16)
        return builder.bitcast(builder.shl(builder.zext(h, _I32), ir.Constant(_I32, 16)), _F32)
    return types.float32(buf, offset), codegen


def _scalar_int_load(name, llvm_type, signed, doc):
    def typer(typingctx, buf, offset):
        def codegen(context, builder, sig, args):
            v = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), llvm_type)
            return (builder.sext if signed else builder.zext)(v, ir.IntType(64))
        return types.int64(buf, offset), codegen
    typer.__name__, typer.__doc__ = name, doc
    return intrinsic(typer)


# Scalar integer loads, widened to int64. Unlike buf[i], these skip Numba's negative-index wraparound,
# which costs three instructions per access in the scale-decoding code.
load_u8 = _scalar_int_load("load_u8", _I8, False, "The byte at buf[offset], unsigned.")
load_i8 = _scalar_int_load("load_i8", _I8, True, "The byte at buf[offset], signed.")
load_u32 = _scalar_int_load("load_u32", _I32, False, "The little-endian uint32 at byte offset `offset` of a uint8 buf.")
load_i32 = _scalar_int_load("load_i32", _I32, True, "The int32 at buf[offset] (an element offset into an int32 array).")

"""The vector types the kernels see (I8x32, I32x8, F32x8, F32x4, and the 512-bit I8x64, F32x16) and the LLVM IR
helpers the intrinsics are built from: pointers into arrays, unaligned loads, splats, shuffles, target intrinsic
calls, and float16 -> float32 conversion (native where LLVM has an instruction, integer-only elsewhere).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import models, register_model

from .host import NATIVE_F16

_I1, _I8, _I16, _I32, _F32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def _vec(elem, n):
    return ir.VectorType(elem, n)


class _VectorType(types.Type):
    def __init__(self, name):
        super().__init__(name=name)


I8x32, I32x8, F32x8 = _VectorType("I8x32"), _VectorType("I32x8"), _VectorType("F32x8")
F32x4 = _VectorType("F32x4")
I8x64, F32x16 = _VectorType("I8x64"), _VectorType("F32x16")
_LLVM_TYPE = {"I8x32": _vec(_I8, 32), "I32x8": _vec(_I32, 8), "F32x8": _vec(_F32, 8), "F32x4": _vec(_F32, 4),
              "I8x64": _vec(_I8, 64), "F32x16": _vec(_F32, 16)}


@register_model(_VectorType)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _LLVM_TYPE[fe_type.name])


_I64 = ir.IntType(64)


def _ptr(context, builder, arytype, ary, offset):
    data = context.make_array(arytype)(context, builder, ary).data
    return builder.gep(data, [offset], source_etype=context.get_data_type(arytype.dtype))


def _cast_ptr(builder, ptr, llvm_type):
    """Point at llvm_type (a no-op under opaque pointers, a bitcast under typed ones)."""
    if getattr(ptr.type, "is_opaque", False):
        return ptr
    return builder.bitcast(ptr, llvm_type.as_pointer())


def _load(builder, ptr, llvm_type):
    return builder.load(_cast_ptr(builder, ptr, llvm_type), typ=llvm_type, align=1)


def _store(builder, ptr, value, align=1):
    builder.store(value, _cast_ptr(builder, ptr, value.type), align=align)


def _splat(builder, value, n):
    vt = _vec(value.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), [0] * n))


def _shuffle(builder, a, b, lanes):
    return builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, len(lanes)), list(lanes)))


def _as_i8x32(context, builder, value_type, value):
    """An I8x32 operand, or an integer scalar splatted to 32 bytes."""
    if value_type is I8x32:
        return value
    return _splat(builder, builder.trunc(value, _I8) if value.type.width > 8 else value, 32)


def _call_intrinsic(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _f16_bits_to_f32(builder, h):
    """Exact half -> float of i16 (or <n x i16>) bits with integer ops only, for hosts without F16C.

    The 15 magnitude bits shifted into a float's exponent/mantissa and scaled by 2**112 give normals and
    subnormals exactly; exponent 31 (inf/nan) gets an all-ones float exponent instead."""
    n = h.type.count if isinstance(h.type, ir.VectorType) else None

    def const(ty, v):
        return ir.Constant(_vec(ty, n), [v] * n) if n else ir.Constant(ty, v)

    i32t, f32t = (_vec(_I32, n), _vec(_F32, n)) if n else (_I32, _F32)
    h32 = builder.zext(h, i32t)
    magnitude = builder.and_(h32, const(_I32, 0x7FFF))
    bits = builder.shl(magnitude, const(_I32, 13))
    finite = builder.fmul(builder.bitcast(bits, f32t), const(_F32, 2.0 ** 112))
    special = builder.bitcast(builder.or_(bits, const(_I32, 0x7F800000)), f32t)
    is_special = builder.icmp_unsigned(">=", magnitude, const(_I32, 0x7C00))
    value = builder.bitcast(builder.select(is_special, special, finite), i32t)
    sign = builder.shl(builder.and_(h32, const(_I32, 0x8000)), const(_I32, 16))
    return builder.bitcast(builder.or_(value, sign), f32t)


def _f16_to_f32(builder, h, native=None):
    if NATIVE_F16 if native is None else native:
        half_type = _vec(ir.HalfType(), h.type.count) if isinstance(h.type, ir.VectorType) else ir.HalfType()
        f32_type = _vec(_F32, h.type.count) if isinstance(h.type, ir.VectorType) else _F32
        return builder.fpext(builder.bitcast(h, half_type), f32_type)
    return _f16_bits_to_f32(builder, h)

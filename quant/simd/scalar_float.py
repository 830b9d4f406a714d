"""Scalar float helpers for kernels that must round exactly like llama.cpp's CPU backend: a float32 FMA, float32
bit tricks, and float32 -> float16 rounding (native instruction or an integer version tested against numpy).
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .host import NATIVE_F16
from .loads import _f32_to_f16_native, f16_bits_to_f32, f32_bits
from .vector_ir import _F32, _I32

@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c in float32 with one rounding (llvm.fma: an FMA instruction on x86 FMA3 and AArch64)."""
    if not all(isinstance(t, types.Float) for t in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        a_, b_, c_ = (context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args))
        return builder.fma(a_, b_, c_)
    return types.float32(a, b, c), codegen


@intrinsic
def f32_shl23_add(typingctx, bits, add):
    """The float32 whose bit pattern is (bits << 23) + add in 32-bit integer arithmetic (wrapping): 2^n built in
    the exponent field from the low bits of n held in `bits` (an exp's scale factor). Python's ints would widen to
    64 bits first, and a loop over them then vectorises four lanes to a register instead of eight."""
    if not isinstance(bits, types.Integer) or not isinstance(add, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        def low32(v):
            return builder.trunc(v, _I32) if v.type.width > 32 else builder.zext(v, _I32) if v.type.width < 32 else v
        shifted = builder.shl(low32(args[0]), ir.Constant(_I32, 23))
        return builder.bitcast(builder.add(shifted, low32(args[1])), _F32)
    return types.float32(bits, add), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        v = builder.trunc(v, _I32) if v.type.width > 32 else builder.zext(v, _I32) if v.type.width < 32 else v
        return builder.bitcast(v, _F32)
    return types.float32(bits), codegen


# float32 -> float16 bits, rounding to nearest even (numpy's astype(float16)); F16C / AArch64 do it in one
# instruction, the integer version serves other hosts and is tested against numpy on every host.


@njit(cache=True)
def f32_to_f16_portable(x):
    b = np.uint32(f32_bits(np.float32(x)))
    sign = np.uint32((b >> np.uint32(16)) & np.uint32(0x8000))
    e = np.int32((b >> np.uint32(23)) & np.uint32(0xFF))
    m = np.uint32(b & np.uint32(0x7FFFFF))
    if e == 0xFF:  # inf, nan (keep nan a quiet nan)
        return np.uint16(sign | np.uint32(0x7C00) | (np.uint32(0x200) if m else np.uint32(0)))
    exp = e - 127 + 15
    if exp >= 31:
        return np.uint16(sign | np.uint32(0x7C00))
    if exp <= 0:  # a float16 subnormal or zero
        if exp < -10:
            return np.uint16(sign)
        m = m | np.uint32(0x800000)
        shift = np.uint32(14 - exp)
        half = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        halfway = np.uint32(1) << (shift - np.uint32(1))
        if rem > halfway or (rem == halfway and (half & np.uint32(1))):
            half += np.uint32(1)
        return np.uint16(sign | half)
    half = (np.uint32(exp) << np.uint32(10)) | (m >> np.uint32(13))
    rem = m & np.uint32(0x1FFF)
    if rem > np.uint32(0x1000) or (rem == np.uint32(0x1000) and (half & np.uint32(1))):
        half += np.uint32(1)  # a carry out of the mantissa correctly bumps the exponent (to inf at the top)
    return np.uint16(sign | half)


@njit(cache=True, inline="always")
def f32_to_f16(x):
    if NATIVE_F16:
        return _f32_to_f16_native(np.float32(x))
    return f32_to_f16_portable(x)


@njit(cache=True, inline="always")
def round_f16(x):
    """x rounded to the nearest float16 value, as float32 (what llama.cpp's float16 conversions leave)."""
    return f16_bits_to_f32(f32_to_f16(x))

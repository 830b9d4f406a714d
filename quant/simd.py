"""Portable SIMD building blocks for the Numba kernels, written as LLVM vector IR.

Why this exists: Numba leaves LLVM's SLP vectoriser off (numba.config.SLP_VECTORIZE, off since a
miscompilation), so a fixed 32-element block loop is fully unrolled into scalar code, and Numba types
int8*int8 as int64. A per-block integer dot product written in plain Numba runs at ~1 GB/s. Here each
operation is one small `@intrinsic` that emits generic LLVM vector instructions (<32 x i8>, <8 x i32>,
<8 x float>); LLVM lowers them for the host (vcvtph2ps, vfmadd231ps, ... on AVX2, whatever other targets
have), and Numba keeps the values in registers between calls. Only the int8 dot product names target intrinsics
(x86 vpmaddubsw / vpmaddwd / vpdpbusd, AArch64 sdot or smull + saddlp, see below), with a generic fallback computing
the same lanes. A kernel
then reads like llama.cpp's intrinsic code, e.g. for a Q8_0 block:

    acc = f32x8_fma_i32(acc, dot_i8x32(load_i8x32(w, o + 2), load_i8x32(xq, 32 * b)), load_f16(w, o) * d_x)

Contract: offsets are in elements of the array passed (bytes for uint8 buffers), and nothing is bounds
checked or wrapped here: callers validate every size in Python before a kernel runs.

Types: I8x32 (32 signed bytes), I32x8 (8 int32 lanes of partial sums), F32x8 (8 float lanes), F32x4 (4 float
lanes: two rows' block scales side by side).
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
from llvmlite import ir
import numpy as np
from numba import njit, types
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic, models, register_model

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


def _is_x86() -> bool:
    return llvm_binding.get_process_triple().startswith(("x86_64", "i686", "i386"))


def _is_aarch64() -> bool:
    return llvm_binding.get_process_triple().startswith(("aarch64", "arm64"))


def _host_has(feature: str) -> bool:
    """Whether the CPU Numba compiles for has an x86 feature (honours NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)."""
    if not _is_x86():
        return False
    if numba_config.CPU_NAME and numba_config.CPU_NAME != "host":
        return f"+{feature}" in (numba_config.CPU_FEATURES or "").split(",")
    return bool(llvm_binding.get_host_cpu_features().get(feature))


# AArch64 CPUs by the optional dot-product extensions LLVM's CPU model gives them (a named CPU implies its features:
# NUMBA_CPU_NAME=cortex-a76 compiles sdot without any NUMBA_CPU_FEATURES). Only names LLVM knows; a CPU missing here
# counts as having neither, which is always safe (plain NEON runs on every AArch64 core).
_ARM_I8MM_CPUS = frozenset((
    "neoverse-n2", "neoverse-n3", "neoverse-v1", "neoverse-v2", "neoverse-v3", "neoverse-v3ae", "neoverse-512tvb",
    "cortex-a510", "cortex-a520", "cortex-a520ae", "cortex-a710", "cortex-a715", "cortex-a720", "cortex-a720ae",
    "cortex-a725", "cortex-x2", "cortex-x3", "cortex-x4", "cortex-x925", "apple-a15", "apple-a16", "apple-a17",
    "apple-a18", "apple-m2", "apple-m3", "apple-m4", "oryon-1", "grace", "ampere1", "ampere1a", "ampere1b"))
_ARM_DOTPROD_CPUS = _ARM_I8MM_CPUS | frozenset((
    "cortex-a55", "cortex-a65", "cortex-a65ae", "cortex-a75", "cortex-a76", "cortex-a76ae", "cortex-a77",
    "cortex-a78", "cortex-a78ae", "cortex-a78c", "cortex-x1", "cortex-x1c", "neoverse-e1", "neoverse-n1",
    "apple-a13", "apple-a14", "apple-m1", "exynos-m4", "exynos-m5", "tsv110"))
# what the names in /proc/cpuinfo's Features line (or LLVM's host feature map) call them
_ARM_FEATURE_ALIASES = {"dotprod": ("dotprod", "asimddp"), "i8mm": ("i8mm",)}


def _arm_has(feature: str) -> bool:
    """Whether the AArch64 CPU Numba compiles for has `feature` ("dotprod" or "i8mm"): NUMBA_CPU_FEATURES' +/-
    entries first, then what NUMBA_CPU_NAME (or the host's CPU name) implies, then the host's own feature list when
    Numba compiles for the host. Under QEMU user emulation LLVM reads the emulating machine's /proc/cpuinfo and sees
    a "generic" CPU with no features, so an emulated check names the CPU through NUMBA_CPU_NAME."""
    if not _is_aarch64():
        return False
    names = _ARM_FEATURE_ALIASES[feature]
    explicit = [f.strip() for f in (numba_config.CPU_FEATURES or "").split(",") if f.strip()]
    if any(f"-{n}" in explicit for n in names):
        return False
    if any(f"+{n}" in explicit for n in names):
        return True
    pinned = numba_config.CPU_NAME and numba_config.CPU_NAME != "host"
    cpu = numba_config.CPU_NAME if pinned else llvm_binding.get_host_cpu_name()
    table = _ARM_I8MM_CPUS if feature == "i8mm" else _ARM_DOTPROD_CPUS
    if cpu in table:
        return True
    if pinned or numba_config.CPU_FEATURES is not None:  # Numba compiles for exactly what was named
        return False
    try:
        host = llvm_binding.get_host_cpu_features()
    except RuntimeError:  # LLVM cannot read this host's features
        return False
    return any(host.get(n) for n in names)


def _has_native_f16() -> bool:
    """True where LLVM turns `fpext half` into an instruction (x86 F16C, AArch64), not a libcall."""
    return _is_aarch64() or _host_has("f16c")


NATIVE_F16 = _has_native_f16()

# ---------------------------------------------------------------------------------------------------------
# IR helpers


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


# ---------------------------------------------------------------------------------------------------------
# scalar loads


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
    """The float16 at byte offsets offset_a and offset_b of a uint8 buffer (e.g. two rows' block scales), as float32."""
    def codegen(context, builder, sig, args):
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


# ---------------------------------------------------------------------------------------------------------
# I8x32: decoding quants into 32 signed bytes


@intrinsic
def load_i8x32(typingctx, buf, offset):
    """32 bytes at buf[offset] as signed bytes."""
    def codegen(context, builder, sig, args):
        return _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I8, 32))
    return I8x32(buf, offset), codegen


@intrinsic
def store_i8x32(typingctx, buf, offset, v):
    """Write the 32 bytes of v to buf[offset:offset + 32] (an int8 or uint8 buffer)."""
    if v is not I8x32:
        return None

    def codegen(context, builder, sig, args):
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(args[2], _cast_ptr(builder, ptr, args[2].type), align=1)
        return context.get_dummy_value()
    return types.none(buf, offset, v), codegen


@intrinsic
def store_pair64(typingctx, dst, d_offset, src, a_offset, b_offset):
    """dst[d_offset:d_offset + 64] <- [a 0-15 | b 0-15 | a 16-31 | b 16-31] for the 32 bytes a at src[a_offset] and
    b at src[b_offset] (an eight-token tile's pair layout, dots_block32._pack_tiles8)."""
    def codegen(context, builder, sig, args):
        a = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3]), _vec(_I8, 32))
        b = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[4]), _vec(_I8, 32))
        v = _shuffle(builder, a, b, list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64)))
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(v, _cast_ptr(builder, ptr, v.type), align=1)
        return context.get_dummy_value()
    return types.none(dst, d_offset, src, a_offset, b_offset), codegen


@intrinsic
def store_lane_sums(typingctx, dst, d_offset, src, s_offset, mult):
    """dst[d_offset + k] <- mult x (src[s_offset + 4k] + ... + src[s_offset + 4k + 3]) for k = 0..7: the int32 lane
    sums of 32 signed bytes (dst an int32 array, element offset; mult an int32, the products within int32)."""
    def codegen(context, builder, sig, args):
        i32x32 = _vec(_I32, 32)
        v = builder.sext(_load(builder, _ptr(context, builder, sig.args[2], args[2], args[3]), _vec(_I8, 32)), i32x32)
        parts = [_shuffle(builder, v, v, range(e, 32, 4)) for e in range(4)]
        total = builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))
        total = builder.mul(total, _splat(builder, args[4], 8))
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(total, _cast_ptr(builder, ptr, total.type), align=4)
        return context.get_dummy_value()
    return types.none(dst, d_offset, src, s_offset, types.int32), codegen


@intrinsic
def load_nibbles_lo_hi(typingctx, buf, offset):
    """16 bytes at buf[offset] -> 32 values 0..15: low nibbles first, then high nibbles (Q4_0/Q4_1/Q5_x)."""
    def codegen(context, builder, sig, args):
        q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I8, 16))
        lo = builder.and_(q, ir.Constant(_vec(_I8, 16), [0x0F] * 16))
        hi = builder.lshr(q, ir.Constant(_vec(_I8, 16), [4] * 16))
        return _shuffle(builder, lo, hi, range(32))
    return I8x32(buf, offset), codegen


@intrinsic
def load_nibbles_lo_hi_bcast(typingctx, buf, offset):
    """load_nibbles_lo_hi's values, built another way: the 16 bytes in both halves of the vector, the upper half's
    32-bit words shifted right by 4, then the bytes masked (on AVX2 vbroadcasti128, vpsrlvd, vpand: three
    instructions against four). Faster where the vector is used whole (the two-row Q4_1 dot); the eight-token tiles,
    which split it into halves again, compile better from load_nibbles_lo_hi (measured: pp512 10% slower)."""
    def codegen(context, builder, sig, args):
        return _nibbles_broadcast(context, builder, sig, args, 2)
    return I8x32(buf, offset), codegen


def _nibbles_broadcast(context, builder, sig, args, copies):
    """The 16 bytes at args[0][args[1]] in each of `copies` 128-bit lanes, the upper half of the lanes' 32-bit words
    shifted right by 4, the bytes masked to their low nibble: low nibbles (x copies / 2), then high nibbles."""
    q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I8, 16))
    n = 4 * copies  # 32-bit words
    words = builder.bitcast(_shuffle(builder, q, q, list(range(16)) * copies), _vec(_I32, n))
    words = builder.lshr(words, ir.Constant(_vec(_I32, n), [0] * (n // 2) + [4] * (n // 2)))
    return builder.and_(builder.bitcast(words, _vec(_I8, 4 * n)), ir.Constant(_vec(_I8, 4 * n), [0x0F] * (4 * n)))


@intrinsic
def load_bits32(typingctx, buf, offset):
    """The little-endian uint32 at buf[offset] -> 32 values 0/1, value j is bit j (Q5_0/Q5_1 qh)."""
    def codegen(context, builder, sig, args):
        word = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _I32)
        return builder.zext(builder.bitcast(word, _vec(_I1, 32)), _vec(_I8, 32))
    return I8x32(buf, offset), codegen


def _i8x32_halves(name, first, doc):
    def typer(typingctx, v):
        if v is not I8x32:
            return None

        def codegen(context, builder, sig, args):
            return _shuffle(builder, args[0], args[0], list(range(first, first + 16)) * 2)
        return I8x32(v), codegen
    typer.__name__, typer.__doc__ = name, doc
    return intrinsic(typer)


i8x32_dup_lo = _i8x32_halves("i8x32_dup_lo", 0, "Bytes 0..15 of v, twice (the low half in both 128-bit lanes).")
i8x32_dup_hi = _i8x32_halves("i8x32_dup_hi", 16, "Bytes 16..31 of v, twice (the high half in both 128-bit lanes).")


def _i8x32_binary(op_name):
    def typer(typingctx, a, b):
        if a is not I8x32 or not (b is I8x32 or isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            lhs = args[0]
            rhs = _as_i8x32(context, builder, sig.args[1], args[1])
            return getattr(builder, op_name)(lhs, rhs)
        return I8x32(a, b), codegen
    typer.__name__ = f"i8x32_{op_name}"
    return intrinsic(typer)


i8x32_and = _i8x32_binary("and_")   # a & b            (b: I8x32 or an integer, splatted)
i8x32_or = _i8x32_binary("or_")     # a | b
i8x32_xor = _i8x32_binary("xor")    # a ^ b
i8x32_add = _i8x32_binary("add")    # a + b, wrapping
i8x32_sub = _i8x32_binary("sub")    # a - b, wrapping
i8x32_shr = _i8x32_binary("lshr")   # logical a >> b, per byte
i8x32_shl = _i8x32_binary("shl")    # a << b, per byte


# ---------------------------------------------------------------------------------------------------------
# integer dot products: 32 int8 x 32 int8 -> I32x8 partial sums, lane m = elements 4m..4m+3.
#
# On AVX2 this is llama.cpp's sequence: vpmaddubsw (unsigned x signed bytes -> pairs summed into int16) then
# vpmaddwd (int16 pairs -> int32, times ones or per-half scales). vpmaddubsw needs an unsigned left side,
# so signed weights go in as |w| with the activation's sign flipped where w < 0 (vpsignb). Its int16 sums
# saturate above 32767; the quants here never get there (|w| <= 128 and activations are within +-127, so a
# pair is at most 2 * 128 * 127 = 32512). On AArch64 sdot (dotprod) or smull + saddlp + addp (plain NEON) compute
# the same lanes; elsewhere generic widening ops do.

HAS_AVX2 = _host_has("avx2")
# AVX-VNNI (or AVX512-VNNI with 256-bit forms): vpdpbusd sums the four unsigned x signed byte products of each lane
# straight into int32, one instruction for vpmaddubsw + vpmaddwd, without the int16 step (nothing saturates there
# either way, see above), so the lanes are the same integers.
HAS_VNNI = HAS_AVX2 and (_host_has("avxvnni") or (_host_has("avx512vnni") and _host_has("avx512vl")))


# AArch64 with the dot-product extension (Armv8.2 optional, 8.4 on): sdot sums the four signed byte products of each
# int32 lane of a 128-bit vector into that lane, the very lanes above, so two sdots make an I32x8 (no int16 step).
IS_AARCH64 = _is_aarch64()
HAS_DOTPROD = _arm_has("dotprod")
# Armv8.6's int8 matrix multiply (i8mm) is detected, not used: each of smmla's 2x2 int32 outputs sums eight products
# where the lanes above sum four, so it keeps these bits only with half its inputs zero, no faster than sdot.
HAS_I8MM = HAS_DOTPROD and _arm_has("i8mm")


def _x86(builder, name, ret, *args):
    return _call_intrinsic(builder, f"llvm.x86.avx2.{name}", ret, list(args))


def _dot_lanes(builder, w, x, signed, pair_scales=None, base=None):
    """<8 x i32> lane m = base[m] + sum over e in 4m..4m+3 of w[e] * x[e] * scale(e), scale from the <16 x i16>
    pair_scales (one per pair of elements; None means 1), base an <8 x i32> (None means 0)."""
    i32x8 = _vec(_I32, 8)
    if HAS_AVX2:
        if signed:
            x = _x86(builder, "psign.b", w.type, x, w)
            w = _call_intrinsic(builder, "llvm.abs.v32i8", w.type, [w, ir.Constant(_I1, 0)])
        if HAS_VNNI and pair_scales is None:  # the starting lanes are vpdpbusd's accumulator
            return _call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.256", i32x8,
                                   [base if base is not None else ir.Constant(i32x8, None),
                                    builder.bitcast(w, i32x8), builder.bitcast(x, i32x8)])
        pairs = _x86(builder, "pmadd.ub.sw", _vec(_I16, 16), w, x)
        if pair_scales is None:
            pair_scales = ir.Constant(_vec(_I16, 16), [1] * 16)
        lanes = _x86(builder, "pmadd.wd", i32x8, pairs, pair_scales)
    elif HAS_DOTPROD or IS_AARCH64:
        # signed instructions also for "unsigned" quants: they are 0..127 (the contracts of the dot_u8x32 family)
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
    else:
        wide = (builder.sext if signed else builder.zext)(w, _vec(_I32, 32))
        p = builder.mul(wide, builder.sext(x, _vec(_I32, 32)))
        pairs = builder.add(_shuffle(builder, p, p, range(0, 32, 2)), _shuffle(builder, p, p, range(1, 32, 2)))
        if pair_scales is not None:
            pairs = builder.mul(pairs, builder.sext(pair_scales, _vec(_I32, 16)))
        even = _shuffle(builder, pairs, pairs, range(0, 16, 2))
        lanes = builder.add(even, _shuffle(builder, pairs, pairs, range(1, 16, 2)))
    return lanes if base is None else builder.add(base, lanes)


def _sdot_i8x32(builder, start, w, x):
    """<8 x i32> start + lanes of w . x (signed bytes) as two sdot (llvm.aarch64.neon.sdot) on the 128-bit halves."""
    i32x4 = _vec(_I32, 4)
    halves = []
    for h in (0, 1):
        lanes = range(16 * h, 16 * h + 16)
        acc = _shuffle(builder, start, start, range(4 * h, 4 * h + 4))
        halves.append(_call_intrinsic(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", i32x4,
                                      [acc, _shuffle(builder, w, w, lanes), _shuffle(builder, x, x, lanes)]))
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
    halves = [_call_intrinsic(builder, "llvm.aarch64.neon.addp.v4i32", i32x4, quarters[2 * h:2 * h + 2])
              for h in (0, 1)]
    return _shuffle(builder, halves[0], halves[1], range(8))


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


# ---------------------------------------------------------------------------------------------------------
# 512-bit tile steps (AVX-512 with VNNI): one vector holds two 256-bit tile accumulators side by side, so each
# vpdpbusd, conversion and FMA does the work of two; the lanes and their arithmetic are the 256-bit ones. Measured on
# the AVX-512 machine kind (a server core), 64 tokens x 1536 rows x 640: Q4_0 1.35x, Q4_1 1.1x, Q5_0 1.2x, Q5_1
# 1.1x, Q8_0 1.24x against the 256-bit tiles; pp512 1.1x (Gemma-3) and 1.13x (SmolLM2).

HAS_WIDE_TILES = HAS_VNNI and all(_host_has(f) for f in ("avx512f", "avx512bw", "avx512vnni"))


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


f32x16_pair_scales = _pair_splats("f32x16_pair_scales", F32x16, 2, "Four vectors from the 8 lanes of v: the k-th is "
                                  "[v[2k] x4 | v[2k+1] x4] twice (a 512-bit tile pair's scales).")


@intrinsic
def f32x16_tile_step(typingctx, acc, w, buf, offset, base, base_offset, scales):
    """acc + float(lanes) * scales with one rounding per lane, lanes = w . buf[offset:offset + 64] per group of four
    bytes (w unsigned bytes, 0..255: vpdpbusd has no int16 step to saturate), each lane starting from the 16 int32 at
    base[base_offset] where base is an array (None: from zero). The 512-bit vpdpbusd, vcvtdq2ps and vfmadd of two
    256-bit tile steps."""
    if acc is not F32x16 or w is not I8x64 or scales is not F32x16:
        return None
    with_base = isinstance(base, types.Array)

    def codegen(context, builder, sig, args):
        i32x16 = _vec(_I32, 16)
        x = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3]), _vec(_I8, 64))
        start = (_load(builder, _ptr(context, builder, sig.args[4], args[4], args[5]), i32x16) if with_base
                 else ir.Constant(i32x16, None))
        lanes = _call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.512", i32x16,
                                [start, builder.bitcast(args[1], i32x16), builder.bitcast(x, i32x16)])
        return _call_intrinsic(builder, "llvm.fma.v16f32", _vec(_F32, 16),
                               [builder.sitofp(lanes, _vec(_F32, 16)), args[6], args[0]])
    return F32x16(acc, w, buf, offset, base, base_offset, scales), codegen


@intrinsic
def f32x16_halves(typingctx, v):
    """(lanes 0-7, lanes 8-15) of v."""
    if v is not F32x16:
        return None

    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, sig.return_type, [_shuffle(builder, args[0], args[0], range(8)),
                                                             _shuffle(builder, args[0], args[0], range(8, 16))])
    return types.UniTuple(F32x8, 2)(v), codegen


_I64 = ir.IntType(64)


@intrinsic
def dot_u8x32_byte_scale(typingctx, w, x, word, g):
    """Lanes of w . x (w 0..127) times byte g of the 64-bit `word` (g a compile-time constant 0..7): one scale for
    all 32 elements, taken from eight packed in a word (a K-quant super-block's sub-block scales). On AVX2 the
    scales are moved to a vector once and each call broadcasts its own (vpbroadcastw / vpshufb), instead of
    extracting it in a general register and moving it over for every call."""
    if w is not I8x32 or x is not I8x32 or not isinstance(g, types.IntegerLiteral) or not 0 <= g.literal_value < 8:
        return None
    lane = g.literal_value

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[2], sig.args[2], types.uint64)
        scales = builder.zext(builder.bitcast(word, _vec(_I8, 8)), _vec(_I16, 8))
        return _dot_lanes(builder, args[0], args[1], False, _shuffle(builder, scales, scales, [lane] * 16))
    return I32x8(w, x, word, g), codegen


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
        scales = builder.sext(scales, _vec(_I16, 16))
        pair_scales = _shuffle(builder, scales, scales, [2 * lane] * 8 + [2 * lane + 1] * 8)
        return _dot_lanes(builder, args[0], args[1], False, pair_scales)
    return I32x8(w, x, buf, offset, g), codegen


@intrinsic
def i32x8_byte_pairs(typingctx, word, half):
    """Bytes 4h .. 4h+3 of the 64-bit `word` (h = half, a constant 0 or 1), each twice, as int32 lanes:
    [b_4h, b_4h, b_4h+1, b_4h+1, ...] (a K-quant super-block's eight mins against its sixteen 16-element sums)."""
    if not isinstance(half, types.IntegerLiteral) or half.literal_value not in (0, 1):
        return None
    h = half.literal_value

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[0], sig.args[0], types.uint64)
        v = builder.bitcast(word, _vec(_I8, 8))
        return builder.zext(_shuffle(builder, v, v, [4 * h + k // 2 for k in range(8)]), _vec(_I32, 8))
    return I32x8(word, half), codegen


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

        def pairs(x, y):  # adjacent lanes added within each half: x01 x23 y01 y23 | x45 x67 y45 y67
            return builder.add(_shuffle(builder, x, y, [0, 2, 8, 10, 4, 6, 12, 14]),
                               _shuffle(builder, x, y, [1, 3, 9, 11, 5, 7, 13, 15]))
        ab, cd, ef, gh = halves(args[0], args[1]), halves(args[2], args[3]), halves(args[4], args[5]), \
            halves(args[6], args[7])
        # ab = a(4) | b(4) partial sums; pairs(ab, cd) = a a c c | b b d d; once more: a c e g | b d f h
        abcd, efgh = pairs(ab, cd), pairs(ef, gh)
        r = pairs(abcd, efgh)  # lanes: a c e g b d f h
        return _shuffle(builder, r, r, [0, 4, 1, 5, 2, 6, 3, 7])
    return I32x8(*args_t), codegen


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
        return builder.add(_shuffle(builder, p, p, range(0, 16, 2)), _shuffle(builder, p, p, range(1, 16, 2)))
    return I32x8(w, o, b, bo), codegen


@intrinsic
def i32x8_hsum(typingctx, v):
    def codegen(context, builder, sig, args):
        return _call_intrinsic(builder, "llvm.vector.reduce.add.v8i32", _I32, [args[0]])
    return types.int32(v), codegen


# ---------------------------------------------------------------------------------------------------------
# float lanes. Multiply-adds are explicit llvm.fma calls (one rounding, on every target: an FMA instruction
# where the CPU has one, a correctly rounded libm call where not) and nothing is reassociated, so each lane's
# sum keeps its order and a kernel gives the same bits on every host and whatever the tiling around it.


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


@intrinsic
def f32x8_fma(typingctx, acc, a, b):
    """acc + a * b with one rounding per lane, all F32x8."""
    def codegen(context, builder, sig, args):
        return _call_intrinsic(builder, "llvm.fma.v8f32", _vec(_F32, 8), [args[1], args[2], args[0]])
    return F32x8(acc, a, b), codegen


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


@intrinsic
def f32x8_splat(typingctx, x):
    """8 lanes of the float32 scalar x."""
    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), 8)
    return F32x8(x), codegen


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


@intrinsic
def store_f32x8(typingctx, buf, offset, v):
    """Write the 8 lanes of v to buf[offset:offset + 8] (a float32 array)."""
    if v is not F32x8:
        return None

    def codegen(context, builder, sig, args):
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(args[2], _cast_ptr(builder, ptr, args[2].type), align=4)
        return context.get_dummy_value()
    return types.none(buf, offset, v), codegen


@intrinsic
def load_f32x8(typingctx, buf, offset):
    """8 float32 at buf[offset] (element offset for float32 arrays, byte offset for uint8 buffers)."""
    def codegen(context, builder, sig, args):
        return _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_F32, 8))
    return F32x8(buf, offset), codegen


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
            builder.store(builder.trunc(ints, _vec(_I8, n)), _cast_ptr(builder, qp, _vec(_I8, n)), align=1)
            return _call_intrinsic(builder, f"llvm.vector.reduce.add.v{n}i32", _I32, [ints])
        return types.int32(x, offset, types.float32, q, q_offset), codegen
    typer.__name__, typer.__doc__ = name, doc
    return intrinsic(typer)


quantize_f32x32 = _quantize_values("quantize_f32x32", 32, False, "A Q8_0 activation block's 32 quants and their sum "
                                   "(the products within +-127.5: scale = 127 / max|x|, or 0).")
quantize_f32x16_clamped = _quantize_values("quantize_f32x16_clamped", 16, True, "Sixteen of a Q8_K activation "
                                           "block's quants, clamped to [-128, 127], and their sum.")


@intrinsic
def load_f16x8(typingctx, buf, offset):
    """8 float16 at `offset` (bytes into a uint8 buffer, elements into a uint16 array), widened to float32."""
    def codegen(context, builder, sig, args):
        h = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I16, 8))
        return _f16_to_f32(builder, h)
    return F32x8(buf, offset), codegen


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


# ---------------------------------------------------------------------------------------------------------
# Scalar float helpers for kernels that must round exactly like llama.cpp's CPU backend.


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

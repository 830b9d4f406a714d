"""I8x32: decoding a block's quants into 32 signed bytes: loads and stores, nibble and bit unpacking, half
duplication and byte-wise arithmetic.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .host import IS_AARCH64
from .vector_ir import I8x32, _I1, _I8, _I32, _I64, _as_i8x32, _load, _ptr, _shuffle, _splat, _store, _vec


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
        _store(builder, ptr, args[2])
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
        _store(builder, ptr, v)
        return context.get_dummy_value()
    return types.none(dst, d_offset, src, a_offset, b_offset), codegen


@intrinsic
def store_lane_sums(typingctx, dst, d_offset, src, s_offset, mult, start):
    """dst[d_offset + k] <- start + mult x (src[s_offset + 4k] + ... + src[s_offset + 4k + 3]) for k = 0..7: the
    int32 lane sums of 32 signed bytes (dst an int32 array, element offset; mult and start int32, the results
    within int32)."""
    def codegen(context, builder, sig, args):
        i32x32 = _vec(_I32, 32)
        v = builder.sext(_load(builder, _ptr(context, builder, sig.args[2], args[2], args[3]), _vec(_I8, 32)), i32x32)
        parts = [_shuffle(builder, v, v, range(e, 32, 4)) for e in range(4)]
        total = builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))
        total = builder.add(builder.mul(total, _splat(builder, args[4], 8)), _splat(builder, args[5], 8))
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1])
        _store(builder, ptr, total, align=4)
        return context.get_dummy_value()
    return types.none(dst, d_offset, src, s_offset, types.int32, types.int32), codegen


def _nibbles_lo_hi(context, builder, sig, args):
    q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I8, 16))
    lo = builder.and_(q, ir.Constant(_vec(_I8, 16), [0x0F] * 16))
    hi = builder.lshr(q, ir.Constant(_vec(_I8, 16), [4] * 16))
    return _shuffle(builder, lo, hi, range(32))


@intrinsic
def load_nibbles_lo_hi(typingctx, buf, offset):
    """16 bytes at buf[offset] -> 32 values 0..15: low nibbles first, then high nibbles (Q4_0/Q4_1/Q5_x)."""
    return I8x32(buf, offset), _nibbles_lo_hi


@intrinsic
def load_nibbles_rows2(typingctx, buf, offset_a, offset_b):
    """Two rows' 16 nibble bytes (at offset_a and offset_b) as ([a's low nibbles | b's low nibbles], [a's high
    nibbles | b's high nibbles]), values 0..15: dotted with a token's [x0..15 | x0..15] and [x16..31 | x16..31], lanes
    0-3 then hold row a's partial dots and lanes 4-7 row b's."""
    def codegen(context, builder, sig, args):
        qa = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_I8, 16))
        qb = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[2]), _vec(_I8, 16))
        q = _shuffle(builder, qa, qb, range(32))
        mask = ir.Constant(_vec(_I8, 32), [0x0F] * 32)
        lo = builder.and_(q, mask)
        hi = builder.and_(builder.lshr(q, ir.Constant(_vec(_I8, 32), [4] * 32)), mask)
        return context.make_tuple(builder, sig.return_type, (lo, hi))
    return types.UniTuple(I8x32, 2)(buf, offset_a, offset_b), codegen


@intrinsic
def load_nibbles_lo_hi_bcast(typingctx, buf, offset):
    """load_nibbles_lo_hi's values, built another way: the 16 bytes in both halves of the vector, the upper half's
    32-bit words shifted right by 4, then the bytes masked (on AVX2 vbroadcasti128, vpsrlvd, vpand: three
    instructions against four). Faster where the vector is used whole (the two-row Q4_1 dot); the eight-token tiles,
    which split it into halves again, compile better from load_nibbles_lo_hi (measured: pp512 10% slower). AArch64
    shifts bytes in one instruction (ushr .16b), so there it is load_nibbles_lo_hi: a mask a row and block fewer."""
    def codegen(context, builder, sig, args):
        if IS_AARCH64:
            return _nibbles_lo_hi(context, builder, sig, args)
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


# Byte b -> eight bytes, byte k 0x10 where bit k of b is set (little-endian): the fifth bits' table on AArch64.
_FIFTH_BITS = [sum(0x10 << (8 * k) for k in range(8) if (b >> k) & 1) for b in range(256)]


def _fifth_bits_table(builder):
    """The module's copy of _FIFTH_BITS (one per compiled module: internal, constant)."""
    name = "edgellm.fifth_bits"
    table = builder.module.globals.get(name)
    if table is None:
        ty = ir.ArrayType(_I64, 256)
        table = ir.GlobalVariable(builder.module, ty, name)
        table.linkage, table.global_constant = "internal", True
        table.initializer = ir.Constant(ty, _FIFTH_BITS)
    return table


@intrinsic
def load_fifth_bits(typingctx, buf, offset):
    """The little-endian uint32 at buf[offset] -> 32 bytes, byte j 0x10 where bit j is set, else 0 (Q5_0/Q5_1's qh
    as the quants' fifth bit). On AArch64 each byte's eight lanes come from a 256-entry table, as in llama.cpp's NEON
    code: LLVM lowers the <32 x i1> bitcast (a few vector instructions on x86) into 32 scalar bit extracts there, and
    spreading the bytes and testing each lane took eight vector instructions a block."""
    def codegen(context, builder, sig, args):
        word = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _I32)
        if not IS_AARCH64:
            bits = builder.zext(builder.bitcast(word, _vec(_I1, 32)), _vec(_I8, 32))
            return builder.shl(bits, ir.Constant(_vec(_I8, 32), [4] * 32))
        table = _fifth_bits_table(builder)
        lanes = ir.Constant(_vec(_I64, 4), ir.Undefined)
        for k in range(4):
            byte = builder.and_(builder.lshr(word, ir.Constant(_I32, 8 * k)), ir.Constant(_I32, 0xFF))
            entry = builder.gep(table, [ir.Constant(_I32, 0), builder.zext(byte, _I64)], inbounds=True,
                                source_etype=table.value_type)
            lanes = builder.insert_element(lanes, builder.load(entry, typ=_I64, align=8), ir.Constant(_I32, k))
        return builder.bitcast(lanes, _vec(_I8, 32))
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

"""512-bit tile steps (AVX-512 with VNNI, host.HAS_WIDE_TILES): one vector holds two 256-bit tile accumulators side
by side, so each vpdpbusd, conversion and FMA does the work of two; the lanes and their arithmetic are the 256-bit
ones, so the bits are too.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .f32_lanes import _pair_splats
from .i8x32 import _nibbles_broadcast
from .vector_ir import (F32x8, F32x16, I8x32, I8x64, _F32, _I1, _I8, _I32, _call_intrinsic, _cast_ptr, _load, _ptr,
                        _shuffle, _splat, _vec)


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



# --- tokens in lanes: the Q4_K prompt gemm (matmul_kquant.matmul_q4_k_wide) -----------------------------------


def _q4_k_pair_sums(name, rows, tvecs):
    """An intrinsic (w, wo, row_stride, xt, xo, tv_stride) -> UniTuple(F32x16, 2 * rows * tvecs): for each of `rows`
    rows (the packed 32 bytes of a Q4_K group pair at w[wo + r * row_stride]: group 2p in the low nibbles, 2p + 1 in
    the high) and each of `tvecs` vectors of sixteen tokens (xt[xo + v * tv_stride]: four bytes of each token per
    64-byte step, group 2p's 8 steps then group 2p + 1's), the two groups' exact integer dots in float lanes, one
    lane per token; order row, group, token vector. Each weight word is broadcast to all lanes (vpdpbusd's unsigned
    side, 0..15 after the mask) and each activation load serves every row."""
    def typer(typingctx, w, wo, row_stride, xt, xo, tv_stride):
        def codegen(context, builder, sig, args):
            i32x16, i64 = _vec(_I32, 16), ir.IntType(64)
            nibbles, four = ir.Constant(i32x16, [0x0F0F0F0F] * 16), ir.Constant(i32x16, [4] * 16)
            rows_at = [_ptr(context, builder, sig.args[0], args[0],
                            builder.add(args[1], builder.mul(args[2], ir.Constant(i64, r)))) for r in range(rows)]
            tokens_at = [_ptr(context, builder, sig.args[3], args[3],
                              builder.add(args[4], builder.mul(args[5], ir.Constant(i64, v)))) for v in range(tvecs)]
            sums = [ir.Constant(i32x16, None)] * (2 * rows * tvecs)
            for k in range(8):
                weights = []
                for at in rows_at:
                    word = _splat(builder, _load(builder, builder.gep(at, [ir.Constant(i64, 4 * k)], source_etype=_I8),
                                                 _I32), 16)
                    weights.append((builder.and_(word, nibbles), builder.and_(builder.lshr(word, four), nibbles)))
                for v, at in enumerate(tokens_at):
                    for g in range(2):
                        x = _load(builder, builder.gep(at, [ir.Constant(i64, 64 * (8 * g + k))], source_etype=_I8),
                                  i32x16)
                        for r in range(rows):
                            i = (2 * r + g) * tvecs + v
                            sums[i] = _call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.512", i32x16,
                                                      [sums[i], weights[r][g], x])
            return context.make_tuple(builder, sig.return_type, [builder.sitofp(s, _vec(_F32, 16)) for s in sums])
        return types.UniTuple(F32x16, 2 * rows * tvecs)(w, wo, row_stride, xt, xo, tv_stride), codegen
    typer.__name__ = name
    return intrinsic(typer)


q4_k_pair_sums_2x4 = _q4_k_pair_sums("q4_k_pair_sums_2x4", 2, 4)
q4_k_pair_sums_1x1 = _q4_k_pair_sums("q4_k_pair_sums_1x1", 1, 1)


@intrinsic
def load_f32x16(typingctx, buf, offset):
    """16 float32 at buf[offset] (a float32 array)."""
    def codegen(context, builder, sig, args):
        return _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1]), _vec(_F32, 16))
    return F32x16(buf, offset), codegen


@intrinsic
def store_f32x16(typingctx, buf, offset, v):
    """Write the 16 lanes of v to buf[offset:offset + 16] (a float32 array)."""
    if v is not F32x16:
        return None

    def codegen(context, builder, sig, args):
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(args[2], _cast_ptr(builder, ptr, args[2].type), align=4)
        return context.get_dummy_value()
    return types.none(buf, offset, v), codegen


@intrinsic
def f32x16_splat(typingctx, x):
    """16 lanes of the scalar x as float32."""
    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), 16)
    return F32x16(x), codegen


@intrinsic
def f32x16_mul(typingctx, a, b):
    """a * b per lane, one rounding each."""
    if a is not F32x16 or b is not F32x16:
        return None
    return F32x16(a, b), lambda context, builder, sig, args: builder.fmul(args[0], args[1])


@intrinsic
def f32x16_fma(typingctx, acc, a, b):
    """acc + a * b per lane, one rounding each (an FMA)."""
    if acc is not F32x16 or a is not F32x16 or b is not F32x16:
        return None

    def codegen(context, builder, sig, args):
        return _call_intrinsic(builder, "llvm.fma.v16f32", _vec(_F32, 16), [args[1], args[2], args[0]])
    return F32x16(acc, a, b), codegen


def _q6_k_superblock_sums(name, rows, tvecs):
    """An intrinsic (codes, co, code_stride, w, so, scale_stride, xt, xo, tv_stride, offsets, oo, offset_stride) ->
    UniTuple(F32x16, rows * tvecs), order row then token vector: each row's exact Q6_K super-block total for sixteen
    tokens a vector, sum over the 16 sub-blocks j of scale_j * (sum of (code - 32) * x), as float (one rounding).
    A row's 256 codes (0..63) are at codes[co + r * code_stride], its int8 scales at w[so + r * scale_stride + j];
    token vector v's activations are at xt[xo + v * tv_stride] (four bytes a token per 64-byte step, 4 steps a
    sub-block) and its -32 * (sum of x) per sub-block at offsets[oo + v * offset_stride + 16 j] (int32 lanes), where
    each sub-block's lanes start, so the code offset costs no instruction."""
    def typer(typingctx, codes, co, code_stride, w, so, scale_stride, xt, xo, tv_stride, offsets, oo, offset_stride):
        def codegen(context, builder, sig, args):
            i32x16, i64 = _vec(_I32, 16), ir.IntType(64)

            def at(k, base, stride, i):  # array k at args[base] + i * args[stride]
                return _ptr(context, builder, sig.args[k], args[k], builder.add(args[base], builder.mul(
                    args[stride], ir.Constant(i64, i))) if i else args[base])

            def byte(p, n):
                return builder.gep(p, [ir.Constant(i64, n)], source_etype=_I8)
            code_rows = [at(0, 1, 2, r) for r in range(rows)]
            scale_rows = [at(3, 4, 5, r) for r in range(rows)]
            tokens = [at(6, 7, 8, v) for v in range(tvecs)]
            offs = [at(9, 10, 11, v) for v in range(tvecs)]
            totals = [ir.Constant(i32x16, None)] * (rows * tvecs)
            for j in range(16):
                starts = [_load(builder, builder.gep(o, [ir.Constant(i64, 16 * j)], source_etype=_I32), i32x16)
                          for o in offs]
                sums = [starts[i % tvecs] for i in range(rows * tvecs)]
                for k in range(4):
                    xs = [_load(builder, byte(t, 64 * (4 * j + k)), i32x16) for t in tokens]
                    for r in range(rows):
                        word = _splat(builder, _load(builder, byte(code_rows[r], 16 * j + 4 * k), _I32), 16)
                        for v in range(tvecs):
                            i = r * tvecs + v
                            sums[i] = _call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.512", i32x16,
                                                      [sums[i], word, xs[v]])
                for r in range(rows):
                    scale = _splat(builder, builder.sext(_load(builder, byte(scale_rows[r], j), _I8), _I32), 16)
                    for v in range(tvecs):
                        i = r * tvecs + v
                        totals[i] = builder.add(totals[i], builder.mul(sums[i], scale))
            return context.make_tuple(builder, sig.return_type, [builder.sitofp(t, _vec(_F32, 16)) for t in totals])
        return types.UniTuple(F32x16, rows * tvecs)(codes, co, code_stride, w, so, scale_stride, xt, xo, tv_stride,
                                                    offsets, oo, offset_stride), codegen
    typer.__name__ = name
    return intrinsic(typer)


q6_k_superblock_sums_2x4 = _q6_k_superblock_sums("q6_k_superblock_sums_2x4", 2, 4)
q6_k_superblock_sums_1x1 = _q6_k_superblock_sums("q6_k_superblock_sums_1x1", 1, 1)

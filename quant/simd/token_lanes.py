"""Tokens in lanes: the K-quant prompt matmuls' integer sums with one token per lane (quant.matmul_kquant's
matmul_q4_k_wide and matmul_q6_k_wide). A row's 4-byte weight word is broadcast to every lane and dotted with four
bytes of each token, so no horizontal sums are needed and each activation load serves every row of a tile.

LANES tokens a vector: 16 in 512-bit vectors where the CPU has AVX-512 with VNNI (one vpdpbusd a step), else 8 in
256-bit ones through simd.dots' lanes (AVX2's vpmaddubsw + vpmaddwd, AVX-VNNI, AArch64 sdot or the generic ops).
The float steps (lanes_*, load_lanes, store_lanes) are simd.f32_lanes' F32x16 or F32x8 ones to match.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .dots import _dot_lanes
from .f32_lanes import (f32x8_fma, f32x8_mul, f32x8_splat, f32x16_fma, f32x16_mul, f32x16_splat, load_f32x8,
                        load_f32x16, store_f32x8, store_f32x16)
from .host import HAS_WIDE_TILES
from .vector_ir import F32x8, F32x16, _F32, _I8, _I32, _call_intrinsic, _load, _ptr, _splat, _vec

LANES = 16 if HAS_WIDE_TILES else 8
# token vectors a tile takes beside its two rows: the integer sums (2 rows x 2 groups x TILE_VECTORS for Q4_K) fill
# half of AVX-512's 32 registers at 4, and at 2 leave AVX2's 16 room for the weights and activations
TILE_VECTORS = 4 if HAS_WIDE_TILES else 2
_LANES_TYPE = F32x16 if HAS_WIDE_TILES else F32x8
_I64 = ir.IntType(64)


def _dot_step(builder, acc, word, x):
    """acc + per lane the four unsigned bytes of word (0..127) times the lane's four signed bytes of x."""
    i32s = _vec(_I32, LANES)
    if HAS_WIDE_TILES:
        return _call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.512", i32s, [acc, word, builder.bitcast(x, i32s)])
    bytes_type = _vec(_I8, 4 * LANES)
    return _dot_lanes(builder, builder.bitcast(word, bytes_type), builder.bitcast(x, bytes_type), False, base=acc)


def _at(context, builder, sig, args, k, base, stride, i):
    """A pointer into array argument k at element args[base] + i * args[stride]."""
    offset = builder.add(args[base], builder.mul(args[stride], ir.Constant(_I64, i))) if i else args[base]
    return _ptr(context, builder, sig.args[k], args[k], offset)


def _byte(builder, p, n):
    return builder.gep(p, [ir.Constant(_I64, n)], source_etype=_I8)


def _q4_k_pair_sums(name, rows, tvecs):
    """An intrinsic (w, wo, row_stride, xt, xo, tv_stride) -> UniTuple(lanes, 2 * rows * tvecs): for each of `rows`
    rows (the packed 32 bytes of a Q4_K group pair at w[wo + r * row_stride]: group 2p in the low nibbles, 2p + 1 in
    the high) and each of `tvecs` vectors of LANES tokens (xt[xo + v * tv_stride]: four bytes of each token per
    step, group 2p's 8 steps then group 2p + 1's), the two groups' exact integer dots in float lanes, one lane per
    token; order row, group, token vector."""
    def typer(typingctx, w, wo, row_stride, xt, xo, tv_stride):
        def codegen(context, builder, sig, args):
            i32s = _vec(_I32, LANES)
            nibbles, four = ir.Constant(i32s, [0x0F0F0F0F] * LANES), ir.Constant(i32s, [4] * LANES)
            rows_at = [_at(context, builder, sig, args, 0, 1, 2, r) for r in range(rows)]
            tokens_at = [_at(context, builder, sig, args, 3, 4, 5, v) for v in range(tvecs)]
            sums = [ir.Constant(i32s, None)] * (2 * rows * tvecs)
            for k in range(8):
                weights = []
                for at in rows_at:
                    word = _splat(builder, _load(builder, _byte(builder, at, 4 * k), _I32), LANES)
                    weights.append((builder.and_(word, nibbles), builder.and_(builder.lshr(word, four), nibbles)))
                for v, at in enumerate(tokens_at):
                    for g in range(2):
                        x = _load(builder, _byte(builder, at, 4 * LANES * (8 * g + k)), i32s)
                        for r in range(rows):
                            i = (2 * r + g) * tvecs + v
                            sums[i] = _dot_step(builder, sums[i], weights[r][g], x)
            return context.make_tuple(builder, sig.return_type, [builder.sitofp(s, _vec(_F32, LANES)) for s in sums])
        return types.UniTuple(_LANES_TYPE, 2 * rows * tvecs)(w, wo, row_stride, xt, xo, tv_stride), codegen
    typer.__name__ = name
    return intrinsic(typer)


q4_k_pair_sums_tile = _q4_k_pair_sums("q4_k_pair_sums_tile", 2, TILE_VECTORS)
q4_k_pair_sums_1x1 = _q4_k_pair_sums("q4_k_pair_sums_1x1", 1, 1)


def _q6_k_superblock_sums(name, rows, tvecs):
    """An intrinsic (codes, co, code_stride, w, so, scale_stride, xt, xo, tv_stride, offsets, oo, offset_stride) ->
    UniTuple(lanes, rows * tvecs), order row then token vector: each row's exact Q6_K super-block total for LANES
    tokens a vector, sum over the 16 sub-blocks j of scale_j * (sum of (code - 32) * x), as float (one rounding).
    A row's 256 codes (0..63) are at codes[co + r * code_stride], its int8 scales at w[so + r * scale_stride + j];
    token vector v's activations are at xt[xo + v * tv_stride] (four bytes a token per step, 4 steps a sub-block)
    and its -32 * (sum of x) per sub-block at offsets[oo + v * offset_stride + LANES j] (int32 lanes), where each
    sub-block's lanes start, so the code offset costs no instruction."""
    def typer(typingctx, codes, co, code_stride, w, so, scale_stride, xt, xo, tv_stride, offsets, oo, offset_stride):
        def codegen(context, builder, sig, args):
            i32s = _vec(_I32, LANES)
            code_rows = [_at(context, builder, sig, args, 0, 1, 2, r) for r in range(rows)]
            scale_rows = [_at(context, builder, sig, args, 3, 4, 5, r) for r in range(rows)]
            tokens = [_at(context, builder, sig, args, 6, 7, 8, v) for v in range(tvecs)]
            offs = [_at(context, builder, sig, args, 9, 10, 11, v) for v in range(tvecs)]
            totals = [ir.Constant(i32s, None)] * (rows * tvecs)
            for j in range(16):
                starts = [_load(builder, builder.gep(o, [ir.Constant(_I64, LANES * j)], source_etype=_I32), i32s)
                          for o in offs]
                sums = [starts[i % tvecs] for i in range(rows * tvecs)]
                for k in range(4):
                    xs = [_load(builder, _byte(builder, t, 4 * LANES * (4 * j + k)), i32s) for t in tokens]
                    for r in range(rows):
                        word = _splat(builder, _load(builder, _byte(builder, code_rows[r], 16 * j + 4 * k), _I32),
                                      LANES)
                        for v in range(tvecs):
                            sums[r * tvecs + v] = _dot_step(builder, sums[r * tvecs + v], word, xs[v])
                for r in range(rows):
                    scale = _splat(builder, builder.sext(_load(builder, _byte(builder, scale_rows[r], j), _I8), _I32),
                                   LANES)
                    for v in range(tvecs):
                        i = r * tvecs + v
                        totals[i] = builder.add(totals[i], builder.mul(sums[i], scale))
            return context.make_tuple(builder, sig.return_type,
                                      [builder.sitofp(t, _vec(_F32, LANES)) for t in totals])
        return types.UniTuple(_LANES_TYPE, rows * tvecs)(codes, co, code_stride, w, so, scale_stride, xt, xo,
                                                          tv_stride, offsets, oo, offset_stride), codegen
    typer.__name__ = name
    return intrinsic(typer)


q6_k_superblock_sums_tile = _q6_k_superblock_sums("q6_k_superblock_sums_tile", 2, TILE_VECTORS)
q6_k_superblock_sums_1x1 = _q6_k_superblock_sums("q6_k_superblock_sums_1x1", 1, 1)


# the float steps at the lane count above
if HAS_WIDE_TILES:
    load_lanes, store_lanes, lanes_splat, lanes_mul, lanes_fma = (load_f32x16, store_f32x16, f32x16_splat,
                                                                  f32x16_mul, f32x16_fma)
else:
    load_lanes, store_lanes, lanes_splat, lanes_mul, lanes_fma = (load_f32x8, store_f32x8, f32x8_splat, f32x8_mul,
                                                                  f32x8_fma)

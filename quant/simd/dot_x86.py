"""The int8 dot product's lanes on x86: llama.cpp's AVX2 sequence, or one AVX-VNNI vpdpbusd where the CPU has it.

vpmaddubsw (unsigned x signed bytes -> pairs summed into int16) then vpmaddwd (int16 pairs -> int32, times ones or
per-half scales). vpmaddubsw needs an unsigned left side, so signed weights go in as |w| with the activation's sign
flipped where w < 0 (vpsignb). Its int16 sums saturate above 32767; the quants here never get there (|w| <= 128
and activations are within +-127, so a pair is at most 2 * 128 * 127 = 32512). vpdpbusd sums the four unsigned x
signed byte products of each lane straight into int32, without the int16 step: the same integers.
"""

from llvmlite import ir

from .host import HAS_VNNI
from .vector_ir import _I1, _I16, _I32, _call_intrinsic, _vec


def _x86(builder, name, ret, *args):
    return _call_intrinsic(builder, f"llvm.x86.avx2.{name}", ret, list(args))


def avx2_dot_lanes(builder, w, x, signed, pair_scales, base):
    """simd.dots._dot_lanes on an AVX2 host."""
    i32x8 = _vec(_I32, 8)
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
    return lanes if base is None else builder.add(base, lanes)

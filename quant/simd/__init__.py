"""Portable SIMD building blocks for the Numba kernels, written as LLVM vector IR.

Why this exists: Numba leaves LLVM's SLP vectoriser off (numba.config.SLP_VECTORIZE, off since a
miscompilation), so a fixed 32-element block loop is fully unrolled into scalar code, and Numba types
int8*int8 as int64. A per-block integer dot product written in plain Numba runs at ~1 GB/s. Here each
operation is one small `@intrinsic` that emits generic LLVM vector instructions (<32 x i8>, <8 x i32>,
<8 x float>); LLVM lowers them for the host (vcvtph2ps, vfmadd231ps, ... on AVX2, whatever other targets
have), and Numba keeps the values in registers between calls. Target intrinsics are named only where generic IR
would not give the instruction: the int8 dot products (x86 vpmaddubsw / vpmaddwd / vpdpbusd, AArch64 sdot or
smull + saddlp) with a generic fallback computing the same lanes, and the AVX-512 tiles' 512-bit vpdpbusd.
A kernel then reads like llama.cpp's intrinsic code, e.g. for a Q8_0 block:

    acc = f32x8_fma_i32(acc, dot_i8x32(load_i8x32(w, o + 2), load_i8x32(xq, 32 * b)), load_f16(w, o) * d_x)

Contract: offsets are in elements of the array passed (bytes for uint8 buffers), and nothing is bounds
checked or wrapped here: callers validate every size in Python before a kernel runs.

Types: I8x32 (32 signed bytes), I32x8 (8 int32 lanes of partial sums), F32x8 (8 float lanes), F32x4 (4 float
lanes: two rows' block scales side by side); I8x64 and F32x16 for the 512-bit tiles.

  host.py          which instructions the CPU has (HAS_AVX2, HAS_VNNI, HAS_WIDE_TILES, HAS_DOTPROD, NATIVE_F16, ...)
  vector_ir.py     the vector types and the LLVM IR helpers every intrinsic is built from
  loads.py         scalar loads (f16, bf16, f32, integers), float16 bits, prefetch
  i8x32.py         decoding quants into 32 signed bytes: loads, stores, nibbles, bits, byte arithmetic
  dots.py          int8 dot products into I32x8 lanes, dispatched to dot_x86.py (AVX2, AVX-VNNI),
                   dot_aarch64.py (sdot, NEON) or a generic fallback
  tiles_avx512.py  512-bit tile steps: two 256-bit tile accumulators in one vector
  token_lanes.py   the K-quant prompt matmuls' sums with one token per lane (16 or 8 lanes)
  i32x8.py         integer lane arithmetic and horizontal sums
  f32_lanes.py     F32x8 and F32x4: FMAs, sums in llama.cpp's orders, loads, stores, activation quantization
  scalar_float.py  fma32, float32 bit tricks, float32 -> float16 rounding

Kernels import every name from this package; the modules above are where each one lives.
"""

from .. import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
from .host import (HAS_AVX2, HAS_DOTPROD, HAS_I8MM, HAS_VNNI, HAS_WIDE_TILES, IS_AARCH64, IS_ZEN, NATIVE_F16,
                   cpu_name)
from .vector_ir import F32x4, F32x8, F32x16, I8x32, I8x64, I32x8
from .loads import (f16_bits_to_f32, f32_bits, load_bf16, load_f16, load_f16_pair, load_f16_portable, load_f32,
                    load_i32, load_i8, load_u32, load_u8, prefetch)
from .i8x32 import (i8x32_add, i8x32_and, i8x32_dup_hi, i8x32_dup_lo, i8x32_or, i8x32_shl, i8x32_shr, i8x32_sub,
                    i8x32_xor, load_fifth_bits, load_i8x32, load_nibbles_lo_hi, load_nibbles_lo_hi_bcast,
                    load_nibbles_rows2, store_i8x32, store_lane_sums, store_pair64)
from .dots import (dot4_u8x32_byte_scales, dot_i8x32, dot_i8x32_2scales, dot_u8x32, dot_u8x32_2scales, dot_u8x32_plus,
                   dot_u8x32_scale_pair)
from .tiles_avx512 import (TILE_START, f32x16_halves, f32x16_pair_scales, f32x16_tile_step, f32x16_tile_sums8,
                           f32x16_zero, i8x64_tile_quants, load_nibbles_tile64, load_q5_tile64)
from .token_lanes import (LANES, TILE_VECTORS, lanes_fma, lanes_mul, lanes_splat, load_lanes, q4_k_pair_sums_1x1,
                          q4_k_pair_sums_tile, q6_k_superblock_sums_1x1, q6_k_superblock_sums_tile, store_lanes)
from .i32x8 import (i32x8_add, i32x8_hsum, i32x8_hsum4, i32x8_hsum8, i32x8_hsum_halves4, i32x8_hsum_two, i32x8_madd,
                    i32x8_mins_dot, i32x8_mul, i32x8_splat, i32x8_zero, load_i32x8, pair_dot_i8_i32)
from .f32_lanes import (absmax_f32x32, f32x4_add, f32x4_lane, f32x4_mul, f32x4_zero, f32x8_add, f32x8_fma,
                        f32x8_fma_i32, f32x8_fma_lanes, f32x8_from_i32, f32x8_hsum, f32x8_hsum_pairs, f32x8_hsum_split,
                        f32x8_lane, f32x8_mul, f32x8_pair_splats, f32x8_splat, f32x8_sub, f32x8_zero, f32x16_fma,
                        f32x16_splat, load_bf16x8, load_f16_splat8, load_f16x2_rows, load_f16x8_pair, load_f16x8_rows,
                        load_f16x8, load_f16x16, load_f32x2_twice, load_f32x8, load_f32x8_pair, load_f32x8_twice,
                        load_f32x16, quantize_f32x16_clamped, quantize_f32x32, store_f32x8, store_f32x16)
from .scalar_float import f32_from_bits, f32_shl23_add, f32_to_f16, f32_to_f16_portable, fma32, round_f16

__all__ = ["F32x16", "F32x4", "F32x8", "HAS_AVX2", "HAS_DOTPROD", "HAS_I8MM", "HAS_VNNI", "HAS_WIDE_TILES", "I32x8",
           "I8x32", "I8x64", "IS_AARCH64", "IS_ZEN", "LANES", "NATIVE_F16", "TILE_START", "TILE_VECTORS", "absmax_f32x32",
           "cpu_name", "dot4_u8x32_byte_scales", "dot_i8x32", "dot_i8x32_2scales", "dot_u8x32", "dot_u8x32_2scales",
           "dot_u8x32_plus", "dot_u8x32_scale_pair", "f16_bits_to_f32", "f32_bits", "f32_from_bits", "f32_shl23_add",
           "f32_to_f16", "f32_to_f16_portable", "f32x16_fma", "f32x16_halves", "f32x16_pair_scales",
           "f32x16_splat", "f32x16_tile_step", "f32x16_tile_sums8", "f32x16_zero", "f32x4_add", "f32x4_lane", "f32x4_mul", "f32x4_zero", "f32x8_add", "f32x8_fma",
           "f32x8_fma_i32", "f32x8_fma_lanes", "f32x8_from_i32", "f32x8_hsum", "f32x8_hsum_pairs", "f32x8_hsum_split",
           "f32x8_lane", "f32x8_mul", "f32x8_pair_splats", "f32x8_splat", "f32x8_sub", "f32x8_zero", "fma32",
           "i32x8_add", "i32x8_hsum", "i32x8_hsum4", "i32x8_hsum8", "i32x8_hsum_halves4", "i32x8_hsum_two",
           "i32x8_madd", "i32x8_mins_dot", "i32x8_mul", "i32x8_splat", "i32x8_zero", "i8x32_add", "i8x32_and",
           "i8x32_dup_hi", "i8x32_dup_lo", "i8x32_or", "i8x32_shl", "i8x32_shr", "i8x32_sub", "i8x32_xor",
           "i8x64_tile_quants", "lanes_fma", "lanes_mul", "lanes_splat", "load_bf16", "load_bf16x8",
           "load_f16", "load_f16_pair", "load_f16_portable", "load_f16_splat8", "load_f16x2_rows", "load_f16x8_pair",
           "load_f16x8_rows", "load_f16x8", "load_f16x16", "load_f32", "load_f32x2_twice", "load_f32x8",
           "load_f32x8_pair", "load_f32x8_twice", "load_f32x16", "load_fifth_bits", "load_i32", "load_i32x8",
           "load_i8", "load_i8x32", "load_lanes", "load_nibbles_lo_hi", "load_nibbles_lo_hi_bcast",
           "load_nibbles_rows2", "load_nibbles_tile64", "load_q5_tile64", "load_u32", "load_u8", "pair_dot_i8_i32",
           "prefetch",
           "q4_k_pair_sums_1x1", "q4_k_pair_sums_tile", "q6_k_superblock_sums_1x1", "q6_k_superblock_sums_tile",
           "quantize_f32x16_clamped", "quantize_f32x32", "round_f16", "store_f32x8", "store_f32x16", "store_i8x32", "store_lane_sums",
           "store_lanes", "store_pair64"]

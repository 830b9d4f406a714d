"""IQ4_XS: 256-value super-blocks of IQ4_NL's 16-level table with a 6-bit scale per 32-value sub-block.

Block (136 bytes): d f16 | scales_h u16 | scales_l[4] | qs[128]. Sub-block ib (0..7) has the scale
ls = (4 bits of scales_l[ib // 2], the low nibble for even ib) | (bits 2ib, 2ib+1 of scales_h) << 4, minus 32, and
16 bytes of indices at qs[16 ib] (element j < 16 the low nibble of byte j, j + 16 its high nibble, as IQ4_NL); the
weight is (d * ls) * KVALUES_IQ4NL[index].

Computed against Q8_K activations as llama.cpp's ggml_vec_dot_iq4_xs_q8_K does on AVX2 (no repacking): per sub-block the 32 table values times the int8
activations, pairs summed and times ls into 8 exact int32 lanes (four consecutive values each); the lanes of the
8 sub-blocks added; one FMA per super-block of float(lanes) with d_w * d_x into one float accumulator of 8 lanes,
summed at the end as hsum_float_8. Batches of 8 tokens or more llama.cpp hands to its tiled K-quant matmul
(ggml-cpu/tiled), which rounds once per super-block instead: res = d_w * float(exact total), acc = fma(res, d_x, acc)
(tiled_dot_iq4_xs_q8_k); matmul_iq4_xs takes each token's kind as the K-quants' kernels do.

Here: block_iq4_xs, the dequantizer; vec_dot_iq4_xs_q8_k and vec_dot4_iq4_xs_q8_k (one row x four tokens, each
super-block decoded once); tiled_dot_iq4_xs_q8_k; matmul_iq4_xs (the contract of quant.matmul_kquant); quantize_block_iq4_xs, llama.cpp's
quantize_iq4_xs without an importance matrix (the operations of quant.reference.quantize_iq4_xs).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .dots_block32 import PREFETCH_BYTES
from .iq4_nl import block_scale_iq4_nl, load_iq4_nl_values, nearest_level_iq4_nl
from .kernels_kquant import TOKEN_TILE, _quantize_tokens
from .quantize_kernels import _f16_bits, _put_u16
from .reference import KVALUES_IQ4NL
from .simd import (dot_i8x32_2scales, f32x8_fma_i32, f32x8_hsum, f32x8_zero, fma32, i32x8_add, i32x8_hsum, i32x8_zero,
                   load_f16, load_f32, load_i8x32, load_u8, prefetch)

BLOCK_BYTES = 136


@njit(cache=True, inline="always")
def _sub_scale(w, o, ib):
    """Sub-block ib's signed 6-bit scale (-32..31) of the super-block at byte o."""
    low = (load_u8(w, o + 4 + (ib >> 1)) >> (4 * (ib & 1))) & 15
    high = ((load_u8(w, o + 2 + (ib >> 2)) >> (2 * (ib & 3))) & 3) << 4
    return (low | high) - 32


@njit(cache=True)
def block_iq4_xs(w, o, out, p):
    d = load_f16(w, o)
    for ib in range(8):
        dl = d * np.float32(_sub_scale(w, o, ib))
        for j in range(16):
            q = np.int32(w[o + 8 + 16 * ib + j])
            out[p + 32 * ib + j] = dl * np.float32(KVALUES_IQ4NL[q & 15])
            out[p + 32 * ib + j + 16] = dl * np.float32(KVALUES_IQ4NL[q >> 4])


@njit(cache=True, inline="always")
def _lanes(w, o, xq, xo):
    """The super-block's 8 exact int32 lanes: sum over sub-blocks of ls * (four consecutive values . activations)."""
    lanes = i32x8_zero()
    for ib in range(8):
        ls = _sub_scale(w, o, ib)
        lanes = i32x8_add(lanes, dot_i8x32_2scales(load_iq4_nl_values(w, o + 8 + 16 * ib),
                                                   load_i8x32(xq, xo + 32 * ib), ls, ls))
    return lanes


@njit(cache=True)
def vec_dot_iq4_xs_q8_k(w, o, nsb, xq, xo, xd, bsums):
    """One row x one token (ggml_vec_dot_iq4_xs_q8_K's bits). bsums: unused (no mins), kept for the contract."""
    acc = f32x8_zero()
    for b in range(nsb):
        ob = o + BLOCK_BYTES * b
        prefetch(w, ob + PREFETCH_BYTES)
        acc = f32x8_fma_i32(acc, _lanes(w, ob, xq, xo + 256 * b), load_f16(w, ob) * load_f32(xd, xo // 256 + b))
    return f32x8_hsum(acc)


@njit(cache=True)
def vec_dot4_iq4_xs_q8_k(w, o, nsb, xq, xo, n_in, xd):
    """One row x tokens at xo, xo + n_in, ..: each sub-block's values and scale decoded once for the four, each
    token's arithmetic vec_dot's."""
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for b in range(nsb):
        ob, k = o + BLOCK_BYTES * b, xo + 256 * b
        prefetch(w, ob + PREFETCH_BYTES)
        s0, s1, s2, s3 = i32x8_zero(), i32x8_zero(), i32x8_zero(), i32x8_zero()
        for ib in range(8):
            ls = _sub_scale(w, ob, ib)
            q = load_iq4_nl_values(w, ob + 8 + 16 * ib)
            s0 = i32x8_add(s0, dot_i8x32_2scales(q, load_i8x32(xq, k + 32 * ib), ls, ls))
            s1 = i32x8_add(s1, dot_i8x32_2scales(q, load_i8x32(xq, k + n_in + 32 * ib), ls, ls))
            s2 = i32x8_add(s2, dot_i8x32_2scales(q, load_i8x32(xq, k + 2 * n_in + 32 * ib), ls, ls))
            s3 = i32x8_add(s3, dot_i8x32_2scales(q, load_i8x32(xq, k + 3 * n_in + 32 * ib), ls, ls))
        d, xb, nb = load_f16(w, ob), xo // 256 + b, n_in // 256
        a0 = f32x8_fma_i32(a0, s0, d * load_f32(xd, xb))
        a1 = f32x8_fma_i32(a1, s1, d * load_f32(xd, xb + nb))
        a2 = f32x8_fma_i32(a2, s2, d * load_f32(xd, xb + 2 * nb))
        a3 = f32x8_fma_i32(a3, s3, d * load_f32(xd, xb + 3 * nb))
    return f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3)


@njit(cache=True)
def tiled_dot_iq4_xs_q8_k(w, o, nsb, xq, xo, xd):
    """One row x one token as llama.cpp's tiled K-quant matmul (ggml-cpu/tiled, batches of 8 tokens or more): per
    super-block res = d_w * float(exact total of the lanes), then acc = fma(res, d_x, acc)."""
    acc = np.float32(0)
    for b in range(nsb):
        ob = o + BLOCK_BYTES * b
        total = i32x8_hsum(_lanes(w, ob, xq, xo + 256 * b))
        acc = fma32(load_f16(w, ob) * np.float32(total), load_f32(xd, xo // 256 + b), acc)
    return acc


@njit(parallel=True, cache=True)
def matmul_iq4_xs(w, row_bytes, x, xq, xd, bsums, out, kinds):
    """kinds[t] (the registry's row_kinds_of): 1 for the tokens llama.cpp multiplies with its tiled matmul, 0 for
    vec_dot (four at a time where four in a row are)."""
    _quantize_tokens(x, xq, xd, bsums)
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    for r in prange(n_out):
        o, t = r * row_bytes, 0
        while t < n_tokens:
            if kinds[t]:
                out[t, r] = tiled_dot_iq4_xs_q8_k(w, o, nsb, xq, t * n_in, xd)
                t += 1
            elif t + TOKEN_TILE <= n_tokens and not (kinds[t + 1] or kinds[t + 2] or kinds[t + 3]):
                out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = vec_dot4_iq4_xs_q8_k(w, o, nsb, xq, t * n_in,
                                                                                              n_in, xd)
                t += TOKEN_TILE
            else:
                out[t, r] = vec_dot_iq4_xs_q8_k(w, o, nsb, xq, t * n_in, xd, bsums)
                t += 1


# --- quantizer ---------------------------------------------------------------------------------------------------


@njit(cache=True)
def quantize_block_iq4_xs(x, out, L, Laux, w, scales, mins, ints):
    """x float32[256] -> out uint8[136]; scales: scratch for the 8 sub-block scales (the rest unused). The
    operations of quant.reference.quantize_iq4_xs, none contracted into an FMA."""
    amax_scale, max_scale = np.float32(0), np.float32(0)
    for ib in range(8):
        s = block_scale_iq4_nl(x[32 * ib:32 * ib + 32])
        scales[ib] = s
        if abs(s) > amax_scale:
            amax_scale, max_scale = abs(s), s
    d = -max_scale / np.float32(32)
    inv = np.float32(1) / d if d != 0 else np.float32(0)
    _put_u16(out, 0, _f16_bits(d))
    high = 0
    for ib in range(8):
        l = min(31, max(-32, int(np.rint(inv * scales[ib]))))
        dl = d * np.float32(l)
        idl = np.float32(1) / dl if dl != 0 else np.float32(0)
        u = l + 32
        if ib % 2 == 0:
            out[4 + ib // 2] = u & 15
        else:
            out[4 + ib // 2] |= (u & 15) << 4
        high |= (u >> 4) << (2 * ib)
        for j in range(16):
            lo = nearest_level_iq4_nl(idl * x[32 * ib + j])
            hi = nearest_level_iq4_nl(idl * x[32 * ib + 16 + j])
            out[8 + 16 * ib + j] = lo | (hi << 4)
    _put_u16(out, 2, high)

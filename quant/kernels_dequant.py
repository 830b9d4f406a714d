"""Numba dequantization for every format, bit-exact with quant.reference (and so with gguf-py).

Per format: `block_<fmt>(w, o, out, p)` dequantizes the block at byte offset `o` of `w` into
out[p : p + block_size], with the same float32 operations in the same order as the numpy reference (no
fastmath: contracting d*q + m into an FMA would change the bits). The row drivers that run them,
`dequantize_rows_<fmt>`, are generated into quant.dequantize_rows (tools/gen_kernels.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .simd import load_bf16, load_f16, load_f32, load_u8, load_u32

_F32 = np.float32


@njit(cache=True)
def block_f32(w, o, out, p):
    out[p] = load_f32(w, o)


@njit(cache=True)
def block_f16(w, o, out, p):
    out[p] = load_f16(w, o)


@njit(cache=True)
def block_bf16(w, o, out, p):
    out[p] = load_bf16(w, o)


@njit(cache=True)
def block_q4_0(w, o, out, p):
    d = load_f16(w, o)
    for j in range(16):
        q = np.int32(w[o + 2 + j])
        out[p + j] = d * _F32((q & 15) - 8)
        out[p + j + 16] = d * _F32((q >> 4) - 8)


@njit(cache=True)
def block_q4_1(w, o, out, p):
    d, m = load_f16(w, o), load_f16(w, o + 2)
    for j in range(16):
        q = np.int32(w[o + 4 + j])
        out[p + j] = d * _F32(q & 15) + m
        out[p + j + 16] = d * _F32(q >> 4) + m


@njit(cache=True)
def block_q5_0(w, o, out, p):
    d, qh = load_f16(w, o), load_u32(w, o + 2)
    for j in range(16):
        q = np.int32(w[o + 6 + j])
        out[p + j] = d * _F32(((q & 15) | (((qh >> j) & 1) << 4)) - 16)
        out[p + j + 16] = d * _F32(((q >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16)


@njit(cache=True)
def block_q5_1(w, o, out, p):
    d, m, qh = load_f16(w, o), load_f16(w, o + 2), load_u32(w, o + 4)
    for j in range(16):
        q = np.int32(w[o + 8 + j])
        out[p + j] = d * _F32((q & 15) | (((qh >> j) & 1) << 4)) + m
        out[p + j + 16] = d * _F32((q >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m


@njit(cache=True)
def block_q8_0(w, o, out, p):
    d = load_f16(w, o)
    for j in range(32):
        out[p + j] = _F32(np.int8(w[o + 2 + j])) * d


@njit(cache=True)
def block_q2_k(w, o, out, p):
    d, dmin = load_f16(w, o + 80), load_f16(w, o + 82)
    for h in range(2):
        for j in range(4):
            for l in range(32):
                s = np.int32(w[o + h * 8 + j * 2 + l // 16])  # scale byte of this 16-element sub-block
                q = (np.int32(w[o + 16 + h * 32 + l]) >> (2 * j)) & 3
                out[p + h * 128 + j * 32 + l] = (d * _F32(s & 15)) * _F32(q) - dmin * _F32(s >> 4)


@njit(cache=True, inline="always")
def q3_k_scale(w, o_scales, s):
    """Signed 6-bit scale s (0..15) of a Q3_K block whose 12 scale bytes start at o_scales: low 4 bits from
    byte s % 8 (low nibble for s < 8, high for s >= 8), top 2 bits from bits 2*(s // 4) of byte 8 + s % 4."""
    low = (load_u8(w, o_scales + (s & 7)) >> (4 * (s >> 3))) & 15
    high = (load_u8(w, o_scales + 8 + (s & 3)) >> (2 * (s >> 2))) & 3
    return np.int32((low | (high << 4)) - 32)


@njit(cache=True)
def block_q3_k(w, o, out, p):
    d = load_f16(w, o + 108)
    for h in range(2):
        for j in range(4):
            for l in range(32):
                e = h * 128 + j * 32 + l
                low = (np.int32(w[o + 32 + h * 32 + l]) >> (2 * j)) & 3
                hbit = (np.int32(w[o + l]) >> (4 * h + j)) & 1
                out[p + e] = (d * _F32(q3_k_scale(w, o + 96, e // 16))) * _F32(low - ((hbit ^ 1) << 2))


@njit(cache=True, inline="always")
def k_scales_mins(w, o_scales):
    """The eight 6-bit scales and the eight mins of a Q4_K / Q5_K block whose 12 scale bytes start at o_scales, as
    two 64-bit words of one byte each (sub-block j in byte j).

    Bytes 0-3 hold scales 0-3 in their low 6 bits and the top 2 bits of scales 4-7; bytes 4-7 the same for
    the mins; bytes 8-11 the low 4 bits of scale 4+i (low nibble) and min 4+i (high nibble). Worked on
    as three words, with no branch."""
    a, b, c = load_u32(w, o_scales), load_u32(w, o_scales + 4), load_u32(w, o_scales + 8)
    scales = (a & 0x3F3F3F3F) | (((c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030)) << 32)
    mins = (b & 0x3F3F3F3F) | ((((c >> 4) & 0x0F0F0F0F) | ((b >> 2) & 0x30303030)) << 32)
    return scales, mins


@njit(cache=True, inline="always")
def k_scale_min(w, o_scales, j):
    """(scale, min) of sub-block j (0..7) of a Q4_K / Q5_K block whose 12 scale bytes start at o_scales."""
    scales, mins = k_scales_mins(w, o_scales)
    return np.int32((scales >> (8 * j)) & 63), np.int32((mins >> (8 * j)) & 63)


@njit(cache=True)
def block_q4_k(w, o, out, p):
    d, dmin = load_f16(w, o), load_f16(w, o + 2)
    for j in range(8):
        sc, mn = k_scale_min(w, o + 4, j)
        ds, dm = d * _F32(sc), dmin * _F32(mn)
        for l in range(32):
            q = (np.int32(w[o + 16 + (j // 2) * 32 + l]) >> (4 * (j % 2))) & 15
            out[p + j * 32 + l] = ds * _F32(q) - dm


@njit(cache=True)
def block_q5_k(w, o, out, p):
    d, dmin = load_f16(w, o), load_f16(w, o + 2)
    for j in range(8):
        sc, mn = k_scale_min(w, o + 4, j)
        ds, dm = d * _F32(sc), dmin * _F32(mn)
        for l in range(32):
            q = (np.int32(w[o + 48 + (j // 2) * 32 + l]) >> (4 * (j % 2))) & 15
            q |= ((np.int32(w[o + 16 + l]) >> j) & 1) << 4
            out[p + j * 32 + l] = ds * _F32(q) - dm


@njit(cache=True)
def block_q6_k(w, o, out, p):
    d = load_f16(w, o + 208)
    for h in range(2):
        for j in range(4):  # element h*128 + j*32 + l: nibble j//2 of ql[h*64 + (j%2)*32 + l], crumb j of qh
            for l in range(32):
                e = h * 128 + j * 32 + l
                low = (np.int32(w[o + h * 64 + (j % 2) * 32 + l]) >> (4 * (j // 2))) & 15
                high = (np.int32(w[o + 128 + h * 32 + l]) >> (2 * j)) & 3
                ds = d * _F32(np.int8(w[o + 192 + e // 16]))
                out[p + e] = ds * _F32((low | (high << 4)) - 32)


@njit(cache=True)
def block_q8_k(w, o, out, p):
    d = load_f32(w, o)
    for j in range(256):
        out[p + j] = _F32(np.int8(w[o + 4 + j])) * d


# --- drivers: out[i, :] = row rows[i] ----------------------------------------------------------------------

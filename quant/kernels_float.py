"""Matmul kernels for the float weight formats F32, F16 and BF16, in llama.cpp's arithmetic (its x86 AVX2 build).

  matmul_<fmt>(w, row_bytes, x, out, kinds): out[t, r] = row r . x[t] for x float32 (T, n_in), weights read in
  place from the uint8 buffer `w`; kinds[t] (the registry's ROWS_PAIRS rule) is 1 where llama.cpp multiplies token t
  in a batch of two or more tokens, 0 where it is a batch of one.

llama.cpp gives a float matrix two kernels, which sum in different orders:
  - a batch of 2+ tokens whose width is a multiple of 8: llamafile's tinyBLAS, one 8-lane FMA accumulator per
    (row, token) over the whole row, its lanes summed ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7));
  - a batch of one token, or any width not a multiple of 8: ggml_vec_dot_<type>, four 8-lane accumulators over runs
    of 32 values (F32, F16: FMA; BF16: a product, then a sum), combined as (a0+a2) + (a1+a3); then the lanes, F32
    and F16 as ((l0+l4) + (l1+l5)) + ((l2+l6) + (l3+l7)) (two hadds), BF16 in tinyBLAS's order; the last n % 32
    values one by one, each product rounded, then added (F32 in float32; F16 and BF16 in float64, rounded to float32
    at the end).
F16 and BF16 weights are multiplied by activations rounded to their own type first (llama.cpp's vec_dot_type), to
nearest even. `matmul_float_ref` below is the numpy reference of all of it.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .simd import (f16_bits_to_f32, f32_bits, f32_from_bits, f32_to_f16, f32x8_add, f32x8_fma, f32x8_hsum,
                   f32x8_lane, f32x8_mul, f32x8_zero, load_bf16, load_bf16x8, load_f16, load_f16x8, load_f32,
                   load_f32x8)

TOKEN_TILE = 4
VEC_DOT_STEP = 32  # ggml_vec_dot's run: four accumulators of 8 lanes
_KIND_F32, _KIND_F16, _KIND_BF16 = 0, 1, 2  # which loader a driver's rows use (a constant per driver)


@njit(cache=True)
def _weights8(w, o, kind):
    """8 weights at byte o, widened to float32."""
    if kind == _KIND_F32:
        return load_f32x8(w, o)
    if kind == _KIND_F16:
        return load_f16x8(w, o)
    return load_bf16x8(w, o)


@njit(cache=True)
def _weight1(w, o, kind):
    if kind == _KIND_F32:
        return load_f32(w, o)
    if kind == _KIND_F16:
        return load_f16(w, o)
    return load_bf16(w, o)


@njit(cache=True, inline="always")
def _round_bf16(v):
    """float32 -> bfloat16 -> float32, to nearest even (NaN kept quiet), as ggml's GGML_FP32_TO_BF16."""
    u = np.uint32(f32_bits(np.float32(v)))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return f32_from_bits(((u >> np.uint32(16)) | np.uint32(64)) << np.uint32(16))
    return f32_from_bits(((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
                         << np.uint32(16))


@njit(cache=True)
def _activations(x, kind):
    """x as llama.cpp's float kernels take it: itself for F32 weights, rounded to float16 / bfloat16 for F16 / BF16."""
    if kind == _KIND_F32:
        return x
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for k in range(x.shape[1]):
            out[t, k] = f16_bits_to_f32(f32_to_f16(x[t, k])) if kind == _KIND_F16 else _round_bf16(x[t, k])
    return out


@njit(cache=True)
def _vec_dot(w, o, x, t, kind, size):
    """Row at byte o . x[t] as ggml_vec_dot_<type> (a batch of one token)."""
    n_in = x.shape[1]
    n32 = n_in - n_in % VEC_DOT_STEP
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    xo = t * n_in
    for k in range(0, n32, VEC_DOT_STEP):
        if kind == _KIND_BF16:
            a0 = f32x8_add(f32x8_mul(_weights8(w, o + size * k, kind), load_f32x8(x, xo + k)), a0)
            a1 = f32x8_add(f32x8_mul(_weights8(w, o + size * (k + 8), kind), load_f32x8(x, xo + k + 8)), a1)
            a2 = f32x8_add(f32x8_mul(_weights8(w, o + size * (k + 16), kind), load_f32x8(x, xo + k + 16)), a2)
            a3 = f32x8_add(f32x8_mul(_weights8(w, o + size * (k + 24), kind), load_f32x8(x, xo + k + 24)), a3)
        else:
            a0 = f32x8_fma(a0, _weights8(w, o + size * k, kind), load_f32x8(x, xo + k))
            a1 = f32x8_fma(a1, _weights8(w, o + size * (k + 8), kind), load_f32x8(x, xo + k + 8))
            a2 = f32x8_fma(a2, _weights8(w, o + size * (k + 16), kind), load_f32x8(x, xo + k + 16))
            a3 = f32x8_fma(a3, _weights8(w, o + size * (k + 24), kind), load_f32x8(x, xo + k + 24))
    acc = f32x8_add(f32x8_add(a0, a2), f32x8_add(a1, a3))
    if kind == _KIND_BF16:
        s = f32x8_hsum(acc)
    else:  # _mm_hadd_ps twice over (lo + hi)
        t0, t1 = f32x8_lane(acc, 0) + f32x8_lane(acc, 4), f32x8_lane(acc, 1) + f32x8_lane(acc, 5)
        t2, t3 = f32x8_lane(acc, 2) + f32x8_lane(acc, 6), f32x8_lane(acc, 3) + f32x8_lane(acc, 7)
        s = (t0 + t1) + (t2 + t3)
    if kind == _KIND_F32:
        for k in range(n32, n_in):
            s += load_f32(w, o + 4 * k) * x[t, k]  # not fused: llama.cpp's leftover loop rounds the product
        return s
    total = np.float64(s)
    for k in range(n32, n_in):
        total += np.float64(_weight1(w, o + size * k, kind) * x[t, k])
    return np.float32(total)


@njit(cache=True)
def _tiled_dot4(w, o, x, t, kind, size):
    """Row at byte o . x[t..t+3] as tinyBLAS (n_in a multiple of 8): four tokens share each widened weight vector."""
    n_in = x.shape[1]
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for k in range(0, n_in, 8):
        v, xo = _weights8(w, o + size * k, kind), t * n_in + k
        a0 = f32x8_fma(a0, v, load_f32x8(x, xo))
        a1 = f32x8_fma(a1, v, load_f32x8(x, xo + n_in))
        a2 = f32x8_fma(a2, v, load_f32x8(x, xo + 2 * n_in))
        a3 = f32x8_fma(a3, v, load_f32x8(x, xo + 3 * n_in))
    return f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3)


@njit(cache=True)
def _tiled_dot(w, o, x, t, kind, size):
    n_in = x.shape[1]
    acc = f32x8_zero()
    for k in range(0, n_in, 8):
        acc = f32x8_fma(acc, _weights8(w, o + size * k, kind), load_f32x8(x, t * n_in + k))
    return f32x8_hsum(acc)


@njit(cache=True)
def _matmul_rows(w, row_bytes, x, out, kinds, kind, size, r):
    n_tokens = x.shape[0]
    o = r * row_bytes
    if x.shape[1] % 8:  # tinyBLAS takes only widths that are a multiple of its 8 lanes
        for t in range(n_tokens):
            out[t, r] = _vec_dot(w, o, x, t, kind, size)
        return
    t = 0
    while t < n_tokens:
        if t + TOKEN_TILE <= n_tokens and kinds[t] and kinds[t + 1] and kinds[t + 2] and kinds[t + 3]:
            out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = _tiled_dot4(w, o, x, t, kind, size)
            t += TOKEN_TILE
            continue
        out[t, r] = _tiled_dot(w, o, x, t, kind, size) if kinds[t] else _vec_dot(w, o, x, t, kind, size)
        t += 1


# The weight type is a constant in each driver, so LLVM folds the `kind` branches away.


@njit(parallel=True, cache=True)
def matmul_f32(w, row_bytes, x, out, kinds):
    for r in prange(out.shape[1]):
        _matmul_rows(w, row_bytes, x, out, kinds, _KIND_F32, 4, r)


@njit(parallel=True, cache=True)
def matmul_f16(w, row_bytes, x, out, kinds):
    xr = _activations(x, _KIND_F16)
    for r in prange(out.shape[1]):
        _matmul_rows(w, row_bytes, xr, out, kinds, _KIND_F16, 2, r)


@njit(parallel=True, cache=True)
def matmul_bf16(w, row_bytes, x, out, kinds):
    xr = _activations(x, _KIND_BF16)
    for r in prange(out.shape[1]):
        _matmul_rows(w, row_bytes, xr, out, kinds, _KIND_BF16, 2, r)


# --- numpy reference ---------------------------------------------------------------------------------------------

def round_activations(x: np.ndarray, name: str) -> np.ndarray:
    """x as the float kernels multiply it by `name` weights: F16 and BF16 round it to their type (nearest even)."""
    if name == "F16":
        return x.astype(np.float16).astype(np.float32)
    if name == "BF16":
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        rounded = np.where(nan, (u >> 16) | 64, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        return (rounded.astype(np.uint32) << 16).view(np.float32)
    return x


def _fma(a, b, c) -> np.float32:
    """float32 a * b + c rounded once. The product is exact in float64; the float64 sum s and its error e (TwoSum)
    hold the exact value, and rounding s to float32 is right unless s is a float32 midpoint, where e decides."""
    p, c = np.float64(a) * np.float64(b), np.float64(c)
    s = p + c
    bp = s - c
    e = (p - bp) + (c - (s - bp))
    r = np.float32(s)
    if e != 0 and np.isfinite(s) and np.float64(r) != s:
        other = np.nextafter(r, np.float32(np.inf) if np.float64(r) < s else np.float32(-np.inf))
        if np.float64(r) + np.float64(other) == 2 * s:  # a midpoint: round towards the exact value
            return other if (np.float64(other) > s) == (e > 0) else r
    return r


def _tiled_ref(w: np.ndarray, x: np.ndarray) -> np.float32:
    lanes = [np.float32(0)] * 8
    for k in range(0, len(x), 8):
        for j in range(8):
            lanes[j] = _fma(w[k + j], x[k + j], lanes[j])
    t = [np.float32(lanes[j] + lanes[j + 4]) for j in range(4)]
    return np.float32(np.float32(t[0] + t[2]) + np.float32(t[1] + t[3]))


def _vec_dot_ref(w: np.ndarray, x: np.ndarray, name: str) -> np.float32:
    n = len(x)
    n32 = n - n % VEC_DOT_STEP
    acc = [[np.float32(0)] * 8 for _ in range(4)]
    for k in range(0, n32, VEC_DOT_STEP):
        for a in range(4):
            for j in range(8):
                i = k + 8 * a + j
                if name == "BF16":
                    acc[a][j] = np.float32(np.float32(w[i] * x[i]) + acc[a][j])
                else:
                    acc[a][j] = _fma(w[i], x[i], acc[a][j])
    v = [np.float32(np.float32(acc[0][j] + acc[2][j]) + np.float32(acc[1][j] + acc[3][j])) for j in range(8)]
    t = [np.float32(v[j] + v[j + 4]) for j in range(4)]
    if name == "BF16":
        s = np.float32(np.float32(t[0] + t[2]) + np.float32(t[1] + t[3]))
    else:
        s = np.float32(np.float32(t[0] + t[1]) + np.float32(t[2] + t[3]))
    if name == "F32":
        for i in range(n32, n):
            s = np.float32(s + np.float32(w[i] * x[i]))
        return s
    total = np.float64(s)
    for i in range(n32, n):
        total += np.float64(np.float32(w[i] * x[i]))
    return np.float32(total)


def matmul_float_ref(weights: np.ndarray, x: np.ndarray, name: str, kinds) -> np.ndarray:
    """The reference of matmul_<name> (name F32, F16 or BF16): weights (n_out, n_in) as float32 (their exact values),
    x (T, n_in) float32, kinds[t] as the kernels take them. Scalar loops: for small shapes (tests)."""
    weights = np.asarray(weights, np.float32)
    xr = round_activations(np.asarray(x, np.float32), name)
    out = np.empty((x.shape[0], weights.shape[0]), np.float32)
    for t in range(x.shape[0]):
        for r in range(weights.shape[0]):
            if kinds[t] and x.shape[1] % 8 == 0:
                out[t, r] = _tiled_ref(weights[r], xr[t])
            else:
                out[t, r] = _vec_dot_ref(weights[r], xr[t], name)
    return out

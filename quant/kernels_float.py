"""Matmul kernels for the float weight formats F32, F16 and BF16: float32 activations, 8 float lanes.

  matmul_<fmt>(w, row_bytes, x, out): out[t, r] = row r . x[t] for x float32 (T, n_in), weights read in
  place from the uint8 buffer `w`. Four tokens share each loaded (and widened) weight vector; a row's last
  n_in % 8 elements are done one by one after the lanes are summed: llama.cpp's batched F32 product (its
  tinyBLAS sgemm, one 8-lane accumulator per output).
  matmul_f32_rows(w, row_bytes, x, out, single): the same, except that rows with single[t] set are summed as
  llama.cpp sums a one-row F32 product (ggml_vec_dot_f32: four accumulators, another order), as a decode step is.
"""

from __future__ import annotations

from numba import njit, prange
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .simd import (f32x8_add, f32x8_fma, f32x8_hsum, f32x8_hsum_pairs, f32x8_zero, load_bf16, load_bf16x8, load_f16, load_f16x8, load_f32,
                   load_f32x8)

TOKEN_TILE = 4
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


@njit(cache=True)
def _vec_dot(w, o, x, t, kind, size):
    n_in = x.shape[1]
    n8 = n_in - n_in % 8
    acc = f32x8_zero()
    for k in range(0, n8, 8):
        acc = f32x8_fma(acc, _weights8(w, o + size * k, kind), load_f32x8(x, t * n_in + k))
    s = f32x8_hsum(acc)
    for k in range(n8, n_in):
        s += _weight1(w, o + size * k, kind) * x[t, k]
    return s


@njit(cache=True)
def vec_dot_f32_one_row(w, o, x, t):
    """Row at byte o of F32 weights . x[t] as ggml_vec_dot_f32 sums it (AVX2, a one-row product): four 8-lane
    accumulators over steps of 32, folded (a0 + a2) + (a1 + a3), the lanes by two horizontal adds; the last
    n_in % 32 products then added one by one, each rounded (not fused: checked on a 48-wide row)."""
    n_in = x.shape[1]
    n32 = n_in - n_in % 32
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    xo = t * n_in
    for k in range(0, n32, 32):
        a0 = f32x8_fma(a0, load_f32x8(w, o + 4 * k), load_f32x8(x, xo + k))
        a1 = f32x8_fma(a1, load_f32x8(w, o + 4 * k + 32), load_f32x8(x, xo + k + 8))
        a2 = f32x8_fma(a2, load_f32x8(w, o + 4 * k + 64), load_f32x8(x, xo + k + 16))
        a3 = f32x8_fma(a3, load_f32x8(w, o + 4 * k + 96), load_f32x8(x, xo + k + 24))
    s = f32x8_hsum_pairs(f32x8_add(f32x8_add(a0, a2), f32x8_add(a1, a3)))
    for k in range(n32, n_in):
        s += load_f32(w, o + 4 * k) * x[t, k]
    return s


@njit(cache=True)
def _vec_dot4(w, o, x, t, kind, size):
    n_in = x.shape[1]
    n8 = n_in - n_in % 8
    a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
    for k in range(0, n8, 8):
        v, xo = _weights8(w, o + size * k, kind), t * n_in + k
        a0 = f32x8_fma(a0, v, load_f32x8(x, xo))
        a1 = f32x8_fma(a1, v, load_f32x8(x, xo + n_in))
        a2 = f32x8_fma(a2, v, load_f32x8(x, xo + 2 * n_in))
        a3 = f32x8_fma(a3, v, load_f32x8(x, xo + 3 * n_in))
    s0, s1, s2, s3 = f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3)
    for k in range(n8, n_in):
        v1 = _weight1(w, o + size * k, kind)
        s0 += v1 * x[t, k]
        s1 += v1 * x[t + 1, k]
        s2 += v1 * x[t + 2, k]
        s3 += v1 * x[t + 3, k]
    return s0, s1, s2, s3


@njit(cache=True)
def _matmul_rows(w, row_bytes, x, out, kind, size, r):
    n_tokens = x.shape[0]
    full = n_tokens - n_tokens % TOKEN_TILE
    for t in range(0, full, TOKEN_TILE):
        out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = _vec_dot4(w, r * row_bytes, x, t, kind, size)
    for t in range(full, n_tokens):
        out[t, r] = _vec_dot(w, r * row_bytes, x, t, kind, size)


# The weight type is a constant in each driver, so LLVM folds the `kind` branches away.


@njit(parallel=True, cache=True)
def matmul_f32(w, row_bytes, x, out):
    for r in prange(out.shape[1]):
        _matmul_rows(w, row_bytes, x, out, _KIND_F32, 4, r)


@njit(parallel=True, cache=True)
def matmul_f16(w, row_bytes, x, out):
    for r in prange(out.shape[1]):
        _matmul_rows(w, row_bytes, x, out, _KIND_F16, 2, r)


@njit(parallel=True, cache=True)
def matmul_bf16(w, row_bytes, x, out):
    for r in prange(out.shape[1]):
        _matmul_rows(w, row_bytes, x, out, _KIND_BF16, 2, r)


@njit(parallel=True, cache=True)
def matmul_f32_rows(w, row_bytes, x, out, single):
    for r in prange(out.shape[1]):
        for t in range(x.shape[0]):
            if single[t]:
                out[t, r] = vec_dot_f32_one_row(w, r * row_bytes, x, t)
            else:
                out[t, r] = _vec_dot(w, r * row_bytes, x, t, _KIND_F32, 4)

"""Matmul kernels for the float weight formats F32, F16 and BF16: float32 activations, 8 float lanes.

  matmul_<fmt>(w, row_bytes, x, out): out[t, r] = row r . x[t] for x float32 (T, n_in), weights read in
  place from the uint8 buffer `w`. Four tokens share each loaded (and widened) weight vector; a row's last
  n_in % 8 elements are done one by one after the lanes are summed, in both paths, so matmul rows equal
  matvec bit for bit.
"""

from __future__ import annotations

from numba import njit, prange
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .simd import (f32x8_fma, f32x8_hsum, f32x8_zero, load_bf16, load_bf16x8, load_f16, load_f16x8, load_f32,
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




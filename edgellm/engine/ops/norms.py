"""RMSNorm and the fused norms of a block (residual add then norm; Gemma's sandwich post-norm), as one kernel over
rows, serial or parallel, with llama.cpp's rounding: y = x / sqrt(mean(x^2) + eps) * w.

Gemma's "(1 + w)" convention needs nothing special here: llama.cpp's converter stores w + 1 in the GGUF, and
llama.cpp multiplies by the stored weight as is, for every architecture.
"""

import math
from functools import partial

import numpy as np
from numba import njit, prange

@njit(cache=True, error_model="numpy", inline="always")
def _scale_from_total(total, n, eps):
    mean = np.float32(total / n)
    return np.float32(1.0) / np.float32(math.sqrt(mean + np.float32(eps)))


@njit(cache=True, error_model="numpy", inline="always")
def rms_scale(row, eps):
    """1 / sqrt(mean(row^2) + eps) as llama.cpp's rms_norm: float32 squares summed in float64 in order, the mean
    rounded to float32, then sqrt and the reciprocal in float32. The caller then computes (x * scale) * weight."""
    total = 0.0
    for i in range(row.shape[0]):
        total += np.float64(row[i] * row[i])
    return _scale_from_total(total, row.shape[0], eps)


@njit(cache=True, error_model="numpy", inline="always")
def _sq(x, r, i):
    return np.float64(x[r, i] * x[r, i])


@njit(cache=True, error_model="numpy", inline="always")
def _rms_scales4(x, r, eps):
    """rms_scale of rows r .. r + 3 of x: four float64 sums side by side, each in its own row's order (so each is
    rms_scale's exactly). One row's sum is a chain of dependent adds; four keep the adder busy."""
    t0 = t1 = t2 = t3 = 0.0
    for i in range(x.shape[1]):
        t0 += _sq(x, r, i)
        t1 += _sq(x, r + 1, i)
        t2 += _sq(x, r + 2, i)
        t3 += _sq(x, r + 3, i)
    n = x.shape[1]
    return (_scale_from_total(t0, n, eps), _scale_from_total(t1, n, eps), _scale_from_total(t2, n, eps),
            _scale_from_total(t3, n, eps))


# The three norms of a block as one kernel over rows: NORM_PLAIN out = rms_norm(x) * w; NORM_ADD x += delta, then
# out = rms_norm(x) * w; NORM_POST x += rms_norm(delta) * w (Gemma's sandwich norm). out may be x or delta.
NORM_PLAIN, NORM_ADD, NORM_POST = 0, 1, 2


@njit(cache=True, error_model="numpy", inline="always")
def _norm_apply(x, weight, out, delta, mode, r, scale):
    if mode == NORM_POST:
        for i in range(x.shape[1]):
            x[r, i] += delta[r, i] * scale * weight[i]
    else:
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] * scale * weight[i]


@njit(cache=True, error_model="numpy", inline="always")
def _norm_rows(x, weight, eps, out, delta, mode, r0, r1):
    """Rows [r0, r1): four at a time (their sums side by side), then one by one."""
    src = delta if mode == NORM_POST else x
    r = r0
    while r < r1:
        n = 4 if r + 4 <= r1 else 1
        if mode == NORM_ADD:
            for k in range(r, r + n):
                for i in range(x.shape[1]):
                    x[k, i] += delta[k, i]
        if n == 4:
            s0, s1, s2, s3 = _rms_scales4(src, r, eps)
            _norm_apply(x, weight, out, delta, mode, r, s0)
            _norm_apply(x, weight, out, delta, mode, r + 1, s1)
            _norm_apply(x, weight, out, delta, mode, r + 2, s2)
            _norm_apply(x, weight, out, delta, mode, r + 3, s3)
        else:
            _norm_apply(x, weight, out, delta, mode, r, rms_scale(src[r], eps))
        r += n


@njit(cache=True, error_model="numpy")
def _norm_serial(x, weight, eps, out, delta, mode):
    _norm_rows(x, weight, eps, out, delta, mode, 0, x.shape[0])


NORM_PARALLEL_MIN_ROWS = 32  # below, one region's start and join cost more than the rows
NORM_ROWS_PER_ITEM = 16


@njit(cache=True, error_model="numpy", parallel=True)
def _norm_parallel(x, weight, eps, out, delta, mode):
    n_rows = x.shape[0]
    for b in prange((n_rows + NORM_ROWS_PER_ITEM - 1) // NORM_ROWS_PER_ITEM):
        _norm_rows(x, weight, eps, out, delta, mode, b * NORM_ROWS_PER_ITEM,
                   min(n_rows, (b + 1) * NORM_ROWS_PER_ITEM))


def _norm(x, weight, eps, out, delta, mode):
    (_norm_parallel if x.shape[0] >= NORM_PARALLEL_MIN_ROWS else _norm_serial)(x, weight, eps, out, delta, mode)


def rms_norm(x, weight, eps, out):
    """x, out: [R, d] float32 (may be the same array); weight: [d]. Each row's bits are the same whichever way the
    rows are split (four side by side, or in parallel from NORM_PARALLEL_MIN_ROWS rows on)."""
    _norm(x, weight, eps, out, x, NORM_PLAIN)


def bound_rms_norm(x, weight, eps, out):
    """rms_norm(x, weight, eps, out) as a callable, its kernel chosen now: a decode step's norm on buffers it reuses."""
    return partial(_norm_parallel if x.shape[0] >= NORM_PARALLEL_MIN_ROWS else _norm_serial, x, weight, eps, out, x,
                   NORM_PLAIN)


def bound_add_rms_norm(x, delta, weight, eps, out):
    """add_rms_norm(x, delta, weight, eps, out) as a callable (see bound_rms_norm)."""
    return partial(_norm_parallel if x.shape[0] >= NORM_PARALLEL_MIN_ROWS else _norm_serial, x, weight, eps, out,
                   delta, NORM_ADD)


def bound_add_post_norm(x, delta, post_weight, eps):
    """add_post_norm(x, delta, post_weight, eps) as a callable (see bound_rms_norm)."""
    return partial(_norm_parallel if x.shape[0] >= NORM_PARALLEL_MIN_ROWS else _norm_serial, x, post_weight, eps, x,
                   delta, NORM_POST)


def rms_norm_ref(x, weight, eps):
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * weight).astype(np.float32)


def add_rms_norm(x, delta, weight, eps, out):
    """The residual step then the next norm: x += delta; out = rms_norm(x) * weight. out may be delta."""
    _norm(x, weight, eps, out, delta, NORM_ADD)


def add_post_norm(x, delta, post_weight, eps):
    """Gemma's sandwich norm on a block's output: x += rms_norm(delta) * post_weight."""
    _norm(x, post_weight, eps, x, delta, NORM_POST)

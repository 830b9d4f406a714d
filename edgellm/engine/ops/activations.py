"""Elementwise nonlinearities: the gated feed-forward activations (SwiGLU, GeGLU with llama.cpp's float16 GELU
table, gpt-oss's clamped SwiGLU), gate <- act(gate) * up in place as llama.cpp's LLM_FFN_PAR, and the logit softcap.
"""

import math
from functools import partial

import numpy as np
from numba import njit, prange

from edgellm.engine.ops.exp import fast_exp
from edgellm.quant.simd import f16_bits_to_f32, f32_to_f16, fma32


# Prompt batches of at least this many rows take the activations in parallel, a row per work item (a decode step's
# one row is a few microseconds, shorter than waking the other threads).
ACTIVATION_PARALLEL_MIN_ROWS = 8


@njit(cache=True, error_model="numpy", inline="always")
def _silu_mul_row(g, u):
    for i in range(g.shape[0]):
        x = g[i]
        g[i] = x / (np.float32(1.0) + fast_exp(np.float32(0.0) - x)) * u[i]


@njit(cache=True, error_model="numpy")
def _silu_mul_serial(gate, up):
    for t in range(gate.shape[0]):
        _silu_mul_row(gate[t], up[t])


@njit(cache=True, error_model="numpy", parallel=True)
def _silu_mul_parallel(gate, up):
    for t in prange(gate.shape[0]):
        _silu_mul_row(gate[t], up[t])


def silu_mul(gate, up):
    """SwiGLU. gate, up: [T, n_ff]; result in gate: (g / (1 + exp(0 - g))) * up, llama.cpp's order."""
    (_silu_mul_parallel if gate.shape[0] >= ACTIVATION_PARALLEL_MIN_ROWS else _silu_mul_serial)(gate, up)


def bound_silu_mul(gate, up):
    """silu_mul(gate, up) as a callable, its kernel chosen now: a decode step's on buffers it reuses."""
    return partial(_silu_mul_parallel if gate.shape[0] >= ACTIVATION_PARALLEL_MIN_ROWS else _silu_mul_serial, gate, up)


def silu_mul_ref(gate, up):
    g = gate.astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * up).astype(np.float32)


# gpt-oss's clamped SwiGLU (ggml's swiglu_oai): the gate clamped from above, up clamped both ways, a sigmoid with a
# slope alpha and up shifted by one; float32 throughout with libm's expf, as ggml-cpu's scalar loop.
SWIGLU_OAI_ALPHA = np.float32(1.702)
SWIGLU_OAI_LIMIT = np.float32(7.0)


@njit(cache=True, error_model="numpy", inline="always")
def _swiglu_oai_row(g, u, alpha, limit):
    one = np.float32(1.0)
    for i in range(g.shape[0]):
        x = min(g[i], limit)
        y = min(max(u[i], -limit), limit)
        g[i] = x / (one + np.float32(math.exp(np.float32(alpha * -x)))) * (y + one)


@njit(cache=True, error_model="numpy")
def _swiglu_oai_serial(gate, up, alpha, limit):
    for t in range(gate.shape[0]):
        _swiglu_oai_row(gate[t], up[t], np.float32(alpha), np.float32(limit))


@njit(cache=True, error_model="numpy", parallel=True)
def _swiglu_oai_parallel(gate, up, alpha, limit):
    for t in prange(gate.shape[0]):
        _swiglu_oai_row(gate[t], up[t], np.float32(alpha), np.float32(limit))


def swiglu_oai(gate, up, alpha=SWIGLU_OAI_ALPHA, limit=SWIGLU_OAI_LIMIT):
    """gpt-oss's SwiGLU. gate, up: [T, n_ff]; result in gate: g' / (1 + exp(alpha * -g')) * (u' + 1) with
    g' = min(g, limit), u' = clamp(u, -limit, limit)."""
    kernel = _swiglu_oai_parallel if gate.shape[0] >= ACTIVATION_PARALLEL_MIN_ROWS else _swiglu_oai_serial
    kernel(gate, up, np.float32(alpha), np.float32(limit))


def swiglu_oai_ref(gate, up, alpha=1.702, limit=7.0):
    g = np.minimum(gate.astype(np.float64), limit)
    u = np.clip(up.astype(np.float64), -limit, limit)
    return (g / (1.0 + np.exp(-alpha * g)) * (u + 1.0)).astype(np.float32)


# GELU as llama.cpp computes it for float32 (GGML_GELU_FP16): x is rounded to float16 and looked up in a 65,536-entry
# table of float16 values of 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))) computed in float32; x <= -10
# gives 0 and x >= 10 gives x. The table is built on first use (a few milliseconds).
GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.7978845608028654)
_GELU_TABLE = []


@njit(cache=True, error_model="numpy")
def _fill_gelu_table(table):
    one, half = np.float32(1.0), np.float32(0.5)
    for i in range(table.shape[0]):
        x = f16_bits_to_f32(np.uint16(i))
        table[i] = f32_to_f16(half * x * (one + math.tanh(SQRT_2_OVER_PI * x * fma32(GELU_COEF_A * x, x, one))))


def gelu_table() -> np.ndarray:
    if not _GELU_TABLE:
        table = np.zeros(1 << 16, np.uint16)
        _fill_gelu_table(table)
        _GELU_TABLE.append(table)
    return _GELU_TABLE[0]


@njit(cache=True, error_model="numpy", inline="always")
def _gelu_tanh_mul_row(g, u, table):
    for i in range(g.shape[0]):
        x = g[i]
        if x <= np.float32(-10.0):
            g[i] = np.float32(0.0)
        elif x >= np.float32(10.0):
            g[i] = x * u[i]
        else:
            g[i] = f16_bits_to_f32(table[f32_to_f16(x)]) * u[i]


@njit(cache=True, error_model="numpy")
def _gelu_tanh_mul(gate, up, table):
    for t in range(gate.shape[0]):
        _gelu_tanh_mul_row(gate[t], up[t], table)


@njit(cache=True, error_model="numpy", parallel=True)
def _gelu_tanh_mul_parallel(gate, up, table):
    for t in prange(gate.shape[0]):
        _gelu_tanh_mul_row(gate[t], up[t], table)


def gelu_tanh_mul(gate, up):
    """GeGLU with the tanh approximation of GELU (Gemma). gate, up: [T, n_ff]; result in gate."""
    kernel = _gelu_tanh_mul_parallel if gate.shape[0] >= ACTIVATION_PARALLEL_MIN_ROWS else _gelu_tanh_mul
    kernel(gate, up, gelu_table())


def bound_gelu_tanh_mul(gate, up):
    """gelu_tanh_mul(gate, up) as a callable, its kernel chosen now (see bound_silu_mul)."""
    kernel = _gelu_tanh_mul_parallel if gate.shape[0] >= ACTIVATION_PARALLEL_MIN_ROWS else _gelu_tanh_mul
    return partial(kernel, gate, up, gelu_table())


def gelu_tanh_mul_ref(gate, up):
    g = gate.astype(np.float64)
    return (0.5 * g * (1.0 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * up).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Softcap: cap * tanh(x / cap) (Gemma 2's final logits; its attention scores: attention_scalar.py), as
# llama.cpp's three f32 ops: scale by 1/cap (rounded to float32), tanhf, scale by cap.


@njit(cache=True, error_model="numpy")
def softcap(x, cap):
    """In place on a [R, n] float32 array."""
    cap32 = np.float32(cap)
    inv_cap = np.float32(1.0) / cap32
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[r, i] = cap32 * np.float32(math.tanh(x[r, i] * inv_cap))


def softcap_ref(x, cap):
    return (cap * np.tanh(x.astype(np.float64) / cap)).astype(np.float32)

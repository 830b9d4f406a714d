"""One token's chosen experts of an expert stack in one parallel region (mixture-of-experts decode).

A decode step routes its token to k experts, and each expert's product is a one-row gemv of a few hundred to a few
thousand rows. As k kernel calls per matrix (three matrices, k = 8, 48 layers) a token pays over a thousand calls and
parallel regions, each about as long as a small expert's rows take to read. Here every chosen expert's rows of one
or two [n_expert, n_out, n_in] stacks (gate and up, or down) are one prange over (expert, row). Each row is the
one-token dot that QuantLinear's one-token matmul runs (llama.cpp's mul_mat_id also multiplies a routed row alone),
on the same activations (Q8_K for the K-quants, Q8_0 for the 32-element formats), so every output has the same bits:
vec_dot, or for the stacks llama.cpp repacks (Q4_0 and MXFP4 of a multiple of 8 rows) the repacked gemv's chain.
"""

from __future__ import annotations

from numba import njit, prange

from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
from .dots_block32 import _quantize_tokens as _quantize_tokens_q8_0
from .matmul_block32 import vec_dot_q8_0_q8_0
from .kernels_kquant import _quantize_tokens
from .matmul_kgroups import vec_dot_q5_k_q8_k
from .matmul_kquant import vec_dot_q4_k_q8_k, vec_dot_q6_k_q8_k
from .mxfp4 import row_dot_rows8 as _row_mxfp4_rows8
from .q4_0_rows8 import row_dot_rows8 as _row_q4_0_rows8

# The stack formats served here, by activation kind; a stack of another format (or Q4_0 / MXFP4 whose row count is
# not a multiple of 8) keeps the per-expert QuantLinear calls.
K_QUANT_CODES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}
BLOCK32_CODES = {"MXFP4": 0, "Q4_0": 1, "Q8_0": 2}  # MXFP4 and Q4_0: the repacked gemv's order


@njit(cache=True)
def _row(code, w, o, nsb, xq, xo, xd, bsums):
    if code == 0:
        return vec_dot_q4_k_q8_k(w, o, nsb, xq, xo, xd, bsums)
    if code == 1:
        return vec_dot_q5_k_q8_k(w, o, nsb, xq, xo, xd, bsums)
    return vec_dot_q6_k_q8_k(w, o, nsb, xq, xo, xd, bsums)


@njit(parallel=True, cache=True)
def chosen_experts(code_a, wa, expert_bytes_a, row_bytes_a, out_a, code_b, wb, expert_bytes_b, row_bytes_b, out_b,
                   ids, x, xq, xd, bsums):
    """out_a[j] = A[ids[j]] x_j and out_b[j] = B[ids[j]] x_j for j < k = len(ids), where x_j = x[j], or x[0] for
    every j when x has one row (gate and up share the token's input; down takes each expert's own). A and B are
    stacks' flat bytes (expert e's rows from e * expert_bytes); out_b may have no columns (one stack). xq, xd,
    bsums: Q8_K activation scratch for x's rows."""
    n_rows, n_in = x.shape
    _quantize_tokens(x, xq, xd, bsums)
    nsb = n_in // 256
    na, nb = out_a.shape[1], out_b.shape[1]
    per_expert = na + nb
    for jr in prange(ids.shape[0] * per_expert):
        j = jr // per_expert
        r = jr - j * per_expert
        xo = 0 if n_rows == 1 else j * n_in
        if r < na:
            out_a[j, r] = _row(code_a, wa, ids[j] * expert_bytes_a + r * row_bytes_a, nsb, xq, xo, xd, bsums)
        else:
            r -= na
            out_b[j, r] = _row(code_b, wb, ids[j] * expert_bytes_b + r * row_bytes_b, nsb, xq, xo, xd, bsums)


@njit(cache=True)
def _row_block32(code, w, o, nb, xq, xo, xd, xdo):
    if code == 0:
        return _row_mxfp4_rows8(w, o, nb, xq, xo, xd, xdo)
    if code == 1:
        return _row_q4_0_rows8(w, o, nb, xq, xo, xd, xdo)
    return vec_dot_q8_0_q8_0(w, o, nb, xq, xo, xd, xdo)


@njit(parallel=True, cache=True)
def chosen_experts_block32(code_a, wa, expert_bytes_a, row_bytes_a, out_a, code_b, wb, expert_bytes_b, row_bytes_b,
                           out_b, ids, x, xq, xd, xs):
    """chosen_experts for the 32-element formats (BLOCK32_CODES) on Q8_0 activations (xq, xd, xs: their scratch)."""
    n_rows, n_in = x.shape
    _quantize_tokens_q8_0(x, xq, xd, xs)
    nb = n_in // 32
    na, nb_out = out_a.shape[1], out_b.shape[1]
    per_expert = na + nb_out
    for jr in prange(ids.shape[0] * per_expert):
        j = jr // per_expert
        r = jr - j * per_expert
        xo = 0 if n_rows == 1 else j * n_in
        if r < na:
            out_a[j, r] = _row_block32(code_a, wa, ids[j] * expert_bytes_a + r * row_bytes_a, nb, xq, xo, xd, xo // 32)
        else:
            r -= na
            out_b[j, r] = _row_block32(code_b, wb, ids[j] * expert_bytes_b + r * row_bytes_b, nb, xq, xo, xd, xo // 32)

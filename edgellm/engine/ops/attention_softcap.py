"""Attention with soft-capped scores (Gemma 2): score = cap * tanh(q·k / cap) before the softmax.

llama.cpp (flash attention off) computes the scores as one f32 matrix, then three ops over it: scale by 1/cap
(1/cap rounded to float32 first), tanhf, scale by cap; then its softmax, which multiplies by the layer's kq_scale
(1 for Gemma 2: its q is scaled before attention). Everything else is attention_scalar's arithmetic, in the
same order: the q·k sums in llama.cpp's lanes, the exp, the float64 sum of 8-slot partial sums and the weighted values.
This is the scalar path only (the 8-wide paths give the same bits, so one path is enough for correctness).
"""

import math

import numba
import numpy as np
from numba import njit, prange
from edgellm.quant import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from edgellm.engine.kvtypes import like_cache
from edgellm.engine.ops.attention_drivers import ATTENTION_PARALLEL_MIN_WORK, _check_scratch, attention_scratch
from edgellm.engine.ops.attention_scalar import (LANES_BATCH, LANES_SINGLE, _exp_run, _reduce_lanes, _score,
                                                 _visible_from, _weigh_run)
from edgellm.engine.ops.cache_write import NO_SCALES


@njit(cache=True, error_model="numpy", inline="always")
def _capped_score_run(q_row, k_cache, k_scale, slot_pos, kv, first, last, lo, p, inv_cap, cap, scale, lanes, acc,
                      work, top):
    """work[j] <- cap * tanh(q·k_j * inv_cap) * scale for slot j in [first, last) (-inf outside lo..p); the max."""
    for j in range(first, last):
        pos = slot_pos[j]
        if pos < lo or pos > p:
            work[j] = -np.inf
            continue
        s = np.float32(cap * np.float32(math.tanh(_score(q_row, k_cache, k_scale, kv, j, lanes, acc) * inv_cap)))
        s = s * scale
        work[j] = s
        top = max(top, s)
    return top


@njit(cache=True, error_model="numpy", inline="always")
def _attend_capped(q, k_cache, v_cache, k_scale, v_scale, slot_pos, p, window, scale, inv_cap, cap, t, h, kv, out,
                   work, single):
    """out[t, h]: attention_scalar._attend with capped scores (the same scratch layout)."""
    capacity = slot_pos.shape[0]
    head_dim = q.shape[2]
    lanes = LANES_SINGLE if single else LANES_BATCH
    lo = _visible_from(p, window, capacity)
    first, last = lo % capacity, p % capacity + 1
    wrapped = first >= last
    acc_rows = work[capacity: capacity + LANES_SINGLE * head_dim].reshape(LANES_SINGLE, head_dim)[:lanes]
    q_row = work[capacity + LANES_SINGLE * head_dim: capacity + (LANES_SINGLE + 1) * head_dim]
    acc = work[capacity + (LANES_SINGLE + 1) * head_dim: capacity + (LANES_SINGLE + 1) * head_dim + LANES_SINGLE]
    for d in range(head_dim):
        q_row[d] = like_cache(q[t, h, d], k_cache)
    top = np.float32(-np.inf)
    if wrapped:
        top = _capped_score_run(q_row, k_cache, k_scale, slot_pos, kv, first, capacity, lo, p, inv_cap, cap, scale,
                                lanes, acc, work, top)
        top = _capped_score_run(q_row, k_cache, k_scale, slot_pos, kv, 0, last, lo, p, inv_cap, cap, scale, lanes,
                                acc, work, top)
        total = _exp_run(work, first, capacity, top, acc) + _exp_run(work, 0, last, top, acc)
    else:
        top = _capped_score_run(q_row, k_cache, k_scale, slot_pos, kv, first, last, lo, p, inv_cap, cap, scale,
                                lanes, acc, work, top)
        total = _exp_run(work, first, last, top, acc)
    inv = np.float32(1.0 / total)
    acc_rows[:] = 0.0
    if wrapped:
        _weigh_run(v_cache, v_scale, kv, first, capacity, inv, lanes, work, acc_rows)
        _weigh_run(v_cache, v_scale, kv, 0, last, inv, lanes, work, acc_rows)
    else:
        _weigh_run(v_cache, v_scale, kv, first, last, inv, lanes, work, acc_rows)
    single_order = lanes == LANES_SINGLE
    for d in range(head_dim):
        for lane in range(lanes):
            acc[lane] = acc_rows[lane, d]
        out[t, h, d] = _reduce_lanes(acc, single_order)


@njit(cache=True, error_model="numpy")
def _capped_serial(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, cap, out, scratch):
    n_tokens, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[0]
    cap32 = np.float32(cap)
    inv_cap = np.float32(1.0) / cap32
    for th in range(n_tokens * n_heads):
        t, h = th // n_heads, th % n_heads
        _attend_capped(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions[t], window, np.float32(scale),
                       inv_cap, cap32, t, h, h // group, out, scratch[0], n_tokens == 1)


@njit(cache=True, error_model="numpy", parallel=True)
def _capped_parallel(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, cap, out, scratch):
    n_tokens, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[0]
    cap32 = np.float32(cap)
    inv_cap = np.float32(1.0) / cap32
    for th in prange(n_tokens * n_heads):
        t, h = th // n_heads, th % n_heads
        _attend_capped(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions[t], window, np.float32(scale),
                       inv_cap, cap32, t, h, h // group, out, scratch[numba.get_thread_id()], n_tokens == 1)


def softcap_attention(q, k_cache, v_cache, slot_pos, q_positions, window, scale, cap, out, scratch=None,
                      k_scale=NO_SCALES, v_scale=NO_SCALES):
    """ops.attention with every score capped: cap * tanh(q·k / cap) * scale. Arguments as ops.attention's."""
    n_tokens, n_heads, head_dim = q.shape
    capacity = slot_pos.shape[0]
    if scratch is None:
        scratch = attention_scratch(capacity, head_dim)
    else:
        _check_scratch(scratch, capacity, head_dim)
    span = min(capacity, window if window > 0 else int(q_positions[-1]) + 1)
    parallel = n_tokens * n_heads * head_dim * span >= ATTENTION_PARALLEL_MIN_WORK
    (_capped_parallel if parallel else _capped_serial)(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions,
                                                       window, scale, cap, out, scratch)


def softcap_attention_ref(q, k, v, q_positions, k_positions, window, scale, cap):
    """Dense float64 reference: q [T, H, hd]; k, v [S, H_kv, hd] at k_positions [S]."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), k)
    scores = cap * np.tanh(scores / cap) * scale
    distance = q_positions[:, None] - k_positions[None, :]
    visible = (distance >= 0) & ((distance < window) if window > 0 else True)
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v).astype(np.float32)

"""Attention over the KV cache, scalar: llama.cpp's summation orders for any cache type (f32, f16, q8_0). The vector
paths (attention_vec, attention_rows) give these bits; this one also serves the caches they do not take.

A query at position p sees the key at kp when p - window < kp <= p (window 0: no lower bound), llama.cpp's rule;
those positions occupy at most two runs of the ring's slots, so only they are read, and the positions the slots
record are checked too, so a slot overwritten by a newer token is never mistaken for an old one.

llama.cpp computes attention (flash attention off) as two matrix products around a softmax, and its float16
cache makes both products float16 x float16 with float32 FMA accumulation: the query and the softmax weights are
rounded to float16 first. The order of each sum depends on the product's kernel:
  - one query row (decoding): ggml_vec_dot_f16, 4 x 8 accumulators over runs of 32 values, reduced as
    ((a0 + a2) + (a1 + a3)), then the 8 lanes as ((l0+l4) + (l1+l5)) + ((l2+l6) + (l3+l7));
  - several query rows (prompt batches): llamafile's tinyBLAS, one 8-lane accumulator, reduced as
    ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)).
The lanes run over the head dimension for the scores and over cache cells for the weighted sum of values (cell
c feeds lane c % 32 or c % 8; a slot here is llama.cpp's cell while the context has not wrapped or shifted).
The softmax: max, exp (fast_exp), a float64 sum of per-8-cell float32 partial sums, one float32 reciprocal.
So every score is computed before any weight: a scratch row per thread holds the scores, then the weights.

Gemma 2 caps the scores (cap > 0; 0 means no cap): llama.cpp computes the scores as one f32 matrix, then scales
it by 1/cap (rounded to float32 first), takes tanhf, scales by cap, and its softmax multiplies by the layer's
scale. gpt-oss gives each head a sink (a learned logit with no value; -inf means none): ggml's soft_max takes it
into the max before the exps and adds expf(sink - max) (libm) to the float64 sum after them. Only this kernel
takes a cap; the vector ones take the sinks too, with the same bits.
"""

import math

import numpy as np
from numba import njit

from edgellm.engine.kvtypes import like_cache, row_value
from edgellm.engine.ops.exp import fast_exp
from edgellm.quant.simd import fma32

LANES_BATCH = 8    # tinyBLAS: accumulators of a sum, several query rows
LANES_SINGLE = 32  # ggml_vec_dot_f16: 4 x 8 accumulators, one query row


@njit(cache=True, error_model="numpy", inline="always")
def _reduce_lanes(acc, single):
    """Sum of acc[0:32] (single) or acc[0:8] in llama.cpp's order for that kernel."""
    if single:
        a0 = (acc[0] + acc[16]) + (acc[8] + acc[24])
        a1 = (acc[1] + acc[17]) + (acc[9] + acc[25])
        a2 = (acc[2] + acc[18]) + (acc[10] + acc[26])
        a3 = (acc[3] + acc[19]) + (acc[11] + acc[27])
        a4 = (acc[4] + acc[20]) + (acc[12] + acc[28])
        a5 = (acc[5] + acc[21]) + (acc[13] + acc[29])
        a6 = (acc[6] + acc[22]) + (acc[14] + acc[30])
        a7 = (acc[7] + acc[23]) + (acc[15] + acc[31])
        return ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))


@njit(cache=True, error_model="numpy", inline="always")
def _score(q_row, k_cache, k_scale, kv, slot, lanes, acc):
    """q_row . k_cache[kv, slot]: FMAs into `lanes` accumulators over the head dimension, then reduced."""
    head_dim = q_row.shape[0]
    acc[:lanes] = 0.0
    full = head_dim - head_dim % lanes
    for d0 in range(0, full, lanes):
        for lane in range(lanes):
            d = d0 + lane
            acc[lane] = fma32(row_value(k_cache, k_scale, kv, slot, d), q_row[d], acc[lane])
    total = _reduce_lanes(acc, lanes == LANES_SINGLE)
    for d in range(full, head_dim):  # head sizes that are not a multiple of the lanes (llama.cpp: leftovers)
        total += row_value(k_cache, k_scale, kv, slot, d) * q_row[d]
    return total


@njit(cache=True, error_model="numpy", inline="always")
def _score_run(q_row, k_cache, k_scale, slot_pos, kv, first, last, lo, p, scale, cap, inv_cap, lanes, acc, work,
               top):
    """work[j] <- score of slot j in [first, last) (-inf where position lo..p excludes it), capped where cap > 0;
    returns the max."""
    for j in range(first, last):
        pos = slot_pos[j]
        if pos < lo or pos > p:
            work[j] = -np.inf
            continue
        s = _score(q_row, k_cache, k_scale, kv, j, lanes, acc)
        if cap > 0.0:
            s = np.float32(cap * np.float32(math.tanh(s * inv_cap)))
        s = s * scale
        work[j] = s
        top = max(top, s)
    return top


@njit(cache=True, error_model="numpy", inline="always")
def _exp_run(work, first, last, top, acc):
    """work[j] <- exp(work[j] - top) over [first, last); returns their sum: float32 sums of aligned runs of 8
    slots (llama.cpp's softmax reduces each 8-wide vector so), added in float64."""
    total = 0.0
    for g in range(first - first % 8, last, 8):
        for lane in range(8):
            j = g + lane
            e = np.float32(0.0)
            if first <= j < last:
                if work[j] != -np.inf:
                    e = fast_exp(work[j] - top)
                work[j] = e
            acc[lane] = e
        total += np.float64(((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])))
    return total


@njit(cache=True, error_model="numpy", inline="always")
def _weigh_run(v_cache, v_scale, kv, first, last, inv, lanes, work, acc_rows):
    """acc_rows[j % lanes] += weight_j * v_j over [first, last), weight_j = work[j] * inv rounded as the cache."""
    head_dim = acc_rows.shape[1]
    for j in range(first, last):
        if work[j] == 0.0:
            continue
        w = like_cache(work[j] * inv, v_cache)
        row = acc_rows[j % lanes]
        for d in range(head_dim):
            row[d] = fma32(row_value(v_cache, v_scale, kv, j, d), w, row[d])


@njit(cache=True, error_model="numpy", inline="always")
def _visible_from(p, window, capacity):
    """The oldest position a query at p sees: the window's start, or the oldest one the ring still holds."""
    lo = max(0, p - window + 1) if window > 0 else 0
    return max(lo, p - capacity + 1)  # older positions have been overwritten


@njit(cache=True, error_model="numpy", inline="always")
def _attend(q, k_cache, v_cache, k_scale, v_scale, slot_pos, p, window, scale, cap, sink, t, h, kv, out, work,
            single):
    """out[t, h] = sum over visible keys of softmax(score(q[t, h] . k) * scale) v, score(s) = s uncapped (cap 0)
    or cap * tanh(s / cap); a finite sink joins the softmax's denominator as exp(sink). work: this thread's scratch
    row: capacity scores, then LANES_SINGLE accumulator rows, the query rounded as the cache, and LANES_SINGLE
    more."""
    capacity = slot_pos.shape[0]
    head_dim = q.shape[2]
    lanes = LANES_SINGLE if single else LANES_BATCH
    lo = _visible_from(p, window, capacity)
    first, last = lo % capacity, p % capacity + 1
    wrapped = first >= last  # the visible positions wrap around the end of the ring
    acc_rows = work[capacity: capacity + LANES_SINGLE * head_dim].reshape(LANES_SINGLE, head_dim)[:lanes]
    q_row = work[capacity + LANES_SINGLE * head_dim: capacity + (LANES_SINGLE + 1) * head_dim]
    acc = work[capacity + (LANES_SINGLE + 1) * head_dim: capacity + (LANES_SINGLE + 1) * head_dim + LANES_SINGLE]
    for d in range(head_dim):
        q_row[d] = like_cache(q[t, h, d], k_cache)
    inv_cap = np.float32(1.0) / cap if cap > 0.0 else np.float32(0.0)
    top = np.float32(-np.inf)
    if wrapped:
        top = _score_run(q_row, k_cache, k_scale, slot_pos, kv, first, capacity, lo, p, scale, cap, inv_cap, lanes,
                         acc, work, top)
        top = _score_run(q_row, k_cache, k_scale, slot_pos, kv, 0, last, lo, p, scale, cap, inv_cap, lanes, acc,
                         work, top)
        top = max(top, sink)
        total = _exp_run(work, first, capacity, top, acc) + _exp_run(work, 0, last, top, acc)
    else:
        top = _score_run(q_row, k_cache, k_scale, slot_pos, kv, first, last, lo, p, scale, cap, inv_cap, lanes, acc,
                         work, top)
        top = max(top, sink)
        total = _exp_run(work, first, last, top, acc)
    if sink != -np.inf:
        total += np.float64(np.float32(math.exp(np.float32(sink - top))))
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

"""Attention for one query row of one head in 8-float vectors, for f16 and f32 caches whose head size is a multiple
of 32 (every model here): the scores, the weighted sum of values and the final reductions run in F32x8 lanes
(edgellm.quant.simd), the exponentials of 8 slots at a time. The results are attention_scalar's (and llama.cpp's)
bit for bit, in its one-row (decoding) or several-row (prompt) order, with attention_scalar's sinks (gpt-oss).
"""

import math

import numpy as np
from numba import njit

from edgellm.engine.kvtypes import like_cache, load_row8
from edgellm.engine.ops.attention_scalar import LANES_BATCH, LANES_SINGLE, _visible_from
from edgellm.engine.ops.exp import fast_exp
from edgellm.quant.simd import (f32x8_add, f32x8_fma, f32x8_hsum, f32x8_hsum_pairs, f32x8_splat, f32x8_zero,
                                load_f32x8, prefetch, store_f32x8)


@njit(cache=True, error_model="numpy", inline="always")
def _fold_chains(a0, a1, a2, a3):
    """A one-row score from its four FMA chains, as ggml_vec_dot_f16 reduces its four accumulators."""
    return f32x8_hsum_pairs(f32x8_add(f32x8_add(a0, a2), f32x8_add(a1, a3)))


@njit(cache=True, error_model="numpy", inline="always")
def _score_vec(q_row, k_cache, base, head_dim, single):
    if single:
        a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
        for c in range(0, head_dim, 32):
            a0 = f32x8_fma(a0, load_row8(k_cache, base + c), load_f32x8(q_row, c))
            a1 = f32x8_fma(a1, load_row8(k_cache, base + c + 8), load_f32x8(q_row, c + 8))
            a2 = f32x8_fma(a2, load_row8(k_cache, base + c + 16), load_f32x8(q_row, c + 16))
            a3 = f32x8_fma(a3, load_row8(k_cache, base + c + 24), load_f32x8(q_row, c + 24))
        return _fold_chains(a0, a1, a2, a3)
    a = f32x8_zero()
    for c in range(0, head_dim, 8):
        a = f32x8_fma(a, load_row8(k_cache, base + c), load_f32x8(q_row, c))
    return f32x8_hsum(a)


@njit(cache=True, error_model="numpy", inline="always")
def _score64(k_cache, b, q0, q1, q2, q3, q4, q5, q6, q7):
    """_score_vec(single) for head_dim 64 with the query's 8 vectors in registers: the same FMAs and folds, one
    memory operand per FMA (the key) instead of two."""
    a0 = f32x8_fma(f32x8_zero(), load_row8(k_cache, b), q0)
    a1 = f32x8_fma(f32x8_zero(), load_row8(k_cache, b + 8), q1)
    a2 = f32x8_fma(f32x8_zero(), load_row8(k_cache, b + 16), q2)
    a3 = f32x8_fma(f32x8_zero(), load_row8(k_cache, b + 24), q3)
    a0 = f32x8_fma(a0, load_row8(k_cache, b + 32), q4)
    a1 = f32x8_fma(a1, load_row8(k_cache, b + 40), q5)
    a2 = f32x8_fma(a2, load_row8(k_cache, b + 48), q6)
    a3 = f32x8_fma(a3, load_row8(k_cache, b + 56), q7)
    return _fold_chains(a0, a1, a2, a3)


KEY_PREFETCH_SLOTS = 16


@njit(cache=True, error_model="numpy")
def _score_run_single64(q_row, k_cache, slot_pos, kv, first, last, lo, p, scale, work, top):
    """_score_run_vec for one query row and head_dim 64 (SmolLM2 and other small llamas): the query stays in
    registers across the keys instead of being reloaded for each key (the loads, not the FMAs, bound this loop),
    with the same bits. Keys are prefetched KEY_PREFETCH_SLOTS ahead (docs/kernels.md has the figures)."""
    capacity = slot_pos.shape[0]
    q0, q1, q2, q3 = load_f32x8(q_row, 0), load_f32x8(q_row, 8), load_f32x8(q_row, 16), load_f32x8(q_row, 24)
    q4, q5, q6, q7 = load_f32x8(q_row, 32), load_f32x8(q_row, 40), load_f32x8(q_row, 48), load_f32x8(q_row, 56)
    for j in range(first, last):
        pos = slot_pos[j]
        if pos < lo or pos > p:
            work[j] = -np.inf
            continue
        prefetch(k_cache, (kv * capacity + j + KEY_PREFETCH_SLOTS) * 64)  # a hint: past the end is harmless
        sc = _score64(k_cache, (kv * capacity + j) * 64, q0, q1, q2, q3, q4, q5, q6, q7) * scale
        work[j] = sc
        top = max(top, sc)
    return top


@njit(cache=True, error_model="numpy")
def _score_run_vec(q_row, k_cache, slot_pos, kv, first, last, lo, p, scale, single, work, top):
    capacity, head_dim = slot_pos.shape[0], q_row.shape[0]
    j = first
    if not single:  # batch order: one accumulator chain per key; four keys at a time keep four chains in flight
        while j + 3 < last:
            if slot_pos[j] < lo or slot_pos[j + 3] > p or slot_pos[j + 1] < lo or slot_pos[j + 2] < lo \
                    or slot_pos[j] > p or slot_pos[j + 1] > p or slot_pos[j + 2] > p or slot_pos[j + 3] < lo:
                break
            b0 = (kv * capacity + j) * head_dim
            a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
            for c in range(0, head_dim, 8):
                qc = load_f32x8(q_row, c)
                a0 = f32x8_fma(a0, load_row8(k_cache, b0 + c), qc)
                a1 = f32x8_fma(a1, load_row8(k_cache, b0 + head_dim + c), qc)
                a2 = f32x8_fma(a2, load_row8(k_cache, b0 + 2 * head_dim + c), qc)
                a3 = f32x8_fma(a3, load_row8(k_cache, b0 + 3 * head_dim + c), qc)
            s0, s1 = f32x8_hsum(a0) * scale, f32x8_hsum(a1) * scale
            s2, s3 = f32x8_hsum(a2) * scale, f32x8_hsum(a3) * scale
            work[j], work[j + 1], work[j + 2], work[j + 3] = s0, s1, s2, s3
            top = max(top, max(max(s0, s1), max(s2, s3)))
            j += 4
    for j in range(j, last):
        pos = slot_pos[j]
        if pos < lo or pos > p:
            work[j] = -np.inf
            continue
        sc = _score_vec(q_row, k_cache, (kv * capacity + j) * head_dim, head_dim, single) * scale
        work[j] = sc
        top = max(top, sc)
    return top


@njit(cache=True, error_model="numpy")
def _exp_run_vec(work, first, last, top, e8):
    """_exp_run, vectorised: the exponentials in place in one loop (fast_exp(-inf) is 0, as the masked slots
    need), then each aligned group of 8 summed in f32x8_hsum's order (slots outside [first, last) as 0)."""
    run = work[first:last]  # a view indexed from 0: LLVM vectorises the loop (not with a signed start)
    for i in range(run.shape[0]):
        run[i] = fast_exp(run[i] - top)
    total = 0.0
    for g in range(first - first % 8, last, 8):
        if g >= first and g + 8 <= last:
            total += np.float64(f32x8_hsum(load_f32x8(work, g)))
        else:
            for lane in range(8):
                j = g + lane
                e8[lane] = work[j] if first <= j < last else np.float32(0.0)
            total += np.float64(f32x8_hsum(load_f32x8(e8, 0)))
    return total


@njit(cache=True, error_model="numpy")
def _weights_run_vec(work, first, last, inv, v_cache):
    """work[j] <- the softmax weight of slot j, exp * inv rounded as the cache (what multiplies the values); 0 for a
    masked slot. The weighing multiplies every slot of the run without a test: for finite values, adding 0 * v
    leaves a sum exactly as the scalar path's skipping does (a sum that starts at +0 never becomes -0)."""
    run = work[first:last]
    for i in range(run.shape[0]):
        run[i] = like_cache(run[i] * inv, v_cache)


# Slots a pass of _weigh_run_vec covers before moving on: 32 KB of an f16 cache with head size 64, a few hundred
# KB at most, which stays in the core's caches while each lane takes its rows from it.
WEIGH_BLOCK_SLOTS = 256


@njit(cache=True, error_model="numpy")
def _weigh_run_vec(v_cache, kv, first, last, lanes, work, acc, acc0):
    """acc lane (j % lanes) += work[j] * v_j for each slot j in [first, last), each lane's slots in increasing
    order (lanes: a power of 2; head_dim: a multiple of 32). In blocks of WEIGH_BLOCK_SLOTS slots, read from memory
    once: within a block one lane at a time, 32 or 64 dimensions of its running sums held in registers across its
    slots. (Each lane over the whole run would instead jump a page of the cache per slot, which is slower.)"""
    capacity = v_cache.shape[1]
    head_dim = v_cache.shape[2]
    mask = lanes - 1
    for b0 in range(first, last, WEIGH_BLOCK_SLOTS):
        b1 = min(last, b0 + WEIGH_BLOCK_SLOTS)
        for lane in range(lanes):
            j0 = b0 + ((lane - b0) & mask)  # the block's first slot in this lane
            if j0 >= b1:
                continue
            for dc in range(0, head_dim, 64):
                wide = dc + 64 <= head_dim
                r = acc0 + lane * head_dim + dc
                a0, a1 = load_f32x8(acc, r), load_f32x8(acc, r + 8)
                a2, a3 = load_f32x8(acc, r + 16), load_f32x8(acc, r + 24)
                a4, a5, a6, a7 = a0, a1, a2, a3
                if wide:
                    a4, a5 = load_f32x8(acc, r + 32), load_f32x8(acc, r + 40)
                    a6, a7 = load_f32x8(acc, r + 48), load_f32x8(acc, r + 56)
                for j in range(j0, b1, lanes):
                    ws = f32x8_splat(work[np.uint64(j)])  # an unsigned index: no test for a negative one
                    base = (kv * capacity + j) * head_dim + dc
                    a0 = f32x8_fma(a0, load_row8(v_cache, base), ws)
                    a1 = f32x8_fma(a1, load_row8(v_cache, base + 8), ws)
                    a2 = f32x8_fma(a2, load_row8(v_cache, base + 16), ws)
                    a3 = f32x8_fma(a3, load_row8(v_cache, base + 24), ws)
                    if wide:
                        a4 = f32x8_fma(a4, load_row8(v_cache, base + 32), ws)
                        a5 = f32x8_fma(a5, load_row8(v_cache, base + 40), ws)
                        a6 = f32x8_fma(a6, load_row8(v_cache, base + 48), ws)
                        a7 = f32x8_fma(a7, load_row8(v_cache, base + 56), ws)
                store_f32x8(acc, r, a0)
                store_f32x8(acc, r + 8, a1)
                store_f32x8(acc, r + 16, a2)
                store_f32x8(acc, r + 24, a3)
                if wide:
                    store_f32x8(acc, r + 32, a4)
                    store_f32x8(acc, r + 40, a5)
                    store_f32x8(acc, r + 48, a6)
                    store_f32x8(acc, r + 56, a7)


@njit(cache=True, error_model="numpy", inline="always")
def _lane(work, r, lane, head_dim):
    return load_f32x8(work, r + lane * head_dim)


@njit(cache=True, error_model="numpy", inline="always")
def _lane_pair(work, r, l, head_dim):
    """ggml_vec_dot_f16's first reduction of its 4 accumulators, for lane l: (x0 + x2) + (x1 + x3)."""
    return f32x8_add(f32x8_add(_lane(work, r, l, head_dim), _lane(work, r, 16 + l, head_dim)),
                     f32x8_add(_lane(work, r, 8 + l, head_dim), _lane(work, r, 24 + l, head_dim)))


@njit(cache=True, error_model="numpy", inline="always")
def _run_bounds(r, first, last, capacity):
    """Slots [a, b) of run r of a query's keys: [first, last), or [first, capacity) then [0, last) when the
    ring has wrapped (first >= last)."""
    if r == 1:
        return 0, last
    return first, capacity if first >= last else last


@njit(cache=True, error_model="numpy")
def _row_weights(row, first, last, n_runs, top, e8, v_cache, sink):
    """One row's softmax weights in place of its scores (row: its `capacity` scores), as _attend_vec makes them;
    a finite sink (top already includes it) adds expf(sink - top) to the sum, as attention_scalar's _attend."""
    capacity = row.shape[0]
    total = 0.0
    for run in range(n_runs):
        a, b = _run_bounds(run, first, last, capacity)
        total += _exp_run_vec(row, a, b, top, e8)
    if sink != -np.inf:
        total += np.float64(np.float32(math.exp(np.float32(sink - top))))
    inv = np.float32(1.0 / total)
    for run in range(n_runs):
        a, b = _run_bounds(run, first, last, capacity)
        _weights_run_vec(row, a, b, inv, v_cache)


@njit(cache=True, error_model="numpy")
def _sum_batch_lanes(work, ra, o, head_dim, out):
    """out[o:o + head_dim] <- the sum of a row's LANES_BATCH lane rows (from work[ra]) in _attend_vec's order."""
    for c in range(0, head_dim, 8):
        rc = ra + c
        sum8 = f32x8_add(f32x8_add(f32x8_add(_lane(work, rc, 0, head_dim), _lane(work, rc, 4, head_dim)),
                                   f32x8_add(_lane(work, rc, 2, head_dim), _lane(work, rc, 6, head_dim))),
                         f32x8_add(f32x8_add(_lane(work, rc, 1, head_dim), _lane(work, rc, 5, head_dim)),
                                   f32x8_add(_lane(work, rc, 3, head_dim), _lane(work, rc, 7, head_dim))))
        store_f32x8(out, o + c, sum8)


@njit(cache=True, error_model="numpy")
def _sum_single_lanes(work, ra, o, head_dim, out):
    """out[o:o + head_dim] <- the sum of a row's LANES_SINGLE lane rows (from work[ra]) in ggml_vec_dot_f16's order:
    each group of four lanes first (_lane_pair), then the eight pairs as a tree."""
    for c in range(0, head_dim, 8):
        r = ra + c
        a0, a1 = _lane_pair(work, r, 0, head_dim), _lane_pair(work, r, 1, head_dim)
        a2, a3 = _lane_pair(work, r, 2, head_dim), _lane_pair(work, r, 3, head_dim)
        a4, a5 = _lane_pair(work, r, 4, head_dim), _lane_pair(work, r, 5, head_dim)
        a6, a7 = _lane_pair(work, r, 6, head_dim), _lane_pair(work, r, 7, head_dim)
        sum8 = f32x8_add(f32x8_add(f32x8_add(a0, a4), f32x8_add(a1, a5)),
                         f32x8_add(f32x8_add(a2, a6), f32x8_add(a3, a7)))
        store_f32x8(out, o + c, sum8)


@njit(cache=True, error_model="numpy")
def _attend_vec(q, k_cache, v_cache, slot_pos, p, window, scale, t, h, kv, out, work, single, sink):
    """_attend for f16/f32 caches, head_dim % 32 == 0, in vectors (sink: -inf for none). work: as _attend's."""
    capacity = slot_pos.shape[0]
    n_heads, head_dim = q.shape[1], q.shape[2]
    lanes = LANES_SINGLE if single else LANES_BATCH
    lo = _visible_from(p, window, capacity)
    first, last = lo % capacity, p % capacity + 1
    wrapped = first >= last
    acc0 = capacity  # work[acc0 + L * head_dim + d]: lane L's running sum for dimension d
    q_row = work[capacity + LANES_SINGLE * head_dim: capacity + (LANES_SINGLE + 1) * head_dim]
    e8 = work[capacity + (LANES_SINGLE + 1) * head_dim: capacity + (LANES_SINGLE + 1) * head_dim + 8]
    for d in range(head_dim):
        q_row[d] = like_cache(q[t, h, d], k_cache)
    # the keys as one or two runs of slots (see _run_bounds)
    n_runs = 2 if wrapped else 1
    top = np.float32(-np.inf)
    for r in range(n_runs):
        a, b = _run_bounds(r, first, last, capacity)
        if single and head_dim == 64:
            top = _score_run_single64(q_row, k_cache, slot_pos, kv, a, b, lo, p, scale, work, top)
        else:
            top = _score_run_vec(q_row, k_cache, slot_pos, kv, a, b, lo, p, scale, single, work, top)
    top = max(top, sink)
    _row_weights(work[:capacity], first, last, n_runs, top, e8, v_cache, sink)
    work[acc0: acc0 + lanes * head_dim] = 0.0
    for r in range(n_runs):
        a, b = _run_bounds(r, first, last, capacity)
        _weigh_run_vec(v_cache, kv, a, b, lanes, work, work, acc0)
    o = (t * n_heads + h) * head_dim
    if single:
        _sum_single_lanes(work, acc0, o, head_dim, out)
    else:
        _sum_batch_lanes(work, acc0, o, head_dim, out)

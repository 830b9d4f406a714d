"""Decoding, the query heads that share a KV head together (grouped-query attention), up to HEADS of them: each key
and value row is loaded and converted once for them instead of once per head.

Every head keeps _attend_vec's one-row arithmetic: its score FMA chains and folds, its max, exponentials and
weights, and each of its LANES_SINGLE lanes' slots in the same order, so the bits are the same. Batched decoding
(finish_attention_rows) runs on it: there every (sequence, KV head) pair is a work item, plenty for the threads,
where a single sequence's few KV heads would leave threads idle. The loops are written out for four heads; a group of
fewer leaves the others' steps out.
"""

import numpy as np
from numba import njit

from edgellm.engine.kvtypes import like_cache, load_row8
from edgellm.engine.ops.attention_rows import _fma4, _load4, _store4
from edgellm.engine.ops.attention_scalar import LANES_SINGLE, _visible_from
from edgellm.engine.ops.attention_vec import (KEY_PREFETCH_SLOTS, WEIGH_BLOCK_SLOTS, _fold_chains, _row_weights,
                                              _run_bounds, _sum_single_lanes)
from edgellm.quant.simd import f32x8_fma, f32x8_zero, load_f32x8, prefetch

HEADS = 4


@njit(cache=True, error_model="numpy")
def _heads_scores(k_cache, v_cache, slot_pos, kv, a, b, q_rows, n, lo, p, scale, work, tops):
    """work[r * capacity + j] <- head r's score of slot j in [a, b) for r < n (-inf where the row does not see it);
    returns the heads' maxima, from tops. Each key is converted once and multiplied by the n queries (q_rows: HEADS
    rows of head_dim, already rounded as the cache)."""
    capacity, head_dim = slot_pos.shape[0], k_cache.shape[2]
    t0, t1, t2, t3 = tops
    inf = np.float32(-np.inf)
    for j in range(a, b):
        pos = slot_pos[j]
        if pos < lo or pos > p:
            work[j], work[capacity + j], work[2 * capacity + j], work[3 * capacity + j] = inf, inf, inf, inf
            continue
        base = (kv * capacity + j) * head_dim
        ahead = base + KEY_PREFETCH_SLOTS * head_dim
        x0, x1, x2, x3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
        y0, y1, y2, y3 = x0, x1, x2, x3
        z0, z1, z2, z3 = x0, x1, x2, x3
        u0, u1, u2, u3 = x0, x1, x2, x3
        for c in range(0, head_dim, 32):
            prefetch(k_cache, ahead + c)  # hints (past the end is harmless): the keys ahead, and the values the
            prefetch(v_cache, ahead + c)  # weighing pass reads in lane order, which the hardware does not follow
            k0, k1 = load_row8(k_cache, base + c), load_row8(k_cache, base + c + 8)
            k2, k3 = load_row8(k_cache, base + c + 16), load_row8(k_cache, base + c + 24)
            x0, x1 = f32x8_fma(x0, k0, load_f32x8(q_rows, c)), f32x8_fma(x1, k1, load_f32x8(q_rows, c + 8))
            x2, x3 = f32x8_fma(x2, k2, load_f32x8(q_rows, c + 16)), f32x8_fma(x3, k3, load_f32x8(q_rows, c + 24))
            if n > 1:
                r = head_dim + c
                y0, y1 = f32x8_fma(y0, k0, load_f32x8(q_rows, r)), f32x8_fma(y1, k1, load_f32x8(q_rows, r + 8))
                y2, y3 = f32x8_fma(y2, k2, load_f32x8(q_rows, r + 16)), f32x8_fma(y3, k3, load_f32x8(q_rows, r + 24))
            if n > 2:
                r = 2 * head_dim + c
                z0, z1 = f32x8_fma(z0, k0, load_f32x8(q_rows, r)), f32x8_fma(z1, k1, load_f32x8(q_rows, r + 8))
                z2, z3 = f32x8_fma(z2, k2, load_f32x8(q_rows, r + 16)), f32x8_fma(z3, k3, load_f32x8(q_rows, r + 24))
            if n > 3:
                r = 3 * head_dim + c
                u0, u1 = f32x8_fma(u0, k0, load_f32x8(q_rows, r)), f32x8_fma(u1, k1, load_f32x8(q_rows, r + 8))
                u2, u3 = f32x8_fma(u2, k2, load_f32x8(q_rows, r + 16)), f32x8_fma(u3, k3, load_f32x8(q_rows, r + 24))
        s = _fold_chains(x0, x1, x2, x3) * scale
        work[j] = s
        t0 = max(t0, s)
        if n > 1:
            s = _fold_chains(y0, y1, y2, y3) * scale
            work[capacity + j] = s
            t1 = max(t1, s)
        if n > 2:
            s = _fold_chains(z0, z1, z2, z3) * scale
            work[2 * capacity + j] = s
            t2 = max(t2, s)
        if n > 3:
            s = _fold_chains(u0, u1, u2, u3) * scale
            work[3 * capacity + j] = s
            t3 = max(t3, s)
    return t0, t1, t2, t3


@njit(cache=True, error_model="numpy")
def _heads_weigh(v_cache, kv, a, b, n, work, acc0):
    """For each head r < n: lane (j % LANES_SINGLE) of its sums (work[acc0 + (r * LANES_SINGLE + lane) * head_dim:])
    += its weight of slot j (work[r * capacity + j], 0 where masked) * v_j over the slots j in [a, b), each lane's
    slots in increasing order, 32 dimensions at a time; in blocks of WEIGH_BLOCK_SLOTS slots (see _weigh_run_vec)."""
    capacity, head_dim = v_cache.shape[1], v_cache.shape[2]
    c1, c2, c3 = np.uint64(capacity), np.uint64(2 * capacity), np.uint64(3 * capacity)
    mask = LANES_SINGLE - 1
    step = LANES_SINGLE * head_dim  # from one head's lanes to the next head's
    for b0 in range(a, b, WEIGH_BLOCK_SLOTS):
        b1 = min(b, b0 + WEIGH_BLOCK_SLOTS)
        for lane in range(LANES_SINGLE):
            j0 = b0 + ((lane - b0) & mask)
            if j0 >= b1:
                continue
            for dc in range(0, head_dim, 32):
                r0 = acc0 + lane * head_dim + dc
                x0, x1, x2, x3 = _load4(work, r0)
                y0, y1, y2, y3 = x0, x1, x2, x3
                z0, z1, z2, z3 = x0, x1, x2, x3
                u0, u1, u2, u3 = x0, x1, x2, x3
                if n > 1:
                    y0, y1, y2, y3 = _load4(work, r0 + step)
                if n > 2:
                    z0, z1, z2, z3 = _load4(work, r0 + 2 * step)
                if n > 3:
                    u0, u1, u2, u3 = _load4(work, r0 + 3 * step)
                for j in range(j0, b1, LANES_SINGLE):
                    base = (kv * capacity + j) * head_dim + dc
                    v0, v1 = load_row8(v_cache, base), load_row8(v_cache, base + 8)
                    v2, v3 = load_row8(v_cache, base + 16), load_row8(v_cache, base + 24)
                    w = np.uint64(j)  # an unsigned index: no test for a negative one
                    x0, x1, x2, x3 = _fma4(x0, x1, x2, x3, v0, v1, v2, v3, work[w])
                    if n > 1:
                        y0, y1, y2, y3 = _fma4(y0, y1, y2, y3, v0, v1, v2, v3, work[w + c1])
                    if n > 2:
                        z0, z1, z2, z3 = _fma4(z0, z1, z2, z3, v0, v1, v2, v3, work[w + c2])
                    if n > 3:
                        u0, u1, u2, u3 = _fma4(u0, u1, u2, u3, v0, v1, v2, v3, work[w + c3])
                _store4(work, r0, x0, x1, x2, x3)
                if n > 1:
                    _store4(work, r0 + step, y0, y1, y2, y3)
                if n > 2:
                    _store4(work, r0 + 2 * step, z0, z1, z2, z3)
                if n > 3:
                    _store4(work, r0 + 3 * step, u0, u1, u2, u3)


def heads_scratch_width(capacity: int, head_dim: int) -> int:
    """Floats of work _attend_heads_vec needs: HEADS score rows, HEADS x LANES_SINGLE sums, HEADS query rows, 8."""
    return HEADS * (capacity + (LANES_SINGLE + 1) * head_dim) + 8


@njit(cache=True, error_model="numpy", inline="always")
def prefetch_first_rows(k_cache, v_cache, slot_pos, kv, p, window):
    """Prefetch the first KEY_PREFETCH_SLOTS key and value rows that a query at position p reads from KV head kv:
    the score loop prefetches only ahead of itself, and in a decode step these rows come from memory (the step's
    weights have passed through the caches since the last step read them)."""
    capacity, head_dim = slot_pos.shape[0], k_cache.shape[2]
    lo = _visible_from(p, window, capacity)
    a, b = _run_bounds(0, lo % capacity, p % capacity + 1, capacity)
    for j in range(a, min(b, a + KEY_PREFETCH_SLOTS)):
        base = (kv * capacity + j) * head_dim
        for c in range(0, head_dim, 32):
            prefetch(k_cache, base + c)
            prefetch(v_cache, base + c)


@njit(cache=True, error_model="numpy")
def _attend_heads_vec(q, k_cache, v_cache, slot_pos, p, window, scale, t, h0, n, kv, out, work):
    """_attend_vec (one-row order, no sink) for query heads h0 .. h0 + n - 1 (n <= HEADS) of token t, which all read
    KV head kv. work: heads_scratch_width(capacity, head_dim) floats."""
    capacity = slot_pos.shape[0]
    n_heads, head_dim = q.shape[1], q.shape[2]
    lo = _visible_from(p, window, capacity)
    first, last = lo % capacity, p % capacity + 1
    n_runs = 2 if first >= last else 1
    acc0 = HEADS * capacity
    q0 = acc0 + HEADS * LANES_SINGLE * head_dim
    e8 = work[q0 + HEADS * head_dim: q0 + HEADS * head_dim + 8]
    q_rows = work[q0: q0 + HEADS * head_dim]
    for r in range(n):
        for d in range(head_dim):
            q_rows[r * head_dim + d] = like_cache(q[t, h0 + r, d], k_cache)
    inf = np.float32(-np.inf)
    tops = (inf, inf, inf, inf)
    for run in range(n_runs):
        a, b = _run_bounds(run, first, last, capacity)
        tops = _heads_scores(k_cache, v_cache, slot_pos, kv, a, b, q_rows, n, lo, p, scale, work, tops)
    for r in range(n):
        top = max(tops[0] if r == 0 else tops[1] if r == 1 else tops[2] if r == 2 else tops[3], inf)  # no sink
        _row_weights(work[r * capacity:(r + 1) * capacity], first, last, n_runs, top, e8, v_cache, inf)
    work[acc0: acc0 + n * LANES_SINGLE * head_dim] = 0.0
    for run in range(n_runs):
        a, b = _run_bounds(run, first, last, capacity)
        _heads_weigh(v_cache, kv, a, b, n, work, acc0)
    for r in range(n):
        _sum_single_lanes(work, acc0 + r * LANES_SINGLE * head_dim, (t * n_heads + h0 + r) * head_dim, head_dim,
                          out)

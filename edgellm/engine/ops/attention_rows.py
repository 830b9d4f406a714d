"""Prompt processing, several query rows of one head together (llama.cpp's several-row order, LANES_BATCH lanes):
each key and value row is loaded and converted once for ROWS query rows instead of once per row.

Every row keeps its own arithmetic: its scores' FMA chains, its mask, max, exponentials, 8-slot group sums and
weights, and its lanes' slots in the same order. The rows walk the union of their visible slots; a slot another row
sees but this one does not scores -inf for it and adds exactly nothing (an exponential of 0, a weight of 0), and
the union's runs visit each row's slots in that row's own order as long as the union fits in the ring (else rows go
one by one). A sink (gpt-oss) joins each row's max and sum as in _attend_vec. The loops are written out for four
rows (docs/kernels.md has the speed-up).
"""

import numpy as np
from numba import njit

from edgellm.engine.kvtypes import like_cache, load_row8, load_row8_pair, load_row16
from edgellm.engine.ops.attention_scalar import LANES_BATCH, _visible_from
from edgellm.engine.ops.attention_vec import WEIGH_BLOCK_SLOTS, _row_weights, _run_bounds, _sum_batch_lanes
from edgellm.quant.simd import (HAS_WIDE_TILES, f32x8_fma, f32x8_hsum, f32x8_splat, f32x8_zero, f32x16_fma,
                                f32x16_halves, f32x16_splat, f32x16_zero, load_f32x8, load_f32x8_twice, load_f32x16,
                                store_f32x8, store_f32x16)

ROWS = 4


@njit(cache=True, error_model="numpy", inline="always")
def _row_score(work, at, pos, lo, p, s, top):
    """Store one row's score of one slot (-inf where the row does not see it); returns the row's new max."""
    if pos < lo or pos > p:
        work[at] = -np.inf
        return top
    work[at] = s
    return max(top, s)


@njit(cache=True, error_model="numpy")
def _rows_scores(k_cache, slot_pos, kv, a, b, q_rows, lo, p, scale, work, tops):
    """work[r * capacity + j] <- row r's score of slot j in [a, b) (-inf where row r does not see it, i.e. outside
    [lo[r], p[r]]); returns the rows' maxima, from tops. Two keys at a time against the ROWS query rows: eight FMA
    chains in flight, each key converted once. (lo, p, tops: tuples of four, no arrays: a cached kernel that
    allocated would pull Numba's array registry in at load.)"""
    capacity, head_dim = slot_pos.shape[0], k_cache.shape[2]
    lo0, lo1, lo2, lo3 = lo
    p0, p1, p2, p3 = p
    t0, t1, t2, t3 = tops
    for j in range(a, b, 2):
        j1 = j + 1 if j + 1 < b else j  # an odd last key: scored twice, stored twice (the same value)
        b0, b1 = (kv * capacity + j) * head_dim, (kv * capacity + j1) * head_dim
        a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
        c0, c1, c2, c3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
        for c in range(0, head_dim, 8):
            k0, k1 = load_row8(k_cache, b0 + c), load_row8(k_cache, b1 + c)
            q0, q1 = load_f32x8(q_rows, c), load_f32x8(q_rows, head_dim + c)
            q2, q3 = load_f32x8(q_rows, 2 * head_dim + c), load_f32x8(q_rows, 3 * head_dim + c)
            a0, a1 = f32x8_fma(a0, k0, q0), f32x8_fma(a1, k0, q1)
            a2, a3 = f32x8_fma(a2, k0, q2), f32x8_fma(a3, k0, q3)
            c0, c1 = f32x8_fma(c0, k1, q0), f32x8_fma(c1, k1, q1)
            c2, c3 = f32x8_fma(c2, k1, q2), f32x8_fma(c3, k1, q3)
        pos = slot_pos[j]
        t0 = _row_score(work, j, pos, lo0, p0, f32x8_hsum(a0) * scale, t0)
        t1 = _row_score(work, capacity + j, pos, lo1, p1, f32x8_hsum(a1) * scale, t1)
        t2 = _row_score(work, 2 * capacity + j, pos, lo2, p2, f32x8_hsum(a2) * scale, t2)
        t3 = _row_score(work, 3 * capacity + j, pos, lo3, p3, f32x8_hsum(a3) * scale, t3)
        pos = slot_pos[j1]
        t0 = _row_score(work, j1, pos, lo0, p0, f32x8_hsum(c0) * scale, t0)
        t1 = _row_score(work, capacity + j1, pos, lo1, p1, f32x8_hsum(c1) * scale, t1)
        t2 = _row_score(work, 2 * capacity + j1, pos, lo2, p2, f32x8_hsum(c2) * scale, t2)
        t3 = _row_score(work, 3 * capacity + j1, pos, lo3, p3, f32x8_hsum(c3) * scale, t3)
    return t0, t1, t2, t3


@njit(cache=True, error_model="numpy", inline="always")
def _fma4(a0, a1, a2, a3, v0, v1, v2, v3, w):
    """a_i + v_i * w for 32 dimensions."""
    ws = f32x8_splat(w)
    return f32x8_fma(a0, v0, ws), f32x8_fma(a1, v1, ws), f32x8_fma(a2, v2, ws), f32x8_fma(a3, v3, ws)


@njit(cache=True, error_model="numpy", inline="always")
def _load4(buf, r):
    return load_f32x8(buf, r), load_f32x8(buf, r + 8), load_f32x8(buf, r + 16), load_f32x8(buf, r + 24)


@njit(cache=True, error_model="numpy", inline="always")
def _store4(buf, r, a0, a1, a2, a3):
    store_f32x8(buf, r, a0)
    store_f32x8(buf, r + 8, a1)
    store_f32x8(buf, r + 16, a2)
    store_f32x8(buf, r + 24, a3)


@njit(cache=True, error_model="numpy")
def _rows_weigh(v_cache, kv, a, b, work, acc, acc0):
    """For each row r: lane (j % LANES_BATCH) of its sums (acc[acc0 + (r * LANES_BATCH + lane) * head_dim:]) +=
    work[r * capacity + j] * v_j over the slots j in [a, b) (a slot the row does not see weighs 0), each lane's slots
    in increasing order, 32 dimensions at a time; in blocks of WEIGH_BLOCK_SLOTS slots (see _weigh_run_vec)."""
    capacity, head_dim = v_cache.shape[1], v_cache.shape[2]
    c1, c2, c3 = np.uint64(capacity), np.uint64(2 * capacity), np.uint64(3 * capacity)
    mask = LANES_BATCH - 1
    for b0 in range(a, b, WEIGH_BLOCK_SLOTS):
        b1 = min(b, b0 + WEIGH_BLOCK_SLOTS)
        for lane in range(LANES_BATCH):
            j0 = b0 + ((lane - b0) & mask)
            if j0 >= b1:
                continue
            for dc in range(0, head_dim, 32):
                r0 = acc0 + lane * head_dim + dc
                step = LANES_BATCH * head_dim  # from one row's lanes to the next row's
                x0, x1, x2, x3 = _load4(acc, r0)
                y0, y1, y2, y3 = _load4(acc, r0 + step)
                z0, z1, z2, z3 = _load4(acc, r0 + 2 * step)
                u0, u1, u2, u3 = _load4(acc, r0 + 3 * step)
                for j in range(j0, b1, LANES_BATCH):
                    base = (kv * capacity + j) * head_dim + dc
                    v0, v1 = load_row8(v_cache, base), load_row8(v_cache, base + 8)
                    v2, v3 = load_row8(v_cache, base + 16), load_row8(v_cache, base + 24)
                    w = np.uint64(j)  # an unsigned index: no test for a negative one
                    x0, x1, x2, x3 = _fma4(x0, x1, x2, x3, v0, v1, v2, v3, work[w])
                    y0, y1, y2, y3 = _fma4(y0, y1, y2, y3, v0, v1, v2, v3, work[w + c1])
                    z0, z1, z2, z3 = _fma4(z0, z1, z2, z3, v0, v1, v2, v3, work[w + c2])
                    u0, u1, u2, u3 = _fma4(u0, u1, u2, u3, v0, v1, v2, v3, work[w + c3])
                _store4(acc, r0, x0, x1, x2, x3)
                _store4(acc, r0 + step, y0, y1, y2, y3)
                _store4(acc, r0 + 2 * step, z0, z1, z2, z3)
                _store4(acc, r0 + 3 * step, u0, u1, u2, u3)


@njit(cache=True, error_model="numpy")
def _rows_scores_wide(k_cache, slot_pos, kv, a, b, q_rows, lo, p, scale, work, tops):
    """_rows_scores in 512-bit vectors: each holds two keys' 8-lane chains for one query row (the keys side by side,
    the row's 8 values in both halves), four keys at a time; every chain's FMAs and fold are the 256-bit ones."""
    capacity, head_dim = slot_pos.shape[0], k_cache.shape[2]
    lo0, lo1, lo2, lo3 = lo
    p0, p1, p2, p3 = p
    t0, t1, t2, t3 = tops
    last = b - 1
    for j in range(a, b, 4):
        js = (j, min(j + 1, last), min(j + 2, last), min(j + 3, last))  # a short last group: the last key repeated
        b0, b1 = (kv * capacity + js[0]) * head_dim, (kv * capacity + js[1]) * head_dim
        b2, b3 = (kv * capacity + js[2]) * head_dim, (kv * capacity + js[3]) * head_dim
        x0, x1, x2, x3 = f32x16_zero(), f32x16_zero(), f32x16_zero(), f32x16_zero()
        y0, y1, y2, y3 = f32x16_zero(), f32x16_zero(), f32x16_zero(), f32x16_zero()
        for c in range(0, head_dim, 8):
            k01, k23 = load_row8_pair(k_cache, b0 + c, b1 + c), load_row8_pair(k_cache, b2 + c, b3 + c)
            q0, q1 = load_f32x8_twice(q_rows, c), load_f32x8_twice(q_rows, head_dim + c)
            q2, q3 = load_f32x8_twice(q_rows, 2 * head_dim + c), load_f32x8_twice(q_rows, 3 * head_dim + c)
            x0, x1 = f32x16_fma(x0, k01, q0), f32x16_fma(x1, k01, q1)
            x2, x3 = f32x16_fma(x2, k01, q2), f32x16_fma(x3, k01, q3)
            y0, y1 = f32x16_fma(y0, k23, q0), f32x16_fma(y1, k23, q1)
            y2, y3 = f32x16_fma(y2, k23, q2), f32x16_fma(y3, k23, q3)
        for k in range(4):
            pair = (x0, x1, x2, x3) if k < 2 else (y0, y1, y2, y3)
            half = k % 2
            jk = js[k]
            pos = slot_pos[jk]
            t0 = _row_score(work, jk, pos, lo0, p0, f32x8_hsum(f32x16_halves(pair[0])[half]) * scale, t0)
            t1 = _row_score(work, capacity + jk, pos, lo1, p1, f32x8_hsum(f32x16_halves(pair[1])[half]) * scale, t1)
            t2 = _row_score(work, 2 * capacity + jk, pos, lo2, p2, f32x8_hsum(f32x16_halves(pair[2])[half]) * scale,
                            t2)
            t3 = _row_score(work, 3 * capacity + jk, pos, lo3, p3, f32x8_hsum(f32x16_halves(pair[3])[half]) * scale,
                            t3)
    return t0, t1, t2, t3


@njit(cache=True, error_model="numpy", inline="always")
def _fma2(a0, a1, v0, v1, w):
    ws = f32x16_splat(w)
    return f32x16_fma(a0, v0, ws), f32x16_fma(a1, v1, ws)


@njit(cache=True, error_model="numpy")
def _rows_weigh_wide(v_cache, kv, a, b, work, acc, acc0):
    """_rows_weigh in 512-bit vectors (the same FMAs per value, 16 dimensions each)."""
    capacity, head_dim = v_cache.shape[1], v_cache.shape[2]
    c1, c2, c3 = np.uint64(capacity), np.uint64(2 * capacity), np.uint64(3 * capacity)
    mask = LANES_BATCH - 1
    step = LANES_BATCH * head_dim  # from one row's lanes to the next row's
    for b0 in range(a, b, WEIGH_BLOCK_SLOTS):
        b1 = min(b, b0 + WEIGH_BLOCK_SLOTS)
        for lane in range(LANES_BATCH):
            j0 = b0 + ((lane - b0) & mask)
            if j0 >= b1:
                continue
            for dc in range(0, head_dim, 32):
                r0 = acc0 + lane * head_dim + dc
                x0, x1 = load_f32x16(acc, r0), load_f32x16(acc, r0 + 16)
                y0, y1 = load_f32x16(acc, r0 + step), load_f32x16(acc, r0 + step + 16)
                z0, z1 = load_f32x16(acc, r0 + 2 * step), load_f32x16(acc, r0 + 2 * step + 16)
                u0, u1 = load_f32x16(acc, r0 + 3 * step), load_f32x16(acc, r0 + 3 * step + 16)
                for j in range(j0, b1, LANES_BATCH):
                    base = (kv * capacity + j) * head_dim + dc
                    v0, v1 = load_row16(v_cache, base), load_row16(v_cache, base + 16)
                    w = np.uint64(j)  # an unsigned index: no test for a negative one
                    x0, x1 = _fma2(x0, x1, v0, v1, work[w])
                    y0, y1 = _fma2(y0, y1, v0, v1, work[w + c1])
                    z0, z1 = _fma2(z0, z1, v0, v1, work[w + c2])
                    u0, u1 = _fma2(u0, u1, v0, v1, work[w + c3])
                store_f32x16(acc, r0, x0)
                store_f32x16(acc, r0 + 16, x1)
                store_f32x16(acc, r0 + step, y0)
                store_f32x16(acc, r0 + step + 16, y1)
                store_f32x16(acc, r0 + 2 * step, z0)
                store_f32x16(acc, r0 + 2 * step + 16, z1)
                store_f32x16(acc, r0 + 3 * step, u0)
                store_f32x16(acc, r0 + 3 * step + 16, u1)


# 512-bit vectors where the CPU has them (the same bits: only how many lanes an instruction holds changes).
_scores, _weigh = (_rows_scores_wide, _rows_weigh_wide) if HAS_WIDE_TILES else (_rows_scores, _rows_weigh)


@njit(cache=True, error_model="numpy")
def _attend_rows_vec(q, k_cache, v_cache, slot_pos, q_positions, t0, window, scale, h, kv, out, work, sink):
    """_attend_vec (several-row order, sink: -inf for none) for query rows t0 .. t0 + ROWS - 1 of head h together.
    Returns False, having done nothing, where their visible slots do not fit in the ring together (the caller then
    takes them one by one).
    work: ROWS score rows of `capacity`, ROWS x LANES_BATCH accumulator rows, ROWS query rows, 8 floats."""
    capacity = slot_pos.shape[0]
    n_heads, head_dim = q.shape[1], q.shape[2]
    p = (q_positions[t0], q_positions[t0 + 1], q_positions[t0 + 2], q_positions[t0 + 3])
    lo = (_visible_from(p[0], window, capacity), _visible_from(p[1], window, capacity),
          _visible_from(p[2], window, capacity), _visible_from(p[3], window, capacity))
    lo_u, p_u = min(min(lo[0], lo[1]), min(lo[2], lo[3])), max(max(p[0], p[1]), max(p[2], p[3]))
    if p_u - lo_u + 1 > capacity:
        return False
    first, last = lo_u % capacity, p_u % capacity + 1
    n_runs = 2 if first >= last else 1
    acc0 = ROWS * capacity
    q0 = acc0 + ROWS * LANES_BATCH * head_dim
    e8 = work[q0 + ROWS * head_dim: q0 + ROWS * head_dim + 8]
    q_rows = work[q0: q0 + ROWS * head_dim]
    for r in range(ROWS):
        for d in range(head_dim):
            q_rows[r * head_dim + d] = like_cache(q[t0 + r, h, d], k_cache)
    inf = np.float32(-np.inf)
    tops = (inf, inf, inf, inf)
    for run in range(n_runs):
        a, b = _run_bounds(run, first, last, capacity)
        tops = _scores(k_cache, slot_pos, kv, a, b, q_rows, lo, p, scale, work, tops)
    _row_weights(work[0:capacity], first, last, n_runs, max(tops[0], sink), e8, v_cache, sink)
    _row_weights(work[capacity:2 * capacity], first, last, n_runs, max(tops[1], sink), e8, v_cache, sink)
    _row_weights(work[2 * capacity:3 * capacity], first, last, n_runs, max(tops[2], sink), e8, v_cache, sink)
    _row_weights(work[3 * capacity:4 * capacity], first, last, n_runs, max(tops[3], sink), e8, v_cache, sink)
    work[acc0: q0] = 0.0
    for run in range(n_runs):
        a, b = _run_bounds(run, first, last, capacity)
        _weigh(v_cache, kv, a, b, work, work, acc0)
    for r in range(ROWS):
        _sum_batch_lanes(work, acc0 + r * LANES_BATCH * head_dim, ((t0 + r) * n_heads + h) * head_dim, head_dim,
                         out)
    return True

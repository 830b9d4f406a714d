"""attention(), finish_attention_rows() and finish_attention_run(): the scratch they need, the choice of kernel
(scalar or vector, serial or parallel), the work items (a head's query row, or ROWS rows of it; in batched decoding,
a verified draft, and for one token where the threads stay busy, a token's query heads that share a KV head) and
the numpy reference.
"""

import functools

import numba
import numpy as np
from numba import njit, prange

from edgellm.engine.ops.attention_heads import HEADS, _attend_heads_vec, heads_scratch_width, prefetch_first_rows
from edgellm.engine.ops.attention_rows import ROWS, _attend_rows_vec
from edgellm.engine.ops.attention_scalar import LANES_BATCH, LANES_SINGLE, _attend
from edgellm.engine.ops.attention_vec import _attend_vec
from edgellm.engine.ops.cache_write import NO_SCALES, _check_rows, _finish_qkv, finish_heads
from edgellm.quant.aligned import zeros_aligned

@njit(cache=True, error_model="numpy", inline="always")
def _attend_item_vec(q, k_cache, v_cache, slot_pos, q_positions, window, scale, sinks, item, out, work):
    """Work item `item` of the vector kernels: one query row of one head for a single token, else up to ROWS rows of
    one head (rows in blocks of ROWS; the last partial block and a block whose slots do not fit the ring together,
    row by row)."""
    n_tokens, n_heads = q.shape[0], q.shape[1]
    group = n_heads // k_cache.shape[0]
    if n_tokens == 1:
        sink = np.float32(sinks[item]) if sinks.shape[0] else np.float32(-np.inf)
        _attend_vec(q, k_cache, v_cache, slot_pos, q_positions[0], window, scale, 0, item, item // group, out, work,
                    True, sink)
        return
    blk, h = item // n_heads, item % n_heads
    sink = np.float32(sinks[h]) if sinks.shape[0] else np.float32(-np.inf)
    t0 = blk * ROWS
    if t0 + ROWS <= n_tokens and _attend_rows_vec(
            q, k_cache, v_cache, slot_pos, q_positions, t0, window, scale, h, h // group, out, work, sink):
        return
    for t in range(t0, min(n_tokens, t0 + ROWS)):
        _attend_vec(q, k_cache, v_cache, slot_pos, q_positions[t], window, scale, t, h, h // group, out, work, False,
                    sink)


@njit(cache=True, error_model="numpy", inline="always")
def _attend_item(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, cap, sinks, item, out,
                 work):
    """Work item `item` of the scalar kernels: the query row of token item // H for head item % H."""
    n_tokens, n_heads = q.shape[0], q.shape[1]
    t, h = item // n_heads, item % n_heads
    sink = np.float32(sinks[h]) if sinks.shape[0] else np.float32(-np.inf)
    _attend(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions[t], window, np.float32(scale),
            np.float32(cap), sink, t, h, h // (n_heads // k_cache.shape[0]), out, work, n_tokens == 1)


@njit(cache=True, error_model="numpy", inline="always")
def _balanced(i, n_items, n_heads):
    """The work item that parallel index i runs. Causal rows' costs grow with their position and prange hands each
    thread a contiguous range of indices, so row blocks are taken from both ends in turn: 0, last, 1, last - 1, ...
    Any contiguous range then holds about equal work. (Items are independent: the order changes no bits.)"""
    n_blocks = n_items // n_heads
    blk, h = i // n_heads, i % n_heads
    blk = blk // 2 if blk % 2 == 0 else n_blocks - 1 - blk // 2
    return blk * n_heads + h


# Capped scores (Gemma 2) and sinks (gpt-oss) have drivers of their own: the plain ones pass the constants _NO_CAP
# and _NO_SINKS, so those steps fold away when they compile (arguments would stay run-time branches in the
# parallel loop's body).
_NO_CAP = np.float32(0.0)
_NO_SINKS = np.zeros(0, np.float32)


@njit(cache=True, error_model="numpy")
def _attention_serial(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out, scratch):
    for item in range(q.shape[0] * q.shape[1]):
        _attend_item(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, _NO_CAP, _NO_SINKS,
                     item, out, scratch[0])


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_parallel(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out,
                        scratch):
    n_items = q.shape[0] * q.shape[1]
    for i in prange(n_items):
        _attend_item(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, _NO_CAP, _NO_SINKS,
                     _balanced(i, n_items, q.shape[1]), out, scratch[numba.get_thread_id()])


@njit(cache=True, error_model="numpy")
def _attention_shaped_serial(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, cap, sinks,
                             out, scratch):
    for item in range(q.shape[0] * q.shape[1]):
        _attend_item(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, cap, sinks, item,
                     out, scratch[0])


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_shaped_parallel(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, cap,
                               sinks, out, scratch):
    n_items = q.shape[0] * q.shape[1]
    for i in prange(n_items):
        _attend_item(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, cap, sinks,
                     _balanced(i, n_items, q.shape[1]), out, scratch[numba.get_thread_id()])


@njit(cache=True, error_model="numpy", inline="always")
def _vec_items(n_tokens, n_heads):
    return n_heads if n_tokens == 1 else (n_tokens + ROWS - 1) // ROWS * n_heads


@njit(cache=True, error_model="numpy")
def _attention_serial_vec(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out,
                          scratch):
    for item in range(_vec_items(q.shape[0], q.shape[1])):
        _attend_item_vec(q, k_cache, v_cache, slot_pos, q_positions, window, np.float32(scale), _NO_SINKS, item, out,
                         scratch[0])


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_parallel_vec(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out,
                            scratch):
    n_items = _vec_items(q.shape[0], q.shape[1])
    for i in prange(n_items):
        _attend_item_vec(q, k_cache, v_cache, slot_pos, q_positions, window, np.float32(scale), _NO_SINKS,
                         _balanced(i, n_items, q.shape[1]), out, scratch[numba.get_thread_id()])


@njit(cache=True, error_model="numpy")
def _attention_sinks_serial_vec(q, k_cache, v_cache, slot_pos, q_positions, window, scale, sinks, out, scratch):
    for item in range(_vec_items(q.shape[0], q.shape[1])):
        _attend_item_vec(q, k_cache, v_cache, slot_pos, q_positions, window, np.float32(scale), sinks, item, out,
                         scratch[0])


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_sinks_parallel_vec(q, k_cache, v_cache, slot_pos, q_positions, window, scale, sinks, out, scratch):
    n_items = _vec_items(q.shape[0], q.shape[1])
    for i in prange(n_items):
        _attend_item_vec(q, k_cache, v_cache, slot_pos, q_positions, window, np.float32(scale), sinks,
                         _balanced(i, n_items, q.shape[1]), out, scratch[numba.get_thread_id()])


@njit(cache=True, error_model="numpy", inline="always")
def _group_chunks(group, chunk):
    """Work items per KV head: its group of query heads in chunks of `chunk`, the last one possibly shorter."""
    return (group + chunk - 1) // chunk


@njit(cache=True, error_model="numpy", inline="always")
def _heads_items(n_heads, n_kv, chunk):
    return n_kv * _group_chunks(n_heads // n_kv, chunk)


@njit(cache=True, error_model="numpy", inline="always")
def _heads_item(q, k_cache, v_cache, slot_pos, q_positions, window, scale, chunk, item, out, work):
    """Work item `item` of a single token's grouped-query attention: query heads g0 .. g0 + chunk - 1 (fewer at a
    group's end) of KV head kv, which read its keys and values once for all of them (_attend_heads_vec)."""
    group = q.shape[1] // k_cache.shape[0]
    chunks = _group_chunks(group, chunk)
    kv, g0 = item // chunks, item % chunks * chunk
    _attend_heads_vec(q, k_cache, v_cache, slot_pos, q_positions[0], window, scale, 0, kv * group + g0,
                      min(chunk, group - g0), kv, out, work)


@njit(cache=True, error_model="numpy")
def _attention_heads_serial_vec(q, k_cache, v_cache, slot_pos, q_positions, window, scale, chunk, out, scratch):
    for item in range(_heads_items(q.shape[1], k_cache.shape[0], chunk)):
        _heads_item(q, k_cache, v_cache, slot_pos, q_positions, window, np.float32(scale), chunk, item, out,
                    scratch[0])


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_heads_parallel_vec(q, k_cache, v_cache, slot_pos, q_positions, window, scale, chunk, out, scratch):
    for item in prange(_heads_items(q.shape[1], k_cache.shape[0], chunk)):
        _heads_item(q, k_cache, v_cache, slot_pos, q_positions, window, np.float32(scale), chunk, item, out,
                    scratch[numba.get_thread_id()])


# What each further query head adds to a work item's time when heads share their keys' and values' conversion,
# relative to a head alone (single-token attention at depth 2048, the catalog shapes, 2 threads, AVX-512 kind).
SHARED_HEAD_COST = 0.75


@functools.lru_cache(maxsize=64)  # called for every decode step's layers: the few shapes a process sees
def _heads_chunk(n_heads: int, n_kv: int, threads: int) -> int:
    """Query heads per work item for a single token's grouped-query attention: the chunk of a KV head's group (at
    most HEADS) whose items, shared out among the threads, are expected to finish first; 1 for one head per item
    (the plain one-row drivers). Sharing saves conversions but makes fewer, longer items: SmolLM2's three KV
    heads on two threads stay one head per item, Gemma-3's one KV head gives two items of two heads."""
    group = n_heads // n_kv
    best, best_time = 1, -(-n_heads // threads)
    for chunk in range(2, min(HEADS, group) + 1):
        items = n_kv * -(-group // chunk)
        finish = -(-items // threads) * (1.0 + SHARED_HEAD_COST * (chunk - 1))
        if finish < best_time:
            best, best_time = chunk, finish
    return best


@njit(cache=True, error_model="numpy", parallel=True)
def _finish_attend_rows_vec(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, q_scale, positions,
                            seqs, k_all, v_all, ks_all, vs_all, sp_all, window, scale, out, scratch):
    """Work items: a token's KV head, its query heads' cache step (finish_heads) then their attention, in runs of
    up to HEADS. Items of one token touch other heads of the same cache only; slot_pos is written first."""
    n_tokens, n_heads, _ = q.shape
    n_kv = k_all.shape[1]
    group = n_heads // n_kv
    capacity = sp_all.shape[1]
    for t in range(n_tokens):
        sp_all[seqs[t], positions[t] % capacity] = positions[t]
    for item in prange(n_tokens * n_kv):
        t, kv = item // n_kv, item % n_kv
        s = seqs[t]
        prefetch_first_rows(k_all[s], v_all[s], sp_all[s], kv, positions[t], window)  # during the cache step
        finish_heads(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, q_scale, t, kv * group,
                     (kv + 1) * group, kv, positions[t] % capacity, k_all[s], v_all[s], ks_all[s], vs_all[s])
        for g0 in range(0, group, HEADS):
            _attend_heads_vec(q, k_all[s], v_all[s], sp_all[s], positions[t], window, np.float32(scale), t,
                              kv * group + g0, min(HEADS, group - g0), kv, out, scratch[numba.get_thread_id()])


@njit(cache=True, error_model="numpy", parallel=True)
def _finish_attend_run_vec(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, q_scale, positions,
                           k_cache, v_cache, k_scale, v_scale, slot_pos, window, scale, out, scratch):
    """Rows at consecutive positions of one sequence: every row's cache step (finish_heads), then every row's
    attention, work items a row's KV head as in _finish_attend_rows_vec. A row's attention reads the slots from its
    first visible position to its own only, so the later rows' keys, already stored, are never read by it."""
    n_tokens, n_heads, _ = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    capacity = slot_pos.shape[0]
    for t in range(n_tokens):
        slot_pos[positions[t] % capacity] = positions[t]
    for item in prange(n_tokens * n_kv):
        t, kv = item // n_kv, item % n_kv
        finish_heads(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, q_scale, t, kv * group,
                     (kv + 1) * group, kv, positions[t] % capacity, k_cache, v_cache, k_scale, v_scale)
    for item in prange(n_tokens * n_kv):
        t, kv = item // n_kv, item % n_kv
        for g0 in range(0, group, HEADS):
            _attend_heads_vec(q, k_cache, v_cache, slot_pos, positions[t], window, np.float32(scale), t,
                              kv * group + g0, min(HEADS, group - g0), kv, out, scratch[numba.get_thread_id()])


def attention_rows_supported(stacked, head_dim) -> bool:
    return stacked.k.dtype != np.int8 and head_dim % LANES_SINGLE == 0


def finish_attention_rows(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, positions, seqs,
                          stacked, out, scratch, q_scale=1.0, scale=1.0):
    """finish_qkv then attention() for T independent sequences of one token each, in one parallel call: row t goes
    to sequence seqs[t] of `stacked` (a KVPool layer; the seqs distinct) and gets exactly the bits, and leaves
    exactly the cache, that finish_qkv + attention() give that row alone. f16/f32 caches with head_dim a multiple of
    32 (attention_rows_supported); out must be C-contiguous."""
    n_tokens, _, head_dim = q.shape
    _check_rows(seqs, positions, stacked, n_tokens)
    _check_scratch(scratch, stacked.slot_pos.shape[1], head_dim)
    if not attention_rows_supported(stacked, head_dim) or not out.flags.c_contiguous:
        raise ValueError("finish_attention_rows needs an f16/f32 cache, head_dim % 32 == 0 and a C-contiguous out")
    _finish_attend_rows_vec(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, np.float32(q_scale),
                            positions, seqs, stacked.k, stacked.v, stacked.k_scale, stacked.v_scale, stacked.slot_pos,
                            stacked.window, scale, out, scratch)


def finish_attention_run(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, positions, layer,
                         out, scratch, q_scale=1.0, scale=1.0):
    """finish_qkv then attention() row by row, in one parallel call, for T rows of one sequence at consecutive
    positions (a verified draft: DecoderModel.forward_verify): each row gets exactly the bits, and the cache exactly
    the contents, that T one-row decode steps in order give. layer: a KVCache layer (k, v, k_scale, v_scale,
    slot_pos, window) with an f16/f32 cache and head_dim % 32 == 0 (attention_rows_supported), at least T slots."""
    n_tokens, _, head_dim = q.shape
    capacity = layer.slot_pos.shape[0]
    _check_scratch(scratch, capacity, head_dim)
    if not attention_rows_supported(layer, head_dim) or not out.flags.c_contiguous:
        raise ValueError("finish_attention_run needs an f16/f32 cache, head_dim % 32 == 0 and a C-contiguous out")
    if positions.dtype != np.int32 or positions.shape != (n_tokens,) or n_tokens > capacity or (
            n_tokens > 1 and not (np.diff(positions) == 1).all()):
        raise ValueError(f"finish_attention_run needs int32 consecutive positions for its {n_tokens} rows, at most "
                         f"the cache's {capacity} slots")
    _finish_attend_run_vec(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, np.float32(q_scale),
                           positions, layer.k, layer.v, layer.k_scale, layer.v_scale, layer.slot_pos, layer.window,
                           scale, out, scratch)


# Below this many multiply-adds the work is shorter than waking the worker threads.
ATTENTION_PARALLEL_MIN_WORK = 1 << 17


def attention_scratch_width(capacity: int, head_dim: int) -> int:
    one_row = capacity + (LANES_SINGLE + 1) * head_dim + LANES_SINGLE
    return max(one_row, ROWS * (capacity + (LANES_BATCH + 1) * head_dim) + 8, heads_scratch_width(capacity, head_dim))


def _check_scratch(scratch, capacity: int, head_dim: int) -> None:
    need = attention_scratch_width(capacity, head_dim)
    if scratch.ndim != 2 or scratch.shape[0] < numba.config.NUMBA_NUM_THREADS or scratch.shape[1] < need:
        raise ValueError(f"attention scratch {scratch.shape} is smaller than {(numba.config.NUMBA_NUM_THREADS, need)}")


def attention_scratch(capacity: int, head_dim: int) -> np.ndarray:
    """The per-thread scratch attention() needs for a cache of this capacity: [threads, width] float32, each
    thread's row on a cache line, as the kernels load their query rows and sums 32 or 64 bytes at a time (16 bytes
    past a line, SmolLM2's 8-sequence attention alone took 1.6x as long)."""
    width = -(-attention_scratch_width(capacity, head_dim) // 16) * 16
    return zeros_aligned((numba.config.NUMBA_NUM_THREADS, width), np.float32)


def attention(q, k_cache, v_cache, slot_pos, q_positions, window, scale, out, scratch=None, k_scale=NO_SCALES,
              v_scale=NO_SCALES, cap=0.0, sinks=None):
    """q: [T, H, head_dim]; k_cache, v_cache: [H_kv, capacity, head_dim]; slot_pos: [capacity] positions;
    q_positions: [T] (their keys already stored); window: 0 for full attention;
    out: [T, H, head_dim]; scratch: attention_scratch(capacity, head_dim) or larger (allocated when None).
    Grouped-query: query head h reads kv head h // (H / H_kv). k_scale, v_scale: a q8_0 cache's scales.
    cap > 0: every score capped as cap * tanh(q·k / cap) before the scale (Gemma 2): the scalar kernel; sinks: [H]
    float32, head h's softmax denominator gains exp(sinks[h]) (gpt-oss): the vector kernels where the cache allows
    them, else the scalar one.
    The cache's values are read in their stored type (edgellm.engine.kvtypes), and must be finite in every slot
    between a query's first and last visible ones, empty slots included (the vector kernels weigh a slot a query
    does not see by 0, as llama.cpp's masked product does; the engine's caches start zeroed)."""
    n_tokens, n_heads, head_dim = q.shape
    capacity = slot_pos.shape[0]
    if scratch is None:
        scratch = attention_scratch(capacity, head_dim)
    else:
        _check_scratch(scratch, capacity, head_dim)
    span = min(capacity, window if window > 0 else int(q_positions[-1]) + 1)
    parallel = n_tokens * n_heads * head_dim * span >= ATTENTION_PARALLEL_MIN_WORK
    if sinks is not None and (sinks.shape != (n_heads,) or sinks.dtype != np.float32):
        raise ValueError(f"attention sinks must be float32 [{n_heads}], got {sinks.dtype} {sinks.shape}")
    vec = k_cache.dtype != np.int8 and head_dim % LANES_SINGLE == 0 and out.flags.c_contiguous
    if cap > 0.0 or (sinks is not None and not vec):
        kernel = _attention_shaped_parallel if parallel else _attention_shaped_serial
        kernel(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, cap,
               _NO_SINKS if sinks is None else sinks, out, scratch)
        return
    if sinks is not None:
        kernel = _attention_sinks_parallel_vec if parallel else _attention_sinks_serial_vec
        kernel(q, k_cache, v_cache, slot_pos, q_positions, window, scale, sinks, out, scratch)
        return
    if vec and n_tokens == 1 and n_heads > k_cache.shape[0]:
        chunk = _heads_chunk(n_heads, k_cache.shape[0], numba.get_num_threads() if parallel else 1)
        if chunk > 1:
            kernel = _attention_heads_parallel_vec if parallel else _attention_heads_serial_vec
            kernel(q, k_cache, v_cache, slot_pos, q_positions, window, scale, chunk, out, scratch)
            return
    if vec:
        kernel = _attention_parallel_vec if parallel else _attention_serial_vec
    else:
        kernel = _attention_parallel if parallel else _attention_serial
    kernel(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out, scratch)


def bound_decode_attention(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, layer, out, scratch,
                           q_scale=1.0, scale=1.0):
    """finish_qkv then attention() of one token (q [1, H, hd], k, v [1, H_kv, hd]) into the cache layer `layer`, as a
    callable of the token's positions ([1] int32) bound to these buffers: a decode step's, each step the kernels
    attention() would choose for that position, with its bits. None where attention() takes other than its vector
    kernels for this cache (int8 values, head_dim not a multiple of LANES_SINGLE) or out is not C-contiguous."""
    n_tokens, n_heads, head_dim = q.shape
    capacity, n_kv, window = layer.slot_pos.shape[0], layer.k.shape[0], layer.window
    if n_tokens != 1 or layer.k.dtype == np.int8 or head_dim % LANES_SINGLE or not out.flags.c_contiguous:
        return None
    _check_scratch(scratch, capacity, head_dim)
    finish = functools.partial(_finish_qkv, q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox,
                               np.float32(q_scale))
    cache = (layer.k, layer.v, layer.k_scale, layer.v_scale, layer.slot_pos)
    heads = n_heads > n_kv
    work = n_heads * head_dim

    def attend(positions):
        finish(positions, *cache)
        span = min(capacity, window if window > 0 else int(positions[0]) + 1)
        parallel = work * span >= ATTENTION_PARALLEL_MIN_WORK
        if heads:
            chunk = _heads_chunk(n_heads, n_kv, numba.get_num_threads() if parallel else 1)
            if chunk > 1:
                (_attention_heads_parallel_vec if parallel else _attention_heads_serial_vec)(
                    q, layer.k, layer.v, layer.slot_pos, positions, window, scale, chunk, out, scratch)
                return
        (_attention_parallel_vec if parallel else _attention_serial_vec)(
            q, layer.k, layer.v, layer.k_scale, layer.v_scale, layer.slot_pos, positions, window, scale, out, scratch)
    return attend


def attention_ref(q, k, v, q_positions, k_positions, window, scale, f16_operands=False, cap=0.0, sinks=None):
    """q: [T, H, hd]; k, v: [S, H_kv, hd] with positions k_positions [S]. Dense scores + mask + softmax, float64.
    f16_operands: round q and the softmax weights to float16 first, as llama.cpp (and ops.attention) do with an
    f16 cache. cap > 0: scores capped as cap * tanh(q·k / cap) before the scale. sinks [H]: a logit per head
    that joins each softmax's denominator (and weighs no value)."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    if f16_operands:
        q = q.astype(np.float16)
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), k)
    if cap > 0.0:
        scores = cap * np.tanh(scores / cap)
    scores *= scale
    distance = q_positions[:, None] - k_positions[None, :]
    visible = distance >= 0
    if window > 0:
        visible &= distance < window
    scores = np.where(visible[None], scores, -np.inf)
    sink = (np.full(q.shape[1], -np.inf) if sinks is None else np.asarray(sinks, np.float64))[:, None, None]
    top = np.maximum(scores.max(axis=-1, keepdims=True), sink)
    probs = np.exp(scores - top)
    probs /= probs.sum(axis=-1, keepdims=True) + np.exp(sink - top)
    if f16_operands:
        probs = probs.astype(np.float16).astype(np.float64)
    return np.einsum("hts,shd->thd", probs, v).astype(np.float32)

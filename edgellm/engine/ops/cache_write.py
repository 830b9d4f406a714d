"""From the q/k/v projections to the KV cache: biases, per-head q/k norms, rope, q's scale and the cache store in one
call (finish_qkv), for one sequence; both it and batched decoding (ops.finish_attention_rows, inside attention's
work items) run finish_heads, those steps for one token's heads of one KV head.

Position p lives in slot p % capacity (a full-context layer's capacity is n_ctx, so the slot is the position; a
sliding-window layer's is a ring), and every slot records the position it holds (-1: empty).
"""

import numpy as np
from numba import njit

from edgellm.engine.kvtypes import store_row
from edgellm.engine.ops.norms import rms_scale
from edgellm.engine.ops.rope import apply_rope

NO_SCALES = np.zeros((0, 0, 0), np.float32)  # the scales argument of an f32 or f16 cache


@njit(cache=True, inline="always")
def _kv_store(k_new, v_new, positions, k_cache, v_cache, k_scale, v_scale, slot_pos):
    capacity = slot_pos.shape[0]
    for t in range(positions.shape[0]):
        slot = positions[t] % capacity
        slot_pos[slot] = positions[t]
        for h in range(k_new.shape[1]):
            store_row(k_new[t, h], k_cache, k_scale, h, slot)
            store_row(v_new[t, h], v_cache, v_scale, h, slot)


def kv_store(k_new, v_new, positions, k_cache, v_cache, slot_pos, k_scale=NO_SCALES, v_scale=NO_SCALES):
    """k_new, v_new: [T, H_kv, head_dim] float32; k_cache, v_cache: [H_kv, capacity, head_dim] of any KV type
    (edgellm.engine.kvtypes) with its scales; slot_pos: [capacity]. Position p goes to slot p % capacity."""
    _kv_store(k_new, v_new, positions, k_cache, v_cache, k_scale, v_scale, slot_pos)


@njit(cache=True, error_model="numpy", inline="always")
def _rms_norm_heads(x, weight, eps):
    """In place over the last axis of x: [T, H, hd], weight: [hd]."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            scale = rms_scale(x[t, h], eps)
            for i in range(x.shape[2]):
                x[t, h, i] = x[t, h, i] * scale * weight[i]


@njit(cache=True, error_model="numpy", inline="always")
def finish_heads(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, q_scale, t, h0, h1, kv,
                 slot, k_cache, v_cache, k_scale, v_scale):
    """The steps between the projections and attention for token t's query heads h0 .. h1 - 1 and its KV head kv
    (each head's values depend on that head only): finish_qkv runs it per token and KV head, batched decoding inside
    attention's work items. k and v go to `slot` of the cache; slot_pos is the caller's to write."""
    hd = q.shape[2]
    if q_bias.size:
        for h in range(h0, h1):
            for i in range(hd):
                q[t, h, i] += q_bias[h * hd + i]
        for i in range(hd):
            k[t, kv, i] += k_bias[kv * hd + i]
            v[t, kv, i] += v_bias[kv * hd + i]
    # [1, heads, hd] views made by reshape, which Numba types C-contiguous (q[t:t + 1, h0:h1] is any-layout and
    # compiles to strided loops)
    qs, ks = q[t, h0:h1].reshape((1, h1 - h0, hd)), k[t, kv:kv + 1].reshape((1, 1, hd))
    if q_norm.size:
        _rms_norm_heads(qs, q_norm, eps)
        _rms_norm_heads(ks, k_norm, eps)
    apply_rope(qs, cos[t:t + 1], sin[t:t + 1], neox)
    apply_rope(ks, cos[t:t + 1], sin[t:t + 1], neox)
    if q_scale != np.float32(1.0):  # in float32 before attention rounds q to f16, as llama.cpp's Gemma graph
        for h in range(h0, h1):
            for i in range(hd):
                q[t, h, i] = q[t, h, i] * q_scale
    store_row(k[t, kv], k_cache, k_scale, kv, slot)
    store_row(v[t, kv], v_cache, v_scale, kv, slot)


@njit(cache=True, error_model="numpy")
def _finish_qkv(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, q_scale,
                positions, k_cache, v_cache, k_scale, v_scale, slot_pos):
    capacity, n_kv = slot_pos.shape[0], k.shape[1]
    group = q.shape[1] // n_kv
    for t in range(q.shape[0]):  # in token order: a ring slot two tokens share keeps the later one, as kv_store
        slot = positions[t] % capacity
        slot_pos[slot] = positions[t]
        for kv in range(n_kv):
            finish_heads(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, q_scale, t, kv * group,
                         (kv + 1) * group, kv, slot, k_cache, v_cache, k_scale, v_scale)


def finish_qkv(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox,
               positions, k_cache, v_cache, slot_pos, k_scale=NO_SCALES, v_scale=NO_SCALES, q_scale=1.0):
    """Everything between the q/k/v projections and attention, in one call:
    add biases (qwen2), per-head RMSNorm of q and k (qwen3, gemma3), rope q and k, store k and v in the cache.
    q: [T, H, hd]; k, v: [T, H_kv, hd]; biases: [H*hd] / [H_kv*hd]; norms: [hd]; a size-0 array skips a step.
    q_scale: a factor on q after rope, for graphs that scale q rather than the scores (Gemma)."""
    _finish_qkv(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, np.float32(q_scale),
                positions, k_cache, v_cache, k_scale, v_scale, slot_pos)


def _check_rows(seqs, positions, stacked, n_rows):
    if seqs.dtype != np.int32 or seqs.shape != (n_rows,) or positions.shape != (n_rows,):
        raise ValueError(f"seqs and positions must be int32 arrays of the {n_rows} rows")
    if n_rows and (int(seqs.min()) < 0 or int(seqs.max()) >= stacked.k.shape[0]):
        raise ValueError(f"sequence index out of range [0, {stacked.k.shape[0]})")

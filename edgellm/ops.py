"""Shared transformer ops: each Numba kernel sits beside a plain numpy reference that tests compare it with.

Sections: a vectorisable exp, normalisation, rotary embedding, KV cache writes (with the q/k steps before
them), attention, gated feed-forward activations, softcap.
Kernels write into caller-provided buffers (decoding allocates nothing); references return new arrays.
Shapes follow the model: activations are [T, ...] with T the tokens of the current batch.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from quant import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
from numba.extending import intrinsic

from edgellm.kvtypes import axpy_row, dot_row, store_row

# ----------------------------------------------------------------------------------------------------------------
# exp in float32 that LLVM can vectorise: without Intel's SVML, Numba calls libm's exp one value at a time
# (~5 ns each), which dominated SwiGLU/GeGLU and the softmax. Cephes' expf: 2^n * p(r), |r| <= ln2/2, with 2^n
# built in the exponent bits; relative error ~2e-7 (tested against numpy). Underflows to exactly 0 below -87.


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


LOG2_E = np.float32(1.4426950408889634)
LN2_HI, LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
EXP_MIN, EXP_MAX = np.float32(-87.0), np.float32(88.0)


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def fast_exp(x):
    x = np.float32(x)
    clamped = min(max(x, EXP_MIN), EXP_MAX)
    n = np.floor(clamped * LOG2_E + np.float32(0.5))
    r = clamped - n * LN2_HI - n * LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * r * r + r + np.float32(1.0)
    scaled = y * _float32_from_bits((np.int64(n) + 127) << 23)
    return scaled if x > EXP_MIN else np.float32(0.0)


@njit(cache=True, fastmath=True, error_model="numpy")
def fast_exp_array(x, out):
    """For tests: out[i] = fast_exp(x[i])."""
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])

# ----------------------------------------------------------------------------------------------------------------
# RMSNorm: y = x / sqrt(mean(x^2) + eps) * w.
# Gemma's "(1 + w)" convention needs nothing special here: llama.cpp's converter stores w + 1 in the GGUF,
# and llama.cpp multiplies by the stored weight as is, for every architecture.


@njit(cache=True, fastmath=True, error_model="numpy")
def rms_norm(x, weight, eps, out):
    """x, out: [R, d] (may be the same array); weight: [d]."""
    n_rows, d = x.shape
    for r in range(n_rows):
        sum_sq = 0.0  # float64 accumulator, like ggml
        for i in range(d):
            sum_sq += x[r, i] * x[r, i]
        inv_rms = np.float32(1.0 / math.sqrt(sum_sq / d + eps))
        for i in range(d):
            out[r, i] = x[r, i] * inv_rms * weight[i]


def rms_norm_ref(x, weight, eps):
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * weight).astype(np.float32)


@njit(cache=True, fastmath=True, error_model="numpy")
def add_rms_norm(x, delta, weight, eps, out):
    """The residual step then the next norm: x += delta; out = rms_norm(x) * weight. out may be delta."""
    n_rows, d = x.shape
    for r in range(n_rows):
        sum_sq = 0.0
        for i in range(d):
            x[r, i] += delta[r, i]
            sum_sq += x[r, i] * x[r, i]
        inv_rms = np.float32(1.0 / math.sqrt(sum_sq / d + eps))
        for i in range(d):
            out[r, i] = x[r, i] * inv_rms * weight[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def add_post_norm(x, delta, post_weight, eps):
    """Gemma's sandwich norm on a block's output: x += rms_norm(delta) * post_weight."""
    n_rows, d = x.shape
    for r in range(n_rows):
        sum_sq = 0.0
        for i in range(d):
            sum_sq += delta[r, i] * delta[r, i]
        inv_rms = np.float32(1.0 / math.sqrt(sum_sq / d + eps))
        for i in range(d):
            x[r, i] += delta[r, i] * inv_rms * post_weight[i]


# ----------------------------------------------------------------------------------------------------------------
# Rotary position embedding. Angle of rotated pair i at position p: p * inv_freq[i], with
# inv_freq[i] = freq_scale * base^(-2i / n_rot) / factor[i]  (see rope_inv_freq).
# "normal" ordering (llama in llama.cpp) rotates adjacent pairs (x[2i], x[2i+1]);
# NeoX ordering (qwen2, qwen3, gemma3) rotates (x[i], x[i + n_rot/2]). Dimensions past n_rot pass through.


def rope_inv_freq(n_rot, base, freq_scale=1.0, factors=None):
    """float64 [n_rot/2]: the angle per position of each rotated pair."""
    inv_freq = freq_scale * base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, dtype=np.float64)
    return inv_freq


@njit(cache=True)
def rope_tables(positions, inv_freq, cos_out, sin_out):
    """positions: [T] int; inv_freq: [n_rot/2] f64; cos_out, sin_out: [T, n_rot/2] f32. Computed once per batch."""
    for t in range(positions.shape[0]):
        for i in range(inv_freq.shape[0]):
            angle = positions[t] * inv_freq[i]
            cos_out[t, i] = math.cos(angle)
            sin_out[t, i] = math.sin(angle)


# inline="always" here and in the other helpers finish_qkv calls: a helper compiled as its own function and
# linked into the caller came out with different rounding in the first process (compiled fresh) than in later
# ones (loaded from the on-disk cache), so the first run after a code change gave other logits than every later
# run (measured: top-1 against llama.cpp moved by 2 positions). Inlined, it is part of the caller's own code.
@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def apply_rope(x, cos, sin, neox):
    """In place. x: [T, H, head_dim]; cos, sin: [T, n_rot/2] from rope_tables."""
    n_tokens, n_heads, _ = x.shape
    half = cos.shape[1]
    for t in range(n_tokens):
        for h in range(n_heads):
            for i in range(half):
                if neox:
                    a, b = i, i + half
                else:
                    a, b = 2 * i, 2 * i + 1
                x0 = x[t, h, a]
                x1 = x[t, h, b]
                x[t, h, a] = x0 * cos[t, i] - x1 * sin[t, i]
                x[t, h, b] = x0 * sin[t, i] + x1 * cos[t, i]


def rope_ref(x, positions, inv_freq, neox):
    """x: [T, H, head_dim]; independent formulation with complex numbers."""
    n_rot = 2 * len(inv_freq)
    y = x.astype(np.float64).copy()
    rot = y[..., :n_rot]
    if neox:
        z = rot[..., : n_rot // 2] + 1j * rot[..., n_rot // 2:]
    else:
        z = rot[..., 0::2] + 1j * rot[..., 1::2]
    z = z * np.exp(1j * np.outer(positions, inv_freq))[:, None, :]
    if neox:
        y[..., : n_rot // 2], y[..., n_rot // 2: n_rot] = z.real, z.imag
    else:
        y[..., 0:n_rot:2], y[..., 1:n_rot:2] = z.real, z.imag
    return y.astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Attention over the KV cache. Position p lives in slot p % capacity (a full-context layer's capacity is n_ctx, so
# the slot is the position; a sliding-window layer's is a ring), and every slot records the position it holds
# (-1: empty). A query at position p sees the key at kp when p - window < kp <= p (window 0: no lower bound),
# llama.cpp's rule; those positions occupy at most two runs of slots, so only they are read, and the recorded
# positions are checked too, so a slot overwritten by a newer token is never mistaken for an old one.


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
    (edgellm.kvtypes) with its scales; slot_pos: [capacity]. Position p goes to slot p % capacity."""
    _kv_store(k_new, v_new, positions, k_cache, v_cache, k_scale, v_scale, slot_pos)


# From the projections to the cache: one call does the small per-token steps in between.


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _rms_norm_heads(x, weight, eps):
    """In place over the last axis of x: [T, H, hd], weight: [hd]."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            sum_sq = 0.0
            for i in range(x.shape[2]):
                sum_sq += x[t, h, i] * x[t, h, i]
            inv_rms = np.float32(1.0 / math.sqrt(sum_sq / x.shape[2] + eps))
            for i in range(x.shape[2]):
                x[t, h, i] = x[t, h, i] * inv_rms * weight[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def _finish_qkv(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox,
                positions, k_cache, v_cache, k_scale, v_scale, slot_pos):
    if q_bias.size:
        q_flat, k_flat, v_flat = q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
        for t in range(q.shape[0]):
            q_flat[t] += q_bias
            k_flat[t] += k_bias
            v_flat[t] += v_bias
    if q_norm.size:
        _rms_norm_heads(q, q_norm, eps)
        _rms_norm_heads(k, k_norm, eps)
    apply_rope(q, cos, sin, neox)
    apply_rope(k, cos, sin, neox)
    _kv_store(k, v, positions, k_cache, v_cache, k_scale, v_scale, slot_pos)


def finish_qkv(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox,
               positions, k_cache, v_cache, slot_pos, k_scale=NO_SCALES, v_scale=NO_SCALES):
    """Everything between the q/k/v projections and attention, in one call:
    add biases (qwen2), per-head RMSNorm of q and k (qwen3, gemma3), rope q and k, store k and v in the cache.
    q: [T, H, hd]; k, v: [T, H_kv, hd]; biases: [H*hd] / [H_kv*hd]; norms: [hd]; a size-0 array skips a step."""
    _finish_qkv(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox,
                positions, k_cache, v_cache, k_scale, v_scale, slot_pos)


# Keys are scored a block at a time into a small scratch row: the block's scores, softmax weights and value sum
# are plain loops LLVM vectorises, and the running maximum (online softmax) is updated once per block.
ATTENTION_KEY_BLOCK = 64
MASKED = np.float32(-1.0e30)  # score of a key the query must not see; fast_exp turns it into exactly 0


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _attend_slots(q, k_cache, v_cache, k_scale, v_scale, slot_pos, first, last, t, h, kv, lo, p, scale, acc, scores,
                  running_max, denom):
    """Fold slots [first, last) into the online softmax of query (t, h): acc [head_dim] holds the unnormalised
    weighted sum of values under running_max; returns the updated (running_max, denom)."""
    head_dim = q.shape[2]
    q_row = q[t, h]
    # 1-D row views in the inner loops: multi-dimensional indexing with computed indices keeps LLVM from
    # vectorising (Numba's negative-index handling), rows do not.
    for j0 in range(first, last, ATTENTION_KEY_BLOCK):
        n = min(ATTENTION_KEY_BLOCK, last - j0)
        for jb in range(n):
            scores[jb] = dot_row(q_row, k_cache, k_scale, kv, j0 + jb) * scale
        block_max = MASKED
        positions = slot_pos[j0: j0 + n]
        for jb in range(n):
            if positions[jb] < lo or positions[jb] > p:
                scores[jb] = MASKED
            block_max = max(block_max, scores[jb])
        if block_max == MASKED:
            continue
        if block_max > running_max:  # rescale what was accumulated under the old maximum
            correction = fast_exp(running_max - block_max)
            denom *= correction
            for d in range(head_dim):
                acc[d] *= correction
            running_max = block_max
        for jb in range(n):
            scores[jb] = fast_exp(scores[jb] - running_max)
            denom += scores[jb]
        for jb in range(n):
            axpy_row(acc, scores[jb], v_cache, v_scale, kv, j0 + jb)
    return running_max, denom


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _attend(q, k_cache, v_cache, k_scale, v_scale, slot_pos, p, window, scale, t, h, kv, out, scores):
    """out[t, h] = sum over visible keys of softmax(q[t, h] . k * scale) v. scores: [ATTENTION_KEY_BLOCK] scratch."""
    capacity = slot_pos.shape[0]
    lo = max(0, p - window + 1) if window > 0 else 0
    lo = max(lo, p - capacity + 1)  # older positions have been overwritten
    acc = out[t, h]
    acc[:] = 0.0
    running_max, denom = MASKED, np.float32(0.0)
    first, last = lo % capacity, p % capacity + 1
    if first < last:
        running_max, denom = _attend_slots(q, k_cache, v_cache, k_scale, v_scale, slot_pos, first, last, t, h, kv,
                                           lo, p, scale, acc, scores, running_max, denom)
    else:  # the visible positions wrap around the end of the ring
        running_max, denom = _attend_slots(q, k_cache, v_cache, k_scale, v_scale, slot_pos, first, capacity, t, h,
                                           kv, lo, p, scale, acc, scores, running_max, denom)
        running_max, denom = _attend_slots(q, k_cache, v_cache, k_scale, v_scale, slot_pos, 0, last, t, h, kv, lo,
                                           p, scale, acc, scores, running_max, denom)
    inv = np.float32(1.0) / denom
    for d in range(acc.shape[0]):
        acc[d] *= inv


@njit(cache=True, fastmath=True, error_model="numpy")
def _attention_serial(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out, scores):
    n_tokens, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[0]
    for th in range(n_tokens * n_heads):
        t, h = th // n_heads, th % n_heads
        _attend(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions[t], window, np.float32(scale), t, h,
                h // group, out, scores[t, h])


@njit(cache=True, fastmath=True, error_model="numpy", parallel=True)
def _attention_parallel(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out,
                        scores):
    n_tokens, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[0]
    for th in prange(n_tokens * n_heads):
        t, h = th // n_heads, th % n_heads
        _attend(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions[t], window, np.float32(scale), t, h,
                h // group, out, scores[t, h])


# Below this many multiply-adds the work is shorter than waking the worker threads.
ATTENTION_PARALLEL_MIN_WORK = 1 << 17


def attention(q, k_cache, v_cache, slot_pos, q_positions, window, scale, out, scores, k_scale=NO_SCALES,
              v_scale=NO_SCALES):
    """q: [T, H, head_dim]; k_cache, v_cache: [H_kv, capacity, head_dim]; slot_pos: [capacity] positions;
    q_positions: [T] (their keys already stored); window: 0 for full attention;
    out: [T, H, head_dim]; scores: [T, H, ATTENTION_KEY_BLOCK] scratch.
    Grouped-query: query head h reads kv head h // (H / H_kv). k_scale, v_scale: a q8_0 cache's scales.
    The cache's values are read in their stored type (edgellm.kvtypes)."""
    n_tokens, n_heads, head_dim = q.shape
    span = min(slot_pos.shape[0], window if window > 0 else int(q_positions[-1]) + 1)
    kernel = _attention_parallel if n_tokens * n_heads * head_dim * span >= ATTENTION_PARALLEL_MIN_WORK \
        else _attention_serial
    kernel(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out, scores)


def attention_ref(q, k, v, q_positions, k_positions, window, scale):
    """q: [T, H, hd]; k, v: [S, H_kv, hd] with positions k_positions [S]. Dense scores + mask + softmax, float64."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), k) * scale
    distance = q_positions[:, None] - k_positions[None, :]
    visible = distance >= 0
    if window > 0:
        visible &= distance < window
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Gated feed-forward activations: gate <- act(gate) * up, in place (llama.cpp's LLM_FFN_PAR).


@njit(cache=True, fastmath=True, error_model="numpy")
def silu_mul(gate, up):
    """SwiGLU. gate, up: [T, n_ff]; result in gate."""
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            gate[t, i] = g / (np.float32(1.0) + fast_exp(-g)) * up[t, i]


def silu_mul_ref(gate, up):
    g = gate.astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * up).astype(np.float32)


GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.7978845608028654)


@njit(cache=True, fastmath=True, error_model="numpy")
def gelu_tanh_mul(gate, up):
    """GeGLU with the tanh approximation of GELU (Gemma). gate, up: [T, n_ff]; result in gate."""
    one, half = np.float32(1.0), np.float32(0.5)
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            inner = SQRT_2_OVER_PI * g * (one + GELU_COEF_A * g * g)
            tanh_inner = one - np.float32(2.0) / (one + fast_exp(np.float32(2.0) * inner))  # tanh via exp
            gate[t, i] = half * g * (one + tanh_inner) * up[t, i]


def gelu_tanh_mul_ref(gate, up):
    g = gate.astype(np.float64)
    return (0.5 * g * (1.0 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * up).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Softcap: cap * tanh(x / cap) (Gemma 2 attention/final logits; Gemma 3 in llama.cpp applies none).


@njit(cache=True, fastmath=True, error_model="numpy")
def softcap(x, cap):
    """In place on a [R, n] array."""
    inv_cap = np.float32(1.0 / cap)
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[r, i] = cap * math.tanh(x[r, i] * inv_cap)


def softcap_ref(x, cap):
    return (cap * np.tanh(x.astype(np.float64) / cap)).astype(np.float32)

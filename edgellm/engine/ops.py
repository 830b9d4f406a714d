"""Shared transformer ops: each Numba kernel sits beside a plain numpy reference that tests compare it with.

Sections: a vectorisable exp, normalisation, rotary embedding, KV cache writes (with the q/k steps before
them), attention, gated feed-forward activations, softcap.

The kernels round exactly as llama.cpp's CPU backend does (x86 AVX2/FMA and AArch64 builds, flash attention off,
its default): the same exp polynomial, float64 sums where it sums in float64, FMAs where it uses them, float16
roundings where it converts, and its summation orders. The models are chaotic enough that a last-bit
difference in one op moves later logits by tenths (docs/exactness.md), so matching llama.cpp means matching its
arithmetic, op by op; tests/test_ops_llama_exact.py checks each op against values dumped from llama.cpp.
Kernels write into caller-provided buffers (decoding allocates nothing); references return new arrays.
Shapes follow the model: activations are [T, ...] with T the tokens of the current batch.
"""

import math

import numba
import numpy as np
from numba import njit, prange
from edgellm.quant import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
from edgellm.quant.simd import (f16_bits_to_f32, f32_bits, f32_shl23_add, f32_to_f16, f32x8_add, f32x8_fma, f32x8_hsum,
                                f32x8_hsum_pairs, f32x8_splat, f32x8_zero, fma32, load_f32x8, prefetch, store_f32x8)

from edgellm.engine.kvtypes import like_cache, load_row8, row_value, store_row

# ----------------------------------------------------------------------------------------------------------------
# exp in float32 as llama.cpp computes it (ggml_v_expf, from Arm's optimized-routines expf): n = round(x / ln2)
# by adding 1.5 * 2^23, b = x - n ln2 in two FMA steps (ln2 split in a high and a low part), a degree-5
# polynomial in b, and 2^n built in the exponent bits; |n| > 126 takes a path that scales in two steps, so large
# negative x underflow to 0 and large positive x overflow to inf. Within 1.5 ulp of exp, and branch-light, so
# LLVM vectorises loops over it (libm's exp is called one value at a time).

EXP_SHIFT = np.float32(float.fromhex("0x1.8p23"))
EXP_INV_LN2 = np.float32(float.fromhex("0x1.715476p+0"))
EXP_LN2_HI, EXP_LN2_LO = np.float32(float.fromhex("0x1.62e4p-1")), np.float32(float.fromhex("0x1.7f7d1cp-20"))
EXP_POLY = tuple(np.float32(float.fromhex(c)) for c in
                 ("0x1.ffffecp-1", "0x1.fffdb6p-2", "0x1.555e66p-3", "0x1.573e2ep-5", "0x1.0e4020p-7"))
_P1, _P2, _P3, _P4, _P5 = EXP_POLY
_ONE_BITS = 0x3F800000
# |n| > 126 builds 2^n in two factors: for n <= 0, (n + 125 in the exponent) * 2^-125, else (n - 127) * 2^127
_TINY_FACTOR_ADD, _TINY_S1 = 0x7E000000, np.float32(2.0 ** -125)
_BIG_S1 = np.float32(2.0 ** 127)


@njit(cache=True, error_model="numpy", inline="always")
def fast_exp(x):
    x = np.float32(x)
    z = fma32(x, EXP_INV_LN2, EXP_SHIFT)
    n = z - EXP_SHIFT
    b = fma32(-n, EXP_LN2_LO, fma32(-n, EXP_LN2_HI, x))
    zb = f32_bits(z)  # n in its low bits; shifted into the exponent field in 32-bit arithmetic (f32_shl23_add)
    u = b * b
    j = fma32(fma32(fma32(_P5, b, _P4), u, fma32(_P3, b, _P2)), u, _P1 * b)
    k = f32_shl23_add(zb, _ONE_BITS)
    normal = fma32(j, k, k)
    # |n| > 126: 2^n in two factors (kg * s1), or over/underflow past 192; selects, not branches, so that loops
    # over fast_exp vectorise. Every lane computes the far path, so a lane that does not take it gets kg = 1.0:
    # with its own far factors a positive n made kg * j subnormal, and each subnormal result costs a microcode
    # assist that costs far more than the arithmetic (docs/kernels.md). (kg = k, s1 = 1 does not do: LLVM turns the
    # multiply by a select of constants into a select of multiplies, and k * 2^-125 is subnormal for n < 0.)
    big = abs(n)
    far_lane = big > np.float32(126.0)
    tiny = n <= np.float32(0.0)
    s1 = _TINY_S1 if tiny else _BIG_S1
    kg = f32_shl23_add(zb if far_lane else np.uint32(0), (_TINY_FACTOR_ADD if tiny else 0) if far_lane else _ONE_BITS)
    scaled = fma32(kg, j, kg) * s1
    far = s1 * s1 if big > np.float32(192.0) else scaled
    return far if far_lane else normal


@njit(cache=True, error_model="numpy")
def fast_exp_array(x, out):
    """For tests: out[i] = fast_exp(x[i])."""
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])

# ----------------------------------------------------------------------------------------------------------------
# RMSNorm: y = x / sqrt(mean(x^2) + eps) * w.
# Gemma's "(1 + w)" convention needs nothing special here: llama.cpp's converter stores w + 1 in the GGUF,
# and llama.cpp multiplies by the stored weight as is, for every architecture.


@njit(cache=True, error_model="numpy", inline="always")
def _scale_from_total(total, n, eps):
    mean = np.float32(total / n)
    return np.float32(1.0) / np.float32(math.sqrt(mean + np.float32(eps)))


@njit(cache=True, error_model="numpy", inline="always")
def rms_scale(row, eps):
    """1 / sqrt(mean(row^2) + eps) as llama.cpp's rms_norm: float32 squares summed in float64 in order, the mean
    rounded to float32, then sqrt and the reciprocal in float32. The caller then computes (x * scale) * weight."""
    total = 0.0
    for i in range(row.shape[0]):
        total += np.float64(row[i] * row[i])
    return _scale_from_total(total, row.shape[0], eps)


@njit(cache=True, error_model="numpy", inline="always")
def _sq(x, r, i):
    return np.float64(x[r, i] * x[r, i])


@njit(cache=True, error_model="numpy", inline="always")
def _rms_scales4(x, r, eps):
    """rms_scale of rows r .. r + 3 of x: four float64 sums side by side, each in its own row's order (so each is
    rms_scale's exactly). One row's sum is a chain of dependent adds; four keep the adder busy."""
    t0 = t1 = t2 = t3 = 0.0
    for i in range(x.shape[1]):
        t0 += _sq(x, r, i)
        t1 += _sq(x, r + 1, i)
        t2 += _sq(x, r + 2, i)
        t3 += _sq(x, r + 3, i)
    n = x.shape[1]
    return (_scale_from_total(t0, n, eps), _scale_from_total(t1, n, eps), _scale_from_total(t2, n, eps),
            _scale_from_total(t3, n, eps))


# The three norms of a block as one kernel over rows: NORM_PLAIN out = rms_norm(x) * w; NORM_ADD x += delta, then
# out = rms_norm(x) * w; NORM_POST x += rms_norm(delta) * w (Gemma's sandwich norm). out may be x or delta.
NORM_PLAIN, NORM_ADD, NORM_POST = 0, 1, 2


@njit(cache=True, error_model="numpy", inline="always")
def _norm_apply(x, weight, out, delta, mode, r, scale):
    if mode == NORM_POST:
        for i in range(x.shape[1]):
            x[r, i] += delta[r, i] * scale * weight[i]
    else:
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] * scale * weight[i]


@njit(cache=True, error_model="numpy", inline="always")
def _norm_rows(x, weight, eps, out, delta, mode, r0, r1):
    """Rows [r0, r1): four at a time (their sums side by side), then one by one."""
    src = delta if mode == NORM_POST else x
    r = r0
    while r < r1:
        n = 4 if r + 4 <= r1 else 1
        if mode == NORM_ADD:
            for k in range(r, r + n):
                for i in range(x.shape[1]):
                    x[k, i] += delta[k, i]
        if n == 4:
            s0, s1, s2, s3 = _rms_scales4(src, r, eps)
            _norm_apply(x, weight, out, delta, mode, r, s0)
            _norm_apply(x, weight, out, delta, mode, r + 1, s1)
            _norm_apply(x, weight, out, delta, mode, r + 2, s2)
            _norm_apply(x, weight, out, delta, mode, r + 3, s3)
        else:
            _norm_apply(x, weight, out, delta, mode, r, rms_scale(src[r], eps))
        r += n


@njit(cache=True, error_model="numpy")
def _norm_serial(x, weight, eps, out, delta, mode):
    _norm_rows(x, weight, eps, out, delta, mode, 0, x.shape[0])


NORM_PARALLEL_MIN_ROWS = 32  # below, one region's start and join cost more than the rows
NORM_ROWS_PER_ITEM = 16


@njit(cache=True, error_model="numpy", parallel=True)
def _norm_parallel(x, weight, eps, out, delta, mode):
    n_rows = x.shape[0]
    for b in prange((n_rows + NORM_ROWS_PER_ITEM - 1) // NORM_ROWS_PER_ITEM):
        _norm_rows(x, weight, eps, out, delta, mode, b * NORM_ROWS_PER_ITEM,
                   min(n_rows, (b + 1) * NORM_ROWS_PER_ITEM))


def _norm(x, weight, eps, out, delta, mode):
    (_norm_parallel if x.shape[0] >= NORM_PARALLEL_MIN_ROWS else _norm_serial)(x, weight, eps, out, delta, mode)


def rms_norm(x, weight, eps, out):
    """x, out: [R, d] float32 (may be the same array); weight: [d]. Each row's bits are the same whichever way the
    rows are split (four side by side, or in parallel from NORM_PARALLEL_MIN_ROWS rows on)."""
    _norm(x, weight, eps, out, x, NORM_PLAIN)


def rms_norm_ref(x, weight, eps):
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * weight).astype(np.float32)


def add_rms_norm(x, delta, weight, eps, out):
    """The residual step then the next norm: x += delta; out = rms_norm(x) * weight. out may be delta."""
    _norm(x, weight, eps, out, delta, NORM_ADD)


def add_post_norm(x, delta, post_weight, eps):
    """Gemma's sandwich norm on a block's output: x += rms_norm(delta) * post_weight."""
    _norm(x, post_weight, eps, x, delta, NORM_POST)


# ----------------------------------------------------------------------------------------------------------------
# Rotary position embedding. Pair i at position p turns by p * inv_freq[i], with
# inv_freq[i] = freq_scale * base^(-2i / n_rot) / factor[i]  (see rope_inv_freq, which the references use).
# The kernels compute the angles as llama.cpp does, in float32: theta_scale = base^(-2 / n_rot), and the angle of
# pair i is p * theta_scale^i by repeated multiplication (then / factor[i], * freq_scale), cos and sin in float32.
# "normal" ordering (llama in llama.cpp) rotates adjacent pairs (x[2i], x[2i+1]);
# NeoX ordering (qwen2, qwen3, gemma3) rotates (x[i], x[i + n_rot/2]). Dimensions past n_rot pass through.
# YaRN (ext_factor 1) blends, per pair, the interpolated angle (* freq_scale) with the extrapolated one (unscaled) by
# a ramp over the pairs between the correction dims [low, high] (ggml_rope_yarn_corr_dims), and multiplies cos and
# sin by mscale = attn_factor * (1 + 0.1 ln(1 / freq_scale)) (ggml-cpu's rope_yarn).

YARN_RAMP_MIN_WIDTH = 0.001  # rope_yarn_ramp's floor on high - low


def yarn_corr_dims_ref(n_rot, n_ctx_orig, base, beta_fast, beta_slow):
    """(low, high) in float64: the pairs below low keep the extrapolated angle, those past high the interpolated."""
    def corr_dim(n_turns):
        return n_rot * np.log(n_ctx_orig / (n_turns * 2 * np.pi)) / (2 * np.log(base))
    return max(0.0, float(np.floor(corr_dim(beta_fast)))), min(n_rot - 1.0, float(np.ceil(corr_dim(beta_slow))))


def rope_inv_freq(n_rot, base, freq_scale=1.0, factors=None, scaling=None):
    """float64 [n_rot/2]: the angle per position of each rotated pair. scaling: a RopeScaling with ext_factor != 0
    for YaRN's per-pair blend."""
    extrap = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if factors is not None:
        extrap = extrap / np.asarray(factors, dtype=np.float64)
    if scaling is None or not scaling.ext_factor:
        return freq_scale * extrap
    low, high = yarn_corr_dims_ref(n_rot, scaling.n_ctx_orig, base, scaling.beta_fast, scaling.beta_slow)
    ramp = 1 - np.clip((np.arange(n_rot // 2) - low) / max(YARN_RAMP_MIN_WIDTH, high - low), 0, 1)
    mix = ramp * scaling.ext_factor
    return extrap * (freq_scale * (1 - mix) + mix)


def rope_mscale_ref(freq_scale=1.0, scaling=None):
    """float64: the factor on cos and sin."""
    if scaling is None:
        return 1.0
    if not scaling.ext_factor:
        return scaling.attn_factor
    return scaling.attn_factor * (1 + 0.1 * np.log(1 / freq_scale))


@njit(cache=True, error_model="numpy")
def _theta_scale(base, n_rot):
    return np.float32(base) ** (np.float32(-2.0) / np.float32(n_rot))  # powf, as llama.cpp


@njit(cache=True, error_model="numpy")
def _yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast, beta_slow):
    """ggml_rope_yarn_corr_dims in float32 (logf, floorf, ceilf; ggml-base has no FMA contraction)."""
    two_pi = np.float32(2) * np.float32(math.pi)
    two_log_base = np.float32(2) * np.float32(math.log(np.float32(base)))
    fast = np.float32(n_rot) * np.float32(math.log(np.float32(n_ctx_orig) / (np.float32(beta_fast) * two_pi)))
    slow = np.float32(n_rot) * np.float32(math.log(np.float32(n_ctx_orig) / (np.float32(beta_slow) * two_pi)))
    low = np.float32(math.floor(fast / two_log_base))
    high = np.float32(math.ceil(slow / two_log_base))
    return max(np.float32(0), low), min(np.float32(n_rot - 1), high)


@njit(cache=True, error_model="numpy")
def _yarn_context_attn_factor(freq_scale):
    """The attn_factor llama.cpp's context hands rope under YaRN: get_mscale(factor) / (1 + 0.1 logf(factor)), which
    rope's own factor then cancels up to rounding (libllama: no FMA contraction)."""
    factor = np.float32(1) / np.float32(freq_scale)
    log = np.float32(math.log(factor))
    a = np.float32(1) if factor <= np.float32(1) else np.float32(0.1) * log + np.float32(1)
    return a * (np.float32(1) / (np.float32(1) + np.float32(0.1) * log))


@njit(cache=True, error_model="numpy")
def _yarn_mscale(attn_factor, freq_scale):
    """rope_yarn's mscale: attn_factor * (1 + 0.1 logf(1 / freq_scale)), the sum one FMA as ggml-cpu's build."""
    log = np.float32(math.log(np.float32(1) / np.float32(freq_scale)))
    return np.float32(attn_factor) * fma32(np.float32(0.1), log, np.float32(1))


class Rope:
    """A rotary embedding's parameters in the form rope_tables takes: theta_scale (float32), freq_scale
    (float32), factors (float32 [n_rot/2], ones without the file's rope_freqs), YaRN's ext_factor, corr dims
    (low, high) and mscale (float32; 0, -, 1 without YaRN), and inv_freq (float64, for the references and for
    re-rotating keys in a context shift). scaling: the config's RopeScaling (its attn_factor and YaRN fields)."""

    def __init__(self, n_rot, base, freq_scale=1.0, factors=None, scaling=None):
        self.n_rot = int(n_rot)
        self.theta_scale = np.float32(_theta_scale(np.float32(base), self.n_rot))
        self.freq_scale = np.float32(freq_scale)
        self.factors = (np.ones(self.n_rot // 2, np.float32) if factors is None
                        else np.ascontiguousarray(factors, dtype=np.float32))
        self.ext_factor, self.low, self.high = np.float32(0), np.float32(0), np.float32(0)
        self.mscale = np.float32(1)
        yarn = scaling is not None and scaling.ext_factor != 0
        if yarn:
            self.ext_factor = np.float32(scaling.ext_factor)
            self.low, self.high = _yarn_corr_dims(self.n_rot, scaling.n_ctx_orig, np.float32(base),
                                                  np.float32(scaling.beta_fast), np.float32(scaling.beta_slow))
            # (from the model's freq_scale, which a layer's own, e.g. Gemma's local layers' 1, need not be)
            self.mscale = np.float32(_yarn_context_attn_factor(np.float32(1) / np.float32(scaling.factor)))
        if scaling is not None:
            self.mscale = self.mscale * np.float32(scaling.attn_factor)
        if yarn:
            self.mscale = np.float32(_yarn_mscale(self.mscale, self.freq_scale))
        self.inv_freq = rope_inv_freq(n_rot, base, freq_scale, factors, scaling)


@njit(cache=True, error_model="numpy")
def _rope_tables(positions, theta_scale, freq_scale, factors, ext_factor, low, high, mscale, cos_out, sin_out):
    theta_scale, freq_scale = np.float32(theta_scale), np.float32(freq_scale)  # float32 arithmetic throughout
    one = np.float32(1)
    width = max(np.float32(YARN_RAMP_MIN_WIDTH), np.float32(high) - np.float32(low))
    for t in range(positions.shape[0]):
        theta = np.float32(positions[t])
        for i in range(cos_out.shape[1]):
            extrap = theta / factors[i]
            angle = freq_scale * extrap
            if ext_factor != 0:  # rope_yarn: the blend's first product fused, as ggml-cpu's build
                y = (np.float32(i) - np.float32(low)) / width
                mix = (one - min(one, max(np.float32(0), y))) * np.float32(ext_factor)
                angle = fma32(angle, one - mix, extrap * mix)
            cos_out[t, i] = np.float32(math.cos(angle)) * np.float32(mscale)
            sin_out[t, i] = np.float32(math.sin(angle)) * np.float32(mscale)
            theta = theta * theta_scale


def rope_tables(positions, rope: Rope, cos_out, sin_out):
    """positions: [T] int; cos_out, sin_out: [T, n_rot/2] f32. Computed once per batch."""
    _rope_tables(positions, rope.theta_scale, rope.freq_scale, rope.factors, rope.ext_factor, rope.low, rope.high,
                 rope.mscale, cos_out, sin_out)


# inline="always" here and in the other helpers finish_qkv calls: a helper compiled as its own function and
# linked into the caller came out with different rounding in the first process (compiled fresh) than in later
# ones (loaded from the on-disk cache), so the first run after a code change gave other logits than every later
# run. Inlined, it is part of the caller's own code.
@njit(cache=True, error_model="numpy", inline="always")
def apply_rope(x, cos, sin, neox):
    """In place. x: [T, H, head_dim]; cos, sin: [T, n_rot/2] from rope_tables. The first output rounds
    x0 cos - x1 sin with one FMA (x0 cos exact), the second x0 sin + x1 cos likewise, as llama.cpp's build."""
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
                c, sn = cos[t, i], sin[t, i]
                x[t, h, a] = fma32(x0, c, -(x1 * sn))
                x[t, h, b] = fma32(x0, sn, x1 * c)


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
    (edgellm.engine.kvtypes) with its scales; slot_pos: [capacity]. Position p goes to slot p % capacity."""
    _kv_store(k_new, v_new, positions, k_cache, v_cache, k_scale, v_scale, slot_pos)


# From the projections to the cache: one call does the small per-token steps in between.


@njit(cache=True, error_model="numpy", inline="always")
def _rms_norm_heads(x, weight, eps):
    """In place over the last axis of x: [T, H, hd], weight: [hd]."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            scale = rms_scale(x[t, h], eps)
            for i in range(x.shape[2]):
                x[t, h, i] = x[t, h, i] * scale * weight[i]


@njit(cache=True, error_model="numpy")
def _finish_qkv(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, q_scale,
                positions, k_cache, v_cache, k_scale, v_scale, slot_pos):
    if q_bias.size:
        q_flat, k_flat, v_flat = q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
        for t in range(q.shape[0]):  # element loops: an array `+=` compiles Numba's shape-error formatting (3 s)
            for i in range(q_bias.size):
                q_flat[t, i] += q_bias[i]
            for i in range(k_bias.size):
                k_flat[t, i] += k_bias[i]
                v_flat[t, i] += v_bias[i]
    if q_norm.size:
        _rms_norm_heads(q, q_norm, eps)
        _rms_norm_heads(k, k_norm, eps)
    apply_rope(q, cos, sin, neox)
    apply_rope(k, cos, sin, neox)
    if q_scale != np.float32(1.0):  # in float32 before attention rounds q to f16, as llama.cpp's Gemma graph
        for t in range(q.shape[0]):
            for h in range(q.shape[1]):
                for i in range(q.shape[2]):
                    q[t, h, i] = q[t, h, i] * q_scale
    _kv_store(k, v, positions, k_cache, v_cache, k_scale, v_scale, slot_pos)


def finish_qkv(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox,
               positions, k_cache, v_cache, slot_pos, k_scale=NO_SCALES, v_scale=NO_SCALES, q_scale=1.0):
    """Everything between the q/k/v projections and attention, in one call:
    add biases (qwen2), per-head RMSNorm of q and k (qwen3, gemma3), rope q and k, store k and v in the cache.
    q: [T, H, hd]; k, v: [T, H_kv, hd]; biases: [H*hd] / [H_kv*hd]; norms: [hd]; a size-0 array skips a step.
    q_scale: a factor on q after rope, for graphs that scale q rather than the scores (Gemma)."""
    _finish_qkv(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, np.float32(q_scale),
                positions, k_cache, v_cache, k_scale, v_scale, slot_pos)


@njit(cache=True, error_model="numpy")
def _finish_qkv_rows(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, q_scale,
                     positions, seqs, k_all, v_all, ks_all, vs_all, sp_all):
    for t in range(q.shape[0]):
        s = seqs[t]
        _finish_qkv(q[t:t + 1], k[t:t + 1], v[t:t + 1], q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos[t:t + 1],
                    sin[t:t + 1], neox, q_scale, positions[t:t + 1], k_all[s], v_all[s], ks_all[s], vs_all[s], sp_all[s])


def finish_qkv_rows(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, positions, seqs, stacked,
                    q_scale=1.0):
    """finish_qkv for T independent sequences of one token each: row t goes to sequence seqs[t] of `stacked`
    (a KVPool layer: arrays with a leading sequence axis). Row t gets exactly finish_qkv's arithmetic alone."""
    _check_rows(seqs, positions, stacked, q.shape[0])
    _finish_qkv_rows(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, np.float32(q_scale),
                     positions, seqs, stacked.k, stacked.v, stacked.k_scale, stacked.v_scale, stacked.slot_pos)


def _check_rows(seqs, positions, stacked, n_rows):
    if seqs.dtype != np.int32 or seqs.shape != (n_rows,) or positions.shape != (n_rows,):
        raise ValueError(f"seqs and positions must be int32 arrays of the {n_rows} rows")
    if n_rows and (int(seqs.min()) < 0 or int(seqs.max()) >= stacked.k.shape[0]):
        raise ValueError(f"sequence index out of range [0, {stacked.k.shape[0]})")


# llama.cpp computes attention (flash attention off) as two matrix products around a softmax, and its float16
# cache makes both products float16 x float16 with float32 FMA accumulation: the query and the softmax weights are
# rounded to float16 first. The order of each sum depends on the product's kernel:
#   - one query row (decoding): ggml_vec_dot_f16, 4 x 8 accumulators over runs of 32 values, reduced as
#     ((a0 + a2) + (a1 + a3)), then the 8 lanes as ((l0+l4) + (l1+l5)) + ((l2+l6) + (l3+l7));
#   - several query rows (prompt batches): llamafile's tinyBLAS, one 8-lane accumulator, reduced as
#     ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)).
# The lanes run over the head dimension for the scores and over cache cells for the weighted sum of values (cell
# c feeds lane c % 32 or c % 8; a slot here is llama.cpp's cell while the context has not wrapped or shifted).
# The softmax: max, exp (fast_exp), a float64 sum of per-8-cell float32 partial sums, one float32 reciprocal.
# So every score is computed before any weight: a scratch row per thread holds the scores, then the weights.

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
def _score_run(q_row, k_cache, k_scale, slot_pos, kv, first, last, lo, p, scale, lanes, acc, work, top):
    """work[j] <- score of slot j in [first, last) (-inf where position lo..p excludes it); returns the max."""
    for j in range(first, last):
        pos = slot_pos[j]
        if pos < lo or pos > p:
            work[j] = -np.inf
            continue
        s = _score(q_row, k_cache, k_scale, kv, j, lanes, acc) * scale
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
def _attend(q, k_cache, v_cache, k_scale, v_scale, slot_pos, p, window, scale, t, h, kv, out, work, single):
    """out[t, h] = sum over visible keys of softmax(q[t, h] . k * scale) v. work: this thread's scratch row:
    capacity scores, then LANES_SINGLE accumulator rows, the query rounded as the cache, and LANES_SINGLE more."""
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
    top = np.float32(-np.inf)
    if wrapped:
        top = _score_run(q_row, k_cache, k_scale, slot_pos, kv, first, capacity, lo, p, scale, lanes, acc, work, top)
        top = _score_run(q_row, k_cache, k_scale, slot_pos, kv, 0, last, lo, p, scale, lanes, acc, work, top)
        total = _exp_run(work, first, capacity, top, acc) + _exp_run(work, 0, last, top, acc)
    else:
        top = _score_run(q_row, k_cache, k_scale, slot_pos, kv, first, last, lo, p, scale, lanes, acc, work, top)
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


# The same arithmetic in 8-float vectors, for f16 and f32 caches whose head size is a multiple of 32 (every model
# here): the scores, the weighted sum of values and the final reductions run in F32x8 lanes (quant.simd), the
# exponentials of 8 slots at a time. The results are the scalar path's (and llama.cpp's) bit for bit.


@njit(cache=True, error_model="numpy", inline="always")
def _score_vec(q_row, k_cache, base, head_dim, single):
    if single:
        a0, a1, a2, a3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
        for c in range(0, head_dim, 32):
            a0 = f32x8_fma(a0, load_row8(k_cache, base + c), load_f32x8(q_row, c))
            a1 = f32x8_fma(a1, load_row8(k_cache, base + c + 8), load_f32x8(q_row, c + 8))
            a2 = f32x8_fma(a2, load_row8(k_cache, base + c + 16), load_f32x8(q_row, c + 16))
            a3 = f32x8_fma(a3, load_row8(k_cache, base + c + 24), load_f32x8(q_row, c + 24))
        return f32x8_hsum_pairs(f32x8_add(f32x8_add(a0, a2), f32x8_add(a1, a3)))
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
    return f32x8_hsum_pairs(f32x8_add(f32x8_add(a0, a2), f32x8_add(a1, a3)))


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
    """work[j] <- the softmax weight of slot j, exp * inv rounded as the cache (what multiplies the values), or
    nan where the exponential is 0: those slots are skipped, as the scalar path skips them."""
    run = work[first:last]
    for i in range(run.shape[0]):
        e = run[i]
        w = like_cache(e * inv, v_cache)
        run[i] = np.float32(np.nan) if e == 0.0 else w


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
                    w = work[j]
                    if w != w:
                        continue
                    ws = f32x8_splat(w)
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
def _row_weights(row, first, last, n_runs, top, e8, v_cache):
    """One row's softmax weights in place of its scores (row: its `capacity` scores), as _attend_vec makes them."""
    capacity = row.shape[0]
    total = 0.0
    for run in range(n_runs):
        a, b = _run_bounds(run, first, last, capacity)
        total += _exp_run_vec(row, a, b, top, e8)
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
def _attend_vec(q, k_cache, v_cache, slot_pos, p, window, scale, t, h, kv, out, work, single):
    """_attend for f16/f32 caches, head_dim % 32 == 0, in vectors. work: as _attend's."""
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
    _row_weights(work[:capacity], first, last, n_runs, top, e8, v_cache)
    work[acc0: acc0 + lanes * head_dim] = 0.0
    for r in range(n_runs):
        a, b = _run_bounds(r, first, last, capacity)
        _weigh_run_vec(v_cache, kv, a, b, lanes, work, work, acc0)
    o = (t * n_heads + h) * head_dim
    if not single:
        _sum_batch_lanes(work, acc0, o, head_dim, out)
        return
    for c in range(0, head_dim, 8):
        r = acc0 + c
        a0, a1 = _lane_pair(work, r, 0, head_dim), _lane_pair(work, r, 1, head_dim)
        a2, a3 = _lane_pair(work, r, 2, head_dim), _lane_pair(work, r, 3, head_dim)
        a4, a5 = _lane_pair(work, r, 4, head_dim), _lane_pair(work, r, 5, head_dim)
        a6, a7 = _lane_pair(work, r, 6, head_dim), _lane_pair(work, r, 7, head_dim)
        sum8 = f32x8_add(f32x8_add(f32x8_add(a0, a4), f32x8_add(a1, a5)),
                         f32x8_add(f32x8_add(a2, a6), f32x8_add(a3, a7)))
        store_f32x8(out, o + c, sum8)


# Prompt processing, several query rows of one head together (llama.cpp's several-row order, LANES_BATCH lanes):
# each key and value row is loaded and converted once for ROWS query rows instead of once per row. Every row keeps
# its own arithmetic: its scores' FMA chains, its mask, max, exponentials, 8-slot group sums and weights, and its
# lanes' slots in the same order. The rows walk the union of their visible slots; a slot another row sees but this
# one does not scores -inf for it and adds exactly nothing (an exponential of 0, a skipped weight), and the union's
# runs visit each row's slots in that row's own order as long as the union fits in the ring (else rows go one by one).
# The loops below are written out for four rows (docs/kernels.md has the speed-up).
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
def _fma4_if(a0, a1, a2, a3, v0, v1, v2, v3, w):
    """a_i + v_i * w for 32 dimensions, or the a_i unchanged where w is nan (a slot this row skips)."""
    if w != w:
        return a0, a1, a2, a3
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
    work[r * capacity + j] * v_j over the slots j in [a, b) it does not skip, each lane's slots in increasing order,
    32 dimensions at a time; in blocks of WEIGH_BLOCK_SLOTS slots (see _weigh_run_vec)."""
    capacity, head_dim = v_cache.shape[1], v_cache.shape[2]
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
                    w0, w1 = work[j], work[capacity + j]
                    w2, w3 = work[2 * capacity + j], work[3 * capacity + j]
                    if w0 != w0 and w1 != w1 and w2 != w2 and w3 != w3:
                        continue
                    base = (kv * capacity + j) * head_dim + dc
                    v0, v1 = load_row8(v_cache, base), load_row8(v_cache, base + 8)
                    v2, v3 = load_row8(v_cache, base + 16), load_row8(v_cache, base + 24)
                    x0, x1, x2, x3 = _fma4_if(x0, x1, x2, x3, v0, v1, v2, v3, w0)
                    y0, y1, y2, y3 = _fma4_if(y0, y1, y2, y3, v0, v1, v2, v3, w1)
                    z0, z1, z2, z3 = _fma4_if(z0, z1, z2, z3, v0, v1, v2, v3, w2)
                    u0, u1, u2, u3 = _fma4_if(u0, u1, u2, u3, v0, v1, v2, v3, w3)
                _store4(acc, r0, x0, x1, x2, x3)
                _store4(acc, r0 + step, y0, y1, y2, y3)
                _store4(acc, r0 + 2 * step, z0, z1, z2, z3)
                _store4(acc, r0 + 3 * step, u0, u1, u2, u3)


@njit(cache=True, error_model="numpy")
def _attend_rows_vec(q, k_cache, v_cache, slot_pos, q_positions, t0, window, scale, h, kv, out, work):
    """_attend_vec (several-row order) for query rows t0 .. t0 + ROWS - 1 of head h together. Returns False, having
    done nothing, where their visible slots do not fit in the ring together (the caller then takes them one by one).
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
        tops = _rows_scores(k_cache, slot_pos, kv, a, b, q_rows, lo, p, scale, work, tops)
    _row_weights(work[0:capacity], first, last, n_runs, tops[0], e8, v_cache)
    _row_weights(work[capacity:2 * capacity], first, last, n_runs, tops[1], e8, v_cache)
    _row_weights(work[2 * capacity:3 * capacity], first, last, n_runs, tops[2], e8, v_cache)
    _row_weights(work[3 * capacity:4 * capacity], first, last, n_runs, tops[3], e8, v_cache)
    work[acc0: q0] = 0.0
    for run in range(n_runs):
        a, b = _run_bounds(run, first, last, capacity)
        _rows_weigh(v_cache, kv, a, b, work, work, acc0)
    for r in range(ROWS):
        _sum_batch_lanes(work, acc0 + r * LANES_BATCH * head_dim, ((t0 + r) * n_heads + h) * head_dim, head_dim,
                         out)
    return True


@njit(cache=True, error_model="numpy", inline="always")
def _attend_item_vec(q, k_cache, v_cache, slot_pos, q_positions, window, scale, item, out, work):
    """Work item `item` of the vector kernels: one query row of one head for a single token, else up to ROWS rows of
    one head (rows in blocks of ROWS; the last partial block, and a block whose slots do not fit the ring together,
    row by row)."""
    n_tokens, n_heads = q.shape[0], q.shape[1]
    group = n_heads // k_cache.shape[0]
    if n_tokens == 1:
        _attend_vec(q, k_cache, v_cache, slot_pos, q_positions[0], window, scale, 0, item, item // group, out, work,
                    True)
        return
    blk, h = item // n_heads, item % n_heads
    t0 = blk * ROWS
    if t0 + ROWS <= n_tokens and _attend_rows_vec(q, k_cache, v_cache, slot_pos, q_positions, t0, window, scale, h,
                                                  h // group, out, work):
        return
    for t in range(t0, min(n_tokens, t0 + ROWS)):
        _attend_vec(q, k_cache, v_cache, slot_pos, q_positions[t], window, scale, t, h, h // group, out, work, False)


@njit(cache=True, error_model="numpy")
def _attention_serial(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out, scratch):
    n_tokens, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[0]
    single = n_tokens == 1
    for th in range(n_tokens * n_heads):
        t, h = th // n_heads, th % n_heads
        _attend(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions[t], window, np.float32(scale), t, h,
                h // group, out, scratch[0], single)


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_parallel(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out,
                        scratch):
    n_tokens, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[0]
    single = n_tokens == 1
    for th in prange(n_tokens * n_heads):
        t, h = th // n_heads, th % n_heads
        _attend(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions[t], window, np.float32(scale), t, h,
                h // group, out, scratch[numba.get_thread_id()], single)


@njit(cache=True, error_model="numpy", inline="always")
def _vec_items(n_tokens, n_heads):
    return n_heads if n_tokens == 1 else (n_tokens + ROWS - 1) // ROWS * n_heads


@njit(cache=True, error_model="numpy")
def _attention_serial_vec(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out,
                          scratch):
    for item in range(_vec_items(q.shape[0], q.shape[1])):
        _attend_item_vec(q, k_cache, v_cache, slot_pos, q_positions, window, np.float32(scale), item, out, scratch[0])


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_parallel_vec(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out,
                            scratch):
    for item in prange(_vec_items(q.shape[0], q.shape[1])):
        _attend_item_vec(q, k_cache, v_cache, slot_pos, q_positions, window, np.float32(scale), item, out,
                         scratch[numba.get_thread_id()])


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_rows_vec(q, k_all, v_all, sp_all, seqs, q_positions, window, scale, out, scratch):
    n_tokens, n_heads, _ = q.shape
    group = n_heads // k_all.shape[1]
    for th in prange(n_tokens * n_heads):
        t, h = th // n_heads, th % n_heads
        s = seqs[t]
        _attend_vec(q, k_all[s], v_all[s], sp_all[s], q_positions[t], window, np.float32(scale), t, h, h // group,
                    out, scratch[numba.get_thread_id()], True)


def attention_rows_supported(stacked, head_dim) -> bool:
    return stacked.k.dtype != np.int8 and head_dim % LANES_SINGLE == 0


def attention_rows(q, stacked, seqs, q_positions, scale, out, scratch):
    """attention() for T independent sequences of one query each (batched decoding): row t attends over sequence
    seqs[t] of `stacked` (a KVPool layer) and gets exactly the bits attention() gives that row alone.
    f16/f32 caches with head_dim a multiple of 32 (attention_rows_supported); out must be C-contiguous."""
    n_tokens, _, head_dim = q.shape
    _check_rows(seqs, q_positions, stacked, n_tokens)
    _check_scratch(scratch, stacked.slot_pos.shape[1], head_dim)
    if not attention_rows_supported(stacked, head_dim) or not out.flags.c_contiguous:
        raise ValueError("attention_rows needs an f16/f32 cache, head_dim % 32 == 0 and a C-contiguous out")
    _attention_rows_vec(q, stacked.k, stacked.v, stacked.slot_pos, seqs, q_positions, stacked.window, scale, out,
                        scratch)


# Below this many multiply-adds the work is shorter than waking the worker threads.
ATTENTION_PARALLEL_MIN_WORK = 1 << 17


def attention_scratch_width(capacity: int, head_dim: int) -> int:
    one_row = capacity + (LANES_SINGLE + 1) * head_dim + LANES_SINGLE
    return max(one_row, ROWS * (capacity + (LANES_BATCH + 1) * head_dim) + 8)


def _check_scratch(scratch, capacity: int, head_dim: int) -> None:
    need = attention_scratch_width(capacity, head_dim)
    if scratch.ndim != 2 or scratch.shape[0] < numba.config.NUMBA_NUM_THREADS or scratch.shape[1] < need:
        raise ValueError(f"attention scratch {scratch.shape} is smaller than {(numba.config.NUMBA_NUM_THREADS, need)}")


def attention_scratch(capacity: int, head_dim: int) -> np.ndarray:
    """The per-thread scratch attention() needs for a cache of this capacity: [threads, width] float32."""
    return np.zeros((numba.config.NUMBA_NUM_THREADS, attention_scratch_width(capacity, head_dim)), np.float32)


def attention(q, k_cache, v_cache, slot_pos, q_positions, window, scale, out, scratch=None, k_scale=NO_SCALES,
              v_scale=NO_SCALES):
    """q: [T, H, head_dim]; k_cache, v_cache: [H_kv, capacity, head_dim]; slot_pos: [capacity] positions;
    q_positions: [T] (their keys already stored); window: 0 for full attention;
    out: [T, H, head_dim]; scratch: attention_scratch(capacity, head_dim) or larger (allocated when None).
    Grouped-query: query head h reads kv head h // (H / H_kv). k_scale, v_scale: a q8_0 cache's scales.
    The cache's values are read in their stored type (edgellm.engine.kvtypes)."""
    n_tokens, n_heads, head_dim = q.shape
    capacity = slot_pos.shape[0]
    if scratch is None:
        scratch = attention_scratch(capacity, head_dim)
    else:
        _check_scratch(scratch, capacity, head_dim)
    span = min(capacity, window if window > 0 else int(q_positions[-1]) + 1)
    parallel = n_tokens * n_heads * head_dim * span >= ATTENTION_PARALLEL_MIN_WORK
    if k_cache.dtype != np.int8 and head_dim % LANES_SINGLE == 0 and out.flags.c_contiguous:
        kernel = _attention_parallel_vec if parallel else _attention_serial_vec
    else:
        kernel = _attention_parallel if parallel else _attention_serial
    kernel(q, k_cache, v_cache, k_scale, v_scale, slot_pos, q_positions, window, scale, out, scratch)


def attention_ref(q, k, v, q_positions, k_positions, window, scale, f16_operands=False):
    """q: [T, H, hd]; k, v: [S, H_kv, hd] with positions k_positions [S]. Dense scores + mask + softmax, float64.
    f16_operands: round q and the softmax weights to float16 first, as llama.cpp (and ops.attention) do with an
    f16 cache."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    if f16_operands:
        q = q.astype(np.float16)
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), k) * scale
    distance = q_positions[:, None] - k_positions[None, :]
    visible = distance >= 0
    if window > 0:
        visible &= distance < window
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    if f16_operands:
        probs = probs.astype(np.float16).astype(np.float64)
    return np.einsum("hts,shd->thd", probs, v).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Gated feed-forward activations: gate <- act(gate) * up, in place (llama.cpp's LLM_FFN_PAR).


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


def silu_mul_ref(gate, up):
    g = gate.astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * up).astype(np.float32)


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


def gelu_tanh_mul_ref(gate, up):
    g = gate.astype(np.float64)
    return (0.5 * g * (1.0 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * up).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Softcap: cap * tanh(x / cap) (Gemma 2's final logits; its attention scores: engine/softcap_attention.py), as
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

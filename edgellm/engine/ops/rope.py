"""Rotary position embedding: the angle tables (with linear, per-pair and YaRN scaling) and the rotation, in
llama.cpp's float32 arithmetic, beside a complex-number reference.

Pair i at position p turns by p * inv_freq[i], with inv_freq[i] = freq_scale * base^(-2i / n_rot) / factor[i] (see
rope_inv_freq, which the references use). The kernels compute the angles as llama.cpp does, in float32:
theta_scale = base^(-2 / n_rot), and the angle of pair i is p * theta_scale^i by repeated multiplication (then
/ factor[i], * freq_scale), cos and sin in float32. "normal" ordering (llama in llama.cpp) rotates adjacent pairs
(x[2i], x[2i+1]); NeoX ordering (qwen2, qwen3, gemma3) rotates (x[i], x[i + n_rot/2]). Dimensions past n_rot pass
through. YaRN (ext_factor 1) blends, per pair, the interpolated angle (* freq_scale) with the extrapolated one
(unscaled) by a ramp over the pairs between the correction dims [low, high] (ggml_rope_yarn_corr_dims), and
multiplies cos and sin by mscale = attn_factor * (1 + 0.1 ln(1 / freq_scale)) (ggml-cpu's rope_yarn).
"""

import math

import numpy as np
from numba import njit

from edgellm.quant.simd import fma32

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

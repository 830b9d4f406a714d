"""Numpy reference quantizers for the K-quant formats (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K).

They follow llama.cpp's `quantize_row_q*_K_ref` (ggml/src/ggml-quants.c), the ones llama-quantize runs when no
importance matrix is given, scale search included:
  make_qkx2_quants  (Q2_K, Q4_K, Q5_K)  scale and min by a grid search of least-squares fits
  make_q3_quants    (Q3_K)              signed scale refined by coordinate descent on the quants
  make_qx_quants    (Q6_K)              signed scale chosen among 19 candidates by weighted fit
then the per-block super-scale (6- or 4-bit quantized sub-block scales) and a final requantization of every
value against the rounded scales.

Sections: shared arithmetic; the three scale searches; one quantizer per format; the public `quantize_k`.

Every step is float32 in C's operation order, and every running sum is sequential (np.cumsum, never the
pairwise np.sum), so the result equals a build of ggml-quants.c without FMA contraction bit for bit; a build
that contracts `a*b + c` into FMAs (gcc -march=native) can differ in the last bit of a sum and, rarely, pick
another scale. Vectorised over sub-blocks: each search step runs over all of a tensor's sub-blocks at once.
The Numba kernels in quant.quantize_kernels are checked against this module.
"""

from __future__ import annotations

import numpy as np

from .formats import QK_K, format_by_name
from .registry import Q8_K, kernels_for, records

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)  # below this a group counts as all zero (ggml-quants.c)

# ---------------------------------------------------------------------------------------------------------
# shared arithmetic


def nearest_int(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """ggml's nearest_int (round half to even) clamped to [lo, hi]; clamping first keeps NaN/inf harmless
    and gives the same integers, since rounding is monotonic and the bounds are integers."""
    with np.errstate(invalid="ignore"):
        return np.rint(np.clip(np.nan_to_num(v, nan=0.0), lo, hi)).astype(np.int32)


def seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis in order, as a C loop `s += a[i]` does in float32."""
    return np.cumsum(a, axis=-1, dtype=F32)[..., -1]


def to_f16(v: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16: round to nearest even half (numpy's conversion is the same)."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=F32).astype(np.float16)


def _first_absmax(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude in each row, the first one on ties (C's `if (ax > amax)` scan)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[:, None], axis=-1)[:, 0]


def _safe_div(a, b):
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return (a / b).astype(F32)


def _pack_crumbs(L: np.ndarray) -> np.ndarray:
    """(n, 256) 2-bit values -> (n, 64) bytes: byte h*32 + l holds L[h*128 + k*32 + l] in bits 2k..2k+1."""
    Lr = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (Lr[:, :, 0] | Lr[:, :, 1] << 2 | Lr[:, :, 2] << 4 | Lr[:, :, 3] << 6).reshape(-1, 64)


def _pack_nibbles_k(L: np.ndarray) -> np.ndarray:
    """(n, 256) 4-bit values -> (n, 128): byte t*32 + l holds L[64t + l] low, L[64t + 32 + l] high."""
    Lr = L.reshape(-1, 4, 2, 32).astype(np.uint8)
    return (Lr[:, :, 0] | Lr[:, :, 1] << 4).reshape(-1, 128)


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> the 12 packed bytes of Q4_K / Q5_K (inverse of get_scale_min_k4)."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    return np.concatenate([ls[:, :4] | (ls[:, 4:] >> 4) << 6,
                           lm[:, :4] | (lm[:, 4:] >> 4) << 6,
                           (ls[:, 4:] & 0xF) | (lm[:, 4:] & 0xF) << 4], axis=-1)


# ---------------------------------------------------------------------------------------------------------
# the scale searches, each over rows of x (n_groups, group_size)


def make_qkx2_quants(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """Unsigned quants L in [0, nmax] with x ~ scale * L - the_min; returns (scale, the_min, L).

    Starts from the min/max fit, then tries nstep + 1 grid points of the inverse scale, each followed by a
    weighted least-squares fit of scale and min; keeps whichever has the smallest weighted error. `min` is
    updated as better fits are found and later grid points use the updated value, as in C."""
    nmax_f = F32(nmax)
    sum_w, sum_x = seq_sum(w), seq_sum(w * x)
    mn = np.minimum(x.min(axis=-1), F32(0))
    mx = x.max(axis=-1)
    flat = mx == mn

    def weighted_error(scale, m, L):
        diff = (scale[:, None] * L.astype(F32) + m[:, None]) - x
        return seq_sum(w * (np.abs(diff) if use_mad else diff * diff))

    iscale = _safe_div(nmax_f, mx - mn)
    scale = _safe_div(F32(1), iscale)
    L = nearest_int(iscale[:, None] * (x - mn[:, None]), 0, nmax)
    best_error = weighted_error(scale, mn, L)
    for step in range(nstep + 1):
        iscale = _safe_div(F32(rmin) + F32(rdelta) * F32(step) + nmax_f, mx - mn)
        Laux = nearest_int(iscale[:, None] * (x - mn[:, None]), 0, nmax)
        lf = Laux.astype(F32)
        wl = w * lf
        sum_l, sum_l2, sum_xl = seq_sum(wl), seq_sum(wl * lf), seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = _safe_div(sum_w * sum_xl - sum_x * sum_l, D)
        this_min = _safe_div(sum_l2 * sum_x - sum_l * sum_xl, D)
        positive_min = this_min > 0
        this_min = np.where(positive_min, F32(0), this_min)
        this_scale = np.where(positive_min, _safe_div(sum_xl, sum_l2), this_scale)
        with np.errstate(invalid="ignore", over="ignore"):
            cur_error = weighted_error(this_scale, this_min, Laux)
            better = (D > 0) & (cur_error < best_error)
        best_error = np.where(better, cur_error, best_error)
        L = np.where(better[:, None], Laux, L)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, F32(0), scale).astype(F32)
    L = np.where(flat[:, None], 0, L)
    return scale, (-mn).astype(F32), L


def make_qx_quants_rmse1(x, nmax: int):
    """Signed quants for Q6_K (rmse_type 1, weights x^2): returns (scale, L + nmax in [0, 2*nmax - 1])."""
    nmax_f = F32(nmax)
    amax_value = _first_absmax(x)
    zero = np.abs(amax_value) < GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def fit(iscale):
        l = nearest_int(iscale[:, None] * x, -nmax, nmax - 1)
        lf = l.astype(F32)
        return l, seq_sum(wx * lf), seq_sum(w * lf * lf)

    L, sumlx, suml2 = fit(_safe_div(-nmax_f, amax_value))
    scale = np.where(suml2 != 0, _safe_div(sumlx, suml2), F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        l, slx, sl2 = fit(_safe_div(-(nmax_f + F32(0.1) * F32(step)), amax_value))
        with np.errstate(over="ignore", invalid="ignore"):
            better = (sl2 > 0) & (slx * slx > best * sl2)
        L = np.where(better[:, None], l, L)
        scale = np.where(better, _safe_div(slx, sl2), scale)
        best = np.where(better, scale * slx, best)
    scale = np.where(zero, F32(0), scale).astype(F32)
    L = np.where(zero[:, None], 0, L + nmax)
    return scale, L


def make_q3_quants_rmse(x, nmax: int):
    """Signed quants for Q3_K: start from the max fit, then up to 5 sweeps of coordinate descent that move
    one quant at a time when that improves the weighted fit (weights x^2). Returns (scale, L + nmax)."""
    amax_value = _first_absmax(x)
    zero = np.abs(amax_value) < GROUP_MAX_EPS
    w = x * x
    wx = w * x
    L = nearest_int(_safe_div(-F32(nmax), amax_value)[:, None] * x, -nmax, nmax - 1)
    lf = L.astype(F32)
    sumlx, suml2 = seq_sum(wx * lf), seq_sum(w * lf * lf)
    # Sweeps are sequential within a group but independent across groups. A group whose sweep changed
    # nothing would change nothing on the next one either, so running all 5 sweeps everywhere equals C's
    # early exit.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for _ in range(5):
            for i in range(x.shape[1]):
                xi, wi, wxi, li = x[:, i], w[:, i], wx[:, i], L[:, i].astype(F32)
                slx = sumlx - wxi * li
                sl2 = suml2 - wi * li * li
                new_l = nearest_int(xi * sl2 / slx, -nmax, nmax - 1)
                nf = new_l.astype(F32)
                slx_new = slx + wxi * nf
                sl2_new = sl2 + wi * nf * nf
                accept = ((slx > 0) & (new_l != L[:, i]) & (sl2_new > 0)
                          & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
                L[:, i] = np.where(accept, new_l, L[:, i])
                sumlx = np.where(accept, slx_new, sumlx)
                suml2 = np.where(accept, sl2_new, suml2)
    scale = np.where(suml2 > 0, _safe_div(sumlx, suml2), F32(0))
    scale = np.where(zero, F32(0), scale).astype(F32)
    L = np.where(zero[:, None], 0, L + nmax)
    return scale, L


# ---------------------------------------------------------------------------------------------------------
# one quantizer per format: x float32 (n_blocks, 256) -> (n_blocks,) structured blocks


def _requantize(x, d, dm, L, lo: int, hi: int, offset: int = 0):
    """Final pass: every value against its rounded sub-block scale d (and min dm, if any), stored + offset;
    sub-blocks whose scale rounded to zero keep the quants of the search (C's `if (!d) continue`)."""
    xs = x.reshape(x.shape[0], d.shape[1], -1)
    if dm is not None:
        xs = xs + dm[:, :, None]
    q = nearest_int(_safe_div(xs, d[:, :, None]), lo, hi) + offset
    return np.where((d != 0)[:, :, None], q, L.reshape(q.shape)).reshape(x.shape[0], -1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    xs = x.reshape(n * 16, 16)
    scales, mins, L = make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins = scales.reshape(n, 16), mins.reshape(n, 16)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    q4scale = F32(15)
    ls = np.where(max_scale[:, None] > 0, nearest_int(_safe_div(q4scale, max_scale)[:, None] * scales, -2**20, 2**20), 0)
    lm = np.where(max_min[:, None] > 0, nearest_int(_safe_div(q4scale, max_min)[:, None] * mins, -2**20, 2**20), 0)
    packed = ((ls & 0xFF) | ((lm << 4) & 0xFF)).astype(np.uint8)  # C stores ints into uint8: wraps
    d16 = to_f16(np.where(max_scale > 0, max_scale / q4scale, F32(0)))
    dmin16 = to_f16(np.where(max_min > 0, max_min / q4scale, F32(0)))
    d = d16.astype(F32)[:, None] * (packed & 0xF).astype(F32)
    dm = dmin16.astype(F32)[:, None] * (packed >> 4).astype(F32)
    L = _requantize(x, d, dm, L, 0, 3)
    out = np.zeros(n, dtype=format_by_name("Q2_K").block_dtype)
    out["scales"], out["qs"], out["d"], out["dmin"] = packed, _pack_crumbs(L), d16, dmin16
    return out


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    scales, L = make_q3_quants_rmse(x.reshape(n * 16, 16), 4)
    scales = scales.reshape(n, 16)
    max_scale = _first_absmax(scales)  # signed; 0 when every scale is 0
    has_scale = max_scale != 0
    iscale = _safe_div(F32(-32), max_scale)
    ls = np.where(has_scale[:, None], nearest_int(iscale[:, None] * scales, -32, 31) + 32, 32)
    low = (ls & 0xF).astype(np.uint8)
    high = (ls >> 4).astype(np.uint8).reshape(n, 4, 4)  # [j // 4, j % 4]
    packed = np.zeros((n, 12), dtype=np.uint8)
    packed[:, :8] = low[:, :8] | low[:, 8:] << 4
    packed[:, 8:] = high[:, 0] | high[:, 1] << 2 | high[:, 2] << 4 | high[:, 3] << 6
    packed = np.where(has_scale[:, None], packed, 0)
    d16 = to_f16(np.where(has_scale, _safe_div(F32(1), iscale), F32(0)))
    d = d16.astype(F32)[:, None] * np.where(has_scale[:, None], ls - 32, 0).astype(F32)
    L = _requantize(x, d, None, L, -4, 3, offset=4)
    high_bits = (L > 3).reshape(n, 8, 32)  # element 32*b + m: bit b of hmask[m]
    out = np.zeros(n, dtype=format_by_name("Q3_K").block_dtype)
    out["hmask"] = np.packbits(high_bits.transpose(0, 2, 1), axis=-1, bitorder="little").reshape(n, 32)
    out["qs"] = _pack_crumbs(np.where(L > 3, L - 4, L))
    out["scales"], out["d"] = packed, d16
    return out


def _quantize_q45_k(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """The shared part of Q4_K (nmax 15) and Q5_K (nmax 31): 8 sub-blocks of 32 with 6-bit scale and min."""
    n = x.shape[0]
    xs = x.reshape(n * 8, 32)
    av_x = np.sqrt(seq_sum(xs * xs) / F32(32))
    scales, mins, L = make_qkx2_quants(xs, av_x[:, None] + np.abs(xs), nmax, rmin, 0.1, nstep, use_mad=False)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    inv_scale = np.where(max_scale > 0, _safe_div(F32(63), max_scale), F32(0))
    inv_min = np.where(max_min > 0, _safe_div(F32(63), max_min), F32(0))
    # C: uint8_t ls = nearest_int(...) wraps, then MIN(63, ls)
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales, -2**20, 2**20) & 0xFF, 63)
    lm = np.minimum(nearest_int(inv_min[:, None] * mins, -2**20, 2**20) & 0xFF, 63)
    d16, dmin16 = to_f16(max_scale / F32(63)), to_f16(max_min / F32(63))
    d = d16.astype(F32)[:, None] * ls.astype(F32)
    dm = dmin16.astype(F32)[:, None] * lm.astype(F32)
    return _requantize(x, d, dm, L, 0, nmax), _pack_scale_min_k4(ls, lm), d16, dmin16


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    L, packed, d16, dmin16 = _quantize_q45_k(x, 15, -1.0, 20)
    out = np.zeros(x.shape[0], dtype=format_by_name("Q4_K").block_dtype)
    out["d"], out["dmin"], out["scales"], out["qs"] = d16, dmin16, packed, _pack_nibbles_k(L)
    return out


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    L, packed, d16, dmin16 = _quantize_q45_k(x, 31, -0.5, 15)
    high = (L >> 4).reshape(-1, 8, 32)  # sub-block k's fifth bits go to bit k of qh[l]
    out = np.zeros(x.shape[0], dtype=format_by_name("Q5_K").block_dtype)
    out["d"], out["dmin"], out["scales"] = d16, dmin16, packed
    out["qh"] = np.packbits(high.transpose(0, 2, 1).astype(np.uint8), axis=-1, bitorder="little").reshape(-1, 32)
    out["qs"] = _pack_nibbles_k(L & 0xF)
    return out


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    scales, L = make_qx_quants_rmse1(x.reshape(n * 16, 16), 32)
    scales = scales.reshape(n, 16)
    max_scale = _first_absmax(scales)
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = _safe_div(F32(-128), max_scale)
    sc = np.minimum(nearest_int(iscale[:, None] * scales, -128, 2**20), 127).astype(np.int8)
    d16 = to_f16(_safe_div(F32(1), iscale))
    d = d16.astype(F32)[:, None] * sc.astype(F32)
    L = _requantize(x, d, None, L, -32, 31, offset=32)
    Lr = L.reshape(n, 2, 4, 32).astype(np.uint8)
    ql = np.stack([Lr[:, :, 0] & 0xF | (Lr[:, :, 2] & 0xF) << 4, Lr[:, :, 1] & 0xF | (Lr[:, :, 3] & 0xF) << 4], axis=2)
    qh = Lr[:, :, 0] >> 4 | (Lr[:, :, 1] >> 4) << 2 | (Lr[:, :, 2] >> 4) << 4 | (Lr[:, :, 3] >> 4) << 6
    out = np.zeros(n, dtype=format_by_name("Q6_K").block_dtype)
    out["ql"], out["qh"], out["scales"], out["d"] = ql.reshape(n, 128), qh.reshape(n, 64), sc, d16
    out[zero] = np.zeros(1, dtype=out.dtype)  # an all-zero block is written as zeros
    return out


def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    amax_value = _first_absmax(x)
    zero = amax_value == 0
    iscale = _safe_div(F32(-127), amax_value)
    q = np.minimum(nearest_int(iscale[:, None] * x, -2**20, 2**20), 127)
    q = np.where(zero[:, None], 0, q).astype(np.int8)
    out = np.zeros(x.shape[0], dtype=format_by_name("Q8_K").block_dtype)
    out["d"] = np.where(zero, F32(0), _safe_div(F32(1), iscale))
    out["qs"] = q
    out["bsums"] = q.reshape(-1, 16, 16).sum(axis=-1, dtype=np.int32).astype(np.int16)
    return out


def quantize_k(x, ggml_type) -> np.ndarray:
    """float32 array (..., n), n a multiple of 256 -> uint8 array (..., bytes per row) of K-quant blocks."""
    fmt = format_by_name(ggml_type)
    k_quants = [r.name for r in records(Q8_K)]
    if fmt.name not in k_quants:
        raise ValueError(f"{fmt.name} is not a K-quant format; K-quants: {', '.join(k_quants)}")
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"{fmt.name} needs rows that are a multiple of {QK_K} elements, got shape {x.shape}")
    shape = x.shape
    blocks = np.ascontiguousarray(x, dtype=F32).reshape(-1, QK_K)
    # inf/NaN appear in the search for degenerate groups exactly as in C, and are masked out there
    with np.errstate(all="ignore"):
        out = kernels_for(fmt).reference_quantizer()(blocks) if blocks.shape[0] else np.zeros(0, fmt.block_dtype)
    return out.view(np.uint8).reshape(*shape[:-1], fmt.row_bytes(shape[-1]))

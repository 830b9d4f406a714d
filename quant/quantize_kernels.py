"""Numba quantizers, bit-exact with the numpy references, and `quantize_fast`, the one entry point that
edgellm.prep.quantize uses.

Sections: scalar helpers (rounding, half floats); the three scale searches; one block kernel per K-quant;
block kernels for the 32-element formats; `quantize_fast`. The parallel drivers that run the block kernels,
`quantize_blocks_<fmt>`, are generated into quant.quantize_blocks (tools/gen_kernels.py).

Each kernel repeats its reference's float32 operations in the same order (quant.kquants_quantize for the
K-quants, quant.reference for Q4_0 ... Q8_0, which is bit-exact with gguf-py): every literal is a float32,
every int is converted to float32 before it meets a float (Numba would otherwise promote to float64), sums
run in element order, and there is no fastmath, so LLVM never contracts `a*b + c` into an FMA.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .formats import format_by_name
from .half_bits import _f16_bits, _put_u16  # noqa: F401  (shared with the IQ4 quantizers)
from .registry import kernels_for

F32 = np.float32
GROUP_MAX_EPS = np.float32(1e-15)

# ---------------------------------------------------------------------------------------------------------
# scalar helpers


@njit(cache=True, inline="always")
def _nearest_int(v, lo, hi):
    """ggml's nearest_int (round half to even) clamped to [lo, hi]; NaN counts as 0 (see the reference)."""
    if v != v:
        v = np.float32(0.0)
    if v < lo:
        v = np.float32(lo)
    if v > hi:
        v = np.float32(hi)
    return int(np.rint(v))


@njit(cache=True)
def _f16_value(bits):
    """IEEE half bits -> float32 value."""
    e = (bits >> 10) & 0x1F
    m = bits & 0x3FF
    if e == 0:
        val = math.ldexp(np.float64(m), -24)
    elif e == 31:
        val = math.inf if m == 0 else math.nan
    else:
        val = math.ldexp(np.float64(1024 + m), e - 25)
    return np.float32(-val if bits & 0x8000 else val)


# ---------------------------------------------------------------------------------------------------------
# scale searches (see quant.kquants_quantize for what each does); the group is x[o : o + n]


@njit(cache=True)
def _make_qkx2(x, o, n, w, L, Laux, nmax, rmin, rdelta, nstep, use_mad):
    """Returns (scale, the_min); L[:n] gets quants in [0, nmax]."""
    mn = x[o]
    mx = x[o]
    sum_w = w[0]
    sum_x = sum_w * x[o]
    for i in range(1, n):
        xi = x[o + i]
        if xi < mn:
            mn = xi
        if xi > mx:
            mx = xi
        sum_w += w[i]
        sum_x += w[i] * xi
    if mn > 0:
        mn = np.float32(0.0)
    if mx == mn:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0), -mn
    nmax_f = np.float32(nmax)
    iscale = nmax_f / (mx - mn)
    scale = np.float32(1.0) / iscale
    best_error = np.float32(0.0)
    for i in range(n):
        l = _nearest_int(iscale * (x[o + i] - mn), 0, nmax)
        L[i] = l
        diff = scale * np.float32(l) + mn - x[o + i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += w[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + nmax_f) / (mx - mn)
        sum_l = np.float32(0.0)
        sum_l2 = np.float32(0.0)
        sum_xl = np.float32(0.0)
        for i in range(n):
            l = _nearest_int(iscale * (x[o + i] - mn), 0, nmax)
            Laux[i] = l
            lf = np.float32(l)
            wl = w[i] * lf
            sum_l += wl
            sum_l2 += wl * lf
            sum_xl += wl * x[o + i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = np.float32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = np.float32(0.0)
            for i in range(n):
                diff = this_scale * np.float32(Laux[i]) + this_min - x[o + i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += w[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(cache=True)
def _first_absmax(x, o, n):
    amax = np.float32(0.0)
    value = np.float32(0.0)
    for i in range(n):
        ax = abs(x[o + i])
        if ax > amax:
            amax = ax
            value = x[o + i]
    return value


@njit(cache=True)
def _qx_fit(x, o, n, iscale, nmax):
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        xi = x[o + i]
        lf = np.float32(_nearest_int(iscale * xi, -nmax, nmax - 1))
        w = xi * xi
        sumlx += w * xi * lf
        suml2 += w * lf * lf
    return sumlx, suml2


@njit(cache=True)
def _qx_store(x, o, n, iscale, nmax, L):
    for i in range(n):
        L[i] = nmax + _nearest_int(iscale * x[o + i], -nmax, nmax - 1)


@njit(cache=True)
def _make_qx_rmse1(x, o, n, nmax, L):
    """Q6_K's make_qx_quants(rmse_type=1, no weights): returns scale; L[:n] gets quants + nmax."""
    vmax = _first_absmax(x, o, n)
    if abs(vmax) < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    nmax_f = np.float32(nmax)
    iscale = -nmax_f / vmax
    _qx_store(x, o, n, iscale, nmax, L)
    sumlx, suml2 = _qx_fit(x, o, n, iscale, nmax)
    scale = sumlx / suml2 if suml2 != 0 else np.float32(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(nmax_f + np.float32(0.1) * np.float32(step)) / vmax
        sumlx, suml2 = _qx_fit(x, o, n, iscale, nmax)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            _qx_store(x, o, n, iscale, nmax, L)
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True)
def _make_q3_rmse(x, o, n, nmax, L):
    """Q3_K's make_q3_quants(do_rmse=true): returns scale; L[:n] gets quants + nmax."""
    vmax = _first_absmax(x, o, n)
    if abs(vmax) < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    iscale = -np.float32(nmax) / vmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        xi = x[o + i]
        l = _nearest_int(iscale * xi, -nmax, nmax - 1)
        L[i] = l
        lf = np.float32(l)
        w = xi * xi
        sumlx += w * xi * lf
        suml2 += w * lf * lf
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            xi = x[o + i]
            w = xi * xi
            li = np.float32(L[i])
            slx = sumlx - w * xi * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = _nearest_int(xi * sl2 / slx, -nmax, nmax - 1)
                if new_l != L[i]:
                    nf = np.float32(new_l)
                    slx += w * xi * nf
                    sl2 += w * nf * nf
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else np.float32(0.0)


# ---------------------------------------------------------------------------------------------------------
# K-quant block kernels: x (256,) float32 -> out (type_size,) uint8


@njit(cache=True)
def _requantize(x, L, d, dm, o, n, lo, hi, offset):
    """Sub-block x[o:o+n] against its rounded scale d (and min dm); kept as searched when d is 0."""
    if d == 0:
        return
    for i in range(n):
        L[o + i] = offset + _nearest_int((x[o + i] + dm) / d, lo, hi)


@njit(cache=True)
def _requantize_nomin(x, L, d, o, n, lo, hi, offset):
    if d == 0:
        return
    for i in range(n):
        L[o + i] = offset + _nearest_int(x[o + i] / d, lo, hi)


@njit(cache=True)
def _pack_crumbs(L, out, o):
    for h in range(2):
        for l in range(32):
            b = h * 128 + l
            out[o + h * 32 + l] = L[b] | (L[b + 32] << 2) | (L[b + 64] << 4) | (L[b + 96] << 6)


@njit(cache=True)
def quantize_block_q2_k(x, out, L, Laux, w, scales, mins, packed):
    for j in range(16):
        for l in range(16):
            w[l] = abs(x[16 * j + l])
        scales[j], mins[j] = _make_qkx2(x, 16 * j, 16, w, L[16 * j:], Laux, 3,
                                        np.float32(-0.5), np.float32(0.1), 15, True)
    max_scale = np.float32(0.0)
    max_min = np.float32(0.0)
    for j in range(16):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    q4scale = np.float32(15.0)
    d_bits = 0
    dmin_bits = 0
    for j in range(16):
        packed[j] = 0
    if max_scale > 0:
        iscale = q4scale / max_scale
        for j in range(16):
            packed[j] = _nearest_int(iscale * scales[j], -(1 << 20), 1 << 20) & 0xFF  # C stores an int in a byte
        d_bits = _f16_bits(max_scale / q4scale)
    if max_min > 0:
        iscale = q4scale / max_min
        for j in range(16):
            packed[j] |= (_nearest_int(iscale * mins[j], -(1 << 20), 1 << 20) << 4) & 0xFF
        dmin_bits = _f16_bits(max_min / q4scale)
    d_all = _f16_value(d_bits)
    dmin_all = _f16_value(dmin_bits)
    for j in range(16):
        out[j] = packed[j]
        d = d_all * np.float32(packed[j] & 0xF)
        dm = dmin_all * np.float32(packed[j] >> 4)
        _requantize(x, L, d, dm, 16 * j, 16, 0, 3, 0)
    _pack_crumbs(L, out, 16)
    _put_u16(out, 80, d_bits)
    _put_u16(out, 82, dmin_bits)


@njit(cache=True)
def quantize_block_q3_k(x, out, L, Laux, w, scales, mins, ls):
    max_scale = np.float32(0.0)
    amax = np.float32(0.0)
    for j in range(16):
        scales[j] = _make_q3_rmse(x, 16 * j, 16, 4, L[16 * j:])
        s = abs(scales[j])
        if s > amax:
            amax = s
            max_scale = scales[j]
    for k in range(96, 108):
        out[k] = 0
    d_bits = 0
    for j in range(16):
        ls[j] = 0  # an all-zero block stores zero scales (and d = 0, so nothing is requantized)
    if max_scale != 0:
        iscale = np.float32(-32.0) / max_scale
        for j in range(16):
            ls[j] = _nearest_int(iscale * scales[j], -32, 31) + 32
        for j in range(8):
            out[96 + j] = (ls[j] & 0xF) | ((ls[j + 8] & 0xF) << 4)
        for m in range(4):
            out[104 + m] = ((ls[m] >> 4) | ((ls[m + 4] >> 4) << 2) | ((ls[m + 8] >> 4) << 4)
                            | ((ls[m + 12] >> 4) << 6))
        d_bits = _f16_bits(np.float32(1.0) / iscale)
    d_all = _f16_value(d_bits)
    for j in range(16):
        _requantize_nomin(x, L, d_all * np.float32(ls[j] - 32), 16 * j, 16, -4, 3, 4)
    for m in range(32):
        bits = 0
        for b in range(8):
            if L[32 * b + m] > 3:
                bits |= 1 << b
                L[32 * b + m] -= 4
        out[m] = bits
    _pack_crumbs(L, out, 32)
    _put_u16(out, 108, d_bits)


@njit(cache=True)
def _q45_k_search(x, out, L, Laux, w, scales, mins, nmax, rmin, nstep):
    """Shared by Q4_K and Q5_K: fills L (0..nmax) and the header: d, dmin at 0..3, scales at 4..15."""
    max_scale = np.float32(0.0)
    max_min = np.float32(0.0)
    for j in range(8):
        sum_x2 = np.float32(0.0)
        for l in range(32):
            sum_x2 += x[32 * j + l] * x[32 * j + l]
        av_x = np.sqrt(sum_x2 / np.float32(32.0))
        for l in range(32):
            w[l] = av_x + abs(x[32 * j + l])
        scales[j], mins[j] = _make_qkx2(x, 32 * j, 32, w, L[32 * j:], Laux, nmax,
                                        rmin, np.float32(0.1), nstep, False)
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = np.float32(63.0) / max_scale if max_scale > 0 else np.float32(0.0)
    inv_min = np.float32(63.0) / max_min if max_min > 0 else np.float32(0.0)
    d_bits = _f16_bits(max_scale / np.float32(63.0))
    dmin_bits = _f16_bits(max_min / np.float32(63.0))
    d_all = _f16_value(d_bits)
    dmin_all = _f16_value(dmin_bits)
    for j in range(8):
        ls = min(63, _nearest_int(inv_scale * scales[j], -(1 << 20), 1 << 20) & 0xFF)
        lm = min(63, _nearest_int(inv_min * mins[j], -(1 << 20), 1 << 20) & 0xFF)
        if j < 4:
            out[4 + j] = ls
            out[4 + j + 4] = lm
        else:
            out[4 + j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            out[4 + j - 4] |= (ls >> 4) << 6
            out[4 + j] |= (lm >> 4) << 6
        _requantize(x, L, d_all * np.float32(ls), dmin_all * np.float32(lm), 32 * j, 32, 0, nmax, 0)
    _put_u16(out, 0, d_bits)
    _put_u16(out, 2, dmin_bits)


@njit(cache=True)
def quantize_block_q4_k(x, out, L, Laux, w, scales, mins, ints):
    _q45_k_search(x, out, L, Laux, w, scales, mins, 15, np.float32(-1.0), 20)
    for t in range(4):
        for l in range(32):
            out[16 + 32 * t + l] = L[64 * t + l] | (L[64 * t + 32 + l] << 4)


@njit(cache=True)
def quantize_block_q5_k(x, out, L, Laux, w, scales, mins, ints):
    _q45_k_search(x, out, L, Laux, w, scales, mins, 31, np.float32(-0.5), 15)
    for l in range(32):
        bits = 0
        for k in range(8):
            bits |= (L[32 * k + l] >> 4) << k
        out[16 + l] = bits
    for t in range(4):
        for l in range(32):
            out[48 + 32 * t + l] = (L[64 * t + l] & 0xF) | ((L[64 * t + 32 + l] & 0xF) << 4)


@njit(cache=True)
def quantize_block_q6_k(x, out, L, Laux, w, scales, mins, ints):
    max_scale = np.float32(0.0)
    max_abs_scale = np.float32(0.0)
    for j in range(16):
        scales[j] = _make_qx_rmse1(x, 16 * j, 16, 32, L[16 * j:])
        if abs(scales[j]) > max_abs_scale:
            max_abs_scale = abs(scales[j])
            max_scale = scales[j]
    if max_abs_scale < GROUP_MAX_EPS:
        for k in range(210):
            out[k] = 0
        return
    iscale = np.float32(-128.0) / max_scale
    d_bits = _f16_bits(np.float32(1.0) / iscale)
    d_all = _f16_value(d_bits)
    for j in range(16):
        sc = min(127, _nearest_int(iscale * scales[j], -128, 1 << 20))
        out[192 + j] = sc & 0xFF
        _requantize_nomin(x, L, d_all * np.float32(sc), 16 * j, 16, -32, 31, 32)
    for h in range(2):
        for l in range(32):
            b = 128 * h + l
            out[64 * h + l] = (L[b] & 0xF) | ((L[b + 64] & 0xF) << 4)
            out[64 * h + l + 32] = (L[b + 32] & 0xF) | ((L[b + 96] & 0xF) << 4)
            out[128 + 32 * h + l] = ((L[b] >> 4) | ((L[b + 32] >> 4) << 2)
                                     | ((L[b + 64] >> 4) << 4) | ((L[b + 96] >> 4) << 6))
    _put_u16(out, 208, d_bits)


# ---------------------------------------------------------------------------------------------------------
# 32-element block kernels, the operations of quant.reference's quantize_q*


@njit(cache=True, inline="always")
def _reciprocal_or_zero(d):
    return np.float32(1.0) / d if d != 0 else np.float32(0.0)


@njit(cache=True)
def quantize_block_q4_0(x, out, q):
    vmax = _first_absmax(x, 0, 32)
    d = vmax / np.float32(-8.0)
    inv = _reciprocal_or_zero(d)
    _put_u16(out, 0, _f16_bits(d))
    for j in range(16):
        lo = min(15, max(0, int(x[j] * inv + np.float32(8.5))))
        hi = min(15, max(0, int(x[j + 16] * inv + np.float32(8.5))))
        out[2 + j] = lo | (hi << 4)


@njit(cache=True)
def _min_max(x):
    lo = x[0]
    hi = x[0]
    for i in range(1, x.shape[0]):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
    return lo, hi


@njit(cache=True)
def quantize_block_q4_1(x, out, q):
    lo, hi = _min_max(x)
    d = (hi - lo) / np.float32(15.0)
    inv = _reciprocal_or_zero(d)
    _put_u16(out, 0, _f16_bits(d))
    _put_u16(out, 2, _f16_bits(lo))
    for j in range(16):
        a = min(15, max(0, int((x[j] - lo) * inv + np.float32(0.5))))
        b = min(15, max(0, int((x[j + 16] - lo) * inv + np.float32(0.5))))
        out[4 + j] = a | (b << 4)


@njit(cache=True)
def _put_q5(out, o_qh, o_qs, q):
    qh = 0
    for j in range(16):
        out[o_qs + j] = (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)
    for j in range(32):
        qh |= (q[j] >> 4) << j
    for k in range(4):
        out[o_qh + k] = (qh >> (8 * k)) & 0xFF


@njit(cache=True)
def quantize_block_q5_0(x, out, q):
    vmax = _first_absmax(x, 0, 32)
    d = vmax / np.float32(-16.0)
    inv = _reciprocal_or_zero(d)
    _put_u16(out, 0, _f16_bits(d))
    for j in range(32):
        q[j] = min(31, max(0, int(x[j] * inv + np.float32(16.5))))
    _put_q5(out, 2, 6, q)


@njit(cache=True)
def quantize_block_q5_1(x, out, q):
    lo, hi = _min_max(x)
    d = (hi - lo) / np.float32(31.0)
    inv = _reciprocal_or_zero(d)
    _put_u16(out, 0, _f16_bits(d))
    _put_u16(out, 2, _f16_bits(lo))
    for j in range(32):
        q[j] = min(31, max(0, int((x[j] - lo) * inv + np.float32(0.5))))
    _put_q5(out, 4, 8, q)


@njit(cache=True)
def quantize_block_q8_0(x, out, q):
    amax = np.float32(0.0)
    for j in range(32):
        amax = max(amax, abs(x[j]))
    d = amax / np.float32(127.0)
    inv = _reciprocal_or_zero(d)
    _put_u16(out, 0, _f16_bits(d))
    for j in range(32):
        v = x[j] * inv  # roundf: half away from zero, as the reference's _round_half_away
        a = abs(v)
        whole = np.floor(a)
        r = whole + np.floor(np.float32(2.0) * (a - whole))
        out[2 + j] = int(-r if v < 0 else r) & 0xFF


# ---------------------------------------------------------------------------------------------------------
# entry point


def _reference_quantize(x: np.ndarray, fmt) -> np.ndarray:
    """The numpy path for formats without a kernel (F32, F16, BF16, Q8_K)."""
    quantizer = kernels_for(fmt).reference_quantizer()
    if quantizer is None:
        raise ValueError(f"quantizing to {fmt.name} is not supported")
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, fmt.block_size)
    with np.errstate(all="ignore"):  # (the K-quant searches meet inf/NaN in degenerate groups, as C does)
        out = quantizer(blocks) if blocks.shape[0] else np.zeros(0, fmt.block_dtype)
    return out.view(np.uint8)


def quantize_fast(x, ggml_type) -> np.ndarray:
    """float32 array (n_rows, n) -> uint8 (n_rows, bytes per row) of `ggml_type` blocks; Numba where there is a
    kernel, else the numpy reference. Same bytes as the references either way."""
    fmt = format_by_name(ggml_type)
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"quantize_fast takes a 2-D array (rows, columns), got shape {x.shape}")
    if x.shape[1] % fmt.block_size:
        raise ValueError(f"{fmt.name} tensor of shape {x.shape}: row length {x.shape[1]} is not a multiple of "
                         f"the block size {fmt.block_size}")
    driver = kernels_for(fmt).quantize_blocks()
    if driver is None:
        return np.ascontiguousarray(_reference_quantize(x, fmt)).reshape(x.shape[0], -1)
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, fmt.block_size)
    out = np.empty((blocks.shape[0], fmt.type_size), dtype=np.uint8)
    if blocks.shape[0]:
        driver(blocks, out)
    return out.reshape(x.shape[0], fmt.row_bytes(x.shape[1]))

"""Numpy reference quantize / dequantize for every format in quant.formats.

Sections:
  1. validation shared by every public entry point (sizes are checked before any data is touched)
  2. dequantize_blocks: one vectorised function per format over (n_blocks,) structured blocks;
     bit-exact with gguf.quants.dequantize (same float32 operations in the same order)
  3. quantize_blocks for F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; bit-exact with gguf.quants.quantize
  4. activation quantization used by the integer kernels (Q8_0-style per 32, Q8_K-style per 256),
     following llama.cpp's x86 conventions so our integer dot products see the same int8 values

The Numba kernels in quant.kernels_* are checked against this module, never the other way round.
"""

from __future__ import annotations

import numpy as np

from .formats import QK_K, BlockFormat, format_by_name
from .registry import kernels_for

# ---------------------------------------------------------------------------------------------------------
# 1. validation


def check_shape(fmt: BlockFormat, shape) -> tuple[int, ...]:
    """Normalise `shape` and check its last axis splits into whole blocks."""
    try:
        shape = tuple(int(s) for s in (shape if np.iterable(shape) else (shape,)))
    except (TypeError, ValueError):
        raise ValueError(f"shape must be a tuple of ints, got {shape!r}") from None
    if not shape or any(s < 0 for s in shape):
        raise ValueError(f"invalid tensor shape {shape}")
    if shape[-1] % fmt.block_size:
        raise ValueError(f"{fmt.name} tensor of shape {shape}: row length {shape[-1]} is not a multiple of "
                         f"the block size {fmt.block_size}")
    return shape


def expected_nbytes(fmt: BlockFormat, shape: tuple[int, ...]) -> int:
    n_elements = int(np.prod(shape, dtype=np.int64))
    return n_elements // fmt.block_size * fmt.type_size


def as_checked_bytes(data, fmt: BlockFormat, shape: tuple[int, ...]) -> np.ndarray:
    """Flat contiguous uint8 view of `data`, after checking it holds exactly the bytes of `shape`."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = np.frombuffer(data, dtype=np.uint8)
    if not isinstance(data, np.ndarray):
        raise ValueError(f"expected a uint8 numpy array of {fmt.name} blocks, got {type(data).__name__}")
    if data.dtype != np.uint8:
        raise ValueError(f"expected uint8 bytes of {fmt.name} blocks, got dtype {data.dtype}")
    want = expected_nbytes(fmt, shape)
    if data.size != want:
        raise ValueError(f"{fmt.name} tensor of shape {shape} needs {want} bytes, got {data.size}")
    # Always a read-only view: weights are never written, and mmap'd (read-only) and in-memory tensors then
    # share one compiled specialisation of every kernel instead of two.
    flat = np.ascontiguousarray(data).reshape(-1).view()
    flat.flags.writeable = False
    return flat


# ---------------------------------------------------------------------------------------------------------
# 2. dequantize: (n_blocks,) structured blocks -> float32 (n_blocks, block_size)


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def _nibbles_lo_then_hi(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32): low nibbles are elements 0..15, high nibbles 16..31 (32-element formats)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) bits, bit j is element j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def dequantize_f32(b):
    return b["v"].astype(np.float32).reshape(-1, 1)


def dequantize_f16(b):
    return b["v"].astype(np.float32).reshape(-1, 1)


def dequantize_bf16(b):
    return (b["v"].astype(np.int32) << 16).view(np.float32).reshape(-1, 1)


def dequantize_q4_0(b):
    q = _nibbles_lo_then_hi(b["qs"]).astype(np.int8) - np.int8(8)
    return _f32(b["d"])[:, None] * q.astype(np.float32)


def dequantize_q4_1(b):
    q = _nibbles_lo_then_hi(b["qs"]).astype(np.float32)
    return _f32(b["d"])[:, None] * q + _f32(b["m"])[:, None]


def dequantize_q5_0(b):
    q = (_nibbles_lo_then_hi(b["qs"]) | (_bits32(b["qh"]) << 4)).astype(np.int8) - np.int8(16)
    return _f32(b["d"])[:, None] * q.astype(np.float32)


def dequantize_q5_1(b):
    q = (_nibbles_lo_then_hi(b["qs"]) | (_bits32(b["qh"]) << 4)).astype(np.float32)
    return _f32(b["d"])[:, None] * q + _f32(b["m"])[:, None]


def dequantize_q8_0(b):
    return b["qs"].astype(np.float32) * _f32(b["d"])[:, None]


def _crumbs_by_shift(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes of 2-bit fields -> (n, 256): element h*128 + j*32 + l is bits 2j..2j+1 of qs[h*32 + l]."""
    n = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, QK_K)


def dequantize_q2_k(b):
    n = b.shape[0]
    sc = b["scales"]
    dl = (_f32(b["d"])[:, None] * (sc & 0xF).astype(np.float32)).reshape(n, 16, 1)
    ml = (_f32(b["dmin"])[:, None] * (sc >> 4).astype(np.float32)).reshape(n, 16, 1)
    q = _crumbs_by_shift(b["qs"]).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """(n, 12) packed bytes -> (n, 16) signed 6-bit scales.

    Scale s takes its low 4 bits from byte s (s < 8) or the high nibble of byte s - 8, and its top 2 bits
    from bits 2*(s // 4) of byte 8 + s % 4."""
    n = scales.shape[0]
    low = np.concatenate([scales[:, :8] & 0x0F, scales[:, :8] >> 4], axis=-1)
    high = (scales[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & 3
    return (low | (high.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)


def dequantize_q3_k(b):
    n = b.shape[0]
    dl = (_f32(b["d"])[:, None] * q3_k_scales(b["scales"]).astype(np.float32)).reshape(n, 16, 1)
    low = _crumbs_by_shift(b["qs"])
    # element j*32 + l (of each 128-half) has its "high" bit in bit j of hmask[l]; a clear bit subtracts 4
    hbit = np.unpackbits(b["hmask"].reshape(n, 1, 32), axis=1, bitorder="little").reshape(n, QK_K)
    q = low.astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (n, 12) packed bytes -> ((n, 8) 6-bit scales, (n, 8) 6-bit mins).

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for mins;
    bytes 8-11 hold the low 4 bits of scale 4+i (low nibble) and min 4+i (high nibble)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 8, 32): sub-block 2i is the low nibbles of bytes 32i.., 2i+1 the high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, 8, 32)


def dequantize_q4_k(b):
    n = b.shape[0]
    sc, mn = k_scale_min(b["scales"])
    d = (_f32(b["d"])[:, None] * sc.astype(np.float32)).reshape(n, 8, 1)
    dm = (_f32(b["dmin"])[:, None] * mn.astype(np.float32)).reshape(n, 8, 1)
    return (d * _k_nibbles(b["qs"]).astype(np.float32) - dm).reshape(n, QK_K)


def dequantize_q5_k(b):
    n = b.shape[0]
    sc, mn = k_scale_min(b["scales"])
    d = (_f32(b["d"])[:, None] * sc.astype(np.float32)).reshape(n, 8, 1)
    dm = (_f32(b["dmin"])[:, None] * mn.astype(np.float32)).reshape(n, 8, 1)
    # sub-block j takes its fifth bit from bit j of qh[l]
    high = np.unpackbits(b["qh"].reshape(n, 1, 32), axis=1, bitorder="little")
    q = (_k_nibbles(b["qs"]) | (high << 4)).astype(np.float32)
    return (d * q - dm).reshape(n, QK_K)


def dequantize_q6_k(b):
    n = b.shape[0]
    d = (_f32(b["d"])[:, None] * b["scales"].astype(np.float32)).reshape(n, 16, 1)
    # element h*128 + s*64 + k: low 4 bits are nibble s of ql[h*64 + k], high 2 bits come from qh like Q2_K
    ql = (b["ql"].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    q = (ql.reshape(n, QK_K) | (_crumbs_by_shift(b["qh"]) << 4)).astype(np.int8) - np.int8(32)
    return (d * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


# IQ4_NL's 16 non-linear levels (llama.cpp's kvalues_iq4nl), indexed by each 4-bit field (gguf-py's IQ4_NL)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def dequantize_iq4_nl(b):
    return _f32(b["d"])[:, None] * KVALUES_IQ4NL[_nibbles_lo_then_hi(b["qs"])].astype(np.float32)


# MXFP4's 16 E2M1 values, doubled to integers (llama.cpp's kvalues_mxfp4): bit 3 is the sign, so index 8 is -0;
# the block scale 2^(e - 128) is half the E8M0 value 2^(e - 127), which undoes the doubling.
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def e8m0_to_f32_half(e: np.ndarray) -> np.ndarray:
    """GGML_E8M0_TO_FP32_HALF: 2^(e - 128) as float32 bits, subnormal for e < 2 (exact for every byte)."""
    e = np.asarray(e, np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32).view(
        np.float32)


def dequantize_mxfp4(b):
    return e8m0_to_f32_half(b["e"])[:, None] * KVALUES_MXFP4[_nibbles_lo_then_hi(b["qs"])].astype(np.float32)


def dequantize_iq4_xs(b):
    """(d * (6-bit scale - 32)) * table[index] per 32-value sub-block ib: scale = 4 bits of scales_l[ib // 2]
    (low nibble for even ib) | bits 2ib, 2ib + 1 of scales_h << 4; indices as IQ4_NL's, 16 bytes a sub-block."""
    n = b.shape[0]
    ib = np.arange(8)
    low = (b["scales_l"][:, ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 15
    high = (b["scales_h"][:, None] >> (2 * ib).astype(np.uint16)) & 3
    ls = (low.astype(np.int32) | (high.astype(np.int32) << 4)) - 32
    dl = (_f32(b["d"])[:, None] * ls.astype(np.float32)).reshape(n, 8, 1)
    q = KVALUES_IQ4NL[_nibbles_lo_then_hi(b["qs"].reshape(n, 8, 16))].astype(np.float32)
    return (dl * q).reshape(n, QK_K)


def dequantize_q8_k(b):  # not in gguf-py; the int8 quants times the float32 scale
    return b["qs"].astype(np.float32) * b["d"][:, None]




def dequantize(data, ggml_type, shape) -> np.ndarray:
    """Numpy reference: raw bytes of a `ggml_type` tensor -> float32 array of `shape`."""
    fmt = format_by_name(ggml_type)
    shape = check_shape(fmt, shape)
    raw = as_checked_bytes(data, fmt, shape)
    blocks = raw.view(fmt.block_dtype)
    return kernels_for(fmt).reference_dequantize()(blocks).astype(np.float32, copy=False).reshape(shape)


# ---------------------------------------------------------------------------------------------------------
# 3. quantize: float32 (n_blocks, block_size) -> (n_blocks,) structured blocks


# The formats gguf-py quantizes, which quantize() reproduces byte for byte; the others have their own quantizers
# (quant.kquants_quantize), named in the registry.
GGUF_PY_QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _fills_blocks(fill):
    """quantize_<fmt>(x) -> (n_blocks,) block records, from fill(x, out) writing the fields of out."""
    fmt = format_by_name(fill.__name__.removeprefix("quantize_"))

    def quantize_blocks(x: np.ndarray) -> np.ndarray:
        out = np.zeros(x.shape[0], dtype=fmt.block_dtype)
        fill(x, out)
        return out
    quantize_blocks.__name__ = quantize_blocks.__qualname__ = fill.__name__
    quantize_blocks.__doc__ = f"float32 (n_blocks, {fmt.block_size}) -> (n_blocks,) {fmt.name} blocks."
    return quantize_blocks


def _reciprocal_or_zero(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The value with the largest magnitude in each row (first one on ties), keeping its sign."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1, keepdims=True), axis=-1)


def _pack_lo_then_hi(q: np.ndarray) -> np.ndarray:
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C roundf. Adding 0.5 then flooring can round up just below .5; doubling the fraction cannot."""
    a = np.abs(x)
    whole = np.floor(a)
    return np.sign(x) * (whole + np.floor(np.float32(2) * (a - whole)))


@_fills_blocks
def quantize_f32(x, out):
    out["v"] = x[:, 0]


@_fills_blocks
def quantize_f16(x, out):
    out["v"] = x[:, 0].astype(np.float16)


@_fills_blocks
def quantize_bf16(x, out):  # round to nearest even, NaNs forced quiet (ggml_compute_fp32_to_bf16)
    u = x[:, 0].view(np.uint32).astype(np.uint64)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    out["v"] = np.where(is_nan, (u >> 16) | 64, rounded).astype(np.uint16)


@_fills_blocks
def quantize_q4_0(x, out):
    d = _signed_absmax(x) / np.float32(-8)
    q = np.trunc(x * _reciprocal_or_zero(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    out["d"], out["qs"] = d[:, 0], _pack_lo_then_hi(q)


@_fills_blocks
def quantize_q4_1(x, out):
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = np.trunc((x - lo) * _reciprocal_or_zero(d) + np.float32(0.5)).astype(np.uint8).clip(0, 15)
    out["d"], out["m"], out["qs"] = d[:, 0], lo[:, 0], _pack_lo_then_hi(q)


@_fills_blocks
def quantize_q5_0(x, out):
    d = _signed_absmax(x) / np.float32(-16)
    q = np.trunc(x * _reciprocal_or_zero(d) + np.float32(16.5)).astype(np.uint8).clip(0, 31)
    out["d"], out["qs"] = d[:, 0], _pack_lo_then_hi(q)
    out["qh"] = np.packbits(q >> 4, axis=-1, bitorder="little")


@_fills_blocks
def quantize_q5_1(x, out):
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(31)
    q = np.trunc((x - lo) * _reciprocal_or_zero(d) + np.float32(0.5)).astype(np.uint8).clip(0, 31)
    out["d"], out["m"], out["qs"] = d[:, 0], lo[:, 0], _pack_lo_then_hi(q)
    out["qh"] = np.packbits(q >> 4, axis=-1, bitorder="little")


@_fills_blocks
def quantize_q8_0(x, out):
    d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    out["d"], out["qs"] = d[:, 0], _round_half_away(x * _reciprocal_or_zero(d)).astype(np.int8)




def quantize(x, ggml_type) -> np.ndarray:
    """float32 array (..., n) -> uint8 array (..., bytes per row) of `ggml_type` blocks (gguf-py's layout)."""
    fmt = format_by_name(ggml_type)
    quantizer = kernels_for(fmt).reference_quantizer() if fmt.name in GGUF_PY_QUANTIZABLE else None
    if quantizer is None:
        raise ValueError(f"quantizing to {fmt.name} is not supported; supported: {', '.join(GGUF_PY_QUANTIZABLE)}")
    x = np.asarray(x)
    shape = check_shape(fmt, x.shape)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, fmt.block_size)
    return quantizer(x).view(np.uint8).reshape(*shape[:-1], fmt.row_bytes(shape[-1]))


# IQ4_NL: llama.cpp's quantize_iq4_nl without an importance matrix (quantize_row_iq4_nl_impl, one 32-element block
# per super-block, 7 tries): weights x^2; a first scale max / 127 refined by a weighted least-squares fit; 15 more
# candidate scales (itry - 127) / max, the fit that explains most of the weighted variance wins; then every value
# takes the nearest level at that scale. As kquants_quantize: float32 in C's order, sequential sums, no FMA, so the
# bytes equal a build of ggml-quants.c without FMA contraction.
IQ4_NL_TRIES = 7
GROUP_MAX_EPS = np.float32(1e-15)


def _nearest_iq4nl(v: np.ndarray) -> np.ndarray:
    """best_index_int8 over KVALUES_IQ4NL: the nearest level's index, the upper one unless the lower is strictly
    nearer (values below the first or above the last level clamp)."""
    levels = KVALUES_IQ4NL.astype(np.float32)
    mu = np.clip(np.searchsorted(levels, v, side="right"), 1, 15)
    lower = (v - levels[mu - 1]) < (levels[mu] - v)
    idx = np.where(lower, mu - 1, mu)
    return np.where(v <= levels[0], 0, np.where(v >= levels[15], 15, idx))


def _iq4nl_fit(x, w, inv):
    """(sumqx, sumq2) of the levels nearest inv * x, each a sequential float32 sum of (w*q)*x and (w*q)*q."""
    q = KVALUES_IQ4NL.astype(np.float32)[_nearest_iq4nl(inv[:, None] * x)]
    wq = w * q
    return (np.cumsum(wq * x, axis=1, dtype=np.float32)[:, -1], np.cumsum(wq * q, axis=1, dtype=np.float32)[:, -1])


def _iq4nl_block_scales(x):
    """Each 32-value row's scale as quantize_row_iq4_nl_impl searches it (its `scales[ib]`), 0 for a row whose
    largest magnitude is under GROUP_MAX_EPS."""
    n = x.shape[0]
    w = x * x
    first = np.abs(x).argmax(axis=1)
    amax, vmax = np.abs(x)[np.arange(n), first], x[np.arange(n), first]
    live = amax >= GROUP_MAX_EPS
    safe_max = np.where(live, vmax, np.float32(1))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = -safe_max / np.float32(KVALUES_IQ4NL[0])
        sumqx, sumq2 = _iq4nl_fit(x, w, np.float32(1) / d)
        d = np.where(sumq2 > 0, sumqx / sumq2, np.float32(0)).astype(np.float32)
        best = d * sumqx
        for itry in range(-IQ4_NL_TRIES, IQ4_NL_TRIES + 1):
            sumqx, sumq2 = _iq4nl_fit(x, w, np.float32(itry + int(KVALUES_IQ4NL[0])) / safe_max)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d)
            best = np.where(better, d * sumqx, best)
    return np.where(live, d, np.float32(0)).astype(np.float32)


def _reciprocals(d):
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)


@_fills_blocks
def quantize_iq4_nl(x, out):
    scale = _iq4nl_block_scales(x)
    idx = _nearest_iq4nl(_reciprocals(scale)[:, None] * x).astype(np.uint8)
    out["d"], out["qs"] = scale, _pack_lo_then_hi(idx)


# MXFP4: llama.cpp's quantize_row_mxfp4_ref. e = floor(log2f(max |x|)) - 2 + 127 (0 for an all-zero block), so the
# largest magnitude lands in [4, 8) times the half scale d = 2^(e - 128) (the top levels 8 and 12 of the doubled
# table); each value takes the index of least |kvalues[i] * d - x| over all 16, the first on ties (0 before -0).
# log2f is modelled as float64 log2 rounded to float32 (correctly rounded), which matters only just below a power
# of two, where log2f can round up to the integer.


def mxfp4_exponents(x):
    """Each 32-value row's E8M0 byte."""
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        lg = np.floor(np.log2(amax.astype(np.float64)).astype(np.float32))
    return np.where(amax > 0, lg - np.float32(2) + np.float32(127), 0).astype(np.uint8)


def _nearest_mxfp4(x, d):
    """best_index_mxfp4 for every value: argmin keeps the first of equal errors, as the C loop's strict `<` does."""
    err = np.abs(KVALUES_MXFP4.astype(np.float32)[None, None, :] * d[:, None, None] - x[:, :, None])
    return err.argmin(axis=2).astype(np.uint8)


@_fills_blocks
def quantize_mxfp4(x, out):
    e = mxfp4_exponents(x)
    out["e"], out["qs"] = e, _pack_lo_then_hi(_nearest_mxfp4(x, e8m0_to_f32_half(e)))


# IQ4_XS: the same search per 32-value sub-block (quantize_row_iq4_nl_impl with 256-value super-blocks); then the
# super-block scale d = -(the sub-block scale of largest magnitude) / 32, each sub-block's scale rounded to a 6-bit
# l in -32..31 (nearest_int: to even), and every value re-indexed against d * l. d is stored as float16 but l and
# the indices come from the float32 d.
@_fills_blocks
def quantize_iq4_xs(x, out):
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    scales = _iq4nl_block_scales(sub).reshape(n, 8)
    first = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(n), first]
    max_scale = np.where(np.abs(max_scale) > 0, max_scale, np.float32(0))  # C keeps +0 unless some |scale| > 0
    d = (-max_scale / np.float32(32)).astype(np.float32)
    l = np.clip(np.rint(_reciprocals(d)[:, None] * scales), -32, 31).astype(np.int64)
    dl = (d[:, None] * l.astype(np.float32)).astype(np.float32)
    idx = _nearest_iq4nl(_reciprocals(dl).reshape(n * 8, 1) * sub).astype(np.uint8)
    u = (l + 32).astype(np.uint16)
    out["d"] = d
    out["scales_l"] = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).astype(np.uint8)
    out["scales_h"] = np.bitwise_or.reduce((u >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1)
    out["qs"] = _pack_lo_then_hi(idx).reshape(n, 128)

# ---------------------------------------------------------------------------------------------------------
# 4. activation quantization for the integer kernels
#
# Q8_0-style (blocks of 32, for the 32-element formats): d = amax / 127, q = round-half-even(x * (127 / amax)),
# and s = d * sum(q), the block sum that formats with a min (Q4_1, Q5_1) need, like llama.cpp's Q8_1.
# Q8_K-style (blocks of 256, for the K-quants): iscale = -127 / (signed absmax), q = min(127, rint(iscale*x)),
# d = 1 / iscale, plus the int sums of each 16 quants (for the K-quant mins), as llama.cpp's Q8_K.
# The int8 values are llama.cpp's (x86 rounding). Q8_0-style d and s are rounded to float16 as llama.cpp's
# block_q8_0 / block_q8_1 store them (s from the unrounded d); Q8_K's d stays float32, as in llama.cpp.

ACT_BLOCK = 32


def quantize_act_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 (n,) -> (q int8 (n,), d float32 (n/32,), s float32 (n/32,))."""
    xb = np.asarray(x, dtype=np.float32).reshape(-1, ACT_BLOCK)
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    q = np.rint(xb * inv[:, None]).astype(np.int8)
    s = d * q.sum(axis=-1, dtype=np.int32).astype(np.float32)
    f16 = np.float16
    return q.reshape(-1), d.astype(f16).astype(np.float32), s.astype(f16).astype(np.float32)


def quantize_act_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 (n,) -> (q int8 (n,), d float32 (n/256,), bsums int32 (n/16,))."""
    xb = np.asarray(x, dtype=np.float32).reshape(-1, QK_K)
    vmax = _signed_absmax(xb)[:, 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(vmax == 0, np.float32(0), np.float32(-127) / vmax).astype(np.float32)
        d = np.where(vmax == 0, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    q = np.minimum(np.rint(xb * iscale[:, None]), 127).astype(np.int8)
    bsums = q.reshape(-1, 16).sum(axis=-1, dtype=np.int32)
    return q.reshape(-1), d, bsums

"""How K and V values are stored in the cache: f32, f16 (llama.cpp's default) or q8_0.

A cache row is one head's head_dim values at one slot. Each type stores a row as
    f32:  head_dim float32                                  4 bytes a value
    f16:  head_dim float16 bits (uint16)                    2 bytes a value
    q8_0: head_dim int8 + one float32 scale per 32 values   1.125 bytes a value
and the attention kernels read rows in place through three small inlined functions (store_row, dot_row,
axpy_row) that Numba specialises on the cache array's dtype, so one attention kernel serves every type.

q8_0 rounds like llama.cpp's quantize_row_q8_0 (scale = max|x| / 127, q = round-half-even(x * 127 / max|x|)); its
scale stays float32 where llama.cpp stores float16 (0.06 bytes a value more, one conversion less per block).
Every function has a numpy reference (encode_ref / decode_ref) that the tests compare with.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, types
from numba.extending import overload

from quant.simd import NATIVE_F16, _f32_to_f16_native, f16_bits_to_f32, f32_bits

Q8_BLOCK = 32  # values per q8_0 scale


@dataclass(frozen=True)
class KVType:
    name: str
    dtype: type          # storage dtype of the values
    block: int           # values per scale; 0: no scales
    bytes_per_value: float


KV_TYPES = {
    "f32": KVType("f32", np.float32, 0, 4.0),
    "f16": KVType("f16", np.uint16, 0, 2.0),
    "q8_0": KVType("q8_0", np.int8, Q8_BLOCK, 1.0 + 4.0 / Q8_BLOCK),
}
# llama.cpp's default (type_k = type_v = f16): the same rounding as the reference outputs, half of f32's bytes.
DEFAULT_KV_TYPE = "f16"
ALIASES = {"float32": "f32", "fp32": "f32", "float16": "f16", "fp16": "f16", "q8": "q8_0"}


def kv_type(name) -> KVType:
    """The KVType for a name ('f32', 'f16', 'q8_0'; None: the default); ValueError naming the choices."""
    if isinstance(name, KVType):
        return name
    key = DEFAULT_KV_TYPE if name is None else ALIASES.get(str(name).lower(), str(name).lower())
    if key not in KV_TYPES:
        raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {name!r}")
    return KV_TYPES[key]


def row_bytes(kvt: KVType, head_dim: int) -> int:
    """Bytes one row of head_dim values takes (values plus scales)."""
    n_scales = head_dim // kvt.block if kvt.block else 0
    return head_dim * np.dtype(kvt.dtype).itemsize + 4 * n_scales


def check_head_dim(kvt: KVType, head_dim: int) -> None:
    if kvt.block and head_dim % kvt.block:
        raise ValueError(f"kv_type {kvt.name} needs a head size that is a multiple of {kvt.block}, got {head_dim}")


# ---------------------------------------------------------------------------------------------------------------
# float32 -> float16 bits, rounding to nearest even (numpy's astype(float16)); F16C / AArch64 do it in one
# instruction, the integer version serves other hosts and is tested against numpy on every host.


@njit(cache=True)
def f32_to_f16_portable(x):
    b = np.uint32(f32_bits(np.float32(x)))
    sign = np.uint32((b >> np.uint32(16)) & np.uint32(0x8000))
    e = np.int32((b >> np.uint32(23)) & np.uint32(0xFF))
    m = np.uint32(b & np.uint32(0x7FFFFF))
    if e == 0xFF:  # inf, nan (keep nan a quiet nan)
        return np.uint16(sign | np.uint32(0x7C00) | (np.uint32(0x200) if m else np.uint32(0)))
    exp = e - 127 + 15
    if exp >= 31:
        return np.uint16(sign | np.uint32(0x7C00))
    if exp <= 0:  # a float16 subnormal or zero
        if exp < -10:
            return np.uint16(sign)
        m = m | np.uint32(0x800000)
        shift = np.uint32(14 - exp)
        half = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        halfway = np.uint32(1) << (shift - np.uint32(1))
        if rem > halfway or (rem == halfway and (half & np.uint32(1))):
            half += np.uint32(1)
        return np.uint16(sign | half)
    half = (np.uint32(exp) << np.uint32(10)) | (m >> np.uint32(13))
    rem = m & np.uint32(0x1FFF)
    if rem > np.uint32(0x1000) or (rem == np.uint32(0x1000) and (half & np.uint32(1))):
        half += np.uint32(1)  # a carry out of the mantissa correctly bumps the exponent (to inf at the top)
    return np.uint16(sign | half)


@njit(cache=True, inline="always")
def f32_to_f16(x):
    if NATIVE_F16:
        return _f32_to_f16_native(np.float32(x))
    return f32_to_f16_portable(x)


# ---------------------------------------------------------------------------------------------------------------
# Row access, specialised on the cache's dtype. cache: [H_kv, capacity, head_dim]; scales: [H_kv, capacity,
# head_dim / 32] for q8_0, an unused [0, 0, 0] array otherwise.


# The row functions are compiled with these options whatever their caller's (an overload does not inherit
# fastmath): reassociation lets LLVM vectorise the dot and axpy loops like the rest of attention.
_ROW_JIT = {"fastmath": True, "error_model": "numpy"}


def store_row(src, cache, scales, kv, slot):
    """cache[kv, slot] <- src (float32 [head_dim]), encoded."""


def dot_row(q, cache, scales, kv, slot):
    """q . cache[kv, slot] in float32."""


def axpy_row(acc, weight, cache, scales, kv, slot):
    """acc += weight * cache[kv, slot]."""


@overload(store_row)  # no fastmath: the quants must be the reference's exactly
def _store_row(src, cache, scales, kv, slot):
    if cache.dtype == types.float32:
        def impl(src, cache, scales, kv, slot):
            row = cache[kv, slot]
            for d in range(src.shape[0]):
                row[d] = src[d]
        return impl
    if cache.dtype == types.uint16:
        def impl(src, cache, scales, kv, slot):
            row = cache[kv, slot]
            for d in range(src.shape[0]):
                row[d] = f32_to_f16(src[d])
        return impl
    if cache.dtype == types.int8:
        def impl(src, cache, scales, kv, slot):
            row, scale_row = cache[kv, slot], scales[kv, slot]
            for b in range(src.shape[0] // Q8_BLOCK):
                amax = np.float32(0.0)
                for j in range(b * Q8_BLOCK, b * Q8_BLOCK + Q8_BLOCK):
                    amax = max(amax, abs(src[j]))
                inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
                for j in range(b * Q8_BLOCK, b * Q8_BLOCK + Q8_BLOCK):
                    row[j] = np.int8(np.rint(src[j] * inv))
                scale_row[b] = amax / np.float32(127.0)
        return impl
    return None


@overload(dot_row, jit_options=_ROW_JIT)
def _dot_row(q, cache, scales, kv, slot):
    if cache.dtype == types.float32:
        def impl(q, cache, scales, kv, slot):
            row = cache[kv, slot]
            dot = np.float32(0.0)
            for d in range(q.shape[0]):
                dot += q[d] * row[d]
            return dot
        return impl
    if cache.dtype == types.uint16:
        def impl(q, cache, scales, kv, slot):
            row = cache[kv, slot]
            dot = np.float32(0.0)
            for d in range(q.shape[0]):
                dot += q[d] * f16_bits_to_f32(row[d])
            return dot
        return impl
    if cache.dtype == types.int8:
        def impl(q, cache, scales, kv, slot):
            row, scale_row = cache[kv, slot], scales[kv, slot]
            # One flat loop, each value times its block's scale: LLVM vectorises it; a loop per 32-value block
            # gets unrolled into scalar code instead (measured 11x slower).
            dot = np.float32(0.0)
            for j in range(q.shape[0]):
                dot += q[j] * np.float32(np.int32(row[j])) * scale_row[j >> 5]
            return dot
        return impl
    return None


@overload(axpy_row, jit_options=_ROW_JIT)
def _axpy_row(acc, weight, cache, scales, kv, slot):
    if cache.dtype == types.float32:
        def impl(acc, weight, cache, scales, kv, slot):
            row = cache[kv, slot]
            for d in range(acc.shape[0]):
                acc[d] += weight * row[d]
        return impl
    if cache.dtype == types.uint16:
        def impl(acc, weight, cache, scales, kv, slot):
            row = cache[kv, slot]
            for d in range(acc.shape[0]):
                acc[d] += weight * f16_bits_to_f32(row[d])
        return impl
    if cache.dtype == types.int8:
        def impl(acc, weight, cache, scales, kv, slot):
            row, scale_row = cache[kv, slot], scales[kv, slot]
            for j in range(acc.shape[0]):  # one flat loop, as in dot_row
                acc[j] += weight * scale_row[j >> 5] * np.float32(np.int32(row[j]))
        return impl
    return None


@njit(cache=True)
def store_rows(src, cache, scales, kv, slots):
    """For tests and state restore: cache[kv, slots[i]] <- src[i] for src float32 [n, head_dim]."""
    for i in range(slots.shape[0]):
        store_row(src[i], cache, scales, kv, slots[i])


@njit(cache=True)
def load_rows(cache, scales, kv, slots, out):
    """For tests: out[i] <- decoded cache[kv, slots[i]], through axpy_row (what attention reads)."""
    for i in range(slots.shape[0]):
        out[i, :] = 0.0
        axpy_row(out[i], np.float32(1.0), cache, scales, kv, slots[i])


# ---------------------------------------------------------------------------------------------------------------
# numpy references: encode float32 rows [..., head_dim] to (values, scales) and back.


def encode_ref(x: np.ndarray, kvt) -> tuple[np.ndarray, np.ndarray]:
    kvt = kv_type(kvt)
    x = np.asarray(x, dtype=np.float32)
    if kvt.name == "f32":
        return x.copy(), np.zeros(x.shape[:-1] + (0,), np.float32)
    if kvt.name == "f16":
        return x.astype(np.float16).view(np.uint16), np.zeros(x.shape[:-1] + (0,), np.float32)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // Q8_BLOCK, Q8_BLOCK))
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(blocks * inv).astype(np.int8).reshape(x.shape)
    return q, (amax[..., 0] / np.float32(127.0)).astype(np.float32)


def decode_ref(values: np.ndarray, scales: np.ndarray, kvt) -> np.ndarray:
    kvt = kv_type(kvt)
    if kvt.name == "f32":
        return values.astype(np.float32, copy=True)
    if kvt.name == "f16":
        return values.view(np.float16).astype(np.float32)
    blocks = values.reshape(values.shape[:-1] + (values.shape[-1] // Q8_BLOCK, Q8_BLOCK)).astype(np.float32)
    return (blocks * scales[..., None]).reshape(values.shape)


@njit(cache=True)
def f32_to_f16_array(x, out):
    """For tests: out[i] = float16 bits of x[i], through the path the kernels use on this host."""
    for i in range(x.shape[0]):
        out[i] = f32_to_f16(x[i])


@njit(cache=True)
def f32_to_f16_portable_array(x, out):
    """For tests: the integer-only conversion, checked on every host."""
    for i in range(x.shape[0]):
        out[i] = f32_to_f16_portable(x[i])

"""How K and V values are stored in the cache: f32, f16 (llama.cpp's default) or q8_0.

A cache row is one head's head_dim values at one slot. Each type stores a row as
    f32:  head_dim float32                                  4 bytes a value
    f16:  head_dim float16 bits (uint16)                    2 bytes a value
    q8_0: head_dim int8 + one float32 scale per 32 values   1.125 bytes a value
and the attention kernels read rows in place through small inlined functions (store_row, row_value, like_cache)
that Numba specialises on the cache array's dtype, so one attention kernel serves every type.

q8_0 rounds like llama.cpp's quantize_row_q8_0 (scale = max|x| / 127, q = round-half-even(x * 127 / max|x|)); its
scale stays float32 where llama.cpp stores float16 (0.06 bytes a value more, one conversion less per block).
Every function has a numpy reference (encode_ref / decode_ref) that the tests compare with.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, types
from numba.extending import overload

from edgellm.quant.simd import (f16_bits_to_f32, f32_to_f16, f32_to_f16_portable,  # noqa: F401  (re-exported)
                                load_f16x8, load_f16x8_pair, load_f16x16, load_f32x8, load_f32x8_pair,
                                load_f32x16)

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
# Row access, specialised on the cache's dtype. cache: [H_kv, capacity, head_dim]; scales: [H_kv, capacity,
# head_dim / 32] for q8_0, an unused [0, 0, 0] array otherwise.


def store_row(src, cache, scales, kv, slot):
    """cache[kv, slot] <- src (float32 [head_dim]), encoded."""


def row_value(cache, scales, kv, slot, d):
    """The float32 value of cache[kv, slot, d]."""


def load_row8(cache, offset):
    """8 values of an f16 or f32 cache from flat element offset `offset`, as quant.simd.F32x8."""


def load_row8_pair(cache, a, b):
    """[8 values from flat offset a | 8 from flat offset b] of an f16 or f32 cache, as quant.simd.F32x16."""


def load_row16(cache, offset):
    """16 values of an f16 or f32 cache from flat element offset `offset`, as quant.simd.F32x16."""


def like_cache(x, cache):
    """x (float32) rounded as llama.cpp rounds an operand multiplied with this cache's values: to float16 for an
    f16 cache (its matrix products convert the other side to float16), unchanged otherwise."""


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


@overload(row_value, inline="always")
def _row_value(cache, scales, kv, slot, d):
    if cache.dtype == types.float32:
        return lambda cache, scales, kv, slot, d: cache[kv, slot, d]
    if cache.dtype == types.uint16:
        return lambda cache, scales, kv, slot, d: f16_bits_to_f32(cache[kv, slot, d])
    if cache.dtype == types.int8:
        def impl(cache, scales, kv, slot, d):
            return scales[kv, slot, d >> 5] * np.float32(np.int32(cache[kv, slot, d]))
        return impl
    return None


@overload(load_row8, inline="always")
def _load_row8(cache, offset):
    if cache.dtype == types.float32:
        return lambda cache, offset: load_f32x8(cache, offset)
    if cache.dtype == types.uint16:
        return lambda cache, offset: load_f16x8(cache, offset)
    return None


@overload(load_row8_pair, inline="always")
def _load_row8_pair(cache, a, b):
    if cache.dtype == types.float32:
        return lambda cache, a, b: load_f32x8_pair(cache, a, b)
    if cache.dtype == types.uint16:
        return lambda cache, a, b: load_f16x8_pair(cache, a, b)
    return None


@overload(load_row16, inline="always")
def _load_row16(cache, offset):
    if cache.dtype == types.float32:
        return lambda cache, offset: load_f32x16(cache, offset)
    if cache.dtype == types.uint16:
        return lambda cache, offset: load_f16x16(cache, offset)
    return None


@overload(like_cache, inline="always")
def _like_cache(x, cache):
    if cache.dtype == types.uint16:
        return lambda x, cache: f16_bits_to_f32(f32_to_f16(x))
    return lambda x, cache: np.float32(x)


@njit(cache=True)
def store_rows(src, cache, scales, kv, slots):
    """For tests and state restore: cache[kv, slots[i]] <- src[i] for src float32 [n, head_dim]."""
    for i in range(slots.shape[0]):
        store_row(src[i], cache, scales, kv, slots[i])


@njit(cache=True)
def load_rows(cache, scales, kv, slots, out):
    """For tests: out[i] <- decoded cache[kv, slots[i]], through row_value (what attention reads)."""
    for i in range(slots.shape[0]):
        out[i, :] = 0.0
        for d in range(out.shape[1]):
            out[i, d] = row_value(cache, scales, kv, slots[i], d)


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

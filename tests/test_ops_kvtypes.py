"""KV cache storage types (edgellm.engine.kvtypes): the Numba row encoders against their numpy references, attention
reading each type in place, the cache's one-block layout per type, the context shift and state export."""

import numpy as np
import pytest

from edgellm.engine import kvtypes, ops
from edgellm.errors import ModelError
from edgellm.engine.kvcache import EMPTY_SLOT, KVCache, cache_bytes

KV_TYPES = list(kvtypes.KV_TYPES)
# Attention on decoded values vs the float64 reference: the same bound as f32 attention (test_ops.py).
NMSE_ATTENTION = 1e-10
# Attention of an f16 / q8_0 cache against f32 values: the storage rounding, relative 2^-11 and ~1/254 per value.
NMSE_VS_F32 = {"f32": 1e-10, "f16": 1e-6, "q8_0": 1e-4}
# A key rotated at p then shifted back by d against one rotated at p - d: float32 rotation error.
SHIFT_TOL = 1e-4


def nmse(a, b):
    return float(np.sum((a.astype(np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


def test_f32_to_f16_matches_numpy_on_every_class_of_value():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, 65504, 65519.99, 65520, 6e-8, 2.98e-8, 2.99e-8, 1e-45, np.inf, -np.inf, 1.0 + 2**-11,
                      1.0 + 3 * 2**-11, 2049.0, 2051.0], np.float32)
    x = np.concatenate([x[np.isfinite(x)], edges, (rng.standard_normal(10_000) * 1e-5).astype(np.float32)])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    for convert in (kvtypes.f32_to_f16_array, kvtypes.f32_to_f16_portable_array):
        got = np.empty_like(want)
        convert(x, got)
        np.testing.assert_array_equal(got, want, err_msg=convert.__name__)


@pytest.mark.parametrize("name", KV_TYPES)
def test_row_store_and_load_match_the_reference(name):
    rng = np.random.default_rng(1)
    kvt = kvtypes.kv_type(name)
    src = (rng.standard_normal((9, 64)) * 3).astype(np.float32)
    src[0] = 0.0  # an all-zero block: scale 0, no division by zero
    cache = KVCache(n_ctx=12, n_head_kv=2, head_dim=64, windows=[0], n_batch=1, kv_type=name).layers[0]
    slots = np.arange(2, 11, dtype=np.int64)
    kvtypes.store_rows(src, cache.k, cache.k_scale, 1, slots)
    values, scales = kvtypes.encode_ref(src, name)
    np.testing.assert_array_equal(cache.k[1, 2:11], values)
    if kvt.block:
        np.testing.assert_array_equal(cache.k_scale[1, 2:11], scales)
    out = np.empty_like(src)
    kvtypes.load_rows(cache.k, cache.k_scale, 1, slots, out)
    np.testing.assert_array_equal(out, kvtypes.decode_ref(values, scales, name))
    assert not cache.k[0].any()  # the other head untouched


@pytest.mark.parametrize("name", KV_TYPES)
@pytest.mark.parametrize("window", [0, 5])
def test_attention_reads_each_type_in_place(name, window):
    rng = np.random.default_rng(2)
    H, H_kv, hd, S, new = 4, 2, 64, 40, 3
    k = rng.standard_normal((S, H_kv, hd)).astype(np.float32)
    v = rng.standard_normal((S, H_kv, hd)).astype(np.float32)
    q = rng.standard_normal((new, H, hd)).astype(np.float32)
    positions = np.arange(S, dtype=np.int32)
    cache = KVCache(n_ctx=S, n_head_kv=H_kv, head_dim=hd, windows=[window], n_batch=new, kv_type=name)
    kv = cache.layers[0]
    for start in range(0, S, new):
        ops.kv_store(k[start:start + new], v[start:start + new], positions[start:start + new], kv.k, kv.v,
                     kv.slot_pos, kv.k_scale, kv.v_scale)
    out = np.empty_like(q)
    ops.attention(q, kv.k, kv.v, kv.slot_pos, positions[-new:], window, 0.125, out, None, kv.k_scale, kv.v_scale)
    k_dec = kvtypes.decode_ref(*kvtypes.encode_ref(k, name), name)
    v_dec = kvtypes.decode_ref(*kvtypes.encode_ref(v, name), name)
    want = ops.attention_ref(q, k_dec, v_dec, positions[-new:], positions, window, 0.125, f16_operands=name == "f16")
    assert nmse(out, want) < NMSE_ATTENTION
    assert nmse(out, ops.attention_ref(q, k, v, positions[-new:], positions, window, 0.125)) < NMSE_VS_F32[name]


@pytest.mark.parametrize("name", KV_TYPES)
def test_cache_is_one_block_sized_by_type(name):
    cache = KVCache(n_ctx=64, n_head_kv=2, head_dim=32, windows=[0, 8, 0], n_batch=4, kv_type=name)
    arrays = [a for layer in cache.layers for a in (layer.k, layer.v, layer.k_scale, layer.v_scale, layer.slot_pos)
              if a.size]
    assert all(np.shares_memory(a, cache._block) for a in arrays)
    for i, a in enumerate(arrays):
        a[...] = i + 1
    assert all((a == i + 1).all() for i, a in enumerate(arrays))  # disjoint
    want = cache_bytes(64, 2, 32, [0, 8, 0], 4, name)
    assert want <= cache.nbytes < want + 15 * 64  # + alignment padding
    assert KVCache.planned_nbytes(64, 2, 32, [0, 8, 0], 4, name) == cache.nbytes
    per_value = {"f32": 4, "f16": 2, "q8_0": 1 + 4 / 32}[name]
    assert cache.bytes_per_token() == 2 * 2 * 2 * 32 * per_value  # two full layers, K and V, two heads


def test_unknown_type_and_bad_head_size_are_refused():
    with pytest.raises(ValueError, match="kv_type must be one of"):
        KVCache(n_ctx=8, n_head_kv=1, head_dim=32, windows=[0], n_batch=1, kv_type="q3")
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(n_ctx=8, n_head_kv=1, head_dim=48, windows=[0], n_batch=1, kv_type="q8_0")


def _filled_cache(name, windows, n_past, rng, inv_freq, neox):
    """A cache holding n_past positions of roped keys: returns (cache, raw keys [n, H_kv, hd], values)."""
    H_kv, hd = 2, 32
    cache = KVCache(n_ctx=24, n_head_kv=H_kv, head_dim=hd, windows=windows, n_batch=4, kv_type=name)
    raw = rng.standard_normal((n_past, H_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_past, H_kv, hd)).astype(np.float32)
    positions = np.arange(n_past, dtype=np.int32)
    roped = ops.rope_ref(raw, positions, inv_freq, neox)
    for kv in cache.layers:
        for start in range(0, n_past, 4):
            sl = slice(start, start + 4)
            ops.kv_store(roped[sl], v[sl], positions[sl], kv.k, kv.v, kv.slot_pos, kv.k_scale, kv.v_scale)
    cache.n_past = n_past
    return cache, raw, v


@pytest.mark.parametrize("name", KV_TYPES)
@pytest.mark.parametrize("neox", [False, True])
def test_shift_keeps_sinks_and_rerotates_moved_keys(name, neox):
    """After shift(n_keep=4, n_discard=8) on 24 positions, a full layer holds positions 0..15: the sinks as they
    were, and each later key exactly as if it had been roped at its new position."""
    rng = np.random.default_rng(3)
    inv_freq = ops.rope_inv_freq(32, 10000.0)
    cache, raw, v = _filled_cache(name, [0, 6], 24, rng, inv_freq, neox)
    cache.shift(4, 8, lambda il: (inv_freq, neox))
    assert cache.n_past == 16 and cache.n_shifted == 8
    kept = np.r_[0:4, 12:24]
    new_pos = np.arange(16)
    full, ring = cache.layers
    np.testing.assert_array_equal(full.slot_pos[:16], new_pos)
    assert (full.slot_pos[16:] == EMPTY_SLOT).all()
    want_k = ops.rope_ref(raw[kept], new_pos, inv_freq, neox)
    got_k = kvtypes.decode_ref(full.k[:, :16], full.k_scale[:, :16] if full.k_scale.size else full.k_scale,
                               name).transpose(1, 0, 2)
    enc_tol = {"f32": 0, "f16": 2e-3, "q8_0": 3e-2}[name]  # one more rounding of the re-rotated key
    assert np.abs(got_k - want_k).max() <= SHIFT_TOL + enc_tol * np.abs(want_k).max()
    got_v = kvtypes.decode_ref(full.v[:, :16], full.v_scale[:, :16] if full.v_scale.size else full.v_scale, name)
    want_v = kvtypes.decode_ref(*kvtypes.encode_ref(v[kept], name), name)
    np.testing.assert_array_equal(got_v.transpose(1, 0, 2), want_v)
    # the ring (window 6, capacity 9) held positions 15..23; they move to 7..15, each in slot p % 9
    held = ring.slot_pos[ring.slot_pos != EMPTY_SLOT]
    assert sorted(held.tolist()) == list(range(7, 16))
    assert all(ring.slot_pos[p % 9] == p for p in range(7, 16))


def test_shift_that_would_drop_more_than_is_cached_is_refused():
    inv_freq = ops.rope_inv_freq(32, 10000.0)
    cache, _, _ = _filled_cache("f32", [0], 8, np.random.default_rng(4), inv_freq, False)
    with pytest.raises(ModelError, match="cannot shift"):
        cache.shift(4, 5, lambda il: (inv_freq, False))


@pytest.mark.parametrize("name", KV_TYPES)
def test_state_round_trip_restores_every_slot(name):
    inv_freq = ops.rope_inv_freq(32, 10000.0)
    cache, _, _ = _filled_cache(name, [0, 6], 20, np.random.default_rng(5), inv_freq, False)
    state = cache.export_state()
    before = [a.copy() for layer in cache.layers for a in (layer.k, layer.v, layer.k_scale, layer.v_scale,
                                                           layer.slot_pos)]
    other = KVCache(n_ctx=24, n_head_kv=2, head_dim=32, windows=[0, 6], n_batch=4, kv_type=name)
    other.import_state(state)
    after = [a for layer in other.layers for a in (layer.k, layer.v, layer.k_scale, layer.v_scale, layer.slot_pos)]
    held = [layer.slot_pos != EMPTY_SLOT for layer in cache.layers]
    for i, (a, b) in enumerate(zip(before, after)):
        if a.ndim == 3 and a.size:
            mask = held[i // 5]
            np.testing.assert_array_equal(a[:, mask], b[:, mask])
        elif a.ndim == 1:
            np.testing.assert_array_equal(a, b)
    assert other.n_past == 20
    with pytest.raises(ModelError, match="does not fit"):
        KVCache(n_ctx=30, n_head_kv=2, head_dim=32, windows=[0, 6], n_batch=4, kv_type=name).import_state(state)

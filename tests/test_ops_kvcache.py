"""The KV cache's layout: one allocation, per-layer views that do not overlap, rings sized for window + batch."""

import numpy as np
import pytest

from edgellm.errors import ModelError
from edgellm.engine.kvcache import EMPTY_SLOT, KVCache, ring_capacity


def test_layers_are_disjoint_views_of_one_block():
    cache = KVCache(n_ctx=100, n_head_kv=2, head_dim=8, windows=[0, 16, 0], n_batch=4, kv_type="f32")
    assert cache.capacities == (100, 16 + 4 - 1, 100)
    arrays = [a for layer in cache.layers for a in (layer.k, layer.v)]
    for a in arrays:
        assert np.shares_memory(a, cache._block)
    for i, a in enumerate(arrays):  # writing one view never shows up in another
        a[...] = i + 1
    for i, a in enumerate(arrays):
        assert (a == i + 1).all()
    slots = 100 + 19 + 100
    assert slots * (2 * 2 * 8 * 4 + 4) <= cache.nbytes < slots * (2 * 2 * 8 * 4 + 4) + 15 * 64  # + alignment
    assert [layer.k.shape for layer in cache.layers] == [(2, 100, 8), (2, 19, 8), (2, 100, 8)]


def test_reset_empties_every_slot():
    cache = KVCache(n_ctx=10, n_head_kv=1, head_dim=4, windows=[0, 3], n_batch=2)
    for layer in cache.layers:
        layer.slot_pos[:] = 7
    cache.n_past = 5
    cache.reset()
    assert cache.n_past == 0
    assert all((layer.slot_pos == EMPTY_SLOT).all() for layer in cache.layers)


def test_ring_capacity():
    assert ring_capacity(n_ctx=4096, window=0, n_batch=512) == 4096
    # 1023 slots needed, rounded up to RING_ALIGN so slot and position share their lanes (as llama.cpp's cells)
    assert ring_capacity(n_ctx=4096, window=512, n_batch=512) == 1024
    assert ring_capacity(n_ctx=4096, window=512, n_batch=64) == 576
    assert ring_capacity(n_ctx=4096, window=16, n_batch=4) == 19  # a tiny test window: not rounded
    assert ring_capacity(n_ctx=600, window=512, n_batch=512) == 600  # never more than the context


def _filled(cache, n, rng):
    """cache as if positions [0, n) had been written one by one (each to slot p % capacity), with random values."""
    for layer in cache.layers:
        for p in range(n):
            slot = p % layer.slot_pos.shape[0]
            layer.slot_pos[slot] = p
            layer.k[:, slot] = rng.integers(-100, 100, layer.k[:, slot].shape)
            layer.v[:, slot] = rng.integers(-100, 100, layer.v[:, slot].shape)
            if layer.k_scale.size:
                layer.k_scale[:, slot] = rng.random(layer.k_scale[:, slot].shape)
                layer.v_scale[:, slot] = rng.random(layer.v_scale[:, slot].shape)
    cache.n_past = n
    return cache


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_copy_prefix_takes_exactly_the_positions_below_n(kv_type):
    """A server slot copies another slot's computed prefix (a shared system prompt): positions [0, n) with their
    values and scales, nothing past n; refused, the cache unchanged, where a window ring lost what the next query
    sees, or the layouts differ."""
    rng = np.random.default_rng(0)
    make = lambda: KVCache(n_ctx=64, n_head_kv=2, head_dim=32, windows=[0, 6], n_batch=2, kv_type=kv_type)
    src, dst = _filled(make(), 14, rng), _filled(make(), 3, rng)
    assert dst.copy_prefix(src, 12)  # the window layer's 7 slots hold 7..13: 7..11 is all the query at 12 sees
    assert dst.n_past == 12
    for d, s in zip(dst.layers, src.layers):
        held = np.flatnonzero((s.slot_pos >= 0) & (s.slot_pos < 12))
        assert (np.sort(d.slot_pos[d.slot_pos >= 0]) == np.sort(s.slot_pos[held])).all()
        np.testing.assert_array_equal(d.k[:, held], s.k[:, held])
        np.testing.assert_array_equal(d.v[:, held], s.v[:, held])
        if s.k_scale.size:
            np.testing.assert_array_equal(d.k_scale[:, held], s.k_scale[:, held])
            np.testing.assert_array_equal(d.v_scale[:, held], s.v_scale[:, held])
    assert (dst.layers[0].slot_pos < 12).all() and (dst.layers[0].slot_pos >= 0).sum() == 12
    before = [(layer.slot_pos.copy(), layer.k.copy()) for layer in dst.layers]
    src2 = _filled(make(), 30, rng)
    assert not dst.copy_prefix(src2, 10)  # the ring now holds 23..29 only: position 9 is gone
    assert not dst.copy_prefix(src, 15)   # past what src holds
    other = KVCache(n_ctx=64, n_head_kv=2, head_dim=32, windows=[0, 6], n_batch=2,
                    kv_type="f32" if kv_type != "f32" else "f16")
    assert not dst.copy_prefix(_filled(other, 14, rng), 12)
    assert dst.n_past == 12 and all((layer.slot_pos == sp).all() and (layer.k == k).all()
                                    for layer, (sp, k) in zip(dst.layers, before))


def test_bad_context_is_refused():
    with pytest.raises(ModelError, match="n_ctx"):
        KVCache(n_ctx=0, n_head_kv=1, head_dim=4, windows=[0], n_batch=1)


def _step_inputs(rng, positions, H, H_kv, hd, extras):
    """q, k, v of one row per position, its rope tables, and the (biases, norms) and q scale: random with extras,
    else the size-0 arrays that skip those steps and 1.0."""
    from edgellm.engine import ops
    T = positions.shape[0]
    q, k, v = (rng.standard_normal((T, h, hd)).astype(np.float32) for h in (H, H_kv, H_kv))
    cos, sin = np.empty((T, hd // 2), np.float32), np.empty((T, hd // 2), np.float32)
    ops.rope_tables(positions, ops.Rope(hd, 10000.0), cos, sin)
    if not extras:
        return q, k, v, cos, sin, (np.zeros(0, np.float32),) * 5, 1.0
    bias_norm = tuple(rng.standard_normal(n).astype(np.float32) for n in (H * hd, H_kv * hd, H_kv * hd, hd, hd))
    return q, k, v, cos, sin, bias_norm, 0.0625


def _decode_row(kv, t, q, k, v, cos, sin, positions, bias_norm, q_scale, out, scratch):
    """Row t as a one-token decode step on cache layer kv: finish_qkv, then attention into out[t] (attention scale
    0.125)."""
    from edgellm.engine import ops
    qt, kt, vt = q[t:t + 1].copy(), k[t:t + 1].copy(), v[t:t + 1].copy()
    ops.finish_qkv(qt, kt, vt, *bias_norm, 1e-6, cos[t:t + 1], sin[t:t + 1], False, positions[t:t + 1], kv.k, kv.v,
                   kv.slot_pos, q_scale=q_scale)
    ops.attention(qt, kv.k, kv.v, kv.slot_pos, positions[t:t + 1], kv.window, 0.125, out[t:t + 1], scratch)


POOL_SHAPES = [("f16", 0, 6, 2, 64), ("f32", 0, 6, 2, 64), ("f16", 24, 6, 2, 64),
               # the query heads of a KV head go together, up to four: groups of one, four (Gemma-3's shape, head
               # size 256), five (a run of four and one of one) and eight (two runs)
               ("f16", 0, 3, 3, 32), ("f16", 24, 4, 1, 256), ("f32", 0, 10, 2, 32), ("f16", 24, 16, 2, 64)]


@pytest.mark.parametrize("kv_type,window,H,H_kv,hd", POOL_SHAPES)
@pytest.mark.parametrize("extras", [False, True])
def test_pool_rows_equal_each_sequence_alone(kv_type, window, H, H_kv, hd, extras):
    """ops.finish_attention_rows (one call for a decode step of several pool sequences) gives each row exactly what
    finish_qkv + attention give it on its own cache, and writes the same cache contents; extras: with q/k/v biases,
    q/k norms and a q scale (the Qwen and Gemma steps)."""
    from edgellm.engine import ops
    from edgellm.engine.kvcache import KVPool
    rng = np.random.default_rng(5)
    n_seq, n_ctx = 4, 64
    pools = [KVPool(n_seq, n_ctx, H_kv, hd, [window], 8, kv_type) for _ in range(2)]
    lengths = [5, 40, 17, 63]  # different depths per sequence (63: a window of 24 sees only the last keys)
    for pool in pools:  # identical histories in both pools
        for i, n in enumerate(lengths):
            kv = pool.caches[i].layers[0]
            r = np.random.default_rng(i)
            k, v = (r.standard_normal((n, H_kv, hd)).astype(np.float32) for _ in range(2))
            ops.kv_store(k, v, np.arange(n, dtype=np.int32), kv.k, kv.v, kv.slot_pos)
    seqs = np.array([3, 0, 2], np.int32)  # a step over some of the sequences, out of order
    positions = np.array([lengths[i] for i in seqs], np.int32)
    q, k, v, cos, sin, bias_norm, q_scale = _step_inputs(rng, positions, H, H_kv, hd, extras)
    scratch = ops.attention_scratch(pools[0].caches[0].layers[0].slot_pos.shape[0], hd)
    q1, k1, v1 = q.copy(), k.copy(), v.copy()
    out_rows = np.empty_like(q)
    stacked = pools[0].stacked[0]
    ops.finish_attention_rows(q1, k1, v1, *bias_norm, 1e-6, cos, sin, False, positions, seqs, stacked, out_rows,
                              scratch, q_scale, 0.125)
    out_alone = np.empty_like(q)
    for t, i in enumerate(seqs):
        _decode_row(pools[1].caches[i].layers[0], t, q, k, v, cos, sin, positions, bias_norm, q_scale, out_alone,
                    scratch)
    np.testing.assert_array_equal(out_rows, out_alone)
    for a, b in zip(pools[0].caches, pools[1].caches):
        np.testing.assert_array_equal(a.layers[0].k, b.layers[0].k)
        np.testing.assert_array_equal(a.layers[0].v, b.layers[0].v)
        np.testing.assert_array_equal(a.layers[0].slot_pos, b.layers[0].slot_pos)
    bad = np.array([0, 1, 4], np.int32)
    with pytest.raises(ValueError, match="out of range"):
        ops.finish_attention_rows(q1, k1, v1, *bias_norm, 1e-6, cos, sin, False, positions, bad, stacked, out_rows,
                                  scratch, q_scale, 0.125)


# SmolLM2's heads, an f32 cache, Gemma-3's (head size 256, one KV head) and two runs of query heads, in rings too
RUN_SHAPES = [("f16", 0, 9, 3, 64), ("f32", 0, 6, 2, 32), ("f16", 24, 4, 1, 256), ("f16", 24, 16, 2, 64)]


@pytest.mark.parametrize("kv_type,window,H,H_kv,hd", RUN_SHAPES)
@pytest.mark.parametrize("extras", [False, True])
def test_verify_run_equals_its_rows_decoded_in_order(kv_type, window, H, H_kv, hd, extras):
    """ops.finish_attention_run (a verified draft: rows at consecutive positions of one cache, in one call) gives
    each row exactly what finish_qkv + attention give it as a decode step after the rows before it, and leaves the
    same cache. With a window the ring (window + batch - 1 slots) has wrapped, and the rows overwrite slots of
    positions no row may see; extras: q/k/v biases, q/k norms and a q scale."""
    from edgellm.engine import ops
    rng = np.random.default_rng(7)
    T, depth = 8, 40
    caches = [KVCache(n_ctx=64, n_head_kv=H_kv, head_dim=hd, windows=[window], n_batch=T, kv_type=kv_type)
              for _ in range(2)]
    k0, v0 = (rng.standard_normal((depth, H_kv, hd)).astype(np.float32) for _ in range(2))
    for cache in caches:
        kv = cache.layers[0]
        ops.kv_store(k0, v0, np.arange(depth, dtype=np.int32), kv.k, kv.v, kv.slot_pos)
    capacity = caches[0].layers[0].slot_pos.shape[0]
    assert window == 0 or capacity < depth + T  # the ring wraps
    positions = np.arange(depth, depth + T, dtype=np.int32)
    q, k, v, cos, sin, bias_norm, q_scale = _step_inputs(rng, positions, H, H_kv, hd, extras)
    scratch = ops.attention_scratch(capacity, hd)
    out_run = np.empty_like(q)
    q1, k1, v1 = q.copy(), k.copy(), v.copy()
    ops.finish_attention_run(q1, k1, v1, *bias_norm, 1e-6, cos, sin, False, positions, caches[0].layers[0],
                             out_run, scratch, q_scale, 0.125)
    out_steps = np.empty_like(q)
    for t in range(T):
        _decode_row(caches[1].layers[0], t, q, k, v, cos, sin, positions, bias_norm, q_scale, out_steps, scratch)
    np.testing.assert_array_equal(out_run, out_steps)
    for a, b in zip(caches[0].layers, caches[1].layers):
        np.testing.assert_array_equal(a.k, b.k)
        np.testing.assert_array_equal(a.v, b.v)
        np.testing.assert_array_equal(a.slot_pos, b.slot_pos)
    with pytest.raises(ValueError, match="consecutive"):  # a gap: a row would see a key its step never had
        ops.finish_attention_run(q1, k1, v1, *bias_norm, 1e-6, cos, sin, False, positions[::-1].copy(),
                                 caches[0].layers[0], out_run, scratch, q_scale, 0.125)


def test_verify_run_refuses_a_q8_0_cache():
    from edgellm.engine import ops
    cache = KVCache(n_ctx=32, n_head_kv=1, head_dim=32, windows=[0], n_batch=4, kv_type="q8_0")
    q = np.zeros((2, 2, 32), np.float32)
    k, v = np.zeros((2, 1, 32), np.float32), np.zeros((2, 1, 32), np.float32)
    cos = sin = np.ones((2, 16), np.float32)
    none = np.zeros(0, np.float32)
    with pytest.raises(ValueError, match="f16/f32"):
        ops.finish_attention_run(q, k, v, none, none, none, none, none, 1e-6, cos, sin, False,
                                 np.arange(2, dtype=np.int32), cache.layers[0], np.empty_like(q),
                                 ops.attention_scratch(32, 32))

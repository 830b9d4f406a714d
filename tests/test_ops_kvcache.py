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


def test_bad_context_is_refused():
    with pytest.raises(ModelError, match="n_ctx"):
        KVCache(n_ctx=0, n_head_kv=1, head_dim=4, windows=[0], n_batch=1)


@pytest.mark.parametrize("kv_type,window", [("f16", 0), ("f32", 0), ("f16", 24)])
def test_pool_rows_equal_each_sequence_alone(kv_type, window):
    """ops.finish_qkv_rows + ops.attention_rows (one call for a decode step of several pool sequences) give each
    row exactly what finish_qkv + attention give it on its own cache, and write the same cache contents."""
    from edgellm.engine import ops
    from edgellm.engine.kvcache import KVPool
    rng = np.random.default_rng(5)
    n_seq, H, H_kv, hd, n_ctx = 4, 6, 2, 64, 64
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
    q, k, v = (rng.standard_normal((3, h, hd)).astype(np.float32) for h in (H, H_kv, H_kv))
    rope = ops.Rope(hd, 10000.0)
    cos, sin = np.empty((3, hd // 2), np.float32), np.empty((3, hd // 2), np.float32)
    ops.rope_tables(positions, rope, cos, sin)
    none = np.zeros(0, np.float32)
    scratch = ops.attention_scratch(pools[0].caches[0].layers[0].slot_pos.shape[0], hd)
    q1, k1, v1 = q.copy(), k.copy(), v.copy()
    out_rows = np.empty_like(q)
    ops.finish_qkv_rows(q1, k1, v1, none, none, none, none, none, 1e-6, cos, sin, False, positions, seqs,
                        pools[0].stacked[0])
    ops.attention_rows(q1, pools[0].stacked[0], seqs, positions, 0.125, out_rows, scratch)
    out_alone = np.empty_like(q)
    for t, i in enumerate(seqs):
        kv = pools[1].caches[i].layers[0]
        qt, kt, vt = q[t:t + 1].copy(), k[t:t + 1].copy(), v[t:t + 1].copy()
        ops.finish_qkv(qt, kt, vt, none, none, none, none, none, 1e-6, cos[t:t + 1], sin[t:t + 1], False,
                       positions[t:t + 1], kv.k, kv.v, kv.slot_pos)
        ops.attention(qt, kv.k, kv.v, kv.slot_pos, positions[t:t + 1], kv.window, 0.125, out_alone[t:t + 1], scratch)
    np.testing.assert_array_equal(out_rows, out_alone)
    for a, b in zip(pools[0].caches, pools[1].caches):
        np.testing.assert_array_equal(a.layers[0].k, b.layers[0].k)
        np.testing.assert_array_equal(a.layers[0].slot_pos, b.layers[0].slot_pos)
    with pytest.raises(ValueError, match="out of range"):
        ops.attention_rows(q1, pools[0].stacked[0], np.array([0, 1, 4], np.int32), positions, 0.125, out_rows,
                           scratch)

"""The KV cache's layout: one allocation, per-layer views that do not overlap, rings sized for window + batch."""

import numpy as np
import pytest

from edgellm.errors import ModelError
from edgellm.kvcache import EMPTY_SLOT, KVCache, ring_capacity


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
    assert ring_capacity(n_ctx=4096, window=512, n_batch=512) == 1023
    assert ring_capacity(n_ctx=600, window=512, n_batch=512) == 600  # never more than the context


def test_bad_context_is_refused():
    with pytest.raises(ModelError, match="n_ctx"):
        KVCache(n_ctx=0, n_head_kv=1, head_dim=4, windows=[0], n_batch=1)

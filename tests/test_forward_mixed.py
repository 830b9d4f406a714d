"""A prompt chunk decoded in the same forward as other sequences' decode rows (DecoderModel.forward_mixed, what the
server's scheduler runs when a prompt arrives while others decode): every row has the bits it has run apart, the
decode rows a decode step's and the chunk's last row a prompt batch's of that chunk alone, and the caches it leaves
continue as theirs would. On both real models (Gemma-3's sliding-window rings included)."""
import numpy as np
import pytest

import edgellm
from edgellm.engine.kvcache import KVPool
from edgellm.errors import ModelError

PROMPT_LENGTHS = (30, 41, 17, 60)


def _pool(fm, n):
    cfg = fm.config
    return KVPool(n, 512, cfg.n_head_kv, cfg.head_dim, [kv.window for kv in fm.cache.layers], fm.n_batch,
                  fm.cache.kv_type)


@pytest.mark.parametrize("chunk_len", [3, 13, 37])
def test_mixed_rows_equal_the_rows_run_apart(real_model, chunk_len):
    _, path = real_model
    fm = edgellm.load(path, n_ctx=512, n_threads=2).model
    rng = np.random.default_rng(chunk_len)
    prompts = [rng.integers(10, 5000, n).astype(np.int32) for n in PROMPT_LENGTHS]
    head = rng.integers(10, 5000, 20).astype(np.int32)  # the chunk's sequence already holds a first chunk
    chunk = rng.integers(10, 5000, chunk_len).astype(np.int32)
    tokens = rng.integers(10, 5000, len(prompts)).astype(np.int32)
    n = len(prompts)

    def started():
        pool = _pool(fm, n + 1)
        for cache, ids in zip(pool.caches, prompts):
            fm.forward(ids, cache=cache)
        fm.forward(head, cache=pool.caches[n])
        return pool

    apart = started()
    want_decode = fm.forward_multi(tokens, apart.caches[:n]).copy()
    want_chunk = fm.forward(chunk, cache=apart.caches[n])[-1].copy()
    mixed = started()
    got = fm.forward_mixed(tokens, mixed.caches[:n], chunk, mixed.caches[n]).copy()
    assert got.shape == (n + 1, fm.n_vocab)
    assert np.array_equal(got[:n], want_decode)
    assert np.array_equal(got[n], want_chunk)
    assert [c.n_past for c in mixed.caches] == [c.n_past for c in apart.caches]
    # the next steps from either pair of caches agree: the keys and values were stored alike
    nxt = tokens[::-1].copy()
    assert np.array_equal(fm.forward_multi(nxt, mixed.caches[:n]), fm.forward_multi(nxt, apart.caches[:n]).copy())
    assert np.array_equal(fm.forward(nxt[:1], cache=mixed.caches[n]), fm.forward(nxt[:1], cache=apart.caches[n]))


def test_mixed_refusals(smollm2_path):
    fm = edgellm.load(smollm2_path, n_ctx=512, n_threads=1).model
    pool = _pool(fm, 3)
    one = np.array([5], np.int32)
    with pytest.raises(ModelError, match="distinct"):
        fm.forward_mixed(one, [pool.caches[0]], one, pool.caches[0])  # the chunk on a decoding sequence's cache
    with pytest.raises(ModelError, match="n_batch"):
        fm.forward_mixed(one, [pool.caches[0]], np.ones(fm.n_batch, np.int32), pool.caches[1])
    with pytest.raises(ModelError, match="does not fit"):
        pool.caches[1].n_past = pool.caches[1].n_ctx - 2
        fm.forward_mixed(one, [pool.caches[0]], np.ones(3, np.int32), pool.caches[1])
    with pytest.raises(ModelError, match="vocabulary"):
        fm.forward_mixed(one, [pool.caches[0]], np.array([fm.n_vocab], np.int32), pool.caches[2])

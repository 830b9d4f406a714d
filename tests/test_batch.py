"""Batched generation (issue 12): each sequence of a batch gives exactly the tokens it gives alone, with mixed
prompt lengths, sequences that finish early, queued prompts that join mid-way (continuous batching), sampling,
stop strings and cancellation; the decode step's rows equal single-sequence decoding bit for bit; the KV pool is
one allocation and an oversize batch is refused up front with the figures."""
import numpy as np
import pytest
from hardening_tiny import tiny_spec, write_loadable_tiny_model

import edgellm
from edgellm.engine import validate
from edgellm.errors import MemoryBudgetError, ModelError, PromptError
from edgellm.engine.kvcache import KVPool

MIB = 1 << 20
PROMPTS = ["hello world", "world hello hello he", "STOP or go", "ld ll he", "h", "go go go go go go", "or", "le"]
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:",
                "Water boils at", "Hello", "In 1969,", "Write a haiku about the sea.\n"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_loadable_tiny_model(tmp_path_factory.mktemp("batch") / "tiny.gguf", tiny_spec(seed=3))


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return edgellm.load(str(tiny_path), n_ctx=128, n_threads=1)


def alone(m, prompts, **kw):
    """Each prompt from an empty cache (a reused prefix would run the rest in a batch of another size, whose
    rounding differs in llama.cpp's kernels and ours)."""
    out = []
    for p in prompts:
        m.reset()
        out.append(m.complete(p, **kw))
    return out


@pytest.mark.parametrize("n_parallel", [None, 3, 1])
def test_each_sequence_gives_what_it_gives_alone(tiny, n_parallel):
    """n_parallel 3 with 8 prompts: five queue and take the slots of finished ones."""
    want = alone(tiny, PROMPTS, max_tokens=12, ignore_eos=True)
    got = tiny.complete_batch(PROMPTS, max_tokens=12, n_parallel=n_parallel, ignore_eos=True)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.text for c in got] == [c.text for c in want]
    assert tiny.last_batch == got


def test_early_finishers_free_their_slot_for_queued_prompts(tiny):
    """Different max_tokens via stop strings and end-of-generation: each ends where it ends alone."""
    kw = dict(max_tokens=20, stop=["o"])
    want = alone(tiny, PROMPTS, **kw)
    got = tiny.complete_batch(PROMPTS, n_parallel=2, **kw)
    assert [(c.tokens, c.text, c.stop_reason) for c in got] == [(c.tokens, c.text, c.stop_reason) for c in want]
    assert len({len(c.tokens) for c in got}) > 1  # they really finished at different steps


def test_stream_yields_pieces_by_index_that_add_up_to_each_text(tiny):
    stream = tiny.stream_batch(PROMPTS[:4], max_tokens=10, ignore_eos=True)
    texts = [""] * 4
    while True:
        try:
            index, piece = next(stream)
        except StopIteration as stop:
            completions = stop.value
            break
        texts[index] += piece
    assert texts == [c.text for c in completions]


def test_sampling_in_a_batch_uses_each_sequences_own_sampler(tiny):
    kw = dict(max_tokens=10, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    assert [c.tokens for c in tiny.complete_batch(PROMPTS[:4], **kw)] == [c.tokens for c in alone(tiny, PROMPTS[:4], **kw)]


def test_forward_multi_rows_equal_single_decoding_bit_for_bit(tiny):
    fm = tiny.model
    cfg, windows = fm.config, [kv.window for kv in fm.cache.layers]
    pool = KVPool(3, 64, cfg.n_head_kv, cfg.head_dim, windows, fm.n_batch, fm.cache.kv_type)
    assert all(np.shares_memory(c._block, pool._block) for c in pool.caches)
    prompts = [np.array(tiny.tokenize(p), np.int32) for p in PROMPTS[:3]]
    for cache, ids in zip(pool.caches, prompts):
        fm.forward(ids, cache=cache)
    rows = fm.forward_multi([5, 6, 7], pool.caches).copy()
    for i, (ids, token) in enumerate(zip(prompts, [5, 6, 7])):
        fm.reset()
        fm.forward(ids)
        np.testing.assert_array_equal(fm.forward(np.array([token], np.int32))[0], rows[i])
    with pytest.raises(ModelError, match="distinct cache"):
        fm.forward_multi([1, 2], [pool.caches[0], pool.caches[0]])


def test_bad_batches_are_refused_before_anything_runs(tiny, monkeypatch):
    with pytest.raises(PromptError, match="at least one prompt"):
        tiny.generate_batch([])
    with pytest.raises(TypeError, match="list of prompts"):
        tiny.generate_batch("one prompt")
    with pytest.raises(PromptError, match="empty"):
        tiny.generate_batch(["ok", ""])
    with pytest.raises(ValueError, match="n_parallel"):
        tiny.generate_batch(["ok"], n_parallel=0)
    monkeypatch.setattr(validate, "available_memory", lambda: 64 * MIB)
    with pytest.raises(MemoryBudgetError, match=r"a batch of 8 sequences of 4096 positions .* only 64\.0 MiB"):
        tiny.generate_batch(PROMPTS, seq_ctx=4096)


def test_cancel_ends_every_sequence_and_the_model_stays_usable(tiny):
    """Two slots for five prompts: the active ones stop where they are, the queued ones end empty."""
    stream = tiny.stream_batch(PROMPTS[:5], max_tokens=40, n_parallel=2, ignore_eos=True)
    next(stream)
    assert tiny.cancel()
    completions = list_and_return(stream)
    assert all(c.stop_reason == "cancelled" for c in completions)
    assert [len(c.tokens) for c in completions[2:]] == [0, 0, 0]
    assert tiny.complete(PROMPTS[0], max_tokens=6).tokens == alone(tiny, PROMPTS[:1], max_tokens=6)[0].tokens


def list_and_return(gen):
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_real_models_batch_equals_alone(name, request):
    """Greedy, mixed prompt lengths, 3 slots for 8 prompts (queued ones join mid-way), end-of-generation on."""
    path = request.getfixturevalue("smollm2_path" if name.startswith("smollm2") else "gemma_path")
    m = edgellm.load(path, n_ctx=256, n_threads=2)
    want = alone(m, SMOL_PROMPTS, max_tokens=24)
    got = m.complete_batch(SMOL_PROMPTS, max_tokens=24, n_parallel=3)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.stop_reason for c in got] == [c.stop_reason for c in want]

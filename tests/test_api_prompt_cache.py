"""The prompt cache (edgellm/generation/prompt_cache.py) with SmolLM2: through the Python API two alternating chats
re-use their own prefixes instead of evicting each other, with the replies of a model without the cache; entries
go under the RAM budget least recently used first; a directory store is read back by a new cache, and a file
whose state does not fit (layer count, shapes, positions, tokens) is refused whole."""
import json
import os

import numpy as np
import pytest

import edgellm
from edgellm.generation.prompt_cache import PromptCache
from edgellm.generation.state import ModelState

N_CTX = 512
BUDGET = 64 << 20
A = [{"role": "user", "content": "List five animals that live in the ocean, with one fact about each: where it "
                                 "lives, what it eats, how big it grows, and how long it lives in the wild."}]
B = [{"role": "user", "content": "Explain in two sentences why the sky is blue on a clear day, and why sunsets are "
                                 "red and orange instead, as you would to a curious ten-year-old child."}]


@pytest.fixture(scope="module")
def models(smollm2_path):
    return (edgellm.load(smollm2_path, n_ctx=N_CTX, prompt_cache=BUDGET),
            edgellm.load(smollm2_path, n_ctx=N_CTX))


def alternate(m):
    """A, B, then each continued: (replies, prompt tokens re-used by the two returning turns)."""
    replies, reused = [], []
    for msgs in (A, B):
        replies.append(m.chat(msgs, max_tokens=8))
    for msgs, reply in ((A, replies[0]), (B, replies[1])):
        turn = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Say more."}]
        replies.append(m.chat(turn, max_tokens=8))
        reused.append(m.timings.reused_tokens)
    return replies, reused


def test_alternating_chats_keep_their_prefixes(models):
    cached, plain = models
    replies, reused = alternate(cached)
    plain_replies, plain_reused = alternate(plain)
    assert replies == plain_replies  # bit-exact prefix reuse: the same tokens as without the cache
    n_a, n_b = (len(cached.chat_prompt_ids(msgs)) for msgs in (A, B))
    # each returning chat re-uses its own first prompt (but for a batch's last rows); without the cache only
    # the part the two chats share (the template's system prompt)
    assert reused[0] >= n_a - 4 and reused[1] >= n_b - 4, (reused, n_a, n_b)
    assert max(plain_reused) < min(n_a, n_b) // 2, plain_reused
    assert cached.prompt_cache.hits >= 2


def test_a_scored_prompt_keeps_the_chat_before_it(models):
    """prompt_logprobs prefills from an empty cache: what the cache held goes to the prompt cache first, so the
    chat it interrupted still re-uses its prefix."""
    cached, _ = models
    cached.reset()
    reply = cached.chat(A, max_tokens=8)
    cached.complete("The capital of France is Paris.", max_tokens=0, prompt_logprobs=0)
    assert cached.timings.reused_tokens == 0
    turn = A + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Say more."}]
    cached.chat(turn, max_tokens=8)
    assert cached.timings.reused_tokens >= len(cached.chat_prompt_ids(A)) - 4


def test_ram_budget_evicts_least_recently_used(models):
    m = models[1]
    cache = m.model.cache
    m.reset()
    ids = m.chat_prompt_ids(A)
    m.logits(ids)
    nbytes = sum(a.nbytes for layer in cache.export_state()["layers"] for a in layer)
    small = PromptCache(int(nbytes * 1.5))
    assert small.store(ids, m._cached_kinds, cache)
    ids_b = m.chat_prompt_ids(B)
    m.logits(ids_b)
    assert small.store(ids_b, m._cached_kinds, cache)
    assert len(small) == 1 and small.ram_used <= small.ram_bytes
    # A went first out: a lookup of A finds at most B (they share the template's system prompt)
    assert [e.tokens.tolist() for e in small._entries.values()] == [ids_b]
    assert small.lookup(ids_b, cache).tokens.tolist() == ids_b


def stored_file(m, directory):
    """A cache directory holding the state of conversation A's prompt; returns (its file, A's ids)."""
    m.reset()
    ids = m.chat_prompt_ids(A)
    m.logits(ids)
    store = PromptCache(BUDGET, str(directory), model_name=m.name, n_vocab=m.n_vocab)
    assert store.store(ids, m._cached_kinds, m.model.cache)
    files = [f for f in os.listdir(directory) if f.endswith(".npz")]
    assert len(files) == 1
    return os.path.join(directory, files[0]), ids


def test_directory_store_is_read_back(models, tmp_path):
    m = models[1]
    path, ids = stored_file(m, tmp_path)
    expected = m.complete(ids + [28], max_tokens=6).tokens
    m.reset()
    again = PromptCache(BUDGET, str(tmp_path), model_name=m.name, n_vocab=m.n_vocab)
    assert len(again) == 1
    m.use_prompt_cache(again)
    try:
        m.reset()
        got = m.complete(ids + [28], max_tokens=6)
        assert got.tokens == expected
        # all of it but the tail a fresh batch computes with other kernels (the last rows of a 4-row group, and a
        # tail batch must keep 8 rows)
        assert m.timings.reused_tokens >= len(ids) - 12, (m.timings.reused_tokens, len(ids))
    finally:
        m.use_prompt_cache(None)


def tamper(path, change):
    state = ModelState.load(path)
    change(state)
    with open(path, "wb") as f:  # written in place, as damage would be
        arrays = {}
        for il, layer in enumerate(state.cache["layers"]):
            for name, a in zip(("slots", "pos", "k", "v", "k_scale", "v_scale"), layer):
                arrays[f"l{il}_{name}"] = a
        header = {"format": "edgellm-state-1", "model_name": state.model_name, "n_ctx": state.n_ctx,
                  "tokens": list(state.tokens), "row_kinds": state.row_kinds,
                  **{k: state.cache[k] for k in ("n_past", "n_shifted", "kv_type")},
                  "capacities": list(state.cache["capacities"]), "n_layers": len(state.cache["layers"])}
        np.savez(f, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)


def drop_layer(s):
    s.cache["layers"] = s.cache["layers"][:-1]


def move_position(s):
    held, pos, *rest = s.cache["layers"][0]
    pos = pos.copy()
    pos[3] = pos[3] + 1  # a position in the wrong slot
    s.cache["layers"][0] = (held, pos, *rest)


def drop_row(s):  # a hole in a full-attention layer: a position the next token attends to is missing
    s.cache["layers"] = [tuple(a[..., 1:, :] if a.ndim == 3 else a[1:] for a in layer) if i == 2 else layer
                         for i, layer in enumerate(s.cache["layers"])]


def bad_shape(s):
    held, pos, k, *rest = s.cache["layers"][1]
    s.cache["layers"][1] = (held, pos, k[:, :, :-1].copy(), *rest)


def extra_token(s):
    s.tokens = s.tokens + [1]


def bad_token(s):
    s.tokens = s.tokens[:-1] + [10 ** 7]


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage", [drop_layer, move_position, drop_row, bad_shape, extra_token, bad_token, truncate])
def test_bad_file_is_refused_whole(models, tmp_path, damage):
    m = models[1]
    path, ids = stored_file(m, tmp_path)
    if damage is truncate:
        truncate(path)
    else:
        tamper(path, damage)
    cache = m.model.cache
    m.reset()
    before = cache.export_state()
    store = PromptCache(BUDGET, str(tmp_path), model_name=m.name, n_vocab=m.n_vocab, log=lambda msg: None)
    assert store.lookup(ids, cache) is None  # refused (or, damaged beyond its header, never indexed)
    after = cache.export_state()
    assert after["n_past"] == before["n_past"] == 0 and all(a[0].size == 0 for a in after["layers"])
    assert len(store) == 0

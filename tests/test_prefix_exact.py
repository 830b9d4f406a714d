"""Prefix reuse keeps a fresh run's bits: on both real models, whatever ran before on one Model (fixture prompts in
several orders, unrelated prompts of many lengths, prompts sharing long prefixes, a chat's second turn that repeats
the previous reply, logits(), a restored state), every call gives the tokens and the logits, bit for bit, that a
model with an empty cache gives. generate_batch likewise."""
import numpy as np
import pytest

import edgellm
from conftest import GEMMA, SMOLLM2, load_reference

N_CTX = 512
N_TOKENS = 4  # generated per call: each step's logits are compared, the first ones depend most on the reused rows
SMALL_STEP = 8  # a prompt batch size that splits these prompts into several batches, so tails start mid-batch


def _run(model, prompt, n=N_TOKENS):
    seen = []
    c = model.complete(prompt, max_tokens=n, ignore_eos=True,
                       logits_processor=lambda ids, scores: (seen.append(scores.copy()), scores)[1])
    return c.tokens, seen, model.timings.reused_tokens


def _calls(model, name):
    """The prompts of the sequence, as token ids: fixture prompts in several orders, unrelated ones of many lengths,
    long shared prefixes, and chat-like next turns that repeat the previous reply (added by _check_sequence)."""
    fixture = [model.tokenize(c["prompt"], parse_special=True) for c in load_reference(name)[0]["greedy"]]
    words = model.tokenize(" ".join(f"word{i} and more text" for i in range(60)), add_special=False)
    bos = fixture[0][:1]
    unrelated = [bos + words[:n] for n in (1, 2, 3, 5, 8, 9, 13, 17, 31, 64)]
    long = bos + words[:150]
    shared = [long, long[:97] + fixture[1][1:], long + words[150:171], long[:140]]
    return fixture + unrelated[::3] + fixture[::-1] + unrelated[1::3] + shared + fixture[1:] + unrelated[2::3]


def _check_sequence(model, fresh, name):
    reused_total = 0
    previous = None
    calls = _calls(model, name)
    for i, ids in enumerate(calls):
        if previous is not None and i % 4 == 0:  # a next turn: the last prompt, its reply, then new text
            ids = previous[0] + previous[1] + ids[1:6]
        fresh.reset()
        want = _run(fresh, ids)
        got = _run(model, ids)
        assert want[2] == 0
        assert got[0] == want[0], f"call {i} ({len(ids)} tokens): {got[0]} != {want[0]}"
        for step, (a, b) in enumerate(zip(got[1], want[1])):
            assert np.array_equal(a, b), f"call {i}, step {step}: logits differ by {np.abs(a - b).max()}"
        reused_total += got[2]
        previous = (ids, got[0])
    assert reused_total > 0, "no call reused a prefix: the test would not see a reuse bug"


@pytest.fixture(scope="module", params=[SMOLLM2, GEMMA])
def pair(request):
    return request.param, edgellm.load(request.param, n_ctx=N_CTX), edgellm.load(request.param, n_ctx=N_CTX)


def test_every_call_gives_a_fresh_models_bits(pair):
    name, model, fresh = pair
    model.logits(model.tokenize("x")[:1] + [0])  # a logits() call first, as in the report
    _check_sequence(model, fresh, name)


def test_tails_that_start_inside_a_prompt_batch_keep_the_bits(pair):
    name, model, fresh = pair
    for m in (model, fresh):
        m.model.n_batch = SMALL_STEP  # buffers and rings stay the larger size: smaller batches fit them
    try:
        _check_sequence(model, fresh, name)
    finally:
        for m in (model, fresh):
            m.model.n_batch = 512


def test_a_restored_state_gives_a_fresh_models_bits(pair, tmp_path):
    name, model, fresh = pair
    ids = model.tokenize(load_reference(name)[0]["greedy"][3]["prompt"])
    model.reset()
    first = model.complete(ids, max_tokens=3, ignore_eos=True).tokens
    state = model.save_state()
    state.save(tmp_path / "s.npz")
    follow = ids + first + model.tokenize(" and then", add_special=False)
    fresh.reset()
    want = _run(fresh, follow)
    model.complete("Something else entirely, to overwrite the cache.", max_tokens=2)
    restored = type(state).load(tmp_path / "s.npz")
    for s in (state, restored, type(state)(state.model_name, state.n_ctx, state.tokens, state.cache)):
        model.load_state(s)
        got = _run(model, follow)
        assert got[0] == want[0] and all(np.array_equal(a, b) for a, b in zip(got[1], want[1]))
        assert (got[2] > 0) == (s.row_kinds is not None)  # kinds unknown: nothing reused


def test_generate_batch_gives_a_fresh_models_bits(pair):
    name, model, fresh = pair
    prompts = [c["prompt"] for c in load_reference(name)[0]["greedy"]]
    want = []
    for p in prompts:
        fresh.reset()
        c = fresh.complete(p, max_tokens=N_TOKENS, ignore_eos=True, logprobs=1)
        want.append((c.tokens, [t.logprob for t in c.token_info]))
    model.complete(prompts[2], max_tokens=3)
    for order in (prompts, prompts[::-1]):
        got = model.complete_batch(order, max_tokens=N_TOKENS, ignore_eos=True, logprobs=1)
        expected = want if order is prompts else want[::-1]
        assert [(c.tokens, [t.logprob for t in c.token_info]) for c in got] == expected


def test_a_repeated_prompt_reuses_all_rows_its_kernels_allow(pair):
    """A row's kind keeps only the bits the file's kernels make a difference to: SmolLM2 (32-element formats only)
    re-runs just a repeated prompt's last two rows (a one-row batch would give the last row the decode kind), with a
    fresh model's bits; Gemma-3's Q4_K gemm and Q6_K tiles keep every bit, and the shorter reuse those allow."""
    from edgellm.engine import prefix
    name, model, fresh = pair
    ids = model.tokenize(load_reference(name)[0]["greedy"][1]["prompt"])
    bits = model.model.row_kind_bits
    assert bits == (prefix.SEVERAL_ROWS if name == SMOLLM2 else prefix.ALL_KIND_BITS)
    model.reset()
    model.complete(ids, max_tokens=2, ignore_eos=True)
    fresh.reset()
    want = _run(fresh, ids)
    got = _run(model, ids)
    assert got[0] == want[0] and all(np.array_equal(a, b) for a, b in zip(got[1], want[1]))
    assert 8 < len(ids) < 512
    every_bit = prefix.plan(ids, prefix.kinds_of([(0, len(ids))], prefix.row_kinds), ids, 512, prefix.row_kinds)[0]
    if name == SMOLLM2:
        assert got[2] == len(ids) - 2 > every_bit
    else:
        assert got[2] == every_bit


def test_a_state_saved_with_every_kind_bit_is_reused_as_far_as_its_own(pair, tmp_path):
    """A state (or cache file) recorded before a row's kind kept only the file's own kernels' bits carries bits
    SmolLM2's kernels never use: read with this model's bits, it is reused as far as a state recorded now, with a
    fresh model's bits."""
    from edgellm.engine import prefix
    name, model, fresh = pair
    ids = model.tokenize(load_reference(name)[0]["greedy"][3]["prompt"])
    model.reset()
    first = model.complete(ids, max_tokens=3, ignore_eos=True).tokens
    state = model.save_state()
    assert len(ids) <= 512 and state.row_kinds[:len(ids)] == prefix.kinds_of([(0, len(ids))], model.model.row_kinds)\
        .tolist()
    every_bit = prefix.kinds_of([(0, len(ids))], prefix.row_kinds).tolist() + state.row_kinds[len(ids):]
    assert (every_bit != state.row_kinds) == (name == SMOLLM2)
    follow = ids + first + model.tokenize(" and then", add_special=False)
    fresh.reset()
    want = _run(fresh, follow)
    reused = []
    for kinds in (state.row_kinds, every_bit):
        model.load_state(type(state)(state.model_name, state.n_ctx, state.tokens, state.cache, kinds))
        got = _run(model, follow)
        assert got[0] == want[0] and all(np.array_equal(a, b) for a, b in zip(got[1], want[1]))
        reused.append(got[2])
    assert reused[0] == reused[1] > 0

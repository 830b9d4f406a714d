"""Speculative decoding (edgellm.generation.speculative): the verification pass gives every row a decode step's bits
and its rollback leaves the cache (ring included) as if the rejected rows never ran; greedy output with prompt
lookup or a draft model is plain greedy decoding's, token for token and logits for logits, with stop strings,
logprobs, streams and a grammar; the rejection rule samples the target's distribution (checked statistically on a
small vocabulary); the options are checked and refused where speculation does not apply."""
import json
import os

import numpy as np
import pytest
from fake_model import fake_metadata, ScriptedDecoder
from hardening_tiny import tiny_spec, write_loadable_tiny_model
from helpers_tiny_gguf import TinySpec, write_tiny_model

import edgellm
from edgellm.api import Model
from edgellm.engine import gguf as gguf_reader, ops
from edgellm.engine.models import build_model
from edgellm.errors import ModelError, SamplingError
from edgellm.generation.sampling import Sampler, SamplingParams
from edgellm.generation.speculative import (DRAFT_MAX, DraftLength, ForwardCosts, PromptLookup, Speculator,
                                           match_class)
from edgellm.tokenizer import Tokenizer

# Text that repeats itself, so that prompt lookup finds drafts (and a random tiny model's loops repeat it too).
REPEATING = "hello world hello world STOP or hello world or hello he ll world hello world hello"
# chi-square critical values at p = 1e-4 (a fixed seed makes each test deterministic; this bounds its false alarm)
CHI2_CRITICAL = {5: 25.74, 26: 59.6}


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    target = write_loadable_tiny_model(d / "target.gguf", tiny_spec(seed=5, weight_type="Q8_0"))
    # the same random weights at 4 bits: a draft that mostly agrees with the target
    draft = write_loadable_tiny_model(d / "draft.gguf", tiny_spec(seed=5, weight_type="Q4_0"))
    return target, draft


@pytest.fixture(scope="module")
def tiny(tiny_paths):
    return edgellm.load(str(tiny_paths[0]), n_ctx=256, n_threads=1)


def _time_steps(target, seconds, n_seqs=1):
    """A plain step's cost, timed twice: a size's first step in a process is not kept (ForwardCosts)."""
    target.timed_step(seconds, n_seqs)
    target.timed_step(seconds, n_seqs)


def _run(m, prompt, **kw):
    """The Completion and the scores seen at every step (through a logits processor, which sees each row)."""
    seen = []
    c = m.complete(prompt, logits_processor=lambda ids, s: (seen.append(s.copy()), s)[1], **kw)
    return c, seen


def _same(a, b):
    (ca, sa), (cb, sb) = a, b
    assert ca.tokens == cb.tokens and ca.text == cb.text
    assert (ca.finish_reason, ca.stop_reason) == (cb.finish_reason, cb.stop_reason)
    assert len(sa) == len(sb) and all(np.array_equal(x, y) for x, y in zip(sa, sb))


# --- the verification pass and the rollback ------------------------------------------------------------------------

def _check_verify_equals_decode(fm, prompt, fed, reject_at):
    fm.reset()
    fm.forward(np.asarray(prompt, np.int32))
    n0 = fm.cache.n_past
    want = [fm.forward(np.array([t], np.int32))[-1].copy() for t in fed]
    fm.truncate(n0)
    rows = fm.forward_verify(np.asarray(fed, np.int32))
    assert all(np.array_equal(r, w) for r, w in zip(rows, want)), "a verified row differs from its decode step"
    # roll back the drafted rows after reject_at, then continue: the bits of a cache that never held them
    fm.truncate(n0 + reject_at)
    after = fm.forward(np.array([7], np.int32))[-1].copy()
    fm.reset()
    fm.forward(np.asarray(prompt, np.int32))
    for t in fed[:reject_at]:
        fm.forward(np.array([t], np.int32))
    assert np.array_equal(after, fm.forward(np.array([7], np.int32))[-1])


@pytest.mark.parametrize("weight_type,kv_type", [("Q8_0", None), ("Q4_K", None), ("Q6_K", None), ("Q8_0", "q8_0")])
def test_verified_rows_equal_decode_steps_bit_for_bit(tmp_path, monkeypatch, weight_type, kv_type):
    """Q4_K and Q6_K compute a batch's rows with other kernels than one token; the verification must not. Its
    attention runs as one call a layer (ops.finish_attention_run) on an f16 cache, row by row on a q8_0 one."""
    path = write_loadable_tiny_model(tmp_path / "m.gguf", tiny_spec(seed=1, weight_type=weight_type, n_embd=256,
                                                                    n_ff=256, n_head=4, n_head_kv=2))
    runs = []
    real_run = ops.finish_attention_run
    monkeypatch.setattr(ops, "finish_attention_run", lambda *a, **k: (runs.append(a[0].shape[0]), real_run(*a, **k)))
    with gguf_reader.open(path) as f:
        fm = build_model(f, n_ctx=128, n_threads=1, kv_type=kv_type)
        _check_verify_equals_decode(fm, list(range(3, 40)), [11, 12, 13, 14, 15, 16, 17, 18, 19], reject_at=3)
    assert runs == ([] if kv_type == "q8_0" else [9] * len(fm.layers))


def test_several_sequences_verified_together_equal_their_decode_steps(tmp_path, monkeypatch):
    """forward_verify_multi (the server's verification: every sequence's rows in one forward) on a KVPool: each
    sequence's rows equal its decode steps bit for bit, a sequence of one row decodes as forward_multi's do, and the
    rows of each several-row sequence go to attention as one run."""
    from edgellm.engine.kvcache import KVPool
    path = write_loadable_tiny_model(tmp_path / "m.gguf", tiny_spec(seed=3, weight_type="Q8_0", n_embd=256,
                                                                    n_ff=256, n_head=4, n_head_kv=2))
    runs = []
    real_run = ops.finish_attention_run
    monkeypatch.setattr(ops, "finish_attention_run", lambda *a, **k: (runs.append(a[0].shape[0]), real_run(*a, **k)))
    with gguf_reader.open(path) as f:
        fm = build_model(f, n_ctx=128, n_threads=1)
        cfg = fm.config
        pool = KVPool(3, 64, cfg.n_head_kv, cfg.head_dim, [kv.window for kv in fm.cache.layers], fm.n_batch,
                      fm.cache.kv_type)
        prompts = [list(range(3, 20)), list(range(30, 35)), list(range(50, 61))]
        feeds = [[70, 71, 72, 73], [80], [90, 91, 92]]
        want = []
        for prompt, fed, cache in zip(prompts, feeds, pool.caches):
            fm.forward(np.asarray(prompt, np.int32), cache=cache)
            n0 = cache.n_past
            want += [fm.forward(np.array([t], np.int32), cache=cache)[-1].copy() for t in fed]
            cache.truncate(n0)
        runs.clear()
        rows = fm.forward_verify_multi(feeds, pool.caches)
    assert len(rows) == len(want) and all(np.array_equal(r, w) for r, w in zip(rows, want))
    assert runs == [4, 3] * len(fm.layers)


def test_rollback_in_a_wrapped_window_ring(tmp_path):
    """Gemma-3 layout, window 5 and batches of 8: each ring holds 12 slots, the prompt wraps it, and the drafted
    rows overwrite slots of positions that the rollback must leave out of every later window."""
    spec = TinySpec(arch="gemma3", weight_type="Q8_0", n_layer=7, n_embd=64, n_head=2, n_head_kv=1, head_dim=32,
                    sliding_window=5, seed=2)
    path = tmp_path / "g.gguf"
    write_tiny_model(path, spec)
    with gguf_reader.open(path) as f:
        fm = build_model(f, n_ctx=128, n_threads=1, n_batch=8)
        assert fm.cache.layers[0].slot_pos.shape[0] == 5 + 8 - 1
        for reject_at in (0, 2, 7):
            _check_verify_equals_decode(fm, list(range(3, 30)), [40, 41, 42, 43, 44, 45, 46, 47], reject_at)


# --- greedy: the same tokens as plain decoding ---------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [REPEATING, "STOP or go go go go go", "ll he"])
def test_greedy_lookup_gives_plain_greedy_output(tiny, prompt):
    plain = _run(tiny, prompt, max_tokens=60, ignore_eos=True, speculative=None)
    spec = _run(tiny, prompt, max_tokens=60, ignore_eos=True, speculative="lookup")
    _same(plain, spec)
    c = spec[0]
    assert c.speculative == "lookup" and plain[0].speculative is None
    assert tiny.timings.draft_tokens == c.draft_tokens and tiny.timings.accepted_tokens == c.accepted_tokens


def _verification_costs_a_plain_step(monkeypatch):
    """Every forward costed alike (ForwardCosts): drafts as long as the find and the room allow, whatever this host's
    timings of the tiny model."""
    monkeypatch.setattr(ForwardCosts, "plain_s", lambda self, n_seqs: 1e-3)
    monkeypatch.setattr(ForwardCosts, "forward_s", lambda self, n_seqs, rows: 1e-3)


def test_lookup_drafts_are_accepted_on_repeating_text(tiny, monkeypatch):
    _verification_costs_a_plain_step(monkeypatch)  # so drafting does not hang on this host's timings
    c = tiny.complete(REPEATING, max_tokens=80, ignore_eos=True, speculative="lookup")
    assert c.accepted_tokens > 0 and c.draft_tokens >= c.accepted_tokens
    # whatever was drafted, each token came from the target: cache bookkeeping matches what it holds
    assert len(tiny._cached_tokens) == tiny.model.cache.n_past
    assert tiny._cached_tokens == tiny.tokenize(REPEATING)[:len(tiny._cached_tokens)] + \
        c.tokens[:len(tiny._cached_tokens) - len(tiny.tokenize(REPEATING))]


def test_stop_strings_logprobs_and_stream_compose(tiny):
    kw = dict(max_tokens=60, ignore_eos=True, logprobs=2, stop=["or h"])
    plain = tiny.complete(REPEATING, speculative=None, **kw)
    spec = tiny.complete(REPEATING, speculative="lookup", **kw)
    assert (spec.tokens, spec.text, spec.stop_reason) == (plain.tokens, plain.text, plain.stop_reason)
    assert [(i.logprob, i.top_logprobs) for i in spec.token_info] == \
        [(i.logprob, i.top_logprobs) for i in plain.token_info]
    pieces = list(tiny.stream(REPEATING, speculative="lookup", max_tokens=60, ignore_eos=True))
    assert "".join(pieces) == tiny.complete(REPEATING, max_tokens=60, ignore_eos=True).text


def test_a_grammar_masks_every_verified_position(tiny):
    """The mask applies at each verified row with the grammar advanced by the tokens accepted before it."""
    kw = dict(max_tokens=40, regex="(hello world ){2}(or )+")
    plain = _run(tiny, REPEATING, speculative=None, **kw)
    spec = _run(tiny, REPEATING, speculative="lookup", **kw)
    _same(plain, spec)
    assert spec[0].text.startswith("hello world hello world or")


def test_the_model_default_and_per_call_override(tiny_paths):
    m = edgellm.load(str(tiny_paths[0]), n_ctx=256, n_threads=1, speculative="lookup")
    assert m.complete(REPEATING, max_tokens=30, ignore_eos=True).speculative == "lookup"
    assert m.complete(REPEATING, max_tokens=30, ignore_eos=True, speculative=None).speculative is None
    out = m.create_completion(REPEATING, max_tokens=30, temperature=0.0)
    details = out["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] == m.last_completion.accepted_tokens
    assert details["rejected_prediction_tokens"] == m.last_completion.draft_tokens - m.last_completion.accepted_tokens
    chat = m.create_chat_completion([{"role": "user", "content": REPEATING}], max_tokens=10, temperature=0.0,
                                    speculative=None)
    assert "completion_tokens_details" not in chat["usage"]


def test_refusals(tiny):
    with pytest.raises(SamplingError, match="speculative must be"):
        tiny.complete("hi", speculative="ngram")
    with pytest.raises(SamplingError, match="needs a draft model"):
        tiny.complete("hi", speculative="draft")
    with pytest.raises(SamplingError, match="one sequence at a time"):
        tiny.generate_batch(["hi", "or"], speculative="lookup")
    assert tiny.generate_batch(["hi"], max_tokens=3, speculative=None)  # off is accepted


# --- a draft model ------------------------------------------------------------------------------------------------

def test_draft_model_greedy_gives_plain_greedy_output(tiny_paths, tiny):
    m = edgellm.load(str(tiny_paths[0]), n_ctx=256, n_threads=1, draft_model=str(tiny_paths[1]))
    assert m.speculative == "draft"
    for prompt in (REPEATING, "ll he", "STOP or go"):
        plain = _run(tiny, prompt, max_tokens=50, ignore_eos=True, speculative=None)
        spec = _run(m, prompt, max_tokens=50, ignore_eos=True)
        _same(plain, spec)
        assert spec[0].accepted_tokens > 0
    # the draft's cache holds the target's history and at most one draft's tokens beyond (rolled back next step)
    assert m.draft_model.model.cache.n_past <= len(m._cached_tokens) + DRAFT_MAX["draft"]


def test_a_draft_model_of_another_vocabulary_is_refused(tmp_path, tiny_paths):
    md = fake_metadata()
    tokens = list(md["tokenizer.ggml.tokens"]) + ["<|extra|>"]  # one more token
    types = np.append(md["tokenizer.ggml.token_type"], 3).astype(np.int32)
    other = write_loadable_tiny_model(tmp_path / "other.gguf", tiny_spec(seed=5, n_vocab=len(tokens)),
                                      tokenizer={**md, "tokenizer.ggml.tokens": tokens,
                                                 "tokenizer.ggml.token_type": types})
    with pytest.raises(ModelError, match="same vocabulary"):
        edgellm.load(str(tiny_paths[0]), n_ctx=256, n_threads=1, draft_model=str(other))


# --- sampling: the rejection rule keeps the target's distribution -------------------------------------------------

def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("q", ["point", "distribution"])
def test_rejection_rule_samples_the_target_distribution(q):
    logits = np.array([2.0, 1.5, 0.3, 0.0, -0.5, 1.0], np.float32)
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0)
    p = Sampler(params).candidates(logits)[1]
    sampler = Sampler(params, seed=11)
    draft_rng = np.random.default_rng(12)
    q_probs = np.array([0.05, 0.05, 0.5, 0.1, 0.1, 0.2])  # far from p: many rejections
    counts = np.zeros(6)
    n = 30000
    for _ in range(n):
        if q == "point":
            counts[sampler.sample_draft(logits, (), 2)] += 1
        else:
            x = int(draft_rng.choice(6, p=q_probs))
            counts[sampler.sample_draft(logits, (), x, np.arange(6), q_probs)] += 1
    assert _chi2(counts, p) < CHI2_CRITICAL[5]
    # the test can tell: keeping every draft gives q's distribution (point: always token 2), far off
    wrong = np.bincount(draft_rng.choice(6, size=n, p=q_probs), minlength=6) if q == "distribution" else \
        np.eye(6)[2] * n
    assert _chi2(wrong, p) > 100 * CHI2_CRITICAL[5]


class MarkovDecoder(ScriptedDecoder):
    """ScriptedDecoder (logits keyed by the last token) with the verification pass and rollback."""
    n_batch = 64

    def forward_verify(self, tokens):
        return self.forward(tokens, all_logits=True)

    def truncate(self, n):
        del self.fed[n:]


def test_lookup_sampling_keeps_the_target_distribution_end_to_end():
    """Three sampled tokens after a prompt whose bigrams make lookup draft after every first token: their joint
    distribution (27 outcomes under top_k 3) is the exact one the logits give, within chi-square's bound."""
    md = fake_metadata()
    tok = Tokenizer.from_metadata(md)
    dec = MarkovDecoder(tok.n_vocab, tok.eos_id, n_ctx=256, seed=4)
    m = Model.from_parts(dec, tok, md)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    cand = Sampler(params)
    start = 100

    def step_probs(prev):
        ids, probs = cand.candidates(dec._noise[prev])
        return dict(zip(ids.tolist(), probs.tolist()))

    # the prompt holds "start t1 x y" for each likely t1, with x the right next token for one and wrong for others
    prompt = []
    for i, t1 in enumerate(step_probs(start)):
        nxt = sorted(step_probs(t1), key=step_probs(t1).get)
        prompt += [start, t1, nxt[i % len(nxt)], 50 + i]
    prompt += [7, start]
    exact = {}
    for t1, p1 in step_probs(start).items():
        for t2, p2 in step_probs(t1).items():
            for t3, p3 in step_probs(t2).items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
    keys = sorted(exact)
    counts = dict.fromkeys(keys, 0)
    drafted = 0
    for seed in range(3000):
        c = m.complete(prompt, max_tokens=3, ignore_eos=True, seed=seed, speculative="lookup", top_k=3, top_p=1.0,
                       min_p=0.0, temperature=1.0)
        counts[tuple(c.tokens)] += 1
        drafted += c.draft_tokens
    assert drafted > 1000  # drafts were really checked, most runs
    obs = np.array([counts[k] for k in keys], float)
    assert _chi2(obs, np.array([exact[k] for k in keys])) < CHI2_CRITICAL[len(keys) - 1]


def test_a_rejected_drafts_own_token_leads_the_next_draft(monkeypatch):
    """After a rejection the target's own token is not in the cache yet: it is fed as the first row of the next
    draft's verification where the lookup finds one, so a plain step runs only where no draft is made."""
    md = fake_metadata()
    tok = Tokenizer.from_metadata(md)
    dec = MarkovDecoder(tok.n_vocab, tok.eos_id, n_ctx=256, seed=4)
    m = Model.from_parts(dec, tok, md)
    # "10 11" drafts "12 13 ...", the reply turns at 13 to 30, and "12 30" drafts "20 21 ..." from the prompt's end
    prompt = [10, 11, 12, 13, 14, 15, 16, 40, 12, 30, 20, 21, 22, 23, 24, 25, 26, 41]
    reply = [10, 11, 12, 30, 20, 21, 22, 23, 50, 51]
    dec.respond(prompt, reply)
    events = []
    real_draft, real_forward = Speculator.draft, dec.forward

    def draft(self, history, *a, **kw):
        d = real_draft(self, history, *a, **kw)
        events.append("none" if d is None else "draft")
        return d

    def forward(tokens, *a, **kw):
        if events:  # the prompt's prefill comes before any draft
            events.append("plain")
        return real_forward(tokens, *a, **kw)

    monkeypatch.setattr(Speculator, "draft", draft)
    monkeypatch.setattr(dec, "forward", forward)
    monkeypatch.setattr(dec, "forward_verify", lambda tokens: real_forward(tokens, all_logits=True))
    c = m.complete(prompt, max_tokens=len(reply), ignore_eos=True, speculative="lookup")
    assert c.tokens == reply and c.accepted_tokens < c.draft_tokens  # a draft was cut short
    i = events.index("draft")
    assert events[i:i + 2] == ["draft", "draft"]  # the rejection's token led the next draft at once
    assert events.count("plain") == events.count("none")
    assert all(events[j + 1] == "plain" for j, e in enumerate(events[:-1]) if e == "none")


def test_no_draft_runs_past_max_tokens(monkeypatch):
    """A draft is cut to the tokens max_tokens still allows: a row past them would be verified for nothing."""
    md = fake_metadata()
    tok = Tokenizer.from_metadata(md)
    dec = MarkovDecoder(tok.n_vocab, tok.eos_id, n_ctx=256, seed=4)
    m = Model.from_parts(dec, tok, md)
    prompt = list(range(10, 60))
    dec.respond(prompt, prompt)  # the reply copies the prompt: every find is long and right
    sizes = []
    real = Speculator.draft

    def draft(self, history, *a, **kw):
        d = real(self, history, *a, **kw)
        if d is not None:
            sizes.append((len(history) - len(prompt), len(d.tokens) - 1))  # (tokens generated, drafted)
        return d

    monkeypatch.setattr(Speculator, "draft", draft)
    _verification_costs_a_plain_step(monkeypatch)
    for max_tokens in (9, 20, 33):
        sizes.clear()
        c = m.complete(prompt, max_tokens=max_tokens, ignore_eos=True, speculative="lookup")
        assert c.tokens == prompt[:max_tokens] and sizes
        assert all(drafted <= max_tokens - generated for generated, drafted in sizes)
        assert sizes[-1][1] == max_tokens - sizes[-1][0]  # the last draft takes exactly what is left


# --- the draft length ------------------------------------------------------------------------------------------------

def _accepting(length, p):
    """Every position's acceptance estimate set to p."""
    length.accepted = [p] * len(length.accepted)
    length.seen = [1.0] * len(length.seen)
    length.prior_weight = [0.0] * len(length.prior_weight)
    return length


def test_draft_length_grows_with_acceptance_and_pauses_without():
    good = DraftLength(12)
    first = good.want()
    for _ in range(12):
        good.update(good.want(), good.want())
    assert good.want() >= max(6, first + 3)  # every draft accepted: longer drafts
    bad = DraftLength(12)
    wants = []
    for _ in range(60):
        k = bad.want()
        wants.append(k)
        bad.update(k, 0)
    assert wants.count(0) > 45  # paused most of the time: open-ended text costs little
    bad.update(1, 1)
    assert bad.pause == DraftLength.PAUSE_FIRST  # an accepted draft ends the long pauses
    unpaused = _accepting(DraftLength(12, pauses=False), 0.05)
    _time_steps(unpaused, 1.0)
    for rows in range(2, 14):
        unpaused.timed_verification(rows, 1.0 + 0.2 * rows)
    assert [unpaused.want() for _ in range(3)] == [0, 0, 0] and unpaused.paused == 0
    for j in range(1, 13):  # seen without drafting (prompt lookup's finds against what followed): drafts at once
        for _ in range(8):
            unpaused.observe(j, True)
    assert unpaused.want() >= 8


def test_draft_length_weighs_the_batch():
    # a decode step of n sequences costs 1 + 0.3 (n - 1) single steps, and each drafted row 0.3 more
    def timed(n_seqs, p=0.6):
        length = _accepting(DraftLength(8), p)
        _time_steps(length, 1.0, 1)
        _time_steps(length, 1.9, 4)
        for extra in range(1, 9):
            length.timed_verification(n_seqs + extra, (1.0 if n_seqs == 1 else 1.9) + 0.3 * extra, n_seqs)
        return length
    assert timed(1).want(1) >= 1  # alone, a draft accepted 60% of the time pays for its rows
    assert timed(4).want(4) == 0  # in a batch of 4 the same rows slow four sequences' step for too few tokens
    assert timed(4, 0.95).want(4) >= 2  # copying text: the draft still pays for the batch
    # a batch size not timed plainly: the nearest one's step, scaled as 1 + 0.3 (n - 1) single steps
    scaled = DraftLength(8)
    _time_steps(scaled, 1.0, 1)
    assert scaled.plain_s(4) == pytest.approx(1.9) and scaled.plain_s(1) == 1.0


def test_draft_length_follows_timed_costs_by_rows():
    """Forwards cost far from linearly in their rows (the matmuls' token tiles): each size is timed, so a draft of
    3 (4 rows) is taken where 4 rows cost less than 3, and a size between two timed ones is interpolated."""
    length = _accepting(DraftLength(8), 0.9)
    _time_steps(length, 1.0, 1)
    for rows, seconds in ((2, 1.8), (3, 2.6), (4, 1.9), (8, 2.7)):
        for _ in range(2):  # (a first timing far above the estimate is not kept: see the next test)
            length.timed_verification(rows, seconds)
    assert length.want(1, available=3) == 3  # 4 rows: 3.7 tokens for 1.9 steps
    assert length.want(1, available=2) == 1  # 3 rows would cost 2.6 steps for 2.7 tokens: 1 (1.9 for 1.8) is better
    assert length.forward_s(1, 6) == pytest.approx(ForwardCosts.UNTIMED * (1.9 + 0.8 * 2 / 4))
    assert length.forward_s(1, 4) == 1.9 and length.forward_s(1, 1) == 1.0
    linear = _accepting(DraftLength(8), 0.9)  # before any verification: a row costs BETA_START of a step
    _time_steps(linear, 1.0, 1)
    assert linear.forward_s(1, 3) == pytest.approx(ForwardCosts.UNTIMED * (1 + 2 * ForwardCosts.BETA_START))


def test_a_slow_first_timing_is_timed_again():
    """A process's first forward of a size also loads its kernels: a first timing far above what the timed sizes
    suggest is not kept (the size stays untimed, and worth trying), the next one is, however slow; a first timing
    near the estimate is kept at once; with nothing timed to compare it with, it is timed again."""
    length = _accepting(DraftLength(8), 0.9)
    _time_steps(length, 1.0, 1)
    length.timed_verification(3, 1.6)
    assert length.want(1, available=3) == 3  # 4 rows untimed: 0.8 of the 1.9 extrapolated
    length.timed_verification(4, 2.9)  # the first 4-row forward, loading its kernels
    assert 4 not in length.costs.verified and length.want(1, available=3) == 3
    length.timed_verification(4, 1.7)
    assert length.costs.verified[4] == 1.7 and length.want(1, available=3) == 3
    again = _accepting(DraftLength(8), 0.9)
    _time_steps(again, 1.0, 1)
    again.timed_verification(3, 1.6)
    again.timed_verification(4, 2.9)
    again.timed_verification(4, 2.9)  # slow twice: that is its cost
    assert again.costs.verified[4] == 2.9 and again.want(1, available=3) < 3
    kept = DraftLength(8).costs
    _time_steps(kept, 1.0, 1)
    kept.timed_verification(3, 1.6)
    kept.timed_verification(5, 2.3)  # 1.25 x the 2.2 extrapolated: kept
    assert kept.verified == {3: 1.6, 5: 2.3}
    first = DraftLength(8).costs  # nothing timed yet to check the first one with: timed again
    first.timed_verification(2, 2.5)
    assert first.verified == {}
    first.timed_verification(2, 2.5)
    assert first.verified == {2: 2.5}
    loading = ForwardCosts()  # a process's first step loads its kernels: not kept, so no check for the first
    loading.timed_step(5.0)  # verification either, which also loads its kernels
    loading.timed_verification(4, 2.6)
    assert loading.steps == {} and loading.verified == {}
    loading.timed_step(1.0)
    loading.timed_verification(4, 2.6)  # (timed again: kept, however slow)
    assert loading.steps == {1: 1.0} and loading.verified == {4: 2.6}
    plain_only = DraftLength(8).costs  # a plain step timed: 3 rows guessed at 1 + 2 BETA_START steps
    _time_steps(plain_only, 1.0, 1)
    plain_only.timed_verification(3, 1.9)
    plain_only.timed_verification(5, 3.6)  # above 1.25 x 2.8 (1.9 and 0.45 a row)
    assert plain_only.verified == {3: 1.9}


def test_a_position_never_reached_is_judged_as_the_one_before():
    """Open text: the first drafted token is rejected every time, so the later positions are never tried. Their
    estimates follow the first one down instead of keeping the start value: no long draft is bet on them."""
    length = DraftLength(8, pauses=False)
    _time_steps(length, 1.0, 1)
    for rows in range(2, 10):
        length.timed_verification(rows, 1.0 + 0.1 * (rows - 1))  # cheap rows: only acceptance holds drafts back
    assert length.want() >= 6  # nothing seen yet: every position at the start value
    for _ in range(6):
        length.observe(1, False)
    p = length.estimates(8)
    assert p[0] < 0.3 and all(later <= p[0] + 1e-12 for later in p[1:])
    assert length.want() == 0
    # a position seen often keeps its own estimate: copied text after a first token that is often wrong
    for _ in range(20):
        length.observe(2, True)
    assert length.p(2) > 0.9 and length.p(3) <= length.p(2)


def test_a_draft_needs_more_than_a_marginal_gain():
    length = _accepting(DraftLength(4, pauses=False), 0.1)
    _time_steps(length, 1.0, 1)
    length.timed_verification(2, 1.07)  # one drafted row: 1.1 tokens for 1.07 steps, a 3% gain
    assert length.best(1, available=1) == (0, 1.0) and length.want(1, available=1) == 0
    length.timed_verification(2, 0.6)  # now clearly worth it (running average 0.93)
    assert length.want(1, available=1) == 1


def test_lookup_counts_what_followed_its_finds():
    """Prompt lookup's finds are compared with the tokens that followed, drafted or not: after open text (drafting
    off), copying is seen as it starts and drafting resumes without a probe."""
    spec = Speculator("lookup", None, PromptLookup())
    _accepting(spec.length, 0.02)
    _time_steps(spec.length, 1.0)
    for rows in range(2, 14):
        spec.length.timed_verification(rows, 1.0 + 0.2 * rows)
    text = list(range(100, 140))
    history = text + [7]
    assert spec.propose(history, 8) is None  # nothing found yet
    history += text[:3]  # the text starts again: found, but not worth a draft at 2%
    assert spec.propose(history, 8) is None
    for t in text[3:12]:  # decoded plainly, and every find was right
        history.append(t)
        spec.propose(history, 8)
    assert spec.length.p(1) > 0.8 and spec.drafted == 0
    drafted = spec.propose(history + [text[12]], 8)
    assert drafted is not None and drafted[0] == text[13:13 + len(drafted[0])] and len(drafted[0]) >= 4


def test_draft_length_bounds():
    length = _accepting(DraftLength(5, 3), 0.4)  # alone, the best draft is short
    assert length.best()[0] < 3 and length.want() == 3  # a draft is at least k_min long
    assert DraftLength(0).want() == 0  # draft_max 0: speculation off


def test_prompt_lookup_drafts_the_latest_continuation():
    lookup = PromptLookup(n_max=3, n_min=2)
    h = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 2, 3]
    assert lookup.propose(h, 3) == [5, 6, 7]  # (2, 3) last continued by 5 6 7, the latest occurrence
    h += [5, 6]
    assert lookup.propose(h, 2) == [7, 2]  # (5, 6) -> 7 2; the index was extended, not rebuilt
    assert PromptLookup().propose([1, 2, 3, 4], 4) == []


def test_prompt_lookup_drafts_from_the_longest_matching_suffix():
    """The longest suffix that occurred before wins over a later occurrence of a shorter one, and find() says how
    long the match was (up to 8 tokens by default)."""
    h = [1, 2, 3, 4, 5, 6, 70, 71, 9, 5, 6, 80, 81, 7, 3, 4, 5, 6]
    assert PromptLookup().find(h, 2) == ([70, 71], 4)  # (3, 4, 5, 6) -> 70 71, not the later (5, 6) -> 80 81
    assert PromptLookup(n_max=2).find(h, 2) == ([80, 81], 2)
    copied = list(range(100, 120))
    assert PromptLookup().find(copied + [0] + copied[:12], 3) == ([112, 113, 114], 8)
    assert PromptLookup().find([1, 2, 3], 3) == ([], 0)
    assert [match_class(n) for n in (2, 3, 4, 8)] == [0, 1, 2, 2]


def test_lookup_judges_its_finds_by_match_length():
    """Finds after long matches are right, finds after 2-token matches wrong: the speculator drafts after the long
    ones and decodes plainly after the short ones, where one estimate for all finds would treat both alike."""
    spec = Speculator("lookup", None, PromptLookup())
    _time_steps(spec.length, 1.0)
    for rows in range(2, 14):
        spec.length.timed_verification(rows, 1.0 + 0.15 * rows)
    for _ in range(30):
        for j in range(1, 6):  # a long match's drafts: every position right
            spec.by_match[2].observe(j, True)
            spec.length.observe(j, True)
        spec.by_match[0].observe(1, False)  # a 2-token match's: the first token wrong
        spec.length.observe(1, False)
    assert 0.4 < spec.length.p(1) < 0.6  # pooled over both kinds of find
    long_text = list(range(100, 130))
    history = long_text + [7] + long_text[:10]  # the last 8 tokens occurred before: a long match
    drafted = spec.propose(history, 12)
    assert drafted is not None and drafted[0] == long_text[10:10 + len(drafted[0])] and len(drafted[0]) >= 5
    history += [55, 56, 57, 200, 201, 55, 56]  # only the last 2 tokens occurred before
    assert spec.drafter.find(history, 3) == ([57, 200, 201], 2) and spec.propose(history, 12) is None


def test_forward_costs_are_kept_across_generations_and_stale_sizes_forgotten():
    costs = ForwardCosts()
    costs.start_generation()
    _time_steps(costs, 1.0)
    costs.timed_verification(4, 1.6)  # the first timing of a size with a plain step to check it against: kept
    costs.timed_verification(8, 2.2)
    for _ in range(ForwardCosts.KEEP_GENERATIONS):  # generations that draft only 3 tokens
        costs.start_generation()
        costs.timed_verification(4, 1.6)
    assert set(costs.verified) == {4, 8}  # the 8-row time is KEEP_GENERATIONS generations old: still kept
    costs.start_generation()
    assert set(costs.verified) == {4} and costs.steps == {1: 1.0}  # one more without it: forgotten, tried again


def test_a_models_speculation_keeps_its_forward_costs_across_calls(tiny):
    tiny.complete(REPEATING, max_tokens=24, speculative="lookup")
    costs = tiny._spec_costs["lookup"]
    assert costs.steps or costs.verified  # the call timed its forwards
    before, seen = costs.generation, []
    real = Speculator.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append(self.length.costs)
    Speculator.__init__ = spy
    try:
        tiny.complete(REPEATING, max_tokens=8, speculative="lookup")
    finally:
        Speculator.__init__ = real
    assert seen == [costs] and costs.generation == before + 1  # the next call started from the same table


def test_saved_forward_costs_load_with_their_costs_and_go_on_forgetting():
    here = ForwardCosts()
    here.start_generation()
    _time_steps(here, 1.0)
    here.timed_verification(4, 1.6)
    here.timed_verification(8, 2.2)
    for _ in range(ForwardCosts.KEEP_GENERATIONS - 1):  # generations that draft only 3 tokens
        here.start_generation()
        here.timed_verification(4, 1.6)
    there = ForwardCosts()  # a later process's table
    there.load(json.loads(json.dumps(here.saved())))  # (through JSON, as on disk)
    assert there.steps == here.steps and there.verified == here.verified
    assert there.forward_s(1, 8) == here.forward_s(1, 8) and there.forward_s(1, 6) == here.forward_s(1, 6)
    for table in (here, there):  # the 8-row time is as old in both: kept one more generation, then forgotten
        table.start_generation()
        table.timed_verification(4, 1.6)
        assert set(table.verified) == {4, 8}
        table.start_generation()
        assert set(table.verified) == {4}
        table.timed_verification(8, 2.3)  # tried again: timed as a new size
        assert table.verified[8] == 2.3


def test_a_loaded_sizes_first_timing_here_is_dropped_when_far_above_it():
    saved = ForwardCosts()
    _time_steps(saved, 1.0)
    saved.timed_verification(4, 1.6)
    costs = ForwardCosts()
    costs.load(saved.saved())
    costs.start_generation()
    costs.timed_step(5.0)  # the process's first plain step also loads its kernels
    costs.timed_verification(4, 9.0)
    assert costs.steps == {1: 1.0} and costs.verified == {4: 1.6}
    costs.timed_step(2.0)  # later timings count as ever
    costs.timed_verification(4, 2.6)
    assert costs.steps[1] == pytest.approx(1.3) and costs.verified[4] == pytest.approx(1.9)
    fresh = ForwardCosts()  # a loaded size timed near its cost counts at once
    fresh.load(saved.saved())
    fresh.timed_verification(4, 1.8)
    assert fresh.verified[4] == pytest.approx(0.7 * 1.6 + 0.3 * 1.8)


@pytest.mark.parametrize("bad", [
    None, [], {}, {"steps": {}}, {"steps": [], "verified": {}},
    {"steps": {"1": 0.01}, "verified": {"0": [0.02, 0]}},  # no size 0
    {"steps": {"x": 0.01}, "verified": {}},
    {"steps": {"1": -0.01}, "verified": {}},
    {"steps": {"1": float("nan")}, "verified": {}},
    {"steps": {"1": True}, "verified": {}},
    {"steps": {"1": 0.01}, "verified": {"4": 0.02}},  # no age
    {"steps": {"1": 0.01}, "verified": {"4": [0.02, -1]}},
    {"steps": {"1": 0.01}, "verified": {"4": [0.02, 1.5]}},
    {"steps": {"1": 0.01}, "verified": {"99999": [0.02, 0]}},
])
def test_a_malformed_saved_table_is_refused_whole(bad):
    costs = ForwardCosts()
    _time_steps(costs, 1.0)
    with pytest.raises(ValueError):
        costs.load(bad)
    assert costs.steps == {1: 1.0} and costs.verified == {} and not costs.loaded


def test_a_models_forward_costs_are_kept_on_disk_for_the_next_process(tiny_paths, tmp_path, monkeypatch):
    from edgellm.generation import cost_store
    monkeypatch.setenv(cost_store.ENV, str(tmp_path / "costs"))
    first = edgellm.load(str(tiny_paths[0]), n_ctx=256, n_threads=1)
    text = first.generate(REPEATING, max_tokens=24, speculative="lookup", ignore_eos=True)
    written = first._spec_costs["lookup"].saved()
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text()) == written and written["verified"]

    seen = []
    real = Speculator.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append((dict(self.length.costs.steps), dict(self.length.costs.verified)))
    monkeypatch.setattr(Speculator, "__init__", spy)
    second = edgellm.load(str(tiny_paths[0]), n_ctx=256, n_threads=1)  # as a new process would
    assert second.generate(REPEATING, max_tokens=24, speculative="lookup", ignore_eos=True) == text
    steps, verified = seen[0]  # what its first generation started from: the first model's table
    assert steps == {int(n): c for n, c in written["steps"].items()}
    assert verified == {int(r): c for r, (c, _) in written["verified"].items()}

    two_threads = edgellm.load(str(tiny_paths[0]), n_ctx=256, n_threads=2)  # another set-up: a table of its own
    two_threads.generate(REPEATING, max_tokens=8, speculative="lookup")
    assert not seen[-1][0] and not seen[-1][1] and len(list((tmp_path / "costs").glob("*.json"))) == 2


def test_a_bad_cost_file_is_ignored_and_replaced_old_ones_pruned_and_off_keeps_none(tiny_paths, tmp_path, monkeypatch):
    from edgellm.generation import cost_store
    monkeypatch.setenv(cost_store.ENV, str(tmp_path))
    m = edgellm.load(str(tiny_paths[0]), n_ctx=256, n_threads=1)
    path = m._spec_cost_path("lookup")
    path.write_text('{"steps": {"1": 0.01}, "verified": {"4": [0.02')  # cut short
    plain = m.generate(REPEATING, max_tokens=24, ignore_eos=True)
    assert m.generate(REPEATING, max_tokens=24, speculative="lookup", ignore_eos=True) == plain
    assert json.loads(path.read_text()) == m._spec_costs["lookup"].saved()  # replaced by this run's table

    stale = tmp_path / "an-old-version.json"
    stale.write_text("{}")
    os.utime(stale, (0, 0))  # unused for decades: removed when a new table is made
    recent = tmp_path / "another-model.json"
    recent.write_text("{}")
    path.unlink()
    m.generate(REPEATING, max_tokens=8, speculative="lookup")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, recent.name])
    recent.unlink()
    with monkeypatch.context() as pinned:  # kernels compiled for another target: a table of their own
        pinned.setenv("NUMBA_CPU_NAME", "znver3")
        assert m._spec_cost_path("lookup") not in (path, None)

    monkeypatch.setenv(cost_store.ENV, "off")
    off = edgellm.load(str(tiny_paths[0]), n_ctx=256, n_threads=1)
    assert off._spec_cost_path("lookup") is None
    off.generate(REPEATING, max_tokens=24, speculative="lookup", ignore_eos=True)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


# --- the command line --------------------------------------------------------------------------------------------

def test_cli_run_lookup_prints_plain_greedy_text(tiny_paths, tiny, capsys):
    from edgellm import cli
    argv = ["run", str(tiny_paths[0]), "-p", REPEATING, "-n", "40", "--no-echo", "-t", "1", "-c", "256",
            "--ignore-eos"]
    assert cli.main(argv + ["--lookup"]) == 0
    out = capsys.readouterr()
    assert out.out == tiny.generate(REPEATING, max_tokens=40, ignore_eos=True) + "\n"
    assert "drafted" in out.err  # the timing line counts the drafts


def test_cli_bench_lookup_reports_every_task(tiny_paths, capsys):
    from edgellm import cli
    from edgellm.prep.speculative_bench import TASKS
    assert cli.main(["bench", str(tiny_paths[0]), "--lookup", "-n", "12", "-r", "1", "-t", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + sum(len(t) for t in TASKS.values())
    cells = [[c.strip() for c in row.strip("| ").split("|")] for row in rows]
    assert cells[0][-2:] == ["identical", "bound"]
    assert all(c[-2] == "yes" for c in cells[1:])  # identical greedy output on every task
    assert all(float(c[-1].rstrip("x")) >= 1.0 for c in cells[1:])  # drafting nothing is always a plan


def test_forward_costs_time_every_size_and_leave_the_cache_empty(tiny):
    from edgellm.prep.speculative_bench import forward_costs
    ids = tiny.tokenize(REPEATING)
    costs = forward_costs(tiny, ids, 5, repeats=1)
    assert sorted(costs) == [1, 2, 3, 4, 5] and all(c > 0 for c in costs.values())
    assert tiny.model.cache.n_past == 0 and tiny._cached_tokens == []
    assert sorted(forward_costs(tiny, ids * 20, 5, repeats=1)) == [1, 2, 3, 4, 5]  # a prompt past the context
    assert forward_costs(tiny, ids, tiny.model.cache.n_ctx) is None  # rows that cannot fit: no timing, no error


def test_the_foresight_bound_is_the_cheapest_plan():
    """An output that copies its prompt: a plain step (no find after the first token), then the find "3 4 5 6 ..."
    after "1 2", of which 4 tokens are right; the cheapest plan drafts 3 (4 rows: 3 accepted and the target's
    next ends it), so 5 tokens cost 1 + 1.3 steps."""
    from edgellm.prep.speculative_bench import foresight_bound
    ids = tokens = [1, 2, 3, 4, 5, 6]
    rising = {r: 1.0 + 0.1 * (r - 1) for r in range(1, 14)}
    assert foresight_bound(ids, tokens, rising, 12) == pytest.approx(5 / 2.3)
    assert foresight_bound(ids, tokens, {r: float(r) for r in range(1, 14)}, 12) == 1.0  # a row costs a step
    assert foresight_bound([1, 2, 3], [7, 8, 9, 10], rising, 12) == 1.0  # nothing found to draft

"""The sampling chain: each stage against a plain numpy reference, the whole chain, the draw, params, logprobs."""
import math
import time

import numpy as np
import pytest

from edgellm.errors import SamplingError
from edgellm.generation.sampling import (Candidates, Sampler, SamplingParams, apply_penalties, log_softmax,
                                         min_p_filter, top_k_filter, top_k_indices, top_p_filter, token_logprobs,
                                         typical_filter)

# 5-sigma of a binomial frequency at N draws is 5*sqrt(p(1-p)/N) <= 5*0.5/sqrt(N); N = 20000 gives 0.018
N_DRAWS = 20_000
FREQ_TOL = 0.018
# log-softmax is computed with a float64 log-sum-exp and returned as float32: a few float32 ulps of |logp|
LOGPROB_TOL = 1e-5
# a full sort of 262,144 logits alone takes ~10 ms here; the partition path takes ~0.3 ms. 5 ms catches a regression
# to sorting without flaking on a busy 2-core machine
MAX_SAMPLE_SECONDS_262K = 5e-3

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0)  # every filter disabled


# --- independent references: full sorts, python loops, float64 -------------------------------------------------

def ref_order(logits, ids=None):
    ids = range(len(logits)) if ids is None else ids
    return sorted(ids, key=lambda i: (-float(logits[i]), i))


def ref_softmax(values):
    v = np.asarray(values, dtype=np.float64)
    e = np.exp(v - v.max())
    return e / e.sum()


def ref_top_k(logits, ids, k):
    order = ref_order(logits, ids)
    return order if k <= 0 else order[:k]


def ref_top_p(logits, ids, p):
    if p >= 1.0:
        return list(ids)
    order = ref_order(logits, ids)
    probs = ref_softmax([logits[i] for i in order])
    total = 0.0
    for n, q in enumerate(probs, start=1):
        total += q
        if total >= p:
            return order[:n]
    return order


def ref_min_p(logits, ids, p):
    if p <= 0.0:
        return list(ids)
    probs = ref_softmax([logits[i] for i in ids])
    return [i for i, q in zip(ids, probs) if q >= p * probs.max()]


def ref_typical(logits, ids, p):
    if p >= 1.0:
        return list(ids)
    order = ref_order(logits, ids)
    probs = ref_softmax([logits[i] for i in order])
    entropy = -sum(q * math.log(q) for q in probs)
    by_typicality = sorted(range(len(order)), key=lambda j: (abs(-math.log(probs[j]) - entropy), j))
    total = 0.0
    for n, j in enumerate(by_typicality, start=1):
        total += probs[j]
        if total > p:
            return [order[j] for j in by_typicality[:n]]
    return [order[j] for j in by_typicality]


def full(logits):
    return Candidates.full(np.asarray(logits, dtype=np.float32))


# --- top-k -------------------------------------------------------------------------------------------------------

FIXED = np.array([1.0, 3.0, 3.0, 2.0, 3.0, 0.0, -1.0, 2.5], dtype=np.float32)


@pytest.mark.parametrize("k, expected", [
    (1, [1]),                    # three-way tie at 3.0: the lowest id wins
    (2, [1, 2]),
    (3, [1, 2, 4]),
    (4, [1, 2, 4, 7]),
    (8, [1, 2, 4, 7, 3, 0, 5, 6]),
    (100, [1, 2, 4, 7, 3, 0, 5, 6]),  # k beyond the vocabulary keeps everything, sorted
])
def test_top_k_fixed_with_ties(k, expected):
    out = top_k_filter(full(FIXED), k)
    assert out.ids.tolist() == expected
    assert out.is_sorted
    np.testing.assert_array_equal(out.logits, FIXED[expected])


def test_top_k_zero_is_off():
    cand = full(FIXED)
    assert top_k_filter(cand, 0) is cand


@pytest.mark.parametrize("n", [7, 1000, 49152, 262144, 262147])
@pytest.mark.parametrize("k", [1, 40, 333])
def test_top_k_indices_exact_against_full_sort(n, k):
    rng = np.random.default_rng(n + k)
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    x[rng.integers(0, n, 30)] = x.max()  # ties at the very top
    x[rng.integers(0, n, 200)] = np.float32(np.sort(x)[-min(k, n)])  # ties right at the cut
    expected = np.lexsort((np.arange(n), -x))[:k]
    np.testing.assert_array_equal(top_k_indices(x, k), expected)


def test_top_k_indices_peaked_and_constant():
    x = np.full(100_000, -30.0, dtype=np.float32)
    x[12345] = 10.0
    assert top_k_indices(x, 3).tolist() == [12345, 0, 1]
    assert top_k_indices(np.zeros(5000, np.float32), 4).tolist() == [0, 1, 2, 3]


# --- top-p / min-p / typical -----------------------------------------------------------------------------------

RANDOM_LOGITS = (np.random.default_rng(7).standard_normal(64) * 2).astype(np.float32)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 0.95, 0.999])
def test_top_p_matches_reference(p):
    out = top_p_filter(full(RANDOM_LOGITS), p)
    assert out.ids.tolist() == ref_top_p(RANDOM_LOGITS, range(64), p)


def test_top_p_one_is_off_and_zero_keeps_the_best():
    cand = full(RANDOM_LOGITS)
    assert top_p_filter(cand, 1.0) is cand
    assert top_p_filter(cand, 0.0).ids.tolist() == [int(np.argmax(RANDOM_LOGITS))]


def test_top_p_large_vocab_head_and_full_sort_paths():
    rng = np.random.default_rng(3)
    peaked = (rng.standard_normal(50_000) * 6).astype(np.float32)  # the top 256 hold > 0.95: the shortcut
    flat = (rng.standard_normal(50_000) * 0.5).astype(np.float32)  # they do not: the full sort
    for x in (peaked, flat):
        out = top_p_filter(full(x), 0.95)
        assert out.ids.tolist() == ref_top_p(x, range(x.size), 0.95)


@pytest.mark.parametrize("p", [0.0, 0.01, 0.05, 0.2, 0.6, 1.0])
def test_min_p_matches_reference(p):
    out = min_p_filter(full(RANDOM_LOGITS), p)
    assert sorted(out.ids.tolist()) == sorted(ref_min_p(RANDOM_LOGITS, list(range(64)), p))


def test_min_p_zero_is_off_and_one_keeps_the_maxima():
    cand = full(FIXED)
    assert min_p_filter(cand, 0.0) is cand
    assert sorted(min_p_filter(cand, 1.0).ids.tolist()) == [1, 2, 4]  # all three tied maxima


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 0.8, 0.95])
def test_typical_matches_reference(p):
    out = typical_filter(full(RANDOM_LOGITS), p)
    assert out.ids.tolist() == ref_typical(RANDOM_LOGITS, range(64), p)


def test_typical_one_is_off():
    cand = full(RANDOM_LOGITS)
    assert typical_filter(cand, 1.0) is cand


def test_typical_keeps_typical_not_top_tokens():
    # one dominant token and a flat tail: the entropy is high enough that the top token is atypical
    x = np.array([5.0] + [0.0] * 200, dtype=np.float32)
    kept = typical_filter(full(x), 0.5).ids.tolist()
    assert 0 not in kept and len(kept) > 1


# --- penalties --------------------------------------------------------------------------------------------------

def test_penalties_formula():
    x = np.array([2.0, -2.0, 1.0, 0.0, 4.0], dtype=np.float32)
    history = [0, 1, 1, 3, 0, 0]
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(x, history, p)
    # token 0: seen 3x, positive -> /2 then -3*0.5-0.25; token 1: 2x, negative -> *2; token 3: logit 0 -> *2 = 0
    expected = [2.0 / 2 - 1.5 - 0.25, -2.0 * 2 - 1.0 - 0.25, 1.0, 0.0 - 0.5 - 0.25, 4.0]
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(x, [2.0, -2.0, 1.0, 0.0, 4.0])  # the caller's logits are untouched


def test_penalties_window_and_switches():
    x = np.array([1.0, 1.0, 1.0], dtype=np.float32)
    history = [0, 1, 2, 2]
    last2 = apply_penalties(x, history, SamplingParams(repeat_penalty=2.0, repeat_last_n=2))
    np.testing.assert_array_equal(last2, [1.0, 1.0, 0.5])  # only the last two tokens count
    whole = apply_penalties(x, history, SamplingParams(repeat_penalty=2.0, repeat_last_n=-1))
    np.testing.assert_array_equal(whole, [0.5, 0.5, 0.5])
    assert apply_penalties(x, history, SamplingParams(repeat_penalty=2.0, repeat_last_n=0)) is x
    assert apply_penalties(x, history, SamplingParams()) is x  # the defaults penalise nothing


def test_penalties_reject_out_of_vocab_history():
    with pytest.raises(SamplingError, match="token id 7"):
        apply_penalties(np.zeros(5, np.float32), [1, 7], SamplingParams(repeat_penalty=1.1))


def test_penalty_changes_greedy_choice():
    x = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.5))
    assert sampler.sample(x, history=[]) == 0
    assert sampler.sample(x, history=[0]) == 1


# --- the whole chain, greedy, the draw --------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(top_k=10, top_p=0.8, min_p=0.1),
    SamplingParams(top_k=0, top_p=0.9, min_p=0.0, typical_p=0.7),
    SamplingParams(top_k=30, typical_p=0.9, top_p=1.0, min_p=0.2),
])
def test_chain_survivors_match_composed_references(params):
    x = (np.random.default_rng(11).standard_normal(500) * 3).astype(np.float32)
    ids = ref_top_k(x, range(500), params.top_k)
    ids = ref_typical(x, ids, params.typical_p)
    ids = ref_top_p(x, ids, params.top_p)
    ids = ref_min_p(x, ids, params.min_p)
    got_ids, probs = Sampler(params, seed=0).candidates(x)
    assert sorted(got_ids.tolist()) == sorted(ids)
    expected = ref_softmax([float(x[i]) / params.temperature for i in got_ids])
    np.testing.assert_allclose(probs, expected, rtol=1e-9, atol=0)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_greedy_is_argmax_with_lowest_id_on_ties(temperature):
    x = np.array([0.5, 2.0, -1.0, 2.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=temperature), seed=123)
    assert all(sampler.sample(x) == 1 for _ in range(20))


def test_seeded_determinism_and_different_seeds():
    x = np.linspace(-1, 1, 50).astype(np.float32)
    params = SamplingParams(temperature=1.5, **OFF)
    run1, run2, other = Sampler(params, seed=42), Sampler(params, seed=42), Sampler(params, seed=43)
    seq1 = [run1.sample(x) for _ in range(200)]
    assert [run2.sample(x) for _ in range(200)] == seq1
    assert [other.sample(x) for _ in range(200)] != seq1
    assert len(set(seq1)) > 10  # it really samples
    run1.reset()
    assert [run1.sample(x) for _ in range(200)] == seq1  # reset replays the stream


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draw_frequencies_follow_softmax(temperature):
    x = np.array([1.0, 0.0, 2.0, -1.0, 0.5], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=temperature, **OFF), seed=2024)
    counts = np.bincount([sampler.sample(x) for _ in range(N_DRAWS)], minlength=5)
    np.testing.assert_allclose(counts / N_DRAWS, ref_softmax(x / temperature), atol=FREQ_TOL)


def test_draw_respects_filters():
    x = np.array([1.0, 0.9, 0.8, -5.0, -6.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0), seed=5)
    drawn = {sampler.sample(x) for _ in range(500)}
    assert drawn == {0, 1}


def test_banned_token_at_minus_inf_is_never_drawn():
    x = np.array([0.0, -np.inf, 0.0, 0.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, **OFF), seed=9)
    drawn = {sampler.sample(x) for _ in range(2000)}
    assert drawn == {0, 2, 3}


# --- errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "0.8"),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("top_p", -0.1), ("top_p", 1.5), ("top_p", None),
    ("min_p", -0.01), ("min_p", 1.01),
    ("typical_p", 2.0), ("typical_p", -1.0),
    ("repeat_penalty", 0.0), ("repeat_penalty", -1.0), ("repeat_penalty", float("inf")),
    ("frequency_penalty", 2.5), ("frequency_penalty", -3.0),
    ("presence_penalty", 2.01), ("presence_penalty", float("nan")),
    ("repeat_last_n", -2), ("repeat_last_n", 1.0),
])
def test_invalid_params_name_the_parameter(name, value):
    with pytest.raises(SamplingError, match=name) as info:
        SamplingParams(**{name: value})
    assert isinstance(info.value, ValueError)


def test_params_defaults_match_llama_cpp_python_and_normalise_numpy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p) == (0.8, 40, 0.95, 0.05, 1.0)
    assert (p.repeat_penalty, p.frequency_penalty, p.presence_penalty, p.repeat_last_n) == (1.0, 0.0, 0.0, 64)
    q = SamplingParams(top_k=np.int64(5), top_p=np.float32(0.5))
    assert type(q.top_k) is int and type(q.top_p) is float
    with pytest.raises(Exception):
        p.top_k = 3  # frozen


@pytest.mark.parametrize("seed", [-1, 1.5, "7"])
def test_invalid_seed(seed):
    with pytest.raises(SamplingError, match="seed"):
        Sampler(SamplingParams(), seed=seed)


@pytest.mark.parametrize("bad, what", [(np.nan, "NaN"), (np.inf, r"\+Inf")])
def test_non_finite_logits_raise(bad, what):
    x = np.zeros(10, dtype=np.float32)
    x[3] = bad
    for params in (SamplingParams(), SamplingParams(temperature=0)):
        with pytest.raises(SamplingError, match=what):
            Sampler(params, seed=0).sample(x)


def test_all_minus_inf_and_bad_shapes_raise():
    with pytest.raises(SamplingError, match="-Inf"):
        Sampler(seed=0).sample(np.full(4, -np.inf, dtype=np.float32))
    with pytest.raises(SamplingError, match="1-D"):
        Sampler(seed=0).sample(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(SamplingError, match="1-D"):
        Sampler(seed=0).sample(np.zeros(0, dtype=np.float32))


# --- logprobs ---------------------------------------------------------------------------------------------------

def test_log_softmax_matches_float64_reference():
    x = (np.random.default_rng(1).standard_normal(1000) * 5).astype(np.float32)
    ref = np.log(ref_softmax(x))
    out = log_softmax(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=0, atol=LOGPROB_TOL)
    assert abs(np.exp(out.astype(np.float64)).sum() - 1.0) < 1e-5


def test_token_logprobs_chosen_and_top_n():
    x = np.array([0.0, 3.0, 1.0, 3.0, -2.0], dtype=np.float32)
    ref = np.log(ref_softmax(x))
    out = token_logprobs(x, token_id=2, top_n=3)
    assert out.token_id == 2
    assert abs(out.logprob - ref[2]) < LOGPROB_TOL
    assert out.top_ids == [1, 3, 2]
    np.testing.assert_allclose(out.top_logprobs, ref[[1, 3, 2]], atol=LOGPROB_TOL)
    assert token_logprobs(x, 0, top_n=0).top_ids == []
    with pytest.raises(SamplingError, match="outside the vocabulary"):
        token_logprobs(x, 5)
    with pytest.raises(SamplingError, match="top_n"):
        token_logprobs(x, 0, top_n=-1)


# --- speed --------------------------------------------------------------------------------------------------------

def test_sample_is_fast_at_262k_vocab():
    x = (np.random.default_rng(0).standard_normal(262_144) * 3).astype(np.float32)
    sampler = Sampler(SamplingParams(repeat_penalty=1.1), seed=0)
    history = list(range(0, 6400, 100))
    sampler.sample(x, history)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        sampler.sample(x, history)
        best = min(best, time.perf_counter() - t0)
    assert best < MAX_SAMPLE_SECONDS_262K, f"one sample took {best * 1e3:.2f} ms"

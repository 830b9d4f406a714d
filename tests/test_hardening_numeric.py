"""Numeric faults: a file whose weights load but make the logits NaN or Inf is reported with NumericalError (a
SamplingError) by every call, logits() included, before any token is sampled or a logits processor sees the
values; the model is never left busy and a later healthy call gives a fresh model's result.

Corrupt files: an F32 norm of finite but huge values (1e38) overflows every logit; one Inf Q8_0 block scale in
the output matrix spoils one logit per position. A fault injected at some positions only (the prompt, or one
decode step) checks that what came before is delivered and that healthy calls afterwards are a fresh model's.
"""
import re

import numpy as np
import pytest

import edgellm
from edgellm.errors import NumericalError, SamplingError
from hardening_tiny import tiny_spec, write_loadable_tiny_model
from helpers_tiny_gguf import random_matrix_bytes

N_CTX = 64
# A float32 that looks like any other scale but overflows the logits: 1e38 * O(1) activations summed over 64 inputs
HUGE_SCALE = 1e38
POISONED_TOKEN = ord("!")   # a byte token of the test vocabulary (token id = byte value)
Q8_0_SCALE_BYTES = slice(0, 2)  # a Q8_0 block starts with its float16 scale


def load(path):
    return edgellm.load(str(path), n_threads=1, n_ctx=N_CTX)


@pytest.fixture(scope="module")
def overflowing_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("nan") / "huge_scale.gguf"
    write_loadable_tiny_model(path, replace={"output_norm.weight": np.full(tiny_spec().n_embd, HUGE_SCALE)})
    return load(path)


@pytest.fixture(scope="module")
def inf_scale_model(tmp_path_factory):
    """An untied output matrix whose row for one token has an Inf block scale: that token's logit is never finite."""
    spec = tiny_spec(tied=False)
    output = random_matrix_bytes(np.random.default_rng(7), (spec.n_vocab, spec.n_embd), "Q8_0")
    output[POISONED_TOKEN, Q8_0_SCALE_BYTES] = np.array([np.inf], np.float16).view(np.uint8)
    path = tmp_path_factory.mktemp("nan") / "inf_scale.gguf"
    return load(write_loadable_tiny_model(path, spec, replace={"output.weight": (output, "Q8_0")}))


def inject_nan_at(m, token):
    """Make every forward batch that contains `token` return NaN logits (the cache is written as usual): a fault
    that appears only at some positions. A real Inf embedding row would not do: the quantized matmuls turn the NaN
    activations it causes into finite garbage before they reach the logits."""
    inner = m.model.forward_batch

    def faulty(tokens, positions, logits_out):
        inner(tokens, positions, logits_out)
        if token in tokens and logits_out is not None:
            logits_out[...] = np.nan
    m.model.forward_batch = faulty
    return m


def test_numerical_error_is_a_sampling_error():
    assert issubclass(NumericalError, SamplingError) and issubclass(NumericalError, edgellm.EdgeLLMError)


def test_every_call_reports_overflowing_logits(overflowing_model):
    m = overflowing_model
    with pytest.raises(NumericalError, match=r"hold [1-9]\d* NaN and \d+ Inf of \d+ values: a weight of this file is corrupt"):
        m.logits(m.tokenize("hello"))
    calls = []

    def processor(ids, scores):
        calls.append(len(ids))
        return scores

    messages = [{"role": "user", "content": "hello"}]
    for call in (lambda: m.generate("hello", max_tokens=4),
                 lambda: m.generate("hello", max_tokens=4, temperature=0.8, seed=1),
                 lambda: m.generate("hello", max_tokens=4, logits_processor=processor),
                 lambda: list(m.stream("hello", max_tokens=4)),
                 lambda: m.chat(messages, max_tokens=4),
                 lambda: m.create_completion("hello", max_tokens=4),
                 lambda: list(m.create_completion("hello", max_tokens=4, stream=True)),
                 lambda: m.create_chat_completion(messages, max_tokens=4)):
        with pytest.raises(NumericalError, match="Inf"):
            call()
    assert calls == []                 # a logits processor never sees the faulty values


def test_model_is_not_left_busy_after_a_numeric_fault(overflowing_model):
    m = overflowing_model
    for _ in range(2):                 # the same call fails the same way: no ModelBusyError, no stale cache
        with pytest.raises(NumericalError):
            m.generate("hello world", max_tokens=2)
        with pytest.raises(NumericalError):
            m.logits(m.tokenize("hi"))


def test_one_inf_block_scale_is_reported_with_the_count(inf_scale_model):
    m = inf_scale_model
    n_vocab = m.n_vocab
    with pytest.raises(NumericalError, match=rf"hold \d+ NaN and \d+ Inf of {n_vocab} values") as info:
        m.logits(m.tokenize("hello"))
    n_nan, n_inf = map(int, re.search(r"(\d+) NaN and (\d+) Inf", str(info.value)).groups())
    assert n_nan + n_inf == len(m.tokenize("hello"))   # one bad logit per position: the poisoned row's
    with pytest.raises(NumericalError):
        m.complete("hello", max_tokens=4)


def test_a_fault_in_the_prompt_is_reported_and_healthy_prompts_still_work(tmp_path):
    path = write_loadable_tiny_model(tmp_path / "ok.gguf")
    m, fresh = inject_nan_at(load(path), POISONED_TOKEN), load(path)
    ids = m.tokenize("hello!")
    assert POISONED_TOKEN in ids
    with pytest.raises(NumericalError, match="NaN"):
        m.logits(ids)
    assert np.array_equal(m.logits(m.tokenize("hello")), fresh.logits(fresh.tokenize("hello")))
    # "hello" is a prefix of the failed prompt: whatever the cache kept must not change the result
    with pytest.raises(NumericalError, match="NaN"):
        m.generate("hello!", max_tokens=4)
    assert m.complete("hello", max_tokens=6, ignore_eos=True).tokens == \
        fresh.complete("hello", max_tokens=6, ignore_eos=True).tokens


def test_a_fault_mid_generation_stops_the_stream_after_the_tokens_before_it(tmp_path):
    path = write_loadable_tiny_model(tmp_path / "ok.gguf")
    m, fresh = inject_nan_at(load(path), POISONED_TOKEN), load(path)
    pieces = []
    stream = m.stream("hello", max_tokens=6, logit_bias={POISONED_TOKEN: 100.0})   # forces "!" first
    with pytest.raises(NumericalError, match="NaN"):
        for piece in stream:
            pieces.append(piece)
    assert pieces == ["!"]             # the token before the fault was delivered; nothing after it was sampled
    assert m.complete("hello", max_tokens=6, ignore_eos=True).tokens == \
        fresh.complete("hello", max_tokens=6, ignore_eos=True).tokens


def test_an_inf_embedding_row_is_reported_not_turned_into_garbage(tmp_path):
    """One token's embedding row with an Inf block scale: its hidden state is NaN from the first layer on. The
    int8 activation quantization of the next matmul would turn that into finite logits; the model marks the rows
    whose final hidden state is not finite as NaN logits, so the API reports it instead of sampling garbage."""
    spec = tiny_spec(tied=False)
    embd = random_matrix_bytes(np.random.default_rng(8), (spec.n_vocab, spec.n_embd), "Q8_0")
    embd[POISONED_TOKEN, Q8_0_SCALE_BYTES] = np.array([np.inf], np.float16).view(np.uint8)
    m = load(write_loadable_tiny_model(tmp_path / "inf_embd.gguf", spec, replace={"token_embd.weight": (embd, "Q8_0")}))
    with pytest.raises(NumericalError, match="NaN"):
        m.generate([POISONED_TOKEN], max_tokens=2)
    healthy = m.complete("hello", max_tokens=4, ignore_eos=True)
    assert len(healthy.tokens) == 4

"""generate / complete / stream / chat on a scripted model: options and their errors, finish reasons, stop strings
across tokens, UTF-8 pieces, logprobs, seeds, prefix reuse, and a model that stays usable after an interrupt."""
import numpy as np
import pytest

from edgellm.api import Completion, ModelBusyError, PromptError
from edgellm.errors import EdgeLLMError, SamplingError
from fake_model import byte_ids, fake_model, script

LOGPROB_TOL = 1e-5  # float32 logits, float64 log-sum-exp
PREFIX_REUSE_TOL = 1e-4  # the same positions and weights; only the batch split of the prompt differs


@pytest.fixture
def m():
    model = fake_model()
    script(model, "hello", " world STOP hello")
    return model


def test_generate_follows_the_script_and_stops_at_eos(m):
    assert m.generate("hello") == " world STOP hello"
    c = m.last_completion
    assert (c.finish_reason, c.stop_reason, c.prompt_tokens) == ("stop", "eog", 1)
    assert m.detokenize(c.tokens) == c.text
    assert m.timings.generated_tokens == len(c.tokens) and m.timings.prompt_tokens == 1


def test_max_tokens_gives_length(m):
    c = m.complete("hello", max_tokens=2)
    assert (c.text, c.finish_reason, c.stop_reason, len(c.tokens)) == (" world STOP", "length", "length", 2)
    assert m.complete("hello", max_tokens=0).text == ""


def test_max_tokens_none_runs_to_the_context_end():
    m = fake_model(n_ctx=12)
    c = m.complete("hello", max_tokens=None, ignore_eos=True)
    assert (len(c.tokens), c.finish_reason) == (12 - 1, "length")


def test_ignore_eos_keeps_going(m):
    c = m.complete("hello", max_tokens=8, ignore_eos=True)
    assert c.text.startswith(" world STOP hello") and len(c.tokens) == 8 and c.finish_reason == "length"


@pytest.mark.parametrize("stop, text", [
    (" ST", " world"),              # inside one token
    (["xyz", "OP h"], " world ST"),  # spans two tokens: " STOP" + " " + "hello"
    ("world STOP hello", " "),
])
def test_stop_strings_across_tokens(m, stop, text):
    pieces = list(m.stream("hello", stop=stop))
    assert "".join(pieces) == text
    c = m.last_completion
    assert (c.finish_reason, c.stop_reason) == ("stop", "stop_string")
    assert c.stop_string in ([stop] if isinstance(stop, str) else stop)
    assert not any(s in "".join(pieces) for s in ([stop] if isinstance(stop, str) else stop))


def test_stream_pieces_are_whole_characters_of_a_chinese_reply():
    m = fake_model()
    reply = "你好，世界！ok"
    script(m, "hello", reply_ids=byte_ids(reply))  # every character split over 3 byte tokens
    pieces = list(m.stream("hello", max_tokens=64))
    assert "".join(pieces) == reply
    assert pieces[:6] == list("你好，世界！")  # each released as soon as its last byte arrived
    for p in pieces:
        p.encode("utf-8", errors="strict")
        assert "\ufffd" not in p


def test_stream_return_value_is_the_completion(m):
    gen = m.stream("hello", max_tokens=3)
    pieces = []
    try:
        while True:
            pieces.append(next(gen))
    except StopIteration as stop:
        result = stop.value
    assert isinstance(result, Completion) and result.text == "".join(pieces)


def test_logprobs_match_log_softmax_of_the_logits(m):
    c = m.complete("hello", max_tokens=3, logprobs=2)
    ids = m.tokenize("hello")
    context = list(ids)
    for info in c.token_info:
        full = m.logits(context)[-1]  # the scripted decoder's row for this context
        logp = full - np.log(np.sum(np.exp(full - full.max()))) - full.max()
        assert abs(info.logprob - logp[info.id]) < LOGPROB_TOL
        assert len(info.top_logprobs) in (2, 3)  # two alternatives plus the chosen token (once if among them)
        best = np.argsort(-logp)[:2]
        for t in best:
            assert abs(info.top_logprobs[m.tokenizer.token_to_bytes(int(t)).decode("utf-8", "ignore")]
                       - logp[t]) < LOGPROB_TOL
        context.append(info.id)
    assert [i.offset for i in c.token_info] == [0, 6, 11]


def test_seeded_sampling_is_reproducible_and_seed_matters():
    m = fake_model()
    kw = dict(max_tokens=12, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    a = m.complete("hello world", seed=7, **kw).tokens
    b = m.complete("hello world", seed=7, **kw).tokens
    others = {tuple(m.complete("hello world", seed=s, **kw).tokens) for s in range(1, 5)}
    assert a == b
    assert len(others | {tuple(a)}) > 1


def test_sampling_options_change_the_draw():
    m = fake_model()
    greedy = m.complete("hello world", max_tokens=6).tokens
    # top_k=1 is greedy whatever the temperature
    assert m.complete("hello world", max_tokens=6, temperature=2.0, top_k=1, seed=3).tokens == greedy
    # a huge repeat penalty forbids reusing any token in the window
    tokens = m.complete("hello world", max_tokens=10, repeat_penalty=1e9, repeat_last_n=64).tokens
    assert len(set(tokens)) == len(tokens)
    # logit_bias can ban the greedy choice
    banned = m.complete("hello world", max_tokens=1, logit_bias={greedy[0]: -1e9}).tokens
    assert banned[0] != greedy[0]


def test_logits_processor_and_stopping_criteria(m):
    target = m.tokenize("hello", add_special=False)[0]

    def force_hello(input_ids, scores):
        scores[:] = -np.inf
        scores[target] = 0.0
        return scores

    assert m.complete("hello", max_tokens=3, logits_processor=[force_hello]).tokens == [target] * 3
    c = m.complete("hello", stopping_criteria=lambda ids, logits: len(ids) >= 3)
    assert (len(c.tokens), c.finish_reason, c.stop_reason) == (2, "stop", "criteria")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"temprature": 0.5}, TypeError, "temprature.*did you mean 'temperature'"),
    ({"n_predict": 5}, TypeError, "n_predict"),
    ({"top_p": 1.5}, SamplingError, "top_p"),
    ({"top_k": -1}, SamplingError, "top_k"),
    ({"temperature": float("nan")}, SamplingError, "temperature"),
    ({"repeat_penalty": 0}, SamplingError, "repeat_penalty"),
    ({"max_tokens": -2}, SamplingError, "max_tokens"),
    ({"max_tokens": 2.5}, SamplingError, "max_tokens"),
    ({"seed": -1}, SamplingError, "seed"),
    ({"stop": ["ok", ""]}, SamplingError, "stop"),
    ({"logprobs": True}, SamplingError, "logprobs"),
    ({"ignore_eos": "yes"}, SamplingError, "ignore_eos"),
    ({"logit_bias": {"x": 1}}, SamplingError, "logit_bias"),
    ({"logit_bias": {99999: 1.0}}, SamplingError, "99999"),
    ({"tfs_z": 0.5}, TypeError, "tfs_z"),  # a llama-cpp-python name, only accepted by create_*
])
def test_bad_options_name_the_argument(m, kwargs, error, match):
    with pytest.raises(error, match=match):
        m.generate("hello", **kwargs)
    with pytest.raises(error, match=match):
        m.stream("hello", **kwargs)  # refused when called, not at the first piece


@pytest.mark.parametrize("prompt, error, match", [
    ("", PromptError, "empty"),
    ([], PromptError, "empty"),
    ([5, 10 ** 6], PromptError, "outside the vocabulary"),
    ([1.5, 2.0], PromptError, "integers"),
    (3.14, TypeError, "str or a list"),
    ("hello " * 300, PromptError, "context holds 256"),
])
def test_bad_prompts(m, prompt, error, match):
    with pytest.raises(error, match=match):
        m.generate(prompt)
    assert issubclass(PromptError, EdgeLLMError) and issubclass(PromptError, ValueError)


def test_prefix_reuse_feeds_only_the_new_tokens(m):
    base = "hello world hello world"
    m.generate(base, max_tokens=4)
    fed = m.model.tokens_fed
    extended = base + " hello"
    text = m.generate(extended, max_tokens=4)
    new_prompt_tokens = len(m.tokenize(extended)) - len(m.tokenize(base))
    assert m.model.tokens_fed - fed == new_prompt_tokens + 3  # the new tokens, then 3 decode steps
    fresh = fake_model()
    assert fresh.generate(extended, max_tokens=4) == text


def test_interrupt_mid_generation_leaves_the_model_usable(m):
    expected = m.generate("hello")
    calls = []

    def interrupt_on_third(tokens):
        calls.append(tokens)
        if len(calls) == 3:
            raise KeyboardInterrupt

    m.model.on_forward = interrupt_on_third
    with pytest.raises(KeyboardInterrupt):
        for _ in m.stream("hello"):
            pass
    m.model.on_forward = None
    assert m.generate("hello") == expected


def test_abandoned_stream_frees_the_model_and_a_second_stream_is_refused_meanwhile(m):
    first = m.stream("hello")
    next(first)
    with pytest.raises(ModelBusyError):
        m.generate("hello")
    first.close()
    assert m.generate("hello") == " world STOP hello"


def test_chat_renders_the_template_and_returns_the_reply():
    m = fake_model()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert m.detokenize(m.chat_prompt_ids(messages), special=True) == prompt
    script(m, prompt, "hello world")
    assert m.chat(messages) == "hello world"
    assert "".join(m.chat(messages, stream=True)) == "hello world"
    with pytest.raises(EdgeLLMError, match="messages"):
        m.chat([])
    with pytest.raises(TypeError, match="bogus"):
        m.chat(messages, bogus=1)


def test_chat_uses_the_gguf_template_without_adding_bos():
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}"
    m = fake_model(**{"tokenizer.chat_template": template, "tokenizer.ggml.add_bos_token": True})
    ids = m.chat_prompt_ids([{"role": "user", "content": "hi"}])
    assert ids[0] == m.tokenizer.bos_id and ids[1] != m.tokenizer.bos_id  # the template's BOS, only once
    assert m.detokenize(ids, special=True) == "<|endoftext|>[user]hi[assistant]"


def test_cache_rewind_refuses_when_a_window_ring_lost_needed_positions():
    from types import SimpleNamespace

    from edgellm.api import Model
    from edgellm.engine.kvcache import EMPTY_SLOT, KVCache

    window, n_batch = 8, 4
    cache = KVCache(n_ctx=64, n_head_kv=1, head_dim=2, windows=[0, window], n_batch=n_batch)
    ring = cache.capacities[1]
    assert ring == window + n_batch - 1
    for layer in cache.layers:  # positions 0..19 written, as kv_store does: slot p % capacity
        for p in range(20):
            layer.slot_pos[p % layer.slot_pos.shape[0]] = p
    cache.n_past = 20
    host = SimpleNamespace(cache=cache, n_vocab=10, n_ctx=64)
    m = Model.from_parts(host, tokenizer=None, metadata={})
    # position 18 attends to 11..17, all still in the ring; 15 would need 8, which position 19 overwrote
    assert not m._rewind_cache(15) and cache.n_past == 20
    assert m._rewind_cache(18) and cache.n_past == 18
    assert cache.layers[0].slot_pos[18:20].tolist() == [EMPTY_SLOT, EMPTY_SLOT]
    assert sorted(p for p in cache.layers[1].slot_pos.tolist() if p != EMPTY_SLOT) == list(range(9, 18))


def test_prefix_reuse_on_a_tiny_sliding_window_model_matches_a_fresh_run(tmp_path):
    """Tiny random gemma3 (window 5, batches of 3: 7-slot rings): a reused prefix must give fresh-run logits,
    both when the rings still hold what the next token needs and when they do not (then it recomputes)."""
    import edgellm.engine.gguf
    from edgellm.api import Model
    from edgellm.engine.models import build_model
    from helpers_tiny_gguf import TinySpec, write_tiny_model

    spec = TinySpec(arch="gemma3", weight_type="Q8_0", n_layer=7, n_embd=64, n_head=2, n_head_kv=1, head_dim=32,
                    sliding_window=5)
    tokens = np.random.default_rng(3).integers(0, spec.n_vocab, 24).tolist()
    with edgellm.engine.gguf.open(write_tiny_model(tmp_path / "tiny.gguf", spec)) as f:
        reused = Model.from_parts(build_model(f, n_ctx=64, n_threads=1, n_batch=3), None, {})
        fresh = build_model(f, n_ctx=64, n_threads=1, n_batch=3)
        for first, second in [(tokens[:19], tokens[:18] + tokens[20:22]),  # rewind to 18: ring holds 14..17
                              (tokens[:19], tokens[:15] + tokens[19:23])]:  # rewind to 15 needs 11: overwritten
            reused._prefill(first)
            got = reused._prefill(second).copy()
            fresh.reset()
            want = fresh.forward(np.array(second, dtype=np.int32))[-1]
            assert np.abs(got - want).max() < PREFIX_REUSE_TOL

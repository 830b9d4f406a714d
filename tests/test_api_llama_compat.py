"""create_completion / create_chat_completion on a scripted model, compared field by field with llama-cpp-python's
shapes (llama_types.py: CreateCompletionResponse, CompletionChunk, CreateChatCompletionResponse,
ChatCompletionChunk) and its defaults."""
import json
import re

import pytest

from edgellm.errors import SamplingError
from fake_model import byte_ids, fake_model, script

COMPLETION_ID = r"cmpl-[0-9a-f-]{36}"
CHAT_ID = r"chatcmpl-[0-9a-f-]{36}"
CHAT_PROMPT = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def m():
    model = fake_model()
    script(model, "hello", " world STOP hello")
    script(model, CHAT_PROMPT, "hello world")
    return model


def test_completion_response_shape(m):
    r = m.create_completion("hello", temperature=0)
    assert list(r) == ["id", "object", "created", "model", "choices", "usage"]
    assert re.fullmatch(COMPLETION_ID, r["id"]) and r["object"] == "text_completion"
    assert isinstance(r["created"], int) and r["model"] == "/models/fake.gguf"
    assert r["choices"] == [{"text": " world STOP hello", "index": 0, "logprobs": None, "finish_reason": "stop"}]
    assert r["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    assert json.loads(json.dumps(r)) == r


def test_completion_defaults_are_llama_cpp_pythons(m):
    r = m("hello world hello world", seed=1)  # __call__ is create_completion; max_tokens defaults to 16
    assert r["usage"]["completion_tokens"] <= 16
    r = m.create_completion("hello world", max_tokens=3, ignore_eos=True, model="my-alias")
    assert r["model"] == "my-alias" and r["usage"]["completion_tokens"] == 3
    assert r["choices"][0]["finish_reason"] == "length"
    # max_tokens None or <= 0: until end of generation or a full context
    assert m.create_completion("hello", max_tokens=0, temperature=0)["choices"][0]["text"] == " world STOP hello"
    assert m.create_completion("hello", max_tokens=None, temperature=0)["choices"][0]["finish_reason"] == "stop"


def test_completion_stop_echo_and_token_prompt(m):
    r = m.create_completion("hello", stop=["OP"], temperature=0)
    assert r["choices"][0]["text"] == " world ST" and r["choices"][0]["finish_reason"] == "stop"
    # usage counts every generated token, the stop string's too, as llama-cpp-python does
    assert r["usage"]["completion_tokens"] == 2
    r = m.create_completion("hello", echo=True, temperature=0, max_tokens=1)
    assert r["choices"][0]["text"] == "hello world"
    r = m.create_completion(m.tokenize("hello"), temperature=0, max_tokens=1)
    assert r["choices"][0]["text"] == " world"


def test_completion_logprobs_shape(m):
    r = m.create_completion("hello", temperature=0, logprobs=3, max_tokens=2)
    lp = r["choices"][0]["logprobs"]
    assert list(lp) == ["tokens", "text_offset", "token_logprobs", "top_logprobs"]
    assert lp["tokens"] == [" world", " STOP"]
    assert lp["text_offset"] == [5, 11]  # counted from the start of the prompt text, as llama-cpp-python
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"])
    for tok, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        # keyed by token text (tokens with equal text share a key): at most 3 alternatives plus the chosen one
        assert top[tok] == logprob and 1 <= len(top) <= 4
        assert all(v <= logprob for k, v in top.items())  # greedy: the chosen token is the most likely
    json.dumps(r)


def test_completion_stream_chunks(m):
    chunks = list(m.create_completion("hello", stream=True, temperature=0, stop="hello"))
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and re.fullmatch(COMPLETION_ID, ids.pop())
    for c in chunks:
        assert list(c) == ["id", "object", "created", "model", "choices"]  # no usage in chunks
        assert list(c["choices"][0]) == ["text", "index", "logprobs", "finish_reason"]
        assert c["object"] == "text_completion"
    assert [c["choices"][0]["text"] for c in chunks] == [" world", " STOP", " ", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]


def test_completion_stream_logprobs_follow_the_text(m):
    chunks = list(m.create_completion("hello", stream=True, temperature=0, logprobs=1, max_tokens=2))
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == [" world"]
    assert chunks[0]["choices"][0]["logprobs"]["text_offset"] == [5]
    assert chunks[1]["choices"][0]["logprobs"]["tokens"] == [" STOP"]
    assert chunks[-1]["choices"][0]["logprobs"] is None


def test_stream_of_split_characters_carries_every_token_logprob():
    m = fake_model()
    script(m, "hello", reply_ids=byte_ids("中a"))
    chunks = list(m.create_completion("hello", stream=True, temperature=0, logprobs=0))
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts == ["中", "a", ""]
    assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) == 3  # three byte tokens made one character


def test_chat_completion_shape(m):
    r = m.create_chat_completion(MESSAGES, temperature=0)
    assert list(r) == ["id", "object", "created", "model", "choices", "usage"]
    assert re.fullmatch(CHAT_ID, r["id"]) and r["object"] == "chat.completion"
    assert r["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello world"},
                             "logprobs": None, "finish_reason": "stop"}]
    n_prompt = len(m.chat_prompt_ids(MESSAGES))
    assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 2, "total_tokens": n_prompt + 2}
    json.dumps(r)


def test_chat_completion_stream_chunks(m):
    chunks = list(m.create_chat_completion(MESSAGES, temperature=0, stream=True))
    for c in chunks:
        assert list(c) == ["id", "model", "created", "object", "choices"]
        assert c["object"] == "chat.completion.chunk" and re.fullmatch(CHAT_ID, c["id"])
        assert list(c["choices"][0]) == ["index", "delta", "logprobs", "finish_reason"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant"}, {"content": "hello"}, {"content": " world"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_completion_logprobs(m):
    r = m.create_chat_completion(MESSAGES, temperature=0, logprobs=True, top_logprobs=2)
    content = r["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["hello", " world"]
    assert all(list(c) == ["token", "bytes", "logprob", "top_logprobs"] for c in content)
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert m.create_chat_completion(MESSAGES, temperature=0, logprobs=True)["choices"][0]["logprobs"] is not None
    with pytest.raises(SamplingError, match="top_logprobs"):
        m.create_chat_completion(MESSAGES, top_logprobs=2)


def test_abandoned_stream_frees_the_model(m):
    chunks = m.create_chat_completion(MESSAGES, temperature=0, stream=True)
    next(chunks)
    next(chunks)
    chunks.close()
    assert m.create_completion("hello", temperature=0)["choices"][0]["text"] == " world STOP hello"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mirostat_mode": 2}, SamplingError, "mirostat_mode"),
    ({"grammar": "root ::= x"}, SamplingError, "grammar"),
    ({"suffix": "end"}, SamplingError, "suffix"),
    ({"max_tokenz": 3}, TypeError, "max_tokenz.*max_tokens"),
    ({"temperature": -float("inf")}, SamplingError, "temperature"),
])
def test_compat_options(m, kwargs, error, match):
    with pytest.raises(error, match=match):
        m.create_completion("hello", **kwargs)
    with pytest.raises(error, match=match):
        m.create_chat_completion(MESSAGES, stream=True, **kwargs)


def test_neutral_compat_values_are_accepted(m):
    r = m.create_completion("hello", tfs_z=1.0, mirostat_mode=0, mirostat_tau=5.0, mirostat_eta=0.1, grammar=None,
                            temperature=0)
    assert r["choices"][0]["text"] == " world STOP hello"
    r = m.create_chat_completion(MESSAGES, response_format={"type": "text"}, tools=None, temperature=0)
    assert r["choices"][0]["message"]["content"] == "hello world"
    with pytest.raises(SamplingError, match="suffix"):
        m.create_completion("hello", suffix="!")

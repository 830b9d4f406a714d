"""Response dicts, field by field, against llama-cpp-python's llama_types.py and its chat conversion."""
import json
import re
import time

import pytest

from edgellm.compat.completions import (chat_chunk, chat_chunks, chat_completion_response, chat_logprobs,
                                        completion_chunk, completion_logprobs, completion_response, new_completion_id,
                                        now, top_logprobs_entry)
from edgellm.errors import SamplingError

UUID4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
COMMON = dict(completion_id="cmpl-abc", created=1700000000, model="/models/smollm2.gguf")


def test_completion_id_and_created():
    cid = new_completion_id()
    assert re.fullmatch("cmpl-" + UUID4, cid)
    assert cid != new_completion_id()
    t = now()
    assert isinstance(t, int) and abs(t - time.time()) < 5


def test_completion_response_fields():
    r = completion_response(text="Paris.", finish_reason="stop", prompt_tokens=7, completion_tokens=3, **COMMON)
    assert list(r) == ["id", "object", "created", "model", "choices", "usage"]
    assert r["id"] == "cmpl-abc" and r["object"] == "text_completion"
    assert r["created"] == 1700000000 and r["model"] == "/models/smollm2.gguf"
    assert r["choices"] == [{"text": "Paris.", "index": 0, "logprobs": None, "finish_reason": "stop"}]
    assert list(r["choices"][0]) == ["text", "index", "logprobs", "finish_reason"]
    assert r["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert json.loads(json.dumps(r)) == r  # plain JSON types only


def test_completion_chunks():
    c = completion_chunk(text="Par", **COMMON)
    assert list(c) == ["id", "object", "created", "model", "choices"]  # streamed chunks carry no usage
    assert c["object"] == "text_completion"
    assert c["choices"] == [{"text": "Par", "index": 0, "logprobs": None, "finish_reason": None}]
    last = completion_chunk(text="", finish_reason="length", **COMMON)
    assert last["choices"][0] == {"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}


@pytest.mark.parametrize("reason", ["eos", "STOP", ""])
def test_bad_finish_reason(reason):
    with pytest.raises(SamplingError, match="finish_reason"):
        completion_response(text="", finish_reason=reason, prompt_tokens=1, completion_tokens=0, **COMMON)
    with pytest.raises(SamplingError, match="finish_reason"):
        chat_chunk(chat_id="chatcmpl-x", created=1, model="m", delta={}, finish_reason=reason)


def test_completion_logprobs_shape():
    top0 = top_logprobs_entry(" Paris", -0.1, [(" Paris", -0.1), (" London", -2.5)])
    top1 = top_logprobs_entry(".", -0.7, [("!", -0.5), (",", -1.0)])
    assert top0 == {" Paris": -0.1, " London": -2.5}
    assert top1 == {"!": -0.5, ",": -1.0, ".": -0.7}  # the chosen token is always present, added last
    lp = completion_logprobs([" Paris", "."], [24, 30], [-0.1, -0.7], [top0, top1])
    assert list(lp) == ["tokens", "text_offset", "token_logprobs", "top_logprobs"]
    assert lp == {"tokens": [" Paris", "."], "text_offset": [24, 30], "token_logprobs": [-0.1, -0.7],
                  "top_logprobs": [top0, top1]}
    echo = completion_logprobs(["The"], [0], [None], [None])  # echo: the first prompt token has no logprob
    assert echo["token_logprobs"] == [None] and echo["top_logprobs"] == [None]
    with pytest.raises(ValueError, match="differ in length"):
        completion_logprobs(["a", "b"], [0], [-1.0, -2.0], [{}, {}])


def test_logprob_values_are_plain_floats():
    import numpy as np
    lp = completion_logprobs(["a"], [np.int64(3)], [np.float32(-0.5)], [top_logprobs_entry("a", np.float32(-0.5), [])])
    assert type(lp["text_offset"][0]) is int and type(lp["token_logprobs"][0]) is float
    assert type(lp["top_logprobs"][0]["a"]) is float
    json.dumps(lp)


def test_chat_logprobs_conversion():
    lp = completion_logprobs([" Hi"], [0], [-0.25], [{" Hi": -0.25, " Hey": -1.5}])
    assert chat_logprobs(lp) == {
        "content": [{"token": " Hi", "bytes": None, "logprob": -0.25,
                     "top_logprobs": [{"token": " Hi", "logprob": -0.25, "bytes": None},
                                      {"token": " Hey", "logprob": -1.5, "bytes": None}]}],
        "refusal": None,
    }
    assert chat_logprobs(None) is None


def test_chat_completion_response_fields():
    lp = completion_logprobs(["4"], [0], [-0.01], [{"4": -0.01}])
    completion = completion_response(text="4", finish_reason="stop", prompt_tokens=20, completion_tokens=2,
                                     logprobs=lp, **COMMON)
    chat = chat_completion_response(completion)
    assert list(chat) == ["id", "object", "created", "model", "choices", "usage"]
    assert chat["id"] == "chatcmpl-abc" and chat["object"] == "chat.completion"
    assert chat["created"] == 1700000000 and chat["model"] == "/models/smollm2.gguf"
    choice = chat["choices"][0]
    assert list(choice) == ["index", "message", "logprobs", "finish_reason"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "4"}
    assert choice["logprobs"] == chat_logprobs(lp)
    assert chat["usage"] == {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}
    assert chat["usage"] is not completion["usage"]


def test_chat_chunks_from_completion_chunks():
    chunks = [completion_chunk(text="Hel", **COMMON), completion_chunk(text="lo", **COMMON),
              completion_chunk(text="", finish_reason="stop", **COMMON)]
    out = list(chat_chunks(chunks))
    assert len(out) == 4
    for c in out:
        assert list(c) == ["id", "model", "created", "object", "choices"]
        assert c["id"] == "chatcmpl-abc" and c["object"] == "chat.completion.chunk"
        assert c["created"] == 1700000000 and c["model"] == "/models/smollm2.gguf"
        assert list(c["choices"][0]) == ["index", "delta", "logprobs", "finish_reason"]
    deltas = [c["choices"][0]["delta"] for c in out]
    reasons = [c["choices"][0]["finish_reason"] for c in out]
    assert deltas == [{"role": "assistant"}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert reasons == [None, None, None, "stop"]
    assert "".join(d.get("content", "") for d in deltas) == "Hello"


def test_chat_chunk_builder():
    c = chat_chunk(chat_id="chatcmpl-1", created=5, model="m", delta={"content": "x"})
    assert c == {"id": "chatcmpl-1", "model": "m", "created": 5, "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]}

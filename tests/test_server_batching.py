"""Continuous batching in the server, with the official openai client against a real server and SmolLM2: concurrent
requests, each with its own options (greedy, a stop string, logprobs, a seed, a JSON schema; one prompt long enough
to be prefilled in several chunks), give exactly what each gives served alone, and decode steps are shared; a
returning conversation re-uses its prefix from the prompt cache."""
import json
import threading

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import edgellm  # noqa: E402
from edgellm.server import BackgroundServer, create_app  # noqa: E402

N_CTX = 512
PREFILL_CHUNK = 32  # small, so the long prompt below runs in several chunks between decode steps
LONG = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig", "kiwi", "lime"] * 12) + \
       ". Which fruit comes first in the list?"
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
          "required": ["colour"], "additionalProperties": False}
REQUESTS = [
    dict(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=12, temperature=0),
    dict(messages=[{"role": "user", "content": LONG}], max_tokens=16, temperature=0),
    dict(messages=[{"role": "user", "content": "Count from one to ten."}], max_tokens=24, temperature=0,
         stop=["4."]),
    dict(messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0, logprobs=True,
         top_logprobs=3),
    dict(messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12, temperature=0.9, seed=7),
    dict(messages=[{"role": "user", "content": "A colour as JSON."}], max_tokens=24, temperature=0,
         response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}),
]


@pytest.fixture(scope="module")
def model(smollm2_path):
    return edgellm.load(smollm2_path, n_ctx=N_CTX)


@pytest.fixture(scope="module")
def alone(model):
    """Each request served alone, by the Python API (no server, nothing beside it)."""
    return [model.create_chat_completion(**kw) for kw in REQUESTS]


def test_concurrent_requests_equal_each_served_alone(model, alone):
    app = create_app(model, model_name="smollm2", parallel=4, prefill_chunk=PREFILL_CHUNK)
    scheduler = app.state.endpoints.scheduler
    results, errors = {}, []

    def one(i, kw):
        try:
            c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
            stream = c.chat.completions.create(model="smollm2", stream=True, **kw)
            text, lps, finish = "", [], None
            for ch in stream:
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    if ch.choices[0].logprobs is not None:
                        lps += [(t.token, round(t.logprob, 4), [(a.token, round(a.logprob, 4))
                                                                 for a in t.top_logprobs])
                                for t in ch.choices[0].logprobs.content]
                    finish = ch.choices[0].finish_reason or finish
            results[i] = (text, finish, lps)
        except Exception as e:  # collected, so the assertion shows every failure
            errors.append(repr(e))

    with BackgroundServer(app) as srv:
        threads = [threading.Thread(target=one, args=(i, kw)) for i, kw in enumerate(REQUESTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    assert errors == []
    for i, a in enumerate(alone):
        choice = a["choices"][0]
        lps = [(t["token"], round(t["logprob"], 4), [(x["token"], round(x["logprob"], 4)) for x in t["top_logprobs"]])
               for t in choice["logprobs"]["content"]] if choice.get("logprobs") else []
        assert results[i] == (choice["message"]["content"], choice["finish_reason"], lps), REQUESTS[i]
    json.loads(results[5][0])  # the constraint held in the batch
    assert "4." not in results[2][0] and "3." in results[2][0] and results[2][1] == "stop"
    stats = scheduler.stats
    # sequences shared decode steps: fewer steps than tokens
    assert stats["decode_steps"] < stats["generated_tokens"]
    assert stats["prefill_chunks"] > len(REQUESTS)  # the long prompt ran in several chunks
    assert stats["mixed_steps"] > 0  # chunks ran in decode steps' forwards, and the outputs above still equal
    assert scheduler.n_active == 0 and scheduler.n_queued == 0


def test_returning_conversation_reuses_its_prefix(model):
    app = create_app(model, model_name="smollm2", parallel=1, prompt_cache=64 << 20)
    scheduler = app.state.endpoints.scheduler
    first = [{"role": "user", "content": LONG}]
    other = [{"role": "user", "content": "Write a haiku about the sea and the wind and the rain."}]
    with BackgroundServer(app) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        reply = c.chat.completions.create(model="smollm2", messages=first, max_tokens=8, temperature=0)
        c.chat.completions.create(model="smollm2", messages=other, max_tokens=8, temperature=0)  # takes the slot
        before = scheduler.stats["reused_tokens"]
        returning = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": "And the last one?"}]
        again = c.chat.completions.create(model="smollm2", messages=returning, max_tokens=8, temperature=0)
        reused = scheduler.stats["reused_tokens"] - before
    n_first = len(model.chat_prompt_ids(first))
    assert reused >= n_first - 2 * PREFILL_CHUNK, (reused, n_first)  # its first prompt, but for a batch tail
    assert scheduler.prompt_cache.hits >= 1
    expected = model.create_chat_completion(returning, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == expected["choices"][0]["message"]["content"]

"""Per-request limits of the server, against the real SmolLM2 through the official openai client: the context
check (with and without max_tokens, chat and completions, and the context_shift opt-in), the max_tokens cap, the
wall-clock limit, OpenAI's bounds on logprobs, and /tokenize through the same size limits and admission."""
import json
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # a test dependency: these checks must run in CI

import edgellm  # noqa: E402
from edgellm.server import BackgroundServer, create_app  # noqa: E402
from edgellm.serving.limits import MAX_LOGPROBS, MAX_TOP_LOGPROBS, RequestLimits  # noqa: E402

N_CTX = 256
CAP = 8
TIMEOUT_S = 0.3           # the wall-clock limit under test
SLOW_TOKENS = 200         # far more than SmolLM2 makes in TIMEOUT_S on any CPU this runs on
MESSAGES = [{"role": "user", "content": "Tell me a long story about the sea."}]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return edgellm.load(smollm2_path, n_ctx=N_CTX)


def serve(llm, **kw):
    return BackgroundServer(create_app(llm, model_name="smollm2", **kw))


@pytest.fixture(scope="module")
def server(llm):
    with serve(llm, max_request_bytes=2 << 20) as srv:
        yield srv


def client_of(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def words_for(llm, n_tokens):
    """A prompt of exactly n_tokens tokens (no BOS: SmolLM2 adds none)."""
    text = " sea" * n_tokens
    assert len(llm.prompt_ids(text)) == n_tokens
    return text


def test_prompt_plus_max_tokens_past_the_context_is_refused(server, llm):
    c = client_of(server)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="m", prompt=words_for(llm, 200), max_tokens=100)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "max_tokens"
    assert "200 in the prompt" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=N_CTX)
    assert info.value.body["code"] == "context_length_exceeded"


def test_a_prompt_past_the_context_is_refused_without_max_tokens(server, llm):
    c = client_of(server)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": " sea" * (2 * N_CTX)}])
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:  # opting into shifts does not let a prompt through
        c.completions.create(model="m", prompt=words_for(llm, N_CTX), extra_body={"context_shift": True})
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "prompt"


def test_without_max_tokens_the_reply_gets_what_fits(server, llm):
    r = client_of(server).completions.create(model="m", prompt=words_for(llm, N_CTX - 12), temperature=0,
                                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (N_CTX - 12, 12)


def test_context_shift_is_opt_in(server, llm):
    r = client_of(server).completions.create(model="m", prompt=words_for(llm, 200), max_tokens=80, temperature=0,
                                             extra_body={"ignore_eos": True, "context_shift": True})
    assert r.usage.completion_tokens == 80  # past the context: old tokens shifted out


def test_max_tokens_cap(llm):
    with serve(llm, limits=RequestLimits(max_tokens=CAP)) as srv:
        c = client_of(srv)
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model="m", prompt="The sea", max_tokens=CAP + 1)
        assert info.value.body["param"] == "max_tokens" and str(CAP) in info.value.body["message"]
        r = c.completions.create(model="m", prompt="The sea", temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == CAP and r.choices[0].finish_reason == "length"
        chunks = list(c.chat.completions.create(model="m", messages=MESSAGES, stream=True, max_tokens=CAP,
                                                extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == CAP


def test_wall_clock_limit_ends_a_generation(llm):
    """A request cut by the limit ends as llama-server's t_max_predict_ms cut does: finish_reason "length", with
    the text generated so far (greedy: the start of what the request gives without the limit)."""
    with serve(llm, limits=RequestLimits(request_timeout_s=TIMEOUT_S)) as srv:
        c = client_of(srv)
        c.completions.create(model="m", prompt="The sea", max_tokens=2)  # compiles whatever is still cold
        t0 = time.monotonic()
        r = c.completions.create(model="m", prompt="The sea", max_tokens=SLOW_TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True})
        took = time.monotonic() - t0
        assert 1 <= r.usage.completion_tokens < SLOW_TOKENS and took < 10 * TIMEOUT_S + 2
        assert r.choices[0].finish_reason == "length"
        t0 = time.monotonic()
        chunks = list(c.chat.completions.create(model="m", messages=MESSAGES, stream=True, max_tokens=SLOW_TOKENS,
                                                temperature=0, extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True}))
        n_streamed = chunks[-1].usage.completion_tokens
        assert 1 <= n_streamed < SLOW_TOKENS and time.monotonic() - t0 < 10 * TIMEOUT_S + 2
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
            ["length"]
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    with serve(llm) as srv:  # without the limit the same request runs to its max_tokens
        c = client_of(srv)
        full = c.completions.create(model="m", prompt="The sea", max_tokens=40, extra_body={"ignore_eos": True})
        assert full.usage.completion_tokens == 40
        same = c.completions.create(model="m", prompt="The sea", max_tokens=r.usage.completion_tokens,
                                    temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == same.choices[0].text and r.choices[0].text
        same = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=n_streamed, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert streamed == same.choices[0].message.content and streamed


def test_logprobs_bounds(server):
    c = client_of(server)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="m", prompt="The sea", max_tokens=2, logprobs=MAX_LOGPROBS + 1)
    assert info.value.body["param"] == "logprobs"
    # greedy, so the chosen token is among the top ones; a sampled token outside them adds its own entry,
    # as llama-cpp-python's top_logprobs do
    r = c.completions.create(model="m", prompt="The sea", max_tokens=2, logprobs=MAX_LOGPROBS, temperature=0)
    assert all(len(t) == MAX_LOGPROBS for t in r.choices[0].logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, logprobs=True,
                                  top_logprobs=MAX_TOP_LOGPROBS + 1)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError):  # the n_vocab-sized request the bound is for
        c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=49152,
                                  stream=True)
    r = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, logprobs=True,
                                  top_logprobs=MAX_TOP_LOGPROBS, temperature=0)
    assert all(len(t.top_logprobs) == MAX_TOP_LOGPROBS for t in r.choices[0].logprobs.content)


def test_tokenize_of_a_one_mib_word_leaves_the_word_cache_as_it_was(server, llm):
    cache = llm.tokenizer._model._cache
    httpx.post(server.base_url + "/tokenize", json={"content": "the sea and the sky"}, timeout=60)
    before = (len(cache), cache.nbytes)
    word = "z" * (1 << 20)
    r = httpx.post(server.base_url + "/tokenize", json={"content": word}, timeout=300)
    assert r.status_code == 200 and len(r.json()["tokens"]) > 1000
    assert (len(cache), cache.nbytes) == before and word not in cache
    r = httpx.post(server.base_url + "/tokenize", json={"content": word * 2}, timeout=60)  # over 2 MiB
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_tokenize_goes_through_the_model_slots_admission(llm):
    # a queue that takes no one: every endpoint that uses the model, /tokenize included, is refused alike
    with serve(llm, max_queue=0) as srv:
        for path, body in (("/tokenize", {"content": "sea"}), ("/detokenize", {"tokens": [1, 2]}),
                           ("/v1/completions", {"prompt": "sea", "max_tokens": 1})):
            r = httpx.post(srv.base_url + path, json=body, timeout=60)
            assert r.status_code == 503, path
            assert r.headers["retry-after"].isdigit() and r.json()["error"]["code"] == "server_busy"
    with serve(llm) as srv:
        r = httpx.post(srv.base_url + "/tokenize", json={"content": "sea", "with_pieces": True}, timeout=60)
        assert r.status_code == 200 and [t["piece"] for t in r.json()["tokens"]] == ["sea"]
        r = httpx.post(srv.base_url + "/detokenize", json={"tokens": llm.tokenize("the sea")}, timeout=60)
        assert json.loads(r.text) == {"content": "the sea"}

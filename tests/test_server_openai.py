"""The HTTP server through the official `openai` client, on 127.0.0.1 with an ephemeral port: completions and chat,
streamed and not, stop sequences, seeds, the API key, invalid bodies, size and context limits, a client that leaves
mid-stream, concurrent clients. A scripted model makes the answers exact; one test runs the real SmolLM2."""
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from edgellm.server import BackgroundServer, create_app  # noqa: E402
from fake_model import fake_model, script  # noqa: E402

API_KEY = "test-key-123"
CHAT_PROMPT = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
MESSAGES = [{"role": "user", "content": "hello"}]
MAX_REQUEST_BYTES = 4096
SLOW_TOKEN_S = 0.05  # per token in the disconnect test: a 400-token reply would take 20 s


@pytest.fixture(scope="module")
def llm():
    m = fake_model(n_ctx=512)
    script(m, "hello", " world STOP hello")
    script(m, CHAT_PROMPT, "hello world")
    return m


@pytest.fixture(scope="module")
def server(llm):
    app = create_app(llm, api_key=API_KEY, model_name="fake", max_request_bytes=MAX_REQUEST_BYTES)
    with BackgroundServer(app) as srv:
        assert srv.host == "127.0.0.1"
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, path, body, key=API_KEY, raw=None):
    """(status, parsed JSON) of a POST, errors included."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(server.base_url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake"]
    with urllib.request.urlopen(server.base_url + "/health", timeout=10) as r:  # no key needed
        assert json.loads(r.read()) == {"status": "ok"}


def test_completion(client):
    r = client.completions.create(model="fake", prompt="hello", temperature=0, max_tokens=16)
    assert r.object == "text_completion" and r.model == "fake" and r.id.startswith("cmpl-")
    assert r.choices[0].text == " world STOP hello" and r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (1, 4, 5)
    r = client.completions.create(model="fake", prompt="hello", temperature=0, max_tokens=2)
    assert r.choices[0].text == " world STOP" and r.choices[0].finish_reason == "length"


def test_completion_stream_with_stop(client):
    stream = client.completions.create(model="fake", prompt="hello", temperature=0, stop=["OP h"], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == " world ST"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat(client):
    r = client.chat.completions.create(model="fake", messages=MESSAGES, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == "hello world"
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 2


def test_chat_stream_with_usage(client):
    chunks = list(client.chat.completions.create(model="fake", messages=MESSAGES, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello world"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2


def test_seed_reproduces_a_sampled_reply(client):
    kw = dict(model="fake", prompt="hello world", max_tokens=12, temperature=1.5, top_p=1.0,
              extra_body={"top_k": 0, "min_p": 0.0, "ignore_eos": True})
    a = client.completions.create(seed=11, **kw).choices[0].text
    b = client.completions.create(seed=11, **kw).choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert a == b and len(others | {a}) > 1


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="fake", messages=MESSAGES, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["hello", " world"] and all(len(c.top_logprobs) == 2 for c in content)


SAMPLED = dict(model="fake", prompt="hello world", max_tokens=12, temperature=1.5, top_p=1.0,
               extra_body={"top_k": 0, "min_p": 0.0, "ignore_eos": True})


def test_n_choices_are_the_seeds_replies(client):
    """Choice i of a seeded request is the reply of the same request with n = 1 and seed + i; the prompt's tokens
    count once, every choice's generated tokens count."""
    r = client.completions.create(n=3, seed=11, **SAMPLED)
    alone = [client.completions.create(seed=11 + i, **SAMPLED) for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) == 36


def test_n_choices_streamed(client):
    whole = client.chat.completions.create(model="fake", messages=MESSAGES, n=3, seed=5, temperature=1.5,
                                           max_tokens=6, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="fake", messages=MESSAGES, n=3, seed=5, temperature=1.5,
                                                  max_tokens=6, stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True}))
    texts, roles, finished = {}, {}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        roles[choice.index] = roles.get(choice.index) or choice.delta.role
        if choice.finish_reason:
            finished[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert roles == {i: "assistant" for i in range(3)} and finished == {i: "length" for i in range(3)}
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18 == whole.usage.completion_tokens


def test_a_list_of_prompts_gets_a_choice_each(client, llm):
    ids = llm.prompt_ids("hello")
    r = client.completions.create(model="fake", prompt=["hello", CHAT_PROMPT, ids], temperature=0, max_tokens=16, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [" world STOP hello"] * 2 + ["hello world"] * 2 + [" world STOP hello"] * 2
    each = [client.completions.create(model="fake", prompt=p, temperature=0, max_tokens=16).usage
            for p in ("hello", CHAT_PROMPT, ids)]
    assert r.usage.prompt_tokens == sum(u.prompt_tokens for u in each)
    assert r.usage.completion_tokens == 2 * sum(u.completion_tokens for u in each)
    stream = client.completions.create(model="fake", prompt=["hello", CHAT_PROMPT], temperature=0, max_tokens=16,
                                       stream=True)
    texts = {}
    for chunk in stream:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert texts == {0: " world STOP hello", 1: "hello world"}


def test_a_client_leaving_frees_every_choice(client, llm):
    llm.model.on_forward = lambda tokens: time.sleep(SLOW_TOKEN_S)
    try:
        stream = client.completions.create(model="fake", prompt="hello world", max_tokens=400, stream=True, n=3,
                                           extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 5:
                break
        stream.close()
        time.sleep(10 * SLOW_TOKEN_S)  # the scheduler's next turns drop them
        fed = llm.model.tokens_fed
        time.sleep(20 * SLOW_TOKEN_S)
        still_fed = llm.model.tokens_fed - fed
        r = client.completions.create(model="fake", prompt="hello", temperature=0, max_tokens=4)
    finally:
        llm.model.on_forward = None
    assert still_fed == 0  # none of the three abandoned choices goes on generating
    assert r.choices[0].text == " world STOP hello"

def test_choices_that_cannot_all_start_end_cleanly(llm):
    """Every request thread taken: a streamed request whose third choice cannot start gets an error event, and its
    other choices are closed and freed."""
    app = create_app(llm, api_key=API_KEY, model_name="fake")
    slot = app.state.endpoints.slot
    slot.worker = threading.BoundedSemaphore(2)  # two of the three choices' calls get a thread
    with BackgroundServer(app) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.APIError, match="busy"):
            list(c.completions.create(model="fake", prompt="hello world", max_tokens=50, n=3, stream=True))
        deadline = time.monotonic() + 10
        while (slot.in_use or slot.worker._value != 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slot.in_use == 0 and slot.waiting == 0 and slot.worker._value == 2
        slot.worker = threading.BoundedSemaphore(8)
        r = c.completions.create(model="fake", prompt="hello", temperature=0, max_tokens=16, n=2)
        assert [ch.text for ch in r.choices] == [" world STOP hello"] * 2


def test_wrong_or_missing_key(server):
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="fake", prompt="hello")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, body = post(server, "/tokenize", {"content": "hello"}, key="")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"prompt": ["hello"] * 9, "n": 2}, "prompt"),
    ({"extra_body": {"bogus_field": 1}}, "bogus_field"),
    ({"stop": [3]}, "stop"),
])
def test_invalid_body_names_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake", **{"prompt": "hello", **kwargs})
    assert info.value.body["param"] == param and param in info.value.body["message"]


def test_invalid_chat_bodies(client, server):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="fake", messages=[{"role": "user"}])
    status, body = post(server, "/v1/chat/completions", {"model": "fake"})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = post(server, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]


def test_request_size_and_context_limits(client, server):
    status, body = post(server, "/v1/completions", {"prompt": "x" * (2 * MAX_REQUEST_BYTES)})
    assert status == 413 and body["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake", prompt="hello " * 600, max_tokens=4)  # 1200 tokens > 512
    assert "context" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake", prompt="hello", max_tokens=600)
    assert info.value.body["code"] == "context_length_exceeded"


def test_tokenize_and_detokenize(server, llm):
    status, body = post(server, "/tokenize", {"content": "hello world"})
    assert status == 200 and body["tokens"] == llm.tokenize("hello world")
    status, body = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["content"] == "hello world"
    status, body = post(server, "/detokenize", {"tokens": [10 ** 7]})
    assert status == 400 and body["error"]["param"] == "tokens"


def test_disconnect_mid_stream_frees_the_slot(client, llm):
    llm.model.on_forward = lambda tokens: time.sleep(SLOW_TOKEN_S)
    try:
        stream = client.completions.create(model="fake", prompt="hello world", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()  # the client leaves
        fed_at_close = llm.model.tokens_fed
        t0 = time.monotonic()
        r = client.completions.create(model="fake", prompt="hello", temperature=0, max_tokens=4)
        waited = time.monotonic() - t0
    finally:
        llm.model.on_forward = None
    assert r.choices[0].text == " world STOP hello"
    # the abandoned generation stopped within a few tokens instead of running its 400 (20 s)
    assert llm.model.tokens_fed - fed_at_close < 40
    assert waited < 400 * SLOW_TOKEN_S / 4


def test_client_leaving_a_whole_request_stops_its_generation(server, llm):
    import socket

    body = json.dumps({"prompt": "hello world", "max_tokens": 400, "ignore_eos": True}).encode()
    llm.model.on_forward = lambda tokens: time.sleep(SLOW_TOKEN_S)
    try:
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(10 * SLOW_TOKEN_S)  # a few tokens in
        t0 = time.monotonic()
        status, r = post(server, "/v1/completions", {"prompt": "hello", "temperature": 0, "max_tokens": 4})
        waited = time.monotonic() - t0
    finally:
        llm.model.on_forward = None
    assert status == 200 and r["choices"][0]["text"] == " world STOP hello"
    assert waited < 400 * SLOW_TOKEN_S / 4  # the abandoned request did not run its 400 tokens first


def test_concurrent_streams_are_all_answered(server):
    results, errors = {}, []

    def one(i):
        try:
            c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
            chunks = c.chat.completions.create(model="fake", messages=MESSAGES, temperature=0, stream=True)
            results[i] = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        except Exception as e:  # collected, so the assertion shows every failure
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert results == {i: "hello world" for i in range(8)}


def test_real_model_through_the_server(smollm2_path):
    import edgellm
    from conftest import SMOLLM2, load_reference
    from test_api_real_models import assert_greedy_matches_llama_cpp

    ref = load_reference(SMOLLM2)[0]["greedy"][0]  # "The capital of France is" -> " Paris.\n\nThe United ..."
    m = edgellm.load(smollm2_path, n_ctx=256)
    with BackgroundServer(create_app(m, model_name="smollm2")) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.completions.create(model="smollm2", prompt=ref["prompt"], temperature=0, max_tokens=8)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        assert_greedy_matches_llama_cpp(SMOLLM2, 0, m.last_completion.tokens)
        pieces = [ch.choices[0].text for ch in c.completions.create(
            model="smollm2", prompt=ref["prompt"], temperature=0, max_tokens=8, stream=True)]
        assert "".join(pieces) == r.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(smollm2_path):
    """lm-eval's loglikelihood call (echo, logprobs, max_tokens 0 or 1), through the server's scheduler: the
    prompt's tokens come back scored, each equal to the Python API's, and what is generated after them follows."""
    import edgellm

    m = edgellm.load(smollm2_path, n_ctx=256)
    prompt = "Question: what is the capital of France? Answer: Paris"
    want = m.create_completion(prompt, echo=True, logprobs=2, max_tokens=1, temperature=0)["choices"][0]
    with BackgroundServer(create_app(m, model_name="smollm2")) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.completions.create(model="smollm2", prompt=prompt, echo=True, logprobs=2, max_tokens=0)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
        assert len(lp.tokens) == len(m.prompt_ids(prompt)) == r.usage.prompt_tokens
        assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
        assert lp.token_logprobs == want["logprobs"]["token_logprobs"][:-1]
        assert lp.top_logprobs == want["logprobs"]["top_logprobs"][:-1]
        r = c.completions.create(model="smollm2", prompt=[prompt, prompt[:-6]], echo=True, logprobs=2, max_tokens=1,
                                 temperature=0)
        assert r.choices[0].text == want["text"] and r.choices[0].logprobs.model_dump() == want["logprobs"]
        assert r.choices[1].logprobs.token_logprobs[:-1] == want["logprobs"]["token_logprobs"][:-2]  # its prompt
        chunks = [ch.choices[0] for ch in c.completions.create(model="smollm2", prompt=prompt, echo=True, logprobs=2,
                                                               max_tokens=1, temperature=0, stream=True)]
        assert chunks[0].text == prompt and "".join(ch.text for ch in chunks) == want["text"]
        assert sum((ch.logprobs.token_logprobs for ch in chunks if ch.logprobs), []) == \
            want["logprobs"]["token_logprobs"]


def test_max_tokens_0_needs_echo(client):
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="fake", prompt="hello", max_tokens=0)
    r = client.completions.create(model="fake", prompt="hello", echo=True, max_tokens=0)
    assert r.choices[0].text == "hello" and r.usage.completion_tokens == 0

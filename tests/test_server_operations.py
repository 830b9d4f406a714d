"""Running the server: /metrics (Prometheus, per app), /health (loading, ok, busy), the Host and Content-Type
checks of a key-less server, opt-in CORS, the API key's sources, and OpenAI-shaped errors with the right status.
Against the real SmolLM2 through the official openai client and httpx."""
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # a test dependency: these checks must run in CI
parser = pytest.importorskip("prometheus_client.parser")

import edgellm  # noqa: E402
from edgellm.errors import EdgeLLMError, NumericalError  # noqa: E402
from edgellm.server import BackgroundServer, ScheduledModel, create_app  # noqa: E402
from edgellm.serving.guard import API_KEY_ENV, LoadingGate, host_allowed, resolve_api_key  # noqa: E402

MESSAGES = [{"role": "user", "content": "Name a colour."}]
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return edgellm.load(smollm2_path, n_ctx=256)


def serve(llm, **kw):
    return BackgroundServer(create_app(llm, model_name="smollm2", **kw))


def client_of(srv, key="unused"):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=600)


def scrape(srv) -> dict:
    """{(sample name, labels as a sorted tuple): value} from /metrics, parsed by prometheus-client's own parser."""
    r = httpx.get(srv.base_url + "/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_requests_tokens_and_times_per_server(llm):
    with serve(llm, parallel=2) as srv, serve(llm) as other:
        c = client_of(srv)
        r = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, temperature=0)
        chunks = list(c.completions.create(model="m", prompt="The sky is", max_tokens=5, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="m", prompt="x", max_tokens=1, temperature="hot")
        m = scrape(srv)
        usage = chunks[-1].usage
        assert m[("edgellm_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] == 1
        assert m[("edgellm_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1
        assert m[("edgellm_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
        assert m[("edgellm_generated_tokens_total", ())] == r.usage.completion_tokens + usage.completion_tokens
        assert m[("edgellm_prompt_tokens_total", ())] == r.usage.prompt_tokens + usage.prompt_tokens
        assert m[("edgellm_time_to_first_token_seconds_count", ())] == 2
        assert m[("edgellm_generation_tokens_per_second_count", ())] == 2
        assert m[("edgellm_prompt_cache_lookups_total", (("result", "hit"),))] + \
            m[("edgellm_prompt_cache_lookups_total", (("result", "miss"),))] == 2
        assert (m[("edgellm_queue_depth", ())], m[("edgellm_slots_busy", ())], m[("edgellm_slots", ())]) == (0, 0, 2)
        assert m[("edgellm_requests_in_flight", ())] == 1  # this scrape
        # one request at a time: each decode step advanced one sequence, fed every token but each request's last
        # (the first came from the prompt's logits)
        steps = m[("edgellm_decode_steps_total", ())]
        assert steps == r.usage.completion_tokens - 1 + usage.completion_tokens - 1
        assert m[("edgellm_decode_sequences_total", ())] == steps
        assert m[("edgellm_decode_seconds_total", ())] > 0
        # the other server's registry saw none of it
        o = scrape(other)
        assert o[("edgellm_generated_tokens_total", ())] == 0
        assert o[("edgellm_time_to_first_token_seconds_count", ())] == 0


def test_n_choices_share_one_prefill_and_are_each_counted(llm):
    prompt = "The history of bread begins with flat loaves baked on hot stones. " * 8 + "In one line:"
    with serve(llm, parallel=3) as srv:
        r = client_of(srv).completions.create(model="m", prompt=prompt, max_tokens=4, n=3, temperature=0.8, seed=3)
        m = scrape(srv)
    n_prompt = r.usage.prompt_tokens
    assert n_prompt > 100 and r.usage.completion_tokens == 12 and len(r.choices) == 3
    assert m[("edgellm_prompt_tokens_total", ())] == 3 * n_prompt  # the metrics count each sequence's prompt
    assert m[("edgellm_generated_tokens_total", ())] == 12
    assert m[("edgellm_time_to_first_token_seconds_count", ())] == 3
    # the second and third choices took the first's prefill whole: its rows and its last row's logits
    assert m[("edgellm_prompt_cache_tokens_total", ())] == 2 * n_prompt


def test_decode_steps_count_the_sequences_batched_together(llm):
    with serve(llm, parallel=2) as srv:
        c = client_of(srv)
        first = c.completions.create(model="m", prompt="Once upon a time", max_tokens=48, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
        next(iter(first))  # generating: the second joins it in the decode steps
        second = c.completions.create(model="m", prompt="The sea was", max_tokens=48, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        list(second), list(first)
        m = scrape(srv)
        steps, sequences = m[("edgellm_decode_steps_total", ())], m[("edgellm_decode_sequences_total", ())]
        assert sequences == 2 * 47  # each fed all its tokens but the last
        assert steps < sequences <= 2 * steps


def test_prompt_cache_hits_are_counted(llm):
    with serve(llm) as srv:
        c = client_of(srv)
        for _ in range(2):  # the second asks for the same prompt: the model re-uses its cached prefix
            c.completions.create(model="m", prompt=" sea" * 100, max_tokens=2, temperature=0)
        m = scrape(srv)
        assert m[("edgellm_prompt_cache_lookups_total", (("result", "hit"),))] == 1
        assert m[("edgellm_prompt_cache_lookups_total", (("result", "miss"),))] == 1
        assert m[("edgellm_prompt_cache_tokens_total", ())] > 0


def test_health_says_loading_then_ok_then_busy(llm):
    gate = LoadingGate()
    with BackgroundServer(gate) as srv:
        r = httpx.get(srv.base_url + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "loading" and r.headers["retry-after"].isdigit()
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
        gate.app = create_app(llm)
        r = httpx.get(srv.base_url + "/health", timeout=30)
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
    with serve(llm, max_queue=0) as srv:  # a full queue: what a new request would get, /health says first
        r = httpx.get(srv.base_url + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "busy" and r.headers["retry-after"].isdigit()


def test_health_reports_no_slot_while_a_stream_holds_it(llm):
    with serve(llm, parallel=1) as srv:  # one slot: the stream holds all of them
        stream = client_of(srv).completions.create(model="m", prompt="Once upon a time", max_tokens=200,
                                                   stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # generating now, and held until closed
        try:
            r = httpx.get(srv.base_url + "/health?fail_on_no_slot=1", timeout=30)
            assert r.status_code == 503 and r.json()["status"] == "no slot available"
            assert (r.json()["slots_idle"], r.json()["slots_processing"]) == (0, 1)
            assert httpx.get(srv.base_url + "/health", timeout=30).status_code == 200  # busy, but healthy
        finally:
            stream.close()


def test_keyless_server_refuses_foreign_hosts_and_non_json_bodies(llm):
    with serve(llm) as srv:
        url = srv.base_url + "/v1/completions"
        body = b'{"prompt": "The sky is", "max_tokens": 1}'
        for host in ("evil.example", f"evil.example:{srv.port}", "127.0.0.1.evil.example"):
            r = httpx.post(url, content=body, headers={"Host": host, "Content-Type": "application/json"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host
            assert httpx.get(srv.base_url + "/v1/models", headers={"Host": host}).status_code == 403
        for host in ("localhost", f"localhost:{srv.port}", f"127.0.0.1:{srv.port}", "[::1]:80"):
            r = httpx.post(url, content=body, headers={"Host": host, "Content-Type": "application/json"})
            assert r.status_code == 200, host
        for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"Content-Type": ctype} if ctype else {}
            r = httpx.post(url, content=body, headers=headers)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", ctype
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200
    with serve(llm, api_key="k") as srv:  # a key replaces those checks: a browser cannot send it cross-origin
        r = httpx.post(srv.base_url + "/v1/completions", content=b'{"prompt": "The sky is", "max_tokens": 1}',
                       headers={"Host": "evil.example", "Content-Type": "text/plain", "Authorization": "Bearer k"})
        assert r.status_code == 200
        r = httpx.post(srv.base_url + "/tokenize", json={"content": "x"}, headers={"Authorization": "Bearer no"})
        assert r.status_code == 401


@pytest.mark.parametrize("host, bound, allowed", [
    ("localhost:8080", "127.0.0.1", True), ("127.0.0.5", "127.0.0.1", True), ("[::1]:8080", "::1", True),
    ("192.168.1.7:8080", "192.168.1.7", True), ("192.168.1.7", "127.0.0.1", False),
    ("10.0.0.3:80", "0.0.0.0", True), ("rebind.example", "0.0.0.0", False), ("api.localhost", "127.0.0.1", True),
    ("localhost.example", "127.0.0.1", False),
])
def test_host_rules(host, bound, allowed):
    assert host_allowed(host, bound) is allowed


def test_cors_is_opt_in_with_preflight(llm):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with serve(llm, api_key="k", cors_origins=[ORIGIN]) as srv:
        r = httpx.options(srv.base_url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = httpx.post(srv.base_url + "/tokenize", json={"content": "x"},
                       headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = httpx.post(srv.base_url + "/tokenize", json={"content": "x"}, headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN  # readable refusal
        r = httpx.options(srv.base_url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers
    with serve(llm, api_key="k") as srv:  # off by default
        r = httpx.options(srv.base_url + "/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = httpx.post(srv.base_url + "/tokenize", json={"content": "x"},
                       headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_api_key_sources(tmp_path):
    keyfile = tmp_path / "key"
    keyfile.write_text("s3cret-value\n")
    assert resolve_api_key(file=str(keyfile), environ={}) == "s3cret-value"
    assert resolve_api_key(environ={API_KEY_ENV: "from-env"}) == "from-env"
    assert resolve_api_key("flag", environ={}) == "flag"
    assert resolve_api_key(environ={}) is None
    for kwargs in ({"file": str(keyfile), "environ": {API_KEY_ENV: "from-env"}},
                   {"flag": "s3cret-value", "file": str(keyfile), "environ": {}},
                   {"flag": "s3cret-value", "environ": {API_KEY_ENV: "from-env"}}):
        with pytest.raises(EdgeLLMError, match="one way") as info:
            resolve_api_key(**kwargs)
        assert "s3cret" not in str(info.value) and "from-env" not in str(info.value)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(EdgeLLMError, match="empty"):
        resolve_api_key(file=str(tmp_path / "empty"), environ={})
    with pytest.raises(EdgeLLMError, match="cannot read"):
        resolve_api_key(file=str(tmp_path / "missing"), environ={})


def test_every_failure_is_an_openai_error_with_the_right_status(llm, monkeypatch):
    with serve(llm) as srv:
        r = httpx.get(srv.base_url + "/v2/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = httpx.get(srv.base_url + "/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        assert "POST" in r.headers["allow"]
        c = client_of(srv)

        def fault(*args, **kwargs):
            raise NumericalError("the logits hold NaN")
        monkeypatch.setattr(ScheduledModel, "create_completion", fault)  # the request's call on the scheduler
        with pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model="m", prompt="The sky", max_tokens=2)
        assert info.value.status_code == 500 and info.value.body["code"] == "model_error"

        def bug(*args, **kwargs):
            raise KeyError("internal detail")
        monkeypatch.setattr(ScheduledModel, "create_completion", bug)
        with pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model="m", prompt="The sky", max_tokens=2)
        assert info.value.body["type"] == "server_error" and "internal detail" not in info.value.body["message"]
        monkeypatch.undo()
        # uvicorn closes a connection after an unexpected exception, so a pooled one may be reset: a new client
        r = client_of(srv).completions.create(model="m", prompt="The sky", max_tokens=2)  # the server is still fine
        assert r.usage.completion_tokens == 2


def test_unexpected_fault_mid_stream_ends_with_an_error_event(llm, monkeypatch):
    real = ScheduledModel.create_chat_completion  # the request's call on the scheduler

    def failing(self, *args, **kwargs):
        def gen():
            for i, chunk in enumerate(real(self, *args, **kwargs)):
                if i == 2:
                    raise KeyError("internal detail")
                yield chunk
        return gen()
    with serve(llm) as srv:
        monkeypatch.setattr(ScheduledModel, "create_chat_completion", failing)
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=600,
                          json={"messages": MESSAGES, "max_tokens": 20, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert '"server_error"' in lines[-1] and "internal detail" not in lines[-1]
        monkeypatch.undo()
        r = client_of(srv).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert r.usage.completion_tokens == 2


"""Speculative decoding in the server's scheduler, per sequence inside continuous batching: with prompt lookup or a
draft model, requests decoded together give plain greedy decoding's tokens and logprobs, token for token, with
stop strings and max_tokens; drafts are made, accepted and rejected (so the rollback runs); per-request control
(draft_max / draft_min, llama-server's speculative.n_max / n_min over HTTP, checked with 400s); the /metrics
counters of drafted and accepted tokens; the batch-aware draft length (a draft's rows slow every sequence in the
forward); and through the openai client against SmolLM2 served with prompt lookup, concurrent greedy chats equal
the same chats without it."""
import json
import threading
import time

import pytest
from hardening_tiny import tiny_spec, write_loadable_tiny_model

import edgellm
from edgellm.errors import SamplingError
from edgellm.generation.options import parse_options
from edgellm.generation.results import Completion
from edgellm.generation.scheduler import Scheduler
from edgellm.generation.speculative import ForwardCosts, Speculator

# text that repeats itself, so prompt lookup finds drafts (and a random tiny model's loops repeat it too)
REPEATING = "hello world hello world STOP or hello world or hello he ll world hello world hello"
TINY_REQUESTS = [  # (prompt, options): run together, each must equal its plain greedy run
    (REPEATING, {"max_tokens": 40}),
    (REPEATING + " world", {"max_tokens": 33, "logprobs": 2}),
    ("hello he ll", {"max_tokens": 25, "stop": ["or hello"]}),
    (REPEATING * 2, {"max_tokens": 30}),
]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("server_spec")
    target = write_loadable_tiny_model(d / "target.gguf", tiny_spec(seed=5, weight_type="Q8_0"))
    draft = write_loadable_tiny_model(d / "draft.gguf", tiny_spec(seed=5, weight_type="Q4_0"))  # mostly agrees
    return edgellm.load(str(target), n_ctx=256, n_threads=1, draft_model=str(draft), speculative=None)


@pytest.fixture
def cheap_drafts(monkeypatch):
    """A fixed, low cost per drafted row instead of timed ones: the tiny models' drafts (and rejections) are then
    the same on any machine and load."""
    monkeypatch.setattr(ForwardCosts, "BETA_START", 0.02)
    monkeypatch.setattr(ForwardCosts, "timed_verification", lambda self, rows, seconds, n_seqs=1: None)


def run_together(model, speculative, extra=None):
    scheduler = Scheduler(model, 3, seq_ctx=256, speculative=speculative)
    if speculative == "draft":  # the tiny models agree on everything: every third drafted token is made wrong,
        for slot in scheduler.slots:  # so that rejections (and the draft cache's rollback) happen too
            slot.drafter.choose = wrong_every_third(slot.drafter.choose, model.n_vocab)
    try:
        requests = [scheduler.submit(model.prompt_ids(p), parse_options("t", {**o, "temperature": 0, **(extra or {})},
                                                                        {}))
                    for p, o in TINY_REQUESTS]
        out = []
        for r in requests:
            out += [e for e in r.events() if isinstance(e, Completion)]
        return out, scheduler.stats
    finally:
        scheduler.close()


def wrong_every_third(choose, n_vocab):
    count = [0]

    def wrapped(logits, history, drafted):
        token, q = choose(logits, history, drafted)
        count[0] += 1
        return ((token + 1) % n_vocab if count[0] % 3 == 0 else token), q
    return wrapped


@pytest.mark.parametrize("mode", ["lookup", "draft"])
def test_speculative_requests_in_a_batch_equal_plain_greedy(tiny_pair, mode, cheap_drafts, monkeypatch):
    plain = [tiny_pair.complete(p, speculative=None, **o) for p, o in TINY_REQUESTS]
    batched, plain_stats = run_together(tiny_pair, None)
    draft_fm, together = tiny_pair.draft_model.model, []
    multi = draft_fm.forward_multi
    monkeypatch.setattr(draft_fm, "forward_multi", lambda tokens, caches: (together.append(len(tokens)),
                                                                           multi(tokens, caches))[1])
    spec, stats = run_together(tiny_pair, mode)
    if mode == "draft":  # the slots' drafts ran through one draft forward per position
        assert together and max(together) > 1
    assert [c.tokens for c in batched] == [c.tokens for c in plain]
    for a, b in zip(plain, spec):
        assert b.tokens == a.tokens and b.text == a.text and b.finish_reason == a.finish_reason
        assert [i.logprob for i in b.token_info] == [i.logprob for i in a.token_info]
        assert [i.top_logprobs for i in b.token_info] == [i.top_logprobs for i in a.token_info]
        assert b.speculative == mode
    drafted, accepted = sum(c.draft_tokens for c in spec), sum(c.accepted_tokens for c in spec)
    assert accepted > 0 and drafted > accepted  # drafts were kept, and some rolled back
    assert (stats["draft_tokens"], stats["accepted_tokens"]) == (drafted, accepted)
    # fewer forward passes than without: accepted drafts came in the same pass
    assert stats["decode_steps"] < plain_stats["decode_steps"]


def test_the_scheduler_times_each_forward_once_in_one_shared_table(tiny_pair, monkeypatch):
    """Every request's draft length reads one table of forward costs, the server's, kept across requests; each
    forward is timed into it once, not once per sequence in it."""
    timed, tables = [], []
    monkeypatch.setattr(ForwardCosts, "timed_step", lambda self, seconds, n_seqs=1: timed.append(self))
    monkeypatch.setattr(ForwardCosts, "timed_verification", lambda self, rows, seconds, n_seqs=1: timed.append(self))
    init = Speculator.__init__
    monkeypatch.setattr(Speculator, "__init__", lambda self, *a, **k: (init(self, *a, **k),
                                                                       tables.append(self.length.costs))[0])
    _, stats = run_together(tiny_pair, "lookup")
    assert len(tables) == len(TINY_REQUESTS) and all(t is tables[0] for t in tables)
    assert tables[0].generation == len(TINY_REQUESTS)
    assert timed and all(t is tables[0] for t in timed)
    assert len(timed) == stats["decode_steps"] - stats["mixed_steps"]


def test_the_servers_forward_costs_are_kept_on_disk_for_its_next_run(tiny_pair, tmp_path, monkeypatch):
    """When its requests are done the scheduler saves its table (a file of its own, not the API's); the next
    scheduler of the same model starts from it."""
    from edgellm.generation import cost_store
    monkeypatch.setenv(cost_store.ENV, str(tmp_path))
    first = Scheduler(tiny_pair, 3, seq_ctx=256, speculative="lookup")
    try:
        request = first.submit(tiny_pair.prompt_ids(REPEATING), parse_options("t", {"max_tokens": 40,
                                                                                    "temperature": 0}, {}))
        list(request.events())
        for _ in range(200):  # saved once the loop is idle again
            if first.spec_costs_path.exists():
                break
            time.sleep(0.01)
        saved = first.spec_costs.saved()
    finally:
        first.close()
    assert first.spec_costs_path.parent == tmp_path and (saved["steps"] or saved["verified"])
    assert first.spec_costs_path != tiny_pair._spec_cost_path("lookup")
    second = Scheduler(tiny_pair, 3, seq_ctx=256, speculative="lookup")
    try:
        assert second.spec_costs.saved() == json.loads(first.spec_costs_path.read_text())
        assert second.spec_costs.steps == {int(n): c for n, c in saved["steps"].items()}
        assert second.spec_costs.verified == {int(r): c for r, (c, _) in saved["verified"].items()}
    finally:
        second.close()


def test_speculative_options_are_checked(tiny_pair):
    with pytest.raises(SamplingError):
        Scheduler(tiny_pair, 1, speculative="beam")
    with pytest.raises(ValueError):
        Scheduler(tiny_pair, 1, speculative="lookup", draft_max=0)


def test_per_request_draft_lengths(tiny_pair, monkeypatch, cheap_drafts):
    plain = [tiny_pair.complete(p, speculative=None, **o) for p, o in TINY_REQUESTS]
    off, stats = run_together(tiny_pair, "lookup", {"draft_max": 0})
    assert [c.tokens for c in off] == [c.tokens for c in plain]
    assert stats["draft_tokens"] == 0 and all(c.speculative is None for c in off)
    drafts, batch_sizes = [], []
    record, propose = Speculator.record, Speculator.propose
    monkeypatch.setattr(Speculator, "record", lambda self, d, a: (drafts.append(d), record(self, d, a))[1])
    monkeypatch.setattr(Speculator, "propose", lambda self, h, room, n_seqs=1: (
        batch_sizes.append(n_seqs), propose(self, h, room, n_seqs))[1])
    few, stats = run_together(tiny_pair, "lookup", {"draft_max": 3, "draft_min": 2})
    assert [c.tokens for c in few] == [c.tokens for c in plain]
    assert drafts and all(2 <= d <= 3 for d in drafts)  # a shorter lookup match is not verified
    assert max(batch_sizes) == 3  # each sequence's draft length is chosen knowing the batch it runs in
    with pytest.raises(SamplingError):
        parse_options("t", {"draft_max": 2, "draft_min": 3}, {})
    with pytest.raises(SamplingError):
        tiny_pair.generate_batch(["a", "b"], max_tokens=2, draft_max=2)


def test_http_speculative_fields_and_metrics(tiny_pair, cheap_drafts):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from prometheus_client import parser
    from edgellm.server import BackgroundServer, create_app
    body = {"prompt": REPEATING, "max_tokens": 40, "temperature": 0}
    plain = tiny_pair.create_completion(REPEATING, max_tokens=40, temperature=0, speculative=None)

    def scrape(srv):
        text = httpx.get(srv.base_url + "/metrics", timeout=60).text
        return {s.name: s.value for f in parser.text_string_to_metric_families(text) for s in f.samples}

    with BackgroundServer(create_app(tiny_pair, model_name="m", parallel=2, speculative="lookup")) as srv:
        def post(extra):
            return httpx.post(srv.base_url + "/v1/completions", json={**body, **extra}, timeout=120)
        for bad, param in [({"speculative.n_max": -1}, "speculative.n_max"), ({"speculative.n_max": 65}, None),
                           ({"speculative.n_max": "4"}, None), ({"speculative.n_min": 1.5}, "speculative.n_min"),
                           ({"speculative.n_max": 2, "speculative.n_min": 3}, "speculative.n_min"),
                           ({"speculative.n_min": 13}, "speculative.n_min")]:  # above the server's 12
            r = post(bad)
            assert r.status_code == 400, bad
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == (param or next(iter(bad))), bad
        before = scrape(srv)
        r = post({"speculative.n_max": 6, "speculative.n_min": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain["choices"][0]["text"]
        details = r.json()["usage"]["completion_tokens_details"]
        after = scrape(srv)
        drafted = details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
        assert drafted > 0
        assert after["edgellm_draft_tokens_total"] - before["edgellm_draft_tokens_total"] == drafted
        assert after["edgellm_draft_accepted_tokens_total"] - before["edgellm_draft_accepted_tokens_total"] == \
            details["accepted_prediction_tokens"]
        r = post({"speculative.n_max": 0})  # drafting off for this request
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain["choices"][0]["text"]
        assert r.json()["usage"].get("completion_tokens_details") is None
        assert scrape(srv)["edgellm_draft_tokens_total"] == after["edgellm_draft_tokens_total"]
    with BackgroundServer(create_app(tiny_pair, model_name="m", parallel=1)) as srv:  # no speculation
        r = httpx.post(srv.base_url + "/v1/completions", json={**body, "speculative.n_max": 4}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.n_max"
        r = httpx.post(srv.base_url + "/v1/completions", json={**body, "speculative.n_max": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain["choices"][0]["text"]


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 through the openai client
# ---------------------------------------------------------------------------------------------------------------

PASSAGE = ("Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of Spain. "
           "Rome is the capital of Italy. Lisbon is the capital of Portugal.")
CHATS = [
    dict(messages=[{"role": "user", "content": "Copy this text exactly: " + PASSAGE}], max_tokens=40),
    dict(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16),
    dict(messages=[{"role": "user", "content": "Repeat after me: the sea, the sky, the sea, the sky."}],
         max_tokens=24),
]


def test_served_with_prompt_lookup_equals_plain(smollm2_path, cheap_drafts, monkeypatch):
    # drafting priced by cheap_drafts, with no cost table loaded from earlier runs: timed costs on a busy host could
    # price every draft out, and the copied passage's drafts are asserted below
    monkeypatch.setenv("EDGELLM_SPEC_COSTS", "off")
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    from edgellm.server import BackgroundServer, create_app
    model = edgellm.load(smollm2_path, n_ctx=512)
    alone = [model.create_chat_completion(temperature=0, speculative=None, **kw) for kw in CHATS]
    results, errors = {}, []

    def one(i, kw, stream):
        try:
            c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
            if stream:
                chunks = list(c.chat.completions.create(model="m", temperature=0, stream=True,
                                                        stream_options={"include_usage": True}, **kw))
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                results[i] = (text, chunks[-1].usage)
            else:
                r = c.chat.completions.create(model="m", temperature=0, **kw)
                results[i] = (r.choices[0].message.content, r.usage)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with BackgroundServer(create_app(model, model_name="m", parallel=2, speculative="lookup")) as srv:
        threads = [threading.Thread(target=one, args=(i, kw, i == 2)) for i, kw in enumerate(CHATS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    assert not errors, errors
    for i, expected in enumerate(alone):
        text, usage = results[i]
        assert text == expected["choices"][0]["message"]["content"], i
        assert usage.completion_tokens == expected["usage"]["completion_tokens"]
    details = results[0][1].completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0  # the copied passage was drafted

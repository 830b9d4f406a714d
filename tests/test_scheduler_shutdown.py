"""The scheduler's shutdown: close() ends every request still queued or running with ServerClosing within a bound,
also when the loop's thread is stuck in a forward pass; a fault inside a turn ends only the requests in slots, and
the loop goes on; a reader never waits on a loop that is gone. On a tiny model (no real weights needed)."""
import threading
import time

import pytest
from hardening_tiny import tiny_spec, write_loadable_tiny_model

import edgellm
from edgellm.errors import ServerClosing
from edgellm.generation.options import parse_options
from edgellm.generation.results import Completion
from edgellm.generation.scheduler import Scheduler

N_PARALLEL = 2
N_REQUESTS = 5       # more than the slots: some are queued when the scheduler closes
LONG = 100           # tokens a request asks for: it is still running when closed
BOUND_S = 10.0       # every waiting reader must be answered within this (a hang is what is tested against)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_loadable_tiny_model(tmp_path_factory.mktemp("shutdown") / "tiny.gguf", tiny_spec(seed=3))
    return edgellm.load(str(path), n_ctx=256, n_threads=1)


def opts(max_tokens=LONG):
    return parse_options("test", {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}, {})


def read_all(request, outcome, first_event=None, gate=None):
    """Read a request's events to its end; outcome gets ("completion", c) or ("error", e) and the time. With a
    gate, the reader stops after its first event until the gate opens (its request pauses on a full buffer)."""
    try:
        for event in request.events():
            if first_event is not None:
                first_event.set()
            if gate is not None:
                gate.wait(60)
            if isinstance(event, Completion):
                outcome.append(("completion", event, time.monotonic()))
    except Exception as e:  # noqa: BLE001 - the test looks at which
        outcome.append(("error", e, time.monotonic()))


def start_readers(scheduler, ids, n, gate=None):
    requests, outcomes, threads, started = [], [], [], threading.Event()
    for _ in range(n):
        request = scheduler.submit(ids, opts())
        outcome = []
        t = threading.Thread(target=read_all, args=(request, outcome, started, gate), daemon=True)
        t.start()
        requests.append(request)
        outcomes.append(outcome)
        threads.append(t)
    return requests, outcomes, threads, started


def test_close_ends_running_and_queued_requests(tiny):
    scheduler = Scheduler(tiny, N_PARALLEL, seq_ctx=256, buffer_events=4)  # small buffers: requests stay running
    ids = tiny.tokenize("hello world")
    gate = threading.Event()
    requests, outcomes, threads, started = start_readers(scheduler, ids, N_REQUESTS, gate)
    assert started.wait(300)  # (the first run compiles the kernels)
    deadline = time.monotonic() + 30  # the later submits reach the slots and the queue
    while not (scheduler.n_active == N_PARALLEL and scheduler.n_queued == N_REQUESTS - N_PARALLEL):
        assert time.monotonic() < deadline, (scheduler.n_active, scheduler.n_queued)
        time.sleep(0.01)
    t0 = time.monotonic()
    scheduler.close()
    gate.set()
    for t in threads:
        t.join(BOUND_S)
        assert not t.is_alive(), "a reader is still waiting after close()"
    for outcome in outcomes:
        kind, value, at = outcome[0]
        assert at - t0 < BOUND_S
        assert kind == "error" and isinstance(value, ServerClosing), outcome
    with pytest.raises(ServerClosing):
        scheduler.submit(ids, opts())


def test_close_answers_readers_while_the_loop_is_stuck_in_a_forward(tiny):
    scheduler = Scheduler(tiny, N_PARALLEL, seq_ctx=256)
    release, entered = threading.Event(), threading.Event()
    decode = scheduler.engine.decode

    def stuck(slots, tokens):  # a forward pass that does not return until released
        entered.set()
        release.wait(60)
        return decode(slots, tokens)
    scheduler.engine.decode = stuck
    ids = tiny.tokenize("hello world")
    requests, outcomes, threads, _ = start_readers(scheduler, ids, N_REQUESTS)
    assert entered.wait(300)
    t0 = time.monotonic()
    scheduler.close(timeout=0.2)
    try:
        for t, outcome in zip(threads, outcomes):
            t.join(BOUND_S)
            assert not t.is_alive()
            kind, value, at = outcome[0]
            assert kind == "error" and isinstance(value, ServerClosing) and at - t0 < BOUND_S
    finally:
        release.set()
    scheduler._thread.join(30)
    assert not scheduler._thread.is_alive()  # it stopped after the pass it was in


def test_a_fault_in_a_turn_ends_the_running_requests_and_the_loop_goes_on(tiny):
    scheduler = Scheduler(tiny, N_PARALLEL, seq_ctx=256)
    try:
        decode, calls = scheduler.engine.decode, []

        def faulty(slots, tokens):
            calls.append(len(tokens))
            if len(calls) == 2:
                raise IndexError("a bug")
            return decode(slots, tokens)
        scheduler.engine.decode = faulty
        ids = tiny.tokenize("hello world")
        outcome = []
        read_all(scheduler.submit(ids, opts(8)), outcome)
        assert outcome[0][0] == "error" and isinstance(outcome[0][1], RuntimeError)
        assert "IndexError" in str(outcome[0][1])
        outcome = []
        read_all(scheduler.submit(ids, opts(8)), outcome)  # the loop still serves
        assert outcome[0][0] == "completion" and len(outcome[0][1].tokens) == 8
    finally:
        scheduler.close()


def test_a_reader_of_a_dead_loop_is_answered(tiny):
    scheduler = Scheduler(tiny, 1, seq_ctx=256)
    release = threading.Event()
    decode = scheduler.engine.decode

    def stuck(slots, tokens):
        release.wait(60)
        return decode(slots, tokens)
    scheduler.engine.decode = stuck
    request = scheduler.submit(tiny.tokenize("hello"), opts(4))
    # the loop's thread is gone without ending its requests (as at interpreter exit): the reader notices
    request._alive = lambda: False
    outcome = []
    t = threading.Thread(target=read_all, args=(request, outcome), daemon=True)
    t.start()
    t.join(BOUND_S)
    release.set()
    scheduler.close()
    assert not t.is_alive() and outcome and isinstance(outcome[0][1], ServerClosing)


def test_a_server_stopping_answers_its_requests_in_flight(tiny):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    import httpx

    from edgellm.server import BackgroundServer, create_app
    app = create_app(tiny, model_name="tiny", parallel=1)
    scheduler = app.state.endpoints.scheduler
    release, entered = threading.Event(), threading.Event()
    decode = scheduler.engine.decode

    def stuck(slots, tokens):  # a long forward pass, which ends once the scheduler is closing
        entered.set()
        while not release.wait(0.01) and not scheduler._closed:
            pass
        return decode(slots, tokens)
    scheduler.engine.decode = stuck
    answers = {}

    def ask(name, stream):
        body = {"prompt": "hello", "max_tokens": 8, "stream": stream}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
            answers[name] = (r.status_code, r.read().decode())
    try:
        with BackgroundServer(app) as srv:
            threads = [threading.Thread(target=ask, args=(name, name == "stream"), daemon=True)
                       for name in ("whole", "stream", "queued")]
            for t in threads:
                t.start()
                assert entered.wait(300)
            deadline = time.monotonic() + 30
            while scheduler.n_queued < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            t0 = time.monotonic()
        for t in threads:
            t.join(BOUND_S)
            assert not t.is_alive()
        assert time.monotonic() - t0 < BOUND_S, (answers, time.monotonic() - t0)
    finally:
        release.set()
    statuses = {name: status for name, (status, _) in answers.items()}
    assert set(answers) == {"whole", "stream", "queued"}
    for name in ("whole", "queued"):
        status, body = answers[name]
        assert status == 503 and '"code":"server_shutting_down"' in body.replace(" ", ""), answers
    status, body = answers["stream"]
    if status == 200:  # a stream already started ends with an OpenAI error event
        assert '"server_shutting_down"' in body and "[DONE]" not in body, body
    else:
        assert status == 503, statuses

"""Clients that stall or leave, against a real server with SmolLM2 and one slot: a reader that stops reading is
cancelled after the stall timeout and its slot freed for the next request; a client that leaves while queued costs
no prefill at all; one that leaves mid-prompt stops the prefill at the next chunk."""
import json
import socket
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import edgellm  # noqa: E402
from edgellm.server import BackgroundServer, create_app  # noqa: E402

N_CTX = 2048
STALL_TIMEOUT_S = 1.0
BUFFER_EVENTS = 4
PREFILL_CHUNK = 16  # many chunks: a client leaving mid-prompt is seen long before the prompt ends
LONG_REPLY = 1500   # tokens a stalled or abandoned request would generate if nothing stopped it (a minute or more)
POLL_S = 0.01
SOCKET_BUFFER = 4096


@pytest.fixture(scope="module")
def server(smollm2_path):
    m = edgellm.load(smollm2_path, n_ctx=N_CTX)
    app = create_app(m, model_name="smollm2", parallel=1, stall_timeout_s=STALL_TIMEOUT_S,
                     buffer_events=BUFFER_EVENTS, prefill_chunk=PREFILL_CHUNK)
    with BackgroundServer(app) as srv:
        # small socket buffers (accepted sockets inherit the listener's): a stalled reader blocks sends within a
        # few dozen tokens, as it would with a slow network, instead of after megabytes of loopback buffering
        srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        srv.scheduler = app.state.endpoints.scheduler
        srv.model = m
        yield srv


def raw_stream(server, body, rcvbuf=None) -> socket.socket:
    """A streaming chat request on a raw socket that nobody reads (a small receive buffer fills at once)."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((server.host, server.port))
    data = json.dumps({"model": "smollm2", "stream": True, **body}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_for(condition, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the server")
        time.sleep(POLL_S)


def quick_answer(server):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    return c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                     temperature=0)


def test_stalled_reader_is_cancelled_and_its_slot_freed(server):
    s = server.scheduler
    before = dict(s.stats)
    # big chunks (20 alternatives per token) fill the socket buffers within a few hundred tokens
    sock = raw_stream(server, {"messages": [{"role": "user", "content": "Tell me a long story."}],
                               "max_tokens": LONG_REPLY, "ignore_eos": True, "logprobs": True, "top_logprobs": 20},
                      rcvbuf=SOCKET_BUFFER)
    try:
        wait_for(lambda: s.n_active == 1)
        t0 = time.monotonic()
        r = quick_answer(server)  # queued behind the stalled stream: served once it is cancelled
        waited = time.monotonic() - t0
    finally:
        sock.close()
    assert r.choices[0].finish_reason == "length"
    ended = (s.stats["stalled"] - before["stalled"]) + (s.stats["cancelled"] - before["cancelled"])
    assert ended == 1
    assert s.stats["generated_tokens"] - before["generated_tokens"] < LONG_REPLY  # it did not run to its end
    wait_for(lambda: s.n_active == 0 and s.n_queued == 0)
    assert waited < 120  # far below the stalled request's 1500 tokens (and logged to compare with its timeout)


def test_client_leaving_while_queued_costs_no_prefill(server):
    s = server.scheduler
    runner = raw_stream(server, {"messages": [{"role": "user", "content": "Count to a thousand."}],
                                 "max_tokens": LONG_REPLY, "ignore_eos": True})
    try:
        wait_for(lambda: s.n_active == 1)
        before = dict(s.stats)
        queued = raw_stream(server, {"messages": [{"role": "user", "content": "Hello there " * 50}],
                                     "max_tokens": 8})
        wait_for(lambda: s.n_queued == 1)
        queued.close()  # leaves while waiting for the slot
        wait_for(lambda: s.n_queued == 0)
        assert s.n_active == 1  # the runner still runs
        assert s.stats["cancelled"] - before["cancelled"] == 1
        assert s.stats["prompt_tokens"] == before["prompt_tokens"]  # the queued prompt was never started
    finally:
        runner.close()
    wait_for(lambda: s.n_active == 0)
    assert quick_answer(server).choices[0].finish_reason == "length"


def test_client_leaving_mid_prompt_stops_the_prefill(server):
    s = server.scheduler
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 150  # about 1,500 tokens: ~100 chunks
    before = dict(s.stats)
    sock = raw_stream(server, {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 8})
    try:
        wait_for(lambda: s.stats["prefill_chunks"] - before["prefill_chunks"] >= 2)
    finally:
        sock.close()
    wait_for(lambda: s.n_active == 0)
    n_prompt = s.stats["prompt_tokens"] - before["prompt_tokens"]
    prefilled = s.stats["prefilled_tokens"] - before["prefilled_tokens"]
    assert n_prompt > 1000 and prefilled < n_prompt / 2, (prefilled, n_prompt)
    assert s.stats["generated_tokens"] == before["generated_tokens"]
    assert quick_answer(server).choices[0].finish_reason == "length"

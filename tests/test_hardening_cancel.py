"""Model.cancel() and the one-call-at-a-time rule, on a tiny real model (real kernels and KV cache).

cancel() ends the call in flight at its next prompt batch (DecoderModel.should_stop) or decode step; the
cancelled prompt's whole batches stay cached and reusable; a cancel() with nothing running affects nothing. A
call that finds the model busy waits, unless its own thread holds the busy stream (then ModelBusyError); a stream
may be stepped, closed or garbage-collected on any thread. test_hardening_concurrency.py covers the cancels from
another thread mid-prompt and mid-generation.
"""
import gc
import threading
import time
import urllib.request

import numpy as np
import pytest

import edgellm
import edgellm.engine.gguf
from edgellm.api import Cancelled, Model, ModelBusyError
from edgellm.engine.models import build_model
from edgellm.tokenizer import Tokenizer
from hardening_tiny import tiny_spec, write_loadable_tiny_model

N_CTX = 128
N_BATCH = 4            # small batches, so a cancel can land between two of them
CANCEL_AT_BATCH = 3    # the batch (counting from 1) during which cancel() is called
PROMPT = "hello world, STOP or go; ld ll he! world hello"  # more than 3 batches of tokens
JOIN_TIMEOUT_S = 30    # a healthy wait here takes milliseconds
STILL_WAITING_S = 0.3  # long enough for a waiting thread that wrongly did not wait to have finished


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_loadable_tiny_model(tmp_path_factory.mktemp("cancel") / "tiny.gguf", tiny_spec(seed=3))


def small_batch_model(path) -> Model:
    f = edgellm.engine.gguf.open(path)
    return Model.from_parts(build_model(f, n_ctx=N_CTX, n_threads=1, n_batch=N_BATCH),
                            Tokenizer.from_metadata(f.metadata), f.metadata, str(path))


def greedy(m, prompt, n=12):
    return m.complete(prompt, max_tokens=n, ignore_eos=True).tokens


def count_batches(m, cancel_at=None):
    """Wrap the forward model's forward_batch: returns the list of batch sizes run; cancel() once, during batch
    number cancel_at."""
    sizes = []
    inner = m.model.forward_batch
    pending = [cancel_at]

    def counted(tokens, positions, logits_out, **kw):  # groups=: the server's scheduler runs its own caches
        sizes.append(len(tokens))
        if len(sizes) == pending[0]:
            pending[0] = None
            assert m.cancel() is True
        inner(tokens, positions, logits_out, **kw)
    m.model.forward_batch = counted
    return sizes


def test_cancel_between_prompt_batches_keeps_the_whole_batches_cached(tiny_path):
    m = small_batch_model(tiny_path)
    ids = m.tokenize(PROMPT)
    assert len(ids) > CANCEL_AT_BATCH * N_BATCH
    sizes = count_batches(m, cancel_at=CANCEL_AT_BATCH)
    done = m.complete(PROMPT, max_tokens=8, ignore_eos=True)
    assert (done.stop_reason, done.finish_reason, done.tokens, done.text) == ("cancelled", "stop", [], "")
    assert len(sizes) == CANCEL_AT_BATCH            # stopped before the 4th batch
    assert m.model.n_past == CANCEL_AT_BATCH * N_BATCH
    assert m._cached_tokens == ids[:CANCEL_AT_BATCH * N_BATCH]
    # the next call reuses those batches and gives what a fresh model gives
    sizes.clear()
    got = greedy(m, PROMPT)
    assert sum(sizes[:-11]) == len(ids) - CANCEL_AT_BATCH * N_BATCH  # prompt remainder, then 11 decode steps
    assert got == greedy(small_batch_model(tiny_path), PROMPT)


def test_cancelled_logits_raise_and_the_next_logits_are_a_fresh_models(tiny_path):
    m = small_batch_model(tiny_path)
    ids = m.tokenize(PROMPT)
    count_batches(m, cancel_at=2)
    with pytest.raises(Cancelled):
        m.logits(ids)
    del m.model.forward_batch
    # logits() starts from an empty cache with the same kernels and batches: bit-identical, not just close
    assert np.array_equal(m.logits(ids), small_batch_model(tiny_path).logits(ids))


def test_cancel_mid_generation_through_create_completion(tiny_path):
    m = edgellm.load(str(tiny_path), n_ctx=N_CTX, n_threads=1)
    seen = []

    def processor(ids, scores):     # runs before each draw: cancel while the 3rd token is being chosen
        seen.append(len(ids))
        if len(seen) == 3:
            m.cancel()
        return scores

    out = m.create_completion("hello", max_tokens=40, temperature=0, logits_processor=processor, ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 3
    assert m.last_completion.stop_reason == "cancelled"
    assert greedy(m, "hello") == greedy(edgellm.load(str(tiny_path), n_ctx=N_CTX, n_threads=1), "hello")


def test_a_cancel_with_nothing_running_does_not_cancel_the_next_call(tiny_path):
    m = edgellm.load(str(tiny_path), n_ctx=N_CTX, n_threads=1)
    assert m.cancel() is False
    assert m.complete("hello", max_tokens=6, ignore_eos=True).stop_reason == "length"
    # nor does one aimed at a stream that is then closed without another step
    stream = m.stream("hello", max_tokens=6, ignore_eos=True)
    next(stream)
    assert m.cancel() is True
    stream.close()
    assert len(greedy(m, "hello", 6)) == 6


def test_other_threads_wait_for_an_open_stream_but_its_own_thread_is_refused(tiny_path):
    m = edgellm.load(str(tiny_path), n_ctx=N_CTX, n_threads=1)
    want = greedy(edgellm.load(str(tiny_path), n_ctx=N_CTX, n_threads=1), "world")
    stream = m.stream("hello", max_tokens=6, ignore_eos=True)
    next(stream)
    box = {}
    waiter = threading.Thread(target=lambda: box.setdefault("tokens", greedy(m, "world")), daemon=True)
    waiter.start()
    time.sleep(STILL_WAITING_S)
    assert waiter.is_alive() and "tokens" not in box   # waiting, not refused
    with pytest.raises(ModelBusyError):                # this thread would wait for itself
        m.generate("world")
    stream.close()
    waiter.join(JOIN_TIMEOUT_S)
    assert box.get("tokens") == want


def test_a_stream_garbage_collected_on_another_thread_releases_the_model(tiny_path):
    m = edgellm.load(str(tiny_path), n_ctx=N_CTX, n_threads=1)

    def start_and_abandon():
        stream = m.stream("hello", max_tokens=6, ignore_eos=True)
        next(stream)
        holder = {"stream": stream}
        holder["self"] = holder        # a reference cycle: only the cycle collector frees it
    worker = threading.Thread(target=start_and_abandon)
    worker.start()
    worker.join(JOIN_TIMEOUT_S)
    gc.collect()                       # the stream's finalizer runs here, on this thread
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("n", len(greedy(m, "world", 4))), daemon=True)
    t.start()
    t.join(JOIN_TIMEOUT_S)
    assert result.get("n") == 4


SLOW_BATCH_S = 0.05    # per prompt batch in the server test: the whole prompt then takes over a second


def test_a_client_leaving_mid_prompt_cancels_the_prompt_on_the_server(tiny_path):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    import json
    import socket

    from edgellm.server import BackgroundServer, create_app

    m = small_batch_model(tiny_path)
    prompt = " ".join([PROMPT] * 4)
    n_batches = -(-len(m.tokenize(prompt)) // N_BATCH)
    sizes = count_batches(m)
    slow = m.model.forward_batch
    m.model.forward_batch = lambda *args, **kw: (time.sleep(SLOW_BATCH_S), slow(*args, **kw))
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "ignore_eos": True}).encode()
    with BackgroundServer(create_app(m, model_name="tiny")) as srv:
        with socket.create_connection((srv.host, srv.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while len(sizes) < 2 and time.monotonic() < deadline:   # the prompt is under way
                time.sleep(0.01)
        while m._busy and time.monotonic() < deadline:              # the client has left: wait for the call to end
            time.sleep(0.01)
        assert 2 <= len(sizes) < n_batches                          # cancelled mid-prompt, not run to the end
        del m.model.forward_batch
        want = greedy(small_batch_model(tiny_path), "hello", 4)
        req = urllib.request.Request(srv.base_url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0,
                                                      "ignore_eos": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=JOIN_TIMEOUT_S) as r:
            assert json.loads(r.read())["choices"][0]["text"] == m.detokenize(want)

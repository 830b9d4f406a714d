"""Ray (the edgellm[ray] extra), on one local Ray instance for the module (ray.init(num_cpus=2)): a 200-line JSONL
job through Ray Data gives the greedy outputs generate_batch gives in-process, and resumes from what OUT holds; an
actor killed mid-job (SIGKILL) loses no line; the Serve deployment answers the official openai client (chat and
stream) as the in-process model does."""
import json
import os
import signal
import socket
import threading
import time

import pytest
from hardening_tiny import tiny_spec, write_loadable_tiny_model

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

import edgellm  # noqa: E402
from edgellm.generation import jobs  # noqa: E402
from edgellm.integrations.ray import ray_executor, serve_deployment, threads_per_actor  # noqa: E402

N_LINES = 200
MAX_TOKENS = 6
LOAD = dict(n_ctx=128)
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(write_loadable_tiny_model(tmp_path_factory.mktemp("ray") / "tiny.gguf", tiny_spec(seed=3)))


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return edgellm.load(tiny_path, n_threads=1, **LOAD)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    yield
    from ray import serve
    serve.shutdown()
    ray.shutdown()


def prompts(n):
    return [f"hello {'world ' * (i % 4)}{'go ' * (i % 3)}or" for i in range(n)]


def write_lines(path, texts, **options):
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"prompt": text, **options}) + "\n")


def read_records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_threads_rule_never_puts_more_threads_on_a_node_than_cores():
    for cores in (1, 2, 8, 64):
        for nodes in (1, 3):
            for actors in range(1, 20):
                per_node = -(-actors // nodes)
                threads = threads_per_actor(cores, actors, nodes)
                assert threads >= 1
                assert per_node * threads <= cores or threads == 1


def test_ray_data_job_gives_the_in_process_greedy_outputs_and_resumes(ray_session, tiny, tiny_path, tmp_path):
    texts = prompts(N_LINES)
    want = tiny.generate_batch(texts, max_tokens=MAX_TOKENS, n_parallel=8)
    write_lines(tmp_path / "in.jsonl", texts)
    out = tmp_path / "out.jsonl"
    with open(out, "w") as f:  # a run that stopped after 30 lines: those are not run again
        for i in range(30):
            f.write(json.dumps({"index": i, "text": want[i], "finish_reason": "length", "usage": {}}) + "\n")
    execute = ray_executor(tiny_path, {"max_tokens": MAX_TOKENS}, actors=2, n_parallel=4, **LOAD)
    summary = jobs.run_file(tmp_path / "in.jsonl", out, execute, progress=False)
    assert (summary.lines, summary.skipped, summary.errors) == (N_LINES - 30, 30, 0)
    records = read_records(out)
    assert sorted(r["index"] for r in records) == list(range(N_LINES))
    assert [r["text"] for r in sorted(records, key=lambda r: r["index"])] == want
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in records[30:])


def _map_workers():
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"MapBatches(EdgeLLMPredictor)" in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_an_actor_killed_mid_job_loses_no_line(ray_session, tiny, tiny_path, tmp_path):
    texts = prompts(N_LINES)
    write_lines(tmp_path / "in.jsonl", texts, max_tokens=32, ignore_eos=True)
    out = tmp_path / "out.jsonl"
    execute = ray_executor(tiny_path, {}, actors=1, n_parallel=2, batch_size=8, **LOAD)
    result = {}
    job = threading.Thread(target=lambda: result.update(s=jobs.run_file(tmp_path / "in.jsonl", out, execute,
                                                                        progress=False)))
    job.start()
    deadline = time.monotonic() + 600
    while not (out.exists() and out.read_text().count("\n") >= 16):
        assert job.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    workers = _map_workers()
    assert workers, "no Ray Data actor process found"
    os.kill(workers[0], signal.SIGKILL)
    killed_at = out.read_text().count("\n")
    job.join(timeout=600)
    assert not job.is_alive()
    assert killed_at < N_LINES, "the kill did not land mid-job"
    records = read_records(out)
    assert sorted(r["index"] for r in records) == list(range(N_LINES))  # every line, once
    want = tiny.generate_batch(texts, max_tokens=32, ignore_eos=True, n_parallel=8)
    assert [r["text"] for r in sorted(records, key=lambda r: r["index"])] == want


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_deployment_answers_the_openai_client(ray_session, tiny, tiny_path):
    from ray import serve
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(serve_deployment(tiny_path, model_name="tiny", max_replicas=2, **LOAD), name="edgellm",
              route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    tiny.reset()
    want = tiny.create_chat_completion(MESSAGES, max_tokens=8, temperature=0.0)

    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0)
    assert reply.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert reply.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    assert reply.usage.completion_tokens == want["usage"]["completion_tokens"]
    assert reply.model == "tiny"

    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want["choices"][0]["message"]["content"]
    assert len([c for c in chunks if c.choices]) > 2  # it really streamed, piece by piece
    assert chunks[-1].usage.completion_tokens == want["usage"]["completion_tokens"]
    assert [m.id for m in client.models.list().data] == ["tiny"]

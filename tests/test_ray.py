"""Ray (the edgellm[ray] extra), on one local Ray instance for the module (ray.init(num_cpus=2)): a 200-line JSONL
job through Ray Data gives the greedy outputs generate_batch gives in-process, and resumes from what OUT holds; an
actor killed mid-job (SIGKILL) loses no line; the Serve deployment answers the official openai client (chat and
stream) as the in-process model does; `edgellm serve --ray` serves it with serve's flags and refuses bad option
combinations before Ray starts; autoscaling goes to two replicas under concurrent load and back to one after it,
every answer correct throughout."""
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
from edgellm import cli  # noqa: E402
from edgellm.generation import jobs  # noqa: E402
from edgellm.integrations import ray as edgellm_ray  # noqa: E402
from edgellm.integrations.ray import APP_NAME, ray_executor, serve_deployment, threads_per_actor  # noqa: E402

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


@pytest.fixture(scope="module")
def serve_port(ray_session):
    """Serve's HTTP proxy, started once for the module (its address cannot change while Serve runs)."""
    from ray import serve
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


@pytest.fixture
def deployed(serve_port):
    """Deploys an application at "/" on the module's Serve; deleted after the test, so its replicas free the CPUs."""
    from ray import serve

    def deploy(app):
        serve.run(app, name=APP_NAME, route_prefix="/")
    yield deploy
    if APP_NAME in serve.status().applications:
        serve.delete(APP_NAME)


def openai_client(port, key="none"):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)


def test_serve_deployment_answers_the_openai_client(tiny, tiny_path, serve_port, deployed):
    deployed(serve_deployment(tiny_path, model_name="tiny", max_replicas=2, **LOAD))
    client = openai_client(serve_port)
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


BAD_SERVE_FLAGS = [
    (["--replicas", "2"], "add --ray"),
    (["--max-replicas", "2", "--target-ongoing-requests", "1"], "add --ray"),
    (["--ray", "--replicas", "2", "--max-replicas", "3"], "give one or the other"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas (3) is more than --max-replicas (2)"),
    (["--ray", "--min-replicas", "2"], "give --max-replicas too"),
    (["--ray", "--max-replicas", "2", "--min-replicas", "2", "--target-ongoing-requests", "1"], "room to scale"),
    (["--ray", "--cache-dir", "/tmp/x"], "--cache-dir"),
    (["--ray", "--device", "cuda"], "not --device cuda"),
    (["--ray", "--max-tokens", "0"], "max_tokens cap must be a positive integer"),
    (["--ray", "--lookup", "--draft-model", "m"], "either prompt lookup or a draft model"),
    (["--ray", "--api-key", "a", "--api-key-file", "/nonexistent"], "one way only"),
]


@pytest.mark.parametrize("flags, message", BAD_SERVE_FLAGS)
def test_serve_ray_refuses_bad_flags_before_ray_starts(flags, message, monkeypatch, capsys):
    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")
    monkeypatch.setattr(edgellm_ray, "connect", no_ray)
    monkeypatch.setattr(edgellm_ray, "run_serve", no_ray)
    assert cli.main(["serve", "some-model", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("edgellm: error: ") and message in err, err


@pytest.mark.parametrize("flag, value", [("--replicas", "0"), ("--min-replicas", "-1"), ("--max-replicas", "x"),
                                         ("--target-ongoing-requests", "0"), ("--target-ongoing-requests", "nan")])
def test_serve_ray_refuses_bad_numbers_as_serve_does(flag, value, capsys):
    with pytest.raises(SystemExit) as info:  # argparse's usage error, as for serve's other numeric flags
        cli.main(["serve", "some-model", "--ray", flag, value])
    assert info.value.code == 2 and flag in capsys.readouterr().err


def _app_running(serve) -> bool:
    app = serve.status().applications.get(APP_NAME)
    return app is not None and app.status == "RUNNING"


def _replicas(serve) -> dict:
    app = serve.status().applications.get(APP_NAME)
    states = app.deployments[APP_NAME].replica_states if app and APP_NAME in app.deployments else {}
    return {str(getattr(k, "value", k)): v for k, v in states.items() if v}


def test_serve_ray_command_serves_with_serves_flags(tiny, tiny_path, serve_port, monkeypatch, capsys):
    """`edgellm serve MODEL --ray` in this process (the module's Ray session), stopped where Ctrl-C would stop it."""
    from ray import serve
    stop = threading.Event()
    monkeypatch.setattr(edgellm_ray, "wait_for_interrupt", stop.wait)
    result = {}
    command = threading.Thread(target=lambda: result.update(rc=cli.main(
        ["serve", tiny_path, "--ray", "--port", str(serve_port), "--replicas", "1", "-c", "128",
         "--max-tokens", "8", "--api-key", "k1"])))
    command.start()
    try:
        deadline = time.monotonic() + 180
        while not _app_running(serve):
            assert command.is_alive() and time.monotonic() < deadline, result
            time.sleep(0.2)
        client = openai_client(serve_port, key="k1")
        tiny.reset()
        want = tiny.create_chat_completion(MESSAGES, max_tokens=8, temperature=0.0)
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0)
        assert reply.choices[0].message.content == want["choices"][0]["message"]["content"]
        models = client.models.list().data
        assert [m.id for m in models] == ["tiny"]  # the file's name, as `serve` names it
        assert models[0].meta["n_ctx"] == 128
        with pytest.raises(openai.BadRequestError) as info:  # --max-tokens 8 caps a request
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=9)
        assert info.value.body["param"] == "max_tokens"
        with pytest.raises(openai.AuthenticationError):  # --api-key: a wrong key gets no answer
            openai_client(serve_port, key="wrong").models.list()
    finally:
        stop.set()
        command.join(timeout=120)
    assert result == {"rc": 0}
    err = capsys.readouterr().err
    assert f"serving tiny on http://127.0.0.1:{serve_port}" in err and "1 replica on Ray Serve, 2 threads each" in err
    assert "k1" not in err
    assert APP_NAME not in serve.status().applications  # stopped: the application is deleted


AUTOSCALING = {"upscale_delay_s": 0.5, "downscale_delay_s": 2.0, "metrics_interval_s": 0.25,
               "look_back_period_s": 1.0}  # seconds, not Serve's minutes: the test sees both moves in under a minute
LOAD_TOKENS = 48  # long enough per request that concurrent clients keep several requests ongoing


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(tiny, tiny_path, serve_port, deployed):
    from ray import serve
    deployed(serve_deployment(tiny_path, model_name="tiny", min_replicas=1, max_replicas=2,
                              target_ongoing_requests=1, autoscaling=AUTOSCALING, **LOAD))
    assert _replicas(serve) == {"RUNNING": 1}
    tiny.reset()
    want = tiny.create_chat_completion(MESSAGES, max_tokens=LOAD_TOKENS, temperature=0.0, ignore_eos=True)
    want = want["choices"][0]["message"]["content"]
    answers, failures = [], []

    def client_loop(until):
        client = openai_client(serve_port)
        while not until.is_set():
            try:
                reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=LOAD_TOKENS,
                                                       temperature=0.0, extra_body={"ignore_eos": True})
                answers.append(reply.choices[0].message.content)
            except Exception as e:  # every request must be answered: collected, asserted below
                failures.append(repr(e))

    scaled = threading.Event()
    load = [threading.Thread(target=client_loop, args=(scaled,)) for _ in range(6)]
    for t in load:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while _replicas(serve).get("RUNNING", 0) < 2:
            assert time.monotonic() < deadline and not failures, (_replicas(serve), failures[:3])
            time.sleep(0.2)
        # two replicas of one thread each hold both CPUs of ray.init(num_cpus=2): the threads rule
        assert ray.available_resources().get("CPU", 0) == 0
        time.sleep(1.0)  # a moment of load on both
    finally:
        scaled.set()
        for t in load:
            t.join(timeout=120)
    under_load = len(answers)

    drained = threading.Event()  # one client goes on while Serve scales down: its requests are answered too
    trickle = threading.Thread(target=client_loop, args=(drained,))
    trickle.start()
    try:
        deadline = time.monotonic() + 90
        while _replicas(serve) != {"RUNNING": 1}:
            assert time.monotonic() < deadline and not failures, (_replicas(serve), failures[:3])
            time.sleep(0.2)
    finally:
        drained.set()
        trickle.join(timeout=120)
    assert not failures, failures[:3]
    assert under_load >= 6 and len(answers) > under_load
    assert all(a == want for a in answers)

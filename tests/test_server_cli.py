"""`edgellm serve` as a process: it binds 127.0.0.1, answers /health without a key and the API with one, and stops
cleanly on SIGINT."""
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

STARTUP_TIMEOUT_S = 180  # model load on a slow shared CI machine


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, key=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def start(args, env=None):
    port = free_loopback_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return proc, port, f"http://127.0.0.1:{port}"


def wait_ready(proc, base):
    """/health's answers until the model is loaded: 503 {"status": "loading"} while it loads, then 200."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            status, body = get(base + "/health")
            if (status, body.get("status")) != (503, "loading"):
                return status, body
        except (urllib.error.URLError, ConnectionError):
            pass
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.5)


def stop(proc):
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out, err


def test_serve_command(smollm2_path):
    proc, port, base = start([str(smollm2_path), "--api-key", "k1", "-c", "256"])
    try:
        status, body = wait_ready(proc, base)
        assert (status, body) == (200, {"status": "ok"})
        assert get(base + "/v1/models")[0] == 401
        status, body = get(base + "/v1/models", key="k1")
        assert status == 200 and body["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
        assert body["data"][0]["meta"]["n_ctx"] == 256
    finally:
        out, err = stop(proc)
    assert f"serving SmolLM2-135M-Instruct.Q4_1 on http://127.0.0.1:{port}" in err


def test_serve_flags_are_wired_through(smollm2_path, tmp_path):
    key = "file-key-7f3a9"
    (tmp_path / "key").write_text(key + "\n")
    proc, port, base = start([str(smollm2_path), "--api-key-file", str(tmp_path / "key"), "-c", "256",
                              "-ctk", "q8_0", "--keep", "8", "--max-tokens", "4", "--device", "cpu", "--lookup",
                              "--draft-max", "3"])
    try:
        assert wait_ready(proc, base) == (200, {"status": "ok"})
        assert get(base + "/v1/models")[0] == 401
        status, body = get(base + "/v1/models", key=key)
        meta = body["data"][0]["meta"]
        assert (meta["n_ctx"], meta["kv_type"], meta["n_keep"], meta["device"]) == (256, "q8_0", 8, "cpu")
        assert (meta["speculative"], meta["draft_max"]) == ("lookup", 3)
        req = urllib.request.Request(base + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "Hi", "max_tokens": 5}).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:  # --max-tokens 4 caps it
            urllib.request.urlopen(req, timeout=60)
        assert info.value.code == 400 and json.loads(info.value.read())["error"]["param"] == "max_tokens"
    finally:
        out, err = stop(proc)
    assert key not in out + err


def test_serve_refuses_a_key_given_two_ways(tmp_path):
    import os

    (tmp_path / "key").write_text("file-key\n")
    env = {**os.environ, "EDGELLM_API_KEY": "env-key"}
    proc, _, _ = start(["--api-key-file", str(tmp_path / "key")], env=env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "one way only" in err
    assert "env-key" not in out + err and "file-key" not in out + err

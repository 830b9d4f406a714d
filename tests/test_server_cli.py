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


def test_serve_command(smollm2_path):
    port = free_loopback_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "serve", str(smollm2_path), "--port", str(port),
                             "--api-key", "k1", "-c", "256"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                status, body = get(base + "/health")
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.5)
        assert (status, body) == (200, {"status": "ok"})
        assert get(base + "/v1/models")[0] == 401
        status, body = get(base + "/v1/models", key="k1")
        assert status == 200 and body["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
        assert body["data"][0]["meta"]["n_ctx"] == 256
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"serving SmolLM2-135M-Instruct.Q4_1 on http://127.0.0.1:{port}" in err

"""tools/loadtest.py against a real server (SmolLM2 on a BackgroundServer), in a small run: normal streams, clients
that leave, a stalled reader, an over-long prompt and huge logprobs, with the server's RSS; and it counts errors
when the server refuses everything."""
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import edgellm  # noqa: E402
import loadtest  # noqa: E402
from edgellm.server import BackgroundServer, create_app  # noqa: E402

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return edgellm.load(smollm2_path, n_ctx=256)


def run_tool(capsys, url, *args):
    code = loadtest.main(["--url", url, "--json", "--max-tokens", str(MAX_TOKENS), *args])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_small_abuse_run(llm, capsys):
    with BackgroundServer(create_app(llm)) as srv:
        code, s = run_tool(capsys, srv.base_url, "--clients", "3", "--requests", "8", "--kind", "mixed",
                           "--disconnect", "0.25", "--stalled", "1", "--stall-s", "0.5", "--long-prompts", "1",
                           "--huge-logprobs", "1", "--pid", str(os.getpid()), "--settle-s", "0", "--check-after")
    assert code == 0 and s["errors"] == 0 and s["requests"] == s["ok"] == 8
    assert s["after"]["answered"] and s["after"]["slots_busy"] == 0 and s["after"]["queue_depth"] == 0
    assert s["by_kind"] == {"disconnect": 2, "huge_logprobs": 1, "long_prompt": 1, "normal": 3, "stalled": 1}
    assert 0 < s["generated_tokens"] <= 3 * MAX_TOKENS and s["tokens_per_s"] > 0
    assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] <= s["latency_p99_s"]
    assert s["rss_before_mb"] > 0 and s["rss_after_mb"] > 0


def test_errors_are_counted(llm, capsys):
    with BackgroundServer(create_app(llm, max_queue=0)) as srv:  # refuses every generation with 503
        code, s = run_tool(capsys, srv.base_url, "--clients", "2", "--requests", "3")
    assert code == 1 and s["errors"] == 3 and s["error_kinds"] == {"HTTP 503": 3} and s["generated_tokens"] == 0


def test_percentile():
    assert loadtest.percentile([], 0.5) is None
    assert loadtest.percentile([3, 1, 2, 4], 0.5) == 2 and loadtest.percentile([3, 1, 2, 4], 0.99) == 4
    assert loadtest.percentile(list(range(1, 101)), 0.99) == 99

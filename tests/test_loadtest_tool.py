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
    assert 0 < s["client_cpu_cores"] < os.cpu_count() + 1  # the client's own process time over the load's wall


def test_errors_are_counted(llm, capsys):
    with BackgroundServer(create_app(llm, max_queue=0)) as srv:  # refuses every generation with 503
        code, s = run_tool(capsys, srv.base_url, "--clients", "2", "--requests", "3")
    assert code == 1 and s["errors"] == 3 and s["error_kinds"] == {"HTTP 503": 3} and s["generated_tokens"] == 0


def test_the_same_question_or_each_its_own(llm, capsys):
    """By default every request asks the same question, which the server then answers from the rows and last logits
    row it kept (nothing prefilled); --distinct ends each prompt its own way, so each prefills its own ending."""
    for distinct in (False, True):
        app = create_app(llm, parallel=1)
        with BackgroundServer(app) as srv:
            code, s = run_tool(capsys, srv.base_url, "--clients", "1", "--requests", "4",
                               *(["--distinct"] if distinct else []))
            stats = dict(app.state.endpoints.scheduler.stats)
        assert code == 0 and s["ok"] == 4
        if distinct:
            assert stats["prefilled_tokens"] > 4 * 5  # each request's own ending, at least
        else:
            assert stats["prefilled_tokens"] == stats["prompt_tokens"] // 4  # the first request's prompt only


def test_percentile():
    assert loadtest.percentile([], 0.5) is None
    assert loadtest.percentile([3, 1, 2, 4], 0.5) == 2 and loadtest.percentile([3, 1, 2, 4], 0.99) == 4
    assert loadtest.percentile(list(range(1, 101)), 0.99) == 99


def test_bench_server_speedups_pair_each_round_with_its_own_base(capsys):
    """With several rounds, a speed-up is the median of each round's ratio to that same round's one-client rate (not
    a ratio of medians, which a host whose speed drifts between rounds would skew), with its range beside it."""
    import bench_server

    def r(tps, ttft=0.1, errors=0, cpu=0.1):
        return {"tokens_per_s": tps, "ttft_p50_s": ttft, "ttft_p99_s": 2 * ttft, "errors": errors,
                "client_cpu_cores": cpu}
    def steps(batch, ms):  # an edgellm row's step figures (another server's rows have none)
        return {"mean_batch": batch, "step_ms": ms}
    rows = [("e", 1, 0, r(100.0)), ("e", 8, 0, {**r(300.0, cpu=0.3), **steps(7.5, 15.0)}), ("e", 1, 1, r(50.0)),
            ("e", 8, 1, {**r(160.0, errors=1, cpu=0.2), **steps(7.7, 17.0)}), ("e", 1, 2, r(200.0)),
            ("e", 8, 2, {**r(620.0, 0.3, cpu=0.4), **steps(7.6, 16.0)})]
    bench_server.print_table(rows, 1, 3)
    lines = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in capsys.readouterr().out.splitlines()
             if line.startswith("| e |")}
    eight = [c.strip() for c in lines[("e", "8")].split("|")[1:-1]]
    assert eight == ["e", "8", "300.0", "3.10x", "3.00-3.20x", "0.1", "0.2", "0.3", "7.6", "16.0", "1"]  # ratios 3.0,
    # 3.2, 3.1 and each column's median
    assert [c.strip() for c in lines[("e", "1")].split("|")[-4:-2]] == ["-", "-"]
    assert [c.strip() for c in lines[("e", "1")].split("|")[3:6]] == ["100.0", "1.00x", "1.00-1.00x"]


def test_bench_server_reads_the_step_counters_of_a_running_server(llm):
    import bench_server
    with BackgroundServer(create_app(llm)) as srv:
        before = bench_server.step_counters(srv.base_url)
        assert before == (0.0, 0.0, 0.0)
        loadtest.main(["--url", srv.base_url, "--json", "--max-tokens", str(MAX_TOKENS), "--clients", "1",
                       "--requests", "1", "--kind", "completion"])
        after = bench_server.step_counters(srv.base_url)
    assert after[0] == after[1] == MAX_TOKENS - 1 and after[2] > 0  # one sequence: every token fed but the last
    assert bench_server.step_figures(before, after)["mean_batch"] == 1.0
    assert bench_server.step_figures((10.0, 40.0, 0.5), (20.0, 115.0, 0.65)) == {"mean_batch": 7.5, "step_ms": 15.0}
    assert bench_server.step_figures(None, after) == {} and bench_server.step_counters("http://127.0.0.1:9") is None

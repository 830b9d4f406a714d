"""`edgellm bench`: the sweep produces one result per test and thread count, shares of the bandwidth bound that
make sense, and markdown / JSON output (on a tiny model, so it is quick)."""
import json

import numpy as np
import pytest

from edgellm.prep import bench
from edgellm import cli
from hardening_tiny import write_loadable_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(write_loadable_tiny_model(tmp_path_factory.mktemp("bench") / "tiny.gguf"))


def test_sweep_results_and_markdown(tiny_model):
    report = bench.bench(tiny_model, n_prompt=(8, 16), n_gen=(4,), depths=(0, 8), threads=(1,), repeats=2)
    tests = [r.test for r in report["results"]]
    assert tests == ["pp8", "pp16", "tg4", "tg4@d8"]
    for r in report["results"]:
        assert len(r.samples_tps) == 2 and all(t > 0 for t in r.samples_tps)
        assert r.bytes_per_token > 0 and r.bandwidth > 1e8   # any machine reads faster than 100 MB/s
    tg_d0, tg_d8 = report["results"][2:]
    assert tg_d8.bytes_per_token > tg_d0.bytes_per_token   # the deeper run also reads its KV cache
    md = bench.to_markdown(report)
    assert md.count("\n| ") >= 5 and "memory bandwidth (same run)" in md and "peak RSS" in md
    from edgellm.quant.threading_layer import chosen_layer
    assert report["threading_layer"] == chosen_layer() and f"threading layer {chosen_layer()}" in md


def test_cli_json_output(tiny_model, capsys):
    assert cli.main(["bench", tiny_model, "-p", "8", "-n", "2", "-t", "1", "-r", "1", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in out["results"]] == ["pp8", "tg2"]
    assert out["peak_rss"] > 0 and out["bandwidth"]["1"] > 0


def test_bad_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "x", "-p", "8,a"])
    assert "comma-separated list of integers" in capsys.readouterr().err


@pytest.mark.parametrize("n", [0, 5, 1000, 4096 * 33 + 7])  # empty, all tail, chunks plus a tail
def test_bandwidth_sum_matches_numpy(n):
    """The bandwidth probe's vector sum reads every element exactly once (numpy reference; integers in float32 are
    summed exactly at these sizes, whatever the order)."""
    from edgellm.prep.bandwidth_kernel import parallel_sum
    a = np.random.default_rng(n).integers(-50, 50, n).astype(np.float32)
    assert parallel_sum(a) == float(a.astype(np.int64).sum())
    with pytest.raises(ValueError, match="contiguous 1-D float32"):
        parallel_sum(a.astype(np.float64))


def test_every_timed_decode_kind_is_warmed_up_first(tiny_model, monkeypatch):
    """llama-bench's warmup: a deep decode and each batch size run once, untimed, before their timed repetitions,
    so that a cold Numba cache compiles there and not inside the first repetition."""
    calls = []
    real_tg, real_batch = bench.run_tg, bench.run_tg_batch
    monkeypatch.setattr(bench, "run_tg", lambda model, n, d, reps, rng: calls.append(("tg", d, reps)) or
                        real_tg(model, n, d, reps, rng))
    monkeypatch.setattr(bench, "run_tg_batch", lambda model, b, n, reps, rng: calls.append(("batch", b, reps)) or
                        real_batch(model, b, n, reps, rng))
    bench.bench(tiny_model, n_prompt=(), n_gen=(4,), depths=(0, 8), threads=(1,), repeats=2, batches=(1, 2))
    assert calls == [("tg", 0, 1), ("tg", 0, 2), ("tg", 8, 1), ("tg", 8, 2), ("batch", 1, 1), ("batch", 1, 2),
                     ("batch", 2, 1), ("batch", 2, 2)]


def test_plot_draws_roofline_profile_and_batch_panels(tiny_model, tmp_path):
    """--plot (the optional matplotlib extra): a PNG with the bandwidth, profile and batch panels."""
    pytest.importorskip("matplotlib")
    report = bench.bench(tiny_model, n_prompt=(), n_gen=(2,), threads=(1,), repeats=1, profile=True, batches=(1, 2))
    assert report["profile"]
    path = tmp_path / "bench.png"
    bench.plot(report, str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width = int.from_bytes(data[16:20], "big")  # the IHDR chunk: three 6-inch panels at 110 dpi
    assert width == 3 * 6 * 110

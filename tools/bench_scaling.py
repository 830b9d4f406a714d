"""Throughput and memory of `edgellm batch` in-process against Ray Data with 1 and 2 actors (docs/scaling.md).

    python tools/bench_scaling.py smollm2-135m --prompts 256 --max-tokens 32

Each configuration runs `edgellm batch` in a fresh process on the same JSONL; a sampler reads /proc every 0.2 s for
the processes that hold the model (the batch process itself, or Ray Data's actors) and keeps each one's peak RSS,
PSS (shared pages split between the processes that map them, so memory-mapped weights count once across actors) and
anonymous RSS (RSS without file-backed pages: what the process owns beyond the shared weights).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

TOPICS = ["the sea", "a city at night", "mountains", "a library", "the first computer", "rain", "a garden", "trains"]


def prompts(n: int) -> list:
    return [{"prompt": f"Write one sentence about {TOPICS[i % len(TOPICS)]} ({i}):"} for i in range(n)]


def memory(pid: int) -> dict | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            rollup = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", f.read(), re.M)}
        with open(f"/proc/{pid}/status") as f:
            status = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", f.read(), re.M)}
    except OSError:
        return None
    return {"rss": rollup.get("Rss", 0), "pss": rollup.get("Pss", 0),
            "anon": status.get("RssAnon", 0) + status.get("RssShmem", 0)}


def model_processes(root: int, ray_mode: bool) -> list:
    if not ray_mode:
        return [root]
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"MapBatches(EdgeLLMPredictor)" in f.read():
                    pids.append(int(pid))
        except (OSError, ValueError):
            continue
    return pids


def run(config: str, args, in_path: str, out_path: str) -> dict:
    cmd = [sys.executable, "-m", "edgellm.cli", "batch", in_path, out_path, "--model", args.model, "-n",
           str(args.max_tokens), "--parallel", str(args.parallel), "-c", str(args.ctx), "--no-progress"]
    in_process = config.startswith("in-process")
    if not in_process:
        cmd += ["--ray", "--actors", config.split()[-2]]
    else:  # "in-process" (all the cores' threads) or "in-process N threads"
        cmd += ["-t", config.split()[-2] if config != "in-process" else str(os.cpu_count())]
    peaks, stop = {}, threading.Event()
    load_before = os.getloadavg()[0]  # the host may be shared: its load is part of the figure
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)

    def sample():
        while not stop.wait(0.2):
            for pid in model_processes(proc.pid, not in_process):
                m = memory(pid)
                if m:
                    peak = peaks.setdefault(pid, {k: 0 for k in m})
                    for k, v in m.items():
                        peak[k] = max(peak[k], v)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    line = [x for x in err.splitlines() if "tok/s" in x]
    if proc.returncode or not line:
        raise SystemExit(f"{config} failed:\n{err[-3000:]}")
    m = re.search(r"(\d+) tokens in ([\d.]+) s, ([\d.]+) tok/s \(first record after ([\d.]+) s", line[-1])
    return {"config": config, "tokens": int(m.group(1)), "job_s": float(m.group(2)), "tok_s": float(m.group(3)),
            "first_s": float(m.group(4)), "wall_s": wall,
            "load_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
            "memory_mib": {str(p): {k: v / 1024 for k, v in peak.items()} for p, peak in peaks.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--configs", default="in-process,ray 1 actors,ray 2 actors",
                    help="comma list of: in-process, in-process N threads, ray N actors")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        in_path = os.path.join(tmp, "in.jsonl")
        with open(in_path, "w") as f:
            for line in prompts(args.prompts):
                f.write(json.dumps(line) + "\n")
        for i, config in enumerate(args.configs.split(",")):
            r = run(config, args, in_path, os.path.join(tmp, f"out{i}.jsonl"))
            results.append(r)
            print(json.dumps(r), flush=True)
    print("\n| configuration | job s (first record) | process wall s | tokens | tok/s | per model process: peak RSS / PSS / anon MiB |")
    print("|---|---|---|---|---|---|")
    for r in results:
        mem = "; ".join(f"{m['rss']:.0f} / {m['pss']:.0f} / {m['anon']:.0f}" for m in r["memory_mib"].values())
        print(f"| {r['config']} | {r['job_s']:.1f} ({r['first_s']:.1f}) | {r['wall_s']:.1f} | {r['tokens']} | {r['tok_s']:.1f} | {mem} |")


if __name__ == "__main__":
    main()

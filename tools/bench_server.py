"""Server benchmark: concurrent streaming chats against `edgellm serve` (continuous batching) and, for comparison,
llama-cpp-python's server and llama.cpp's llama-server, each started here as a niced subprocess on 127.0.0.1 and
loaded in turn at each client count; plus the time to first token of a returning ~2,000-token conversation with
the prompt cache and without.

    python tools/bench_server.py --model smollm2-135m --clients 1,8,16 --max-tokens 64 [--llama-cpp-python]
        [--llama-server PATH] [--loadtest tools/loadtest.py] [--nice 10] [--returning 2000]

The load itself is tools/loadtest.py (the official openai async client): aggregate generated tokens/s over the
wall time, p50/p99 time to first token, errors, and the CPU the client itself used (cores, over the wall time: on
a machine it shares with the server, that much is taken from the server); for edgellm also, from its /metrics
around each run, the mean batch (sequences a decode step) and a step's forward time. The speed-up is each row's
tokens/s over the 1-client row's; with --rounds N the client counts run N times in turn, and each speed-up is the
median of its rounds' own ratios. Every request asks the same question unless --distinct gives each its own ending:
a server that keeps prompts then answers the same question from what it kept.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

from loadtest import metric_samples  # (tools/ is this script's directory)

LLAMA_PYTHON = "/work/llama-venv/bin/python"
STARTUP_S = 600  # a first start compiles the kernels


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, argv, port, nice):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        # the log goes to a file: a pipe nobody reads fills up and blocks a verbose server (llama.cpp's load log)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench_server_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(["nice", "-n", str(nice)] + argv, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self):
        deadline = time.monotonic() + STARTUP_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited; its log: {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return False


def edgellm_server(model, port, nice, n_ctx, parallel, cache_ram="1G"):
    exe = os.path.join(os.path.dirname(sys.executable), "edgellm")
    return Server([exe, "serve", model, "--port", str(port), "-c", str(n_ctx), "--parallel", str(parallel),
                   "--cache-ram", cache_ram], port, nice)


def llama_cpp_python_server(path, port, nice, n_ctx, threads, python=LLAMA_PYTHON, chat_format=None):
    # A file without a chat template gets llama-2's format there, to which Gemma-3 answers with its end token at
    # once; edgellm (and llama-server) take llama.cpp's gemma format for it, so this server is given it too.
    fmt = ["--chat_format", chat_format] if chat_format else []
    return Server([python, "-m", "llama_cpp.server", "--model", path, "--port", str(port), "--n_ctx",
                   str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads),
                   # by default a new request interrupts the stream in flight: queue them instead, as edgellm does
                   "--interrupt_requests", "False", *fmt], port, nice)


def llama_server(exe, path, port, nice, n_ctx, threads, parallel):
    """llama.cpp's own server (built from the llama.cpp source that llama-cpp-python's sdist ships): `-np` slots
    with continuous batching, each slot n_ctx positions (llama-server splits -c among its slots)."""
    return Server([exe, "-m", path, "--port", str(port), "-c", str(n_ctx * parallel), "-np", str(parallel),
                   "--threads", str(threads), "--threads-batch", str(threads), "--cont-batching"], port, nice)


STEP_COUNTERS = ("edgellm_decode_steps_total", "edgellm_decode_sequences_total", "edgellm_decode_seconds_total")


def step_counters(url):
    """edgellm's decode step counters from /metrics (steps, sequences, seconds), or None from another server."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            values = metric_samples(r.read().decode(), STEP_COUNTERS)
    except (OSError, ValueError):  # no /metrics, or not Prometheus's text
        return None
    return tuple(values[name] for name in STEP_COUNTERS) if len(values) == len(STEP_COUNTERS) else None


def step_figures(before, after) -> dict:
    """The steps run between two step_counters readings: their mean batch (sequences a step) and a forward's ms."""
    if before is None or after is None or after[0] <= before[0]:
        return {}
    steps = after[0] - before[0]
    return {"mean_batch": round((after[1] - before[1]) / steps, 2),
            "step_ms": round((after[2] - before[2]) * 1e3 / steps, 2)}


def load(loadtest, url, clients, requests, max_tokens, distinct=False):
    argv = [sys.executable, loadtest, "--url", url, "--clients", str(clients), "--requests", str(requests),
            "--max-tokens", str(max_tokens), "--json"] + (["--distinct"] if distinct else [])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"loadtest failed: {out.stdout[-1000:]} {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def returning_ttft(url, history_tokens, model_name="any"):
    """TTFT of a conversation's next turn after another conversation took the (single) slot in between."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1200)
    turns = []
    for i in range(400):
        turns += [{"role": "user", "content": f"Question {i}: tell me one fact about the number {i * 7}."},
                  {"role": "assistant", "content": f"The number {i * 7} is {'even' if i % 2 == 0 else 'odd'}, "
                                                   f"and {i * 7} plus one is {i * 7 + 1}."}]
        if 50 * len(turns) // 2 >= history_tokens:  # ~50 tokens a pair with SmolLM2's chat template
            break
    first = turns[:-1]
    reply = c.chat.completions.create(model=model_name, messages=first, max_tokens=16, temperature=0)
    c.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Something else " * 40}],
                              max_tokens=4, temperature=0)  # another conversation takes the slot
    follow = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And the next one?"}]
    t0 = time.perf_counter()
    stream = c.chat.completions.create(model=model_name, messages=follow, max_tokens=4, temperature=0, stream=True)
    ttft = None
    for ch in stream:
        if ttft is None and ch.choices and ch.choices[0].delta.content:
            ttft = time.perf_counter() - t0
    return ttft, reply.usage.prompt_tokens


def print_table(rows, base_clients: int, rounds: int) -> None:
    """One line per engine and client count: with several rounds, the medians over the rounds (tokens/s, TTFT, the
    speed-up of each round over that round's base count) and the speed-ups' range; errors summed."""
    several = rounds > 1
    print("\n| engine | clients | tokens/s | vs 1 client | " + ("range | " if several else "")
          + "TTFT p50 s | TTFT p99 s | client CPU | batch | forward ms a step | errors |")
    print("| --- | --- | --- | --- | " + ("--- | " if several else "") + "--- | --- | --- | --- | --- | --- |")
    for engine, n in dict.fromkeys((e, m) for e, m, _, _ in rows):
        mine = [(i, r) for e, m, i, r in rows if e == engine and m == n]
        base = {i: r["tokens_per_s"] for e, m, i, r in rows if e == engine and m == base_clients}
        ratios = [r["tokens_per_s"] / base[i] for i, r in mine if base.get(i, 0) > 0]  # none: nothing generated
        speedup = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        spread = (f"{min(ratios):.2f}-{max(ratios):.2f}x | " if ratios else "- | ") if several else ""

        def median(key):
            values = [r[key] for _, r in mine if r.get(key) is not None]
            return round(statistics.median(values), 4) if values else None
        steps = " | ".join("-" if median(k) is None else str(median(k)) for k in ("mean_batch", "step_ms"))
        print(f"| {engine} | {n} | {median('tokens_per_s'):.1f} | {speedup} | {spread}{median('ttft_p50_s')} | "
              f"{median('ttft_p99_s')} | {median('client_cpu_cores')} | {steps} | "
              f"{sum(r['errors'] for _, r in mine)} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", default="1,8,16")
    ap.add_argument("--requests-per-client", type=int, default=4,
                    help="requests each client sends in turn (the 1-client row, every speed-up's base, is this many "
                         "requests: with 2 of 64 tokens it lasted about a second and moved by 40%% between runs)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--distinct", action="store_true", help="each request's prompt ends its own way (loadtest's "
                    "--distinct): only the shared start is re-used, as with many users' own questions")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--nice", type=int, default=10, help="the servers' niceness (the same for both engines)")
    ap.add_argument("--loadtest", default=os.path.join(os.path.dirname(__file__), "loadtest.py"))
    ap.add_argument("--llama-cpp-python", action="store_true", help="also load llama-cpp-python's server")
    ap.add_argument("--llama-python", default=LLAMA_PYTHON, help="the python whose llama_cpp serves")
    ap.add_argument("--llama-server", metavar="PATH", help="also load llama.cpp's llama-server binary at PATH, "
                    "with -np set to the most clients")
    ap.add_argument("--no-edgellm", action="store_true", help="only the other servers (and the returning conversation)")
    ap.add_argument("--returning", type=int, default=2000, help="history tokens of the returning conversation (0: skip)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times the client counts are run in turn; each speed-up is then the median of its rounds' "
                         "ratios to the same round's smallest count (a shared host's speed drifts between minutes)")
    args = ap.parse_args(argv)
    clients = [int(x) for x in args.clients.split(",")]
    rows = []
    parallel = max(clients)
    path = None
    if args.llama_cpp_python or args.llama_server:
        from edgellm.store import catalog
        path = str(catalog.resolve(args.model))
    with contextlib.ExitStack() as stack:
        # every server started first and idle while another is loaded, so the engines alternate at each client count
        servers = []
        if not args.no_edgellm:
            servers.append(("edgellm", stack.enter_context(
                edgellm_server(args.model, free_port(), args.nice, args.n_ctx, parallel))))
        if args.llama_cpp_python:
            servers.append(("llama-cpp-python", stack.enter_context(
                llama_cpp_python_server(path, free_port(), args.nice, args.n_ctx, os.cpu_count(), args.llama_python,
                                        "gemma" if "gemma" in os.path.basename(path).lower() else None))))
        if args.llama_server:
            servers.append((f"llama-server -np {parallel}", stack.enter_context(
                llama_server(args.llama_server, path, free_port(), args.nice, args.n_ctx, os.cpu_count(), parallel))))
        for engine, srv in servers:  # a first batch of each size compiles or loads its kernels: not timed
            load(args.loadtest, srv.url, parallel, parallel, 8)
        for i in range(args.rounds):
            for n in clients:
                for engine, srv in servers:
                    before = step_counters(srv.url)
                    r = load(args.loadtest, srv.url, n, n * args.requests_per_client, args.max_tokens, args.distinct)
                    r.update(step_figures(before, step_counters(srv.url)))
                    rows.append((engine, n, i, r))
                    print(json.dumps({"engine": engine, "clients": n, "round": i, **r}), flush=True)
    print_table(rows, min(clients), args.rounds)
    for engine in dict.fromkeys(e for e, _, _, r in rows if r["generated_tokens"] == 0):
        print(f"{engine}: answered every request with no generated text (its chat format for this model)")
    if args.returning:
        for cache in ("1G", "0"):
            port = free_port()
            with edgellm_server(args.model, port, args.nice, args.n_ctx, 1, cache_ram=cache) as srv:
                returning_ttft(srv.url, 200)  # compile the paths first
                ttft, n_prompt = returning_ttft(srv.url, args.returning)
            print(f"returning conversation ({n_prompt} prompt tokens before), prompt cache {cache}: "
                  f"time to first token {ttft:.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load test for `edgellm serve` on loopback: N concurrent streaming clients, bounded in requests and time.

    python tools/loadtest_server.py [--model smollm2-135m] [--clients 4] [--requests 16] [--max-tokens 32]
                                    [--time-limit 300] [--url http://127.0.0.1:8080 --api-key KEY]

Without --url it starts the server in this process on 127.0.0.1 (an ephemeral port) with --model. Every client
streams chat completions (greedy, the same question) over plain HTTP with server-sent events; a request counts as
answered when its stream ends with a finish_reason and [DONE] and its text equals the first answer. Reports
throughput (generated tokens per second over the wall time, requests per second) and p50/p95 of the full latency
and of the time to the first token. Only loopback addresses are accepted.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "localhost", "::1")
QUESTION = [{"role": "user", "content": "Name three colours."}]


def percentile(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def stream_once(host, port, api_key, max_tokens, timeout):
    """One streamed chat completion: (text, finish_reason, completion tokens, latency s, first-token s)."""
    body = json.dumps({"messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        text, finish, tokens, first, done = [], None, None, None, False
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                content = choice["delta"].get("content")
                if content:
                    if first is None:
                        first = time.perf_counter() - t0
                    text.append(content)
                finish = choice.get("finish_reason") or finish
        if not done or finish is None:
            raise RuntimeError("stream ended without a finish_reason and [DONE]")
        return "".join(text), finish, tokens or 0, time.perf_counter() - t0, first or 0.0
    finally:
        conn.close()


def run_load(host, port, api_key, clients, requests, max_tokens, time_limit):
    deadline = time.monotonic() + time_limit
    issued = [0]
    lock = threading.Lock()
    results, failures = [], []

    def client():
        while True:
            with lock:
                if issued[0] >= requests or time.monotonic() > deadline:
                    return
                issued[0] += 1
            try:
                r = stream_once(host, port, api_key, max_tokens, timeout=max(1.0, deadline - time.monotonic()))
                with lock:
                    results.append(r)
            except Exception as e:  # counted as lost, reported below
                with lock:
                    failures.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=time_limit + 60)
    return results, failures, time.perf_counter() - t0, issued[0]


def report(results, failures, wall, issued, clients):
    texts = {r[0] for r in results}
    tokens = sum(r[2] for r in results)
    latency = [r[3] for r in results]
    first = [r[4] for r in results]
    print(f"clients {clients}, requests issued {issued}, answered {len(results)}, failed {len(failures)}, "
          f"distinct answers {len(texts)}")
    print(f"wall {wall:.1f} s, {tokens} tokens generated: {tokens / wall:.2f} tokens/s, "
          f"{len(results) / wall:.3f} requests/s")
    print(f"latency  p50 {percentile(latency, 0.5):.2f} s  p95 {percentile(latency, 0.95):.2f} s  "
          f"(mean {statistics.fmean(latency) if latency else float('nan'):.2f} s)")
    print(f"first token  p50 {percentile(first, 0.5):.2f} s  p95 {percentile(first, 0.95):.2f} s")
    for f in failures[:5]:
        print("  failure:", f)
    return not failures and len(texts) <= 1 and len(results) == issued


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="catalog name or path (when no --url)")
    ap.add_argument("--url", default=None, help="an already running server on a loopback address")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16, help="total requests (bound)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=300, help="seconds (bound)")
    ap.add_argument("--n-ctx", type=int, default=1024)
    args = ap.parse_args(argv)

    if args.url:
        url = urlparse(args.url)
        if url.hostname not in LOOPBACK:
            ap.error(f"only loopback addresses are allowed, not {url.hostname}")
        ok = report(*run_load(url.hostname, url.port or 80, args.api_key, args.clients, args.requests,
                              args.max_tokens, args.time_limit), args.clients)
        return 0 if ok else 1

    import edgellm
    from edgellm.server import BackgroundServer, create_app
    llm = edgellm.load(args.model, n_ctx=args.n_ctx)
    print(f"model {llm.name}, n_ctx {llm.n_ctx}, threads {llm.n_threads}, max_tokens {args.max_tokens}")
    with BackgroundServer(create_app(llm, api_key=args.api_key)) as srv:
        stream_once(srv.host, srv.port, args.api_key, 4, timeout=args.time_limit)  # warm-up, not counted
        ok = report(*run_load(srv.host, srv.port, args.api_key, args.clients, args.requests, args.max_tokens,
                              args.time_limit), args.clients)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

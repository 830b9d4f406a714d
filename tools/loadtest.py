"""Load test for an OpenAI-compatible server (edgellm serve, llama-server, llama-cpp-python's server) with the
official `openai` async client: N concurrent streaming chats or completions, then aggregate generated tokens/s,
p50/p99 time to first token and latency, and error counts.

    python tools/loadtest.py --url http://127.0.0.1:8080 --clients 8 --requests 32 --max-tokens 64
    python tools/loadtest.py --requests 200 --clients 16 --disconnect 0.2 --stalled 3 --long-prompts 5 \\
        --huge-logprobs 5 --pid $(pgrep -f 'edgellm serve')      # abuse mode, with the server's RSS

Abuse mode mixes in, at random positions: clients that leave after a few chunks (--disconnect, a fraction),
readers that stop reading for --stall-s seconds mid-stream (--stalled), prompts far longer than any context
(--long-prompts, expected to be refused with 400 or 413) and logprobs beyond OpenAI's bounds (--huge-logprobs, expected
400). Only normal requests count in the throughput and latency figures; an expected refusal that is not refused,
an error whose body is not OpenAI's shape ({"error": {"message", "type", ...}}), or any other failure, is an error,
and the exit status is 1 when there is one. `--check-after` then asks for one short chat, which must be answered,
and reads the server's slots and queue from /metrics where it has edgellm's gauges (they must come back to 0).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import openai
from prometheus_client.parser import text_string_to_metric_families

QUESTION = "Write a short story about a lighthouse keeper."  # chats
OPENING = "Once upon a time, in a lighthouse by the sea, there lived"  # completions: a text to continue
KEEPERS = ("Ada", "Bram", "Cora", "Dmitri", "Elin", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kiri", "Lotte")
LONG_PROMPT_WORDS = 60_000  # ~120k tokens, past the context of the models served here, in a 660 kB body


@dataclass
class Outcome:
    kind: str                 # normal, disconnect, stalled, long_prompt, huge_logprobs
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens: int = 0


@dataclass
class Report:
    outcomes: list = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0        # this client's own CPU time over the load (process time, all its threads)
    rss_before: int | None = None
    rss_after: int | None = None
    after: dict | None = None  # --check-after's findings

    def summary(self) -> dict:
        normal = [o for o in self.outcomes if o.kind == "normal" and o.ok]
        errors = {}
        for o in self.outcomes:
            if o.error is not None:
                errors[o.error] = errors.get(o.error, 0) + 1
        tokens = sum(o.tokens for o in normal)
        out = {"requests": len(self.outcomes), "ok": sum(o.ok for o in self.outcomes),
               "errors": sum(errors.values()), "error_kinds": errors,
               "by_kind": {k: sum(o.kind == k for o in self.outcomes) for k in sorted({o.kind for o in self.outcomes})},
               "generated_tokens": tokens, "wall_s": round(self.wall_s, 3),
               # on a machine it shares with the server, the client's CPU is taken from the server's
               "client_cpu_cores": round(self.cpu_s / self.wall_s, 3) if self.wall_s > 0 else 0.0,
               "tokens_per_s": round(tokens / self.wall_s, 2) if self.wall_s > 0 else 0.0,
               "ttft_p50_s": percentile([o.ttft_s for o in normal if o.ttft_s is not None], 0.50),
               "ttft_p99_s": percentile([o.ttft_s for o in normal if o.ttft_s is not None], 0.99),
               "latency_p50_s": percentile([o.latency_s for o in normal], 0.50),
               "latency_p99_s": percentile([o.latency_s for o in normal], 0.99)}
        if self.rss_before is not None:
            out["rss_before_mb"] = round(self.rss_before / 2**20, 1)
            out["rss_after_mb"] = round(self.rss_after / 2**20, 1)
        if self.after is not None:
            out["after"] = self.after
            if not self.after["answered"]:
                out["errors"] += 1
                out["error_kinds"]["not answered after the run"] = 1
        return out


def percentile(values, q):
    """Nearest-rank percentile; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1], 4)


def openai_shaped(e: openai.APIError) -> bool:
    """Whether an error's body was OpenAI's: the client hands over the "error" object, with message and type."""
    return isinstance(e.body, dict) and isinstance(e.body.get("message"), str) and "type" in e.body


def rss_of(pid: int) -> int:
    import psutil  # an edgellm dependency; needed only with --pid
    return psutil.Process(pid).memory_info().rss


async def _stream(client, args, kind, rng, extra=None):
    """Open one streaming request: the async iterator of chunks, and a function giving a chunk's text."""
    extra = extra or {}
    common = dict(model=args.model, max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
                  stream_options={"include_usage": True})
    # --distinct: each request's own ending after the shared text, as many users' questions differ
    ending = f" Call the keeper {rng.choice(KEEPERS)} and set it in {rng.randint(1700, 1999)}." if args.distinct else ""
    if kind == "completion":
        stream = await client.completions.create(prompt=extra.pop("prompt", OPENING + ending), **common, **extra)
        return stream, lambda c: c.choices[0].text if c.choices else ""
    messages = [{"role": "user", "content": extra.pop("prompt", QUESTION + ending)}]
    stream = await client.chat.completions.create(messages=messages, **common, **extra)
    return stream, lambda c: (c.choices[0].delta.content or "") if c.choices else ""


async def one_request(client, args, role, rng) -> Outcome:
    kind = args.kind if args.kind != "mixed" else rng.choice(("chat", "completion"))
    out = Outcome(role)
    t0 = time.monotonic()
    try:
        if role in ("long_prompt", "huge_logprobs"):
            extra = {"prompt": "lighthouse " * LONG_PROMPT_WORDS} if role == "long_prompt" else (
                {"logprobs": 10_000} if kind == "completion" else {"logprobs": True, "top_logprobs": 10_000})
            try:
                stream, _ = await _stream(client, args, kind, rng, extra)
                await stream.close()
                out.error = f"{role} was not refused"
            except openai.APIStatusError as e:
                if e.status_code not in (400, 413) or not openai_shaped(e):  # invalid or too large: both right
                    raise
                out.ok = True
            return out
        stream, text_of = await _stream(client, args, kind, rng)
        leave_after = rng.randint(0, 3) if role == "disconnect" else None
        n_chunks = n_text = 0
        async for chunk in stream:
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
            if text_of(chunk):
                n_text += 1
                if out.ttft_s is None:
                    out.ttft_s = time.monotonic() - t0
            n_chunks += 1
            if leave_after is not None and n_chunks > leave_after:
                await stream.close()
                break
            if role == "stalled" and n_chunks == 1:
                await asyncio.sleep(args.stall_s)  # holds the connection without reading
        out.latency_s = time.monotonic() - t0
        if not out.tokens:  # a server that sends no usage chunk (llama-cpp-python's): a chunk of text per token
            out.tokens = n_text
        out.ok = True
    except openai.APIStatusError as e:
        out.error = f"HTTP {e.status_code}" + ("" if openai_shaped(e) else " (not an OpenAI error body)")
    except openai.APIError as e:  # an error event in a stream, or a transport failure
        out.error = type(e).__name__ + ("" if e.body is None or openai_shaped(e) else " (not an OpenAI error)")
    except (OSError, asyncio.TimeoutError) as e:
        out.error = type(e).__name__
    return out


def roles(args, rng) -> list:
    special = (["disconnect"] * int(round(args.disconnect * args.requests)) + ["stalled"] * args.stalled
               + ["long_prompt"] * args.long_prompts + ["huge_logprobs"] * args.huge_logprobs)[:args.requests]
    out = special + ["normal"] * (args.requests - len(special))
    rng.shuffle(out)
    return out


async def run(args) -> Report:
    rng = random.Random(args.seed)
    client = openai.AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0,
                                timeout=args.timeout)
    gate = asyncio.Semaphore(args.clients)
    report = Report()
    if args.pid:
        report.rss_before = rss_of(args.pid)

    async def limited(role, seed):
        async with gate:
            return await one_request(client, args, role, random.Random(seed))

    t0, c0 = time.monotonic(), time.process_time()
    report.outcomes = await asyncio.gather(*(limited(role, rng.random()) for role in roles(args, rng)))
    report.wall_s, report.cpu_s = time.monotonic() - t0, time.process_time() - c0
    if args.pid or args.check_after:
        await asyncio.sleep(args.settle_s)  # let the server finish what the abandoned requests left
    if args.pid:
        report.rss_after = rss_of(args.pid)
    if args.check_after:
        report.after = await check_after(client, args)
    await client.close()
    return report


async def check_after(client, args) -> dict:
    """One short chat must be answered; edgellm's /metrics gauges (where the server has them) read back."""
    import httpx  # the openai client's own transport
    after = {"answered": False}
    try:
        r = await client.chat.completions.create(model=args.model, max_tokens=4, temperature=0,
                                                 messages=[{"role": "user", "content": "Hi"}])
        after["answered"] = bool(r.choices) and r.choices[0].message is not None
    except openai.APIError as e:
        after["error"] = f"{type(e).__name__}: {e}"
    try:
        text = httpx.get(args.url.rstrip("/") + "/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {args.api_key}"}).text
        gauges = ("edgellm_slots_busy", "edgellm_queue_depth", "edgellm_requests_in_flight")
        for name, value in metric_samples(text, gauges).items():
            after[name.removeprefix("edgellm_")] = value
    except (httpx.HTTPError, ValueError):  # no /metrics, or not Prometheus's text: another server
        pass
    return after


def metric_samples(text: str, names) -> dict:
    """{name: value} of the unlabelled samples of these names on a Prometheus text page (names it lacks left out),
    read by prometheus-client's own parser; ValueError when the page is not in that format."""
    wanted = set(names)
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in wanted and not s.labels}


def format_summary(s: dict) -> str:
    lines = [f"requests {s['requests']}: ok {s['ok']}, errors {s['errors']} {s['error_kinds'] or ''}",
             f"kinds: {s['by_kind']}",
             f"generated {s['generated_tokens']} tokens in {s['wall_s']} s: {s['tokens_per_s']} tokens/s aggregate",
             f"this client used {s['client_cpu_cores']} CPU cores meanwhile",
             f"TTFT p50 {s['ttft_p50_s']} s, p99 {s['ttft_p99_s']} s; "
             f"latency p50 {s['latency_p50_s']} s, p99 {s['latency_p99_s']} s"]
    if "rss_before_mb" in s:
        lines.append(f"server RSS {s['rss_before_mb']} MB before, {s['rss_after_mb']} MB after")
    if "after" in s:
        lines.append(f"after the run: {s['after']}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="the server (without /v1)")
    ap.add_argument("--api-key", default=os.environ.get("EDGELLM_API_KEY", "none"))
    ap.add_argument("--model", default="any")
    ap.add_argument("--kind", choices=("chat", "completion", "mixed"), default="chat")
    ap.add_argument("--clients", type=int, default=8, help="requests in flight at once")
    ap.add_argument("--requests", type=int, default=None, help="requests in all (default: --clients)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--distinct", action="store_true",
                    help="end each request's prompt its own way (a name and a year): the server cannot take a whole "
                         "prompt it has seen, only the shared start")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disconnect", type=float, default=0.0, help="fraction of requests that leave mid-stream")
    ap.add_argument("--stalled", type=int, default=0, help="requests that stop reading mid-stream")
    ap.add_argument("--stall-s", type=float, default=30.0, help="how long a stalled reader stalls")
    ap.add_argument("--long-prompts", type=int, default=0, help="requests with a prompt past the context")
    ap.add_argument("--huge-logprobs", type=int, default=0, help="requests asking for 10,000 logprobs")
    ap.add_argument("--pid", type=int, default=None, help="report this server process's RSS before and after")
    ap.add_argument("--settle-s", type=float, default=2.0, help="wait before the after-RSS (with --pid)")
    ap.add_argument("--check-after", action="store_true",
                    help="then one short chat must be answered; reads edgellm's slot and queue gauges from /metrics")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    args = ap.parse_args(argv)
    args.requests = args.clients if args.requests is None else args.requests
    if args.clients < 1 or args.requests < 1 or not 0 <= args.disconnect <= 1:
        ap.error("--clients and --requests must be positive, --disconnect a fraction")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    summary = asyncio.run(run(args)).summary()
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

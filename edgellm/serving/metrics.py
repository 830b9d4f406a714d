"""Prometheus metrics for one server, with the official prometheus-client, on a registry of its own (several
servers in one process, as in tests, keep apart counts).

The endpoints and the model's scheduler report through the hooks here: `generation(...)` once per finished
request, `prompt_cache(...)` per lookup, and `watch(...)` for the queue and slot gauges and the scheduler's decode
step counters, read at scrape time.
`RequestCounter` is ASGI middleware counting every answered request by endpoint and status.
"""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

# seconds: from a few ms (a cached prompt) to minutes (a long prompt on a slow CPU)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)  # generated tokens per second, per request


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, known_paths=()):
        self.registry = r = CollectorRegistry()
        self.known_paths = frozenset(known_paths)
        self.requests = Counter("edgellm_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("edgellm_requests_in_flight", "HTTP requests being answered", registry=r)
        self.prompt_tokens = Counter("edgellm_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.generated_tokens = Counter("edgellm_generated_tokens", "tokens generated", registry=r)
        self.draft_tokens = Counter("edgellm_draft_tokens", "tokens drafted for speculative decoding and verified",
                                    registry=r)
        self.draft_accepted_tokens = Counter("edgellm_draft_accepted_tokens", "drafted tokens the model accepted",
                                             registry=r)
        self.cache_tokens = Counter("edgellm_prompt_cache_tokens",
                                    "prompt tokens taken from the prompt cache instead of evaluated", registry=r)
        self.cache_lookups = Counter("edgellm_prompt_cache_lookups", "prompt cache lookups", ["result"], registry=r)
        for result in ("hit", "miss"):  # both series from the start, so a rate over them is defined at once
            self.cache_lookups.labels(result)
        self.queue_depth = Gauge("edgellm_queue_depth", "requests waiting for a slot", registry=r)
        self.slots_busy = Gauge("edgellm_slots_busy", "slots generating now", registry=r)
        self.slots_total = Gauge("edgellm_slots", "slots (requests that can generate at once)", registry=r)
        self.ttft = Histogram("edgellm_time_to_first_token_seconds", "from a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("edgellm_request_duration_seconds", "from a generation request's arrival to its "
                                  "last token", buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_s = Histogram("edgellm_generation_tokens_per_second", "a request's generated tokens per "
                                      "second after its first", buckets=RATE_BUCKETS, registry=r)

    # -- hooks ---------------------------------------------------------------------------------------------------
    def watch(self, queue_depth=None, slots_busy=None, slots_total=None, decode_stats=None) -> None:
        """Callables read at each scrape, so the gauges are never stale. decode_stats: () -> the scheduler's stats
        dict, for the decode step counters (_DecodeSteps)."""
        for gauge, fn in ((self.queue_depth, queue_depth), (self.slots_busy, slots_busy),
                          (self.slots_total, slots_total)):
            if fn is not None:
                gauge.set_function(fn)
        if decode_stats is not None:
            self.registry.register(_DecodeSteps(decode_stats))

    def generation(self, prompt_tokens: int, generated_tokens: int, ttft_s: float | None = None,
                   duration_s: float | None = None, decode_s: float | None = None, draft_tokens: int = 0,
                   accepted_tokens: int = 0) -> None:
        """One finished generation: its token counts and times (decode_s: the time after its first token;
        draft_tokens / accepted_tokens: speculative decoding's drafted and accepted tokens)."""
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.generated_tokens.inc(max(0, generated_tokens))
        self.draft_tokens.inc(max(0, draft_tokens))
        self.draft_accepted_tokens.inc(max(0, accepted_tokens))
        if ttft_s is not None and generated_tokens > 0:
            self.ttft.observe(max(0.0, ttft_s))
        if duration_s is not None:
            self.duration.observe(max(0.0, duration_s))
        if decode_s is not None and decode_s > 0 and generated_tokens > 1:
            self.tokens_per_s.observe((generated_tokens - 1) / decode_s)

    def prompt_cache(self, hit: bool, reused_tokens: int = 0) -> None:
        """One prompt cache lookup: a hit re-used `reused_tokens` of the prompt."""
        self.cache_lookups.labels("hit" if hit else "miss").inc()
        if hit:
            self.cache_tokens.inc(max(0, reused_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def endpoint(self, path: str) -> str:
        return path if path in self.known_paths else "other"  # unknown paths would make labels unbounded


class _DecodeSteps:
    """The scheduler's batched forward passes as counters (llama-server's n_decode_total and busy slots per decode):
    sequences over steps is the mean batch, seconds over steps a step's time."""

    FIELDS = (("edgellm_decode_steps", "decode_steps", "forward passes that advanced generating sequences"),
              ("edgellm_decode_sequences", "decode_sequences", "sequences those forward passes advanced (over the "
               "steps: the mean batch)"),
              ("edgellm_decode_seconds", "decode_s", "seconds spent in those forward passes"))

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        for name, key, doc in self.FIELDS:
            yield CounterMetricFamily(name, doc, value=stats[key])


class RequestCounter:
    """ASGI middleware: every HTTP response counted by endpoint and status (refusals and errors included)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = []

        async def recording_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.in_flight.dec()
            code = status[0] if status else 500
            self.metrics.requests.labels(self.metrics.endpoint(scope["path"]), str(code)).inc()


class Stopwatch:
    """A request's times: arrival, first token, end."""

    def __init__(self):
        self.start = time.monotonic()
        self.first = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

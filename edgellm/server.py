"""`edgellm serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn; the `edgellm[server]` extra).

Sections: errors in OpenAI's shape; request bodies (size cap, JSON, field types, the limits of
edgellm/serving/limits.py); requests on the scheduler (edgellm/generation/scheduler.py: continuous batching on one
model-owning thread, so concurrent requests decode together; each request's llama-cpp-python-shaped call runs on a
thread of its own, reading its events from the scheduler); the endpoints; `create_app` (the endpoints behind
edgellm/serving/guard.py's checks, CORS and metrics), `BackgroundServer` (a server on a thread, for tests and
embedding apps) and `serve` (the CLI entry).

Streaming answers are server-sent events, one OpenAI chunk per `data:` line, then `data: [DONE]`. A client that
disconnects, queued, mid-prompt or mid-stream, cancels its request: a queued one is dropped unprefilled, a running
one frees its slot at the next scheduler turn. Generation runs ahead of a slow reader into a bounded buffer; a
reader that stays stalled past the stall timeout (its buffer full, or a send blocked) is cancelled and its slot
freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import socket
import sys
import threading
import time
import warnings
from functools import partial

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import edgellm
from edgellm.compat import llama_compat
from edgellm.compat.tool_calls import ChatPlan
from edgellm.errors import EdgeLLMError
from edgellm.generation import embeddings
from edgellm.generation.options import parse_options
from edgellm.generation.prompt_cache import PromptCache
from edgellm.generation.results import Completion
from edgellm.generation.scheduler import DEFAULT_BUFFER_EVENTS, DEFAULT_STALL_TIMEOUT_S, Scheduler
from edgellm.generation.speculative import DRAFT_LIMIT
from edgellm.serving.choices import check_choices, choice_kwargs, merged_response, reindexed, stream_usage
from edgellm.serving.errors import HTTPError, busy, error_from_exception, server_error
from edgellm.serving.guard import LoadingGate, RequestGuard, resolve_api_key
from edgellm.serving.limits import RequestLimits, check_logprobs, fit_max_tokens
from edgellm.serving.metrics import RequestCounter, ServerMetrics, Stopwatch

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_MAX_QUEUE = 64  # waiting requests beyond this get 503 rather than an unbounded wait
DEFAULT_CACHE_RAM = 1 << 30  # `serve`'s prompt cache: KV prefixes of recent conversations
log = logging.getLogger("edgellm.server")


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------

# HTTPError and the mapping of exceptions to statuses live in edgellm/serving/errors.py
_error_from_exception = error_from_exception


# ---------------------------------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------------------------------

def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_stop(v):
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _is_token_ids(v):
    return isinstance(v, list) and len(v) > 0 and all(_is_int(t) for t in v)


def _is_prompt_batch(v):
    return isinstance(v, list) and len(v) > 0 and all(isinstance(p, str) or _is_token_ids(p) for p in v)


def _is_prompt(v):
    return isinstance(v, str) or _is_token_ids(v) or _is_prompt_batch(v)


NUMBER = (_is_number, "a number")
INTEGER = (_is_int, "an integer")
BOOLEAN = (lambda v: isinstance(v, bool), "true or false")
STRING = (lambda v: isinstance(v, str), "a string")
OBJECT = (lambda v: isinstance(v, dict), "an object")
STOP = (_is_stop, "a string or a list of strings")

SAMPLING_FIELDS = {
    "max_tokens": INTEGER, "temperature": NUMBER, "top_p": NUMBER, "top_k": INTEGER, "min_p": NUMBER,
    "typical_p": NUMBER, "repeat_penalty": NUMBER, "repeat_last_n": INTEGER, "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER, "seed": INTEGER, "stop": STOP, "logit_bias": OBJECT, "ignore_eos": BOOLEAN,
    "stream": BOOLEAN, "stream_options": OBJECT, "n": INTEGER, "model": STRING, "user": STRING,
    # structured output (llama.cpp's server names grammar and json_schema; regex and choice are edgellm's)
    "response_format": OBJECT, "grammar": STRING, "json_schema": (lambda v: isinstance(v, (dict, bool)), "an object"),
    "regex": STRING, "choice": (lambda v: isinstance(v, list), "a list of strings"),
    # edgellm's: let max_tokens run past the context, old tokens shifting out (the prompt must still fit)
    "context_shift": BOOLEAN,
    # llama-server's per-request speculative decoding (flat keys with a dot): most / fewest tokens drafted per step
    "speculative.n_max": INTEGER, "speculative.n_min": INTEGER,
}
COMPLETION_FIELDS = {**SAMPLING_FIELDS, "prompt": (_is_prompt, "a string, a list of token ids, or a list of those"),
                     "logprobs": INTEGER, "echo": BOOLEAN, "best_of": INTEGER, "suffix": STRING}
CHAT_FIELDS = {**SAMPLING_FIELDS, "messages": (lambda v: isinstance(v, list), "a list of messages"),
               "max_completion_tokens": INTEGER, "logprobs": BOOLEAN, "top_logprobs": INTEGER,
               "tools": (lambda v: isinstance(v, list), "a list of tools"),
               "tool_choice": (lambda v: isinstance(v, (str, dict)), "\"auto\", \"none\", \"required\" or an object"),
               "parallel_tool_calls": BOOLEAN, "chat_template_kwargs": OBJECT,
               "functions": (lambda v: isinstance(v, list), "a list of functions"),
               "function_call": (lambda v: isinstance(v, (str, dict)), "a string or an object")}
EMBEDDING_FIELDS = {"input": (_is_prompt, "a string, a list of token ids, or a list of those"), "model": STRING,
                    "encoding_format": STRING, "dimensions": INTEGER, "user": STRING}
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one request's inputs
CHAT_PLAN_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
                    "chat_template_kwargs")
# accepted and ignored: they describe the caller or OpenAI's storage, not the generation
IGNORED_FIELDS = ("model", "user", "n", "best_of", "stream", "stream_options", "service_tier",
                  "store", "metadata")


async def read_json(request: Request, max_bytes: int) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes}",
                        code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise HTTPError(413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "request body must be a JSON object")
    return data


def check_fields(body: dict, fields: dict, required: tuple) -> None:
    for name in required:
        if name not in body:
            raise HTTPError(400, f"'{name}' is required", param=name)
    for name, value in body.items():
        if name not in fields and name not in IGNORED_FIELDS:
            raise HTTPError(400, f"unrecognized request field '{name}'", param=name)
        if value is None or name not in fields:
            continue  # null means "the default", as in OpenAI's API
        is_valid, expected = fields[name]
        if not is_valid(value):
            raise HTTPError(400, f"'{name}' must be {expected}, got {json.dumps(value)[:80]}", param=name)


def speculation_kwargs(kwargs: dict, scheduler: Scheduler) -> None:
    """llama-server's `speculative.n_max` / `speculative.n_min` as the options draft_max / draft_min, checked: whole
    numbers, 0 <= n_min <= n_max <= DRAFT_LIMIT (n_max 0 turns drafting off for the request; n_min: shorter drafts
    are not verified). Refused on a server that does not speculate, unless they ask for none."""
    n_max, n_min = kwargs.pop("speculative.n_max", None), kwargs.pop("speculative.n_min", None)
    if n_max is None and n_min is None:
        return
    for name, value in (("speculative.n_max", n_max), ("speculative.n_min", n_min)):  # (integers: check_fields)
        if value is not None and not 0 <= value <= DRAFT_LIMIT:
            raise HTTPError(400, f"'{name}' must be from 0 to {DRAFT_LIMIT}, got {value}", param=name)
    most = scheduler.draft_max if n_max is None else n_max
    if n_min and most is not None and n_min > most:
        raise HTTPError(400, f"'speculative.n_min' ({n_min}) must not exceed speculative.n_max ({most})",
                        param="speculative.n_min")
    if scheduler.speculative is None and (n_max or n_min):
        raise HTTPError(400, "this server does not do speculative decoding (start it with --lookup or "
                             "--draft-model): speculative.n_max and speculative.n_min must be 0 or left out",
                        param="speculative.n_max" if n_max else "speculative.n_min")
    if n_max is not None:
        kwargs["draft_max"] = n_max
    if n_min is not None:
        kwargs["draft_min"] = n_min


def generation_kwargs(body: dict, fields: dict) -> dict:
    """The body's generation fields as create_completion / create_chat_completion keyword arguments."""
    kwargs = {k: v for k, v in body.items() if k in fields and k not in IGNORED_FIELDS and v is not None}
    if "max_completion_tokens" in kwargs:  # OpenAI's newer name
        kwargs["max_tokens"] = kwargs.pop("max_completion_tokens")
    if kwargs.get("max_tokens", 1) < (0 if kwargs.get("echo") else 1):  # 0 with echo: the prompt back, scored
        raise HTTPError(400, "'max_tokens' must be at least 1 (0 only with echo)", param="max_tokens")
    return kwargs


# ---------------------------------------------------------------------------------------------------------------
# The model slot
# ---------------------------------------------------------------------------------------------------------------

def _hand_over(loop, done, fn, *args) -> None:
    """fn(*args), on the calling thread; its result, or the exception it raised, settles the future `done` on the
    event loop (unless already settled, or the loop is closed: the server is exiting and nobody waits)."""
    try:
        method, value = done.set_result, fn(*args)
    except BaseException as e:  # handed to the awaiting request
        method, value = done.set_exception, e

    def settle():
        if not done.done():
            method(value)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


class ModelSlot:
    """The scheduler's admission, as the endpoints see it: n_slots sequences decode together, `waiting` requests
    queue behind them (at most max_queue, then 503), and run(fn) runs a request's blocking call (it waits on the
    scheduler's events) on a thread of its own."""

    def __init__(self, scheduler: Scheduler, max_queue: int = DEFAULT_MAX_QUEUE):
        self.scheduler, self.max_queue = scheduler, max_queue
        self.n_slots = scheduler.n_parallel
        self.worker = threading.BoundedSemaphore(self.n_slots + max_queue + 4)  # request threads at once
        self._waiting_here = 0  # requests counted before they reach the scheduler's queue

    @property
    def in_use(self) -> int:
        return self.scheduler.n_active

    @property
    def waiting(self) -> int:
        return self.scheduler.n_queued + self._waiting_here

    @waiting.setter
    def waiting(self, value: int) -> None:
        self._waiting_here = value - self.scheduler.n_queued

    async def run(self, fn, *args):
        """fn(*args) on a daemon thread of its own: a request left waiting on a scheduler that is gone must never
        hold up the interpreter's exit (an executor's workers are joined at exit)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def job():
            try:
                _hand_over(loop, done, fn, *args)
            finally:
                self.worker.release()

        if not self.worker.acquire(blocking=False):
            raise busy("the server is busy (every request thread is taken); retry later")
        threading.Thread(target=job, name="edgellm-request", daemon=True).start()
        return await done

    def pump(self, gen) -> "_Pump":
        """gen stepped on a thread of its own (one of the request threads), until closed."""
        if not self.worker.acquire(blocking=False):
            gen.close()
            raise busy("the server is busy (every request thread is taken); retry later")
        return _Pump(gen, self.worker.release)

    @contextlib.contextmanager
    def counted(self):
        """One request counted as waiting outside the scheduler's queue (tokenizer work), without the read-then-set
        of `waiting`, which races with the scheduler thread's dequeues."""
        self._waiting_here += 1
        try:
            yield
        finally:
            self._waiting_here -= 1

    def check_queue(self, requests: int = 1):
        if self.waiting + requests > self.max_queue:
            raise busy(f"the server is busy ({self.waiting} requests waiting); retry later")

    def close(self) -> None:
        """Stop the scheduler (requests in flight end with an error) and release its slots' memory."""
        self.scheduler.close()


class ScheduledModel:
    """The Model as one request sees it: its generations go to the scheduler (the llama-cpp-python-shaped calls
    of edgellm/compat/llama_compat.py run unchanged on top), and last_completion is this request's."""

    def __init__(self, model, scheduler: Scheduler):
        self._model, self._scheduler = model, scheduler
        self.last_completion = None
        self.request = None
        self.time_limit_s = None  # the server's request timeout (see ServedRequest)
        self._gone = False

    def __getattr__(self, name):
        return getattr(self._model, name)

    def decode_events(self, ids, opts):
        self.request = self._scheduler.submit(ids, opts, time_limit_s=self.time_limit_s)
        if self._gone:
            self.request.cancel()
        return self._events(self.request)

    def _events(self, request):
        for event in request.events():
            if isinstance(event, Completion):
                self.last_completion = event
            yield event

    def started(self) -> float | None:
        """When the scheduler took this request from its queue (time.monotonic()); None before."""
        return None if self.request is None else self.request.started

    def cancel(self) -> None:
        """The client left: its request, queued or running, is dropped at the scheduler's next turn."""
        self._gone = True
        if self.request is not None:
            self.request.cancel()

    def create_completion(self, prompt, **kwargs):
        return llama_compat.create_completion(self, prompt, **kwargs)

    def create_chat_completion(self, messages, **kwargs):
        return llama_compat.create_chat_completion(self, messages, **kwargs)


class EventStream:
    """A server-sent-events response from an async iterator of str: each send must finish within send_timeout_s
    (else the reader is stalled: on_gone(), and the connection is dropped), and a disconnect calls on_gone() at once,
    even while nothing is being sent (a queued request, a long prompt)."""

    HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, chunks, on_gone, send_timeout_s: float):
        self.chunks, self.on_gone, self.send_timeout_s = chunks, on_gone, send_timeout_s

    async def __call__(self, scope, receive, send):
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.on_gone()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.HEADERS})
            async for text in self.chunks:
                if watcher.done():
                    return
                try:
                    await asyncio.wait_for(send({"type": "http.response.body", "body": text.encode(),
                                                 "more_body": True}), self.send_timeout_s)
                except (asyncio.TimeoutError, OSError):
                    self.on_gone()
                    return  # the response stays incomplete: the server closes the connection
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await self.chunks.aclose()


class _Pump:
    """A stream's chunk generator, stepped on one thread of its own for the whole stream (a thread per chunk cost
    a thread start per token): next() asks for one chunk, so a slow reader's backlog stays in the scheduler's
    bounded buffer; close() ends the generator on that thread, after the step in flight."""

    def __init__(self, gen, on_exit):
        self.gen, self.on_exit, self.loop = gen, on_exit, asyncio.get_running_loop()
        self.asks = queue.SimpleQueue()  # futures to settle with the next chunk; None ends the thread
        threading.Thread(target=self._run, name="edgellm-stream", daemon=True).start()

    def _run(self):
        try:
            while (done := self.asks.get()) is not None:
                _hand_over(self.loop, done, next, self.gen, None)
        finally:
            self.gen.close()
            self.on_exit()

    async def next(self):
        done = self.loop.create_future()
        self.asks.put(done)
        return await done

    def close(self):
        self.asks.put(None)


# ---------------------------------------------------------------------------------------------------------------
# Endpoints
# ---------------------------------------------------------------------------------------------------------------

class Endpoints:
    def __init__(self, llm, model_name: str, max_request_bytes: int, max_queue: int, scheduler: Scheduler,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, limits: RequestLimits = RequestLimits(),
                 metrics: ServerMetrics | None = None):
        self.llm = llm
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.scheduler = scheduler
        self.slot = ModelSlot(scheduler, max_queue)
        self.stall_timeout_s = stall_timeout_s
        self.limits = limits
        self.metrics = metrics or ServerMetrics()
        self.metrics.watch(queue_depth=lambda: self.slot.waiting, slots_busy=lambda: self.slot.in_use,
                           slots_total=lambda: self.slot.n_slots, decode_stats=lambda: scheduler.stats)
        self.created = int(time.time())

    async def health(self, request):
        """llama-server's answers: 200 ok; 503 busy when a request would be refused for a full queue; with
        ?fail_on_no_slot, 503 "no slot available" while every slot generates."""
        slot = self.slot
        slots = {"slots_idle": slot.n_slots - slot.in_use, "slots_processing": slot.in_use}
        if slot.waiting >= slot.max_queue:
            error = busy(f"the server is busy ({slot.waiting} requests waiting)")
            return JSONResponse({"status": "busy", **slots, "error": error.body()}, 503, headers=error.headers)
        if "fail_on_no_slot" in request.query_params and slots["slots_idle"] == 0:
            error = busy("no slot available")
            return JSONResponse({"status": "no slot available", **slots, "error": error.body()}, 503,
                                headers=error.headers)
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request):
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def models(self, request):
        model = self.llm.model
        kv_type = getattr(model, "kv_type", None)
        meta = {"n_ctx": self.llm.n_ctx, "n_vocab": self.llm.n_vocab,
                "kv_type": getattr(kv_type, "name", kv_type), "n_keep": getattr(model, "n_keep", None),
                "device": getattr(self.llm, "device", "cpu"), "speculative": self.scheduler.speculative,
                "draft_max": self.scheduler.draft_max}
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "edgellm",
             "meta": meta}]})

    async def _tokenizer_job(self, fn, *args):
        """Tokenizer work through the model slot's admission: refused with 503 when the queue is full, and counted
        as waiting while it runs (on a request thread; the tokenizer does not touch the scheduler's model state)."""
        self.slot.check_queue()
        with self.slot.counted():
            return await self.slot.run(fn, *args)

    async def tokenize(self, request):
        body = await read_json(request, self.max_request_bytes)
        check_fields(body, {"content": STRING, "add_special": BOOLEAN, "parse_special": BOOLEAN,
                            "with_pieces": BOOLEAN}, ("content",))
        add_special, parse_special = body.get("add_special") or False, body.get("parse_special", True) is not False

        def job():
            ids = self.llm.tokenize(body["content"], add_special, parse_special)
            if body.get("with_pieces"):
                return [{"id": i, "piece": self.llm.detokenize([i], special=True)} for i in ids]
            return ids
        try:
            tokens = await self._tokenizer_job(job)
        except EdgeLLMError as e:
            raise HTTPError(400, str(e), param="content") from None
        return JSONResponse({"tokens": tokens})

    async def embeddings(self, request):
        """OpenAI's /v1/embeddings: each input's mean-pooled, L2-normalised embedding (llama-server's --pooling
        mean). The forward passes go through the engine thread between the scheduler's steps, each input in a cache
        of its own, so running requests keep their slots; the work counts as a waiting request, as /tokenize."""
        body = await read_json(request, self.max_request_bytes)
        check_fields(body, EMBEDDING_FIELDS, ("input",))
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise HTTPError(400, f"encoding_format must be \"float\" or \"base64\", got {fmt!r}",
                            param="encoding_format")
        n_embd = self.llm.model.config.n_embd
        if body.get("dimensions") not in (None, n_embd):
            raise HTTPError(400, f"this model's embeddings have {n_embd} dimensions; it cannot give "
                                 f"{body['dimensions']}", param="dimensions")
        inputs = body["input"]
        if _is_prompt_batch(inputs) and len(inputs) > MAX_EMBEDDING_INPUTS:
            raise HTTPError(400, f"at most {MAX_EMBEDDING_INPUTS} inputs a request, got {len(inputs)}", param="input")

        def job():
            ids, _ = embeddings.input_ids(self.llm, inputs)
            return embeddings.embed_ids(self.llm.model, ids), sum(len(i) for i in ids)
        try:
            vectors, n_tokens = await self._tokenizer_job(job)
        except EdgeLLMError as e:
            raise HTTPError(400, str(e), param="input") from None
        return JSONResponse(embeddings.embedding_response(vectors, self.model_name, n_tokens, fmt == "base64"))

    async def detokenize(self, request):
        body = await read_json(request, self.max_request_bytes)
        check_fields(body, {"tokens": (lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                                       "a list of token ids")}, ("tokens",))
        try:
            text = await self._tokenizer_job(self.llm.detokenize, body["tokens"])
        except EdgeLLMError as e:
            raise HTTPError(400, str(e), param="tokens") from None
        return JSONResponse({"content": text})

    async def completions(self, request):
        body = await read_json(request, self.max_request_bytes)
        check_fields(body, COMPLETION_FIELDS, ("prompt",))
        kwargs = generation_kwargs(body, COMPLETION_FIELDS)
        prompt = kwargs.pop("prompt")
        batch = prompt if _is_prompt_batch(prompt) else [prompt]  # a list of prompts: a choice each (times n)
        prompts = [(partial(self.llm.prompt_ids, p), partial(_create_completion, p)) for p in batch]
        return await self._generate(request, body, COMPLETION_FIELDS, prompts, kwargs, "prompt")

    async def chat_completions(self, request):
        body = await read_json(request, self.max_request_bytes)
        check_fields(body, CHAT_FIELDS, ("messages",))
        kwargs = generation_kwargs(body, CHAT_FIELDS)
        messages = kwargs.pop("messages")
        plan_args = {k: kwargs[k] for k in CHAT_PLAN_FIELDS if k in kwargs}

        def ids_of():  # the prompt as the call will render it (tools included), checked before a slot is taken
            return ChatPlan(self.llm, messages, **plan_args).ids
        return await self._generate(request, body, CHAT_FIELDS, [(ids_of, partial(_create_chat, messages))], kwargs,
                                    "messages")

    async def _generate(self, request, body, fields, prompts, kwargs, prompt_param):
        """prompts: (ids_of, create) per prompt; each makes n choices, each a request on the scheduler."""
        watch = Stopwatch()
        n = check_choices(body.get("n"), body.get("best_of"), len(prompts))
        kwargs["model"] = self.model_name
        wants_shift = kwargs.pop("context_shift", False)
        speculation_kwargs(kwargs, self.scheduler)
        check_logprobs(kwargs, chat=fields is CHAT_FIELDS)
        options = {k: v for k, v in kwargs.items()
                   if k not in ("echo", "logprobs", "top_logprobs") + CHAT_PLAN_FIELDS}
        if fields is COMPLETION_FIELDS:
            options["logprobs"] = kwargs.get("logprobs")
        else:  # chat's logprobs is a switch; the number of alternatives is top_logprobs
            options["logprobs"] = kwargs.get("top_logprobs", 0) if kwargs.get("logprobs") else None
        try:
            # what can be refused is refused here, with a 400, before a slot is taken
            parse_options("request", options, {}, allow_compat=True)
            if kwargs.get("top_logprobs") is not None and not kwargs.get("logprobs"):
                raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            n_prompts = [len(await asyncio.to_thread(ids_of)) for ids_of, _ in prompts]
        except (EdgeLLMError, TypeError, ValueError) as e:
            raise _error_from_exception(e, fields) from None
        may_shift = bool(wants_shift) and bool(getattr(self.llm.model, "context_shift", False))
        parts = []  # (create, its arguments) per choice, prompt-major
        for (_, create), n_prompt in zip(prompts, n_prompts):
            fitted = {**kwargs, "max_tokens": fit_max_tokens(n_prompt, kwargs.get("max_tokens"), self.llm.n_ctx,
                                                             self.limits, may_shift, prompt_param)}
            parts += [(create, kw) for kw in choice_kwargs(fitted, n)]
        if 0 < self.slot.max_queue < len(parts):  # (never room for it: not a 503 to retry)
            raise HTTPError(400, f"this request asks for {len(parts)} choices; this server queues at most "
                                 f"{self.slot.max_queue} requests", param="n", code="invalid_value")
        self.slot.check_queue(len(parts))
        llms = [ScheduledModel(self.llm, self.scheduler) for _ in parts]
        for llm in llms:
            # the scheduler checks it after each of this request's tokens, counted from its admission; a request
            # cut by it ends with finish_reason "length", as llama-server's t_max_predict_ms
            llm.time_limit_s = self.limits.request_timeout_s
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = self._metered(self._sse(llms, parts, include_usage, fields, n), llms, watch)
            return EventStream(events, partial(_cancel_all, llms), self.stall_timeout_s)
        response = await self._whole(request, llms, parts, fields, n)
        for llm in llms:
            self._record(llm, watch, first_token_s=None)
        return response

    def _record(self, llm, watch: Stopwatch, first_token_s):
        """The finished request's figures into the metrics, from its own request on the scheduler (other requests
        decode beside it, so the model's timings are no one request's)."""
        done, served = llm.last_completion, llm.request
        if done is None or served is None:
            return
        duration = watch.elapsed()
        if first_token_s is None and served.first_token_s is not None:
            first_token_s = max(0.0, served.submitted - watch.start) + served.first_token_s
        decode_s = None if first_token_s is None else duration - first_token_s
        self.metrics.generation(done.prompt_tokens, done.completion_tokens, ttft_s=first_token_s,
                                duration_s=duration, decode_s=decode_s, draft_tokens=done.draft_tokens,
                                accepted_tokens=done.accepted_tokens)
        self.metrics.prompt_cache(served.reused > 0, served.reused)

    async def _metered(self, events, llms, watch: Stopwatch):
        """A stream's events, timed for the metrics; an unexpected fault becomes an OpenAI error event."""
        finished = False
        try:
            async for event in events:
                if watch.first is None and '"error"' not in event[:20]:
                    watch.token()
                finished = finished or event == "data: [DONE]\n\n"
                yield event
        except Exception:  # headers are sent: the error can only go in the stream
            log.exception("a streamed request failed")
            yield f"data: {json.dumps({'error': server_error().body()})}\n\n"
            return
        finally:
            await events.aclose()
        if finished:
            for llm in llms:
                self._record(llm, watch, None if watch.first is None else watch.first - watch.start)

    async def _whole(self, request, llms, parts, fields, n):
        gone = threading.Event()
        watcher = asyncio.create_task(_watch_disconnect(request, gone, partial(_cancel_all, llms)))
        runs = [asyncio.ensure_future(self.slot.run(partial(create, llm, **kw)))
                for llm, (create, kw) in zip(llms, parts)]
        try:
            await asyncio.wait(runs, return_when=asyncio.FIRST_EXCEPTION)
            failed = [run.exception() for run in runs if run.done() and run.exception() is not None]
            if failed:
                _cancel_all(llms)  # the other choices end at the scheduler's next turn
                await asyncio.wait(runs)
                for run in runs:
                    run.exception()  # (retrieved: the first failure answers)
                raise failed[0]
            results = [run.result() for run in runs]
        except (EdgeLLMError, TypeError, ValueError) as e:
            raise _error_from_exception(e, fields) from None
        finally:
            watcher.cancel()
        return JSONResponse(results[0] if len(results) == 1 else merged_response(results, n))

    async def _sse(self, llms, parts, include_usage, fields, n):
        pumps, merged, first = [], None, None
        try:
            try:
                streams = await asyncio.gather(*(self.slot.run(partial(create, llm, stream=True, **kw))
                                                 for llm, (create, kw) in zip(llms, parts)), return_exceptions=True)
                made = [s for s in streams if not isinstance(s, BaseException)]
                failed = [s for s in streams if isinstance(s, BaseException)]
                try:
                    while made and not failed:
                        pumps.append(self.slot.pump(made.pop(0)))  # (a refused pump closes its stream)
                finally:
                    for stream in made:  # not pumped: another choice failed to start, or a pump was refused
                        stream.close()
                if failed:
                    raise failed[0]
                merged = _merged(pumps)
                async for index, chunk in merged:
                    first = first or chunk
                    if len(pumps) > 1:
                        chunk = reindexed(chunk, index, first)
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except (EdgeLLMError, TypeError, ValueError) as e:
                yield f"data: {json.dumps({'error': _error_from_exception(e, fields).body()})}\n\n"
                return
            except HTTPError as e:  # (every request thread taken: the headers are sent, so the 503 goes in the stream)
                yield f"data: {json.dumps({'error': e.body()})}\n\n"
                return
            if include_usage:
                usage = stream_usage([llm.last_completion for llm in llms], n)
                yield f"data: {json.dumps({**(first or {}), 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            _cancel_all(llms)  # (nothing happens to a finished request)
            if merged is not None:
                await merged.aclose()
            for pump in pumps:
                pump.close()


def _create_completion(prompt, llm, **kwargs):
    return llm.create_completion(prompt, **kwargs)


def _create_chat(messages, llm, **kwargs):
    return llm.create_chat_completion(messages, **kwargs)


def _cancel_all(llms) -> None:
    for llm in llms:
        llm.cancel()


async def _merged(pumps):
    """(choice index, chunk) from each pump as they come, until every pump has ended. One pump is read directly;
    several are read by a task each into a queue of one place per pump, so a slow reader still holds them back."""
    if len(pumps) == 1:
        while (chunk := await pumps[0].next()) is not None:
            yield 0, chunk
        return
    chunks = asyncio.Queue(maxsize=len(pumps))

    async def feed(index, pump):
        try:
            while (chunk := await pump.next()) is not None:
                await chunks.put((index, chunk, None))
        except Exception as e:  # (a cancellation, when the stream ends early, is not caught: the task ends)
            await chunks.put((index, None, e))
            return
        await chunks.put((index, None, None))

    feeders = [asyncio.create_task(feed(i, pump)) for i, pump in enumerate(pumps)]
    try:
        running = len(pumps)
        while running:
            index, chunk, error = await chunks.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
            else:
                yield index, chunk
    finally:
        for task in feeders:
            task.cancel()


async def _watch_disconnect(request: Request, flag: threading.Event, on_disconnect=None):
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            flag.set()
            if on_disconnect is not None:
                on_disconnect()
            return


# ---------------------------------------------------------------------------------------------------------------
# The app, a background server, and `edgellm serve`
# ---------------------------------------------------------------------------------------------------------------

def create_app(llm, api_key: str | None = None, model_name: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_queue: int = DEFAULT_MAX_QUEUE,
               limits: RequestLimits = RequestLimits(), cors_origins=(), host: str = "127.0.0.1",
               parallel: int | None = None, prompt_cache=None, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
               buffer_events: int = DEFAULT_BUFFER_EVENTS, **scheduler_options):
    """The ASGI app serving `llm` (an edgellm Model): the Starlette app inside its middleware (`.state` is the
    app's). Without api_key it answers only requests addressed to a loopback name or `host` (the address it is
    bound to), with JSON bodies (edgellm/serving/guard.py). cors_origins: web origins allowed to call it from a
    browser (none by default). parallel: sequences decoded together (default: what fits in free memory, at most
    8); prompt_cache: a PromptCache (or a RAM budget in bytes) for returning conversations; stall_timeout_s: how
    long a reader may take nothing before its request is cancelled, buffer_events: how far generation runs ahead
    of it. scheduler_options: the rest of Scheduler's (seq_ctx, prefill_chunk)."""
    if prompt_cache is not None and not hasattr(prompt_cache, "lookup"):
        prompt_cache = PromptCache(prompt_cache, model_name=llm.name, n_vocab=llm.n_vocab)
    scheduler = Scheduler(llm, parallel, prompt_cache=prompt_cache, stall_timeout_s=stall_timeout_s,
                          buffer_events=buffer_events, **scheduler_options)
    routes = {"/health": "health", "/metrics": "prometheus", "/v1/models": "models",
              "/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
              "/v1/embeddings": "embeddings", "/tokenize": "tokenize", "/detokenize": "detokenize"}
    metrics = ServerMetrics(known_paths=routes)
    ep = Endpoints(llm, model_name or llm.name, max_request_bytes, max_queue, scheduler, stall_timeout_s, limits,
                   metrics)
    posts = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize")
    app = Starlette(routes=[Route(path, getattr(ep, name), methods=["POST" if path in posts else "GET"])
                            for path, name in routes.items()],
                    exception_handlers={HTTPError: _on_http_error, 404: _on_not_found, 405: _on_not_found,
                                        Exception: _on_unexpected})
    app.state.endpoints = ep
    stack = RequestCounter(RequestGuard(app, api_key, bound_host=host), metrics)
    if cors_origins:  # outermost: a preflight carries no key, and refusals need the CORS headers to be readable
        stack = CORSMiddleware(stack, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                               allow_headers=["Authorization", "Content-Type"], max_age=600)
    stack.state = app.state
    return stack


async def _on_http_error(request, exc):
    return exc.response()


async def _on_not_found(request, exc):
    status = getattr(exc, "status_code", 404)
    error = HTTPError(status, f"{request.method} {request.url.path}: "
                              f"{'no such endpoint' if status == 404 else 'method not allowed'}",
                      code="not_found" if status == 404 else "method_not_allowed")
    response = error.response()
    if status == 405:
        response.headers.update(getattr(exc, "headers", None) or {})  # Allow: the methods it takes
    return response


async def _on_unexpected(request, exc):
    # the traceback goes to the log (Starlette re-raises after this answer); the client gets no internals
    return server_error().response()


class BackgroundServer:
    """Serve an app on a loopback port from a thread: `with BackgroundServer(app) as srv: srv.base_url`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn  # only running a server needs it: create_app and its test client do not
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        endpoints = getattr(getattr(self.app, "state", None), "endpoints", None)
        if endpoints is not None:  # first, so requests in flight end (503 or an error event) and uvicorn can stop
            endpoints.slot.close()
        self.thread.join(timeout=30)
        self.sock.close()
        return False


def check_serve_options(api_key: str | None = None, api_key_file: str | None = None,
                        max_tokens: int | None = None, request_timeout: float | None = None, lookup: bool = False,
                        draft_model: str | None = None) -> tuple:
    """`serve`'s checks that need no model, made before anything starts: (the API key, the RequestLimits, the
    speculation mode: None, "lookup" or "draft"). EdgeLLMError or ValueError with the message to print."""
    key = resolve_api_key(api_key, api_key_file)
    limits = RequestLimits(max_tokens=max_tokens, request_timeout_s=request_timeout)  # ValueError: a bad flag
    if lookup and draft_model:
        raise ValueError("speculative decoding takes either prompt lookup or a draft model, not both")
    return key, limits, "draft" if draft_model else "lookup" if lookup else None


def served_app(llm, model=None, *, api_key: str | None = None, limits: RequestLimits = RequestLimits(),
               speculative: str | None = None, host: str = "127.0.0.1",
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_queue: int = DEFAULT_MAX_QUEUE,
               cors_origins=(), parallel: int | None = None, cache_ram: int | None = None,
               cache_dir: str | None = None, draft_max: int | None = None, model_name: str | None = None) -> tuple:
    """The app `serve` runs around a loaded model (and each Ray Serve replica runs around its own): (the name it
    serves the model under, the app). The name: model_name, else the catalog name it was loaded by, else the
    file's name without .gguf. cache_ram: the prompt cache's RAM budget (None: DEFAULT_CACHE_RAM, 0: none)."""
    # the server refuses a prompt past the context (it never shifts through one), so the API's warning that a prompt
    # will would only mislead the log
    from edgellm.api import ContextShiftWarning
    warnings.filterwarnings("ignore", category=ContextShiftWarning)
    name = model_name or (model if model and not str(model).endswith(".gguf") else llm.name.removesuffix(".gguf"))
    cache_ram = DEFAULT_CACHE_RAM if cache_ram is None else cache_ram
    prompt_cache = PromptCache(cache_ram, cache_dir, model_name=llm.name, n_vocab=llm.n_vocab) \
        if cache_ram or cache_dir else None
    return name, create_app(llm, api_key=api_key, model_name=name, max_request_bytes=max_request_bytes,
                            max_queue=max_queue, limits=limits, cors_origins=cors_origins, host=host,
                            parallel=parallel, prompt_cache=prompt_cache, speculative=speculative,
                            draft_max=draft_max)


def serve(model=None, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          n_ctx: int | None = None, n_threads: int | None = None,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, compile_progress=None, *,
          api_key_file: str | None = None, kv_type: str | None = None, n_keep: int | None = None,
          device: str = "cpu", max_tokens: int | None = None, request_timeout: float | None = None,
          max_queue: int = DEFAULT_MAX_QUEUE, cors_origins=(), parallel: int | None = None,
          cache_ram: int | None = None, cache_dir: str | None = None, lookup: bool = False,
          draft_model: str | None = None, draft_max: int | None = None) -> int:
    """`edgellm serve`: bind first and answer 503 "loading" (on /health: {"status": "loading"}) while the model
    loads, then serve it (the scheduler and its prompt cache are built once the model is loaded). The API key comes
    from exactly one of api_key, api_key_file and $EDGELLM_API_KEY. compile_progress: where given, told of kernels a
    request's prompt compiles on first use (the server's log says so rather than a request seeming to hang).
    parallel: sequences decoded together (None: from the free memory); cache_ram: the prompt cache's RAM budget in
    bytes (0: none; None: DEFAULT_CACHE_RAM), cache_dir: where it also keeps its entries across restarts.
    lookup / draft_model: speculative decoding for every request, by prompt lookup or by this smaller model of the
    same vocabulary (per sequence, inside the batch: edgellm/generation/scheduler.py); draft_max: the most tokens
    drafted per step (a request may set its own, or 0, with llama-server's "speculative.n_max" /
    "speculative.n_min")."""
    import uvicorn  # only running a server needs it: create_app and its test client do not
    key, limits, speculative = check_serve_options(api_key, api_key_file, max_tokens, request_timeout, lookup,
                                                   draft_model)
    if host not in ("127.0.0.1", "localhost", "::1") and not key:
        print(f"edgellm: warning: serving on {host} without an API key: anyone who can reach it can use it",
              file=sys.stderr)
    gate = LoadingGate()
    server = uvicorn.Server(uvicorn.Config(gate, host=host, port=port, log_level="warning", lifespan="off"))
    failed = []

    def load():
        try:
            llm = edgellm.load(model, n_ctx=n_ctx, n_threads=n_threads, kv_type=kv_type, n_keep=n_keep,
                               device=device, draft_model=draft_model, speculative=speculative)
            llm.compile_progress = compile_progress
            name, gate.app = served_app(llm, model, api_key=key, limits=limits, speculative=speculative, host=host,
                                        max_request_bytes=max_request_bytes, max_queue=max_queue,
                                        cors_origins=cors_origins, parallel=parallel, cache_ram=cache_ram,
                                        cache_dir=cache_dir, draft_max=draft_max)
            print(f"edgellm: serving {name} on http://{host}:{port} (OpenAI base_url http://{host}:{port}/v1)",
                  file=sys.stderr)
        except BaseException as e:  # reported by the main thread once the server has stopped
            failed.append(e)
            server.should_exit = True

    print(f"edgellm: loading {model or 'the default model'}; http://{host}:{port}/health says when it is ready",
          file=sys.stderr)
    loader = threading.Thread(target=load, name="edgellm-load", daemon=True)
    loader.start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled by shutting down: a clean stop
        pass
    finally:
        endpoints = getattr(getattr(gate.app, "state", None), "endpoints", None)
        if endpoints is not None:
            endpoints.slot.close()
    if failed:
        raise failed[0]
    return 0

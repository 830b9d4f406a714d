"""Continuous batching for a server: requests arriving at any time decode together, on one model-owning thread.

`Scheduler(model, n_parallel)` keeps n_parallel sequence slots (one KV cache each, from a KVPool) and a FIFO
queue. `submit(ids, opts)` returns a `ServedRequest` at once; its events (text piece, TokenInfo), then the
Completion, arrive in its own bounded buffer, read from any thread. Only the scheduler thread touches the model.

One turn of the loop:
  1. admit: each free slot takes the oldest queued request (a cancelled one is dropped unprefilled). The slot
     whose cache (or the prompt cache's entry) shares the longest re-usable prefix with the prompt is chosen, and
     what a slot held is kept in the prompt cache before it is overwritten. A slot that prefilled this very prompt
     (its rows still held, its last row's logits kept) is taken first, and the request decodes at once;
  2. prefill: one chunk (at most `prefill_chunk` tokens) of the oldest request still prefilling;
  3. decode: one step of every decoding sequence whose buffer has room: each samples its next token with its own
     SequenceState (sampling, seed, stop strings, logprobs, constraint), and one forward_multi feeds them all.
     The chunk runs in that same forward (forward_mixed: the weights read once for both) where it fits beside the
     decode rows in n_batch and no draft is verified in the step; else in a forward of its own before it.
So a long prompt holds the running streams for one chunk at a time, never for its whole length (and a short one
adds its rows to a decode step instead of a forward of its own), and a request that arrives joins at the next turn.

Speculative decoding (`speculative="lookup"` or `"draft"`), per sequence: in the decode step each sequence may add
the tokens its drafter proposes after its next token (prompt lookup, or a draft model on a KV cache of its own per
slot, all slots' draft forwards run as one per drafted position), and one forward_verify_multi runs every
sequence's rows together, each row with a decode step's arithmetic;
each sequence then walks its rows through SequenceState.step as plain decoding would, and the rejected rows are
truncated from its cache. A sequence whose draft was cut by a rejection feeds the target's own token at the next
step. Each sequence's DraftLength adapts to its acceptance and to what the extra rows cost the step, for the batch:
drafted rows slow every sequence in the forward, so a draft is made only where the tokens it is expected to gain
beat what its rows cost the whole batch (a bigger batch drafts less). A request may lower its draft length or turn
drafting off (GenerationOptions.draft_max / draft_min). A sequence that finishes, is cancelled, or whose reader
stalls past `stall_timeout_s` frees its slot in that turn.

Shutdown: close() ends every request still queued or running with ServerClosing, whether the loop exits in time or
not, and an unexpected fault in a turn ends the requests in slots with it and the loop goes on; a reader also
checks, while it waits, that the loop's thread is alive. So no reader is ever left waiting on a loop that is gone.

Exactness: a chunk is a whole fresh batch of the prompt (edgellm.engine.prefix), or a part of one whose rows keep
the kinds the whole batch gives them (beside decode rows too: its rows are a group of their own, computed as a
batch of its size alone), and forward_multi's rows equal single-sequence decoding bit for bit; so a greedy request
gives the same tokens as served alone, whatever else runs beside it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np

from edgellm.engine import prefix, validate
from edgellm.errors import EdgeLLMError, PromptError, SamplingError, ServerClosing
from edgellm.generation.decoding import (PromptScore, SequenceState, check_finite, logit_bias_arrays,
                                         max_new_tokens, take_row)
from edgellm.generation.results import Completion, PromptScored
from edgellm.generation.sampling import Sampler
from edgellm.generation import cost_store, speculative as speculative_mod

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens between two decode steps (a multiple of 4: Q4_K's gemm groups)
DEFAULT_BUFFER_EVENTS = 256  # tokens a request may run ahead of its reader before it pauses
DEFAULT_STALL_TIMEOUT_S = 30.0  # a reader that takes nothing for this long, its buffer full, is cancelled
log = logging.getLogger("edgellm.server")
MAX_DEFAULT_PARALLEL = 8
KV_SHARE = 0.5  # of the free memory, what the default slot count may take for KV caches
IDLE_WAIT_S = 0.05  # between turns with every sequence paused (full buffers): how often stalls are checked
ALIVE_CHECK_S = 1.0  # how often a waiting reader checks that the scheduler's thread still runs


class ServedRequest:
    """One request's side of the scheduler: its events, read by the request's thread; cancel() from anywhere."""

    def __init__(self, ids, opts, bias, max_events: int, time_limit_s: float | None = None):
        self.ids, self.opts, self.bias, self.max_events = list(ids), opts, bias, max_events
        self.time_limit_s = time_limit_s  # generation ends ("time_limit", finish_reason "length") this long after
        # it leaves the queue, checked after each token
        self._events = deque()
        self._cond = threading.Condition()
        self._ended = False     # its last event (the Completion or an error) is pushed: nothing more is
        self.cancelled = threading.Event()
        self.finished = False
        self.status = "queued"  # queued, prefill, decode, done
        self.prefilled = 0      # prompt tokens this request ran through the model
        self.reused = 0         # prompt tokens re-used from a cache
        self.stop_cause = None  # "cancelled", "stalled" or an error, when it did not finish on its own
        self.submitted = time.monotonic()
        self.started = None     # time.monotonic() when it left the queue for a slot
        self.first_token_s = None
        self._wake = None       # the scheduler's, to tell it a full buffer drained
        self._alive = None      # the scheduler's: () -> whether its thread still runs

    def cancel(self) -> None:
        if not self.finished:
            self.cancelled.set()
            if self._wake is not None:
                self._wake()

    # -- the scheduler's side ----------------------------------------------------------------------------------
    def _push(self, event) -> None:
        """Queue an event for the reader; after the last one (a Completion or an error) nothing more is queued, so
        the closing thread and the scheduler's may both end a request."""
        with self._cond:
            if self._ended:
                return
            self._ended = isinstance(event, (Completion, BaseException))
            self._events.append(event)
            self._cond.notify_all()

    def _full(self) -> bool:
        return len(self._events) >= self.max_events

    # -- the reader's side -------------------------------------------------------------------------------------
    def events(self):
        """Generator of (piece, TokenInfo) events, then the Completion (an EdgeLLMError is raised where the model
        failed). Closing it cancels the request."""
        try:
            while True:
                with self._cond:
                    while not self._events:
                        if not self._cond.wait(ALIVE_CHECK_S) and self._alive is not None and not self._alive():
                            raise ServerClosing("the server stopped before this request ended")
                    event = self._events.popleft()
                if self._wake is not None and len(self._events) == self.max_events - 1:
                    self._wake()  # it had paused on a full buffer
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, Completion):
                    return
        finally:
            self.cancel()


class _Slot:
    def __init__(self, index: int, cache):
        self.index, self.cache = index, cache
        self.tokens: list[int] = []  # what the cache holds (for prefix reuse); [] when unknown
        self.kinds: list[int] = []
        self.request: ServedRequest | None = None
        self.seq: SequenceState | None = None
        self.batches: list = []      # prompt chunks still to run
        self.logits = None           # the row to sample the next token from
        self.found = None            # what take_row's scan found in it
        self.pending = None          # or: a token sampled but not yet fed (a draft's rejection gave it)
        self.spec = None             # the request's Speculator (speculative decoding), or None
        self.drafter = None          # a draft model's DraftModel on this slot's own draft cache
        self.last_used = 0.0
        self.paused_since = None
        # (prompt ids, its last row's logits, their scan) of the last prompt prefilled whole here, while the cache
        # still holds its rows: the same prompt again takes the rows and this row, and runs nothing
        self.prompt_row = None
        self.score = None  # the request's PromptScore, while its prompt is prefilled, where it asks for prompt_logprobs


class _PoolEngine:
    """Slots on a KVPool: prompts with forward(cache=...), decode steps with forward_multi."""

    def __init__(self, fm, n_parallel: int, seq_ctx: int):
        from edgellm.engine.kvcache import KVPool  # kernels: slow to import, loaded with a model
        windows = [kv.window for kv in fm.cache.layers]
        cfg = fm.config
        args = (n_parallel, seq_ctx, cfg.n_head_kv, cfg.head_dim, windows, fm.n_batch, fm.cache.kv_type)
        nbytes = KVPool.planned_nbytes(*args)
        validate.check_memory(0, nbytes, what=f"{n_parallel} server slots of {seq_ctx} positions")
        self.fm, self.pool = fm, KVPool(*args)
        self.caches = self.pool.caches
        self.reusable = True

    def reset(self, slot) -> None:
        slot.cache.reset()

    def prefill(self, slot, tokens, all_rows: bool = False) -> np.ndarray:
        """The last row of logits, or every row's."""
        out = self.fm.forward(np.asarray(tokens, np.int32), all_logits=all_rows, cache=slot.cache)
        return out if all_rows else out[-1]

    def decode(self, slots, tokens) -> np.ndarray:
        return self.fm.forward_multi(tokens, [s.cache for s in slots])

    def verify(self, slots, token_lists) -> np.ndarray:
        return self.fm.forward_verify_multi(token_lists, [s.cache for s in slots])

    def can_mix(self, slot, n_tokens: int, n_decode: int) -> bool:
        """Whether a prompt chunk of n_tokens for slot can run in one forward with n_decode decode rows."""
        return n_tokens + n_decode <= self.fm.n_batch and slot.cache.n_past + n_tokens <= slot.cache.n_ctx

    def mixed(self, slots, tokens, slot, chunk) -> np.ndarray:
        return self.fm.forward_mixed(tokens, [s.cache for s in slots], chunk, slot.cache)


class _SingleEngine:
    """One slot on the model's own cache (models without forward_multi: the GPU's, test doubles)."""

    def __init__(self, fm):
        self.fm, self.caches, self.reusable = fm, [fm.cache], False

    def reset(self, slot) -> None:
        self.fm.reset()

    def prefill(self, slot, tokens, all_rows: bool = False) -> np.ndarray:
        out = self.fm.forward(np.asarray(tokens, np.int32), all_logits=all_rows)
        return out if all_rows else out[-1]

    def decode(self, slots, tokens) -> np.ndarray:
        return self.fm.forward(np.asarray(tokens, np.int32))[-1:]

    def can_mix(self, slot, n_tokens: int, n_decode: int) -> bool:
        return False  # (one slot: never a chunk beside decode rows)


def supports_batching(fm) -> bool:
    return bool(getattr(fm, "SUPPORTS_MULTI", False)) and hasattr(getattr(fm, "cache", None), "layers") \
        and hasattr(fm, "forward_multi")


def default_parallel(fm, seq_ctx: int) -> int:
    """Slots that fit in KV_SHARE of the free memory, at most MAX_DEFAULT_PARALLEL (and n_batch)."""
    from edgellm.engine.kvcache import KVPool  # kernels: slow to import, loaded with a model
    windows = [kv.window for kv in fm.cache.layers]
    cfg = fm.config
    one = KVPool.planned_nbytes(1, seq_ctx, cfg.n_head_kv, cfg.head_dim, windows, fm.n_batch, fm.cache.kv_type)
    fit = int(validate.available_memory() * KV_SHARE) // max(one, 1)
    return max(1, min(MAX_DEFAULT_PARALLEL, fm.n_batch, fit))


class Scheduler:
    """The model-owning loop (see the module docstring). close() stops it; requests in flight end cancelled."""

    def __init__(self, model, n_parallel: int | None = None, seq_ctx: int | None = None, prompt_cache=None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, buffer_events: int = DEFAULT_BUFFER_EVENTS,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, speculative: str | None = None,
                 draft_max: int | None = None):
        for name, value in (("n_parallel", n_parallel), ("seq_ctx", seq_ctx)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.model = model
        fm = model.model
        self.seq_ctx = min(seq_ctx or model.n_ctx, model.n_ctx)
        if supports_batching(fm):
            n_parallel = min(n_parallel or default_parallel(fm, self.seq_ctx), fm.n_batch)
            self.engine = _PoolEngine(fm, n_parallel, self.seq_ctx)
        else:
            self.engine = _SingleEngine(fm)
            self.seq_ctx = model.n_ctx
        self.slots = [_Slot(i, c) for i, c in enumerate(self.engine.caches)]
        self.n_parallel = len(self.slots)
        self._start_speculation(speculative, draft_max)
        self.prompt_cache = prompt_cache if self.engine.reusable else None
        self.prefill_chunk = max(4, prefill_chunk - prefill_chunk % 4)
        self.buffer_events, self.stall_timeout_s = buffer_events, stall_timeout_s
        self.row_kinds = getattr(fm, "row_kinds", prefix.row_kinds)
        self.kind_bits = getattr(fm, "row_kind_bits", prefix.ALL_KIND_BITS)
        self.decode_kind = int(prefix.kinds_of([(0, 1)], self.row_kinds)[0])
        self.queue: deque[ServedRequest] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.stats = {"requests": 0, "finished": 0, "cancelled": 0, "stalled": 0, "failed": 0,
                      "prompt_tokens": 0, "prefilled_tokens": 0, "reused_tokens": 0, "generated_tokens": 0,
                      "decode_steps": 0, "decode_sequences": 0, "decode_s": 0.0, "prefill_chunks": 0, "mixed_steps": 0,
                      "draft_tokens": 0, "accepted_tokens": 0, "shared_tokens": 0}
        self._thread = threading.Thread(target=self._run, name="edgellm-scheduler", daemon=True)
        self._thread.start()

    def _start_speculation(self, mode, draft_max) -> None:
        self.speculative = speculative_mod.check_mode(mode, getattr(self.model, "draft_model", None) is not None)
        if draft_max is not None and (isinstance(draft_max, bool) or not isinstance(draft_max, int)
                                      or not 1 <= draft_max <= speculative_mod.DRAFT_LIMIT):
            raise ValueError(f"draft_max must be an integer from 1 to {speculative_mod.DRAFT_LIMIT}, got {draft_max!r}")
        self.draft_max = draft_max or (speculative_mod.DRAFT_MAX[mode] if mode else None)
        self.spec_costs = speculative_mod.ForwardCosts()  # what forwards cost, for every request's draft length
        self.spec_costs_path = None  # where that table is kept between runs (cost_store), saved when idle
        if self.speculative is None:
            return
        if not isinstance(self.engine, _PoolEngine) or not hasattr(self.engine.fm, "forward_verify_multi"):
            raise SamplingError("speculative decoding in the server needs the CPU backend's batched "
                                                "verification pass")
        if self.speculative == "draft":  # each slot drafts on a cache of its own
            from edgellm.engine.kvcache import KVPool  # kernels: slow to import, loaded with a model
            dm = self.model.draft_model.model
            windows, cfg = [kv.window for kv in dm.cache.layers], dm.config
            args = (self.n_parallel, self.seq_ctx, cfg.n_head_kv, cfg.head_dim, windows, dm.n_batch, dm.cache.kv_type)
            validate.check_memory(0, KVPool.planned_nbytes(*args), what=f"{self.n_parallel} draft caches")
            self.draft_pool = KVPool(*args)
            for slot, cache in zip(self.slots, self.draft_pool.caches):
                slot.drafter = speculative_mod.DraftModel(self.model.draft_model, None, cache)
        self.spec_costs_path = self.model._spec_cost_path(self.speculative, server=True)
        cost_store.load(self.spec_costs, self.spec_costs_path)

    def _speculator(self, slot, opts):
        if self.speculative is None or opts.speculative is None or opts.draft_max == 0:  # off for this request
            return None
        if self.speculative == "lookup":
            drafter = speculative_mod.PromptLookup()
        else:
            drafter = slot.drafter  # its cache keeps what it held: the next prompt re-uses the common prefix
            drafter.sampler = None if opts.sampling.greedy else Sampler(
                opts.sampling, seed=None if opts.seed is None else opts.seed + 1)  # its own stream of draws
        k_max = self.draft_max if opts.draft_max is None else opts.draft_max
        self.spec_costs.start_generation()
        return speculative_mod.Speculator(self.speculative, None, drafter, k_max, opts.draft_min, self.spec_costs)

    # -- any thread ------------------------------------------------------------------------------------------
    def submit(self, ids, opts, bias=None, time_limit_s: float | None = None) -> ServedRequest:
        """Queue a generation after prompt ids (checked by the caller) with these GenerationOptions; time_limit_s:
        a wall-clock limit counted from its admission (see ServedRequest)."""
        if bias is None:
            bias = logit_bias_arrays(opts, self.model.n_vocab)
        request = ServedRequest(ids, opts, bias, self.buffer_events, time_limit_s)
        request._wake, request._alive = self._wake, self._thread.is_alive
        with self._cond:
            if self._closed:
                raise ServerClosing("the server is shutting down")
            self.queue.append(request)
            self.stats["requests"] += 1
            self._cond.notify_all()
        return request

    @property
    def n_queued(self) -> int:
        return len(self.queue)

    @property
    def n_active(self) -> int:
        return sum(s.request is not None for s in self.slots)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self, timeout: float = 30) -> None:
        """Stop the loop: every request still queued or running ends with ServerClosing at once (not after the
        forward pass in progress, which may be long), then the loop's thread is given `timeout` to stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._end_pending()
        self._thread.join(timeout)

    def _end_pending(self) -> None:
        with self._cond:
            pending = list(self.queue) + [s.request for s in self.slots if s.request is not None]
            self.queue.clear()
        for request in pending:
            request.status, request.finished = "done", True
            request.stop_cause = request.stop_cause or "shutdown"
            request._push(ServerClosing("the server is shutting down"))

    # -- the scheduler thread --------------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self.queue) or any(s.request is not None for s in self.slots)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closed and not self._has_work():
                        self._cond.wait()
                    if self._closed:
                        break
                with self.model.exclusive("serve"):  # other callers of this Model wait while requests run
                    while self._has_work() and not self._closed:
                        if not self._guarded_turn():
                            with self._cond:  # every sequence waits on its reader: sleep until one drains
                                self._cond.wait(IDLE_WAIT_S)
                    if isinstance(self.engine, _SingleEngine):  # it used the Model's own cache
                        self.model._set_cached([], [])
                cost_store.save(self.spec_costs, self.spec_costs_path)  # (None: not kept)
        finally:  # closed, or a BaseException (interpreter exit, a KeyboardInterrupt) ended the loop
            with self._cond:
                self._closed = True
            self._end_pending()

    def _guarded_turn(self) -> bool:
        """A turn; an unexpected fault in it (a bug, not a model error) ends the requests in slots with that error,
        their caches forgotten, and the loop goes on serving the queue."""
        try:
            return self._turn()
        except Exception as e:
            log.exception("a scheduler turn failed")
            for slot in self.slots:
                if slot.request is not None:  # each reader its own exception (a 500: not the request's fault)
                    self._fail(slot, RuntimeError(f"the scheduler failed: {type(e).__name__}"))
            return True

    def _turn(self) -> bool:
        """One turn (see the module docstring); False when nothing could run."""
        progressed = self._admit()
        taken, chunk = self._take_chunk()
        progressed |= self._decode_step(chunk)
        return progressed or taken

    def _admit(self) -> bool:
        progressed = False
        while True:
            with self._cond:
                while self.queue and self.queue[0].cancelled.is_set():
                    self._end_unstarted(self.queue.popleft())
                    progressed = True
                free = [s for s in self.slots if s.request is None]
                if not free or not self.queue:
                    return progressed
                request = self.queue.popleft()
            try:
                self._start(request, free)
            except EdgeLLMError as e:
                request.stop_cause = repr(e)
                self.stats["failed"] += 1
                request.finished = True
                request._push(e)
            progressed = True

    def _end_unstarted(self, request) -> None:
        """A request cancelled while queued: answered empty, never prefilled."""
        seq = SequenceState(self.model, request.ids, request.opts, 0, request.bias)
        seq.stop_reason = "cancelled"
        request.stop_cause, request.status, request.finished = "cancelled", "done", True
        self.stats["cancelled"] += 1
        request._push(seq.finish()[1])

    def _plan(self, tokens, kinds, ids) -> int:
        if not tokens:
            return 0
        return prefix.plan(tokens, kinds, ids, self._step(len(ids)), self.row_kinds)[0]

    def _step(self, n_tokens: int) -> int:
        """The batch length a prompt of n_tokens gets from an empty slot."""
        fm = self.engine.fm
        step = getattr(fm, "prompt_step", None)
        if step is None or not self.engine.reusable:
            return getattr(fm, "n_batch", 512)
        return step(self.slots[0].cache, n_tokens)

    def _start(self, request, free) -> None:
        ids = request.ids
        budget = max_new_tokens(request.opts.max_tokens, self.seq_ctx, len(ids),
                                getattr(self.engine.fm, "context_shift", False))
        seq = SequenceState(self.model, ids, request.opts, budget, request.bias)
        step = self._step(len(ids))
        # a prompt scored token by token (prompt_logprobs) needs every row's logits: it re-uses nothing
        scoring = request.opts.prompt_logprobs is not None
        if scoring and len(ids) > self.seq_ctx:
            raise PromptError(f"prompt_logprobs needs the whole prompt in the context: {len(ids)} tokens do not fit "
                              f"in a slot's {self.seq_ctx}")
        fits = len(ids) <= self.seq_ctx and self.engine.reusable and not scoring
        # a free slot that prefilled this very prompt, else the one that re-uses most, else the least recently used
        holding = [s for s in free if fits and self._holds_prompt(s, ids)]
        reuse = {s.index: self._plan(s.tokens, s.kinds, ids) if fits and not holding else 0 for s in free}
        slot = holding[0] if holding else max(free, key=lambda s: (reuse[s.index], -s.last_used))
        common = len(ids) if holding else reuse[slot.index]
        if not holding:
            slot.prompt_row = None  # its rows are about to be replaced
        entry = None if holding or not fits or self.prompt_cache is None else self.prompt_cache.lookup(ids, slot.cache)
        kinds = prefix.narrowed(entry.kinds, self.kind_bits) if entry is not None else None
        from_entry = self._plan(entry.tokens.tolist(), kinds, ids) if entry is not None else 0
        if self.prompt_cache is not None and common < len(slot.tokens):
            self.prompt_cache.store(slot.tokens, slot.kinds, slot.cache)  # before it is overwritten
        if from_entry > common:
            slot.cache.import_state(entry.state)
            slot.tokens, slot.kinds, common = entry.tokens.tolist(), kinds, from_entry
        batches, whole = None, bool(holding) and prefix.rewind(slot.cache, common)
        if whole:  # the whole prompt: nothing to run
            batches = []
        elif common:
            planned, batches = prefix.plan(slot.tokens, slot.kinds, ids, step, self.row_kinds)
            if planned != common or not prefix.rewind(slot.cache, common):
                batches = None
        if batches is None:
            common, batches, slot.prompt_row = 0, prefix.fresh_batches(len(ids), step), None
            self.engine.reset(slot)
        slot.tokens, slot.kinds = list(ids[:common]), slot.kinds[:common]
        slot.batches = self._chunks(batches)
        slot.request, slot.seq, slot.logits, slot.paused_since = request, seq, None, None
        slot.pending, slot.spec = None, self._speculator(slot, request.opts)
        slot.score = PromptScore(self.model.tokenizer, ids, request.opts.prompt_logprobs) if scoring else None
        request.status, request.reused, request.started = "prefill", common, time.monotonic()
        self.stats["prompt_tokens"] += len(ids)
        self.stats["reused_tokens"] += common
        if whole:
            self._decode_from_prompt_row(slot, slot)
        if seq.done and not scoring:  # max_tokens 0 (a scored prompt ends after its prefill)
            self._finish(slot)

    def _chunks(self, batches) -> list:
        """Split fresh batches into chunks of prefill_chunk tokens (the last may take a short remainder) where every
        row keeps its kind."""
        out = []
        for b0, b1 in batches:
            pieces = [(s, min(s + self.prefill_chunk, b1)) for s in range(b0, b1, self.prefill_chunk)]
            # a remainder too short to keep its rows' kinds (a tiled kernel needs a few rows) joins the chunk before
            joined = pieces[:-2] + [(pieces[-2][0], b1)] if len(pieces) > 2 else []
            whole = prefix.kinds_of([(b0, b1)], self.row_kinds)
            for split in (pieces, joined):
                if len(split) > 1 and self.engine.reusable and np.array_equal(
                        prefix.kinds_of(split, self.row_kinds), whole):
                    out += split
                    break
            else:
                out.append((b0, b1))
        return out

    def _take_chunk(self):
        """(progressed, chunk): the next prompt chunk to run, (slot, b0, b1) of the oldest request still prefilling,
        or None (none, or that request was cancelled: progressed then)."""
        prefilling = [s for s in self.slots if s.request is not None and s.request.status == "prefill"]
        if not prefilling:
            return False, None
        slot = min(prefilling, key=lambda s: s.request.submitted)
        request = slot.request
        if request.cancelled.is_set():
            self._finish(slot, "cancelled")
            return True, None
        if request.prefilled == 0 and slot.score is None and self._share_prefix(slot):
            return True, None
        b0, b1 = slot.batches.pop(0)
        return True, (slot, b0, b1)

    def _run_chunk(self, chunk) -> None:
        """A prompt chunk in a forward of its own."""
        slot, b0, b1 = chunk
        try:
            logits = self.engine.prefill(slot, slot.request.ids[b0:b1], all_rows=slot.score is not None)
            if slot.score is not None:
                slot.score.rows(b0, logits)
                logits = logits[-1]
        except EdgeLLMError as e:
            self._fail(slot, e)
            return
        self._chunk_done(chunk, logits)

    def _chunk_done(self, chunk, logits) -> None:
        """A prompt chunk ran (logits: its last row's); after the prompt's last, the request decodes."""
        slot, b0, b1 = chunk
        request = slot.request
        request.prefilled += b1 - b0
        self.stats["prefilled_tokens"] += b1 - b0
        self.stats["prefill_chunks"] += 1
        slot.tokens += request.ids[b0:b1]
        slot.kinds += prefix.kinds_of([(b0, b1)], self.row_kinds).tolist()  # as this chunk ran
        self._note_shifts(slot)
        if not slot.batches:
            slot.logits, slot.found = take_row(logits)
            if self.engine.reusable:
                slot.prompt_row = (request.ids, slot.logits.copy(), slot.found)
            request.status = "decode"
            request.first_token_s = time.monotonic() - request.submitted
            if slot.score is not None:
                slot.seq.prompt_info, slot.score = slot.score.infos, None
                request._push(PromptScored(slot.seq.prompt_info))
                if slot.seq.done:  # max_tokens 0: the prompt's scores were all it asked for
                    self._finish(slot)

    def _share_prefix(self, slot) -> bool:
        """Before a prompt's first chunk: the longest re-usable prefix another slot has computed by now (the same
        system prompt, requests admitted together) is copied into this slot's cache rather than computed again; the
        whole prompt, with its last row's logits, where another slot prefilled the same prompt (n choices, a
        regenerated reply). True when nothing is left to prefill."""
        request = slot.request
        ids, have = request.ids, len(slot.tokens)
        if not self.engine.reusable or len(ids) > self.seq_ctx:
            return False
        for donor in self.slots:
            if donor is not slot and self._holds_prompt(donor, ids) and slot.cache.copy_prefix(donor.cache, len(ids)):
                slot.tokens, slot.kinds, slot.batches = list(ids), list(donor.kinds[:len(ids)]), []
                self.stats["shared_tokens"] += len(ids) - have
                self.stats["reused_tokens"] += len(ids) - request.reused
                self._decode_from_prompt_row(slot, donor)
                return True
        step = self._step(len(ids))
        plans = [(prefix.plan(s.tokens, s.kinds, ids, step, self.row_kinds), s) for s in self.slots
                 if s is not slot and len(s.tokens) > have]
        for (n, batches), donor in sorted(plans, key=lambda p: p[0][0], reverse=True):
            if n <= have:
                break
            if slot.cache.copy_prefix(donor.cache, n):
                slot.tokens, slot.kinds = list(ids[:n]), list(donor.kinds[:n])
                slot.batches = self._chunks(batches)
                self.stats["reused_tokens"] += n - request.reused
                self.stats["shared_tokens"] += n - have
                request.reused = n
                return False
        return False

    @staticmethod
    def _holds_prompt(slot, ids) -> bool:
        """Whether slot prefilled exactly this prompt whole and its cache still holds those rows (only decoded rows
        follow them: a new prompt there, a shift or a failure clears prompt_row or tokens)."""
        row = slot.prompt_row
        return row is not None and row[0] == ids and slot.tokens[:len(ids)] == ids

    @staticmethod
    def _decode_from_prompt_row(slot, donor) -> None:
        """slot's cache holds its prompt's rows (donor's, copied or its own): it decodes from donor's last prompt
        row, as the prefill that computed those rows left it (the same bits a fresh prefill gives)."""
        _, row, found = slot.prompt_row = donor.prompt_row
        slot.logits, slot.found = row.copy(), found
        request = slot.request
        request.reused, request.status = len(request.ids), "decode"
        request.first_token_s = time.monotonic() - request.submitted

    def _decode_step(self, chunk=None) -> bool:
        """Each decoding sequence takes its next token (sampled from its last row, or the one a rejected draft
        left pending), and any drafted tokens after it; one forward feeds them all, and `chunk` (a prompt chunk,
        _take_chunk's) with them where it fits beside plain decode rows, else in a forward of its own before."""
        decoding = [s for s in self.slots if s.request is not None and s.request.status == "decode"]
        stepped, drafting, progressed, now = [], [], False, time.monotonic()
        room = getattr(self.engine.fm, "n_batch", 1) - len(decoding)  # rows left for drafts in this forward
        # the sequences this forward will feed (a draft's rows slow each of their steps: DraftLength weighs that)
        n_seqs = sum(not s.request.cancelled.is_set() and not s.request._full() for s in decoding)
        for slot in decoding:
            request, seq = slot.request, slot.seq
            if request.cancelled.is_set():
                self._finish(slot, "cancelled")
                progressed = True
                continue
            if request._full():
                slot.paused_since = slot.paused_since or now
                if now - slot.paused_since > self.stall_timeout_s:
                    self._finish(slot, "stalled")
                    progressed = True
                continue
            slot.paused_since = None
            progressed = True
            if slot.pending is None:
                if not self._sample(slot, slot.logits, found=slot.found):
                    continue
            fed, choices, draft_s = [slot.pending if slot.pending is not None else seq.generated[-1]], [], 0.0
            slot.pending = None
            if slot.spec is not None and room > 0:
                cache_room = slot.cache.n_ctx - slot.cache.n_past - 1  # verified rows must fit without a shift
                limit = min(room, cache_room, seq.max_tokens - len(seq.generated))
                if self.speculative == "draft":  # planned here, drafted below for every slot at once
                    k = slot.spec.plan(limit, n_seqs)
                    room -= k
                    if k:
                        drafting.append((len(stepped), k))
                else:
                    t0 = time.perf_counter()
                    proposed = slot.spec.propose(seq.history, limit, n_seqs)
                    draft_s = time.perf_counter() - t0
                    if proposed is not None:
                        fed += proposed[0]
                        choices = proposed[1]
                        room -= len(choices)
            stepped.append([slot, fed, choices, draft_s])
        if drafting:
            self._draft_together(stepped, drafting)
        if chunk is not None and not (stepped and chunk[0].score is None
                                      and not any(choices for _, _, choices, _ in stepped)
                                      and self.engine.can_mix(chunk[0], chunk[2] - chunk[1], len(stepped))):
            self._run_chunk(chunk)
            chunk = None
        if stepped:
            self._feed(stepped, chunk)
        return progressed

    def _draft_together(self, stepped, drafting) -> None:
        """The draft model's proposals for the slots planned to draft, one draft forward per drafted position for all
        of them; their choices go into stepped (its time counted once, on the first)."""
        t0 = time.perf_counter()
        specs = [stepped[j][0].spec for j, _ in drafting]
        proposals = speculative_mod.draft_together([spec.drafter for spec in specs],
                                                   [stepped[j][0].seq.history for j, _ in drafting],
                                                   [k for _, k in drafting])
        for (j, _), spec, (tokens, qs) in zip(drafting, specs, proposals):
            proposed = spec.choices(tokens, qs)
            if proposed is not None:
                stepped[j][1] += proposed[0]
                stepped[j][2] = proposed[1]
        stepped[drafting[0][0]][3] = time.perf_counter() - t0

    def _sample(self, slot, row, choice=None, finish: bool = True, found=None) -> bool:
        """One token of slot's sequence from this row of logits (checked by the choice of a draft, when given;
        found: take_row's scan of the row); False when the sequence ended (failed, or done: then finished unless
        finish is False)."""
        request, seq = slot.request, slot.seq
        try:
            scanned = check_finite(row, f"after {len(seq.history)} tokens", found)
            event = seq.step(row, choice, scanned)
        except EdgeLLMError as e:
            self._fail(slot, e)
            return False
        if event is not None:
            request._push(event)
            self.stats["generated_tokens"] += 1
            self._check_time(request, seq)
        if seq.done:
            if finish:
                self._finish(slot)
            return False
        return True

    def _feed(self, stepped, chunk=None) -> None:
        """One forward for the stepped sequences (and a prompt chunk beside plain decode rows), then each walks its
        rows."""
        slots = [s for s, _, _, _ in stepped]
        drafted = any(choices for _, _, choices, _ in stepped)
        t0 = time.perf_counter()
        try:
            if drafted:
                rows = self.engine.verify(slots, [fed for _, fed, _, _ in stepped])
            elif chunk is not None:
                c_slot, b0, b1 = chunk
                rows = self.engine.mixed(slots, [fed[0] for _, fed, _, _ in stepped], c_slot,
                                         c_slot.request.ids[b0:b1])
            else:
                rows = self.engine.decode(slots, [fed[0] for _, fed, _, _ in stepped])
        except EdgeLLMError as e:
            for slot in slots + ([chunk[0]] if chunk is not None else []):
                self._fail(slot, e)
            return
        step_s = time.perf_counter() - t0
        self.stats["decode_steps"] += 1
        self.stats["decode_sequences"] += len(stepped)
        self.stats["decode_s"] += step_s
        if chunk is not None:
            self.stats["mixed_steps"] += 1
            self._chunk_done(chunk, rows[len(stepped)])
        extra = sum(len(choices) for _, _, choices, _ in stepped)
        n_seqs, draft_s = len(stepped), sum(d for _, _, _, d in stepped)  # every draft delays the whole forward
        if chunk is None and any(slot.spec is not None for slot in slots):  # what extra rows cost, against a plain
            if drafted:                                                     # step as big (once: one shared table)
                self.spec_costs.timed_verification(n_seqs + extra, step_s + draft_s, n_seqs)
            else:
                self.spec_costs.timed_step(step_s, n_seqs)
        offset = 0
        for slot, fed, choices, _ in stepped:
            own = rows[offset:offset + len(fed)]
            offset += len(fed)
            slot.tokens += fed
            slot.kinds += [self.decode_kind] * len(fed)
            if not choices:
                slot.logits, slot.found = take_row(own[0])  # the engine reuses its logits buffer
                self._note_shifts(slot)
                continue
            accepted, seq, spec = 0, slot.seq, slot.spec  # (the walk may end the request and free the slot)
            for row, choice in zip(own, choices):
                n = len(seq.generated)
                alive = self._sample(slot, row, choice, finish=False)  # finished below, its counts recorded
                if len(seq.generated) == n or seq.generated[-1] != choice[0]:
                    break  # rejected: the target's own token (or its end) is at this position
                accepted += 1
                if not alive:
                    break
            spec.record(len(choices), accepted)
            self.stats["draft_tokens"] += len(choices)
            self.stats["accepted_tokens"] += accepted
            rejected = len(choices) - accepted
            if rejected:
                slot.cache.truncate(slot.cache.n_past - rejected)
                del slot.tokens[-rejected:], slot.kinds[-rejected:]
            if slot.request is None:  # it failed in the walk
                continue
            if seq.done:
                self._finish(slot)
                continue
            if rejected:
                slot.logits, slot.pending = None, slot.seq.generated[-1]  # the target's own token, fed next step
            else:
                slot.logits, slot.found = take_row(own[-1])

    @staticmethod
    def _check_time(request, seq) -> None:
        limit = request.time_limit_s
        if limit is not None and not seq.done and time.monotonic() - request.started > limit:
            seq.stop_reason, seq.done = "time_limit", True

    def _note_shifts(self, slot) -> None:
        log = getattr(slot.cache, "shift_log", None)
        if log:  # a context shift re-rotated keys no fresh run computes so: this cache is not re-used
            slot.tokens, slot.kinds, slot.prompt_row = [], [], None
            log.clear()

    def _finish(self, slot, cause: str | None = None) -> None:
        request, seq = slot.request, slot.seq
        if cause is not None:
            seq.stop_reason = "cancelled"
            request.stop_cause = cause
            self.stats["stalled" if cause == "stalled" else "cancelled"] += 1
        else:
            self.stats["finished"] += 1
        piece, completion = seq.finish()
        if slot.spec is not None:
            completion.speculative = slot.spec.mode
            completion.draft_tokens, completion.accepted_tokens = slot.spec.drafted, slot.spec.accepted
        if piece:
            request._push((piece, None))
        self.model.last_completion = completion
        request.status, request.finished = "done", True
        request._push(completion)
        self._free(slot)

    def _fail(self, slot, error) -> None:
        request = slot.request
        request.stop_cause, request.status, request.finished = repr(error), "done", True
        self.stats["failed"] += 1
        request._push(error)
        slot.tokens, slot.kinds, slot.prompt_row = [], [], None  # a failed forward leaves the cache in no known state
        self._free(slot)

    def _free(self, slot) -> None:
        slot.batches = []  # cut mid-prompt: the whole chunks that ran stay in the cache, and in slot.tokens
        slot.request = slot.seq = slot.logits = slot.found = slot.pending = slot.spec = slot.score = None
        slot.paused_since = None
        slot.last_used = time.monotonic()

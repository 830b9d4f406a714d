"""Batched generation: many sequences decoded together, each decode step reading the weights once for all.

Each sequence owns one KV cache of a pool (edgellm.kvcache.KVPool: one allocation, per-sequence rings that shift
on their own). A sequence's prompt is prefilled alone in its cache (the same forward pass as Model.generate);
then every step samples each active sequence's next token (edgellm.decoding.SequenceState: the same choices as
alone) and runs one forward_multi over all of them, whose rows equal the single-sequence decode bit for bit. So
with greedy sampling each sequence gives exactly the tokens it gives alone. A sequence that finishes frees its
slot and the next queued prompt takes it (continuous batching).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from .errors import Cancelled, PromptError


def pool_for(model, n_seq: int, seq_ctx: int):
    """The Model's KV pool for n_seq sequences of seq_ctx positions, kept between calls of the same shape.
    Refused up front (MemoryBudgetError with the figures) when it cannot fit in available memory."""
    from . import validate
    from .kvcache import KVPool
    fm = model.model
    key = (n_seq, seq_ctx)
    pool = getattr(model, "_batch_pool", None)
    if pool is not None and model._batch_pool_key == key:
        return pool
    model._batch_pool = model._batch_pool_key = None  # release the old pool before sizing the new one
    windows = [kv.window for kv in fm.cache.layers]
    cfg = fm.config
    nbytes = KVPool.planned_nbytes(n_seq, seq_ctx, cfg.n_head_kv, cfg.head_dim, windows, fm.n_batch,
                                   fm.cache.kv_type)
    validate.check_memory(0, nbytes, what=f"a batch of {n_seq} sequences of {seq_ctx} positions "
                                          f"({nbytes // n_seq / 2**20:.1f} MiB of KV cache each)")
    model._batch_pool = KVPool(n_seq, seq_ctx, cfg.n_head_kv, cfg.head_dim, windows, fm.n_batch, fm.cache.kv_type)
    model._batch_pool_key = key
    return model._batch_pool


def run_batch(model, prompt_ids: list, opts, pool, bias):
    """Generator of (index, text piece) for every sequence; returns the Completions in prompt order.
    Holds the model (one call at a time) from its first step to its end."""
    from .decoding import SequenceState, max_new_tokens
    fm = model.model
    n_parallel, seq_ctx = len(pool.caches), pool.caches[0].n_ctx
    model._acquire("generate_batch")
    completions = [None] * len(prompt_ids)
    try:
        queue = deque(range(len(prompt_ids)))
        free = list(range(n_parallel))[::-1]
        active = {}   # slot -> SequenceState
        pending = {}  # slot -> logits row to sample from next
        while queue or active:
            while free and queue:  # a free slot takes the next queued prompt: prefilled alone in its cache
                index, slot = queue.popleft(), free.pop()
                ids = prompt_ids[index]
                budget = max_new_tokens(opts.max_tokens, seq_ctx, len(ids), fm.context_shift)
                seq = SequenceState(model, ids, opts, budget, bias)
                seq.index = index
                cache = pool.caches[slot]
                cache.reset()
                if model._cancel_requested.is_set():  # cancelled before its turn: an empty completion
                    seq.stop_reason, seq.done = "cancelled", True
                if not seq.done:  # (max_tokens 0 is done at once)
                    try:
                        pending[slot] = fm.forward(np.asarray(ids, dtype=np.int32), cache=cache)[-1].copy()
                        active[slot] = seq
                        continue
                    except Cancelled:  # cancel() during this prompt: whole batches ran, the cache is dropped
                        seq.stop_reason, seq.done = "cancelled", True
                completions[index] = seq.finish()[1]
                free.append(slot)
            step_slots = []
            for slot in sorted(pending):
                seq = active[slot]
                if model._cancel_requested.is_set():
                    seq.stop_reason, seq.done = "cancelled", True
                    event = None
                else:
                    model._check_finite(pending[slot], f"of batch sequence {seq.index} after {len(seq.history)} "
                                                       "tokens")
                    event = seq.step(pending[slot])
                if event is not None and event[0]:
                    yield seq.index, event[0]
                if seq.done:
                    piece, completions[seq.index] = seq.finish()
                    if piece:
                        yield seq.index, piece
                    del active[slot]
                    free.append(slot)
                else:
                    step_slots.append(slot)
            pending.clear()
            if step_slots:
                tokens = [active[slot].generated[-1] for slot in step_slots]
                logits = fm.forward_multi(tokens, [pool.caches[slot] for slot in step_slots])
                for row, slot in enumerate(step_slots):
                    pending[slot] = logits[row]  # valid until the next forward_multi, after the sampling above
        model.last_batch = completions
        return completions
    finally:
        model._release()


def prepare(model, prompts, max_tokens, n_parallel, seq_ctx, options):
    """Check everything before the first step: the prompts, the options, the slot count and the context."""
    from .options import parse_options
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise TypeError("prompts must be a list of prompts (text or token-id lists)")
    if len(prompts) == 0:
        raise PromptError("generate_batch() needs at least one prompt")
    opts = parse_options("generate_batch", {**options, "max_tokens": max_tokens}, model.NATIVE_DEFAULTS)
    prompt_ids = [model._prompt_ids(p) for p in prompts]
    fm = model.model
    for name, value in (("n_parallel", n_parallel), ("seq_ctx", seq_ctx)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    n_parallel = min(n_parallel or len(prompts), len(prompts), fm.n_batch)
    if seq_ctx is None:  # enough for the longest prompt and its tokens, at most the model's context
        longest = max(len(ids) for ids in prompt_ids)
        seq_ctx = model.n_ctx if max_tokens is None else min(model.n_ctx, longest + max_tokens + 1)
    seq_ctx = max(seq_ctx, 2 * fm.n_keep + 2)
    bias = model._logit_bias(opts)
    return prompt_ids, opts, pool_for(model, n_parallel, seq_ctx), bias

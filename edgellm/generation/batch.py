"""Batched generation: many sequences decoded together, each decode step reading the weights once for all.

Each sequence owns one KV cache of a pool (edgellm.engine.kvcache.KVPool: one allocation, per-sequence rings that shift
on their own). A sequence's prompt is prefilled alone in its cache (the same forward pass as Model.generate); then every
step samples each active sequence's next token (edgellm.generation.decoding.SequenceState: the same choices as alone)
and runs one forward_multi over all of them, whose rows equal the single-sequence decode bit for bit. So with greedy
sampling each sequence gives exactly the tokens it gives alone. A sequence that finishes frees its slot and the next
queued prompt takes it (continuous batching).
"""
from __future__ import annotations

import weakref
from collections import deque

import numpy as np

from edgellm.engine import prefix, validate
from edgellm.errors import Cancelled, PromptError, SamplingError
from edgellm.generation.decoding import (PromptScore, SequenceState, check_finite, logit_bias_arrays,
                                         max_new_tokens, take_row)
from edgellm.generation.options import MODEL_DEFAULT, parse_options

# Model -> ((n_seq, seq_ctx), its KV pool): the caches of the last batch shape, kept between calls of that shape
_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_for(model, n_seq: int, seq_ctx: int):
    """The Model's KV pool for n_seq sequences of seq_ctx positions, kept between calls of the same shape.
    Refused up front (MemoryBudgetError with the figures) when it cannot fit in available memory."""
    from edgellm.engine.kvcache import KVPool  # kernels: slow to import, loaded with a model
    fm = model.model
    key = (n_seq, seq_ctx)
    kept = _POOLS.get(model)
    if kept is not None and kept[0] == key:
        return kept[1]
    _POOLS.pop(model, None)  # release the old pool before sizing the new one
    windows = [kv.window for kv in fm.cache.layers]
    cfg = fm.config
    nbytes = KVPool.planned_nbytes(n_seq, seq_ctx, cfg.n_head_kv, cfg.head_dim, windows, fm.n_batch,
                                   fm.cache.kv_type)
    validate.check_memory(0, nbytes, what=f"a batch of {n_seq} sequences of {seq_ctx} positions "
                                          f"({nbytes // n_seq / 2**20:.1f} MiB of KV cache each)")
    pool = KVPool(n_seq, seq_ctx, cfg.n_head_kv, cfg.head_dim, windows, fm.n_batch, fm.cache.kv_type)
    _POOLS[model] = (key, pool)
    return pool


def release_pool(model) -> None:
    """Drop the Model's kept KV pool, if any (its memory goes with it)."""
    _POOLS.pop(model, None)


def run_batch(model, prompt_ids: list, opts, pool, bias, on_finish=None):
    """Generator of (index, text piece) for every sequence; returns the Completions in prompt order.
    Holds the model (one call at a time) from its first step to its end.

    opts and bias: one for every prompt, or lists with one per prompt (batch jobs mix options line by line).
    on_finish(index, completion) is called as each sequence ends, so a job can record it before the batch ends."""
    fm = model.model
    n_parallel, seq_ctx = len(pool.caches), pool.caches[0].n_ctx
    completions = [None] * len(prompt_ids)
    per_prompt = isinstance(opts, (list, tuple))

    def finished(index, completion):
        completions[index] = completion
        if on_finish is not None:
            on_finish(index, completion)
    with model.exclusive("generate_batch"):
        queue = deque(range(len(prompt_ids)))
        free = list(range(n_parallel))[::-1]
        active = {}   # slot -> SequenceState
        pending = {}  # slot -> logits row to sample from next
        found = {}    # slot -> take_row's scan of a prompt's row (copied out of the engine's buffer)
        while queue or active:
            while free and queue:  # a free slot takes the next queued prompt: prefilled alone in its cache
                index, slot = queue.popleft(), free.pop()
                ids = prompt_ids[index]
                o, b = (opts[index], bias[index]) if per_prompt else (opts, bias)
                budget = max_new_tokens(o.max_tokens, seq_ctx, len(ids), fm.context_shift)
                seq = SequenceState(model, ids, o, budget, b)
                seq.index = index
                cache = pool.caches[slot]
                cache.reset()
                if model.cancel_requested:  # cancelled before its turn: an empty completion
                    seq.stop_reason, seq.done = "cancelled", True
                if not seq.done or o.prompt_logprobs is not None:  # (max_tokens 0 is done at once, unless scored)
                    try:
                        row = _prompt_row(model, ids, cache, seq)
                        if not seq.done:
                            pending[slot], found[slot] = take_row(row)
                            active[slot] = seq
                            continue
                    except Cancelled:  # cancel() during this prompt: whole batches ran, the cache is dropped
                        seq.stop_reason, seq.done = "cancelled", True
                finished(index, seq.finish()[1])
                free.append(slot)
            step_slots = []
            for slot in sorted(pending):
                seq = active[slot]
                if model.cancel_requested:
                    seq.stop_reason, seq.done = "cancelled", True
                    event = None
                else:
                    scanned = check_finite(pending[slot], f"of batch sequence {seq.index} after "
                                           f"{len(seq.history)} tokens", found.pop(slot, None))
                    event = seq.step(pending[slot], scanned=scanned)
                if event is not None and event[0]:
                    yield seq.index, event[0]
                if seq.done:
                    piece, completion = seq.finish()
                    if piece:
                        yield seq.index, piece
                    finished(seq.index, completion)
                    del active[slot]
                    free.append(slot)
                else:
                    step_slots.append(slot)
            pending.clear()
            found.clear()
            if step_slots:
                tokens = [active[slot].generated[-1] for slot in step_slots]
                logits = fm.forward_multi(tokens, [pool.caches[slot] for slot in step_slots])
                for row, slot in enumerate(step_slots):
                    pending[slot] = logits[row]  # valid until the next forward_multi, after the sampling above
        model.last_batch = completions
        return completions


def _prompt_row(model, ids, cache, seq) -> np.ndarray:
    """A prompt through a sequence's cache, as Model.generate runs it; its last row of logits. Where the options ask
    for prompt_logprobs, the fresh batches run one at a time with every row kept, and scored as they come."""
    fm, top_n = model.model, seq.opts.prompt_logprobs
    if top_n is None:
        return fm.forward(np.asarray(ids, dtype=np.int32), cache=cache)[-1]
    score = PromptScore(model.tokenizer, ids, top_n)
    last = score.prefill(fm, prefix.fresh_batches(len(ids), fm.prompt_step(cache, len(ids))), cache)
    seq.prompt_info = score.infos
    return last


def prepare(model, prompts, max_tokens, n_parallel, seq_ctx, options):
    """Check everything before the first step: the prompts, the options, the slot count and the context."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise TypeError("prompts must be a list of prompts (text or token-id lists)")
    if len(prompts) == 0:
        raise PromptError("generate_batch() needs at least one prompt")
    opts = parse_options("generate_batch", {**options, "max_tokens": max_tokens}, model.NATIVE_DEFAULTS)
    if opts.speculative not in (None, MODEL_DEFAULT) or opts.draft_max or opts.draft_min:
        # (a model's load() default is for single sequences)
        raise SamplingError("speculative decoding runs one sequence at a time; a batch already reads the weights "
                            "once for all its sequences, the saving speculation makes, so the two are not combined: "
                            "leave speculative out of generate_batch / stream_batch")
    prompt_ids = [model.prompt_ids(p) for p in prompts]
    fm = model.model
    for name, value in (("n_parallel", n_parallel), ("seq_ctx", seq_ctx)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    n_parallel = min(n_parallel or len(prompts), len(prompts), fm.n_batch)
    if seq_ctx is None:  # enough for the longest prompt and its tokens, at most the model's context
        longest = max(len(ids) for ids in prompt_ids)
        seq_ctx = model.n_ctx if max_tokens is None else min(model.n_ctx, longest + max_tokens + 1)
    seq_ctx = max(seq_ctx, 2 * fm.n_keep + 2)
    if opts.prompt_logprobs is not None and max(len(ids) for ids in prompt_ids) > seq_ctx:
        raise PromptError(f"prompt_logprobs needs each whole prompt in its sequence's context of {seq_ctx} tokens")
    bias = logit_bias_arrays(opts, model.n_vocab)
    return prompt_ids, opts, pool_for(model, n_parallel, seq_ctx), bias

"""What every decoder-only model shares: token validation, splitting a long input into batches, the KV cache
position, logits buffers and thread count. Each architecture writes only forward_pass, the math over a Batch."""

from typing import NamedTuple

import numba
from edgellm.quant import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
import numpy as np

from edgellm.engine import ops, prefix, profiler
from edgellm.engine.engine_thread import on_engine_thread
from edgellm.errors import Cancelled, ModelError
from edgellm.engine.kvcache import KVCache
from edgellm.engine.models.linear import group_projections, row_kind_bits
from edgellm.quant.linear import StepScratch
from edgellm.engine.models.loading import fill_absent_qkv_steps, layer_weights, load_tensors

# Rows up to which a forward of one-row groups (a decode step, a verified draft, a batch of sequences) runs its
# layers as callables bound to its buffers (DecoderModel.decode_steps).
BOUND_MAX_ROWS = 16
# Tokens per batch: bounds the activation buffers and the sliding-window rings (llama.cpp's default ubatch).
DEFAULT_N_BATCH = 512
# Attention sinks: positions a full context keeps when it shifts (StreamingLLM's 4; llama.cpp's --keep).
DEFAULT_N_KEEP = 4


class TokenBuffers:
    """Scratch activations for up to n_tokens tokens. Every array attribute has the token axis first;
    for_tokens(T) returns the same buffers cut to T rows (views, nothing copied)."""

    def __init__(self, n_tokens: int):
        self.n_tokens = n_tokens
        self._small_views = {}  # n <= BOUND_MAX_ROWS -> its view, kept: decode_steps binds to them

    def for_tokens(self, n: int):
        if n == self.n_tokens:
            return self
        view = self._small_views.get(n)
        if view is not None:
            return view
        view = object.__new__(type(self))
        for name, value in vars(self).items():
            setattr(view, name, value[:n] if isinstance(value, np.ndarray) else value)
        view.n_tokens = n
        if n <= BOUND_MAX_ROWS:
            self._small_views[n] = view
        return view


class RopeRows(NamedTuple):
    """One rope's tables at a batch's positions, as ops.finish_qkv applies them."""
    cos: np.ndarray  # [T, n_rot/2]
    sin: np.ndarray  # [T, n_rot/2]
    neox: bool  # NeoX pair ordering


class Batch:
    """The rows of one forward pass and where each row keeps its keys and values.

    tokens, positions: [T] int32; logits_out: [T, n_vocab], [1, n_vocab] (the last row only) or None.
    groups: ((row_begin, row_end, KVCache), ...) in row order, one per sequence: one group for a prompt batch or a
        decode step, one single-row group per sequence when forward_multi decodes several.
    sizes: the groups' row counts when there are several, else None: the matmuls give each group's rows the
        arithmetic of a batch of its own size, as if it ran alone (quant.linear).
    pool, seqs, n_pool: set when the first n_pool >= 2 rows are each its own sequence of one KVPool that
        ops.finish_attention_rows serves: the pool, and [n_pool] int32 each row's sequence in it; the cache step and
        attention then run as one call over those rows (and per group over the rest: a prompt chunk decoded beside
        them).
    runs: the groups after the pool's rows as attention takes them (_attention_runs): a verified draft's one-row
        groups, consecutive positions of one cache, merged into one run.
    logit_rows: [k] rows whose logits logits_out [k, n_vocab] gets, each computed as a one-row batch's; None: the
        last logits_out.shape[0] rows."""

    __slots__ = ("tokens", "positions", "logits_out", "groups", "sizes", "pool", "seqs", "n_pool", "logit_rows",
                 "runs", "embed_out")

    def __init__(self, tokens, positions, logits_out, groups, head_dim: int, logit_rows=None, embed_out=None):
        self.tokens, self.positions, self.logits_out, self.groups = tokens, positions, logits_out, groups
        self.logit_rows = logit_rows
        self.embed_out = embed_out  # [T, n_embd]: every row's output-normed hidden state (forward_embeddings)
        self.sizes = None if len(groups) == 1 else tuple(b1 - b0 for b0, b1, _ in groups)
        self.pool = self.seqs = None
        self.n_pool = 0
        pool = groups[0][2].pool
        n = 0
        while n < len(groups) and groups[n][1] - groups[n][0] == 1 and groups[n][2].pool is pool:
            n += 1
        # (rows of one sequence must take the per-group path: each row attends before the next one stores its keys)
        if n > 1 and pool is not None and len({id(c) for _, _, c in groups}) == len(groups) \
                and all(ops.attention_rows_supported(stacked, head_dim) for stacked in pool.stacked):
            self.pool, self.seqs, self.n_pool = pool, np.array([c.pool_index for _, _, c in groups[:n]], np.int32), n
        self.runs = _attention_runs(groups[self.n_pool:], positions, head_dim)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def rope_rows(self, rope, cos, sin, neox: bool) -> RopeRows:
        """The tables of `rope` (an ops.Rope) at this batch's positions, written into cos, sin [>= T, n_rot/2]."""
        ops.rope_tables(self.positions, rope, cos, sin)
        return RopeRows(cos, sin, neox)


def _attention_runs(groups, positions, head_dim: int) -> tuple:
    """The groups as attention takes them: ((row_begin, row_end, cache, run), ...), run True for single-row groups
    of one cache at consecutive positions merged into one (a verified draft: ops.finish_attention_run computes its
    rows as decode steps in order, in one call a layer) where the cache allows it, else each group as it is."""
    out, i = [], 0
    while i < len(groups):
        b0, b1, cache = groups[i]
        j = i + 1
        if b1 - b0 == 1:
            while j < len(groups) and groups[j][2] is cache and groups[j][1] - groups[j][0] == 1 \
                    and groups[j][0] == groups[j - 1][1] and positions[groups[j][0]] == positions[groups[j - 1][0]] + 1:
                j += 1
        if j - i > 1 and all(ops.attention_rows_supported(kv, head_dim) and j - i <= kv.slot_pos.shape[0]
                             for kv in cache.layers):
            out.append((b0, groups[j - 1][1], cache, True))
        else:
            out.extend((g0, g1, c, False) for g0, g1, c in groups[i:j])
        i = j
    return tuple(out)


class DecoderModel:
    """Subclasses call make_cache() once their weights are loaded, and implement forward_pass (the math, over a
    Batch) and layer_rope.

    A full context shifts (context_shift=True, the default): the first n_keep positions stay, the oldest half of
    the rest is dropped (llama.cpp's context shift), so generation and long prompts go on past n_ctx."""

    # Checked before each batch (api.Model.cancel sets it): True raises Cancelled with the cache holding exactly
    # the batches already run, so a long prompt can be cancelled without leaving a half-written batch behind.
    should_stop = None
    SUPPORTS_MULTI = True  # forward_multi: several sequences per step, each in its own KVCache
    # A forward of up to BOUND_MAX_ROWS one-row groups runs its layers' products and norms as callables bound once
    # to its buffers (decode_steps), not through each op's checks and kernel choice; the profiler turns this off to
    # time each op.
    bound_decode = True

    def __init__(self, config, n_ctx: int, n_threads: int, n_batch: int, kv_type=None):
        self.config = config
        self.n_ctx = int(n_ctx)
        self.n_threads = max(1, int(n_threads))
        self.n_batch = int(n_batch)
        self.n_vocab = config.n_vocab
        self.kv_type = kv_type
        self.n_keep = DEFAULT_N_KEEP
        self.context_shift = True
        self._all_positions = np.arange(self.n_ctx, dtype=np.int32)
        self._last_logits = np.zeros((1, self.n_vocab), dtype=np.float32)  # [1, n_vocab], reused every call
        self._multi_logits = None  # [n_batch, n_vocab] for forward_multi, made on first use
        self._decode_steps = {}  # (rows, sizes) -> (buffers, per-layer callables) of decode_steps

    @staticmethod
    def tensor_specs(config) -> list:
        """Every tensor the architecture reads (loading.matrix / loading.vector), checked before any is used."""
        raise NotImplementedError

    def load_weights(self, gguf_file, specs) -> dict:
        """Check and load the tensors of specs (loading.TensorSpec). Sets token_embd, output_norm, output (token_embd
        when the file has no output.weight: tied) and layers: each layer's tensors as attributes named like GGUF
        (blk.3.attn_q.weight -> .attn_q), projections that share an input grouped (linear.group_projections),
        absent q/k/v biases and QK norms as size-0 arrays. Returns name -> tensor for the architecture's others."""
        w = load_tensors(gguf_file, specs)
        self.row_kind_bits = row_kind_bits(w.values())
        self.token_embd = w["token_embd.weight"]
        self.output_norm = w["output_norm.weight"]
        self.output = w["output.weight"] if w.get("output.weight") is not None else self.token_embd
        self.layers = [layer_weights(w, il) for il in range(self.config.n_layer)]
        for il, layer in enumerate(self.layers):
            group_projections(layer)
            fill_absent_qkv_steps(layer, il)
        return w

    def make_cache(self) -> KVCache:
        """The model's own KV cache, each layer sized by its attention window (config.layer_windows())."""
        self.cache = KVCache(self.n_ctx, self.config.n_head_kv, self.config.head_dim, self.config.layer_windows(),
                             self.n_batch, self.kv_type)
        return self.cache

    _attn_scratch = None
    _attn_scratch_capacity = -1  # the largest cache capacity _attn_scratch serves

    def attn_scratch(self, kv) -> np.ndarray:
        """Attention's per-thread scratch, big enough for layer cache kv; allocated once, at the first forward
        (this runs once per layer and token: the common case is one comparison)."""
        capacity = kv.slot_pos.shape[0]
        if capacity <= self._attn_scratch_capacity:
            return self._attn_scratch
        widest = max(max(layer.slot_pos.shape[0] for layer in self.cache.layers), capacity)
        self._attn_scratch = ops.attention_scratch(widest, self.config.head_dim)
        self._attn_scratch_capacity = widest
        return self._attn_scratch

    def layer_rope(self, il: int):
        """(inv_freq, neox) of layer il's rotary embedding: what a context shift re-rotates keys with."""
        raise NotImplementedError

    @property
    def n_past(self) -> int:
        return self.cache.n_past

    def reset(self) -> None:
        self.cache.reset()

    @on_engine_thread
    def forward(self, tokens, all_logits: bool = False, cache=None) -> np.ndarray:
        """Append tokens to the cache and return logits: [T, n_vocab] if all_logits else [1, n_vocab] for the last.
        The [1, n_vocab] array is reused by the next call: copy it to keep it. cache: another KVCache of this
        model's layout to append to (a batch's sequence), instead of self.cache."""
        cache = self.cache if cache is None else cache
        other_cache = cache is not self.cache  # then forward_batch gets it as the one group of rows
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        n_tokens = tokens.shape[0]
        if n_tokens == 0:
            raise ModelError("forward() needs at least one token")
        self._check_ids(tokens)
        n_ctx = cache.n_ctx
        step = self.prompt_step(cache, cache.n_past + n_tokens)
        if not self.context_shift:
            if cache.n_past + n_tokens > n_ctx:
                raise ModelError(f"context full: {cache.n_past} cached + {n_tokens} new tokens > n_ctx "
                                 f"{n_ctx} (context_shift is off)")
        numba.set_num_threads(min(self.n_threads, numba.config.NUMBA_NUM_THREADS))
        result = np.empty((n_tokens, self.n_vocab), dtype=np.float32) if all_logits else self._last_logits
        for begin in range(0, n_tokens, step):
            if self.should_stop is not None and self.should_stop():
                raise Cancelled(f"cancelled after {begin} of {n_tokens} tokens")
            end = min(begin + step, n_tokens)
            if all_logits:
                logits_out = result[begin:end]
            else:
                logits_out = self._last_logits if end == n_tokens else None
            start_pos = cache.n_past
            if start_pos + end - begin > n_ctx:
                self._shift_context(cache, start_pos + end - begin - n_ctx)
                start_pos = cache.n_past
            positions = self._all_positions[start_pos: start_pos + end - begin]
            if other_cache:
                self.forward_batch(tokens[begin:end], positions, logits_out, groups=((0, end - begin, cache),))
            else:  # (the CUDA models' forward_batch takes no groups)
                self.forward_batch(tokens[begin:end], positions, logits_out)
            cache.n_past = start_pos + end - begin
        return result

    @on_engine_thread
    def forward_embeddings(self, tokens, cache) -> np.ndarray:
        """Append one batch of at most n_batch tokens to `cache` (a KVCache of this model's layout, not self.cache)
        and return every row's output-normed hidden state [T, n_embd]: what llama.cpp's embeddings read (its
        result_norm), no logits computed. The caller splits a longer input into n_batch batches, as forward()
        would (edgellm/generation/embeddings.py)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        n_tokens = tokens.shape[0]
        if not 0 < n_tokens <= self.n_batch:
            raise ModelError(f"forward_embeddings() takes 1 to n_batch ({self.n_batch}) tokens, got {n_tokens}")
        self._check_ids(tokens)
        start = cache.n_past
        if start + n_tokens > cache.n_ctx:
            raise ModelError(f"{start} cached + {n_tokens} new tokens do not fit in the cache's {cache.n_ctx}")
        if self.should_stop is not None and self.should_stop():
            raise Cancelled(f"cancelled after {start} tokens")
        numba.set_num_threads(min(self.n_threads, numba.config.NUMBA_NUM_THREADS))
        out = np.empty((n_tokens, self.config.n_embd), dtype=np.float32)
        self.forward_pass(Batch(tokens, self._all_positions[start:start + n_tokens], None, ((0, n_tokens, cache),),
                                self.config.head_dim, embed_out=out))
        cache.n_past = start + n_tokens
        return out

    @on_engine_thread
    def forward_verify(self, tokens) -> np.ndarray:
        """Append tokens to self.cache and return logits [T, n_vocab] for every row, each row computed with the
        arithmetic of a one-token decode step (its own group of one row: decode matmul kernels, decode attention
        order), so row i equals what forward() of tokens[i] alone after tokens[:i] gives, bit for bit, while the
        weights are read once for all rows. Speculative decoding verifies drafts with it and truncate()s the rest.
        Needs the rows to fit without a context shift and T <= n_batch (a window ring holds one batch beyond
        its window, so rolled-back rows never overwrite a position a later query needs)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        n, cache = tokens.shape[0], self.cache
        if not 0 < n <= self.n_batch or cache.n_past + n > cache.n_ctx:
            raise ModelError(f"forward_verify needs 1 to n_batch ({self.n_batch}) tokens that fit the context: "
                             f"{n} tokens after {cache.n_past} of {cache.n_ctx}")
        self._check_ids(tokens)
        numba.set_num_threads(min(self.n_threads, numba.config.NUMBA_NUM_THREADS))
        logits = np.empty((n, self.n_vocab), np.float32)
        start = cache.n_past
        groups = tuple((i, i + 1, cache) for i in range(n)) if n > 1 else None
        self.forward_batch(tokens, self._all_positions[start:start + n], logits, groups=groups)
        cache.n_past = start + n
        return logits

    @on_engine_thread
    def forward_verify_multi(self, token_lists, caches) -> np.ndarray:
        """forward_multi where sequence i feeds token_lists[i] (its next token, then any drafted ones) onto caches[i]:
        every row is its own group of one, in decode order, so each row's logits equal a decode step's bit for bit
        (forward_verify for several sequences, the weights read once for all). Returns [sum of lengths, n_vocab],
        sequence after sequence. A sequence of several rows must fit without a context shift; one of one row
        shifts as forward_multi's do. At most n_batch rows in all."""
        counts = [len(t) for t in token_lists]
        n = sum(counts)
        if not self.SUPPORTS_MULTI or len(caches) != len(counts) or not 0 < n <= self.n_batch or min(counts) < 1 \
                or len({id(c) for c in caches}) != len(caches):
            raise ModelError(f"forward_verify_multi needs 1 to n_batch ({self.n_batch}) rows, at least one per "
                             f"distinct cache; got {counts} rows for {len(caches)} caches")
        tokens = np.ascontiguousarray(np.concatenate([np.asarray(t).reshape(-1) for t in token_lists]), np.int32)
        self._check_ids(tokens)
        positions, groups, row = np.empty(n, np.int32), [], 0
        for k, cache in zip(counts, caches):
            if cache.n_past + k > cache.n_ctx:
                if k > 1 or not self.context_shift:
                    raise ModelError(f"{k} rows do not fit after {cache.n_past} of {cache.n_ctx} cached positions")
                self._shift_context(cache, 1)
            positions[row:row + k] = np.arange(cache.n_past, cache.n_past + k)
            groups += [(row + i, row + i + 1, cache) for i in range(k)]
            row += k
        logits = np.empty((n, self.n_vocab), np.float32)
        numba.set_num_threads(min(self.n_threads, numba.config.NUMBA_NUM_THREADS))
        self.forward_batch(tokens, positions, logits, groups=tuple(groups))
        for k, cache in zip(counts, caches):
            cache.n_past += k
        return logits

    def truncate(self, n_past: int) -> None:
        """Forget the cached positions from n_past on (rejected draft rows); nothing is copied."""
        self.cache.truncate(n_past)

    def prompt_step(self, cache=None, n_total=None) -> int:
        """The tokens per batch forward() splits a prompt into, when the cache will hold n_total positions after it
        (None: any number). A prompt that fits the context never shifts, so it goes in n_batch batches as in
        llama.cpp: the batch a row lands in picks its kernels (row_kinds), and so its bits."""
        cache = self.cache if cache is None else cache
        if self.context_shift and (n_total is None or n_total > cache.n_ctx):
            # a batch must fit beside the kept positions once the context has shifted
            return max(1, min(self.n_batch, cache.n_ctx - self._n_keep(cache)))
        return self.n_batch

    row_kind_bits = prefix.ALL_KIND_BITS  # narrowed to the loaded matrices' kernels by load_weights

    def row_kinds(self, offsets: np.ndarray, n: int) -> np.ndarray:
        """How forward_batch computes the rows at these offsets of a batch of n rows, as a code: rows of equal code,
        token and earlier keys give equal bits (prefix.row_kinds, with the bits this model's kernels use)."""
        return prefix.row_kinds(offsets, n, self.row_kind_bits)

    def profile_step(self, tokens, n_steps: int = 1) -> dict:
        """forward(tokens) n_steps times, timed per operation and layer: {(op, layer): seconds per step}
        (edgellm.engine.profiler)."""
        return profiler.profile_step(self, tokens, n_steps)

    def _n_keep(self, cache) -> int:
        """The attention sinks a shift of this cache keeps: n_keep, at most half its context."""
        return min(max(0, int(self.n_keep)), cache.n_ctx // 2)

    def _shift_context(self, cache, needed: int) -> None:
        """Drop at least `needed` positions after the first n_keep: half of those after n_keep, as llama.cpp."""
        n_keep, n_past = self._n_keep(cache), cache.n_past
        n_discard = min(max(needed, (n_past - n_keep) // 2), n_past - n_keep)
        cache.shift(n_keep, n_discard, self.layer_rope)

    @on_engine_thread
    def forward_batch(self, tokens, positions, logits_out, groups=None, logit_rows=None):
        """tokens, positions: [T]; logits_out: [T, n_vocab], [1, n_vocab] (last token only), [len(logit_rows),
        n_vocab] or None. groups: ((row_begin, row_end, KVCache), ...) when rows belong to different sequences
        (batched decoding); None: all rows are one sequence in self.cache. logit_rows: the rows logits_out gets (each
        as a one-row batch's), instead of the last ones."""
        groups = groups or ((0, len(tokens), self.cache),)
        self.forward_pass(Batch(tokens, positions, logits_out, groups, self.config.head_dim, logit_rows))

    def forward_pass(self, b: Batch) -> None:
        """The architecture's math over one batch: embed b.tokens, run the layers (attend() between the q/k/v
        projections and W_o), then logits_head() fills b.logits_out."""
        raise NotImplementedError

    def decode_steps(self, s, b: Batch, bind_layer):
        """The layers' callables for a batch b of one-row groups (a decode step, a verified draft, several sequences),
        bind_layer(il, layer, s, scratch, b.sizes) for each, bound to the buffers s (self.buffers' view of b's rows)
        and kept while s stays the same; None for other batches (a prompt's chunk) and while bound_decode is off."""
        n = b.n_tokens
        if not self.bound_decode or n > BOUND_MAX_ROWS or (n > 1 and b.sizes != (1,) * n):
            return None
        key = (n, b.sizes)
        kept = self._decode_steps.get(key)
        if kept is None or kept[0] is not s:
            scratch = StepScratch()
            kept = self._decode_steps[key] = (s, tuple(bind_layer(il, layer, s, scratch, b.sizes)
                                                       for il, layer in enumerate(self.layers)))
        return kept[1]

    def unbind_steps(self) -> None:
        """Forget the kept decode_steps: a layer's weights or buffers replaced after a forward are bound at the next
        one (the kept callables hold the objects they were bound to)."""
        self._decode_steps = {}

    def bound_attention(self, il: int, layer, s, cos, sin):
        """attend()'s work for one token of self.cache at layer il, as a callable of the step's positions bound to the
        buffers s and the rope rows cos, sin (ops.bound_decode_attention); None for buffers of several rows, where a
        subclass attends its own way or where the cache takes other kernels."""
        if type(self).attend is not DecoderModel.attend or s.n_tokens != 1:
            return None
        cfg, kv = self.config, self.cache.layers[il]
        return ops.bound_decode_attention(s.q_heads, s.k_heads, s.v_heads, layer.attn_q_bias, layer.attn_k_bias,
                                          layer.attn_v_bias, layer.attn_q_norm, layer.attn_k_norm, cfg.norm_eps, cos,
                                          sin, cfg.rope_neox, kv, s.attn_heads, self.attn_scratch(kv), cfg.q_scale,
                                          cfg.attn_scale)

    def attend_step(self, attend, il: int, layer, s, b: Batch, rope: RopeRows) -> None:
        """Layer il's attention in a forward with decode_steps: the bound one-token attention `attend` where there is
        one and the row is self.cache's, else attend()."""
        if attend is not None and b.groups[0][2] is self.cache:
            attend(b.positions)
        else:
            self.attend(il, layer, s, b, rope)

    def logits_head(self, s, b: Batch) -> None:
        """b.logits_out <- output · rmsnorm(last rows of s.x) · output_norm (nothing when it is None). A non-finite
        hidden state (corrupt weights, e.g. huge scales) makes those rows NaN: the int8 activation quantization of
        the output matmul would otherwise turn it into finite garbage that the API's NaN check cannot see."""
        if b.embed_out is not None:  # embeddings: the normed rows themselves, and no output matmul
            ops.rms_norm(s.x[:b.n_tokens], self.output_norm, self.config.norm_eps, b.embed_out)
            return
        logits_out = b.logits_out
        if logits_out is None:
            return
        sizes = b.sizes
        if b.logit_rows is not None:
            rows, sizes = s.x[b.logit_rows], (1,) * len(b.logit_rows)
        else:
            rows = s.x[b.n_tokens - logits_out.shape[0]:]
        normed = s.xn[: rows.shape[0]]
        ops.rms_norm(rows, self.output_norm, self.config.norm_eps, normed)
        self.output.matmul(normed, logits_out, sizes)
        if not np.isfinite(normed).all():
            logits_out[~np.isfinite(normed).all(axis=1)] = np.nan

    def attend(self, il: int, layer, s, b: Batch, rope: RopeRows) -> None:
        """Layer il's steps between the q/k/v projections (s.q_heads, s.k_heads, s.v_heads) and W_o: the layer's
        q/k/v biases and QK norms where it has them (size-0 arrays skip a step), rope, q_scale, the cache store
        (ops.finish_qkv), then attention into s.attn_heads, each sequence's rows against its own cache."""
        cfg = self.config
        qkv = (s.q_heads, s.k_heads, s.v_heads)
        bias_norm = (layer.attn_q_bias, layer.attn_k_bias, layer.attn_v_bias, layer.attn_q_norm, layer.attn_k_norm,
                     cfg.norm_eps)
        if b.pool is not None:  # the first rows each one sequence of one KVPool: one call for all of them
            stacked, n = b.pool.stacked[il], b.n_pool
            q, k, v, pos = (a[:n] for a in (*qkv, b.positions))
            ops.finish_attention_rows(q, k, v, *bias_norm, rope.cos, rope.sin, rope.neox, pos, b.seqs, stacked,
                                      s.attn_heads[:n], self.attn_scratch(b.groups[0][2].layers[il]), cfg.q_scale,
                                      cfg.attn_scale)
        for b0, b1, cache, run in b.runs:
            kv = cache.layers[il]
            if b0 == 0 and b1 == b.n_tokens:
                q, k, v, cos, sin, pos, out = *qkv, rope.cos, rope.sin, b.positions, s.attn_heads
            else:
                q, k, v, cos, sin, pos, out = (a[b0:b1] for a in (*qkv, rope.cos, rope.sin, b.positions,
                                                                  s.attn_heads))
            if run:
                ops.finish_attention_run(q, k, v, *bias_norm, cos, sin, rope.neox, pos, kv, out, self.attn_scratch(kv),
                                         cfg.q_scale, cfg.attn_scale)
                continue
            ops.finish_qkv(q, k, v, *bias_norm, cos, sin, rope.neox, pos, kv.k, kv.v, kv.slot_pos, kv.k_scale,
                           kv.v_scale, cfg.q_scale)
            ops.attention(q, kv.k, kv.v, kv.slot_pos, pos, kv.window, cfg.attn_scale, out, self.attn_scratch(kv),
                          kv.k_scale, kv.v_scale)

    @on_engine_thread
    def forward_multi(self, tokens, caches) -> np.ndarray:
        """One decode step for len(tokens) sequences, token i appended to caches[i] (KVCaches of this model's
        layout): the weights are read once for all of them. Returns logits [B, n_vocab] (reused by the next call).
        Each row equals what forward() of that token alone on that cache gives, bit for bit."""
        if not self.SUPPORTS_MULTI:
            raise ModelError(f"{type(self).__name__} cannot decode several sequences at once")
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        n = tokens.shape[0]
        if n == 0 or n != len(caches) or n > self.n_batch:
            raise ModelError(f"forward_multi needs 1 to n_batch ({self.n_batch}) tokens, one per cache; got "
                             f"{n} tokens for {len(caches)} caches")
        self._check_ids(tokens)
        if len({id(c) for c in caches}) != n:
            raise ModelError("forward_multi needs a distinct cache per sequence")
        positions = np.empty(n, np.int32)
        self._next_positions(caches, positions)
        logits = self._multi_rows(n)
        numba.set_num_threads(min(self.n_threads, numba.config.NUMBA_NUM_THREADS))
        self.forward_batch(tokens, positions, logits, groups=tuple((i, i + 1, c) for i, c in enumerate(caches)))
        for cache in caches:
            cache.n_past += 1
        return logits

    def _check_ids(self, tokens) -> None:
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ModelError(f"token id {int(tokens[(tokens < 0) | (tokens >= self.n_vocab)][0])} is outside the "
                             f"vocabulary [0, {self.n_vocab})")

    def _next_positions(self, caches, positions) -> None:
        """positions[i] <- the position of caches[i]'s next token, each full cache shifted first (or refused)."""
        for i, cache in enumerate(caches):
            if cache.n_past + 1 > cache.n_ctx:
                if not self.context_shift:
                    raise ModelError(f"context full for sequence {i}: {cache.n_past} cached, n_ctx {cache.n_ctx}")
                self._shift_context(cache, 1)
            positions[i] = cache.n_past

    def _multi_rows(self, n: int) -> np.ndarray:
        """[n, n_vocab] of the logits buffer the batched forwards reuse."""
        if self._multi_logits is None or self._multi_logits.shape[0] < n:
            self._multi_logits = np.empty((self.n_batch, self.n_vocab), np.float32)
        return self._multi_logits[:n]

    @on_engine_thread
    def forward_mixed(self, tokens, caches, chunk, chunk_cache) -> np.ndarray:
        """forward_multi's decode step for len(tokens) sequences and, in the same forward, a prompt chunk appended to
        chunk_cache (another cache of the same pool): the weights are read once for both, so a prompt is prefilled
        without holding the running sequences for a forward of its own. The chunk's rows get the arithmetic of the
        chunk run alone (its own group: the matmuls' sizes, its own attention), the decode rows a decode step's.
        Returns logits [len(tokens) + 1, n_vocab]: the decode rows', then the chunk's last row's (reused by the next
        call). The chunk must fit without a context shift, and all the rows in n_batch."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        chunk = np.ascontiguousarray(chunk, dtype=np.int32).reshape(-1)
        n, m = tokens.shape[0], chunk.shape[0]
        if not self.SUPPORTS_MULTI or n == 0 or m == 0 or n != len(caches) or n + m > self.n_batch \
                or len({id(c) for c in (*caches, chunk_cache)}) != n + 1:
            raise ModelError(f"forward_mixed needs 1 to n_batch ({self.n_batch}) rows in all, one token per distinct "
                             f"cache and a chunk on another; got {n} tokens for {len(caches)} caches and a chunk "
                             f"of {m}")
        if chunk_cache.n_past + m > chunk_cache.n_ctx:
            raise ModelError(f"a chunk of {m} tokens does not fit after {chunk_cache.n_past} of {chunk_cache.n_ctx} "
                             "cached positions")
        both = np.concatenate([tokens, chunk])
        self._check_ids(both)
        positions = np.empty(n + m, np.int32)
        self._next_positions(caches, positions)
        positions[n:] = self._all_positions[chunk_cache.n_past:chunk_cache.n_past + m]
        logits = self._multi_rows(n + 1)
        groups = tuple((i, i + 1, c) for i, c in enumerate(caches)) + ((n, n + m, chunk_cache),)
        numba.set_num_threads(min(self.n_threads, numba.config.NUMBA_NUM_THREADS))
        self.forward_batch(both, positions, logits, groups=groups, logit_rows=np.append(np.arange(n), n + m - 1))
        for cache in caches:
            cache.n_past += 1
        chunk_cache.n_past += m
        return logits

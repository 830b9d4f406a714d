"""What every decoder-only model shares: token validation, splitting a long input into batches, the KV cache
position, logits buffers and thread count. Each architecture writes only forward_batch, the math."""

import numba
from edgellm.quant import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
import numpy as np

from edgellm.engine import ops, profiler
from edgellm.errors import Cancelled, ModelError
from edgellm.engine.kvcache import KVCache

# Tokens per batch: bounds the activation buffers and the sliding-window rings (llama.cpp's default ubatch).
DEFAULT_N_BATCH = 512
# Attention sinks: positions a full context keeps when it shifts (StreamingLLM's 4; llama.cpp's --keep).
DEFAULT_N_KEEP = 4


class TokenBuffers:
    """Scratch activations for up to n_tokens tokens. Every array attribute has the token axis first;
    for_tokens(T) returns the same buffers cut to T rows (views, nothing copied)."""

    def __init__(self, n_tokens: int):
        self.n_tokens = n_tokens
        self._decode_view = None

    def for_tokens(self, n: int):
        if n == self.n_tokens:
            return self
        if n == 1 and self._decode_view is not None:
            return self._decode_view
        view = object.__new__(type(self))
        for name, value in vars(self).items():
            setattr(view, name, value[:n] if isinstance(value, np.ndarray) else value)
        view.n_tokens = n
        if n == 1:
            self._decode_view = view
        return view


class DecoderModel:
    """Subclasses call make_cache(windows), implement forward_batch and layer_rope.

    A full context shifts (context_shift=True, the default): the first n_keep positions stay, the oldest half of
    the rest is dropped (llama.cpp's context shift), so generation and long prompts go on past n_ctx."""

    # Checked before each batch (api.Model.cancel sets it): True raises Cancelled with the cache holding exactly
    # the batches already run, so a long prompt can be cancelled without leaving a half-written batch behind.
    should_stop = None
    SUPPORTS_MULTI = True  # forward_multi: several sequences per step, each in its own KVCache

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

    def make_cache(self, windows) -> KVCache:
        self.cache = KVCache(self.n_ctx, self.config.n_head_kv, self.config.head_dim, windows, self.n_batch,
                             self.kv_type)
        return self.cache

    _attn_scratch = None
    _attn_scratch_capacity = -1  # the largest cache capacity _attn_scratch serves
    _pool_rows = None  # (KVPool, int32 sequence index per row) while forward_multi runs over one pool's caches

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
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            bad = tokens[(tokens < 0) | (tokens >= self.n_vocab)][0]
            raise ModelError(f"token id {bad} is outside the vocabulary [0, {self.n_vocab})")
        n_ctx = cache.n_ctx
        step = self.prompt_step(cache)
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

    def prompt_step(self, cache=None) -> int:
        """The tokens per batch forward() splits a prompt into."""
        cache = self.cache if cache is None else cache
        if self.context_shift:  # a batch must fit beside the kept positions once the context has shifted
            return max(1, min(self.n_batch, cache.n_ctx - self._n_keep(cache)))
        return self.n_batch

    @staticmethod
    def row_kinds(offsets: np.ndarray, n: int) -> np.ndarray:
        """How forward_batch computes the rows at these offsets of a batch of n rows, as a code: rows of equal code,
        token and earlier keys give equal bits. Bit 0: attention's several-row order (one row: the decode order);
        bit 1: Q4_K's four-token gemm (all but the batch's last n % 4 rows); bit 2: Q6_K's tiled kernel (n >= 8).
        Every other kernel computes a row the same whatever its batch (quant.linear, edgellm.engine.ops)."""
        offsets = np.asarray(offsets, np.int64)
        return ((n > 1) | ((offsets < n - n % 4) << 1) | ((n >= 8) << 2)).astype(np.int64)

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

    def forward_batch(self, tokens, positions, logits_out, groups=None):
        """tokens, positions: [T]; logits_out: [T, n_vocab], [1, n_vocab] (last token only) or None.
        groups: ((row_begin, row_end, KVCache), ...) when rows belong to different sequences (batched decoding);
        None: all rows are one sequence in self.cache."""
        raise NotImplementedError

    def logits_head(self, s, T, logits_out, sizes=None):
        """logits_out <- output · rmsnorm(last rows of s.x) · output_norm. A non-finite hidden state (corrupt
        weights, e.g. huge scales) makes those rows NaN: the int8 activation quantization of the output matmul
        would otherwise turn it into finite garbage that the API's NaN check cannot see."""
        rows = s.x[T - logits_out.shape[0]:]
        normed = s.xn[: rows.shape[0]]
        ops.rms_norm(rows, self.output_norm, self.config.norm_eps, normed)
        self.output.matmul(normed, logits_out, sizes)
        if not np.isfinite(normed).all():
            logits_out[~np.isfinite(normed).all(axis=1)] = np.nan

    def attend(self, il, s, positions, cos, sin, neox, biases, norms, groups):
        """Layer il's steps between the q/k/v projections and W_o, for each group of rows in its own cache:
        biases, QK norms, rope, the cache store (ops.finish_qkv), then attention into s.attn_heads."""
        eps, scale, q_scale = self.config.norm_eps, self.config.attn_scale, self.config.q_scale
        rows = self._pool_rows
        if rows is not None and len(groups) == len(positions) > 1:  # forward_multi over one KVPool's caches
            pool, seqs = rows
            stacked = pool.stacked[il]
            if ops.attention_rows_supported(stacked, self.config.head_dim):
                ops.finish_qkv_rows(s.q_heads, s.k_heads, s.v_heads, *biases, *norms, eps, cos, sin, neox, positions,
                                    seqs, stacked, q_scale)
                ops.attention_rows(s.q_heads, stacked, seqs, positions, scale, s.attn_heads,
                                   self.attn_scratch(groups[0][2].layers[il]))
                return
        for b0, b1, cache in groups:
            kv = cache.layers[il]
            if b0 == 0 and b1 == len(positions):
                q, k, v, c, sn, pos, out = s.q_heads, s.k_heads, s.v_heads, cos, sin, positions, s.attn_heads
            else:
                q, k, v, c, sn, pos, out = (a[b0:b1] for a in (s.q_heads, s.k_heads, s.v_heads, cos, sin,
                                                               positions, s.attn_heads))
            ops.finish_qkv(q, k, v, *biases, *norms, eps, c, sn, neox, pos, kv.k, kv.v, kv.slot_pos, kv.k_scale,
                           kv.v_scale, q_scale)
            ops.attention(q, kv.k, kv.v, kv.slot_pos, pos, kv.window, scale, out, self.attn_scratch(kv), kv.k_scale,
                          kv.v_scale)

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
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ModelError(f"token id {int(tokens[(tokens < 0) | (tokens >= self.n_vocab)][0])} is outside the "
                             f"vocabulary [0, {self.n_vocab})")
        if len({id(c) for c in caches}) != n:
            raise ModelError("forward_multi needs a distinct cache per sequence")
        positions = np.empty(n, np.int32)
        for i, cache in enumerate(caches):
            if cache.n_past + 1 > cache.n_ctx:
                if not self.context_shift:
                    raise ModelError(f"context full for sequence {i}: {cache.n_past} cached, n_ctx {cache.n_ctx}")
                self._shift_context(cache, 1)
            positions[i] = cache.n_past
        if self._multi_logits is None or self._multi_logits.shape[0] < n:
            self._multi_logits = np.empty((self.n_batch, self.n_vocab), np.float32)
        logits = self._multi_logits[:n]
        numba.set_num_threads(min(self.n_threads, numba.config.NUMBA_NUM_THREADS))
        pool = caches[0].pool
        if pool is not None and all(c.pool is pool for c in caches):  # one kernel call per layer for them all
            self._pool_rows = (pool, np.array([c.pool_index for c in caches], np.int32))
        try:
            self.forward_batch(tokens, positions, logits, groups=tuple((i, i + 1, c) for i, c in enumerate(caches)))
        finally:
            self._pool_rows = None
        for cache in caches:
            cache.n_past += 1
        return logits

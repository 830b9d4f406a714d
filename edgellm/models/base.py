"""What every decoder-only model shares: token validation, splitting a long input into batches, the KV cache
position, logits buffers and thread count. Each architecture writes only forward_batch, the math."""

import numba
from quant import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
import numpy as np

from edgellm.errors import ModelError

# Tokens per batch: bounds the activation buffers and the sliding-window rings (llama.cpp's default ubatch).
DEFAULT_N_BATCH = 512


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
    """Subclasses set self.config, self.cache (KVCache) and implement forward_batch."""

    def __init__(self, config, n_ctx: int, n_threads: int, n_batch: int):
        self.config = config
        self.n_ctx = int(n_ctx)
        self.n_threads = max(1, int(n_threads))
        self.n_batch = int(n_batch)
        self.n_vocab = config.n_vocab
        self._all_positions = np.arange(self.n_ctx, dtype=np.int32)
        self._last_logits = np.zeros((1, self.n_vocab), dtype=np.float32)  # [1, n_vocab], reused every call

    @property
    def n_past(self) -> int:
        return self.cache.n_past

    def reset(self) -> None:
        self.cache.reset()

    def forward(self, tokens, all_logits: bool = False) -> np.ndarray:
        """Append tokens to the cache and return logits: [T, n_vocab] if all_logits else [1, n_vocab] for the last.
        The [1, n_vocab] array is reused by the next call: copy it to keep it."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        n_tokens = tokens.shape[0]
        if n_tokens == 0:
            raise ModelError("forward() needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            bad = tokens[(tokens < 0) | (tokens >= self.n_vocab)][0]
            raise ModelError(f"token id {bad} is outside the vocabulary [0, {self.n_vocab})")
        start_pos = self.cache.n_past
        if start_pos + n_tokens > self.n_ctx:
            raise ModelError(f"context full: {start_pos} cached + {n_tokens} new tokens > n_ctx {self.n_ctx}")
        numba.set_num_threads(min(self.n_threads, numba.config.NUMBA_NUM_THREADS))
        result = np.empty((n_tokens, self.n_vocab), dtype=np.float32) if all_logits else self._last_logits
        for begin in range(0, n_tokens, self.n_batch):
            end = min(begin + self.n_batch, n_tokens)
            if all_logits:
                logits_out = result[begin:end]
            else:
                logits_out = self._last_logits if end == n_tokens else None
            positions = self._all_positions[start_pos + begin: start_pos + end]
            self.forward_batch(tokens[begin:end], positions, logits_out)
            self.cache.n_past = start_pos + end
        return result

    def forward_batch(self, tokens, positions, logits_out):
        """tokens, positions: [T]; logits_out: [T, n_vocab], [1, n_vocab] (last token only) or None."""
        raise NotImplementedError

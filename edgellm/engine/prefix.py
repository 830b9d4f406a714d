"""Which cached rows a new prompt may reuse so that its logits equal a fresh run's bit for bit.

A fresh run splits a prompt of N tokens into batches of `step` tokens: [0, step), [step, 2 step), ... The kernels'
arithmetic for a row depends on its batch (DecoderModel.row_kinds): one token decodes with other kernels than a
batch, Q4_K rows run the four-token gemm except a batch's last len % 4, Q6_K rows the tiled kernel from eight tokens
on. Every cached row carries the kind it was computed with. A prefix [0, c) is reused only where each of its rows has
the kind the fresh run would give it, and the rest is run so that each of its rows gets its fresh kind too: the part
of c's fresh batch from c on, then the fresh batches. Then, row by row, every input of the arithmetic is the fresh
run's (the same token, kind and keys of earlier positions), so every output is.
"""
from __future__ import annotations

import numpy as np

TAINTED = -1  # a row no fresh run computes so (its keys re-rotated by a context shift; a state without kinds)

# The bits of a row's kind, each a kernel whose arithmetic depends on the row's batch.
SEVERAL_ROWS = 1  # attention's several-row order (one row: the decode order); float matrices' tinyBLAS pairs likewise
GEMM4_ROWS = 2    # Q4_K's four-token gemm: all but the batch's last n % 4 rows
TILED8_ROWS = 4   # Q6_K's (IQ4_XS's) tiled kernel: batches of at least 8 rows
ALL_KIND_BITS = SEVERAL_ROWS | GEMM4_ROWS | TILED8_ROWS


def row_kinds(offsets, n: int, bits: int = ALL_KIND_BITS) -> np.ndarray:
    """The kinds of the rows at these offsets of a batch of n rows, keeping only `bits` (those the model's kernels
    make a difference to): rows of equal kind, token and earlier keys give equal bits. Every other kernel computes a
    row the same whatever its batch (quant.linear, edgellm.engine.ops)."""
    offsets = np.asarray(offsets, np.int64)
    kinds = (n > 1) | ((offsets < n - n % 4) << 1) | ((n >= 8) << 2)
    return (kinds & bits).astype(np.int64)


def narrowed(kinds, bits: int) -> list:
    """Recorded kinds (a saved state's or a cache file's, perhaps from before a model's kinds kept only its own
    kernels' bits) as this model tells them apart: a bit it drops separated kernels it never runs, so the rows it
    told apart compute alike here. TAINTED stays."""
    return [k if k < 0 else k & bits for k in kinds]


def fresh_batches(n_tokens: int, step: int) -> list[tuple[int, int]]:
    return [(b, min(b + step, n_tokens)) for b in range(0, n_tokens, step)]


def kinds_of(batches, row_kinds) -> np.ndarray:
    """The kind of every row of these consecutive batches."""
    parts = [row_kinds(np.arange(b1 - b0), b1 - b0) for b0, b1 in batches]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def plan(cached_tokens, cached_kinds, ids, step: int, row_kinds):
    """(c, batches): reuse the cache's first c rows and run these batches of ids after them. c <= len(ids) - 1."""
    n = len(ids)
    batches = fresh_batches(n, step)
    fresh = kinds_of(batches, row_kinds)
    m = min(len(cached_tokens), n - 1)
    if m <= 0:
        return 0, batches
    same = (np.asarray(cached_tokens[:m]) == np.asarray(ids[:m])) & (np.asarray(cached_kinds[:m]) == fresh[:m])
    c = m if same.all() else int(np.argmin(same))
    while c > 0:
        b0 = c - c % step
        b1 = min(b0 + step, n)
        if c == b0 or np.array_equal(row_kinds(np.arange(b1 - c), b1 - c), fresh[c:b1]):
            return c, [(c, b1)] + [b for b in batches if b[0] >= b1]
        c -= 1
    return 0, batches


def next_query_sees(layers, n: int) -> bool:
    """Whether every position a query at n attends to, n - window < p < n (all of [0, n) without a window), is still
    in its slot of each layer's ring."""
    for layer in layers:
        first = max(0, n - layer.window + 1) if layer.window else 0
        needed = np.arange(first, n, dtype=np.int64)
        if needed.size and not np.array_equal(layer.slot_pos[needed % layer.slot_pos.shape[0]], needed):
            return False
    return True


def rewind(cache, n: int) -> bool:
    """Make a KVCache hold positions [0, n) only; False when that is impossible (a window ring already overwrote
    positions the next token must see), in which case the caller starts from an empty cache."""
    layers = getattr(cache, "layers", None)
    if layers is None or n > cache.n_past or not next_query_sees(layers, n):
        return False
    for layer in layers:
        layer.slot_pos[layer.slot_pos >= n] = -1  # kvcache.EMPTY_SLOT
    cache.n_past = n
    return True

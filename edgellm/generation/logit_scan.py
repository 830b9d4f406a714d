"""Compiled passes over a row of logits for the sampler: finiteness and argmax in one pass, top-k in two.

A 262,144-token row is 1 MB, and numpy's isfinite-all, max, argmax and column-max top-k each read it again and
build a temporary. These read the row once as int32 order keys (the floats' order, so the max reductions vectorise
without fast-math) and return what the numpy code in edgellm.generation.sampling returns; tests/test_logit_scan.py
compares them.
"""
from __future__ import annotations

import numpy as np
from numba import njit

CHUNK = 64  # values per chunk maximum
_EXP = np.int32(0x7F800000)
_LOW = np.int32(0x7FFFFFFF)
_KEY_MIN = np.int32(-0x80000000)
_KEY_MINUS_ZERO = np.int32(-1)  # the key of -0.0, the one value below +0.0's key (0) that equals it


@njit(cache=True, nogil=True, inline="always")
def _key(b):
    """A float32's bits as an int32 that orders as the float does (-0.0 just below +0.0; NaN above +Inf)."""
    return np.int32(b ^ np.int32(np.int32(b >> np.int32(31)) & _LOW))  # int32 throughout: numba widens to int64


@njit(cache=True, nogil=True)
def _chunk_maxima(bits, keys, copy):
    """keys[c] = the largest key in chunk c, for each whole chunk and then the ragged tail (_KEY_MIN if empty);
    returns how many values are NaN or +-Inf. Writes the bits to `copy` on the way, unless it is None (a
    separate compilation: the branch is pruned)."""
    n, n_whole = bits.shape[0], bits.shape[0] // CHUNK
    bad = 0
    for c in range(n_whole):
        m, nf, base = _KEY_MIN, np.int32(0), c * CHUNK
        for j in range(CHUNK):  # a fixed trip count of int32 lanes: LLVM unrolls it into vector max and compare
            b = bits[base + j]
            m = np.int32(max(m, _key(b)))
            nf = np.int32(nf + np.int32(np.int32(b & _EXP) == _EXP))
            if copy is not None:
                copy[base + j] = b
        keys[c] = m
        bad += nf
    m = _KEY_MIN
    for i in range(n_whole * CHUNK, n):
        b = bits[i]
        m = max(m, _key(b))
        bad += (b & _EXP) == _EXP
        if copy is not None:
            copy[i] = b
    keys[n_whole] = m
    return bad


@njit(cache=True, nogil=True)
def _value_of(x, keys, key):
    """The float whose key is `key`, found in the first chunk whose maximum it is."""
    bits = x.view(np.int32)
    for c in range(keys.shape[0]):
        if keys[c] == key:
            for i in range(c * CHUNK, min(x.shape[0], c * CHUNK + CHUNK)):
                if _key(bits[i]) == key:
                    return x[i]
    return np.float32(np.nan)


@njit(cache=True, nogil=True)
def _kth_largest(keys, k):
    """The k-th largest of keys (0 < k <= keys.size), by a running set of the k largest: on a row's chunk maxima
    few replace one, which makes it cheaper than numba's np.partition there."""
    best = np.empty(k, np.int32)
    for c in range(k):
        best[c] = keys[c]
    low = _argmin(best)
    for c in range(k, keys.shape[0]):
        if keys[c] > best[low]:
            best[low] = keys[c]
            low = _argmin(best)
    return best[low]


# Loops rather than array methods (.max(), .argmin(), .copy()): a cached kernel that calls one makes Numba load its
# whole array-math registry when the kernel is loaded (quant.cache_load's light path, tests/test_warmup.py).


@njit(cache=True, nogil=True)
def _argmin(v):
    low = 0
    for i in range(1, v.shape[0]):
        if v[i] < v[low]:
            low = i
    return low


@njit(cache=True, nogil=True)
def _max(v):
    top = v[0]
    for i in range(1, v.shape[0]):
        top = max(top, v[i])
    return top


@njit(cache=True, nogil=True)
def _low_key(value, key):
    """The smallest key of a value equal to `value` (-0.0 equals +0.0): chunks below it hold no such value."""
    return _KEY_MINUS_ZERO if value == 0 else key


def readable(x) -> bool:
    """Whether these passes can read x: a 1-D C-contiguous float32 array (others take numpy's path)."""
    return x.ndim == 1 and x.dtype == np.float32 and x.flags.c_contiguous


def scan(x, copy=None):
    """(how many values of x are NaN or +-Inf, np.argmax(x), the chunk maxima top_k can reuse) for a 1-D
    C-contiguous float32 x; the index and maxima hold only when the count is zero. copy: an array like x that
    receives x's values in the same pass (a row taken out of a buffer that will be overwritten)."""
    return _scan(x, None if copy is None else copy.view(np.int32))


@njit(cache=True, nogil=True)
def _scan(x, copy):
    n = x.shape[0]
    keys = np.empty(n // CHUNK + 1, np.int32)
    bad = _chunk_maxima(x.view(np.int32), keys, copy)
    if n == 0:
        return bad, -1, keys
    top_key = _max(keys)
    top = _value_of(x, keys, top_key)
    low = _low_key(top, top_key)
    for c in range(keys.shape[0]):  # the first value equal to the largest, as np.argmax
        if keys[c] >= low:
            for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
                if x[i] == top:
                    return bad, i, keys
    return bad, -1, keys


def top_k(x, k, keys=None):
    """The indices of the k largest values of x (1-D float32, C-contiguous, no NaN), largest first, equal values
    by lower index: sampling.top_k_indices's answer. keys: scan(x)'s chunk maxima, when x was scanned."""
    cand = _top_k_candidates(x, k, scan(x)[2] if keys is None else keys)
    order = np.argsort(-x[cand], kind="stable")  # equal values keep ascending index order
    return cand[order[:k]]


@njit(cache=True, nogil=True)
def _top_k_candidates(x, k, keys):
    """Ascending indices of every value of x at or above a lower bound of its k-th largest, the k largest among
    them: the k-th largest chunk maximum is such a bound, so only chunks reaching it are read again."""
    n = x.shape[0]
    k = min(k, n)
    if k <= 0:
        return np.empty(0, np.int64)
    bound_key = _kth_largest(keys, k) if k <= keys.shape[0] else _KEY_MIN
    bound = _value_of(x, keys, bound_key) if bound_key != _KEY_MIN else np.float32(-np.inf)
    low = _low_key(bound, bound_key)
    count = 0
    for c in range(keys.shape[0]):
        if keys[c] >= low:
            for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
                count += x[i] >= bound
    cand = np.empty(count, np.int64)
    j = 0
    for c in range(keys.shape[0]):
        if keys[c] >= low:
            for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
                if x[i] >= bound:
                    cand[j] = i
                    j += 1
    return cand

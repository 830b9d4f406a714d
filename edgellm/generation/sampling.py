"""Token sampling in llama.cpp's order, plus log-probabilities.

Sections: `SamplingParams` (validated, frozen); the chain stages, each a pure function on a `Candidates` set
(penalties, top-k, typical-p, top-p, min-p); `Sampler`, which runs the chain and draws with a seeded numpy
Generator; `log_softmax` / `token_logprobs` for the logprobs of completions.

The chain is the one llama-cpp-python builds for a plain completion (llama.py `_init_sampler`):
penalties -> top-k -> typical-p -> top-p -> min-p -> temperature -> draw, each filter keeping at least one token.
Kept deliberately the same as llama.cpp (src/llama-sampling.cpp): which tokens survive each stage, the penalty
formula (float32), min-p's test in logit space. Differs on purpose: the draw uses numpy's Generator rather than
std::mt19937, so a seed reproduces edgellm's own runs, not llama.cpp's; probabilities are float64; ties are broken
by the lower token id (llama.cpp leaves tie order to std::partial_sort); temperature <= 0 is greedy (llama.cpp's
temp sampler does the same; llama-cpp-python samples the unfiltered distribution for a negative temperature).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from edgellm.errors import SamplingError
from edgellm.generation import logit_scan

MIN_KEEP = 1  # llama-cpp-python passes min_keep = max(1, n_probs) with n_probs = 0


# ---------------------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------------------

def _check_real(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise SamplingError(f"{name} must be a finite number, got {value!r}")
    low_ok = value > low if low_open else value >= low
    if not (low_ok and value <= high):
        bracket = "(" if low_open else "["
        high_text = "inf)" if high == math.inf else f"{high:g}]"
        raise SamplingError(f"{name} must be in {bracket}{low:g}, {high_text}, got {value!r}")
    return float(value)


def _check_int(name: str, value, low: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingError(f"{name} must be an integer >= {low} ({meaning}), got {value!r}")
    if value < low:
        raise SamplingError(f"{name} must be an integer >= {low} ({meaning}), got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """llama-cpp-python's create_completion defaults; repeat_last_n is its last_n_tokens_size."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_last_n: int = 64

    def __post_init__(self):
        # normalise numpy scalars to plain python values so the dataclass hashes and prints cleanly
        checked = {
            # any finite value; <= 0 means greedy
            "temperature": _check_real("temperature", self.temperature, -math.inf, math.inf),
            "top_k": _check_int("top_k", self.top_k, 0, "0 disables"),
            "top_p": _check_real("top_p", self.top_p, 0.0, 1.0),
            "min_p": _check_real("min_p", self.min_p, 0.0, 1.0),
            "typical_p": _check_real("typical_p", self.typical_p, 0.0, 1.0),
            # 0 would divide by zero; 1.0 disables
            "repeat_penalty": _check_real("repeat_penalty", self.repeat_penalty, 0.0, math.inf, low_open=True),
            # the OpenAI range, which llama-cpp-python's server also enforces
            "frequency_penalty": _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0),
            "presence_penalty": _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0),
            "repeat_last_n": _check_int("repeat_last_n", self.repeat_last_n, -1, "-1 = whole history, 0 disables"),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalties_active(self) -> bool:
        # the same early-out as llama.cpp's penalties sampler
        return self.repeat_last_n != 0 and not (
            self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0 and self.presence_penalty == 0.0)


def _check_seed(seed) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise SamplingError(f"seed must be None or an integer >= 0, got {seed!r}")
    return int(seed)


# ---------------------------------------------------------------------------------------------------------------
# Logits checks and the candidate set
# ---------------------------------------------------------------------------------------------------------------

def as_logits(logits) -> np.ndarray:
    """The logits as a 1-D float32 array, refusing NaN and +Inf (-Inf is allowed: it is how a token is banned)."""
    return _checked(logits)[0]


def _checked(logits, scanned=None) -> tuple[np.ndarray, tuple | None]:
    """as_logits, with (np.argmax, chunk maxima) of the row when a compiled pass found every value finite (this
    one, or `scanned`: decoding.check_finite's of the same row), else None."""
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 1 or x.size == 0:
        raise SamplingError(f"logits must be a non-empty 1-D array of n_vocab values, got shape {x.shape}")
    if scanned is not None:
        return x, scanned
    if logit_scan.readable(x):
        n_bad, top_id, keys = logit_scan.scan(x)
        if n_bad == 0:
            return x, (int(top_id), keys)
    # one reduction finds both problems: max() is NaN if any entry is NaN, +inf if any is +inf
    top = x.max()
    if np.isnan(top):
        raise SamplingError(f"logits contain NaN ({int(np.isnan(x).sum())} of {x.size}); the forward pass is broken")
    if top == np.inf:
        raise SamplingError(f"logits contain +Inf ({int(np.isposinf(x).sum())} of {x.size}); "
                            "the forward pass overflowed")
    if top == -np.inf:
        raise SamplingError("every logit is -Inf: no token can be sampled")
    return x, None


class Candidates(NamedTuple):
    """Token ids and their logits. When is_sorted, logits descend and equal logits are in ascending id order."""

    ids: np.ndarray  # int64 [n]
    logits: np.ndarray  # float32 [n]
    is_sorted: bool

    @classmethod
    def full(cls, logits: np.ndarray) -> "Candidates":
        return cls(np.arange(logits.size, dtype=np.int64), logits, False)

    def sorted(self) -> "Candidates":
        if self.is_sorted:
            return self
        # stable sort of ascending ids on -logit: equal logits stay in id order
        by_id = np.argsort(self.ids, kind="stable")
        ids, logits = self.ids[by_id], self.logits[by_id]
        order = np.argsort(-logits, kind="stable")
        return Candidates(ids[order], logits[order], True)

    def take(self, index) -> "Candidates":
        return Candidates(self.ids[index], self.logits[index], self.is_sorted)


def _softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits.astype(np.float64) - float(logits.max()))
    return z / z.sum()


def top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of x, largest first, ties by lower index, without sorting all of x.

    View x as a (groups, n/groups) matrix and take each column's max (one fast elementwise pass). The k-th largest
    column max, v, is <= the k-th largest value of x (the k column maxes are k values of x that are >= v), so every
    top-k value lies in a column whose max is >= v: about k columns, i.e. ~groups*k candidates to partition and sort.
    Exact whatever the distribution of x; ties only widen the candidate set.
    """
    n = x.size
    k = min(k, n)
    groups = 64
    while groups > 1 and n // groups < 8 * k:  # keep enough columns that ~k of them hold the answer
        groups //= 2
    if groups > 1:
        n_cols = n // groups
        col_max = x[: groups * n_cols].reshape(groups, n_cols).max(axis=0)
        bound = np.partition(col_max, n_cols - k)[n_cols - k]
        cols = np.flatnonzero(col_max >= bound)
        cand = (np.arange(groups)[:, None] * n_cols + cols[None, :]).ravel()
        if groups * n_cols < n:  # the ragged tail is not in any column: always a candidate
            cand = np.concatenate([cand, np.arange(groups * n_cols, n)])
    else:
        cand = np.arange(n)
    vals = x[cand]
    if cand.size > k:
        kth = np.partition(vals, cand.size - k)[cand.size - k]
        keep = vals >= kth  # keeps ties at the boundary; the sort below picks the lower indices among them
        cand, vals = cand[keep], vals[keep]
    order = np.lexsort((cand, -vals))[:k]  # by value descending, then index ascending
    return cand[order]


def _top_k(x: np.ndarray, k: int, keys=None) -> np.ndarray:
    """top_k_indices(x, k) for a checked row (no NaN), compiled where logit_scan can read it; keys: its scan's."""
    return logit_scan.top_k(x, k, keys) if logit_scan.readable(x) else top_k_indices(x, k)


# ---------------------------------------------------------------------------------------------------------------
# Chain stages
# ---------------------------------------------------------------------------------------------------------------

def apply_penalties(logits: np.ndarray, history: Sequence[int], params: SamplingParams) -> np.ndarray:
    """llama.cpp's penalties over the last repeat_last_n tokens of history; returns a copy when anything changes."""
    if not params.penalties_active or len(history) == 0:
        return logits
    recent = history if params.repeat_last_n < 0 else history[-params.repeat_last_n:]
    recent = np.asarray(recent, dtype=np.int64)
    ids, counts = np.unique(recent, return_counts=True)
    if ids[0] < 0 or ids[-1] >= logits.size:
        bad = int(ids[0] if ids[0] < 0 else ids[-1])
        raise SamplingError(f"history holds token id {bad}, outside the vocabulary [0, {logits.size})")
    vals = logits[ids]
    repeat = np.float32(params.repeat_penalty)
    # dividing a negative logit would raise its probability, so negative logits are multiplied instead
    vals = np.where(vals <= 0, vals * repeat, vals / repeat).astype(np.float32)
    vals -= (counts.astype(np.float32) * np.float32(params.frequency_penalty)
             + np.float32(params.presence_penalty))
    out = logits.copy()
    out[ids] = vals
    return out


def top_k_filter(cand: Candidates, k: int) -> Candidates:
    """The k highest logits, sorted. Expects the full vocabulary (ids == positions) or a sorted set."""
    if k <= 0:
        return cand
    if cand.is_sorted:
        return cand.take(slice(0, k))
    if k >= cand.ids.size:
        return cand.sorted()
    idx = top_k_indices(cand.logits, k)
    return Candidates(cand.ids[idx], cand.logits[idx], True)


def typical_filter(cand: Candidates, p: float, min_keep: int = MIN_KEEP) -> Candidates:
    """Locally typical sampling: keep the tokens whose surprise is nearest the entropy, until their mass exceeds p."""
    if p >= 1.0:
        return cand
    cand = cand.sorted()
    probs = _softmax64(cand.logits)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(probs)
        entropy = -np.sum(np.where(probs > 0, probs * logp, 0.0))
        shifted = np.abs(-logp - entropy)
    order = np.argsort(shifted, kind="stable")
    cum = np.cumsum(probs[order])
    # llama.cpp: strictly greater than p (top-p uses >=)
    last = int(np.searchsorted(cum, p, side="right")) + 1
    last = min(max(last, min_keep), order.size)
    # survivors come out in typicality order, no longer sorted by logit
    return Candidates(cand.ids[order[:last]], cand.logits[order[:last]], False)


def top_p_filter(cand: Candidates, p: float, min_keep: int = MIN_KEEP) -> Candidates:
    """Nucleus: the smallest prefix by descending probability whose mass reaches p."""
    if p >= 1.0:
        return cand
    # like llama.cpp, try the most likely few first; only a flat distribution needs the full sort
    top, total = float(cand.logits.max()), None
    for head_size in (256, 4096):
        if cand.is_sorted or cand.ids.size <= 4 * head_size:
            break
        if total is None:
            # the softmax normaliser from float32 exps summed in float64: much cheaper than a float64 softmax over
            # a 262k vocabulary; the head's cumulative mass moves by ~1e-7 relative, only at an exact boundary
            total = float(np.sum(np.exp(cand.logits - np.float32(top)), dtype=np.float64))
        head = top_k_indices(cand.logits, head_size)
        cum = np.cumsum(np.exp(cand.logits[head].astype(np.float64) - top)) / total
        if cum[-1] >= p:
            last = min(max(int(np.searchsorted(cum, p, side="left")) + 1, min_keep), head.size)
            return Candidates(cand.ids[head[:last]], cand.logits[head[:last]], True)
    probs = _softmax64(cand.logits)
    if not cand.is_sorted:
        by_id = np.argsort(cand.ids, kind="stable")
        order = by_id[np.argsort(-cand.logits[by_id], kind="stable")]
        cand, probs = Candidates(cand.ids[order], cand.logits[order], True), probs[order]
    cum = np.cumsum(probs)
    last = min(max(int(np.searchsorted(cum, p, side="left")) + 1, min_keep), cand.ids.size)
    return cand.take(slice(0, last))


def min_p_filter(cand: Candidates, p: float, min_keep: int = MIN_KEEP) -> Candidates:
    """Keep tokens with probability >= p * (top probability), tested in logit space as llama.cpp does."""
    if p <= 0.0:
        return cand
    min_logit = np.float32(cand.logits.max()) + np.float32(math.log(p))
    keep = cand.logits >= min_logit
    if int(keep.sum()) >= min_keep:
        return cand.take(keep)
    return cand.sorted().take(slice(0, min_keep))


# ---------------------------------------------------------------------------------------------------------------
# The sampler
# ---------------------------------------------------------------------------------------------------------------

class Sampler:
    """Runs the chain and draws a token. Deterministic for a given seed and sequence of calls."""

    def __init__(self, params: SamplingParams | None = None, seed: int | None = None):
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise SamplingError(f"params must be a SamplingParams, got {type(params).__name__}")
        self.params = params
        self.seed = _check_seed(seed)
        self._rng = np.random.default_rng(self.seed)

    def reset(self, seed: int | None = None) -> None:
        """Restart the random stream (from `seed` if given, else from the seed the sampler was built with)."""
        if seed is not None:
            self.seed = _check_seed(seed)
        self._rng = np.random.default_rng(self.seed)

    def candidates(self, logits, history: Sequence[int] = (), scanned=None) -> tuple[np.ndarray, np.ndarray]:
        """The distribution the draw uses: surviving token ids and their probabilities (after temperature).
        scanned: decoding.check_finite's result for this very row, so that it is not read again."""
        params = self.params
        raw, scanned = _checked(logits, scanned)
        x = apply_penalties(raw, history, params)
        same = scanned is not None and x is raw  # penalties change nothing (the usual case): the scan holds
        if params.greedy:
            return np.array([scanned[0] if same else int(np.argmax(x))], dtype=np.int64), np.ones(1)
        if 0 < params.top_k < x.size:
            top = _top_k(x, params.top_k, scanned[1] if same else None)  # no full-vocabulary id array
            cand = Candidates(top, x[top], True)
        else:
            cand = top_k_filter(Candidates.full(x), params.top_k)
        cand = typical_filter(cand, params.typical_p)
        cand = top_p_filter(cand, params.top_p)
        cand = min_p_filter(cand, params.min_p)
        scaled = cand.logits.astype(np.float64) / params.temperature
        return cand.ids, _softmax64(scaled)

    def sample(self, logits, history: Sequence[int] = (), scanned=None) -> int:
        ids, probs = self.candidates(logits, history, scanned)
        if ids.size == 1:
            return int(ids[0])
        # first token whose running mass exceeds u: a zero-probability token is never chosen
        cum = np.cumsum(probs)
        i = int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right"))
        return int(ids[min(i, ids.size - 1)])


    def sample_draft(self, logits, history: Sequence[int], token: int, q_ids=None, q_probs=None,
                     scanned=None) -> int:
        """The next token when a drafter proposed `token`, drawn from q (q_ids, q_probs; None: a point mass, as
        prompt lookup and greedy drafts are): speculative sampling's rejection rule, whose output is distributed
        as sample()'s. Keep `token` with probability min(1, p(token) / q(token)); else draw from the residual
        max(p - q, 0), normalised, which never holds `token`. Greedy (one candidate) it keeps `token` exactly
        when it is the argmax, and draws nothing from the random stream."""
        ids, probs = self.candidates(logits, history, scanned)
        if ids.size == 1:
            return int(ids[0])
        is_token = ids == token
        p_x = float(probs[is_token].sum())
        q_on_ids = np.zeros_like(probs)
        if q_ids is None:
            q_x = 1.0
            q_on_ids[is_token] = 1.0
        else:
            q_ids, q_probs = np.asarray(q_ids), np.asarray(q_probs, np.float64)
            q_x = float(q_probs[q_ids == token].sum())
            where = {int(t): i for i, t in enumerate(ids)}
            for t, q in zip(q_ids.tolist(), q_probs.tolist()):
                i = where.get(t)
                if i is not None:
                    q_on_ids[i] = q
        if q_x > 0 and self._rng.random() * q_x < p_x:
            return int(token)
        residual = np.maximum(probs - q_on_ids, 0.0)
        residual[is_token] = 0.0  # (rejected: p(token) < q(token), so its residual is 0 up to rounding)
        if residual.sum() <= 0.0:  # p == q on every candidate but token: only rounding can bring us here
            residual = probs.copy()
            residual[is_token] = 0.0
            if residual.sum() <= 0.0:
                return int(token)
        cum = np.cumsum(residual)
        i = int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right"))
        return int(ids[min(i, ids.size - 1)])


# ---------------------------------------------------------------------------------------------------------------
# Log-probabilities (of the raw logits, as llama-cpp-python reports them)
# ---------------------------------------------------------------------------------------------------------------

def _log_sum_exp(x: np.ndarray) -> float:
    # exp in float32 (fast over a 262k vocabulary, relative error ~1e-7), summed in float64
    m = float(x.max())
    return m + math.log(float(np.sum(np.exp(x - np.float32(m)), dtype=np.float64)))


def log_softmax(logits) -> np.ndarray:
    """log p for every token, float32 (llama-cpp-python's logits_to_logprobs)."""
    x = as_logits(logits)
    return (x.astype(np.float64) - _log_sum_exp(x)).astype(np.float32)


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float
    top_ids: list[int]  # the top_n most likely tokens, most likely first
    top_logprobs: list[float]


def token_logprobs(logits, token_id: int, top_n: int = 0, scanned=None) -> TokenLogprobs:
    """The chosen token's log-probability and the top_n alternatives', without a full log-softmax array.
    scanned: decoding.check_finite's result for this very row, so that it is not read again."""
    x, scanned = _checked(logits, scanned)
    if isinstance(top_n, bool) or not isinstance(top_n, numbers.Integral) or top_n < 0:
        raise SamplingError(f"top_n (logprobs) must be an integer >= 0, got {top_n!r}")
    if not 0 <= token_id < x.size:
        raise SamplingError(f"token id {token_id} is outside the vocabulary [0, {x.size})")
    lse = _log_sum_exp(x)
    top = _top_k(x, int(top_n), scanned[1] if scanned else None) if top_n > 0 else np.empty(0, dtype=np.int64)
    return TokenLogprobs(int(token_id), float(x[token_id]) - lse, [int(i) for i in top],
                         [float(x[i]) - lse for i in top])

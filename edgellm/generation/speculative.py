"""Speculative decoding: a cheap drafter proposes the next few tokens, the target model checks them all in one
forward pass (DecoderModel.forward_verify, every row with a decode step's arithmetic), and the rejected rows are
dropped from the KV cache (KVCache.truncate: slots marked empty, nothing copied).

Sections: the drafters (`PromptLookup`: the continuation of the latest earlier occurrence of the last n tokens;
`DraftModel`: a smaller model of the same vocabulary, its KV cache kept in step with the target's); `DraftLength`,
which adapts the number of drafted tokens to how many get accepted and pauses drafting where nothing is;
`Speculator`, one generation's drafter, length and counts, which the decode loop in edgellm/api.py drives.

Which drafted tokens are kept is decided by SequenceState.step (edgellm/generation/decoding.py) through
Sampler.sample_draft (edgellm/generation/sampling.py), position by position, with the target's logits at that
position and everything the plain loop applies there (bias, processors, grammar mask, penalties over the history
so far). Greedy, a drafted token is kept exactly when it is the target's argmax, so the output is plain greedy
decoding's; sampling, the rejection rule keeps the output distribution the target's.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np

from edgellm.errors import ModelError, SamplingError

MODES = ("lookup", "draft")
LOOKUP_NGRAM_MAX = 8  # the longest suffix searched for: the longest one that matches is drafted from
LOOKUP_NGRAM_MIN = 2  # single-token matches are mostly chance on open text
# Lookup drafts are judged by the length of the suffix they matched, in classes: 2 tokens, 3, and 4 or more. Text
# being copied matches long suffixes and goes on matching; a 2-token match is often where the output leaves it.
LOOKUP_MATCH_CLASSES = (2, 3)
DRAFT_MAX = {"lookup": 12, "draft": 6}  # most tokens drafted per step: a model draft costs a draft forward each
DRAFT_LIMIT = 64  # the most a caller may ask drafted per step (each drafted row is a verified row of the forward)


def check_mode(value, has_draft_model: bool):
    """The speculative mode a caller asked for: None (off), "lookup" or "draft"; refuses anything else."""
    if value is None or value is False:
        return None
    if value not in MODES:
        raise SamplingError(f"speculative must be None, 'lookup' or 'draft', got {value!r}")
    if value == "draft" and not has_draft_model:
        raise SamplingError("speculative='draft' needs a draft model: load(..., draft_model=PATH)")
    return value


def check_lengths(draft_max, draft_min, names=("draft_max", "draft_min")) -> None:
    """SamplingError unless draft_max (None: the default) and draft_min are whole numbers with
    0 <= draft_min <= draft_max <= DRAFT_LIMIT (draft_max 0: no drafting)."""
    for name, value in zip(names, (draft_max, draft_min)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= DRAFT_LIMIT:
            raise SamplingError(f"{name} must be an integer from 0 to {DRAFT_LIMIT}, got {value!r}")
    if draft_max is not None and draft_min is not None and draft_min > draft_max:
        raise SamplingError(f"{names[1]} ({draft_min}) must not exceed {names[0]} ({draft_max})")


# ---------------------------------------------------------------------------------------------------------------
# Drafters
# ---------------------------------------------------------------------------------------------------------------

class PromptLookup:
    """Drafts from the text itself: for n from LOOKUP_NGRAM_MAX down to LOOKUP_NGRAM_MIN, the tokens that followed
    the latest earlier occurrence of the history's last n tokens. An index per n maps each n-gram to where its
    latest continuation starts; it is extended by the tokens added since the last call, so a step costs a few
    dictionary look-ups whatever the length of the history."""

    def __init__(self, n_max: int = LOOKUP_NGRAM_MAX, n_min: int = LOOKUP_NGRAM_MIN):
        self.sizes = range(n_max, n_min - 1, -1)
        self.index = {n: {} for n in self.sizes}
        self.n_indexed = 0

    def _extend(self, history) -> None:
        for t in range(max(self.n_indexed, 1), len(history)):
            for n in self.sizes:  # the n-gram ending just before t now has a continuation starting at t
                if t >= n:
                    self.index[n][tuple(history[t - n:t])] = t
        self.n_indexed = len(history)

    def find(self, history, k: int) -> tuple[list[int], int]:
        """(up to k drafted tokens, the length of the suffix they were found after); ([], 0) when none matched."""
        self._extend(history)
        end = len(history)
        for n in self.sizes:
            if end < n:
                continue
            start = self.index[n].get(tuple(history[end - n:]))
            if start is not None:
                return list(history[start:start + k]), n
        return [], 0

    def propose(self, history, k: int) -> list[int]:
        return self.find(history, k)[0]


def match_class(n: int) -> int:
    """The class (an index) of a lookup find after a matched suffix of n tokens: see LOOKUP_MATCH_CLASSES."""
    return bisect.bisect_left(LOOKUP_MATCH_CLASSES, n)


class DraftModel:
    """Drafts with a smaller model: k greedy (or, sampling, drawn from its own distribution) tokens, one draft
    forward each. Its cache holds a prefix of the target's history; before each draft it is rolled back to the
    common prefix (at most the last draft's rejected tokens) and fed what the target accepted since."""

    def __init__(self, draft, sampler=None, cache=None):
        self.draft = draft  # an edgellm Model
        self.forward = draft.model
        self.sampler = sampler  # None: greedy drafts (a point mass for the rejection rule)
        self.cache = cache  # a KVCache of the draft's layout (the server's: one per slot); None: the draft's own
        self.tokens: list[int] = []  # what the draft's cache holds

    def start(self, prompt_ids) -> None:
        (self.forward if self.cache is None else self.cache).reset()
        self.tokens = []

    def propose(self, history, k: int):
        """(tokens, q): q[i] is (ids, probs), the draft's distribution the i-th token was drawn from, or None when
        greedy."""
        return draft_together([self], [history], [k])[0]

    def room(self, history, k: int) -> int:
        """k, cut so that the draft's context never shifts (drafting stops instead)."""
        cache = self.forward.cache if self.cache is None else self.cache
        return min(k, cache.n_ctx - 1 - len(history))

    def catch_up(self, history) -> list[int]:
        """Roll the cache back to its common prefix with history; returns what must be fed for it to hold history."""
        cache = self.forward.cache if self.cache is None else self.cache
        c, n = 0, min(len(self.tokens), len(history))
        while c < n and self.tokens[c] == history[c]:
            c += 1
        if c < len(self.tokens):
            cache.truncate(c)
            del self.tokens[c:]
        return list(history[c:])

    def choose(self, logits, history, drafted):
        """(token, q) from the draft's logits after history + drafted: greedy (q None), or drawn from its own
        distribution."""
        if self.sampler is None:
            return int(np.argmax(logits)), None
        ids, probs = self.sampler.candidates(logits, list(history) + drafted)
        cum = np.cumsum(probs)
        j = int(np.searchsorted(cum, self.sampler._rng.random() * cum[-1], side="right"))
        return int(ids[min(j, ids.size - 1)]), (ids, probs)


def draft_together(drafters, histories, ks) -> list:
    """DraftModel.propose for several drafters at once, ks[i] tokens after histories[i]: a catch-up of more than one
    token (a new prompt, a draft's accepted tail) runs on its own, then each step feeds every drafter's one token in
    one forward of the draft (forward_multi over their caches: distinct caches of the draft's layout, as a KVPool's),
    the weights read once for all. Returns [(tokens, qs)] in the drafters' order."""
    out = [([], []) for _ in drafters]
    live, feed = [], []  # (index, k) of the drafters still drafting; the token each feeds next
    for i, (d, history, k) in enumerate(zip(drafters, histories, ks)):
        todo = d.catch_up(history) if d.room(history, k) > 0 else []
        if not todo:  # (no room; or the whole history is cached: never, the target's last token is new)
            continue
        if len(todo) > 1:
            d.forward.forward(np.asarray(todo[:-1], np.int32), cache=d.cache)
        d.tokens = list(history[:-1])
        live.append((i, d.room(history, k)))
        feed.append(todo[-1])
    while live:
        if len(live) == 1:
            d = drafters[live[0][0]]
            rows = d.forward.forward(np.asarray(feed, np.int32), cache=d.cache)
        else:
            rows = drafters[live[0][0]].forward.forward_multi(np.asarray(feed, np.int32),
                                                              [drafters[i].cache for i, _ in live])
        still, next_feed = [], []
        for (i, k), token, row in zip(live, feed, rows):  # (rows is the model's buffer: read before the next forward)
            d = drafters[i]
            d.tokens.append(token)
            drafted, q = d.choose(row, histories[i], out[i][0])
            out[i][0].append(drafted)
            out[i][1].append(q)
            if len(out[i][0]) < k:
                still.append((i, k))
                next_feed.append(drafted)
        live, feed = still, next_feed
    return out


def check_same_vocabulary(target, draft) -> None:
    """ModelError unless the draft model's tokens are the target's, id for id (a drafted id must mean the same
    text to both)."""
    a, b = target.tokenizer, draft.tokenizer
    if target.n_vocab != draft.n_vocab or a.n_vocab != b.n_vocab:
        raise ModelError(f"the draft model {draft.name} has a vocabulary of {draft.n_vocab} tokens, the target "
                         f"{target.name} {target.n_vocab}: speculative decoding needs the same vocabulary")
    for i in range(a.n_vocab):
        if a.token_to_bytes(i) != b.token_to_bytes(i):
            raise ModelError(f"the draft model {draft.name} and the target {target.name} differ at token {i} "
                             f"({a.token_to_bytes(i)!r} vs {b.token_to_bytes(i)!r}): speculative decoding needs "
                             "the same vocabulary")
    if a.eos_id != b.eos_id or a.bos_id != b.bos_id:
        raise ModelError(f"the draft model {draft.name} has other BOS/EOS tokens than {target.name}")


# ---------------------------------------------------------------------------------------------------------------
# The draft length
# ---------------------------------------------------------------------------------------------------------------

class ForwardCosts:
    """What the target's forwards cost, per number of rows, timed as they run: plain steps per batch size n (n rows),
    verifications per total rows R (n sequences plus drafted rows, drafting included). Costs are far from linear in
    the rows (the matmuls run tokens in tiles of 8 and 4: on a small model 4 rows can cost less than 3), so each
    size is timed; an untimed size is interpolated between timed ones, past them extrapolated at the average extra
    row's cost (before any verification is timed, BETA_START of a single step a row), and taken UNTIMED lower, so
    that each size worth it gets tried once. A table is kept across generations (a Model's per mode, a server's),
    since trying each size costs a short generation much of its gain; a size that none of the last KEEP_GENERATIONS
    generations timed is forgotten, so that a noisy timing is not kept for good (a size judged too dear is not
    drafted, and so not timed, again: forgotten, it is guessed and tried again). A size's first timing is timed
    again when it is far above what the timed forwards suggest, or when nothing is timed yet to check it with: a
    process's first forward of a size also loads its kernels from Numba's cache (SmolLM2's 4-row verification at
    one thread, 16-22 ms, took 27-33 ms the first time, and a generation that kept that never drafted 3 tokens
    again). For the same reason a plain step's first timing in a process is never kept: kept, it made the plain
    step look dear for the next few steps, and a slow first verification measured against it passed for true
    (SmolLM2's 4 rows at two threads kept at 26 ms, 3.9 steps, and never drafted again in that generation)."""

    DECAY = 0.7  # weight of the past in the running times, per timed forward
    BETA_START = 0.3  # an extra row's cost in single steps, before any verification is timed
    UNTIMED = 0.8  # an untimed size's estimate, times this: optimistic, so that it gets timed
    FIRST_SLACK = 1.25  # a first timing above this many times the size's estimate is timed again before it counts
    KEEP_GENERATIONS = 4

    def __init__(self):
        self.steps = {}  # sequences in a plain forward -> its running seconds
        self.verified = {}  # rows in a verifying forward -> its running seconds, drafting included
        self.slow_first = set()  # sizes whose first timing was not kept
        self.generation = 0
        self.timed_in = {}  # rows -> the generation that last timed a verification of that size
        self.loaded = set()  # verification sizes from an earlier process, untimed in this one
        self.steps_here = set()  # plain step sizes timed in this process

    def start_generation(self) -> None:
        """A generation starts with this table: sizes no timing of the last KEEP_GENERATIONS generations kept are
        forgotten (see the class)."""
        self.generation += 1
        for rows in [r for r, g in self.timed_in.items() if g <= self.generation - self.KEEP_GENERATIONS - 1]:
            del self.verified[rows], self.timed_in[rows]
            self.slow_first.discard(rows)
            self.loaded.discard(rows)

    def _running(self, table: dict, key: int, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds

    def timed_step(self, seconds: float, n_seqs: int = 1) -> None:
        if n_seqs not in self.steps_here:  # its kernels loading: the first step of a size is not kept (see the class)
            self.steps_here.add(n_seqs)
            return
        self._running(self.steps, n_seqs, seconds)

    def timed_verification(self, rows: int, seconds: float, n_seqs: int = 1) -> None:
        if rows <= n_seqs:
            return
        if rows in self.loaded:  # a loaded size's first timing here: dropped when far above the loaded cost
            self.loaded.discard(rows)
            if seconds > self.FIRST_SLACK * self.verified[rows]:
                return
        if rows not in self.verified and rows not in self.slow_first and (
                not (self.verified or n_seqs in self.steps)  # nothing timed to check it with
                or seconds > self.FIRST_SLACK * max(self.plain_s(n_seqs), self._guess(n_seqs, rows))):
            self.slow_first.add(rows)
            return
        self._running(self.verified, rows, seconds)
        self.timed_in[rows] = self.generation

    def saved(self) -> dict:
        """The table as kept between processes (edgellm.generation.cost_store): the running costs, and for each
        verification size how many generations ago it was last timed, so that forgetting goes on across them."""
        return {"steps": {str(n): s for n, s in self.steps.items()},
                "verified": {str(r): [s, self.generation - self.timed_in[r]] for r, s in self.verified.items()}}

    def load(self, saved: dict) -> None:
        """Start from a table saved() by an earlier process, before this one's first generation (the sizes it
        holds count as timed; a verification size's first timing here is dropped when far above its loaded cost,
        as the class says of first timings). Raises ValueError
        where `saved` is not such a table, leaving this one as it was."""
        steps, verified = _parse_saved(saved)
        self.steps.update(steps)
        for rows, (seconds, age) in verified.items():
            self.verified[rows], self.timed_in[rows] = seconds, self.generation - age
        self.loaded |= set(verified)

    def plain_s(self, n_seqs: int) -> float:
        """A plain step of n_seqs sequences: timed, else the nearest timed batch size's scaled as 1 + BETA_START
        (n - 1) single steps are; in single steps before any is timed."""
        if n_seqs in self.steps:
            return self.steps[n_seqs]
        if not self.steps:
            return self._shape(n_seqs)
        near = min(self.steps, key=lambda n: (abs(n - n_seqs), n))
        return self.steps[near] * self._shape(n_seqs) / self._shape(near)

    def _shape(self, n_seqs: int) -> float:
        return 1 + self.BETA_START * (n_seqs - 1)

    def forward_s(self, n_seqs: int, rows: int) -> float:
        """A forward of n_seqs sequences and rows - n_seqs drafted rows, drafting included (see the class)."""
        plain = self.plain_s(n_seqs)
        if rows <= n_seqs:
            return plain
        if rows in self.verified:
            return self.verified[rows]
        return max(plain, self.UNTIMED * self._guess(n_seqs, rows))  # (never below the plain step: more rows)

    def _guess(self, n_seqs: int, rows: int) -> float:
        """An untimed size's cost: interpolated between timed sizes, else extrapolated (see the class)."""
        plain = self.plain_s(n_seqs)
        below = [r for r in self.verified if n_seqs < r < rows]
        above = [r for r in self.verified if r > rows]
        r0, t0 = (max(below), self.verified[max(below)]) if below else (n_seqs, plain)
        if above:
            r1 = min(above)
            guess = t0 + (self.verified[r1] - t0) * (rows - r0) / (r1 - r0)
        else:
            row = (t0 - plain) / (r0 - n_seqs) if r0 > n_seqs else self.BETA_START * plain / self._shape(n_seqs)
            guess = t0 + max(0.0, row) * (rows - r0)
        return guess


MAX_SAVED_ROWS = 1024  # a saved table's sizes: sequences in a batch, rows in a verification


def _parse_saved(saved) -> tuple[dict, dict]:
    """ForwardCosts.saved()'s form -> ({n: seconds}, {rows: (seconds, age)}); ValueError when it is not that."""
    def size(key) -> int:
        if not (isinstance(key, str) and key.isdigit() and 1 <= int(key) <= MAX_SAVED_ROWS):
            raise ValueError(f"a forward cost table's size must be 1..{MAX_SAVED_ROWS}, got {key!r}")
        return int(key)

    def cost(value) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 60.0:
            raise ValueError(f"a forward cost must be a number of seconds in (0, 60), got {value!r}")
        return float(value)

    if not isinstance(saved, dict) or not isinstance(saved.get("steps"), dict) or \
            not isinstance(saved.get("verified"), dict):
        raise ValueError("a forward cost table is a dict with 'steps' and 'verified' dicts")
    steps = {size(k): cost(v) for k, v in saved["steps"].items()}
    verified = {}
    for k, v in saved["verified"].items():
        if not (isinstance(v, list) and len(v) == 2 and isinstance(v[1], int) and not isinstance(v[1], bool)
                and 0 <= v[1] <= 1_000_000):
            raise ValueError(f"a verification's saved cost is [seconds, generations since timed], got {v!r}")
        verified[size(k)] = (cost(v[0]), v[1])
    return steps, verified


class DraftLength:
    """How many tokens to draft next, from p_j, the chance that the target accepts drafted token j given it
    accepted the ones before, per position j (drafts that start right tend to stay right: text being copied), as
    decayed counts over recent drafts, and what forwards cost per number of rows (ForwardCosts).

    The choice is the batch's: a forward of n sequences gives n tokens plainly; k drafted rows of this sequence
    add p_1 + p_1 p_2 + ... + p_1..p_k expected tokens for the cost of n + k rows. The k that maximises the batch's
    tokens per second is drafted (at most `available`, what the drafter found, when it is known first); at n = 1
    that is the single sequence's speed-up. Where no k beats plain decoding (open-ended text: drafts rejected; a
    big batch) drafting pauses (unless `pauses` is off: a drafter whose finds are checked without drafting), for a
    pause that doubles while it stays so and resets when a draft is accepted again. k_min: a shorter draft is not
    verified (want() asks for at least k_min). parent: another DraftLength whose estimates this one's start from and
    are pulled toward, as POOL_WEIGHT observations of them (prompt lookup's classes of find, each pooled toward all
    finds: a class seen rarely is judged mostly as the finds are overall)."""

    ACCEPT_DECAY = 0.9  # weight of the past in the acceptance counts, per observation
    ALPHA_START = 0.8  # the first position's first estimate
    PAUSE_FIRST, PAUSE_MAX = 4, 128
    MIN_GAIN = 1.05  # a draft is verified only for at least this expected speed-up: less is within the costs' noise
    POOL_WEIGHT = 2.0

    def __init__(self, k_max: int, k_min: int = 0, pauses: bool = True, costs: ForwardCosts | None = None,
                 parent: DraftLength | None = None):
        self.k_max, self.k_min, self.pauses, self.parent = k_max, min(k_min, k_max), pauses, parent
        self.costs = ForwardCosts() if costs is None else costs
        n = max(k_max, 0) + 1
        self.accepted = [0.0] * n  # [j - 1]: decayed counts of drafted token j accepted / tried
        self.seen = [0.0] * n  # (tried: every token before it was accepted)
        # each estimate starts as one observation of its prior, decayed as the real ones come: ALPHA_START, or the
        # estimate before it where that is lower, so a position rarely reached (its predecessors rejected) is judged
        # as they are, not as a fresh guess
        self.prior_weight = [1.0] * n
        self.pause, self.paused = self.PAUSE_FIRST, 0

    def estimates(self, k: int) -> list[float]:
        """[p_1, ..., p_k]: p_j, the chance that drafted token j is accepted, given the ones before it were."""
        if self.parent is not None:
            pooled, w = self.parent.estimates(k), self.POOL_WEIGHT
            return [(self.accepted[i] + w * pooled[i]) / (self.seen[i] + w) for i in range(k)]
        out, p = [], self.ALPHA_START
        for i in range(k):
            w = self.prior_weight[i]
            p = (self.accepted[i] + w * min(p, self.ALPHA_START)) / (self.seen[i] + w)
            out.append(p)
        return out

    def p(self, j: int) -> float:
        """The chance that drafted token j (from 1) is accepted, given the ones before it were."""
        return self.estimates(j)[-1]

    def plain_s(self, n_seqs: int) -> float:
        return self.costs.plain_s(n_seqs)

    def forward_s(self, n_seqs: int, rows: int) -> float:
        return self.costs.forward_s(n_seqs, rows)

    def timed_step(self, seconds: float, n_seqs: int = 1) -> None:
        """A plain forward of n_seqs sequences took `seconds`."""
        self.costs.timed_step(seconds, n_seqs)

    def timed_verification(self, rows: int, seconds: float, n_seqs: int = 1) -> None:
        """A forward of `rows` rows (n_seqs sequences and their drafted rows) took `seconds`, drafting included."""
        self.costs.timed_verification(rows, seconds, n_seqs)

    def best(self, n_seqs: int = 1, available: int | None = None) -> tuple[int, float]:
        """(k, expected speed-up of the batch's tokens per second over plain decoding) of the best draft length now,
        in a forward of n_seqs sequences, with at most `available` tokens to draft (None: k_max); (0, 1.0) when no
        length reaches MIN_GAIN."""
        n = max(1, n_seqs)
        plain_rate = n / self.plain_s(n)
        best_k, best_gain, tokens, run = 0, self.MIN_GAIN, float(n), 1.0
        k_top = min(self.k_max, self.k_max if available is None else available)
        for k, p in enumerate(self.estimates(max(k_top, 0)), start=1):
            run *= min(p, 0.999)
            tokens += run
            gain = tokens / self.forward_s(n, n + k) / plain_rate
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k, best_gain if best_k else 1.0

    def want(self, n_seqs: int = 1, available: int | None = None) -> int:
        """Tokens to draft now (0: decode plainly), in a forward of n_seqs sequences, at most `available`."""
        if self.k_max <= 0:
            return 0
        if self.paused > 0:
            self.paused -= 1
            return 0 if self.paused else max(1, self.k_min)  # the pause's last step probes with a short draft
        k, _ = self.best(n_seqs, available)
        if k == 0 and self.pauses:
            self.paused = self.pause
            self.pause = min(self.PAUSE_MAX, 2 * self.pause)
            return 0
        return max(k, self.k_min)

    def update(self, drafted: int, accepted: int) -> None:
        """A verification's outcome: drafted tokens 1..accepted were accepted, the next one (if any) was not."""
        for j in range(1, min(drafted, accepted + 1) + 1):
            self.observe(j, j <= accepted)
        if accepted:
            self.pause = self.PAUSE_FIRST

    def observe(self, j: int, accepted: bool) -> None:
        """Drafted token j (from 1), after j - 1 accepted ones, was accepted or not."""
        if 1 <= j <= self.k_max:
            d = self.ACCEPT_DECAY
            self.seen[j - 1] = d * self.seen[j - 1] + 1
            self.accepted[j - 1] = d * self.accepted[j - 1] + accepted
            self.prior_weight[j - 1] *= d


# ---------------------------------------------------------------------------------------------------------------
# One generation's speculation
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Draft:
    """One verification: the tokens fed ([the pending token] + drafted), the target's logits at each, and for each
    drafted token what SequenceState.step compares it with: (token, q_ids, q_probs)."""
    tokens: list
    rows: np.ndarray  # [len(tokens), n_vocab]
    choices: list


class Speculator:
    """Drives one generation's drafts against the target's forward model. draft(): propose and verify; settle():
    after the decode loop has stepped through the rows, drop the rejected ones and update the counts."""

    def __init__(self, mode: str, target_forward, drafter, k_max: int | None = None, k_min: int = 0,
                 costs: ForwardCosts | None = None):
        self.mode, self.target, self.drafter = mode, target_forward, drafter
        self.lookup = isinstance(drafter, PromptLookup)
        # a lookup costs a few dictionary look-ups, so it runs every step and needs no pauses (see propose)
        self.length = DraftLength(DRAFT_MAX[mode] if k_max is None else k_max, k_min, pauses=not self.lookup,
                                  costs=costs)
        # lookup: the length is chosen with the estimates of the find's class (match_class), pooled toward
        # self.length's, which counts every find
        self.by_match = [DraftLength(self.length.k_max, k_min, pauses=False, costs=self.length.costs,
                                     parent=self.length) for _ in range(len(LOOKUP_MATCH_CLASSES) + 1)] \
            if self.lookup else []
        self.drafted = self.accepted = self.verifications = 0
        self._found = []  # lookup: [history length, the tokens found then, how many compared yet, its class's length]

    def propose(self, history, room: int, n_seqs: int = 1):
        """(drafted tokens, choices for SequenceState.step) after history, at most `room` tokens, in a forward of
        n_seqs sequences; None when no draft is worth it now (paused, nothing found, shorter than k_min, no room).
        Prompt lookup looks every step, drafting or not, and its finds are compared with the tokens that follow
        them, so the acceptance estimates see every position, drafted or not (what a longer draft would have got,
        and when copying starts again after open text); the length is chosen knowing how many tokens it found."""
        if self.lookup:
            self._compare_found(history)
            found, n = self.drafter.find(history, self.length.k_max) if self.length.k_max > 0 else ([], 0)
            if not found:
                return None
            length = self.by_match[match_class(n)]
            self._found.append([len(history), found, 0, length])
            k = min(length.want(n_seqs, min(len(found), room)), room)
            return self.choices(found[:k], None) if k > 0 else None
        k = self.plan(room, n_seqs)
        if k == 0:
            return None
        tokens, qs = self.drafter.propose(history, k)
        return self.choices(tokens, qs)

    def _compare_found(self, history) -> None:
        """Each earlier find against the tokens that have followed it since the last step: each position counts
        once, as it is seen, up to the find's first wrong token."""
        waiting = []
        for entry in self._found:
            start, found, j, length = entry
            while j < len(found) and start + j < len(history):
                right = history[start + j] == found[j]
                j += 1
                self.length.observe(j, right)
                length.observe(j, right)
                if not right:
                    j = len(found)
            if j < len(found):
                entry[2] = j
                waiting.append(entry)
        self._found = waiting

    def plan(self, room: int, n_seqs: int = 1) -> int:
        """How many tokens to draft now, at most room (0: none)."""
        k = min(self.length.want(n_seqs), room)
        return k if k > 0 and k >= self.length.k_min else 0

    def choices(self, tokens, qs):
        """(tokens, choices for SequenceState.step) of a drafter's proposal; None when it is too short to verify."""
        if not tokens or len(tokens) < self.length.k_min:
            return None
        return tokens, [(t, None, None) if qs is None or qs[i] is None else (t, *qs[i]) for i, t in enumerate(tokens)]

    def draft(self, history, limit: int | None = None) -> Draft | None:
        """The target's logits after history[-1] (not yet in its cache) and a draft of at most `limit` tokens after
        it (the tokens the generation may still take: a row past them would be verified for nothing); None when no
        draft is worth it now (paused, nothing found, no room: the caller decodes one token plainly)."""
        room = min(self.target.n_batch, self.target.n_ctx - self.target.n_past) - 1  # the draft must fit without a shift
        if limit is not None:
            room = min(room, limit)
        t0 = time.perf_counter()
        proposed = self.propose(history, room)
        if proposed is None:
            return None
        tokens, choices = proposed
        fed = [history[-1]] + tokens
        rows = self.target.forward_verify(np.asarray(fed, np.int32))
        # a draft model's forwards count in the cost of the draft, as the verification does
        self.length.timed_verification(len(fed), time.perf_counter() - t0)
        return Draft(fed, rows, choices)

    def timed_step(self, seconds: float) -> None:
        """The time of a plain decode step, which a verification's cost is measured against."""
        self.length.timed_step(seconds)

    def settle(self, draft: Draft, accepted: int) -> list[int]:
        """Keep the pending token and the first `accepted` drafted tokens in the target's cache; returns them."""
        kept = draft.tokens[:1 + accepted]
        self.target.truncate(self.target.n_past - (len(draft.tokens) - len(kept)))
        self.record(len(draft.tokens) - 1, accepted)
        return kept

    def record(self, drafted: int, accepted: int) -> None:
        """One verification's counts, into the totals and the draft length's estimates."""
        self.drafted += drafted
        self.accepted += accepted
        self.verifications += 1
        if not self.lookup:  # (a lookup's finds are counted as what followed them shows, in _compare_found)
            self.length.update(drafted, accepted)

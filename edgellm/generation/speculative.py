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

import time
from dataclasses import dataclass

import numpy as np

from edgellm.errors import ModelError, SamplingError

MODES = ("lookup", "draft")
LOOKUP_NGRAM_MAX = 4  # the longest suffix searched for; longer matches predict better but occur less often
LOOKUP_NGRAM_MIN = 2  # single-token matches are mostly chance on open text
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

    def propose(self, history, k: int) -> list[int]:
        self._extend(history)
        end = len(history)
        for n in self.sizes:
            if end < n:
                continue
            start = self.index[n].get(tuple(history[end - n:]))
            if start is not None:
                return list(history[start:start + k])
        return []


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

class DraftLength:
    """How many tokens to draft next, from two running estimates: alpha, the chance that the target accepts a
    drafted token given it accepted the ones before (accepted / (accepted + rejections) over recent drafts), and
    beta, what each extra drafted and verified row costs relative to the same forward without drafts (timed: the
    seconds a row adds, one estimate for every batch size, over the plain step of as many sequences, so a forward
    of n sequences plus E drafted rows costs about 1 + beta E plain steps of n sequences; on a small model on a CPU
    the kernels are compute-bound enough that beta is 0.1-0.4 at n = 1, not ~0).

    The choice is the batch's: a forward of n sequences gives n tokens plainly; k drafted rows of this sequence
    add (1 - alpha^(k+1)) / (1 - alpha) - 1 expected tokens for beta k more of the step. The k that maximises the
    batch's tokens per second, (n + gained) / (n (1 + beta k)), is drafted; at n = 1 that is the single sequence's
    speed-up. So in a batch a draft must gain more than n beta k tokens: its rows slow every other sequence's step.
    Where even the best ratio is below 1 (open-ended text: drafts rejected; a big batch) drafting pauses, for a
    pause that doubles while it stays so and resets when a draft is accepted again. k_min: a shorter draft is not
    verified (want() asks for at least k_min)."""

    DECAY = 0.7  # weight of the past in the running estimates, per draft (or per timed step)
    ALPHA_START, BETA_START = 0.5, 0.3
    PAUSE_FIRST, PAUSE_MAX = 4, 128

    def __init__(self, k_max: int, k_min: int = 0):
        self.k_max, self.k_min = k_max, min(k_min, k_max)
        self.accepted, self.rejected = self.ALPHA_START, 1.0 - self.ALPHA_START  # decayed counts
        self.steps = {}  # sequences in the forward -> running time of a plain step
        self.row_s = None  # running seconds one extra verified row adds to a forward, whatever its batch
        self.pause, self.paused = self.PAUSE_FIRST, 0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def beta(self) -> float:
        return self.row_cost(1)

    @property
    def step_s(self):
        return self.steps.get(1)

    def plain_s(self, n_seqs: int):
        """A plain step of n_seqs sequences: timed, else the nearest batch size's, each other sequence's row costing
        what a drafted one does (at most a whole step more each, at least none); None before any is timed."""
        if n_seqs in self.steps or not self.steps:
            return self.steps.get(n_seqs)
        near = min(self.steps, key=lambda n: (abs(n - n_seqs), n))
        s = self.steps[near]
        row = self.BETA_START * s if self.row_s is None else max(0.0, self.row_s)
        return min(max(s + row * (n_seqs - near), min(s, s * n_seqs / near)), max(s, s * n_seqs / near))

    def row_cost(self, n_seqs: int = 1) -> float:
        """beta in a forward of n_seqs sequences: the measured seconds of a row over that forward's plain step; before
        both are timed, the start value with the batch's own rows costing what a drafted one does (a plain step of
        n sequences: 1 + BETA_START (n - 1) single steps)."""
        plain = self.plain_s(n_seqs)
        if self.row_s is None or not plain:
            return self.BETA_START / (1 + self.BETA_START * (n_seqs - 1))
        return max(0.0, self.row_s) / plain

    def best(self, n_seqs: int = 1) -> tuple[int, float]:
        """(k, expected speed-up of the batch's tokens per second over plain decoding) of the best draft length now,
        in a forward of n_seqs sequences."""
        a, beta, n = min(self.alpha, 0.999), self.row_cost(n_seqs), max(1, n_seqs)
        best_k, best_gain = 0, 1.0
        for k in range(1, self.k_max + 1):
            gain = (n - 1 + (1 - a ** (k + 1)) / (1 - a)) / (n * (1 + beta * k))
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k, best_gain

    def want(self, n_seqs: int = 1) -> int:
        """Tokens to draft now (0: decode plainly), in a forward of n_seqs sequences."""
        if self.k_max <= 0:
            return 0
        if self.paused > 0:
            self.paused -= 1
            return 0 if self.paused else max(1, self.k_min)  # the pause's last step probes with a short draft
        k, _ = self.best(n_seqs)
        if k == 0:
            self.paused = self.pause
            self.pause = min(self.PAUSE_MAX, 2 * self.pause)
            return 0
        return max(k, self.k_min)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        d = self.DECAY
        self.accepted = d * self.accepted + accepted
        self.rejected = d * self.rejected + (accepted < drafted)
        if accepted:
            self.pause = self.PAUSE_FIRST

    def timed_step(self, seconds: float, n_seqs: int = 1) -> None:
        """A plain forward of n_seqs sequences took `seconds`."""
        old = self.steps.get(n_seqs)
        self.steps[n_seqs] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds

    def timed_verification(self, rows: int, seconds: float, n_seqs: int = 1) -> None:
        """A forward of n_seqs sequences and rows - n_seqs drafted rows (theirs and the others') took `seconds`,
        drafting included: what a row added, against the plain step of as many sequences."""
        plain = self.plain_s(n_seqs)
        if plain is None or rows <= n_seqs:
            return
        row = (seconds - plain) / (rows - n_seqs)  # unclipped: a noisy host's errors either way average out
        old = self.row_cost(n_seqs) * plain if self.row_s is None else self.row_s
        self.row_s = self.DECAY * old + (1 - self.DECAY) * row


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

    def __init__(self, mode: str, target_forward, drafter, k_max: int | None = None, k_min: int = 0):
        self.mode, self.target, self.drafter = mode, target_forward, drafter
        self.length = DraftLength(DRAFT_MAX[mode] if k_max is None else k_max, k_min)
        self.drafted = self.accepted = self.verifications = 0

    def propose(self, history, room: int, n_seqs: int = 1):
        """(drafted tokens, choices for SequenceState.step) after history, at most `room` tokens, in a forward of
        n_seqs sequences; None when no draft is worth it now (paused, nothing found, shorter than k_min, no room)."""
        k = self.plan(room, n_seqs)
        if k == 0:
            return None
        if isinstance(self.drafter, PromptLookup):
            tokens, qs = self.drafter.propose(history, k), None
        else:
            tokens, qs = self.drafter.propose(history, k)
        return self.choices(tokens, qs)

    def plan(self, room: int, n_seqs: int = 1) -> int:
        """How many tokens to draft now, at most room (0: none)."""
        k = min(self.length.want(n_seqs), room)
        return k if k > 0 and k >= self.length.k_min else 0

    def choices(self, tokens, qs):
        """(tokens, choices for SequenceState.step) of a drafter's proposal; None when it is too short to verify."""
        if not tokens or len(tokens) < self.length.k_min:
            return None
        return tokens, [(t, None, None) if qs is None or qs[i] is None else (t, *qs[i]) for i, t in enumerate(tokens)]

    def draft(self, history) -> Draft | None:
        """The target's logits after history[-1] (not yet in its cache) and a draft after it; None when no draft
        is worth it now (paused, nothing found, no room: the caller decodes one token plainly)."""
        room = min(self.target.n_batch, self.target.n_ctx - self.target.n_past) - 1  # the draft must fit without a shift
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
        self.length.update(drafted, accepted)

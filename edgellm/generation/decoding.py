"""One sequence's generation step by step: logit bias and processors, the sampler, end-of-generation, stop
strings and criteria, per-token info and log-probabilities, UTF-8-safe text pieces.

Shared by Model's single-sequence decode loop (edgellm/api.py) and batched generation (edgellm/generation/batch.py), so
a sequence behaves the same alone or in a batch: the forward passes differ, the choice of tokens does not.
"""
from __future__ import annotations

import codecs
import time

import numpy as np

from edgellm.errors import NumericalError, SamplingError
from edgellm.generation import logit_scan
from edgellm.generation.results import Completion, TokenInfo, top_logprobs_entry
from edgellm.generation.sampling import Sampler, token_logprobs
from edgellm.generation.textstream import TextStream


def max_new_tokens(requested, n_ctx: int, n_prompt: int, context_shift: bool) -> int:
    """How many tokens a sequence may generate: max_tokens None runs until the context is full (as
    llama-cpp-python); an explicit count is capped by the context only where a full context cannot shift."""
    limit = n_ctx - n_prompt
    if requested is None:
        return max(limit, 1 if context_shift else 0)
    return requested if context_shift else min(requested, limit)


def check_finite(logits: np.ndarray, where: str, found=None):
    """NumericalError when a row of logits holds NaN or Inf, before anything is sampled from it. Returns what
    the compiled pass found (SequenceState.step's `scanned`), or None where numpy checked. found: take_row's
    scan of this row, so that it is not read again."""
    if found is not None or logit_scan.readable(logits):
        n_bad, top_id, keys = logit_scan.scan(logits) if found is None else found  # one pass, no temporaries
        if n_bad == 0:
            return int(top_id), keys
    elif np.isfinite(logits).all():
        return None
    n_nan = int(np.isnan(logits).sum())
    n_inf = int(np.isinf(logits).sum())
    raise NumericalError(f"the model's logits {where} hold {n_nan} NaN and {n_inf} Inf of {logits.size} values: "
                         "a weight of this file is corrupt or overflows float32 (e.g. huge quantization "
                         "scales); nothing was sampled")


def take_row(row: np.ndarray):
    """(a copy of a row of logits, its scan for check_finite's `found`, or None) in one pass over the row: the
    engine reuses its logits buffer, so a row sampled after the next forward is copied out first."""
    if not logit_scan.readable(row):
        return np.array(row, copy=True), None
    copy = np.empty_like(row)
    return copy, logit_scan.scan(row, copy)


def logit_bias_arrays(opts, n_vocab: int):
    """opts.logit_bias as (ids, values) arrays, checked against the vocabulary; None without one."""
    if not opts.logit_bias:
        return None
    bias_ids = np.array(list(opts.logit_bias), dtype=np.int64)
    bad = bias_ids[(bias_ids < 0) | (bias_ids >= n_vocab)]
    if bad.size:
        raise SamplingError(f"logit_bias names token id {int(bad[0])}, outside the vocabulary [0, {n_vocab})")
    return bias_ids, np.array(list(opts.logit_bias.values()), dtype=np.float32)


def token_info(tok, token: int, offset: int, row, top_n, scanned=None) -> TokenInfo:
    """A token's TokenInfo; with a row of logits (the one it was chosen or scored from), its logprob and the top_n
    alternatives', of the model's own distribution."""
    info = TokenInfo(token, tok.token_to_bytes(token).decode("utf-8", errors="ignore"), offset)
    if row is not None and top_n is not None:
        lp = token_logprobs(row, token, top_n, scanned)
        info.logprob = lp.logprob
        info.top_logprobs = top_logprobs_entry(
            info.text, lp.logprob, [(tok.token_to_bytes(int(i)).decode("utf-8", errors="ignore"), v)
                                    for i, v in zip(lp.top_ids, lp.top_logprobs)])
    return info


class PromptScore:
    """Each prompt token's log-probability given the tokens before it (prompt_logprobs), from the prompt's logits
    rows as its prefill computes them, a batch at a time: the row at position i scores token i + 1, and the first
    token has none."""

    def __init__(self, tok, ids, top_n: int):
        self.tok, self.ids, self.top_n = tok, list(ids), top_n
        self._chars = codecs.getincrementaldecoder("utf-8")("ignore")
        self._offset = 0
        self.infos: list = []
        self._add(0, None)

    def _add(self, j: int, row) -> None:
        token = self.ids[j]
        self.infos.append(token_info(self.tok, token, self._offset, row, self.top_n))
        self._offset += len(self._chars.decode(self.tok.token_to_bytes(token)))

    def rows(self, b0: int, rows) -> None:
        """rows: the logits of prompt positions b0, b0 + 1, ..., in order (the prompt's last row scores nothing)."""
        for i in range(len(rows)):
            if b0 + i + 1 < len(self.ids):
                self._add(b0 + i + 1, rows[i])

    def prefill(self, fm, batches, cache=None) -> np.ndarray:
        """The prompt through the forward model fm (into `cache`, or fm's own) in its fresh `batches`, one forward
        each, every row's logits kept and scored as they come; the last row."""
        where = {} if cache is None else {"cache": cache}  # (forward models without other caches take no such key)
        for b0, b1 in batches:
            out = fm.forward(np.asarray(self.ids[b0:b1], dtype=np.int32), all_logits=True, **where)
            self.rows(b0, out)
        return out[-1]


class SequenceState:
    """Feed step() the logits after the prompt, then after each token it returned; stop when it returns None
    (an end-of-generation token) or .done is set (stop string, max_tokens, stopping criterion)."""

    def __init__(self, model, prompt_ids, opts, max_tokens: int, bias=None):
        self.model, self.opts, self.bias, self.max_tokens = model, opts, bias, max_tokens
        self.prompt_ids = list(prompt_ids)
        self.sampler = Sampler(opts.sampling, seed=opts.seed)
        self.text = TextStream(opts.stop)
        self.history = list(prompt_ids)
        self.generated: list[int] = []
        self.infos: list = []
        self.stop_reason = "length"
        self.done = max_tokens <= 0
        self.sample_s = 0.0
        self.prompt_info = None  # PromptScore.infos, where the options ask for prompt_logprobs
        self.constraint = None
        if opts.constraint is not None:  # each sequence its own matcher, from the grammar checked in the options
            from edgellm.generation.constrain import SequenceConstraint  # (imported only where one is asked for)
            self.constraint = SequenceConstraint(opts.constraint, model.tokenizer, model.n_vocab)

    def step(self, logits: np.ndarray, draft=None, scanned=None):
        """The next token from this row of logits: (text piece, TokenInfo), or None at end-of-generation.
        draft: (token, q_ids, q_probs) a drafter proposed here (edgellm.generation.speculative): the token is
        chosen by the rejection rule (Sampler.sample_draft), equal to the draft exactly when it is accepted.
        scanned: check_finite's result for this row, which the sampler reuses while the scores are the row."""
        opts, tok = self.opts, self.model.tokenizer
        ts = time.perf_counter()
        scores = logits
        if self.bias is not None:
            scores = scores.copy()
            scores[self.bias[0]] += self.bias[1]
        if opts.logits_processor is not None:
            scores = np.asarray(opts.logits_processor(np.asarray(self.history, dtype=np.intc), scores.copy()),
                                dtype=np.float32)
        if self.constraint is not None:  # before the sampler chain: it only ever sees allowed tokens
            scores = self.constraint.mask(scores, self.max_tokens - len(self.generated))
        held = scanned if scores is logits else None  # the scan describes the row, not scores made from it
        if draft is None:
            token = self.sampler.sample(scores, self.history, held)
        else:
            token = self.sampler.sample_draft(scores, self.history, *draft, scanned=held)
        if self.constraint is not None:  # near max_tokens, a token that leaves no room to complete is replaced
            token = self.constraint.vet(token, self.max_tokens - len(self.generated))
        self.sample_s += time.perf_counter() - ts
        if tok.is_eog(token) and (not opts.ignore_eos or self.constraint is not None):
            # under a grammar an end-of-generation token is only allowed where the grammar is complete
            self.stop_reason, self.done = "eog", True
            return None
        # logprobs of the model's own distribution, before biases and penalties, as llama-cpp-python reports
        info = token_info(tok, token, self.text.decoded_chars, logits, opts.logprobs, scanned)
        self.generated.append(token)
        self.history.append(token)
        self.infos.append(info)
        piece = self.text.push(tok.token_to_bytes(token))
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.text.stopped:
            self.stop_reason, self.done = "stop_string", True
        elif self.constraint is not None and self.constraint.complete:
            self.stop_reason, self.done = "constraint", True
        elif len(self.generated) >= self.max_tokens:
            self.done = True
        elif opts.stopping_criteria is not None and opts.stopping_criteria(
                np.asarray(self.history, dtype=np.intc), logits):
            self.stop_reason, self.done = "criteria", True
        return piece, info

    def finish(self):
        """(the last text piece held back for stop strings, the Completion)."""
        finish = "length" if self.stop_reason in ("length", "time_limit") else "stop"
        piece = self.text.finish(finish)
        return piece, Completion(self.text.text, self.generated, finish, len(self.prompt_ids), self.stop_reason,
                                 self.text.stop_string, self.infos, prompt_info=self.prompt_info)

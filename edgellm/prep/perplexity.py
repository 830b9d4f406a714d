"""Perplexity and KL divergence, by llama-perplexity's method (tools/perplexity/perplexity.cpp).

Perplexity: the text is tokenized once (with BOS where the model adds one), cut into chunks of n_ctx tokens
(whole chunks only), each chunk is evaluated from an empty cache with its first token replaced by BOS where the
model adds one, and only the second half of each chunk is scored: the logits at positions n_ctx/2 .. n_ctx-2
predict tokens n_ctx/2+1 .. n_ctx-1, so every scored token has at least n_ctx/2 tokens of context. PPL is
exp(mean negative log-likelihood); its uncertainty is the standard error of the mean NLL times PPL.

KL divergence: a perplexity run on the base model can save, for every scored position, the base model's
TOP_K most likely tokens with their log-probabilities and the NLL of the true next token (a compact .npz,
instead of llama.cpp's 16-bit log-probabilities of the whole vocabulary, ~100x smaller). A later run on another
model of the same vocabulary compares its distributions with those over the same tokens. The KL divergence is
computed over the base's top tokens plus one bucket for all the rest, so it is the KL of that coarse-grained
distribution: a lower bound of the full KL that differs from it only by how the last few percent of the
probability mass spread out (llama.cpp also leaves out tokens with base log-prob below -16).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np

from edgellm.errors import EdgeLLMError

DEFAULT_N_CTX = 512
TOP_K = 64  # base-model tokens saved per scored position for --kl-divergence
KL_FORMAT = "edgellm-kl-base-v1"


def _bos_policy(model) -> tuple[bool, int | None]:
    """(adds BOS, BOS id), read off the tokenizer's behaviour: the one thing llama.cpp asks the vocabulary."""
    plain, special = model.tokenize("a", add_special=False), model.tokenize("a", add_special=True)
    if len(special) == len(plain) + 1 and special[1:] == plain:
        return True, special[0]
    return False, None


def _log_rest_mass(logp: np.ndarray, top_ids: np.ndarray) -> np.ndarray:
    """log of the probability of every token outside each row's top_ids (-inf when they cover the vocabulary)."""
    rest = logp.copy()
    np.put_along_axis(rest, top_ids.astype(np.int64), -np.inf, axis=1)
    m = rest.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = m[:, 0] + np.log(np.exp(rest - np.where(np.isfinite(m), m, 0)).sum(axis=1))
    return np.where(np.isfinite(m[:, 0]), out, -np.inf)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    """Mean of a per-token quantity and the standard error of that mean (perplexity.cpp's helper)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total2 / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0


def chunk_tokens(tokens, n_ctx: int, n_chunks: int | None) -> list[np.ndarray]:
    """Whole chunks of n_ctx tokens, at most n_chunks of them; needs at least 2 * n_ctx tokens, as llama.cpp."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if n_ctx < 4:
        raise EdgeLLMError(f"the context must hold at least 4 tokens to score half of each chunk, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise EdgeLLMError(f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of {n_ctx}; "
                           f"the text tokenizes to only {len(tokens)} tokens")
    n = len(tokens) // n_ctx
    if n_chunks is not None and n_chunks > 0:
        n = min(n, n_chunks)
    return [tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n)]


def _chunk_log_probs(model, chunk: np.ndarray, add_bos: bool, bos_id):
    """Log-probabilities of the scored rows of one chunk and the tokens they predict."""
    ids = chunk.copy()
    if add_bos:
        ids[0] = bos_id
    first = len(ids) // 2
    logits = np.asarray(model.logits(ids))
    return _log_softmax(logits[first:len(ids) - 1]), ids[first + 1:]


@dataclass
class PerplexityResult:
    ppl: float
    ppl_error: float
    n_chunks: int
    n_scored: int
    chunk_estimates: list = field(default_factory=list)  # the running PPL after each chunk


def perplexity(model, tokens, n_ctx: int = DEFAULT_N_CTX, n_chunks: int | None = None, kl_base_path=None,
               out=None) -> PerplexityResult:
    """llama-perplexity on a token list (tokenize the text with model.tokenize(text), BOS included as the model
    wants). Prints the running estimate per chunk and llama.cpp's final line; with kl_base_path also saves the
    base distributions for kl_divergence()."""
    out = out or sys.stdout
    add_bos, bos_id = _bos_policy(model)
    chunks = chunk_tokens(tokens, n_ctx, n_chunks)
    nll_sum = nll2_sum = 0.0
    count = 0
    estimates, saved = [], {"top_ids": [], "top_logp": [], "rest_logp": [], "nll": []}
    print(f"perplexity: {len(chunks)} chunks of {n_ctx} tokens, scoring the last {n_ctx - n_ctx // 2 - 1} of each",
          file=out)
    for i, chunk in enumerate(chunks):
        logp, targets = _chunk_log_probs(model, chunk, add_bos, bos_id)
        nll = -logp[np.arange(len(targets)), targets]
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        count += len(nll)
        estimates.append(math.exp(nll_sum / count))
        print(f"[{i + 1}]{estimates[-1]:.4f},", end="", file=out, flush=True)
        if kl_base_path is not None:
            k = min(TOP_K, logp.shape[1])
            top = np.argpartition(-logp, k - 1, axis=1)[:, :k]
            order = np.argsort(-np.take_along_axis(logp, top, axis=1), axis=1, kind="stable")
            top = np.take_along_axis(top, order, axis=1)
            saved["top_ids"].append(top.astype(np.int32))
            saved["top_logp"].append(np.take_along_axis(logp, top, axis=1).astype(np.float32))
            saved["rest_logp"].append(_log_rest_mass(logp, top))
            saved["nll"].append(nll.astype(np.float64))
    print(file=out)
    mean, err = mean_and_uncertainty(nll_sum, nll2_sum, count)
    ppl = math.exp(mean)
    print(f"Final estimate: PPL = {ppl:.4f} +/- {err * ppl:.5f}", file=out, flush=True)
    if kl_base_path is not None:
        with open(kl_base_path, "wb") as f:  # a file object: np.savez would otherwise append ".npz" to the name
            np.savez(f, format=np.array(KL_FORMAT), n_ctx=np.int64(n_ctx), n_vocab=np.int64(logp.shape[1]),
                     tokens=np.concatenate(chunks), **{k: np.concatenate(v) for k, v in saved.items()})
        print(f"saved the base model's top-{min(TOP_K, logp.shape[1])} log-probabilities to {kl_base_path}", file=out)
    return PerplexityResult(ppl, err * ppl, len(chunks), count, estimates)


def load_kl_base(path) -> dict:
    try:
        with np.load(path, allow_pickle=False) as z:
            base = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise EdgeLLMError(f"{path}: not a KL-divergence base file written by `edgellm perplexity "
                           f"--kl-divergence-base` ({e})") from None
    if str(base.get("format")) != KL_FORMAT:
        raise EdgeLLMError(f"{path}: not a KL-divergence base file (format {base.get('format')!r})")
    return base


@dataclass
class KLResult:
    ppl: float
    ppl_error: float
    ppl_base: float
    ppl_base_error: float
    log_ppl_ratio: float
    log_ppl_ratio_error: float
    kld_mean: float
    kld_error: float
    kld_percentiles: dict   # "max", "99.9", "99", "90", "median", "10", "min" -> value
    p_diff_rms: float       # RMS of p(true token) - p_base(true token)
    same_top: float         # fraction of positions where both models' most likely token agree
    same_top_error: float
    n_scored: int


def _kl_to_base(logp: np.ndarray, top_ids: np.ndarray, top_logp: np.ndarray, rest_logp: np.ndarray) -> np.ndarray:
    """KL(base || model) per row over the base's top tokens plus one bucket for the rest."""
    top_logp = top_logp.astype(np.float64)
    q_logp_top = np.take_along_axis(logp, top_ids.astype(np.int64), axis=1)
    kl = (np.exp(top_logp) * (top_logp - q_logp_top)).sum(axis=1)
    has_rest = np.isfinite(rest_logp)
    if has_rest.any():
        q_rest = _log_rest_mass(logp[has_rest], top_ids[has_rest])
        kl[has_rest] += np.exp(rest_logp[has_rest]) * (rest_logp[has_rest] - q_rest)
    return np.maximum(kl, 0.0)  # the float32 saved log-probs can leave a tiny negative where the two agree


def kl_divergence(model, base_path, n_chunks: int | None = None, out=None) -> KLResult:
    """Compare `model` with the base distributions saved by perplexity(..., kl_base_path=...), over the base's
    tokens; prints a line per chunk and llama-perplexity's summary statistics."""
    out = out or sys.stdout
    base = load_kl_base(base_path)
    n_ctx, n_vocab = int(base["n_ctx"]), int(base["n_vocab"])
    add_bos, bos_id = _bos_policy(model)
    chunks = list(base["tokens"].reshape(-1, n_ctx))  # the base run's chunks, exactly
    if n_chunks is not None and n_chunks > 0:
        chunks = chunks[:n_chunks]
    per_chunk = n_ctx - n_ctx // 2 - 1
    sums = dict(nll=0.0, nll2=0.0, nllb=0.0, nllb2=0.0, nll_nllb=0.0, pd2=0.0, pd4=0.0, same=0)
    kld_values, count = [], 0
    print("chunk        PPL            ln(PPL(Q)/PPL(base))       KL Divergence        Same top p", file=out)
    for i, chunk in enumerate(chunks):
        logp, targets = _chunk_log_probs(model, chunk, add_bos, bos_id)
        if logp.shape[1] != n_vocab:
            raise EdgeLLMError(f"the model has {logp.shape[1]} tokens but the base file was computed with {n_vocab}")
        rows = slice(i * per_chunk, (i + 1) * per_chunk)
        top_ids, top_logp, nll_base = base["top_ids"][rows], base["top_logp"][rows], base["nll"][rows]
        rest_logp = base["rest_logp"][rows]
        nll = -logp[np.arange(len(targets)), targets]
        kld_values.append(_kl_to_base(logp, top_ids, top_logp, rest_logp))
        p_diff = np.exp(-nll) - np.exp(-nll_base)
        sums["nll"] += nll.sum()
        sums["nll2"] += (nll * nll).sum()
        sums["nllb"] += nll_base.sum()
        sums["nllb2"] += (nll_base * nll_base).sum()
        sums["nll_nllb"] += (nll * nll_base).sum()
        sums["pd2"] += (p_diff ** 2).sum()
        sums["pd4"] += (p_diff ** 4).sum()
        sums["same"] += int((logp.argmax(axis=1) == top_ids[:, 0]).sum())
        count += len(nll)
        stats = _kl_stats(sums, np.concatenate(kld_values), count)
        print(f"{i + 1:4d}  {stats.ppl:10.4f} ± {stats.ppl_error:8.4f}  {stats.log_ppl_ratio:10.5f} ± "
              f"{stats.log_ppl_ratio_error:9.5f}  {stats.kld_mean:10.5f} ± {stats.kld_error:9.5f}  "
              f"{100 * stats.same_top:7.3f} ± {100 * stats.same_top_error:6.3f} %", file=out, flush=True)
    print_kl_summary(stats, out)
    return stats


def _kl_stats(s: dict, kld: np.ndarray, count: int) -> KLResult:
    log_ppl, log_ppl_err = mean_and_uncertainty(s["nll"], s["nll2"], count)
    log_base, log_base_err = mean_and_uncertainty(s["nllb"], s["nllb2"], count)
    cov = ((s["nll_nllb"] / count - (s["nll"] / count) * (s["nllb"] / count)) / (count - 1)) if count >= 10 else 0.0
    ratio_err = math.sqrt(max(0.0, log_ppl_err ** 2 + log_base_err ** 2 - 2 * cov))
    kld_mean, kld_err = mean_and_uncertainty(float(kld.sum()), float((kld * kld).sum()), count)
    same = s["same"] / count
    q = np.percentile(kld, [100, 99.9, 99, 90, 50, 10, 0])
    return KLResult(
        ppl=math.exp(log_ppl), ppl_error=math.exp(log_ppl) * log_ppl_err,
        ppl_base=math.exp(log_base), ppl_base_error=math.exp(log_base) * log_base_err,
        log_ppl_ratio=log_ppl - log_base, log_ppl_ratio_error=ratio_err, kld_mean=kld_mean, kld_error=kld_err,
        kld_percentiles=dict(zip(("max", "99.9", "99", "90", "median", "10", "min"), map(float, q))),
        p_diff_rms=math.sqrt(s["pd2"] / count), same_top=same,
        same_top_error=math.sqrt(same * (1 - same) / (count - 1)) if count > 1 else 0.0, n_scored=count)


def print_kl_summary(r: KLResult, out=None) -> None:
    out = out or sys.stdout
    print("\n====== Perplexity statistics ======", file=out)
    print(f"Mean PPL(Q)                   : {r.ppl:10.6f} ± {r.ppl_error:10.6f}", file=out)
    print(f"Mean PPL(base)                : {r.ppl_base:10.6f} ± {r.ppl_base_error:10.6f}", file=out)
    print(f"Mean ln(PPL(Q)/PPL(base))     : {r.log_ppl_ratio:10.6f} ± {r.log_ppl_ratio_error:10.6f}", file=out)
    print("\n====== KL divergence statistics ======", file=out)
    print(f"Mean    KLD: {r.kld_mean:10.6f} ± {r.kld_error:10.6f}", file=out)
    for name, label in (("max", "Maximum KLD"), ("99.9", "99.9%   KLD"), ("99", "99.0%   KLD"),
                        ("90", "90.0%   KLD"), ("median", "Median  KLD"), ("10", "10.0%   KLD"),
                        ("min", "Minimum KLD")):
        print(f"{label}: {r.kld_percentiles[name]:10.6f}", file=out)
    print("\n====== Token probability statistics ======", file=out)
    print(f"RMS Δp    : {100 * r.p_diff_rms:6.3f} %", file=out)
    print(f"Same top p: {100 * r.same_top:6.3f} ± {100 * r.same_top_error:5.3f} %", file=out, flush=True)

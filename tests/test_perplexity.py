"""edgellm.prep.perplexity: llama-perplexity's chunking and scoring, checked on small fake models whose
probabilities are known exactly, plus one run of the CLI on the real SmolLM2."""

import io
import math
import re

import numpy as np
import pytest

from edgellm.prep import perplexity as P
from edgellm.errors import EdgeLLMError

N_VOCAB = 40
BOS = 1
EXACT = 1e-9  # float64 throughout: the module and the independent loop below must agree to rounding
FINAL_LINE = re.compile(r"^Final estimate: PPL = \d+\.\d{4} \+/- \d+\.\d{5}$", re.M)


class FakeModel:
    """Logits that depend on the previous token and the position (a table), so every scored row differs;
    records what it was asked to evaluate."""

    def __init__(self, add_bos=True, seed=0, temperature=1.0):
        rng = np.random.default_rng(seed)
        self.table = rng.standard_normal((N_VOCAB, N_VOCAB)) * 2.0 / temperature
        self.add_bos = add_bos
        self.calls = []

    def tokenize(self, text, add_special=True):
        ids = [2 + (ord(c) % (N_VOCAB - 2)) for c in text]
        return ([BOS] if add_special and self.add_bos else []) + ids

    def logits(self, ids):
        ids = np.asarray(ids)
        self.calls.append(ids.copy())
        return (self.table[ids] + 0.01 * np.arange(len(ids))[:, None]).astype(np.float32)


def reference_ppl(model, tokens, n_ctx, n_chunks=None):
    """perplexity.cpp's loop, written out: whole chunks, BOS swapped in, rows n_ctx/2 .. n_ctx-2 scored."""
    n = len(tokens) // n_ctx if n_chunks is None else min(n_chunks, len(tokens) // n_ctx)
    nlls = []
    for c in range(n):
        chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if model.add_bos:
            chunk[0] = BOS
        logits = (model.table[chunk] + 0.01 * np.arange(n_ctx)[:, None]).astype(np.float32).astype(np.float64)
        for pos in range(n_ctx // 2, n_ctx - 1):
            row = logits[pos]
            lse = row.max() + math.log(np.exp(row - row.max()).sum())
            nlls.append(lse - row[chunk[pos + 1]])
    nlls = np.array(nlls)
    ppl = math.exp(nlls.mean())
    return ppl, ppl * nlls.std(ddof=0) * math.sqrt(1 / (len(nlls) - 1)), len(nlls)


TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 3


@pytest.mark.parametrize("add_bos", [True, False])
def test_perplexity_matches_llama_cpp_method(add_bos):
    model = FakeModel(add_bos=add_bos)
    tokens = model.tokenize(TEXT)
    out = io.StringIO()
    r = P.perplexity(model, tokens, n_ctx=32, out=out)
    ppl, err, count = reference_ppl(model, tokens, 32)
    assert r.n_chunks == len(tokens) // 32 and r.n_scored == count == r.n_chunks * (32 - 16 - 1)
    assert r.ppl == pytest.approx(ppl, rel=EXACT) and r.ppl_error == pytest.approx(err, rel=1e-6)
    assert FINAL_LINE.search(out.getvalue())
    assert f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}" in out.getvalue()
    assert re.search(r"\[1\]\d+\.\d{4},\[2\]", out.getvalue())  # the running estimate, per chunk
    for c, ids in enumerate(model.calls):  # each chunk from an empty context, BOS first where the model adds one
        assert len(ids) == 32
        assert ids[0] == (BOS if add_bos else tokens[c * 32])
        assert list(ids[1:]) == tokens[c * 32 + 1:(c + 1) * 32]


def test_chunks_limits_the_work_and_too_short_a_text_is_refused():
    model = FakeModel()
    tokens = model.tokenize(TEXT)
    r = P.perplexity(model, tokens, n_ctx=32, n_chunks=2, out=io.StringIO())
    assert r.n_chunks == 2 and len(model.calls) == 2
    assert r.ppl == pytest.approx(reference_ppl(model, tokens, 32, n_chunks=2)[0], rel=EXACT)
    with pytest.raises(EdgeLLMError, match="at least 64 tokens"):
        P.perplexity(model, tokens[:63], n_ctx=32, out=io.StringIO())


def test_a_sharper_model_has_lower_perplexity():
    """A model that puts all its mass on the true next token approaches PPL 1."""
    tokens = FakeModel().tokenize(TEXT)

    class Oracle(FakeModel):
        def logits(self, ids):
            out = np.zeros((len(ids), N_VOCAB), np.float32)
            nxt = np.r_[ids[1:], 0]
            out[np.arange(len(ids)), nxt] = 30.0
            return out

    assert P.perplexity(Oracle(), tokens, n_ctx=32, out=io.StringIO()).ppl < 1.0 + 1e-6
    assert P.perplexity(FakeModel(), tokens, n_ctx=32, out=io.StringIO()).ppl > 2


def exact_kl(base, model, tokens, n_ctx):
    """KL(base || model) over the full vocabulary at every scored position."""
    kls = []
    for c in range(len(tokens) // n_ctx):
        chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        chunk[0] = BOS
        lp, lq = (P._log_softmax(m.logits(chunk))[n_ctx // 2:n_ctx - 1] for m in (base, model))
        kls.append((np.exp(lp) * (lp - lq)).sum(axis=1))
    return np.concatenate(kls)


def test_kl_divergence_against_a_saved_base(tmp_path):
    base, other = FakeModel(seed=0), FakeModel(seed=0, temperature=1.5)
    tokens = base.tokenize(TEXT)
    path = tmp_path / "base.kld"
    P.perplexity(base, tokens, n_ctx=32, kl_base_path=path, out=io.StringIO())
    assert path.exists()  # the name given, no ".npz" appended

    same = P.kl_divergence(FakeModel(seed=0), path, out=io.StringIO())
    assert same.kld_mean == pytest.approx(0.0, abs=1e-6) and same.same_top == 1.0
    assert same.ppl == pytest.approx(same.ppl_base, rel=1e-9)

    out = io.StringIO()
    r = P.kl_divergence(other, path, out=out)
    expected = exact_kl(base, other, tokens, 32)
    # TOP_K >= N_VOCAB: the saved top tokens cover the whole vocabulary, so the KL is exact
    assert r.kld_mean == pytest.approx(expected.mean(), rel=1e-5)
    assert r.kld_percentiles["max"] == pytest.approx(expected.max(), rel=1e-5)
    assert r.ppl_base == pytest.approx(reference_ppl(base, tokens, 32)[0], rel=1e-9)
    assert 0 < r.same_top <= 1
    assert "Mean    KLD:" in out.getvalue() and "Same top p:" in out.getvalue()


def test_kl_with_fewer_saved_tokens_is_a_close_lower_bound(tmp_path, monkeypatch):
    """With only the top 8 of 40 tokens saved, the rest lumped together: KL(coarse) <= KL(full), and close."""
    monkeypatch.setattr(P, "TOP_K", 8)
    base, other = FakeModel(seed=0, temperature=0.5), FakeModel(seed=0, temperature=0.6)
    tokens = base.tokenize(TEXT)
    P.perplexity(base, tokens, n_ctx=32, kl_base_path=tmp_path / "b", out=io.StringIO())
    r = P.kl_divergence(other, tmp_path / "b", out=io.StringIO())
    exact = exact_kl(base, other, tokens, 32).mean()
    assert r.kld_mean <= exact + 1e-9
    assert r.kld_mean > 0.8 * exact


def test_kl_refuses_a_model_with_another_vocabulary(tmp_path):
    P.perplexity(FakeModel(), FakeModel().tokenize(TEXT), n_ctx=32, kl_base_path=tmp_path / "b", out=io.StringIO())

    class Bigger(FakeModel):
        def logits(self, ids):
            return np.zeros((len(ids), N_VOCAB + 1), np.float32)

    with pytest.raises(EdgeLLMError, match="41 tokens"):
        P.kl_divergence(Bigger(), tmp_path / "b", out=io.StringIO())
    (tmp_path / "junk").write_bytes(b"not a base file")
    with pytest.raises(EdgeLLMError, match="not a KL-divergence base file"):
        P.kl_divergence(FakeModel(), tmp_path / "junk", out=io.StringIO())


def test_cli_perplexity_on_smollm2(smollm2_path, tmp_path, capsys):
    from edgellm.cli import main
    text = tmp_path / "text.txt"
    text.write_text(("Once upon a time there was a small village by the sea. The people there fished every "
                     "morning and told stories every night. ") * 6, encoding="utf-8")
    assert main(["perplexity", str(smollm2_path), str(text), "-c", "64", "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    m = FINAL_LINE.search(out)
    assert m, out
    ppl = float(re.search(r"PPL = (\S+)", out).group(1))
    assert 1.0 < ppl < 50  # repeated English text: a working model finds it easy

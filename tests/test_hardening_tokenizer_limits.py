"""Adversarial text and vocabularies: special-token splitting in one pass, word caches bounded by size, the
tokenizer's vocabulary checked against the embedding rows, and no mapped file left behind by a failed load."""
import signal

import pytest

import hardening_tiny
from conftest import GEMMA
from edgellm.engine import gguf
from edgellm import load
from edgellm.errors import EdgeLLMError, ModelError
from edgellm.tokenizer import Tokenizer
from edgellm.tokenizer.vocab import SpecialTokenMatcher

# one split per token over every fragment took minutes on this text; one pass takes well under a second
SPLIT_DEADLINE_S = 20


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_path):
    with gguf.open(gemma_path) as f:
        return Tokenizer.from_metadata(f.metadata)


class _Deadline(Exception):
    pass


def _run_with_deadline(seconds, fn):
    def on_alarm(signum, frame):
        raise _Deadline()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_gemma_text_full_of_distinct_unused_tokens_splits_in_one_pass(gemma_tokenizer):
    vocab = gemma_tokenizer.vocab
    unused = [t for t in (vocab.tokens[i] for i in range(vocab.n_vocab)) if t.startswith("<unused")]
    assert len(unused) > 6000  # Gemma 3's reserved tokens: the vocabulary this guards against
    text = " x ".join(unused * 4)
    try:
        parts = _run_with_deadline(SPLIT_DEADLINE_S, lambda: vocab.special_matcher(True).split(text))
    except _Deadline:
        pytest.fail(f"splitting {len(text):,} characters took over {SPLIT_DEADLINE_S} s")
    ids = [p for p in parts if isinstance(p, int)]
    assert ids == [vocab.token_to_id[t] for t in unused * 4]
    assert all(p == " x " for p in parts if isinstance(p, str))


@pytest.mark.parametrize("specials, text, expected", [
    # a longer token claims first even when a shorter one starts earlier
    ([(0, "ab"), (1, "bcd")], "abcd", ["a", 1]),
    # a longer token blocked by a higher-priority one leaves room for its own prefix at the same position
    ([(1, "<a>b"), (0, "bxyz"), (2, "<a>")], "<a>bxyz", [2, 0]),
    # overlapping occurrences of one token: leftmost first, then after it, as str.split does
    ([(0, "aa")], "aaaaa", [0, 0, "a"]),
    # equal byte lengths: the lower id wins
    ([(5, "xy"), (3, "yz")], "xyz", ["x", 3]),
])
def test_special_split_keeps_llama_cpp_priority_order(specials, text, expected):
    assert SpecialTokenMatcher(specials).split(text) == expected


def test_long_words_are_not_cached(smollm2_path, gemma_tokenizer):
    with gguf.open(smollm2_path) as f:
        bpe = Tokenizer.from_metadata(f.metadata)
    for tok, word in ((bpe, "z" * 20_000), (gemma_tokenizer, "q" * 20_000)):
        tok.encode(word, add_special=False)
        cached = tok._model._cache
        assert len(cached) <= 2 and all(len(w) < 1000 for w in getattr(cached, "_entries", cached))
        tok.encode("hello", add_special=False)  # short words still are
        assert len(cached) >= 1


def test_word_cache_stays_within_its_byte_budget():
    from edgellm.tokenizer.wordcache import WordCache
    cache = WordCache(budget_bytes=100_000)
    for i in range(5_000):
        cache.put(f"word{i:05d}" * 20, list(range(40)))
        assert cache.nbytes <= 100_000
    assert 0 < len(cache) < 5_000


def test_vocabulary_larger_than_the_embedding_is_refused_at_load(tmp_path):
    path = hardening_tiny.write_loadable_tiny_model(
        tmp_path / "short_embd.gguf", hardening_tiny.tiny_spec(n_vocab=hardening_tiny.N_VOCAB - 16))
    with pytest.raises(ModelError, match="token_embd.weight has only"):
        load(str(path), n_ctx=64, n_threads=1)


def _mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return str(path) in f.read()


@pytest.mark.parametrize("failure", ["tokenizer", "model"])
def test_failed_load_unmaps_the_file(tmp_path, monkeypatch, failure):
    path = tmp_path / f"bad_{failure}.gguf"
    if failure == "tokenizer":
        monkeypatch.setitem(hardening_tiny.TOKENIZER, "tokenizer.ggml.model", "no-such-tokenizer")
        hardening_tiny.write_loadable_tiny_model(path)
    else:
        hardening_tiny.write_loadable_tiny_model(path, drop=("output_norm.weight",))
    with pytest.raises(EdgeLLMError) as excinfo:  # the traceback is kept alive on purpose, as a REPL would
        load(str(path), n_ctx=64, n_threads=1)
    assert not _mapped(path), f"{path.name} is still mapped after {excinfo.value!r}"

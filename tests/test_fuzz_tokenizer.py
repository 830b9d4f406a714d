"""Both real tokenizers under fuzzing: a deterministic sample of tools/fuzz_tokenizer.py's cases (the long run is
`tools/fuzz_tokenizer.py --cases 100000`), and regressions for what the fuzzer found: lone surrogates, byte tokens
whose text is not <0xNN>, and metadata values of the wrong type each raised ValueError or TypeError, not
TokenizerError."""
import sys
from pathlib import Path

import numpy as np
import pytest

from edgellm.errors import TokenizerError
from edgellm.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import fuzz_tokenizer  # noqa: E402

SAMPLE_CASES = 1200          # ~4 s with both tokenizers
SAMPLE_LONG_LENGTHS = (5_000, 20_000)   # characters; the long run goes to 200,000
SAMPLE_TIME_LIMIT_S = 30.0   # per case, generous for a loaded 2-core machine: the slowest case takes ~0.5 s
GEMMA_SPECIAL_STRIDE = 8     # Gemma has 6,414 special tokens (~1.3 ms each); the long run checks all of them


@pytest.fixture(scope="module")
def subjects(smollm2_path, gemma_path):
    return {s.name: s for s in fuzz_tokenizer.load_subjects()}


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma-3-270m"])
def subject(request, subjects):
    return subjects[request.param]


def test_fuzz_sample_has_no_crash_and_no_hang(subjects):
    report = fuzz_tokenizer.run_campaign(SAMPLE_CASES, seed=0, subjects=list(subjects.values()),
                                         time_limit_s=SAMPLE_TIME_LIMIT_S, long_lengths=SAMPLE_LONG_LENGTHS)
    assert report.crashes == [], report.crashes[:5]
    assert report.hangs == []
    kinds = report.kinds
    assert set(kinds) == {"text", "special", "long", "decode", "metadata"}
    assert all(kinds[k].get("ok", 0) > 0 for k in kinds)
    # refusals happen where they must: surrogates, out-of-range ids, corrupt metadata
    assert all(kinds[k].get("error", 0) > 0 for k in ("text", "decode", "metadata"))


def test_special_token_texts_encode_to_themselves(subject):
    stride = GEMMA_SPECIAL_STRIDE if subject.name.startswith("gemma") else 1
    for token_id in subject.specials[::stride]:
        assert fuzz_tokenizer.check_special_alone(subject, token_id) == ""


@pytest.mark.parametrize("text", ["\udcff", "abc \udc80\udc81 def", "<|im_end|>\ud800", "é" * 50 + "\udfff"])
def test_lone_surrogates_raise_tokenizer_error(subject, text):
    for parse_special in (False, True):
        with pytest.raises(TokenizerError, match="lone surrogate"):
            subject.tokenizer.encode(text, parse_special=parse_special)


def test_surrogateescaped_bytes_after_replace_tokenize(subject):
    raw = b"ok \xff\xfe\xc3( end"
    with pytest.raises(TokenizerError):
        subject.tokenizer.encode(raw.decode("utf-8", "surrogateescape"))
    ids = subject.tokenizer.encode(raw.decode("utf-8", "replace"), add_special=False)
    assert subject.tokenizer.decode(ids) == "ok \ufffd\ufffd\ufffd( end"


@pytest.mark.parametrize("bad", [-1, -(2**63), 2**31, 2**63, 2**100, "n_vocab"])
def test_out_of_range_ids_raise_tokenizer_error(subject, bad):
    tok = subject.tokenizer
    bad = tok.n_vocab if bad == "n_vocab" else bad
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([1, 2, bad])
    with pytest.raises(TokenizerError, match="out of range"):
        tok.token_to_bytes(bad)
    with pytest.raises(TokenizerError, match="out of range"):
        tok.token_to_bytes(bad, special=True)


def test_numpy_id_arrays_decode_like_lists(subject):
    ids = list(range(300, 340))
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        assert subject.tokenizer.decode(np.array(ids, dtype)) == subject.tokenizer.decode(ids)


def test_byte_token_with_a_malformed_text_raises_tokenizer_error(subjects):
    md = dict(subjects["gemma-3-270m"].metadata)
    tokens = list(md["tokenizer.ggml.tokens"])
    byte_a = tokens.index("<0x41>")
    tokens[byte_a] = "<0xZZ>"
    md["tokenizer.ggml.tokens"] = tokens
    tok = Tokenizer.from_metadata(md)
    with pytest.raises(TokenizerError, match=r"token \d+ is typed as a byte token.*<0xZZ>"):
        tok.decode([byte_a])
    assert tok.decode([tokens.index("<0x42>")]) == "B"


WRONG_TYPES = [
    ("tokenizer.ggml.model", np.array([1, 2], np.int32)),
    ("tokenizer.ggml.pre", ["smollm"]),
    ("tokenizer.ggml.tokens", np.arange(10, dtype=np.int32)),
    ("tokenizer.ggml.tokens", 1.5),
    ("tokenizer.ggml.scores", ["a", "b"]),
    ("tokenizer.ggml.scores", 7),
    ("tokenizer.ggml.token_type", "normal"),
    ("tokenizer.ggml.bos_token_id", np.array([1, 2], np.int32)),
    ("tokenizer.ggml.eos_token_id", "x"),
    ("tokenizer.ggml.eos_token_id", float("inf")),
    ("tokenizer.ggml.add_bos_token", np.ones(3, bool)),
    ("tokenizer.ggml.add_space_prefix", "yes"),
    ("tokenizer.ggml.merges", 3.0),
]


@pytest.mark.parametrize("key,value", WRONG_TYPES, ids=[f"{k.rsplit('.', 1)[1]}-{type(v).__name__}"
                                                         for k, v in WRONG_TYPES])
def test_metadata_of_the_wrong_type_raises_tokenizer_error(subjects, key, value):
    md = dict(subjects["smollm2-135m"].metadata)   # BPE: every key above is read
    md[key] = value
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata(md)

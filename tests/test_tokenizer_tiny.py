"""Hand-built vocabularies that pin down the rules: BPE merge order, SPM score order, byte fallback, special-token
partitioning, BOS/EOS/space-prefix flags and end-of-generation detection. Expected ids are worked out by hand."""
import numpy as np
import pytest

from edgellm.errors import TokenizerError
from edgellm.tokenizer import Tokenizer
from edgellm.tokenizer.unicode_classes import BYTE_TO_UNICODE

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6

# --- byte-level BPE ------------------------------------------------------------------------------------------
BPE_PIECES = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "Ġworld", "bc", "ab", "aa"]
BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor ld", "b c", "a b", "a a", "l d"]
BPE_SPECIALS = [("<|endoftext|>", CONTROL), ("<|im_end|>", CONTROL), ("<tool>", USER_DEFINED),
                ("xyz", USER_DEFINED), ("wx", USER_DEFINED)]


def bpe_metadata(**extra):
    tokens = [BYTE_TO_UNICODE[b] for b in range(256)] + BPE_PIECES + ["ld"] + [t for t, _ in BPE_SPECIALS]
    types = [NORMAL] * (len(tokens) - len(BPE_SPECIALS)) + [k for _, k in BPE_SPECIALS]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": np.array(types, np.int32), "tokenizer.ggml.merges": BPE_MERGES,
          "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
          "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>")}
    md.update(extra)
    return md


@pytest.fixture(scope="module")
def bpe():
    return Tokenizer.from_metadata(bpe_metadata())


def _ids(tok, *texts):
    return [tok.vocab.token_to_id[t] for t in texts]


def test_bpe_merges_follow_rank(bpe):
    assert bpe.encode("hello world") == _ids(bpe, "hello", "Ġworld")
    # "b c" (rank 8) beats "a b" (rank 9): a|bc, not ab|c
    assert bpe.encode("abc") == _ids(bpe, "a", "bc")
    # equal ranks merge leftmost first: aa|a
    assert bpe.encode("aaa") == _ids(bpe, "aa", "a")


def test_bpe_bytes_of_unseen_characters(bpe):
    # no merges apply to é: it stays as its two UTF-8 bytes, each a byte-level token
    assert bpe.encode("é") == [bpe.vocab.token_to_id[BYTE_TO_UNICODE[b]] for b in "é".encode("utf-8")]
    assert bpe.decode(bpe.encode("é hello")) == "é hello"


def test_bpe_special_tokens(bpe):
    end = bpe.vocab.token_to_id["<|endoftext|>"]
    tool = bpe.vocab.token_to_id["<tool>"]
    # control tokens need parse_special; user-defined ones are always matched
    assert bpe.encode("hello<|endoftext|>", parse_special=True) == _ids(bpe, "hello") + [end]
    assert end not in bpe.encode("hello<|endoftext|>", parse_special=False)
    assert bpe.encode("a<tool>b", parse_special=False) == _ids(bpe, "a") + [tool] + _ids(bpe, "b")
    # llama.cpp partitions by the longest special token first, wherever it is: w|xyz, not wx|yz
    assert bpe.encode("wxyz") == _ids(bpe, "w", "xyz")


def test_bpe_flags_and_end_of_generation(bpe):
    assert not bpe.add_bos and bpe.encode("") == []
    with_bos = Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.add_bos_token": True,
                                                       "tokenizer.ggml.add_eos_token": True}))
    end = with_bos.vocab.token_to_id["<|endoftext|>"]
    assert with_bos.encode("hello") == [end] + _ids(with_bos, "hello") + [end]
    assert with_bos.encode("hello", add_special=False) == _ids(with_bos, "hello")
    im_end = bpe.vocab.token_to_id["<|im_end|>"]
    assert bpe.is_eog(end) and bpe.is_eog(im_end) and not bpe.is_eog(bpe.vocab.token_to_id["<tool>"])
    assert bpe.eot_id == im_end   # <|im_end|> comes before <|endoftext|> in llama.cpp's EOT list
    # llama3-style pre-tokenizers add BOS by default
    llama3 = Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.pre": "llama-bpe"}))
    assert llama3.add_bos and llama3.encode("hello")[0] == llama3.bos_id


def test_bpe_decode_control_and_user_defined(bpe):
    ids = bpe.encode("hello<|endoftext|><tool>", parse_special=True)
    assert bpe.decode(ids) == "hello<tool>"
    assert bpe.decode(ids, special=True) == "hello<|endoftext|><tool>"


# --- SentencePiece-style ------------------------------------------------------------------------------------
def spm_metadata(**extra):
    pieces = [("<unk>", -1000.0, 2), ("<s>", -1000.0, CONTROL), ("</s>", -1000.0, CONTROL),
              ("<start_of_turn>", 0.0, CONTROL), ("<end_of_turn>", 0.0, CONTROL), ("\n", 0.0, USER_DEFINED)]
    pieces += [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
    # scores: higher merges first
    pieces += [(p, s, NORMAL) for p, s in [
        ("▁", -1.0), ("h", -2.0), ("e", -2.0), ("l", -2.0), ("o", -2.0), ("a", -2.0), ("b", -2.0), ("c", -2.0),
        ("▁h", -3.0), ("he", -5.0), ("ll", -4.0), ("hell", -6.0), ("hello", -7.0), ("▁hello", -8.0),
        ("ab", -9.0), ("bc", -3.0), ("aa", -3.0), ("▁a", -20.0)]]
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [p for p, _, _ in pieces],
          "tokenizer.ggml.scores": np.array([s for _, s, _ in pieces], np.float32),
          "tokenizer.ggml.token_type": np.array([t for _, _, t in pieces], np.int32)}
    md.update(extra)
    return md


@pytest.fixture(scope="module")
def spm():
    return Tokenizer.from_metadata(spm_metadata())


def test_spm_merges_by_score_with_space_prefix(spm):
    # SPM defaults: BOS id 1 added, a space prefix; "▁h" (-3) merges before "he" (-5), so "hello" is reached
    # as ▁h|e|ll|o -> ... and stops at the best pieces available: ▁h, e, ll, o
    assert spm.add_bos and spm.bos_id == 1 and spm.eos_id == 2
    assert spm.encode("hello") == [1] + _ids(spm, "▁h", "e", "ll", "o")
    # without the space prefix "hello" is one piece: he(-5) after ll(-4), then hell, hello
    no_prefix = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert no_prefix.encode("hello", add_special=False) == _ids(no_prefix, "hello")
    assert no_prefix.encode(" hello", add_special=False) == _ids(no_prefix, "▁h", "e", "ll", "o")
    assert spm.encode("abc", add_special=False) == _ids(spm, "▁a", "bc")   # bc (-3) beats ab (-9)
    assert no_prefix.encode("aaa", add_special=False) == _ids(no_prefix, "aa", "a")   # ties: leftmost first


def test_spm_byte_fallback_and_decode(spm):
    ids = spm.encode("hé", add_special=False)
    assert ids == _ids(spm, "▁h", "<0xC3>", "<0xA9>")
    assert spm.token_to_bytes(ids[1]) == b"\xc3"
    assert spm.decode(ids) == "hé"             # the space the prefix added is removed again
    assert spm.decode(spm.encode("hello")) == "hello"


def test_spm_special_tokens_and_prefix_after_them(spm):
    sot, eot = _ids(spm, "<start_of_turn>", "<end_of_turn>")
    ids = spm.encode("<start_of_turn>hello<end_of_turn>\nabc", parse_special=True)
    # a space prefix follows each special token; the user-defined "\n" is split out even as plain text
    assert ids == [1, sot] + _ids(spm, "▁h", "e", "ll", "o") + [eot] + _ids(spm, "\n", "▁a", "bc")
    assert spm.is_eog(eot) and spm.is_eog(spm.eos_id) and spm.eot_id == eot
    assert spm.decode(ids) == "hello\n abc"


def test_bad_metadata_raises():
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    md = bpe_metadata()
    del md["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata(md)
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.pre": "no-such-pre-tokenizer"}))
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.tokens": ["a", "a"] + spm_metadata()[
            "tokenizer.ggml.tokens"][2:]}))

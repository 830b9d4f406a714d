"""The vocabulary kept in the GGUF file's map (edgellm/tokenizer/strings.py): StringTable and TextIndex must answer
exactly as the list[str] and dict they replaced, for both real models and for hand-built files with empty,
duplicate and invalid-UTF-8 entries; hash collisions, long clusters and the end of the table are probed; and a
tokenizer built from a file keeps no str per token."""
import gc
import tracemalloc

import numpy as np
import pytest

import edgellm.engine.gguf as gguf_reader
from edgellm.errors import TokenizerError
from edgellm.tokenizer import Tokenizer
from edgellm.tokenizer import strings
from edgellm.tokenizer.strings import StringTable, TextIndex
from edgellm.tokenizer.unicode_classes import BYTE_TO_UNICODE

from gguf_builder import build, kv

NORMAL, CONTROL, BYTE = 1, 3, 6
TOKENS, MERGES = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"


def as_list(lazy, name_empty):
    """What the reader's list (and the dict built from it) held before: the decoded texts, empties renamed."""
    texts = lazy.to_list()
    return [t if t or not name_empty else f"[EMPTY_{i}]" for i, t in enumerate(texts)]


def first_ids(texts):
    out = {}
    for i, t in enumerate(texts):
        out.setdefault(t, i)
    return out


def write_gguf(tmp_path, tokens, merges=None, model="gpt2", types=None, name="v.gguf"):
    """A GGUF file with only tokenizer metadata; tokens and merges may be bytes (to write invalid UTF-8)."""
    kvs = [kv("general.architecture", "STRING", "llama"), kv("tokenizer.ggml.model", "STRING", model),
           kv(TOKENS, "ARRAY", ("STRING", tokens))]
    if types is not None:
        kvs.append(kv("tokenizer.ggml.token_type", "ARRAY", ("INT32", types)))
    if merges is not None:
        kvs.append(kv(MERGES, "ARRAY", ("STRING", merges)))
    path = tmp_path / name
    path.write_bytes(build(kvs, [])[0])
    return path


# --- the real vocabularies ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_files(smollm2_path, gemma_path):
    files = {"smollm2": gguf_reader.open(smollm2_path), "gemma": gguf_reader.open(gemma_path)}
    yield {name: (f, Tokenizer.from_metadata(f.metadata)) for name, f in files.items()}
    for f in files.values():
        f.close()


@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_every_real_token_round_trips_text_id_text(real_files, name):
    f, tok = real_files[name]
    tokens, index = tok.vocab.tokens, tok.vocab.token_to_id
    assert isinstance(tokens, StringTable) and isinstance(index, TextIndex)
    assert isinstance(dict.get(f.metadata, TOKENS), gguf_reader.LazyStrings)   # the tokenizer decoded nothing
    expected = as_list(dict.get(f.metadata, TOKENS), name_empty=True)
    assert len(tokens) == len(index) == len(expected) and list(tokens) == expected
    get = index.get
    assert [get(t) for t in tokens] == list(range(len(tokens)))
    assert list(index) == expected
    ids = first_ids(expected)
    rng = np.random.default_rng(0)
    for i in rng.integers(0, len(tokens), 3000).tolist():   # near misses: a character more or less
        for text in (expected[i] + "\x00", expected[i][:-1], "\ufffd" + expected[i], expected[i].upper()):
            assert get(text) == ids.get(text), text


def test_real_merge_ranks_are_first_occurrences(real_files):
    f, tok = real_files["smollm2"]
    ranks = tok._model._ranks
    merges = as_list(dict.get(f.metadata, MERGES), name_empty=False)
    expected = first_ids(merges)
    assert len(ranks) == len(expected)
    assert all(ranks.get(m) == r for m, r in expected.items())
    assert ranks.get("Ġ Ġ Ġ") is None and "zz zz zz" not in ranks


def test_real_hashes_and_space_search_match_brute_force(real_files):
    f, tok = real_files["gemma"]
    table = tok.vocab.tokens
    np.testing.assert_array_equal(table.hashes(), np.fromiter(map(hash, table), np.int64, len(table)))
    texts = list(table)
    for after_start in (False, True):
        brute = [i for i, t in enumerate(texts) if "\u2581" in t[1 if after_start else 0:]]
        assert table.ids_containing("\u2581", after_start) == brute
    assert table.ids_containing(">\u2581</") == [i for i, t in enumerate(texts) if ">\u2581</" in t]


def test_gemma_tokenizer_keeps_no_str_per_token(gemma_path):
    with gguf_reader.open(gemma_path) as f:
        gc.collect()
        tracemalloc.start()
        try:
            tok = Tokenizer.from_metadata(f.metadata)
            gc.collect()
            kept, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # 262k tokens: ~3 MiB of index, 1 MiB of attributes (the scores are the reader's array); a list[str] and a
        # dict took ~37 MiB
        assert kept < 8 * 2**20, kept
        assert tok.encode("Hello world") == tok.encode("Hello world")


def test_tokenizer_outlives_its_closed_file(gemma_path):
    with gguf_reader.open(gemma_path) as f:
        tok = Tokenizer.from_metadata(f.metadata)
        ids = tok.encode("keep the map open", add_special=False)
    assert tok.encode("keep the map open", add_special=False) == ids   # the table holds a view of the map
    assert tok.decode(ids) == "keep the map open" and tok.token_text(ids[0]) == tok.vocab.tokens[ids[0]]


# --- hand-built files -----------------------------------------------------------------------------------------
BPE_BYTES = [BYTE_TO_UNICODE[b] for b in range(256)]


def test_file_and_list_vocabularies_agree_with_empty_and_invalid_entries(tmp_path):
    # an empty token (renamed [EMPTY_i]), invalid UTF-8 (decoded with U+FFFD), a truncated character
    odd = [b"", b"ab\xff", b"\xc3", "hé".encode(), b"he", b"", "Ġhé".encode()]
    tokens = [t.encode() for t in BPE_BYTES] + odd + [b"<|endoftext|>"]
    merges = [b"h e", b"he \xc3\xa9", b"\xc4\xa0 h", b"h e", b"\xc4\xa0h \xc3\xa9", b"a b"]   # "h e" twice
    types = [NORMAL] * (len(tokens) - 1) + [CONTROL]
    path = write_gguf(tmp_path, tokens, merges, "gpt2", types)
    with gguf_reader.open(path) as f:
        from_file = Tokenizer.from_metadata(f.metadata)
        md = {k: f.metadata[k] for k in f.metadata.keys()}     # the decoded lists, as before
    from_lists = Tokenizer.from_metadata(md)
    assert isinstance(from_file.vocab.tokens, StringTable) and isinstance(from_lists.vocab.tokens, list)
    texts = from_lists.vocab.tokens
    n = len(BPE_BYTES)
    assert texts[n:n + 7] == ["[EMPTY_256]", "ab\ufffd", "\ufffd", "hé", "he", "[EMPTY_261]", "Ġhé"]
    assert list(from_file.vocab.tokens) == texts
    for tok in (from_file, from_lists):
        index = tok.vocab.token_to_id
        assert [index[t] for t in texts] == list(range(len(texts)))
        assert index.get("") is None and index.get("ab\xff") is None and "[EMPTY_7]" not in index
        assert index.get("ab\ufffd") == n + 1 and index["[EMPTY_261]"] == n + 5
        assert tok._model._ranks.get("h e") == 0 and len(tok._model._ranks) == 5
        assert list(index) == texts
    for text in ["hé", "héhé hé", "ab\ufffd", "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
                 "<|endoftext|>hé", " hé", ""]:
        for parse_special in (False, True):
            assert from_file.encode(text, parse_special=parse_special) == from_lists.encode(text,
                                                                                            parse_special=parse_special)
    ids = list(range(len(texts)))
    assert from_file.decode(ids, special=True) == from_lists.decode(ids, special=True)


def test_spm_file_vocabulary_matches_its_lists(tmp_path):
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [
        "▁", "h", "e", "▁h", "he", "▁he", ">▁</", "a▁b", "▁▁", "x▁▁"]
    types = [2, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * 10
    path = write_gguf(tmp_path, pieces, model="llama", types=types)
    with gguf_reader.open(path) as f:
        from_file = Tokenizer.from_metadata(f.metadata)
        md = {k: f.metadata[k] for k in f.metadata.keys()}
    from_lists = Tokenizer.from_metadata(md)
    assert from_file._model._cut.pattern == from_lists._model._cut.pattern
    assert set(from_file._model._cut.pattern) >= set(">ax")     # the characters some token joins to a ▁
    for text in ["he he", "a b", "x  y", "h>\u2581</ é", "héllo wörld"]:
        assert from_file.encode(text) == from_lists.encode(text)


@pytest.mark.parametrize("tokens,what", [
    ([b"a", b"b", b"a"], "same bytes"),
    ([b"a", b"\xff", b"\xfe"], "both decode to U+FFFD"),
    ([b"a", b"", b"[EMPTY_1]"], "an empty entry's name"),
])
def test_duplicate_token_texts_raise(tmp_path, tokens, what):
    path = write_gguf(tmp_path, tokens, [], "gpt2")
    with gguf_reader.open(path) as f:
        with pytest.raises(TokenizerError, match="duplicate token text in tokenizer.ggml.tokens"):
            Tokenizer.from_metadata(f.metadata)
        md = {k: f.metadata[k] for k in f.metadata.keys()}
    with pytest.raises(TokenizerError, match="duplicate token text"):
        Tokenizer.from_metadata(md)


def test_non_string_tokens_raise_tokenizer_error():
    with pytest.raises(TokenizerError, match="array of strings"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama", TOKENS: ["a", 3, "b"]})
    with pytest.raises(TokenizerError, match="array of strings"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", TOKENS: ["a"], MERGES: ["a a", None]})


# --- StringTable and TextIndex alone --------------------------------------------------------------------------
def packed(texts, gap=8):
    """A GGUF-style buffer (gap bytes before each entry) and the offsets of the entries' gaps."""
    raw = [t.encode() if isinstance(t, str) else t for t in texts]
    offsets = np.cumsum([0] + [len(r) + gap for r in raw])
    return b"".join(b"\x07" * gap + r for r in raw), offsets


def test_string_table_reads_like_a_list():
    buf, offsets = packed(["a", "", "\u2581b", b"\xe2\x96"])
    table = StringTable(buf, offsets, gap=8, name_empty=True)
    assert list(table) == ["a", "[EMPTY_1]", "\u2581b", "\ufffd"] and len(table) == 4
    assert table[-1] == "\ufffd" and table[np.int64(2)] == "\u2581b" and table[1:3] == ["[EMPTY_1]", "\u2581b"]
    with pytest.raises(IndexError):
        table[4]
    with pytest.raises(IndexError):
        table[-5]
    assert table.ids_containing("\u2581") == [2] and table.ids_containing("\u2581", after_start=True) == []
    assert table.ids_containing("EMPTY") == [1] and table.ids_containing("") == [0, 1, 2, 3]
    assert list(StringTable(buf, offsets, gap=8)) == ["a", "", "\u2581b", "\ufffd"]
    for bad in (offsets[::-1], offsets + len(buf), offsets[:, None], offsets.astype(np.float32)):
        with pytest.raises(TokenizerError):
            StringTable(buf, bad, gap=8)


def test_hashes_when_every_separator_byte_occurs():
    texts = [chr(b) + "x" for b in strings._SEPARATORS] + ["plain", "é", ""]
    for gap in (0, 1, 8):
        table = StringTable(*packed(texts, gap), gap=gap)
        np.testing.assert_array_equal(table.hashes(), [hash(t) for t in texts])
    many = [f"t{i}" for i in range(3 * strings._HASH_CHUNK + 5)]   # several chunks, the last one short
    np.testing.assert_array_equal(StringTable(*packed(many), gap=8).hashes(), [hash(t) for t in many])


class FixedHash(str):
    """A str whose hash is chosen, to put entries where a test wants them."""
    value = 0

    def __hash__(self):
        return FixedHash.value


@pytest.mark.parametrize("home", ["start", "end"])
def test_one_long_cluster_at_the_start_and_past_the_end_of_the_table(home):
    texts = [FixedHash(f"w{i}") for i in range(300)] + [FixedHash("w7")]       # one duplicate, last
    n = len(texts)
    FixedHash.value = 0 if home == "start" else (1 << max(2 * n - 1, 1).bit_length()) - 1
    index = TextIndex(texts, unique=False, what="test")
    assert len(index) == 300 and all(index.get(t) == i for i, t in enumerate(texts[:300]))
    assert index.get(FixedHash("w300")) is None and index.get(FixedHash("w7")) == 7
    with pytest.raises(TokenizerError, match="duplicate"):
        TextIndex(texts, unique=True, what="test")


def test_cpython_str_hash_collisions_are_told_apart():
    # CPython hashes a str's code units: '弧' (U+5F27) and "'_" (0x27 0x5F) have the same hash
    assert hash("弧") == hash("'_")
    for texts in (["'_", "弧", "x"], ["弧", "x", "'_"]):
        index = TextIndex(texts, unique=True, what="test")
        assert [index[t] for t in texts] == [0, 1, 2] and index.get("\u5f28") is None
        table = StringTable(*packed(texts), gap=8)
        index = TextIndex(table, unique=True, what="test")
        assert [index[t] for t in texts] == [0, 1, 2]


def test_text_index_reads_like_a_dict():
    texts = ["b", "a", "", "b", "c"]
    index = TextIndex(texts, unique=False, what="test")
    assert dict(index) == first_ids(texts) and list(index) == ["b", "a", "", "c"] and len(index) == 4
    assert index["c"] == 4 and index.get("zz", -1) == -1 and "" in index and b"a" not in index
    with pytest.raises(KeyError):
        index["zz"]
    with pytest.raises(TypeError):
        index.get(["unhashable"])
    empty = TextIndex([], unique=True, what="test")
    assert len(empty) == 0 and empty.get("a") is None and list(empty) == []

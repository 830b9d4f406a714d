"""The compiled string-array walk (edgellm/engine/gguf_scan.py) finds the same elements as the reader's Python
walk on both real models' vocabularies and merges, and a malformed or cut-short array raises the same error, or
asks for the same bytes, on either path."""
import struct

import numba  # the compiled walk is taken only where Numba is already imported
import numpy as np
import pytest

import edgellm.engine.gguf as gguf_reader
from edgellm.engine import gguf_scan
from edgellm.errors import GGUFError

from gguf_builder import build, kv

assert numba
N_ELEMENTS = 2 * gguf_reader.COMPILED_WALK_MIN  # long enough for the compiled walk


def _python_walk(monkeypatch):
    monkeypatch.setattr(gguf_reader, "COMPILED_WALK_MIN", 1 << 62)


def _string_arrays(f):
    return {k: v for k, v in dict.items(f.metadata) if isinstance(v, gguf_reader.LazyStrings)}


def test_both_walks_find_the_same_elements_in_the_real_vocabularies(real_model, monkeypatch):
    _, path = real_model
    calls = []
    walk = gguf_scan.walk
    monkeypatch.setattr(gguf_scan, "walk", lambda *a: calls.append(a[2]) or walk(*a))
    with gguf_reader.open(path) as f:
        compiled = {k: v.offsets.copy() for k, v in _string_arrays(f).items()}
        tensors = sorted((t.name, t.offset) for t in f.tensors.values())
    long_arrays = [len(v) for v in compiled.values() if len(v) - 1 >= gguf_reader.COMPILED_WALK_MIN]
    assert "tokenizer.ggml.tokens" in compiled and sorted(calls) == sorted(n - 1 for n in long_arrays)
    _python_walk(monkeypatch)
    with gguf_reader.open(path) as f:
        walked = {k: v.offsets.copy() for k, v in _string_arrays(f).items()}
        assert sorted((t.name, t.offset) for t in f.tensors.values()) == tensors  # the walk ended in the same place
    assert compiled.keys() == walked.keys()
    for key in compiled:
        assert compiled[key].dtype == walked[key].dtype, key
        np.testing.assert_array_equal(compiled[key], walked[key], err_msg=key)


def _vocab_file(lengths, lie_at=None, lie=0):
    """A GGUF with one string array of elements of the given lengths; element `lie_at` claims length `lie`."""
    items = [bytes([97 + i % 26]) * n for i, n in enumerate(lengths)]
    data, _ = build([kv("general.architecture", "STRING", "llama"), kv("tokenizer.ggml.tokens", "ARRAY",
                     ("STRING", items)), kv("general.name", "STRING", "after")], [])
    if lie_at is not None:
        at = data.index(b"".join(struct.pack("<Q", len(t)) + t for t in items))
        at += sum(8 + len(t) for t in items[:lie_at])
        data = data[:at] + struct.pack("<Q", lie) + data[at + 8:]
    return data


def _outcome(path_or_data, size=None):
    try:
        if size is None:
            with gguf_reader.open(path_or_data) as f:
                return ("ok", f.metadata["tokenizer.ggml.tokens"], f.metadata["general.name"])
        h = gguf_reader.read_header(path_or_data, size)
        return ("ok", h.metadata["tokenizer.ggml.tokens"], h.metadata["general.name"])
    except GGUFError as e:
        return ("GGUFError", str(e))
    except gguf_reader.HeaderIncomplete as e:
        return ("HeaderIncomplete", e.needed)


LENGTHS = [(i * 7) % 13 for i in range(N_ELEMENTS)]   # empty ones included


@pytest.mark.parametrize("case", ["whole", "cut_in_a_length", "cut_in_a_text", "lies_past_the_end", "huge_length"])
def test_a_malformed_array_raises_the_same_error_on_both_walks(case, tmp_path, monkeypatch):
    data = _vocab_file(LENGTHS)
    if case == "cut_in_a_length":
        data = data[:len(data) // 2 - len(data) // 2 % 8 + 3]
    elif case == "cut_in_a_text":
        data = data[:len(data) - 40]
    elif case == "lies_past_the_end":
        data = _vocab_file(LENGTHS, lie_at=N_ELEMENTS - 3, lie=len(data))
    elif case == "huge_length":
        data = _vocab_file(LENGTHS, lie_at=5, lie=2**64 - 1)
    path = tmp_path / "v.gguf"
    path.write_bytes(data)
    compiled = _outcome(path)
    _python_walk(monkeypatch)
    walked = _outcome(path)
    assert compiled == walked
    assert (compiled[0] == "ok") == (case == "whole"), compiled[:2]
    if case == "whole":
        assert [len(t) for t in compiled[1]] == LENGTHS and compiled[2] == "after"


@pytest.mark.parametrize("cut", [0.3, 0.7, 0.99])
def test_a_header_cut_short_asks_for_the_same_bytes_on_both_walks(cut, monkeypatch):
    data = _vocab_file(LENGTHS)
    head = data[:int(len(data) * cut)]
    compiled = _outcome(head, len(data))
    _python_walk(monkeypatch)
    assert compiled == _outcome(head, len(data)) and compiled[0] == "HeaderIncomplete"
    assert _outcome(data, len(data))[0] == "ok"

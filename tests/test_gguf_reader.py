"""The GGUF reader: values round-trip, tensors are zero-copy views, real models parse, and every malformed file
raises GGUFError (never IndexError, struct.error, MemoryError or a crash)."""
import struct

import numpy as np
import pytest

import edgellm.engine.gguf as gguf_reader
from edgellm.errors import GGUFError

from gguf_builder import build, kv, sample_file, tensor_info, gguf_string


def write(tmp_path, data, name="m.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_values_round_trip(tmp_path):
    data, exp = sample_file()
    with gguf_reader.open(write(tmp_path, data)) as f:
        md = f.metadata
        assert md["general.architecture"] == "llama" and f.architecture == "llama"
        assert (md["test.u8"], md["test.i8"], md["test.u16"], md["test.i16"]) == (200, -100, 60000, -30000)
        assert (md["test.u32"], md["test.i32"], md["test.u64"], md["test.i64"]) == (4_000_000_000, -2_000_000_000,
                                                                                    2**63, -(2**62))
        assert md["test.f32"] == 1.5 and md["test.f64"] == 2.25 and md["test.bool"] is True
        assert md["test.strings"] == ["a", "héllo", "", "🙂"]
        np.testing.assert_array_equal(md["test.floats"], np.array([0.5, -1.0, 2.0], np.float32))
        assert md["test.ints"].dtype == np.int32 and md["test.ints"].tolist() == [1, -2, 3]
        t = f.tensors["w.f32"]
        assert t.ggml_type == "F32" and t.shape == (3, 8) and t.n_elements == 24 and t.nbytes == 96
        np.testing.assert_array_equal(t.data.view(np.float32).reshape(3, 8), exp["f32"])
        q = f.tensors["w.q8"]
        assert q.ggml_type == "Q8_0" and q.shape == (2, 64) and q.nbytes == 2 * 2 * 34
        np.testing.assert_array_equal(q.data.reshape(2, -1), exp["q8_raw"])


def test_tensor_data_is_a_view_into_the_map(tmp_path):
    data, _ = sample_file()
    with gguf_reader.open(write(tmp_path, data)) as f:
        t = f.tensors["w.f32"]
        assert not t.data.flags.owndata and not t.data.flags.writeable
        assert t.offset % f.alignment == 0
        assert bytes(t.data) == data[t.offset:t.offset + t.nbytes]


def test_real_models_match_gguf_py_layout(real_model):
    name, path = real_model
    with gguf_reader.open(path) as f:
        assert f.version == 3
        emb = f.tensors["token_embd.weight"]
        assert emb.ggml_type == "Q8_0"
        if name == "smollm2-135m":
            assert emb.shape == (49152, 576) and len(f.tensors) == 272
            assert f.metadata["llama.block_count"] == 30 and f.metadata["tokenizer.ggml.pre"] == "smollm"
            assert len(f.metadata["tokenizer.ggml.merges"]) == 48900
        else:
            assert emb.shape == (262144, 640) and len(f.tensors) == 236
            assert f.metadata["gemma3.attention.sliding_window"] == 512
            assert f.metadata["tokenizer.ggml.scores"].dtype == np.float32
        tokens = f.metadata["tokenizer.ggml.tokens"]
        assert len(tokens) == emb.shape[0] and all(isinstance(t, str) for t in tokens[:100])
        # Tensors tile the data section without overlap and stay inside the file.
        spans = sorted((t.offset, t.offset + t.nbytes) for t in f.tensors.values())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= f.size


def test_smollm2_agrees_with_gguf_py(smollm2_path):
    gguf = pytest.importorskip("gguf")
    ref = gguf.GGUFReader(smollm2_path)
    with gguf_reader.open(smollm2_path) as f:
        assert len(ref.tensors) == len(f.tensors)
        for rt in ref.tensors[::17]:
            t = f.tensors[rt.name]
            assert t.ggml_type == rt.tensor_type.name
            assert t.shape == tuple(int(d) for d in reversed(rt.shape.tolist()))
            assert np.array_equal(t.data, np.asarray(rt.data).reshape(-1).view(np.uint8))
        for key in ("llama.embedding_length", "llama.rope.freq_base", "tokenizer.ggml.bos_token_id"):
            assert f.metadata[key] == pytest.approx(ref.fields[key].contents())


# ---- malformed files ------------------------------------------------------------------------------------------

def expect_error(tmp_path, data, *fragments):
    with pytest.raises(GGUFError) as e:
        gguf_reader.open(write(tmp_path, data))
    msg = str(e.value)
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_truncated_at_every_byte(tmp_path):
    data, _ = sample_file()
    for n in range(len(data)):
        p = write(tmp_path, data[:n], f"t{n}.gguf")
        with pytest.raises(GGUFError):
            gguf_reader.open(p)


def test_bad_magic_and_version(tmp_path):
    data, _ = sample_file()
    expect_error(tmp_path, b"GGML" + data[4:], "bad magic")
    expect_error(tmp_path, data[:4] + struct.pack("<I", 1) + data[8:], "unsupported GGUF version 1")
    expect_error(tmp_path, data[:4] + struct.pack(">I", 3) + data[8:], "big-endian")


def test_absurd_counts(tmp_path):
    kvs = [kv("general.architecture", "STRING", "llama")]
    expect_error(tmp_path, build(kvs, [], n_kv=2**60)[0], "absurd counts")
    expect_error(tmp_path, build(kvs, [], n_tensors=2**40)[0], "absurd counts")
    huge_array = gguf_string("a") + struct.pack("<IIQ", 9, 6, 2**61)
    expect_error(tmp_path, build([huge_array], [])[0], "truncated")
    huge_strings = gguf_string("a") + struct.pack("<IIQ", 9, 8, 2**50)
    expect_error(tmp_path, build([huge_strings], [])[0], "more than the rest of the file")
    long_string = gguf_string("a") + struct.pack("<IQ", 8, 2**62)
    expect_error(tmp_path, build([long_string], [])[0], "truncated")


def test_bad_metadata(tmp_path):
    a = kv("general.architecture", "STRING", "llama")
    expect_error(tmp_path, build([a, a], [])[0], "duplicate metadata key")
    expect_error(tmp_path, build([gguf_string(b"\xff\xfe") + struct.pack("<I", 4) + b"\0" * 4], [])[0], "UTF-8")
    expect_error(tmp_path, build([gguf_string("x") + struct.pack("<I", 99)], [])[0], "unknown value type 99")
    nested = gguf_string("x") + struct.pack("<IIQ", 9, 9, 1)
    expect_error(tmp_path, build([nested], [])[0], "unsupported element type")
    expect_error(tmp_path, build([a, kv("general.alignment", "UINT32", 24)], [])[0], "power of two")


def _tensor_file(tensors, **kw):
    return build([kv("general.architecture", "STRING", "llama")], tensors, **kw)[0]


def test_bad_tensors(tmp_path):
    raw = np.zeros(64, np.float32).tobytes()
    expect_error(tmp_path, _tensor_file([("t", (64,), 77, raw)]), "unknown or unsupported ggml type 77", "'t'")
    expect_error(tmp_path, _tensor_file([("t", (64, 0), 0, raw)]), "zero dimension")
    expect_error(tmp_path, _tensor_file([("t", (1, 1, 1, 1, 1), 0, raw)]), "5 dimensions")
    expect_error(tmp_path, _tensor_file([("t", (), 0, raw)]), "0 dimensions")
    expect_error(tmp_path, _tensor_file([("t", (2**32, 2**32), 0, raw)]), "absurd")
    expect_error(tmp_path, _tensor_file([("t", (2**62, 4), 0, raw)]), "absurd")
    expect_error(tmp_path, _tensor_file([("t", (65,), 8, raw)]), "block size 32")
    expect_error(tmp_path, _tensor_file([("t", (64,), 0, raw), ("t", (64,), 0, raw)]), "duplicate tensor name")
    expect_error(tmp_path, _tensor_file([("t", (128,), 0, raw)]), "past the end")


def _patch_offset(data, name, new_offset):
    """Rewrite the data offset in tensor `name`'s info (the 8 bytes after its type id)."""
    key = gguf_string(name)
    i = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, i)
    j = i + 4 + 8 * n_dims + 4
    return data[:j] + struct.pack("<Q", new_offset) + data[j + 8:]


def test_bad_offsets(tmp_path):
    raw = np.zeros(64, np.float32).tobytes()
    data = _tensor_file([("a", (64,), 0, raw), ("b", (64,), 0, raw)])
    expect_error(tmp_path, _patch_offset(data, "b", 0), "overlap", "'a'", "'b'")
    expect_error(tmp_path, _patch_offset(data, "b", 260), "not aligned")
    expect_error(tmp_path, _patch_offset(data, "b", 2**40), "past the end")
    expect_error(tmp_path, _patch_offset(data, "b", 2**64 - 32), "past the end")


def test_not_a_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        gguf_reader.open(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="directory"):
        gguf_reader.open(tmp_path)
    with pytest.raises(GGUFError, match="too small"):
        gguf_reader.open(write(tmp_path, b"GGUF"))


def test_random_corruption_never_escapes(tmp_path):
    """Flip random bytes in the header region: the result is either a valid file or GGUFError, nothing else."""
    data, _ = sample_file()
    rng = np.random.default_rng(1)
    header_end = data.index(b"w.q8") + 64
    for trial in range(300):
        buf = bytearray(data)
        for _ in range(rng.integers(1, 4)):
            buf[rng.integers(0, header_end)] = rng.integers(0, 256)
        p = write(tmp_path, bytes(buf), "c.gguf")
        try:
            with gguf_reader.open(p) as f:
                for t in f.tensors.values():
                    assert t.offset + t.nbytes <= f.size
        except GGUFError:
            pass

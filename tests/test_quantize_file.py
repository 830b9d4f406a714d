"""edgellm.prep.quantize: llama.cpp's per-tensor mixes, the requantize guard, metadata carry-over, streaming memory,
and byte-identical output to llama-quantize on the real SmolLM2."""

import hashlib
import tracemalloc

import gguf
import numpy as np
import pytest

import edgellm.engine.gguf as gguf_reader
from edgellm.cli import main as cli_main
from edgellm.errors import EdgeLLMError
from edgellm.prep.quantize import metadata_value_types, plan_tensor_types, quantize_file

N_LAYER, D, FF, N_VOCAB = 8, 256, 512, 512
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def write_model(path, weight_type="F16", n_layer=N_LAYER, d=D, ff=FF, extra=None, tied=True):
    """A llama-shaped GGUF with tokenizer metadata; weights random in weight_type, norms F32."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([f"t{i}" for i in range(N_VOCAB)])
    w.add_token_types([1] * N_VOCAB)
    w.add_token_merges(["t 1", "t1 2"])
    w.add_bos_token_id(1)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_int32("test.signed", -5)
    w.add_uint64("test.big", 1 << 40)

    def matrix(name, rows, cols):
        x = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        if weight_type == "F32":
            w.add_tensor(name, x)
        elif weight_type == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType[weight_type]),
                         raw_dtype=gguf.GGMLQuantizationType[weight_type])

    matrix("token_embd.weight", N_VOCAB, d)
    if not tied:
        matrix("output.weight", N_VOCAB, d)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        for name, rows, cols in (("attn_q", d, d), ("attn_k", d // 2, d), ("attn_v", d // 2, d),
                                 ("attn_output", d, d), ("ffn_gate", ff, d), ("ffn_up", ff, d), ("ffn_down", d, ff)):
            matrix(p + name + ".weight", rows, cols)
        w.add_tensor(p + "attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d, np.float32))
    for name, (rows, cols) in (extra or {}).items():
        matrix(name, rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# llama-quant.cpp's choices for this 8-layer model (4 heads, 2 KV heads: n_gqa 2; tied embeddings, so
# token_embd takes the output tensor's type). use_more_bits(i, 8) holds for layers 0, 3, 6, 7.
MORE = [0, 3, 6, 7]


def per_layer(high, low, layers):
    return [high if i in layers else low for i in range(N_LAYER)]


EXPECTED = {  # mix -> (token_embd, default, attn_v per layer, ffn_down per layer, attn_output)
    "Q4_K_M": ("Q6_K", "Q4_K", per_layer("Q6_K", "Q4_K", MORE), per_layer("Q6_K", "Q4_K", MORE), "Q4_K"),
    "Q5_K_M": ("Q6_K", "Q5_K", per_layer("Q6_K", "Q5_K", MORE), per_layer("Q6_K", "Q5_K", MORE), "Q5_K"),
    "Q4_K_S": ("Q6_K", "Q4_K", per_layer("Q5_K", "Q4_K", range(4)), per_layer("Q5_K", "Q4_K", [0]), "Q4_K"),
    "Q3_K_M": ("Q6_K", "Q3_K", per_layer("Q5_K", "Q4_K", range(2)), ["Q4_K"] * N_LAYER, "Q4_K"),
    "Q2_K": ("Q6_K", "Q2_K", ["Q3_K"] * N_LAYER, ["Q3_K"] * N_LAYER, "Q3_K"),
    "Q6_K": ("Q6_K", "Q6_K", ["Q6_K"] * N_LAYER, ["Q6_K"] * N_LAYER, "Q6_K"),
    "Q4_0": ("Q6_K", "Q4_0", ["Q4_0"] * N_LAYER, ["Q4_0"] * N_LAYER, "Q4_0"),
    "IQ4_NL": ("Q6_K", "IQ4_NL", ["IQ4_NL"] * N_LAYER, per_layer("Q5_K", "IQ4_NL", [0]), "IQ4_NL"),
    "IQ4_XS": ("Q6_K", "IQ4_XS", ["IQ4_XS"] * N_LAYER, per_layer("Q5_K", "IQ4_XS", [0]), "IQ4_XS"),
    "Q8_0": ("Q8_0", "Q8_0", ["Q8_0"] * N_LAYER, ["Q8_0"] * N_LAYER, "Q8_0"),
    "F16": ("F16", "F16", ["F16"] * N_LAYER, ["F16"] * N_LAYER, "F16"),
}


@pytest.fixture(scope="module")
def f16_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("quant") / "model-f16.gguf")


@pytest.mark.parametrize("mix", sorted(EXPECTED))
def test_plan_follows_llama_cpp_mix_rules(f16_model, mix):
    embd, default, attn_v, ffn_down, attn_output = EXPECTED[mix]
    with gguf_reader.open(f16_model) as f:
        types = {p.name: p.dst_type for p in plan_tensor_types(f, mix)}
    assert types["token_embd.weight"] == embd
    assert types["output_norm.weight"] == "F32"
    for i in range(N_LAYER):
        p = f"blk.{i}."
        assert types[p + "attn_v.weight"] == attn_v[i], (mix, i)
        assert types[p + "ffn_down.weight"] == ffn_down[i], (mix, i)
        assert types[p + "attn_output.weight"] == attn_output
        assert [types[p + n + ".weight"] for n in ("attn_q", "attn_k", "ffn_gate", "ffn_up")] == [default] * 4
        assert types[p + "attn_norm.weight"] == types[p + "ffn_norm.weight"] == "F32"


def test_pure_and_type_overrides(f16_model):
    with gguf_reader.open(f16_model) as f:
        pure = {p.name: p.dst_type for p in plan_tensor_types(f, "Q4_K_M", pure=True)}
        assert {t for n, t in pure.items() if not n.endswith("norm.weight")} == {"Q4_K"}
        out = {p.name: p.dst_type for p in plan_tensor_types(f, "Q4_K_M", output_tensor_type="Q8_0")}
        assert out["token_embd.weight"] == "Q8_0"  # tied: the embedding is the output tensor
        emb = {p.name: p.dst_type for p in plan_tensor_types(f, "Q4_K_M", token_embedding_type="Q5_0")}
        assert emb["token_embd.weight"] == "Q5_0" and emb["blk.0.attn_q.weight"] == "Q4_K"


def test_rows_that_do_not_split_into_blocks_fall_back_as_llama_cpp(tmp_path):
    path = write_model(tmp_path / "odd.gguf", n_layer=2, extra={"blk.0.odd_576.weight": (64, 576),
                                                                "blk.0.odd_80.weight": (64, 80)}, tied=False)
    with gguf_reader.open(path) as f:
        q4 = {p.name: (p.dst_type, p.fell_back) for p in plan_tensor_types(f, "Q4_K_M")}
        q6 = {p.name: p.dst_type for p in plan_tensor_types(f, "Q6_K")}
        q2 = {p.name: p.dst_type for p in plan_tensor_types(f, "Q2_K")}
    assert q4["blk.0.odd_576.weight"] == ("Q5_0", True)  # Q4_K -> Q5_0
    assert q4["blk.0.odd_80.weight"] == ("F16", True)    # not even a multiple of 32
    assert q4["output.weight"] == ("Q6_K", False) and q4["token_embd.weight"] == ("Q4_K", False)
    assert q6["blk.0.odd_576.weight"] == "Q8_0" and q2["blk.0.odd_576.weight"] == "Q4_0"


def test_quantized_input_is_refused_without_allow_requantize(tmp_path):
    path = write_model(tmp_path / "q8.gguf", weight_type="Q8_0", n_layer=2)
    with pytest.raises(EdgeLLMError, match=r"already quantized.*Q8_0.*allow_requantize"):
        quantize_file(path, tmp_path / "out.gguf", "Q4_K_M", progress=False)
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.gguf.tmp").exists()
    r = quantize_file(path, tmp_path / "out.gguf", "Q4_K_M", allow_requantize=True, progress=False)
    assert r.out_bytes < path.stat().st_size


def test_output_keeps_every_key_with_its_type_and_dequantizes_close(f16_model, tmp_path):
    out = tmp_path / "q6.gguf"
    quantize_file(f16_model, out, "Q6_K", progress=False)
    types_in, types_out = metadata_value_types(f16_model), metadata_value_types(out)
    assert types_out["general.file_type"] == (4, None) and types_out["general.quantization_version"] == (4, None)
    for key in types_in:
        assert types_out[key] == types_in[key], key
    with gguf_reader.open(f16_model) as a, gguf_reader.open(out) as b:
        assert b.metadata["general.file_type"] == 18
        assert b.metadata["tokenizer.chat_template"] == CHAT_TEMPLATE
        assert b.metadata["tokenizer.ggml.tokens"] == a.metadata["tokenizer.ggml.tokens"]
        assert b.metadata["test.signed"] == -5 and b.metadata["test.big"] == 1 << 40
        from edgellm.quant import dequantize
        for name in ("blk.1.attn_q.weight", "token_embd.weight"):
            x, y = (dequantize(t.data, t.ggml_type, t.shape) for t in (a.tensors[name], b.tensors[name]))
            assert b.tensors[name].ggml_type == "Q6_K"
            assert np.sqrt(np.mean((x - y) ** 2)) < 0.03 * np.sqrt(np.mean(x ** 2))  # Q6_K's ~1.5% rms error


PEAK_TENSORS = 3  # heap at most ~3 tensors' float32 size: one dequantized slab, its output, the output buffer


def test_streaming_keeps_peak_memory_near_one_tensor(tmp_path):
    extra = {f"blk.0.big_{i}.weight": (1024, 1024) for i in range(12)}
    path = write_model(tmp_path / "big.gguf", weight_type="F32", n_layer=1, extra=extra)
    model_f32_bytes = 12 * 1024 * 1024 * 4
    # modules imported and kernels compiled or loaded on first use are not the streaming's memory: a warm-up run
    # first, so the figure is the same whether this test runs alone or after others
    quantize_file(write_model(tmp_path / "small.gguf", weight_type="F32", n_layer=1), tmp_path / "small_q8.gguf",
                  "Q8_0", progress=False)
    tracemalloc.start()
    try:
        quantize_file(path, tmp_path / "q8.gguf", "Q8_0", progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_TENSORS * 1024 * 1024 * 4 < model_f32_bytes / 3


def test_cli_quantize(f16_model, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert cli_main(["quantize", str(f16_model), str(out), "q4_k_m", "--quiet"]) == 0
    assert "quantized" in capsys.readouterr().out
    with gguf_reader.open(out) as f:
        assert f.metadata["general.file_type"] == 15
    assert cli_main(["quantize", str(out), str(tmp_path / "again.gguf"), "Q8_0", "-q"]) == 1
    assert "--allow-requantize" in capsys.readouterr().err


# sha256 (first 16 hex digits) of the files llama-quantize (llama-cpp-python 0.3.36) writes from SmolLM2:
# F16 from the catalog's Q4_1 file (with --allow-requantize), then Q4_K_M from that F16 file.
LLAMA_QUANTIZE_SHA256 = {"F16": "a269e3181fcbb250", "Q4_K_M": "27e1496775b07d69"}


def _sha16(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def test_smollm2_files_are_byte_identical_to_llama_quantize(smollm2_path, tmp_path):
    f16 = tmp_path / "smollm2-f16.gguf"
    quantize_file(smollm2_path, f16, "F16", allow_requantize=True, progress=False)
    assert _sha16(f16) == LLAMA_QUANTIZE_SHA256["F16"]
    q4km = tmp_path / "smollm2-q4_k_m.gguf"
    quantize_file(f16, q4km, "Q4_K_M", progress=False)
    assert _sha16(q4km) == LLAMA_QUANTIZE_SHA256["Q4_K_M"]

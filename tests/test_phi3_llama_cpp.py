"""phi3 (fused attn_qkv, gate-up ffn_up, q scaled after rope, longrope) against llama.cpp's own logits on a tiny file
(tests/helpers_tiny_llama_cpp.py, tests/fixtures/llama_cpp_tiny.json): run with a context past the original one
(llama.cpp takes rope_factors_long; positions up to 306 of an original 256) and within it (rope_factors_short),
teacher-forced and on the decode path; and against the numpy ReferenceModel."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers_tiny_llama_cpp import PHI3_ORIG_CTX, file_sha256, write_case
from test_rope_scaling_llama_cpp import _agreement

import edgellm.engine.gguf as gguf_reader
from edgellm.engine.models import build_model, get_architecture
from edgellm.engine.models.phi3 import longrope_factors
from edgellm.engine.reference import ReferenceModel

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_tiny.json").read_text())["cases"]
PHI3_CASES = ("phi3_longrope_long", "phi3_longrope_short")
# the fast path's int8 activation rounding in each Q8_0 matmul against the float64 reference (measured 7.5e-5)
REFERENCE_LOGITS_NMSE = 3e-4


@pytest.fixture(scope="module", params=PHI3_CASES)
def case(request, tmp_path_factory):
    name = request.param
    path = write_case(tmp_path_factory.mktemp("phi3") / f"{name}.gguf", name)
    assert file_sha256(path) == FIXTURE[name]["sha256_16"], "the tiny model differs from the one llama.cpp ran on"
    return name, path, FIXTURE[name]


def test_rows_equal_llama_cpp_teacher_forced_and_decode(case):
    name, path, want = case
    tokens, n_prompt = want["tokens"], want["prompt_tokens"]
    with gguf_reader.open(path) as f:
        model = build_model(f, n_ctx=want["n_ctx"], n_threads=2, n_batch=512)
        rows = model.forward(np.array(tokens, np.int32), all_logits=True).copy()
        exact, top1, worst = _agreement(rows, want["teacher_forced"])
        print(f"{name} teacher-forced: {exact}/{len(rows)} exact, top-1 {top1}, max |d log-prob| {worst:.2e}")
        assert exact == len(rows)
        model = build_model(f, n_ctx=want["n_ctx"], n_threads=2, n_batch=512)
        steps = [model.forward(np.array(tokens[:n_prompt], np.int32))[-1].copy()]
        steps += [model.forward(np.array([t], np.int32))[-1].copy() for t in tokens[n_prompt:-1]]
        exact, top1, worst = _agreement(steps, want["decode"])
        assert exact == len(steps)


def test_fast_path_matches_reference_model(case):
    name, path, want = case
    ids = np.array(want["tokens"][:64], np.int32)
    with gguf_reader.open(path) as f:
        got = build_model(f, n_ctx=want["n_ctx"], n_threads=2).forward(ids, all_logits=True)
        ref = ReferenceModel(f, n_ctx=want["n_ctx"]).logits(ids)
    assert float(np.sum((got - ref) ** 2) / np.sum(ref.astype(np.float64) ** 2)) < REFERENCE_LOGITS_NMSE


def test_config_and_longrope_choice(tmp_path):
    path = write_case(tmp_path / "phi3.gguf", "phi3_longrope_long")
    with gguf_reader.open(path) as f:
        config = get_architecture("phi3").config_class.from_gguf(f)
        assert config.fused_qkv and config.rope_neox and config.attn_scale == 1.0 and config.q_scale == 0.25
        assert config.layer_windows() == (0,) * config.n_layer  # the sliding window is ignored, as llama.cpp does
        assert config.rope_scaling.n_ctx_orig == PHI3_ORIG_CTX
        assert config.rope_scaling.attn_factor == pytest.approx(np.sqrt(1 + np.log(4) / np.log(PHI3_ORIG_CTX)))
        long = np.asarray(f.tensors["rope_factors_long.weight"].data).view(np.float32)
        short = np.asarray(f.tensors["rope_factors_short.weight"].data).view(np.float32)
        np.testing.assert_array_equal(longrope_factors(f, config, PHI3_ORIG_CTX + 1), long)
        np.testing.assert_array_equal(longrope_factors(f, config, PHI3_ORIG_CTX), short)
        model = build_model(f, n_ctx=2 * PHI3_ORIG_CTX, n_threads=1)
        assert model.rope.mscale == np.float32(config.rope_scaling.attn_factor)
        np.testing.assert_array_equal(model.rope.factors, long)

"""Rope scaling against llama.cpp beyond the original context: tiny models (tests/helpers_tiny_llama_cpp.py) whose
logits llama.cpp recorded (tools/record_tiny_llama_cpp.py, tests/fixtures/llama_cpp_tiny.json),
teacher-forced and on the decode path, at positions up to several times the original context. The rope tables
also against the numpy reference, and the whole model against ReferenceModel."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers_tiny_llama_cpp import CASES, file_sha256, write_case

import edgellm.engine.gguf as gguf_reader
from edgellm.engine import ops
from edgellm.engine.models import build_model
from edgellm.engine.models.config import RopeScaling
from edgellm.engine.reference import ReferenceModel

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_tiny.json").read_text())["cases"]
# float32 rope tables against the float64 reference: pair i's angle is p * theta_scale^i by i float32 products,
# up to ~n_rot/2 roundings of 2^-24 each (4e-6 relative for 64 pairs), so cos and sin agree to that times the angle.
ROPE_ANGLE_RTOL = 1e-5
REFERENCE_LOGITS_NMSE = 1e-4  # int8 activation rounding of the Q8_0 matmuls (as the other tiny-model checks)


def _sha(row) -> str:
    return hashlib.sha256(np.ascontiguousarray(row, dtype=np.float32).tobytes()).hexdigest()[:16]


def _agreement(rows, recorded):
    """(rows equal bit for bit, rows whose argmax is llama.cpp's, max |log-prob difference| over llama.cpp's top 8)."""
    exact = top1 = 0
    worst = 0.0
    for row, want in zip(rows, recorded):
        exact += _sha(row) == want["sha"]
        top1 += int(np.argmax(row)) == want["top"][0][0]
        r = row.astype(np.float64)
        lse = r.max() + np.log(np.exp(r - r.max()).sum())
        worst = max(worst, max(abs((r[i] - lse) - (logit - want["lse"])) for i, logit in want["top"]))
    return exact, top1, worst


ROPE_CASES = ("llama_yarn", "qwen2_yarn")


@pytest.fixture(scope="module", params=ROPE_CASES)
def case(request, tmp_path_factory):
    name = request.param
    path = write_case(tmp_path_factory.mktemp("rope") / f"{name}.gguf", name)
    want = FIXTURE[name]
    assert file_sha256(path) == want["sha256_16"], "the tiny model differs from the one llama.cpp ran on"
    return name, path, want


def test_teacher_forced_rows_equal_llama_cpp(case):
    name, path, want = case
    with gguf_reader.open(path) as f:
        model = build_model(f, n_ctx=want["n_ctx"], n_threads=2, n_batch=512)
        rows = model.forward(np.array(want["tokens"], np.int32), all_logits=True)
    exact, top1, worst = _agreement(rows, want["teacher_forced"])
    print(f"{name} teacher-forced: {exact}/{len(rows)} rows exact, top-1 {top1}/{len(rows)}, "
          f"max |d log-prob| {worst:.2e}")
    assert exact == len(rows)


def test_decode_rows_equal_llama_cpp(case):
    name, path, want = case
    tokens, n_prompt = want["tokens"], want["prompt_tokens"]
    with gguf_reader.open(path) as f:
        model = build_model(f, n_ctx=want["n_ctx"], n_threads=2, n_batch=512)
        rows = [model.forward(np.array(tokens[:n_prompt], np.int32))[-1].copy()]  # (a view of the output buffer)
        rows += [model.forward(np.array([t], np.int32))[-1].copy() for t in tokens[n_prompt:-1]]
    exact, top1, worst = _agreement(rows, want["decode"])
    print(f"{name} decode: {exact}/{len(rows)} rows exact, top-1 {top1}/{len(rows)}, max |d log-prob| {worst:.2e}")
    assert exact == len(rows)


def test_fast_path_matches_reference_model(case):
    name, path, want = case
    ids = np.array(want["tokens"][:64], np.int32)
    with gguf_reader.open(path) as f:
        got = build_model(f, n_ctx=want["n_ctx"], n_threads=2).forward(ids, all_logits=True)
        ref = ReferenceModel(f).logits(ids)
    error = float(np.sum((got - ref) ** 2) / np.sum(ref.astype(np.float64) ** 2))
    assert error < REFERENCE_LOGITS_NMSE, error


@pytest.mark.parametrize("factor, n_ctx_orig, base, n_rot", [(4.0, 32, 10000.0, 16), (2.5, 40, 1000.0, 16),
                                                             (8.0, 4096, 500000.0, 128)])
def test_yarn_rope_tables_match_numpy_reference(factor, n_ctx_orig, base, n_rot):
    scaling = RopeScaling("yarn", factor, 1.0, 1.0, n_ctx_orig)
    rope = ops.Rope(n_rot, base, 1.0 / factor, None, scaling)
    positions = np.arange(0, int(n_ctx_orig * factor), 7)
    cos = np.empty((len(positions), n_rot // 2), np.float32)
    sin = np.empty_like(cos)
    ops.rope_tables(positions, rope, cos, sin)
    angle = np.outer(positions, ops.rope_inv_freq(n_rot, base, 1.0 / factor, None, scaling))
    mscale = ops.rope_mscale_ref(1.0 / factor, scaling)
    limit = ROPE_ANGLE_RTOL * (1 + angle)
    assert np.all(np.abs(cos - mscale * np.cos(angle)) <= limit)
    assert np.all(np.abs(sin - mscale * np.sin(angle)) <= limit)
    # YaRN's blend: the first pair keeps the extrapolated angle, the last the interpolated one
    plain = base ** (-np.arange(0, n_rot, 2) / n_rot)
    assert rope.inv_freq[0] == pytest.approx(plain[0]) and rope.inv_freq[-1] == pytest.approx(plain[-1] / factor)
    # the magnitude: attn_factor * (1 + 0.1 ln factor)
    assert np.hypot(cos, sin) == pytest.approx(1 + 0.1 * np.log(factor), rel=1e-6)


def test_unsupported_yarn_variant_is_refused(tmp_path):
    from dataclasses import replace

    from helpers_tiny_gguf import write_tiny_model

    from edgellm.errors import ModelError
    spec = CASES["llama_yarn"]
    spec = replace(spec, extra_keys={**spec.extra_keys, "llama.rope.scaling.yarn_log_multiplier": 0.1})
    with gguf_reader.open(write_tiny_model(tmp_path / "m.gguf", spec)) as f:
        with pytest.raises(ModelError, match="yarn_log_multiplier"):
            build_model(f, n_ctx=64, n_threads=1)

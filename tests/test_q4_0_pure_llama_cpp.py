"""Pure Q4_0 files (every matrix Q4_0, the token embedding and the untied output included, as ARM users pick them for
llama.cpp's repacked kernels): a tiny one against llama.cpp's own logits (tests/helpers_tiny_llama_cpp.py,
tests/fixtures/llama_cpp_tiny.json), and the kernel for Q4_0 matrices of a multiple of 8 rows (quant.q4_0_rows8, the
arithmetic of llama.cpp's repacked q4_0_8x8 gemv and gemm) against its numpy model."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers_tiny_llama_cpp import file_sha256, write_case
from test_rope_scaling_llama_cpp import _agreement

import edgellm.engine.gguf as gguf_reader
from edgellm import quant
from edgellm.engine.models import build_model
from edgellm.quant.activations import quantize_act_q8_0
from edgellm.quant.q4_0_rows8 import rows8_reference
from edgellm.quant.testing import random_matrix_bytes

CASE = "llama_q4_0_pure"
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_tiny.json").read_text())["cases"][CASE]
FMT = quant.format_by_name("Q4_0")


@pytest.fixture(scope="module")
def pure_q4_0(tmp_path_factory):
    path = write_case(tmp_path_factory.mktemp("q4_0") / f"{CASE}.gguf", CASE)
    assert file_sha256(path) == FIXTURE["sha256_16"], "the tiny model differs from the one llama.cpp ran on"
    return path


def test_pure_q4_0_file_loads_with_q4_0_everywhere_and_equals_llama_cpp(pure_q4_0):
    tokens, n_prompt = FIXTURE["tokens"], FIXTURE["prompt_tokens"]
    with gguf_reader.open(pure_q4_0) as f:
        matrices = {n: t.ggml_type for n, t in f.tensors.items() if len(t.shape) == 2}
        assert set(matrices.values()) == {"Q4_0"} and {"token_embd.weight", "output.weight"} <= set(matrices)
        model = build_model(f, n_ctx=FIXTURE["n_ctx"], n_threads=2, n_batch=512)
        rows = model.forward(np.array(tokens, np.int32), all_logits=True).copy()
        exact, top1, worst = _agreement(rows, FIXTURE["teacher_forced"])
        print(f"pure Q4_0 teacher-forced: {exact}/{len(rows)} exact, top-1 {top1}, max |d log-prob| {worst:.2e}")
        assert exact == len(rows)
        model = build_model(f, n_ctx=FIXTURE["n_ctx"], n_threads=2, n_batch=512)
        steps = [model.forward(np.array(tokens[:n_prompt], np.int32))[-1].copy()]
        steps += [model.forward(np.array([t], np.int32))[-1].copy() for t in tokens[n_prompt:-1]]
        exact, top1, worst = _agreement(steps, FIXTURE["decode"])
        assert exact == len(steps)


@pytest.mark.parametrize("n_out, n_in", [(8, 32), (24, 96), (40, 1024)])
def test_rows8_kernel_is_the_repacked_arithmetic(n_out, n_in):
    raw = random_matrix_bytes(FMT, n_out, n_in, np.random.default_rng(n_in))
    layer = quant.QuantLinear(raw, "Q4_0", (n_out, n_in))
    assert layer.rows8
    x = np.random.default_rng(7).standard_normal((9, n_in)).astype(np.float32)
    x[2] *= 1e-4
    batch = np.empty((9, n_out), np.float32)
    layer.matmul(x, batch)
    for t in range(9):
        xq, xd, xs = np.empty(n_in, np.int8), np.empty(n_in // 32, np.float32), np.empty(n_in // 32, np.float32)
        quantize_act_q8_0(x[t], xq, xd, xs)
        want = rows8_reference(raw, n_out, n_in, xq, xd)
        one = np.empty(n_out, np.float32)
        layer.matvec(x[t], one)
        np.testing.assert_array_equal(one.view(np.uint32), want.view(np.uint32), err_msg=f"matvec token {t}")
        np.testing.assert_array_equal(batch[t].view(np.uint32), want.view(np.uint32), err_msg=f"matmul token {t}")


def test_other_row_counts_keep_vec_dot_and_groups_equal_their_layers():
    """llama.cpp repacks only multiples of 8 rows; a group holding a repacked layer gives each layer's own bits."""
    n_in = 256
    layers = [quant.QuantLinear(random_matrix_bytes(FMT, n, n_in, np.random.default_rng(n)), "Q4_0", (n, n_in))
              for n in (16, 12, 24)]
    assert [layer.rows8 for layer in layers] == [True, False, True]
    group = quant.QuantGroup(layers)
    x = np.random.default_rng(3).standard_normal((5, n_in)).astype(np.float32)
    got = [np.empty((5, layer.n_out), np.float32) for layer in layers]
    group.matmul(x, got)
    for layer, g in zip(layers, got):
        want = np.empty_like(g)
        layer.matmul(x, want)
        np.testing.assert_array_equal(g.view(np.uint32), want.view(np.uint32))

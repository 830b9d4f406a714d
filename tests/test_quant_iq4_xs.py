"""IQ4_XS: the kernels against a numpy model of llama.cpp's arithmetic and against llama.cpp's own outputs, and the
quantizer against llama.cpp's bytes.

llama.cpp's ggml_vec_dot_iq4_xs_q8_K (AVX2), for batches under 8 tokens: per super-block, 8 exact
int32 lanes (lane k: values 4k..4k+3 of each 32-value sub-block, times that sub-block's 6-bit scale, summed over the
8 sub-blocks); one FMA per super-block of float(lanes) with d_w * d_x into one float accumulator; the lanes summed as
hsum_float_8; batches of 8 or more go through its tiled K-quant matmul (one rounding per super-block, then an FMA with
d_x). The models below do that with exact rationals and one float32 rounding per operation, depending on
nothing in quant's kernels. The generic checks (dequantize vs gguf-py, hand-built block, the Numba dequantizer and
quantizer vs the numpy references, matmul rows vs matvec, other CPU kinds) pick IQ4_XS up from the registry.

tests/fixtures/llama_cpp_iq4_xs.json holds hashes of llama.cpp's outputs (llama-cpp-python 0.3.36's libraries called
through ctypes by tools/record_iq4_xs_llama_cpp.py): quantize_iq4_xs's bytes for two inputs, and every (token, row)
of ggml_vec_dot_iq4_xs_q8_K on integer-LCG matrices and activations.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from test_quant_iq4_nl import KVALUES, add, fma, hsum_float_8, lcg_activations
from test_quantize_kquants import DATASETS

from edgellm import quant
from edgellm.quant import reference
from edgellm.quant.activations import quantize_act_q8_k
from edgellm.quant.quantize_kernels import quantize_fast
from edgellm.quant.testing import random_matrix_bytes

FMT = quant.format_by_name("IQ4_XS")
LLAMA_CPP = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_iq4_xs.json").read_text())


def sha16(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def superblock(raw, b):
    """(d, the 8 sub-block scales ls - 32, the 256 table values) of super-block b of a row's bytes."""
    blk = raw[b * 136:(b + 1) * 136]
    d = np.float32(blk[:2].view(np.float16)[0])
    sh = int(blk[2]) | int(blk[3]) << 8
    ls = [((int(blk[4 + ib // 2]) >> (4 * (ib % 2))) & 15 | ((sh >> (2 * ib)) & 3) << 4) - 32 for ib in range(8)]
    qs = blk[8:].reshape(8, 16)
    idx = np.concatenate([qs & 15, qs >> 4], axis=1).reshape(-1)
    return d, ls, np.array([KVALUES[i] for i in idx], np.int64)


def llama_vec_dot(row, xq, xd):
    """ggml_vec_dot_iq4_xs_q8_K's result for one row (raw bytes) and one token's Q8_K activations."""
    acc = [np.float32(0)] * 8
    for b in range(len(xd)):
        d, ls, vals = superblock(row, b)
        prod = (vals * xq[256 * b:256 * b + 256].astype(np.int64)).reshape(8, 8, 4).sum(axis=2)  # (sub-block, lane)
        lanes = (prod * np.array(ls, np.int64)[:, None]).sum(axis=0)
        scale = np.float32(d * np.float32(xd[b]))
        acc = [fma(scale, np.float32(lanes[k]), acc[k]) for k in range(8)]
    return hsum_float_8(acc)


def llama_tiled_dot(row, xq, xd):
    """llama.cpp's tiled K-quant matmul (batches of 8 tokens or more) for one row and one token: per super-block
    res = d_w * float(exact total), acc = fma(res, d_x, acc)."""
    acc = np.float32(0)
    for b in range(len(xd)):
        d, ls, vals = superblock(row, b)
        total = int(((vals * xq[256 * b:256 * b + 256].astype(np.int64)).reshape(8, 32).sum(axis=1) * ls).sum())
        acc = fma(np.float32(d * np.float32(total)), np.float32(xd[b]), acc)
    return acc


def activations(x):
    n_in = x.shape[-1]
    xq, xd, bs = np.empty(n_in, np.int8), np.empty(n_in // 256, np.float32), np.empty(n_in // 16, np.int32)
    quantize_act_q8_k(x, xq, xd, bs)
    return xq, xd


def test_matvec_and_matmul_rows_equal_llama_cpp_arithmetic():
    n_out, n_in, n_tokens = 7, 512, 6  # four-token tiles and single tokens
    raw = random_matrix_bytes(FMT, n_out, n_in, np.random.default_rng(5))
    layer = quant.QuantLinear(raw, "IQ4_XS", (n_out, n_in))
    x = np.random.default_rng(2).standard_normal((n_tokens, n_in)).astype(np.float32)
    x[1] *= 1e-3
    batch = np.empty((n_tokens, n_out), np.float32)
    layer.matmul(x, batch)
    row_bytes = FMT.row_bytes(n_in)
    for t in range(n_tokens):
        xq, xd = activations(x[t])
        want = np.array([llama_vec_dot(raw[r * row_bytes:(r + 1) * row_bytes], xq, xd) for r in range(n_out)],
                        np.float32)
        one = np.empty(n_out, np.float32)
        layer.matvec(x[t], one)
        np.testing.assert_array_equal(one.view(np.uint32), want.view(np.uint32), err_msg=f"matvec token {t}")
        np.testing.assert_array_equal(batch[t].view(np.uint32), want.view(np.uint32), err_msg=f"matmul token {t}")


def test_batches_of_eight_or_more_tokens_follow_llama_cpp_tiled_matmul():
    n_out, n_in, n_tokens = 5, 512, 9
    raw = random_matrix_bytes(FMT, n_out, n_in, np.random.default_rng(8))
    layer = quant.QuantLinear(raw, "IQ4_XS", (n_out, n_in))
    x = np.random.default_rng(9).standard_normal((n_tokens, n_in)).astype(np.float32)
    batch = np.empty((n_tokens, n_out), np.float32)
    layer.matmul(x, batch)
    row_bytes = FMT.row_bytes(n_in)
    for t in range(n_tokens):
        xq, xd = activations(x[t])
        want = np.array([llama_tiled_dot(raw[r * row_bytes:(r + 1) * row_bytes], xq, xd) for r in range(n_out)],
                        np.float32)
        np.testing.assert_array_equal(batch[t].view(np.uint32), want.view(np.uint32), err_msg=f"token {t}")


# --- against llama.cpp's own outputs -------------------------------------------------------------------------------

def _lcg_bytes(n, seed):
    i = np.arange(n, dtype=np.uint64) + np.uint64(seed)
    return (((i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(1 << 32)) >> np.uint64(13)).astype(np.uint8)


def lcg_iq4_xs_matrix(n_out, n_in):
    """IQ4_XS bytes from an integer LCG, d = (k % 13 - 6) / 512 (zeros and both signs); tools/record_iq4_xs_llama_cpp
    builds the same."""
    raw = _lcg_bytes(n_out * n_in // 256 * 136, 7).reshape(-1, 136)
    d = ((np.arange(raw.shape[0]) % 13) - 6).astype(np.float16) * np.float16(2.0 ** -9)
    raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("n_in", sorted(LLAMA_CPP["vec_dot_iq4_xs_q8_K"]))
def test_matmul_and_matvec_bits_equal_llama_cpp_vec_dot(n_in):
    case = LLAMA_CPP["vec_dot_iq4_xs_q8_K"][n_in]
    n_in, n_out, n_tokens = int(n_in), case["rows"], case["tokens"]
    layer = quant.QuantLinear(lcg_iq4_xs_matrix(n_out, n_in), "IQ4_XS", (n_out, n_in))
    x = lcg_activations(n_tokens, n_in)
    out = np.empty((n_tokens, n_out), np.float32)
    layer.matmul(x, out, sizes=(1,) * n_tokens)  # each token alone: vec_dot (a whole batch of 8+ is tiled)
    assert list(out[0].view(np.uint32)) == case["first_row_bits"]
    assert sha16(out) == case["sha256_16"]
    for t in range(n_tokens):
        layer.matvec(x[t], out[t])
    assert sha16(out) == case["sha256_16"]


@pytest.mark.parametrize("name", sorted(LLAMA_CPP["quantize_iq4_xs_sha256_16"]))
def test_quantizer_bytes_equal_llama_cpp(name):
    x = DATASETS[name]()
    x = x.reshape(-1, x.shape[-1])
    want = LLAMA_CPP["quantize_iq4_xs_sha256_16"][name]
    assert sha16(reference.quantize_iq4_xs(x.reshape(-1, 256)).view(np.uint8)) == want
    assert sha16(quantize_fast(x, "IQ4_XS")) == want


def test_quantize_round_trip_error():
    # IQ4_NL's levels with a 6-bit scale per 32 values: IQ4_NL's error or a little more (measured 5.7e-3 on Gaussian
    # data; IQ4_NL's limit there is 1.5e-2)
    x = np.random.default_rng(3).standard_normal((8, 512)).astype(np.float32)
    y = quant.dequantize(quantize_fast(x, "IQ4_XS"), "IQ4_XS", x.shape)
    assert ((y - x) ** 2).sum() / (x ** 2).sum() < 1.5e-2


def test_zero_and_tiny_superblocks_quantize_to_zero():
    """A super-block under GROUP_MAX_EPS gets d = -0 (llama.cpp's -max_scale/32 with max_scale 0) and decodes to 0."""
    x = np.zeros((2, 512), np.float32)
    x[1, 256:] = np.linspace(-1, 1, 256)
    got = quantize_fast(x, "IQ4_XS")
    np.testing.assert_array_equal(got, reference.quantize_iq4_xs(x.reshape(-1, 256)).view(np.uint8).reshape(2, -1))
    assert got[0, :2].view(np.float16)[0] == 0 and np.signbit(got[0, :2].view(np.float16)[0])
    np.testing.assert_array_equal(quant.dequantize(got, "IQ4_XS", x.shape)[0], 0)


# --- a tiny IQ4_XS model against llama.cpp -----------------------------------------------------------------------------

def test_tiny_iq4_xs_model_equals_llama_cpp(tmp_path):
    """Every matrix IQ4_XS (written by edgellm's quantizer): the file loads in llama.cpp, and its logits
    (tests/fixtures/llama_cpp_tiny.json, tools/record_tiny_llama_cpp.py) equal edgellm's, teacher-forced and decode."""
    from helpers_tiny_llama_cpp import file_sha256, write_case
    from test_rope_scaling_llama_cpp import _agreement

    import edgellm.engine.gguf as gguf_reader
    from edgellm.engine.models import build_model
    want = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_tiny.json").read_text())["cases"]["llama_iq4_xs"]
    path = write_case(tmp_path / "iq4_xs.gguf", "llama_iq4_xs")
    assert file_sha256(path) == want["sha256_16"], "the tiny model differs from the one llama.cpp ran on"
    tokens, n_prompt = want["tokens"], want["prompt_tokens"]
    with gguf_reader.open(path) as f:
        assert {t.ggml_type for t in f.tensors.values() if len(t.shape) == 2} == {"IQ4_XS"}
        model = build_model(f, n_ctx=want["n_ctx"], n_threads=2, n_batch=512)
        rows = model.forward(np.array(tokens, np.int32), all_logits=True).copy()
        assert _agreement(rows, want["teacher_forced"])[0] == len(rows)
        model = build_model(f, n_ctx=want["n_ctx"], n_threads=2, n_batch=512)
        prompt_row = model.forward(np.array(tokens[:n_prompt], np.int32))[-1].copy()
        steps = [model.forward(np.array([t], np.int32))[-1].copy() for t in tokens[n_prompt:-1]]
        assert _agreement(steps, want["decode"][1:])[0] == len(steps)  # single tokens: vec_dot, bit for bit
        exact, top1, worst = _agreement([prompt_row], want["decode"][:1])
        assert top1 == 1 and worst < TILED_CHUNKING_LOGPROB


# The prompt evaluated alone (120 tokens) gives its last row a few ulps from llama.cpp's (measured 6.8e-7 in
# log-prob), while the same row in the 126-token batch is exact: llama.cpp's tiled matmul splits batches into chunks
# by their size, and the chunking of a 120-token batch is not modelled yet.
TILED_CHUNKING_LOGPROB = 1e-5

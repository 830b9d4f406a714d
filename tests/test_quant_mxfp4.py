"""MXFP4: the kernels against a numpy model of llama.cpp's arithmetic and against llama.cpp's own outputs, the
quantizer against llama.cpp's bytes, and the E8M0 scale over every byte.

llama.cpp's ggml_vec_dot_mxfp4_q8_0 (AVX2; matrices whose row count is not a multiple of 8) is IQ4_NL's scheme
with another table and scale: per block, 8 exact int32 lanes of the doubled E2M1 values times the int8 activations;
one FMA per block with d_x * 2^(e - 128) into one of two float accumulators (even blocks, odd blocks); the two added
lane by lane and the lanes summed as hsum_float_8; an odd last block as a scalar FMA after that. Matrices of a
multiple of 8 rows it repacks at load and multiplies with ggml_gemv/gemm_mxfp4_8x8_q8_0: one FMA chain over the
blocks per (row, token). The models below do that with exact rationals and one float32 rounding per operation
(test_quant_iq4_nl's helpers), depending on nothing in quant's kernels. The generic checks (dequantize vs
gguf-py, hand-built block, the Numba dequantizer and quantizer vs the numpy references, matmul rows vs matvec, tiles,
groups, other CPU kinds) pick MXFP4 up from the registry.

tests/fixtures/llama_cpp_mxfp4.json holds hashes of llama.cpp's outputs (llama-cpp-python 0.3.36's libraries called
through ctypes by tools/record_mxfp4_llama_cpp.py, whose input generators are imported here).
"""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers_tiny_gguf import TinySpec
from test_models_tiny import QUANTIZED_VS_REFERENCE_NMSE, check_decode_matches_batch, check_fast_matches_reference
from test_quant_iq4_nl import activations, add, fma, hsum_float_8

from edgellm import quant
from edgellm.quant import reference
from edgellm.quant.quantize_kernels import quantize_fast
from edgellm.quant.testing import random_matrix_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import record_mxfp4_llama_cpp as recorded  # noqa: E402  (the fixture's input generators)

FMT = quant.format_by_name("MXFP4")
LLAMA_CPP = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_mxfp4.json").read_text())


def sha16(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def block_values(raw, b):
    """The 32 table values of block b (low nibbles first) and its scale 2^(e - 128), from the format's definition."""
    blk = raw[b * 17:(b + 1) * 17]
    idx = np.concatenate([blk[1:] & 15, blk[1:] >> 4])
    return np.array([recorded.KVALUES[i] for i in idx], np.int64), np.float32(np.ldexp(1.0, int(blk[0]) - 128))


def llama_vec_dot(row, xq, xd):
    """ggml_vec_dot_mxfp4_q8_0's result for one row (raw bytes) and one token's Q8_0 activations."""
    nb = len(xd)
    acc = [[np.float32(0)] * 8, [np.float32(0)] * 8]
    for b in range(nb - nb % 2):
        vals, d = block_values(row, b)
        lanes = (vals * xq[32 * b:32 * b + 32].astype(np.int64)).reshape(8, 4).sum(axis=1)
        scale = np.float32(np.float32(xd[b]) * d)
        acc[b % 2] = [fma(scale, np.float32(lanes[k]), acc[b % 2][k]) for k in range(8)]
    total = hsum_float_8([add(acc[0][k], acc[1][k]) for k in range(8)])
    if nb % 2:
        b = nb - 1
        vals, d = block_values(row, b)
        sumi = int((vals * xq[32 * b:32 * b + 32].astype(np.int64)).sum())
        total = fma(np.float32(np.float32(xd[b]) * d), np.float32(sumi), total)
    return total


def llama_rows8_dot(row, xq, xd):
    """ggml_gemv/gemm_mxfp4_8x8_q8_0's result (a matrix of a multiple of 8 rows, repacked): one chain over the
    blocks, acc = fma(float(exact block dot), d_x * 2^(e - 128), acc)."""
    acc = np.float32(0)
    for b in range(len(xd)):
        vals, d = block_values(row, b)
        sumi = int((vals * xq[32 * b:32 * b + 32].astype(np.int64)).sum())
        acc = fma(np.float32(sumi), np.float32(np.float32(xd[b]) * d), acc)
    return acc


# 19 rows: the vec_dot path (a row block ending on an odd row); 16: the repacked one
@pytest.mark.parametrize("n_out,n_in", [(19, 128), (19, 160), (16, 160)])  # 4 and 5 blocks (the scalar last step)
def test_matvec_and_matmul_rows_equal_llama_cpp_arithmetic(n_out, n_in):
    n_tokens = 13  # an eight-token tile, a four-token tile, one token
    raw = random_matrix_bytes(FMT, n_out, n_in, np.random.default_rng(n_in))
    layer = quant.QuantLinear(raw, "MXFP4", (n_out, n_in))
    assert layer.rows8 == (n_out % 8 == 0)
    llama_dot = llama_rows8_dot if layer.rows8 else llama_vec_dot
    x = np.random.default_rng(1).standard_normal((n_tokens, n_in)).astype(np.float32)
    x[3] *= 1e-3  # one token of small activations
    batch = np.empty((n_tokens, n_out), np.float32)
    layer.matmul(x, batch)
    row_bytes = FMT.row_bytes(n_in)
    for t in range(n_tokens):
        xq, xd = activations(x[t])
        want = np.array([llama_dot(raw[r * row_bytes:(r + 1) * row_bytes], xq, xd) for r in range(n_out)],
                        np.float32)
        one = np.empty(n_out, np.float32)
        layer.matvec(x[t], one)
        np.testing.assert_array_equal(one.view(np.uint32), want.view(np.uint32), err_msg=f"matvec token {t}")
        np.testing.assert_array_equal(batch[t].view(np.uint32), want.view(np.uint32), err_msg=f"matmul token {t}")


def test_e8m0_half_scale_every_byte():
    """2^(e - 128) for every byte, e = 0 and 1 as float32 subnormals (GGML_E8M0_TO_FP32_HALF); 255 is 2^127, the
    format's NaN code left unhandled as llama.cpp leaves it."""
    e = np.arange(256)
    want = np.array([np.ldexp(1.0, int(k) - 128) for k in e]).astype(np.float32)
    np.testing.assert_array_equal(reference.e8m0_to_f32_half(e).view(np.uint32), want.view(np.uint32))
    blocks = np.zeros(256, FMT.block_dtype)
    blocks["e"], blocks["qs"] = e, 0x11  # every value is level 1: the scale itself
    got = quant.dequantize(blocks.view(np.uint8), "MXFP4", (256 * 32,)).reshape(256, 32)
    np.testing.assert_array_equal(got.view(np.uint32), np.repeat(want[:, None], 32, axis=1).view(np.uint32))


# --- against llama.cpp's own outputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel,n_in", [(k, n) for k in ("vec_dot_mxfp4_q8_0", "gemv_mxfp4_8x8_q8_0")
                                          for n in sorted(LLAMA_CPP[k], key=int)])
def test_matmul_bits_equal_llama_cpp(kernel, n_in):
    """Rows not in eights: ggml_vec_dot_mxfp4_q8_0's bits; rows in eights: the repacked gemv's (and gemm's)."""
    rec = LLAMA_CPP[kernel][n_in]
    n_in, n_out, n_tokens = int(n_in), rec["rows"], rec["tokens"]
    layer = quant.QuantLinear(recorded.lcg_mxfp4_matrix(n_out, n_in), "MXFP4", (n_out, n_in))
    assert layer.rows8 == kernel.startswith("gemv")
    x = recorded.lcg_activations(n_tokens, n_in)
    out = np.empty((n_tokens, n_out), np.float32)
    layer.matmul(x, out)
    one = np.empty(n_out, np.float32)
    layer.matvec(x[0], one)
    np.testing.assert_array_equal(one.view(np.uint32), np.array(rec["first_token_bits"], np.uint32))
    assert sha16(out) == rec["sha256_16"]


@pytest.mark.parametrize("name", sorted(recorded.DATASETS))
def test_quantizer_bytes_equal_llama_cpp(name):
    x = recorded.DATASETS[name]()
    for got in (reference.quantize_mxfp4(x.reshape(-1, 32)).view(np.uint8), quantize_fast(x, "MXFP4")):
        assert sha16(got) == LLAMA_CPP["quantize_mxfp4_sha256_16"][name]


def test_quantize_round_trip_error():
    # 8 magnitudes a block on a power-of-two scale, the largest value in [4, 8) of it: coarser than IQ4_NL's levels
    # (5.8e-3 here) and Q4_0's (7.4e-3); measured 1.4e-2 on these Gaussian data, the limit leaves 2x headroom
    x = np.random.default_rng(3).standard_normal((8, 512)).astype(np.float32)
    y = quant.dequantize(quantize_fast(x, "MXFP4"), "MXFP4", x.shape)
    assert ((y - x) ** 2).sum() / (x ** 2).sum() < 3e-2


def test_tiny_model_with_mxfp4_weights_runs_and_matches_the_reference(tmp_path):
    """A GGUF whose matrices are MXFP4 (type 39) loads, its batch matches the numpy reference forward pass (gguf-py's
    dequantizer, float64) and token-by-token decoding matches the batch."""
    spec = TinySpec(n_embd=256, n_head=4, n_head_kv=2, n_ff=512, weight_type="MXFP4", embd_type="Q8_0")
    model, tokens, fast = check_fast_matches_reference(tmp_path, spec, bound=QUANTIZED_VS_REFERENCE_NMSE)
    check_decode_matches_batch(model, tokens, fast)

"""IQ4_NL: the kernels against a numpy model of llama.cpp's arithmetic and against llama.cpp's own outputs, the
quantizer against llama.cpp's bytes, and a requantized SmolLM2 against the numpy reference forward pass.

llama.cpp's ggml_vec_dot_iq4_nl_q8_0 (AVX2): per block, 8 exact int32 lanes (four consecutive elements each) of the
table values times the int8 activations; one FMA per block with d_w * d_x into one of two float accumulators, even
blocks into the first and odd into the second; the two added lane by lane, the lanes summed as hsum_float_8 does; an
odd last block as a scalar FMA after that. The model below does the same with exact rational arithmetic and one
rounding to float32 per operation, so it depends on nothing in quant's kernels. The generic checks (dequantize vs
gguf-py, matmul rows vs matvec, tiles, groups, the Numba quantizer vs its reference) run IQ4_NL through the format
registry with every other format.

The recorded hashes are of llama.cpp's outputs (the copy vendored in llama-cpp-python 0.3.36): quantize_iq4_nl from
ggml/src/ggml-quants.c compiled with -ffp-contract=off (as the K-quant hashes in test_quantize_kquants; a build with
contraction gave the same bytes on these inputs), ggml_vec_dot_iq4_nl_q8_0 from ggml/src/ggml-cpu/arch/x86/quants.c
compiled with gcc -O2 -mavx2 -mfma -mf16c (its AVX2 path, contracting the odd last block's d * sumi + sum into an
FMA), called through ctypes. docs/adding-a-format.md says how.
"""

import hashlib
from fractions import Fraction

import numpy as np
import pytest
from test_quantize_kquants import DATASETS

import edgellm.engine.gguf
from edgellm import quant
from edgellm.engine.models import build_model
from edgellm.prep.quantize import quantize_file
from edgellm.engine.reference import ReferenceModel
from edgellm.quant import reference
from edgellm.quant.activations import quantize_act_q8_0
from edgellm.quant.quantize_kernels import quantize_fast
from edgellm.quant.testing import random_matrix_bytes

KVALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
FMT = quant.format_by_name("IQ4_NL")


def f32(q) -> np.float32:
    """The float32 nearest the rational q (ties to even): one rounding, as a float32 operation's result."""
    x = np.float32(float(q))  # within an ulp of q; pick the nearest of it and its neighbours
    cands = [x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(-np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - q), int(np.array(c).view(np.uint32)) & 1))
    return np.float32(best)


def fma(a, b, c) -> np.float32:
    return f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def add(a, b) -> np.float32:
    return f32(Fraction(float(a)) + Fraction(float(b)))


def hsum_float_8(v):
    h = [add(v[i + 4], v[i]) for i in range(4)]
    return add(add(h[0], h[2]), add(h[1], h[3]))


def block_values(raw, b):
    """The 32 table values of block b (low nibbles first) and its d."""
    blk = raw[b * 18:(b + 1) * 18]
    qs = blk[2:]
    idx = np.concatenate([qs & 15, qs >> 4])
    return np.array([KVALUES[i] for i in idx], np.int64), np.float32(blk[:2].view(np.float16)[0])


def llama_vec_dot(row, xq, xd):
    """ggml_vec_dot_iq4_nl_q8_0's result for one row (raw bytes) and one token's Q8_0 activations."""
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


def activations(x):
    n_in = x.shape[-1]
    xq, xd, xs = np.empty(n_in, np.int8), np.empty(n_in // 32, np.float32), np.empty(n_in // 32, np.float32)
    quantize_act_q8_0(x, xq, xd, xs)
    return xq, xd


@pytest.mark.parametrize("n_in", [256, 288])  # an even and an odd number of blocks (the scalar last step)
def test_matvec_and_matmul_rows_equal_llama_cpp_arithmetic(n_in):
    n_out, n_tokens = 19, 21  # a row block ending on an odd row; eight-token tiles, a four-token tile, single tokens
    raw = random_matrix_bytes(FMT, n_out, n_in, np.random.default_rng(n_in))
    layer = quant.QuantLinear(raw, "IQ4_NL", (n_out, n_in))
    x = np.random.default_rng(1).standard_normal((n_tokens, n_in)).astype(np.float32)
    x[3] *= 1e-3  # one token of small activations
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


def test_reference_dequantize_hand_built_block():
    """d * table[index]: index j in the low nibble of byte j (elements 0-15), the high nibble (16-31)."""
    blk = np.zeros(1, FMT.block_dtype)
    blk["d"] = 0.5
    blk["qs"] = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    want = np.float32(0.5) * np.array(KVALUES + KVALUES[::-1], np.float32)
    got = reference.dequantize(blk.view(np.uint8), "IQ4_NL", (32,))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(quant.dequantize(blk.view(np.uint8), "IQ4_NL", (32,)), want)


# --- against llama.cpp's own outputs -------------------------------------------------------------------------------

LLAMA_CPP_QUANTIZE_SHA256 = {"cos": "23f5268a9821b328", "lcg": "a0a0c37a80879390"}  # quantize_iq4_nl, no imatrix
LLAMA_CPP_DOT_SHA256 = {256: "c56e01208e3efc22", 288: "0fde030d5c665a3a"}  # vec_dot for each (token, row)


def _lcg_bytes(n, seed):
    i = np.arange(n, dtype=np.uint64) + np.uint64(seed)
    return (((i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(1 << 32)) >> np.uint64(13)).astype(np.uint8)


def lcg_iq4_nl_matrix(n_out, n_in):
    """IQ4_NL bytes from an integer LCG, scales exact halves d = (k % 13 - 6) / 512 (zeros and both signs)."""
    raw = _lcg_bytes(n_out * n_in // 32 * 18, 7).reshape(-1, 18)
    d = ((np.arange(raw.shape[0]) % 13) - 6).astype(np.float16) * np.float16(2.0 ** -9)
    raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def lcg_activations(n_tokens, n_in):
    b = _lcg_bytes(n_tokens * n_in, 99).astype(np.float64).reshape(n_tokens, n_in)
    return ((b - 127.5) / 64.0 * (1 + np.arange(n_tokens)[:, None] % 3)).astype(np.float32)


@pytest.mark.parametrize("n_in", sorted(LLAMA_CPP_DOT_SHA256))
def test_matmul_bits_equal_llama_cpp_vec_dot(n_in):
    n_out, n_tokens = 24, 11
    layer = quant.QuantLinear(lcg_iq4_nl_matrix(n_out, n_in), "IQ4_NL", (n_out, n_in))
    out = np.empty((n_tokens, n_out), np.float32)
    layer.matmul(lcg_activations(n_tokens, n_in), out)
    assert hashlib.sha256(out.tobytes()).hexdigest()[:16] == LLAMA_CPP_DOT_SHA256[n_in]


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_QUANTIZE_SHA256))
def test_quantizer_bytes_equal_llama_cpp(name):
    x = DATASETS[name]()
    x = x.reshape(-1, x.shape[-1])
    for got in (reference.quantize_iq4_nl(x.reshape(-1, 32)).view(np.uint8), quantize_fast(x, "IQ4_NL")):
        assert hashlib.sha256(np.ascontiguousarray(got).tobytes()).hexdigest()[:16] == LLAMA_CPP_QUANTIZE_SHA256[name]


def test_quantize_round_trip_error():
    # 16 levels over a block's range, denser near zero: about 4-bit rounding error on Gaussian data (~7e-3 NMSE
    # for Q4_0's uniform levels); the limit leaves 2x headroom
    x = np.random.default_rng(3).standard_normal((8, 512)).astype(np.float32)
    y = quant.dequantize(quantize_fast(x, "IQ4_NL"), "IQ4_NL", x.shape)
    assert ((y - x) ** 2).sum() / (x ** 2).sum() < 1.5e-2


# --- a real model, requantized -------------------------------------------------------------------------------------

# SmolLM2 requantized from its Q4_1 file to IQ4_NL (llama.cpp's mix: Q5_K for the first ffn_down layers, Q8_0 for the
# tied token embedding, whose 576 columns do not split into Q6_K's 256): the fast path's logits against the numpy
# reference forward pass, which dequantizes every weight with gguf-py and computes in float64. The difference is the
# int8 activation rounding of each matmul, as for the Gemma long-prompt check in test_models_real (LONG_PROMPT_NMSE
# there); measured 1.3e-3.
REQUANTIZED_LOGITS_NMSE = 5e-3
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1232, 30]  # fixed ids from SmolLM2's vocabulary


@pytest.fixture(scope="module")
def iq4_nl_smollm2(smollm2_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("iq4_nl") / "smollm2-iq4_nl.gguf"
    quantize_file(smollm2_path, path, "IQ4_NL", allow_requantize=True, progress=False)
    return path


def test_requantized_smollm2_loads_generates_and_matches_the_reference(iq4_nl_smollm2):
    with edgellm.engine.gguf.open(iq4_nl_smollm2) as f:
        kinds = {t.ggml_type for t in f.tensors.values()}
        assert {"IQ4_NL", "Q5_K", "Q8_0"} <= kinds
        model = build_model(f, n_ctx=256, n_threads=2, n_batch=64)
        ids = np.array(PROMPT, np.int32)
        got = model.forward(ids, all_logits=True)
        want = ReferenceModel(f).logits(ids)
        error = float(np.sum((got - want) ** 2) / np.sum(want.astype(np.float64) ** 2))
        print(f"IQ4_NL SmolLM2: NMSE vs reference {error:.2e}")
        assert error < REQUANTIZED_LOGITS_NMSE
        assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.8
        tokens = []  # greedy decoding runs: each step's logits are finite and pick a token
        for _ in range(8):
            logits = model.forward(np.array([int(got[-1].argmax()) if not tokens else tokens[-1]], np.int32))[0]
            assert np.isfinite(logits).all()
            tokens.append(int(logits.argmax()))
        assert len(tokens) == 8

"""Quantizers: the numpy K-quant references against llama.cpp, the Numba kernels against the references, and the
round trip through a GGUF file read back by edgellm's own reader.

Three separate checks per format, as llama.cpp's tests/test-quantize-fns.cpp does: the reference's bytes (here
compared with llama.cpp's own output), the round-trip error (under test-quantize-fns' per-type limits), and the
fast path against the reference (bit-exact).
"""

import hashlib

import gguf
import numpy as np
import pytest

import edgellm.engine.gguf as gguf_reader
from edgellm.quant import dequantize
from edgellm.quant.kquants_quantize import quantize_k
from edgellm.quant.quantize_kernels import quantize_fast
from edgellm.quant.registry import kernels_for, records

K_FORMATS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
LEGACY_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

# test-quantize-fns.cpp's limits on its total error, sqrt(sum of squared differences) / n, for its data
# 0.1 + 2 cos(i) (n = 4096): MAX_QUANTIZATION_TOTAL_ERROR, _2BITS and _3BITS.
LLAMA_CPP_MAX_TOTAL_ERROR = {"Q2_K": 0.0075, "Q3_K": 0.0040, "Q4_K": 0.002, "Q5_K": 0.002, "Q6_K": 0.002}

# First 16 hex digits of the sha256 of what llama.cpp's quantize_row_<type>_ref (ggml/src/ggml-quants.c, the
# vendored copy in llama-cpp-python 0.3.36, compiled with -ffp-contract=off) writes for the two inputs below.
# Equal hashes mean byte-identical blocks: same scale search, same rounding, same packing.
LLAMA_CPP_REF_SHA256 = {
    ("Q2_K", "cos"): "8769945b59ba9fa8", ("Q2_K", "lcg"): "c7b86fe6fed29112",
    ("Q3_K", "cos"): "08b8f2a04166c2a4", ("Q3_K", "lcg"): "174954f648711634",
    ("Q4_K", "cos"): "c5b0ab128cca9069", ("Q4_K", "lcg"): "b26d0923eead13a7",
    ("Q5_K", "cos"): "031cc3b5b2266ee6", ("Q5_K", "lcg"): "f44b71d3d054b6fe",
    ("Q6_K", "cos"): "8b76c8de301bb3d0", ("Q6_K", "lcg"): "76cf32d070cbdead",
    ("Q8_K", "cos"): "eee1551a667b0087", ("Q8_K", "lcg"): "68e90f08352f0d57",
}


def cos_data(n=4096):
    """test-quantize-fns' generate_data(0, n); computed in float64 so no libm's float32 cos can change a bit."""
    return (0.1 + 2 * np.cos(np.arange(n, dtype=np.float64))).astype(np.float32)


def lcg_weights(rows=8, cols=1024):
    """Weight-like rows from an integer LCG (exact on every platform, unlike a seeded normal generator), with
    an all-zero row, an outlier and a row whose first super-block is zero."""
    i = np.arange(rows * cols * 4, dtype=np.uint64)
    u = ((i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(1 << 32)).astype(np.float64) / 2**32
    g = u.reshape(-1, 4).sum(axis=1) - 2.0
    x = (g.reshape(rows, cols) * (0.02 * (1 + np.arange(rows)))[:, None]).astype(np.float32)
    x[1] = 0
    x[2, 7] = 1.5
    x[3, :300] = 0
    return x


DATASETS = {"cos": cos_data, "lcg": lcg_weights}


def awkward_data():
    """Inputs that exercise the degenerate branches: zero, constant and one-sided groups, huge and tiny values,
    float16 overflow and subnormal scales."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((12, 512)).astype(np.float32)
    x[0] = 0
    x[1, :16] = 0
    x[2, :256] = 3.0
    x[3, 5] = 1000
    x[4, :32] = -2
    x[5] = rng.uniform(0.5, 1, 512)
    x[6] *= 1e-6
    x[7] *= 3e3
    x[8] = rng.standard_t(2, 512)
    x[9, ::2] = 0
    x[10] *= 1e5  # scales past float16's range
    x[11] *= 1e-9  # scales in float16's subnormal range
    return x


@pytest.mark.parametrize("fmt", K_FORMATS + ("Q8_K",))
@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_kquant_reference_bytes_equal_llama_cpp(fmt, dataset):
    blocks = quantize_k(DATASETS[dataset](), fmt)
    assert hashlib.sha256(blocks.tobytes()).hexdigest()[:16] == LLAMA_CPP_REF_SHA256[(fmt, dataset)]


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_kquant_round_trip_error_under_llama_cpp_limit(fmt):
    x = cos_data()
    y = dequantize(quantize_k(x, fmt), fmt, x.shape)
    total_error = np.sqrt(np.sum((x.astype(np.float64) - y) ** 2)) / x.size  # test-quantize-fns' array_rmse
    assert total_error < LLAMA_CPP_MAX_TOTAL_ERROR[fmt]


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_kquant_error_shrinks_with_more_bits(fmt):
    """On weight-like data each extra bit must cut the error: a broken scale search would not."""
    x = lcg_weights()
    errors = {f: np.sqrt(np.mean((x - dequantize(quantize_k(x, f), f, x.shape)) ** 2)) for f in K_FORMATS}
    order = [errors[f] for f in K_FORMATS]
    assert all(a > b for a, b in zip(order, order[1:])), errors


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the 1e5-scaled row, on purpose
@pytest.mark.parametrize("fmt", [r.name for r in records() if r.quantizer])
def test_fast_kernel_bytes_equal_reference(fmt):
    record = kernels_for(fmt)
    for x in (lcg_weights(), awkward_data(), cos_data().reshape(2, -1)):
        with np.errstate(all="ignore"):  # (the K-quant searches meet inf/NaN in degenerate groups, as C does)
            blocks = record.reference_quantizer()(np.asarray(x, np.float32).reshape(-1, record.format.block_size))
        expected = blocks.view(np.uint8).reshape(x.shape[0], -1)
        np.testing.assert_array_equal(quantize_fast(x, fmt), expected)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the 1e5-scaled row, on purpose
@pytest.mark.parametrize("fmt", LEGACY_FORMATS + ("F16", "BF16"))
def test_fast_quantize_equals_gguf_py(fmt):
    x = awkward_data()[:, :256]
    expected = gguf.quants.quantize(x, gguf.GGMLQuantizationType[fmt])
    np.testing.assert_array_equal(quantize_fast(x, fmt).view(np.uint8), expected.view(np.uint8).reshape(x.shape[0], -1))


def test_quantize_fast_rejects_rows_that_do_not_split_into_blocks():
    with pytest.raises(ValueError, match="block size 256"):
        quantize_fast(np.zeros((2, 576), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="2-D"):
        quantize_fast(np.zeros(256, np.float32), "Q4_K")


ROUND_TRIP_RMS = {  # rms error of dequantize(quantize(x)) relative to rms(x), for Gaussian-like weights
    "Q2_K": 0.40, "Q3_K": 0.20, "Q4_K": 0.10, "Q5_K": 0.05, "Q6_K": 0.025,
    "Q4_0": 0.12, "Q4_1": 0.10, "Q5_0": 0.06, "Q5_1": 0.05, "Q8_0": 0.008, "F16": 1e-3, "BF16": 8e-3,
}


def test_round_trip_through_a_gguf_file_and_edgellm_reader(tmp_path):
    """Quantize with the fast path, write with gguf-py's GGUFWriter, read back with edgellm.engine.gguf and dequantize
    with quant.dequantize: shape, type and values survive, and equal gguf-py's own dequantization."""
    x = lcg_weights(rows=16, cols=512)
    path = tmp_path / "all_formats.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for fmt in ROUND_TRIP_RMS:
        writer.add_tensor(f"{fmt}.weight", quantize_fast(x, fmt), raw_dtype=gguf.GGMLQuantizationType[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    rows = np.r_[0, 2:16]  # skip the all-zero row in the relative error
    with gguf_reader.open(path) as f:
        for fmt, limit in ROUND_TRIP_RMS.items():
            t = f.tensors[f"{fmt}.weight"]
            assert (t.ggml_type, t.shape) == (fmt, x.shape)
            y = dequantize(t.data, t.ggml_type, t.shape)
            np.testing.assert_array_equal(y, gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType[fmt]).reshape(x.shape))
            rel = np.sqrt(np.mean((y[rows] - x[rows]) ** 2)) / np.sqrt(np.mean(x[rows] ** 2))
            assert rel < limit, (fmt, rel)
            assert np.all(y[1] == 0)

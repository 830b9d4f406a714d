"""The format table and the numpy reference: gguf-py agreement, hand-built blocks, size validation.

Nothing here compiles Numba kernels; tests/test_quant_kernels.py checks the kernels against this reference.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from edgellm import quant
from edgellm.quant import reference
from edgellm.quant.formats import FORMATS, UnknownFormatError, format_by_id, format_by_name
from edgellm.quant.testing import hand_built, random_blocks

FORMAT_IDS = [f.name for f in FORMATS]
GGUF_DEQUANTIZES = {f.name for f in FORMATS if f.name != "Q8_K"}  # gguf-py has no Q8_K class
N_RANDOM_BLOCKS = 256


# --- the table ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_format_matches_gguf_py(fmt):
    ggml_type = GGMLQuantizationType[fmt.name]
    assert fmt.type_id == int(ggml_type)
    assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[ggml_type]
    assert fmt.block_dtype.itemsize == fmt.type_size
    assert format_by_name(fmt.name) is fmt and format_by_id(fmt.type_id) is fmt


def test_lookup_accepts_lowercase_and_entries():
    assert format_by_name("q4_k") is format_by_name("Q4_K")
    assert format_by_name(format_by_name("Q8_0")).name == "Q8_0"


@pytest.mark.parametrize("lookup, key", [(format_by_name, "Q9_9"), (format_by_id, 16), (format_by_id, 9999),
                                         (format_by_id, "x")])
def test_unknown_format_is_a_clear_key_error(lookup, key):
    with pytest.raises(KeyError) as info:
        lookup(key)
    assert isinstance(info.value, UnknownFormatError)
    assert str(key) in str(info.value) and "known" in str(info.value)


# --- dequantize ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_dequantize_random_blocks_bit_exact_with_gguf_py(fmt):
    if fmt.name not in GGUF_DEQUANTIZES:
        pytest.skip(f"gguf-py has no {fmt.name} dequantizer (the hand-built block test covers it)")
    raw = random_blocks(fmt, N_RANDOM_BLOCKS, np.random.default_rng(fmt.type_id))
    shape = (4, N_RANDOM_BLOCKS * fmt.block_size // 4)
    ours = reference.dequantize(raw, fmt.name, shape)
    theirs = gguf_dequantize(raw.reshape(4, -1), GGMLQuantizationType[fmt.name])
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_dequantize_hand_built_block(fmt):
    raw, want = hand_built(fmt.name)
    np.testing.assert_array_equal(reference.dequantize(raw, fmt.name, (fmt.block_size,)), want)


# --- quantize ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(reference.GGUF_PY_QUANTIZABLE))
def test_quantize_bit_exact_with_gguf_py(name):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, 256)) * rng.uniform(0.01, 10, (6, 1))).astype(np.float32)
    x[0, :32] = 0            # an all-zero block (scale 0)
    x[1, :32] = 3.0          # a constant block (max == min)
    x[2, 5] = np.float32(3e4)   # one huge value, still a finite float16 scale
    ours = quant.quantize(x, name)
    theirs = np.ascontiguousarray(gguf_quantize(x, GGMLQuantizationType[name]))
    np.testing.assert_array_equal(ours, theirs.view(np.uint8).reshape(ours.shape))


def test_bf16_quantize_rounds_to_nearest_even_and_keeps_nan():
    x = np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, np.nan], np.float32)  # ties: down to even, up to even
    got = quant.quantize(x, "BF16").view(np.uint16)
    assert got[0] == 0x3F80 and got[1] == 0x3F82 and (got[2] & 0x7FC0) == 0x7FC0


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantize_round_trip_error(name):
    # Uniform rounding error over a step of (block range) / 2**bits: NMSE ~ step**2 / 12 for Gaussian data
    # (4-bit ~7e-3, 5-bit ~1.7e-3, 8-bit ~3e-5); the limits leave 2x headroom.
    round_trip_nmse = {"Q4_0": 1.5e-2, "Q4_1": 1.5e-2, "Q5_0": 4e-3, "Q5_1": 4e-3, "Q8_0": 6e-5}
    x = np.random.default_rng(3).standard_normal((8, 512)).astype(np.float32)
    y = quant.dequantize(quant.quantize(x, name), name, x.shape)
    assert ((y - x) ** 2).sum() / (x ** 2).sum() < round_trip_nmse[name]


def test_quantize_rejects_formats_without_a_quantizer():
    with pytest.raises(ValueError, match="Q4_K"):
        quant.quantize(np.zeros(256, np.float32), "Q4_K")


# --- sizes are checked before anything runs -------------------------------------------------------------------


@pytest.mark.parametrize("dequantize", [reference.dequantize, quant.dequantize], ids=["reference", "numba"])
def test_dequantize_rejects_bad_sizes(dequantize):
    good = np.zeros(2 * 144, np.uint8)
    with pytest.raises(ValueError, match="block size 256"):
        dequantize(good, "Q4_K", (2, 200))          # row not a multiple of the block
    with pytest.raises(ValueError, match="needs 288 bytes, got 287"):
        dequantize(good[:-1], "Q4_K", (2, 256))     # one byte short
    with pytest.raises(ValueError, match="needs 288 bytes"):
        dequantize(np.zeros(400, np.uint8), "Q4_K", (2, 256))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(good.view(np.int8), "Q4_K", (2, 256))
    with pytest.raises(ValueError, match="shape"):
        dequantize(good, "Q4_K", (2, -256))
    with pytest.raises(KeyError):
        dequantize(good, "Q7_K", (2, 256))


def test_quantize_rejects_bad_row_length():
    with pytest.raises(ValueError, match="block size 32"):
        quant.quantize(np.zeros((2, 40), np.float32), "Q8_0")


def test_dequantize_accepts_bytes_and_keeps_shape():
    raw, want = hand_built("Q8_0")
    got = quant.dequantize(bytes(raw), "Q8_0", (1, 32))
    assert got.shape == (1, 32)
    np.testing.assert_array_equal(got[0], want)


# --- activation quantization (what the integer kernels multiply with) -------------------------------------------


def test_act_q8_0_reference_properties():
    x = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    x[:32] = 0
    q, d, s = reference.quantize_act_q8_0(x)
    assert q.dtype == np.int8 and d[0] == 0 and not q[:32].any()
    assert np.abs(q).max() == 127  # the block's largest magnitude maps to +-127
    # d and s are float16 values (llama.cpp's block_q8_0 / q8_1 store them so); the quants were chosen with the
    # unrounded d, so each value is within half a step plus 127 times d's float16 rounding (2**-11 relative)
    np.testing.assert_array_equal(d, d.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(s, s.astype(np.float16).astype(np.float32))
    err = np.abs(q.astype(np.float32) * np.repeat(d, 32) - x)
    assert np.all(err <= np.repeat(d, 32) * (0.5 + 127 * 2.0**-11) * 1.001)
    np.testing.assert_allclose(s, d * q.reshape(-1, 32).sum(axis=1).astype(np.float32), rtol=2 * 2.0**-11)


def test_act_q8_k_reference_properties():
    x = np.random.default_rng(2).standard_normal(512).astype(np.float32)
    x[256:] = 0
    q, d, bsums = reference.quantize_act_q8_k(x)
    assert d[1] == 0 and not q[256:].any()
    vmax = x[np.abs(x[:256]).argmax()]
    assert q[np.abs(x[:256]).argmax()] == -127 * np.sign(vmax)  # iscale = -127 / max flips the sign
    np.testing.assert_array_equal(bsums, q.reshape(-1, 16).sum(axis=1))
    assert np.all(np.abs(q[:256] * d[0] - x[:256]) <= abs(d[0]) * 0.5001)

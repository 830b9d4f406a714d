"""Numba kernels against the numpy reference: dequantize, activation quantization, QuantLinear.

Every registered format runs through every check. Random weights are random quant bytes with sane float16
scales; the dot-product checks compare with float64 matmuls of the dequantized weights.
"""

import functools
import platform
import sys

import numpy as np
import pytest
from numba import njit

import background
from edgellm import quant
from edgellm.quant import reference, simd
from edgellm.quant.activations import quantize_act_q8_0, quantize_act_q8_k
from edgellm.quant.formats import FORMATS
from edgellm.quant.kernels_float import round_activations
from edgellm.quant.registry import DRIVER_MINS, FLOAT, Q8_0, Q8_K, kernels_for, records
from edgellm.quant.simd import f32x4_lane, load_f16, load_f16_pair, load_f16_portable, load_f16x2_rows, prefetch
from edgellm.quant.testing import hand_built, random_matrix_bytes

FORMAT_IDS = [f.name for f in FORMATS]

# Named tolerances (NMSE of outputs vs float64), one per family:
FLOAT_ACT_NMSE = 1e-11   # F32/F16/BF16 weights with float32 activations: only float32 summation error
Q8_0_ACT_NMSE = 2e-4     # 32-element formats: activations rounded to int8 per 32 (~3e-5 for Gaussian inputs)
Q8_K_ACT_NMSE = 4e-4     # K-quants: int8 per 256, a coarser activation scale (~6e-5 measured, cancellations more)
NMSE_LIMIT = {FLOAT: FLOAT_ACT_NMSE, Q8_0: Q8_0_ACT_NMSE, Q8_K: Q8_K_ACT_NMSE}
Q8_0_ACT_FORMATS = [r.name for r in records(Q8_0)]  # the formats the generated block32 drivers run


def nmse(got, want):
    return float(((np.asarray(got, np.float64) - want) ** 2).sum() / (want ** 2).sum())


def matrix(fmt, n_out, n_in, seed=0):
    return random_matrix_bytes(fmt, n_out, n_in, np.random.default_rng(seed))


def shape_for(fmt):
    """An (n_out, n_in) that exercises the edges: odd row counts, float rows not a multiple of 8."""
    return (37, 512) if fmt.block_size > 1 else (37, 203)


# --- dequantize ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_numba_dequantize_equals_reference(fmt):
    n_out, n_in = shape_for(fmt)
    raw = matrix(fmt, n_out, n_in)
    want = reference.dequantize(raw, fmt.name, (n_out, n_in))
    np.testing.assert_array_equal(quant.dequantize(raw, fmt.name, (n_out, n_in)).view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(quant.QuantLinear(raw, fmt.name, (n_out, n_in)).dequantize(), want)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_numba_dequantize_hand_built_block(fmt):
    raw, want = hand_built(fmt.name)
    np.testing.assert_array_equal(quant.dequantize(raw, fmt.name, (1, fmt.block_size))[0], want)


@njit(cache=True)
def _all_halves(bits, native):
    out = np.empty(bits.size // 2, np.float32)
    for i in range(out.size):
        out[i] = load_f16(bits, 2 * i) if native else load_f16_portable(bits, 2 * i)
    return out


@pytest.mark.parametrize("native", [True, False], ids=["host", "integer-only"])
def test_f16_loads_convert_every_half_exactly(native):
    halves = np.arange(65536, dtype=np.uint16)
    want = halves.view(np.float16).astype(np.float32)
    got = _all_halves(halves.view(np.uint8), native)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])


# --- activation quantization ---------------------------------------------------------------------------------


def _activations(n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * rng.uniform(0.01, 30)).astype(np.float32)
    x[:32] = 0                       # an all-zero block
    x[64:96] = np.float32(0.5)       # exact ties after scaling: round half to even
    x[96] = np.float32(-7.0)
    return x


def test_numba_act_q8_0_equals_reference():
    x = _activations(1024, 1)
    xq, xd, xs = np.empty(1024, np.int8), np.empty(32, np.float32), np.empty(32, np.float32)
    quantize_act_q8_0(x, xq, xd, xs)
    for got, want in zip((xq, xd, xs), reference.quantize_act_q8_0(x)):
        np.testing.assert_array_equal(got, want)


def test_numba_act_q8_k_equals_reference():
    x = _activations(1024, 2)
    x[256:512] = 0
    xq, xd, bsums = np.empty(1024, np.int8), np.empty(4, np.float32), np.empty(64, np.int32)
    quantize_act_q8_k(x, xq, xd, bsums)
    for got, want in zip((xq, xd, bsums), reference.quantize_act_q8_k(x)):
        np.testing.assert_array_equal(got, want)


def test_numba_act_q8_k_sign_of_the_largest_magnitude():
    """Where +max|x| and -max|x| both occur in a block, the scale's sign follows the first of them (llama.cpp's
    quantize_row_q8_K), or +max|x| with positive_wins (its 4-row quantizer). Block 0 has -5 first, then +5: there
    the two rules give opposite scales, so every quant, the scale and the sums change sign. Block 1 has +5 first,
    block 2 only -5, block 3 only +5 (twice): there both rules agree with the reference."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(1024) * 0.5).astype(np.float32)
    x[10], x[20] = -5.0, 5.0
    x[256 + 30], x[256 + 31] = 5.0, -5.0
    x[512 + 7] = -5.0
    x[768 + 3] = x[768 + 200] = 5.0
    q_ref, d_ref, sums_ref = reference.quantize_act_q8_k(x)
    assert d_ref[0] > 0 > d_ref[1]  # d = -vmax / 127
    for positive_wins in (False, True):
        xq, xd, bsums = np.empty(1024, np.int8), np.empty(4, np.float32), np.empty(64, np.int32)
        quantize_act_q8_k(x, xq, xd, bsums, positive_wins)
        flip = -1 if positive_wins else 1
        np.testing.assert_array_equal(xq[:256], flip * q_ref[:256])
        np.testing.assert_array_equal(xd[0], flip * d_ref[0])
        np.testing.assert_array_equal(bsums[:16], flip * sums_ref[:16])
        np.testing.assert_array_equal(xq[256:], q_ref[256:])
        np.testing.assert_array_equal(xd[1:], d_ref[1:])
        np.testing.assert_array_equal(bsums[16:], sums_ref[16:])


# --- QuantLinear ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_matvec_and_matmul_match_float64(fmt):
    n_out, n_in = shape_for(fmt)
    raw = matrix(fmt, n_out, n_in, seed=1)
    layer = quant.QuantLinear(raw, fmt.name, (n_out, n_in))
    w = reference.dequantize(raw, fmt.name, (n_out, n_in)).astype(np.float64)
    x = np.random.default_rng(2).standard_normal((9, n_in)).astype(np.float32)
    # F16 / BF16 weights multiply activations rounded to their own type, as llama.cpp's do
    want = round_activations(x, fmt.name).astype(np.float64) @ w.T

    out = np.empty((9, n_out), np.float32)
    layer.matmul(x, out)
    assert nmse(out, want) < NMSE_LIMIT[kernels_for(fmt).activation]
    one = np.empty(n_out, np.float32)
    layer.matvec(x[3], one)
    assert nmse(one, want[3]) < NMSE_LIMIT[kernels_for(fmt).activation]


def _decoded_rows_equal_matvec(layer, x):
    """Asserts that the rows of x decoded together (sizes of 1) equal matvec's bits; returns (out, matvec rows)."""
    ones = np.empty((x.shape[0], layer.n_out), np.float32)
    for t in range(x.shape[0]):
        layer.matvec(x[t], ones[t])
    out = np.empty_like(ones)
    layer.matmul(x, out, sizes=(1,) * x.shape[0])
    np.testing.assert_array_equal(out, ones)
    return out, ones


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("n_out", [37, 40])  # 40: a multiple of 8, which llama.cpp repacks for Q4_K
def test_matmul_rows_equal_matvec_bit_for_bit(fmt, n_out):
    """Decoding sequences together (sizes of 1) gives every row matvec's bits, whatever the token tiling; a plain
    batch too, except for Q4_K (repacked), Q6_K and IQ4_XS, whose batches llama.cpp multiplies with other kernels.
    The float formats' rows here are 203 wide, which llama.cpp's tinyBLAS refuses (not a multiple of 8), so their
    batches take the one-row dot too (tests/test_quant_float.py has the widths where they differ)."""
    n_in = shape_for(fmt)[1]
    layer = quant.QuantLinear(matrix(fmt, n_out, n_in, seed=3), fmt.name, (n_out, n_in))
    x = np.random.default_rng(4).standard_normal((45, n_in)).astype(np.float32)
    batch_kernels = fmt.name in ("Q4_K", "Q6_K", "IQ4_XS")  # IQ4_XS: the tiled matmul from 8 tokens
    for n_tokens in (45, 13, 1, 2, 3, 4, 6, 7, 12, 14, 24, 9):  # 45: tiles of 8 (of 16 with the 512-bit tiles),
        # a four-token tile and a single; 7: a padded tile (7 + 1 copy); 24: 16 + 8; 14: 8 + 4 + a pair; 3: padded
        # to a four-token tile with the 512-bit tiles, else a pair and a single; 9 last
        out, ones = _decoded_rows_equal_matvec(layer, x[:n_tokens])
        layer.matmul(x[:n_tokens], out)
        if not batch_kernels:
            np.testing.assert_array_equal(out, ones)
    if batch_kernels:  # rows 0..7 of a 9-token batch: Q4_K's 4-row gemm, Q6_K's tiled matmul
        other = (fmt.name == "Q4_K" and n_out % 8 == 0) or fmt.name in ("Q6_K", "IQ4_XS")
        assert (out[:8] != ones[:8]).any() == other
        if fmt.name == "Q4_K":  # the ninth token is the gemv's, as one token alone
            np.testing.assert_array_equal(out[8], ones[8])


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.block_size == 32 and f.name not in ("F16", "BF16")],
                         ids=lambda f: f.name)
def test_two_rows_padded_to_a_tile_keep_their_bits(fmt, monkeypatch):
    """A batch of two rows through a matrix too big for the caches runs as a padded four-token tile (with the 512-bit
    tiles): forced here for a small matrix on any host, every row still equals matvec's bits (and ten rows, whose
    last two stay singles, too)."""
    from edgellm.quant import linear
    monkeypatch.setattr(linear, "_PAD_TWO_FROM_BYTES", 0)
    n_out, n_in = 37, shape_for(fmt)[1]
    layer = quant.QuantLinear(matrix(fmt, n_out, n_in, seed=5), fmt.name, (n_out, n_in))
    if layer._kernel3 is None:
        pytest.skip(f"{fmt.name} does not go through the block32 tiles")
    x = np.random.default_rng(6).standard_normal((10, n_in)).astype(np.float32)
    for n_tokens in (2, 10):
        _decoded_rows_equal_matvec(layer, x[:n_tokens])


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.block_size == 32 and f.name not in ("F16", "BF16")],
                         ids=lambda f: f.name)
def test_batch_tails_unpadded_keep_their_bits(fmt, monkeypatch):
    """A batch's tokens after its tiles go two at a time through the two-token dots (vec_dot22_<fmt>), an odd last
    one alone. With the padding to bigger tiles turned off, so that every tail takes that path on any host (pairs,
    a pair and a single, after a four-token tile or an eight-token one), every row still equals matvec's bits."""
    from edgellm.quant import linear
    monkeypatch.setattr(linear, "_PAD_ROWS", {})
    monkeypatch.setattr(linear, "_PAD_TWO_FROM_BYTES", None)
    n_out, n_in = 37, shape_for(fmt)[1]  # 37: the last row block has an odd row, which goes through vec_dot
    layer = quant.QuantLinear(matrix(fmt, n_out, n_in, seed=7), fmt.name, (n_out, n_in))
    if layer._kernel3 is None:
        pytest.skip(f"{fmt.name} does not go through the block32 tiles")
    x = np.random.default_rng(8).standard_normal((15, n_in)).astype(np.float32)
    for n_tokens in (2, 3, 5, 6, 7, 10, 11, 15):
        _decoded_rows_equal_matvec(layer, x[:n_tokens])


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_bound_products_give_matvec_bits_on_their_buffers(fmt):
    """QuantLinear.bound (a decode step's product bound to its buffers) gives matvec's bits each call, on whatever
    the buffer holds then; QuantGroup.bound each of its layers' bits; wrong buffers are refused when bound."""
    from edgellm.quant.linear import QuantGroup, StepScratch
    n_out, n_in = 40, shape_for(fmt)[1]
    layers = [quant.QuantLinear(matrix(fmt, n_out, n_in, seed=20 + i), fmt.name, (n_out, n_in)) for i in range(3)]
    x, outs = np.empty((1, n_in), np.float32), [np.empty((1, n_out), np.float32) for _ in range(3)]
    scratch = StepScratch()
    call = layers[0].bound(x, outs[0], scratch)
    group = QuantGroup.of(*layers)
    group_call = group.bound(x, outs, scratch) if group is not None else None
    rng = np.random.default_rng(21)
    for _ in range(3):
        x[:] = rng.standard_normal((1, n_in))
        call()
        want = np.empty(n_out, np.float32)
        layers[0].matvec(x[0], want)
        np.testing.assert_array_equal(outs[0][0].view(np.uint32), want.view(np.uint32))
        if group_call is not None:
            group_call()
            for layer, out in zip(layers, outs):
                layer.matvec(x[0], want)
                np.testing.assert_array_equal(out[0].view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="shape"):
        layers[0].bound(np.empty((2, n_in), np.float32), outs[0], scratch)
    with pytest.raises(ValueError, match="float32"):
        layers[0].bound(x, np.empty((1, n_out), np.float64), scratch)


def test_row_kinds_follow_llama_cpp_dispatch():
    from edgellm.quant.registry import kernels_for, records

    def row_kinds(name, n_out, sizes):
        return kernels_for(name).row_kinds_of(n_out, sizes)
    np.testing.assert_array_equal(row_kinds("Q4_K", 640, (9,)), [1] * 8 + [0])
    np.testing.assert_array_equal(row_kinds("Q4_K", 640, (3, 5)), [0, 0, 0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(row_kinds("Q4_K", 644, (9,)), [0] * 9)  # not repacked
    np.testing.assert_array_equal(row_kinds("Q6_K", 640, (7, 8)), [0] * 7 + [1] * 8)
    np.testing.assert_array_equal(row_kinds("IQ4_XS", 640, (7, 8)), [0] * 7 + [1] * 8)
    # the float formats: tinyBLAS for batches of two or more, vec_dot for one token
    np.testing.assert_array_equal(row_kinds("F16", 640, (1, 2, 1)), [0, 1, 1, 0])
    # every other format computes all of a batch with one kernel
    assert {r.name for r in records() if r.row_kinds} == {"F32", "F16", "BF16", "Q4_K", "Q6_K", "IQ4_XS"}
    assert not row_kinds("Q5_K", 640, (9, 8)).any()


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_get_rows_equals_dequantized_rows(fmt):
    n_out, n_in = shape_for(fmt)
    raw = matrix(fmt, n_out, n_in, seed=5)
    layer = quant.QuantLinear(raw, fmt.name, (n_out, n_in))
    ids = np.array([36, 0, 5, 5, 17], np.int32)
    out = np.empty((ids.size, n_in), np.float32)
    layer.get_rows(ids, out)
    np.testing.assert_array_equal(out, reference.dequantize(raw, fmt.name, (n_out, n_in))[ids])


def test_zero_activations_give_zero_outputs():
    fmt = quant.format_by_name("Q4_1")  # has mins: still zero, as d_x * sum(q_x) is zero
    layer = quant.QuantLinear(matrix(fmt, 8, 64), "Q4_1", (8, 64))
    out = np.full(8, np.nan, np.float32)
    layer.matvec(np.zeros(64, np.float32), out)
    np.testing.assert_array_equal(out, 0)


def test_scratch_is_shared_within_a_thread_grows_and_is_per_thread():
    import threading
    from edgellm.quant.linear import _scratch_for
    fmt = quant.format_by_name("Q8_0")
    a = quant.QuantLinear(matrix(fmt, 4, 96), "Q8_0", (4, 96))
    b = quant.QuantLinear(matrix(fmt, 6, 96, seed=1), "Q8_0", (6, 96))
    assert a._scratch_key == b._scratch_key
    x = np.ones((40, 96), np.float32)
    out = np.empty((40, 6), np.float32)
    b.matmul(x, out)
    mine = _scratch_for(b._scratch_key)
    assert mine.capacity >= 40
    # the activations' block scale 1/127 is stored in float16, as llama.cpp's block_q8_0 does: 2**-11 relative
    np.testing.assert_allclose(out[0], b.dequantize().sum(axis=1), rtol=2.0**-10)
    # Parallel kernels release the GIL: another thread must get its own activation buffer.
    other = []
    t = threading.Thread(target=lambda: other.append(_scratch_for(b._scratch_key)))
    t.start()
    t.join()
    assert other[0] is not mine


def test_activation_scratch_and_the_tiles_copy_start_on_cache_lines():
    """The 512-bit tiles load their activations 64 bytes at a time, so every scratch array, and the tiles' copy of
    the quants after the token-by-token ones, start on a cache line (numpy's own arrays start wherever malloc
    leaves them, often 16 to 48 bytes past one, and a load across two lines costs two)."""
    from edgellm.quant.aligned import CACHE_LINE, empty_aligned, zeros_aligned
    from edgellm.quant.linear import _ActivationScratch
    from edgellm.quant.registry import Q8_0, Q8_K
    for activation, n_in in ((Q8_0, 576), (Q8_0, 640), (Q8_K, 768)):
        for n_tokens in (1, 8, 40, 129):
            arrays = _ActivationScratch(activation, n_in).reserve(n_tokens)
            assert [a.ctypes.data % CACHE_LINE for a in arrays] == [0, 0, 0], (activation, n_in, n_tokens)
    xq = _ActivationScratch(Q8_0, 576).reserve(16)[0]
    assert xq[16 * 576:].ctypes.data % CACHE_LINE == 0
    assert [empty_aligned(n, np.int8).ctypes.data % CACHE_LINE for n in (1, 63, 10_000, 300_000)] == [0] * 4
    a = zeros_aligned((3, 1000), np.float32)
    assert a.shape == (3, 1000) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % CACHE_LINE == 0 and not a.any()


# --- validation: a kernel never sees a wrong buffer ----------------------------------------------------------------


def test_quantlinear_rejects_bad_construction():
    fmt = quant.format_by_name("Q4_0")
    raw = matrix(fmt, 4, 64)
    with pytest.raises(ValueError, match="2-D"):
        quant.QuantLinear(raw, "Q4_0", (256,))
    with pytest.raises(ValueError, match="needs 108 bytes, got 144"):
        quant.QuantLinear(raw, "Q4_0", (3, 64))  # 4 rows of bytes for a 3-row shape
    with pytest.raises(ValueError, match="block size 32"):
        quant.QuantLinear(raw, "Q4_0", (8, 36))
    with pytest.raises(KeyError):
        quant.QuantLinear(raw, "Q4_9", (4, 64))


@pytest.mark.parametrize("bad_x", [np.zeros(63, np.float32), np.zeros(64, np.float64), np.zeros((1, 64), np.float32),
                                   np.zeros(128, np.float32)[::2], [0.0] * 64], ids=["short", "f64", "2d", "strided",
                                                                                    "list"])
def test_matvec_rejects_bad_inputs(bad_x):
    fmt = quant.format_by_name("Q8_0")
    layer = quant.QuantLinear(matrix(fmt, 4, 64), "Q8_0", (4, 64))
    with pytest.raises(ValueError, match="x must be"):
        layer.matvec(bad_x, np.empty(4, np.float32))


def test_matvec_matmul_reject_bad_outputs():
    fmt = quant.format_by_name("Q6_K")
    layer = quant.QuantLinear(matrix(fmt, 4, 256), "Q6_K", (4, 256))
    with pytest.raises(ValueError, match="out must be"):
        layer.matvec(np.zeros(256, np.float32), np.empty(5, np.float32))
    with pytest.raises(ValueError, match="out must be"):
        layer.matmul(np.zeros((2, 256), np.float32), np.empty((3, 4), np.float32))
    frozen = np.empty(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        layer.matvec(np.zeros(256, np.float32), frozen)
    with pytest.raises(ValueError, match="2-D"):
        layer.matmul(np.zeros(256, np.float32), np.empty((1, 4), np.float32))


def test_get_rows_rejects_bad_ids():
    fmt = quant.format_by_name("Q8_0")
    layer = quant.QuantLinear(matrix(fmt, 4, 64), "Q8_0", (4, 64))
    out = np.empty((1, 64), np.float32)
    for ids, message in [([4], "out of range"), ([-1], "out of range"), ([0.5], "integer"), ([[0]], "1-D")]:
        with pytest.raises(ValueError, match=message):
            layer.get_rows(np.array(ids), out)
    with pytest.raises(ValueError, match="out must be"):
        layer.get_rows(np.array([0, 1]), out)


def test_concat_rows_stacks_layers():
    fmt = quant.format_by_name("Q4_1")
    parts = [quant.QuantLinear(matrix(fmt, n, 64, seed=n), "Q4_1", (n, 64)) for n in (3, 5, 2)]
    stacked = quant.QuantLinear.concat_rows(parts)
    assert (stacked.n_out, stacked.n_in) == (10, 64)
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    out = np.empty(10, np.float32)
    stacked.matvec(x, out)
    pieces = []
    for part in parts:
        pieces.append(np.empty(part.n_out, np.float32))
        part.matvec(x, pieces[-1])
    np.testing.assert_array_equal(out, np.concatenate(pieces))
    with pytest.raises(ValueError, match="one format"):
        quant.QuantLinear.concat_rows([parts[0], quant.QuantLinear(matrix(fmt, 2, 96), "Q4_1", (2, 96))])


PORTABLE_CHECK = """
import platform
import numpy as np
from edgellm import quant
from edgellm.quant import simd
from edgellm.quant.testing import random_matrix_bytes
assert simd.HAS_AVX2 == WANT_AVX2 and simd.HAS_VNNI == WANT_VNNI, "the dot product asked for was not selected"
assert not simd.HAS_WIDE_TILES, "the 512-bit tiles were selected"
assert not simd.HAS_DOTPROD, "sdot was selected"
assert WANT_AVX2 or platform.machine().lower() not in ("x86_64", "amd64") or not simd.NATIVE_F16, "F16C is on"
rng = np.random.default_rng(0)
for name in FORMATS:
    fmt = quant.format_by_name(name)
    raw = random_matrix_bytes(fmt, 12, WIDTH, rng)
    layer = quant.QuantLinear(raw, name, (12, WIDTH))
    x = rng.standard_normal((13, WIDTH)).astype(np.float32)  # an 8-token tile, a 4-token tile and a single token
    out = np.empty((13, 12), np.float32)
    layer.matmul(x, out)
    np.save(f"{OUT}/{name}.npy", out)
    for few, n in (("one", 1), ("three", 3)):  # a decode step's single token; a pair and a single (a short draft)
        part = np.empty((n, 12), np.float32)
        layer.matmul(x[:n], part)
        np.save(f"{OUT}/{name}_{few}.npy", part)
for name in BATCH_FORMATS:  # batches long enough for the wide K-quant matmuls where this CPU runs them
    fmt = quant.format_by_name(name)
    layer = quant.QuantLinear(random_matrix_bytes(fmt, 40, 512, rng), name, (40, 512))
    x = rng.standard_normal((37, 512)).astype(np.float32)
    out = np.empty((37, 40), np.float32)
    layer.matmul(x, out)
    np.save(f"{OUT}/{name}_batch.npy", out)
"""


PORTABLE_FORMATS = tuple(Q8_0_ACT_FORMATS) + ("Q6_K", "F16")
# Rows of every 32-element format at least dots_block32.ONE_ROW_FROM_BYTES long (Q4_0: 432 bytes), which a Zen
# build decodes one row at a time and other builds two at a time: the znver3 child checks the first where this host
# runs the second, and this Zen host the second against the haswell child.
PORTABLE_WIDTH = 768
BATCH_FORMATS = ("Q4_K", "Q6_K")


# Other CPUs' builds, each compiled in a child process that runs beside the other tests (tests/background.py):
# (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES, AVX2 expected, VNNI expected, whether this host can check it)
OTHER_CPUS = {
    # AArch64 has FMA on both sides (plain NEON against sdot here), x86-64's generic build has none
    "generic": ("generic", "+neon" if platform.machine().lower() in ("aarch64", "arm64") else "", False, False, True),
    "haswell": ("haswell", "+avx,+avx2,+fma,+f16c,+popcnt,+sse4.2,+bmi,+bmi2", True, False, simd.HAS_AVX2),
    "znver3": ("znver3", "+avx,+avx2,+fma,+f16c,+popcnt,+sse4.2,+bmi,+bmi2", True, False, simd.HAS_AVX2),
    "alderlake": ("alderlake", "+avx,+avx2,+fma,+f16c,+popcnt,+sse4.2,+bmi,+bmi2,+avxvnni", True, True,
                  simd.host._host_has("avxvnni")),
}


@functools.cache
def _other_cpu_job(name):
    cpu_name, cpu_features, want_avx2, want_vnni, _ = OTHER_CPUS[name]
    out = background.temp_dir(f"kernels-{name}")
    env = background.child_env(NUMBA_CPU_NAME=cpu_name, NUMBA_CPU_FEATURES=cpu_features, NUMBA_CACHE_DIR=out / "cache")
    code = (f"OUT = {str(out)!r}\nWANT_AVX2 = {want_avx2}\nWANT_VNNI = {want_vnni}\n"
            f"FORMATS = {PORTABLE_FORMATS}\nBATCH_FORMATS = {BATCH_FORMATS}\nWIDTH = {PORTABLE_WIDTH}\n" + PORTABLE_CHECK)
    return background.Job(f"kernels-{name}", [sys.executable, "-c", code], env=env), out


def _other_cpu_jobs(item):
    name = item.callspec.params["cpu"]
    return [_other_cpu_job(name)[0]] if OTHER_CPUS[name][-1] else []


def _kernels_for_cpu_match(name, exact):
    """Compare the products of PORTABLE_CHECK compiled for another CPU (its child process) with this process's."""
    job, out_dir = _other_cpu_job(name)
    done = background.result(job)
    assert done.returncode == 0, done.stderr[-3000:]
    rng = np.random.default_rng(0)
    # (format, rows, tokens, width, the child's file, whether the child also saved the products of its first one and
    # three tokens)
    runs = [(name, 12, 13, PORTABLE_WIDTH, f"{name}.npy", True) for name in PORTABLE_FORMATS]
    runs += [(name, 40, 37, 512, f"{name}_batch.npy", False) for name in BATCH_FORMATS]  # PORTABLE_CHECK's order
    for fmt_name, n_out, n_tokens, width, saved, few_tokens in runs:
        fmt = quant.format_by_name(fmt_name)
        layer = quant.QuantLinear(random_matrix_bytes(fmt, n_out, width, rng), fmt_name, (n_out, width))
        x = rng.standard_normal((n_tokens, width)).astype(np.float32)
        out = np.empty((n_tokens, n_out), np.float32)
        layer.matmul(x, out)
        compared = [(np.load(out_dir / saved), out)]
        for few, n in (("one", 1), ("three", 3)) if few_tokens else ():
            part = np.empty((n, n_out), np.float32)
            layer.matmul(x[:n], part)
            compared.append((np.load(out_dir / saved.replace(".npy", f"_{few}.npy")), part))
        for theirs, ours in compared:
            if exact:
                np.testing.assert_array_equal(theirs, ours)
            else:  # the same integers; only FMA contraction (absent on generic x86-64) may move the last float bits
                np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5 * np.abs(ours).max())


@pytest.mark.parametrize("cpu", ["generic"])
@pytest.mark.background(jobs=_other_cpu_jobs)
def test_generic_code_paths_match_avx2(cpu):
    """Where AVX2 / F16C are missing (other CPUs, NUMBA_CPU_NAME=generic) the same integer lanes come from
    generic vector ops: run the kernels that way in a subprocess and compare with this process. On AArch64 (plain
    NEON against sdot here) both have FMA, so the bits must agree too."""
    _kernels_for_cpu_match(cpu, exact=platform.machine().lower() in ("aarch64", "arm64"))


@pytest.mark.skipif(not OTHER_CPUS["haswell"][-1], reason="needs an AVX2 host")
@pytest.mark.parametrize("cpu", ["haswell"])
@pytest.mark.background(jobs=_other_cpu_jobs)
def test_avx2_without_vnni_gives_the_same_bits(cpu):
    """On AVX2 CPUs without AVX-VNNI (Haswell to Ice Lake clients, Zen 1-3) the dots are vpmaddubsw + vpmaddwd
    instead of vpdpbusd, and the wide K-quant matmuls take 8 tokens a vector, not 16: the same integer lanes, so
    the same bits. Compiled for such a CPU in a subprocess."""
    _kernels_for_cpu_match(cpu, exact=True)


@pytest.mark.skipif(not OTHER_CPUS["znver3"][-1], reason="needs an AVX2 host")
@pytest.mark.parametrize("cpu", ["znver3"])
@pytest.mark.background(jobs=_other_cpu_jobs)
def test_zen_rows_one_at_a_time_give_the_same_bits(cpu):
    """An AMD Zen build decodes a token's long rows one at a time (vec_dot, dots_block32.ONE_ROW_FROM_BYTES; a pair
    of tokens' through vec_dot12) where other builds go two rows at a time (vec_dot2, vec_dot22): the same sums in
    the same order, so the same bits, for a single token and for a pair and a single. Compiled for Zen 3 (AVX2) in
    a subprocess; its counterpart is the haswell child (two at a time) on a Zen host."""
    _kernels_for_cpu_match(cpu, exact=True)


@pytest.mark.skipif(not OTHER_CPUS["alderlake"][-1], reason="needs a host with AVX-VNNI")
@pytest.mark.parametrize("cpu", ["alderlake"])
@pytest.mark.background(jobs=_other_cpu_jobs)
def test_vnni_without_avx512_gives_the_same_bits(cpu):
    """On AVX-VNNI CPUs without AVX-512 (Alder Lake and later clients) the tiles are the 256-bit ones with vpdpbusd,
    where this machine kind may take the 512-bit tiles (simd.HAS_WIDE_TILES): the same lanes, so the same bits.
    Compiled for such a CPU in a subprocess."""
    _kernels_for_cpu_match(cpu, exact=True)


def test_i32x8_hsum4_matches_numpy_row_sums():
    """The four-vector integer reduction the Q4_K gemm uses gives each vector's exact lane sum (numpy reference),
    including sums that need all 32 bits."""
    from numba import njit
    from edgellm.quant.simd import i32x8_hsum4, load_i32x8

    @njit
    def hsum4(a):
        return i32x8_hsum4(load_i32x8(a, 0), load_i32x8(a, 8), load_i32x8(a, 16), load_i32x8(a, 24))

    rng = np.random.default_rng(3)
    for bound in (100, 1 << 27):
        a = rng.integers(-bound, bound, 32).astype(np.int32)
        assert hsum4(a) == tuple(int(v) for v in a.reshape(4, 8).sum(axis=1, dtype=np.int64))


def test_eight_token_tile_intrinsics_match_numpy():
    """The vector pieces of the 32-element formats' eight-token tiles (quant.dots_block32): half duplication, per-lane
    products and FMAs, lane extraction, and the split horizontal sum, which must give f32x8_hsum's bits for each of
    the two vectors it holds."""
    from edgellm.quant.simd import (f32x8_fma_lanes, f32x8_hsum, f32x8_hsum_split, f32x8_lane, f32x8_mul, i8x32_dup_hi,
                                    i8x32_dup_lo, load_f32x8, load_i32x8, load_i8x32, store_f32x8, store_i8x32)

    @njit
    def pieces(b, f, i, dup, prod, fma, lanes):
        v = load_i8x32(b, 0)
        store_i8x32(dup, 0, i8x32_dup_lo(v))
        store_i8x32(dup, 32, i8x32_dup_hi(v))
        a, c = load_f32x8(f, 0), load_f32x8(f, 8)
        store_f32x8(prod, 0, f32x8_mul(a, c))
        store_f32x8(fma, 0, f32x8_fma_lanes(load_f32x8(f, 16), load_i32x8(i, 0), c))
        for j in range(8):
            lanes[j] = (f32x8_lane(a, 0), f32x8_lane(a, 1), f32x8_lane(a, 2), f32x8_lane(a, 3), f32x8_lane(a, 4),
                        f32x8_lane(a, 5), f32x8_lane(a, 6), f32x8_lane(a, 7))[j]
        p, q = load_f32x8(f, 24), load_f32x8(f, 32)
        return f32x8_hsum_split(p, q)

    @njit
    def hsum(f, o):
        return f32x8_hsum(load_f32x8(f, o))

    rng = np.random.default_rng(5)
    for _ in range(50):
        b = rng.integers(-128, 128, 32).astype(np.int8)
        f = (rng.standard_normal(40) * 10.0 ** rng.integers(-3, 4, 40)).astype(np.float32)
        i = rng.integers(-(1 << 24), 1 << 24, 8).astype(np.int32)
        dup, prod, fma, lanes = np.empty(64, np.int8), *(np.empty(8, np.float32) for _ in range(3))
        split = pieces(b, f, i, dup, prod, fma, lanes)
        np.testing.assert_array_equal(dup, np.concatenate([b[:16], b[:16], b[16:], b[16:]]))
        np.testing.assert_array_equal(prod.view(np.int32), (f[:8] * f[8:16]).view(np.int32))
        # fma with one rounding: the float64 product of two float32 is exact, so only the sum rounds (to float64,
        # then float32: double rounding is possible in principle; these magnitudes never hit it)
        want = (i.astype(np.float32).astype(np.float64) * f[8:16] + f[16:24]).astype(np.float32)
        np.testing.assert_array_equal(fma.view(np.int32), want.view(np.int32))
        np.testing.assert_array_equal(lanes, f[:8])
        # p = a lanes 0-3 | b lanes 0-3, q = a lanes 4-7 | b lanes 4-7
        a_vec = np.concatenate([f[24:28], f[32:36]])
        b_vec = np.concatenate([f[28:32], f[36:40]])
        buf = np.concatenate([a_vec, b_vec]).astype(np.float32)
        assert np.float32(split[0]).view(np.int32) == np.float32(hsum(buf, 0)).view(np.int32)
        assert np.float32(split[1]).view(np.int32) == np.float32(hsum(buf, 8)).view(np.int32)


def test_pair_splats_copy_lanes():
    """f32x8_pair_splats (the 256-bit tiles' scales): vector k is [v[2k] x4 | v[2k+1] x4], lane copies only."""
    from edgellm.quant.simd import f32x8_pair_splats, load_f32x8, store_f32x8

    @njit
    def splats(v, out):
        s = f32x8_pair_splats(load_f32x8(v, 0))
        for j in range(4):
            store_f32x8(out, 8 * j, s[j])

    v = np.random.default_rng(8).standard_normal(8).astype(np.float32)
    out = np.empty(32, np.float32)
    splats(v, out)
    np.testing.assert_array_equal(out.reshape(4, 8), np.repeat(v.reshape(4, 2), 4, axis=1))


@pytest.mark.skipif(not simd.HAS_WIDE_TILES, reason="needs AVX-512 with VNNI")
def test_512_bit_tile_intrinsics_match_numpy():
    """The 512-bit tiles' pieces against numpy: quants in tile order from Q4 nibbles and Q5 nibbles plus high bits,
    the pairs' scales, and one step (unsigned x signed four-byte lane sums from zero or from starting lanes that
    carry TILE_START, to float exactly, times the scales plus the accumulator with one rounding; lanes up to the
    extremes of a Q8_0 step, +-2^18), and the halves."""
    from edgellm.quant.simd import (TILE_START, f32x16_halves, f32x16_pair_scales, f32x16_tile_step, f32x16_zero,
                                    i8x64_tile_quants, load_f32x8, load_i8x32, load_nibbles_tile64, load_q5_tile64,
                                    store_f32x8)

    @njit
    def step(w, x, base, scales8, acc8, out, with_base, pair):
        s = f32x16_pair_scales(load_f32x8(scales8, 0))[pair]
        acc = f32x16_pair_scales(load_f32x8(acc8, 0))[pair]
        wv = i8x64_tile_quants(load_i8x32(w, 0))
        r = f32x16_tile_step(acc, wv, x, 0, base, 0, s) if with_base else f32x16_tile_step(acc, wv, x, 0, None, 0, s)
        lo, hi = f32x16_halves(r)
        store_f32x8(out, 0, lo)
        store_f32x8(out, 8, hi)

    @njit
    def tile_bytes(raw, qo, bo, x, out):  # each quant vector dotted with unit activations in one lane each
        one = f32x16_pair_scales(load_f32x8(np.ones(8, np.float32), 0))[0]
        for j, v in enumerate((load_nibbles_tile64(raw, qo), load_q5_tile64(raw, qo, bo))):
            for e in range(4):  # x selects byte e of every four-byte group
                lo, hi = f32x16_halves(f32x16_tile_step(f32x16_zero(), v, x, 64 * e, None, 0, one))
                store_f32x8(out, (4 * j + e) * 16, lo)
                store_f32x8(out, (4 * j + e) * 16 + 8, hi)

    rng = np.random.default_rng(9)
    for trial in range(20):
        raw = rng.integers(0, 256, 24).astype(np.uint8)
        qs, bits = raw[4:20], int(raw[:4].view("<u4")[0])
        nib = np.concatenate([qs & 15, qs >> 4]).astype(np.int64)  # quant j: low nibbles 0-15, high 16-31
        q5 = nib + 16 * ((bits >> np.arange(32)) & 1)
        order = np.r_[0:16, 0:16, 16:32, 16:32]
        sel = np.zeros(256, np.int8)
        for e in range(4):
            sel[64 * e + e:64 * e + 64:4] = 1
        out = np.empty(128, np.float32)
        tile_bytes(raw, 4, 0, sel, out)
        got = out.reshape(2, 4, 16)  # [vector, e, lane]: byte 4 * lane + e
        for j, want in enumerate((nib[order], q5[order])):
            np.testing.assert_array_equal(got[j].T.reshape(64), want.astype(np.float32))

        w = rng.integers(0, 256, 32).astype(np.uint8).view(np.int8)
        x = rng.integers(-127, 128, 64).astype(np.int8)
        if trial % 4 == 1:  # the largest lanes, both signs: 255 x +-127 x 4 plus a base of +-2^17
            w[:] = -1
            x[:32], x[32:] = 127, -127
        base = rng.integers(-(1 << 17), 1 << 17, 16).astype(np.int32)
        scales8 = (rng.standard_normal(8) * 1e-3).astype(np.float32)
        acc8 = rng.standard_normal(8).astype(np.float32)
        wt = w.view(np.uint8)[order].astype(np.int64)
        lanes = (wt * x.astype(np.int64)).reshape(16, 4).sum(axis=1)
        for pair in range(4):
            s16 = np.tile(np.repeat(scales8[2 * pair:2 * pair + 2], 4), 2)
            a16 = np.tile(np.repeat(acc8[2 * pair:2 * pair + 2], 4), 2)
            for with_base in (False, True):
                total = lanes + (base if with_base else 0)
                out = np.empty(16, np.float32)
                step(w, x, base + TILE_START, scales8, acc8, out, with_base, pair)
                want = (total.astype(np.float32).astype(np.float64) * s16 + a16).astype(np.float32)
                np.testing.assert_array_equal(out.view(np.int32), want.view(np.int32))


def test_q4_k_pair_sums_match_numpy():
    """The Q4_K tokens-in-lanes sums against numpy (simd.LANES tokens a vector: 16 with the 512-bit tiles, else 8):
    for each row, group (low nibbles, then high) and token vector, the exact integer dot of the 32 quants with each
    token's 32 activations, as float lanes."""
    from edgellm.quant.simd import LANES, TILE_VECTORS, q4_k_pair_sums_1x1, q4_k_pair_sums_tile, store_lanes

    @njit
    def sums_tile(w, row_stride, xt, tv_stride, out):
        s = q4_k_pair_sums_tile(w, 3, row_stride, xt, 5, tv_stride)
        for i in range(len(s)):
            store_lanes(out, LANES * i, s[i])

    @njit
    def sums_1x1(w, row_stride, xt, tv_stride, out):
        s = q4_k_pair_sums_1x1(w, 3, row_stride, xt, 5, tv_stride)
        for i in range(len(s)):
            store_lanes(out, LANES * i, s[i])

    rng = np.random.default_rng(31)
    row_stride, tv_stride = 40, 70 * LANES
    for tile in (False, True):
        rows, tvecs = (2, TILE_VECTORS) if tile else (1, 1)
        w = rng.integers(0, 256, 3 + row_stride * rows).astype(np.uint8)
        xt = rng.integers(-128, 128, 5 + tv_stride * tvecs).astype(np.int8)
        out = np.empty(2 * rows * tvecs * LANES, np.float32)
        (sums_tile if tile else sums_1x1)(w, row_stride, xt, tv_stride, out)
        got = out.reshape(rows, 2, tvecs, LANES)
        for r in range(rows):
            packed = w[3 + r * row_stride: 3 + r * row_stride + 32].astype(np.int64)
            for g, q in enumerate((packed & 15, packed >> 4)):
                for v in range(tvecs):
                    at = 5 + v * tv_stride + 32 * LANES * g
                    steps = xt[at: at + 32 * LANES].astype(np.int64)
                    x = steps.reshape(8, LANES, 4).transpose(1, 0, 2).reshape(LANES, 32)  # token, its 32 values
                    np.testing.assert_array_equal(got[r, g, v], (x @ q).astype(np.float32))


def test_q6_k_superblock_sums_match_numpy():
    """The Q6_K tokens-in-lanes totals against numpy: per row and token vector, the exact sum over the 16 sub-blocks
    of scale x (codes x activations + the starting lanes), as float lanes."""
    from edgellm.quant.simd import LANES, TILE_VECTORS, q6_k_superblock_sums_1x1, q6_k_superblock_sums_tile, store_lanes

    @njit
    def sums_tile(codes, w, xt, xs, offs, os, out):
        s = q6_k_superblock_sums_tile(codes, 2, 300, w, 1, 20, xt, 3, xs, offs, 5, os)
        for i in range(len(s)):
            store_lanes(out, LANES * i, s[i])

    @njit
    def sums_1x1(codes, w, xt, xs, offs, os, out):
        s = q6_k_superblock_sums_1x1(codes, 2, 300, w, 1, 20, xt, 3, xs, offs, 5, os)
        for i in range(len(s)):
            store_lanes(out, LANES * i, s[i])

    rng = np.random.default_rng(32)
    xs, os = 260 * LANES, 17 * LANES  # token vector strides
    for tile in (False, True):
        rows, tvecs = (2, TILE_VECTORS) if tile else (1, 1)
        codes = rng.integers(0, 64, 2 + 300 * rows).astype(np.int8)
        w = rng.integers(0, 256, 1 + 20 * rows).astype(np.uint8)  # the scales: any int8
        xt = rng.integers(-128, 128, 3 + xs * tvecs).astype(np.int8)
        offs = rng.integers(-65536, 65536, 5 + os * tvecs).astype(np.int32)
        out = np.empty(rows * tvecs * LANES, np.float32)
        (sums_tile if tile else sums_1x1)(codes, w, xt, xs, offs, os, out)
        for r in range(rows):
            q = codes[2 + 300 * r: 2 + 300 * r + 256].astype(np.int64).reshape(16, 16)
            scale = w[1 + 20 * r: 1 + 20 * r + 16].view(np.int8).astype(np.int64)
            for v in range(tvecs):
                steps = xt[3 + xs * v: 3 + xs * v + 256 * LANES].astype(np.int64)
                x = steps.reshape(64, LANES, 4).transpose(1, 0, 2).reshape(LANES, 16, 16)  # token, sub-block, value
                start = offs[5 + os * v: 5 + os * v + 16 * LANES].astype(np.int64).reshape(16, LANES).T
                want = (((x * q).sum(axis=2) + start) * scale).sum(axis=1)
                np.testing.assert_array_equal(out[(r * tvecs + v) * LANES:(r * tvecs + v + 1) * LANES],
                                              want.astype(np.float32))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n_out,n_in,sizes", [
    (40, 512, (16,)),  # one token vector, one block of 16 rows and one of 8
    (48, 768, (70,)),  # whole tiles and one more token vector, the last one part-filled; gemv tokens at the end
    (56, 256, (3, 5, 36, 1, 17)),  # gemm and gemv tokens interleaved, sequences of every kind
    (64, 1024, (133,)),
])
def test_wide_kquant_matmul_gives_the_narrow_bits(name, n_out, n_in, sizes):
    """matmul_q4_k_wide and matmul_q6_k_wide (one token per vector lane) give matmul_q4_k's and matmul_q6_k's bits
    on every token, whichever of llama.cpp's kernels it stands for; the registry runs them where they are the faster
    kernel: with 16 lanes from the first gemm group (4 tokens, Q6_K's 8), with AVX2's 8 lanes (Q6_K) from 16."""
    from edgellm.quant import linear, matmul_kquant as mk
    record = kernels_for(name)
    narrow, wide = getattr(mk, f"matmul_{record.suffix}"), getattr(mk, f"matmul_{record.suffix}_wide")
    layer = quant.QuantLinear(matrix(quant.format_by_name(name), n_out, n_in, seed=n_out), name, (n_out, n_in))
    x = (np.random.default_rng(5).standard_normal((sum(sizes), n_in)) * 3).astype(np.float32)
    kinds = record.row_kinds_of(n_out, sizes)
    runs_wide = simd.HAS_WIDE_TILES or (name == "Q6_K" and simd.HAS_AVX2)
    assert (record.row_kinds_kernel(kinds) is wide) == runs_wide
    first_group = 4 if name == "Q4_K" else 8
    assert record.row_kinds_kernel(record.row_kinds_of(n_out, (first_group - 1,))) is not wide
    assert (record.row_kinds_kernel(record.row_kinds_of(n_out, (first_group,))) is wide) == simd.HAS_WIDE_TILES
    assert (record.row_kinds_kernel(record.row_kinds_of(n_out, (15,))) is wide) == simd.HAS_WIDE_TILES
    outs = []
    for kernel in (narrow, wide):
        out = np.full((len(kinds), n_out), np.nan, np.float32)
        kernel(layer.data, layer.row_bytes, x, *linear._ActivationScratch(Q8_K, n_in).reserve(len(kinds)), out, kinds)
        outs.append(out)
    np.testing.assert_array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32))


def test_dot_with_starting_lanes_matches_numpy():
    """simd.dot_u8x32_plus (the Q4_0/Q5_0 tiles' dot, vpdpbusd's accumulator where the CPU has VNNI): eight int32
    starting values plus each lane's four unsigned x signed products, as numpy sums them in int64."""
    from edgellm.quant.simd import dot_u8x32_plus, f32x8_from_i32, load_i8x32, store_f32x8

    @njit
    def lanes(w, x, base, out):  # the lanes as float32: exact below 2**24
        store_f32x8(out, 0, f32x8_from_i32(dot_u8x32_plus(load_i8x32(w, 0), load_i8x32(x, 0), base, 0)))

    rng = np.random.default_rng(11)
    for _ in range(20):
        w = rng.integers(0, 128, 32).astype(np.int8)
        x = rng.integers(-127, 128, 32).astype(np.int8)
        base = rng.integers(-(1 << 20), 1 << 20, 8).astype(np.int32)
        want = base.astype(np.int64) + (w.astype(np.int64) * x).reshape(8, 4).sum(axis=1)
        got = np.zeros(8, np.float32)
        lanes(w, x, base.view(np.int8), got)
        np.testing.assert_array_equal(got.astype(np.int64), want)


def test_two_row_dot_intrinsics_match_numpy():
    """The pieces of the two-row Q4_1/Q5_1 dots: both nibble loaders give every byte's low then high nibbles; an F32x4
    of two rows' (d, m) times the token's (d, s) twice, summed, is the scalar products and sums lane by lane."""
    from edgellm.quant.simd import (f32x4_add, f32x4_lane, f32x4_mul, f32x4_zero, load_f32x2_twice, load_nibbles_lo_hi,
                                    load_nibbles_lo_hi_bcast, store_i8x32)

    @njit
    def nibbles(q, out):
        for i in range(0, q.size, 16):
            store_i8x32(out, 2 * i, load_nibbles_lo_hi(q, i))
            store_i8x32(out, 2 * q.size + 2 * i, load_nibbles_lo_hi_bcast(q, i))

    @njit
    def scales(h, o, o2, ds, nb, out):
        m = f32x4_zero()
        for b in range(nb):
            s = f32x4_mul(load_f16x2_rows(h, o + 20 * b, o2 + 20 * b), load_f32x2_twice(ds, 2 * b))
            m = f32x4_add(m, s)
            out[b, 0], out[b, 1] = f32x4_lane(s, 0), f32x4_lane(s, 2)
        return f32x4_lane(m, 1), f32x4_lane(m, 3)

    q = np.arange(256, dtype=np.uint8).repeat(2)  # every byte value, twice
    out = np.empty(4 * q.size, np.int8)
    nibbles(q, out)
    want = np.concatenate([np.concatenate([blk & 15, blk >> 4]) for blk in q.reshape(-1, 16)]).astype(np.int8)
    np.testing.assert_array_equal(out[:2 * q.size], want)
    np.testing.assert_array_equal(out[2 * q.size:], want)

    rng = np.random.default_rng(6)
    nb = 24
    rows = np.zeros((2, nb, 20), np.uint8)  # Q4_1 blocks: d, m as float16, then 16 bytes
    dm = (rng.standard_normal((2, nb, 2)) * 10.0 ** rng.integers(-4, 2, (2, nb, 2))).astype(np.float16)
    rows[:, :, :4] = dm.view(np.uint8).reshape(2, nb, 4)
    ds = (rng.standard_normal((nb, 2)) * 10.0 ** rng.integers(-3, 3, (nb, 2))).astype(np.float32)
    got = np.empty((nb, 2), np.float32)
    mins = scales(rows.reshape(-1), 0, nb * 20, ds.reshape(-1), nb, got)
    d32, m32 = dm[..., 0].astype(np.float32), dm[..., 1].astype(np.float32)
    np.testing.assert_array_equal(got.T.view(np.int32), (d32 * ds[:, 0]).view(np.int32))
    for r in range(2):
        want_m = np.float32(0)
        for b in range(nb):
            want_m = np.float32(want_m + m32[r, b] * ds[b, 1])
        assert np.float32(mins[r]).view(np.int32) == want_m.view(np.int32)


def pack_tiles8_reference(xq, xd, xs, n_tokens, n_in):
    """numpy version of dots_block32._pack_tiles8: the quantized activations of each eight tokens laid out as
    the tiles read them."""
    nb, n8 = n_in // 32, n_tokens - n_tokens % 8
    q = xq[:n8 * n_in].reshape(n8 // 8, 4, 2, nb, 2, 16)       # group, pair, token of pair, block, half, 16
    xp = q.transpose(0, 3, 1, 4, 2, 5).reshape(-1)            # group, block, pair, half, token of pair, 16
    scales = xd[:n8 * nb].reshape(n8 // 8, 8, nb).transpose(0, 2, 1).reshape(-1)    # group, block, token
    sums = xs[:n8 * nb].reshape(n8 // 8, 8, nb).transpose(0, 2, 1).reshape(-1)      # group, block, token
    return xp, np.concatenate([scales, sums])


@pytest.mark.parametrize("n_tokens", [8, 21])
def test_pack_tiles8_matches_numpy(n_tokens):
    from edgellm.quant.dots_block32 import _pack_tiles8
    n_in = 96
    rng = np.random.default_rng(n_tokens)
    xq = rng.integers(-127, 128, n_tokens * n_in).astype(np.int8)
    xd, xs = rng.standard_normal((2, n_tokens * n_in // 32)).astype(np.float32)
    n8 = n_tokens - n_tokens % 8
    xp, xt = np.zeros(n_tokens * n_in, np.int8), np.zeros(5 * n_tokens * n_in // 32, np.float32)
    _pack_tiles8(xq, xd, xs, n_in, n8, xp, xt)
    want_xp, want_xt = pack_tiles8_reference(xq, xd, xs, n_tokens, n_in)
    np.testing.assert_array_equal(xp[:n8 * n_in], want_xp)
    np.testing.assert_array_equal(xt[:2 * n8 * n_in // 32], want_xt)


@pytest.mark.parametrize("n_tokens", [4, 13])
def test_pack_tiles4_matches_numpy(n_tokens):
    """The four tokens after the eight-token groups, as the four-token tile reads them: two pairs a block, then
    four scales a block and four sums a block after the eight-token groups' scales and sums."""
    from edgellm.quant.dots_block32 import _pack_tiles4
    n_in = 96
    nb = n_in // 32
    rng = np.random.default_rng(n_tokens)
    xq = rng.integers(-127, 128, n_tokens * n_in).astype(np.int8)
    xd, xs = rng.standard_normal((2, n_tokens * nb)).astype(np.float32)
    n8 = n_tokens - n_tokens % 8
    xp, xt = np.zeros(n_tokens * n_in, np.int8), np.zeros(5 * n_tokens * nb, np.float32)
    _pack_tiles4(xq, xd, xs, n_in, n8, xp, xt)
    q = xq[n8 * n_in:(n8 + 4) * n_in].reshape(2, 2, nb, 2, 16)  # pair, token of pair, block, half, 16
    np.testing.assert_array_equal(xp[n8 * n_in:(n8 + 4) * n_in], q.transpose(2, 0, 3, 1, 4).reshape(-1))
    base = 2 * n8 * nb
    np.testing.assert_array_equal(xt[base:base + 4 * nb], xd[n8 * nb:(n8 + 4) * nb].reshape(4, nb).T.reshape(-1))
    np.testing.assert_array_equal(xt[base + 4 * nb:base + 8 * nb],
                                  xs[n8 * nb:(n8 + 4) * nb].reshape(4, nb).T.reshape(-1))
    assert not xp[:n8 * n_in].any() and not xt[:base].any()  # the eight-token groups' part is left alone


@pytest.mark.parametrize("mult, start", [(-16, 0), (-8, 0), (-128, 0), (3, 0), (-128, 0x4B400000),
                                         (-8, 0x4B400000)])
def test_lane_sums_match_numpy(mult, start):
    """dots_block32._lane_sums (eight lanes at a time): start + mult x the sum of each four activation bytes,
    including the extremes (-128 x 4 x -128 needs more than 16 bits)."""
    from edgellm.quant.dots_block32 import _lane_sums
    rng = np.random.default_rng(abs(mult))
    src = rng.integers(-128, 128, 3 * 32 * 5).astype(np.int8)
    src[:32] = -128
    src[32:64] = 127
    dst = np.full(src.size // 4 + 3, 7, np.int32)  # past the lanes: left as it was
    _lane_sums(src, mult, dst[:src.size // 4], start)
    np.testing.assert_array_equal(dst[:-3], start + mult * src.astype(np.int64).reshape(-1, 4).sum(axis=1))
    np.testing.assert_array_equal(dst[-3:], 7)


def test_i32x8_hsum8_and_lane_conversions_match_numpy():
    """The eight-vector integer reduction the Q4_K and Q6_K eight-token gemms use (lane k = the k-th vector's exact
    sum, with sums that need all 32 bits), and the lane-wise int -> float, subtract and splat beside it."""
    from edgellm.quant.simd import (f32x8_from_i32, f32x8_sub, i32x8_hsum8, i32x8_splat, load_f32x8, load_i32x8,
                                    store_f32x8)

    @njit
    def hsum8(a, out):
        v = i32x8_hsum8(load_i32x8(a, 0), load_i32x8(a, 8), load_i32x8(a, 16), load_i32x8(a, 24),
                        load_i32x8(a, 32), load_i32x8(a, 40), load_i32x8(a, 48), load_i32x8(a, 56))
        store_f32x8(out, 0, f32x8_from_i32(v))
        store_f32x8(out, 8, f32x8_from_i32(i32x8_splat(a[3])))

    @njit
    def sub(f, out):
        store_f32x8(out, 0, f32x8_sub(load_f32x8(f, 0), load_f32x8(f, 8)))

    rng = np.random.default_rng(4)
    for bound in (100, 1 << 24):  # sums within float32's exact integers, so the conversion shows the sum itself
        a = rng.integers(-bound, bound, 64).astype(np.int32)
        out = np.empty(16, np.float32)
        hsum8(a, out)
        np.testing.assert_array_equal(out[:8], a.reshape(8, 8).sum(axis=1, dtype=np.int64).astype(np.float32))
        np.testing.assert_array_equal(out[8:], np.full(8, a[3], np.float32))
    f = rng.standard_normal(16).astype(np.float32)
    out = np.empty(8, np.float32)
    sub(f, out)
    np.testing.assert_array_equal(out, f[:8] - f[8:])


def test_block32_matmul_refuses_scratch_too_small_for_its_tiles():
    """The 32-element block kernels keep the eight-token tiles' copy of the activations after the token-by-token quants
    in the scratch QuantLinear sizes; a direct caller passing less gets an error, not writes past the buffers."""
    matmul_q8_0 = kernels_for("Q8_0").matmul_kernel()
    fmt = quant.format_by_name("Q8_0")
    layer = quant.QuantLinear(matrix(fmt, 4, 64), "Q8_0", (4, 64))
    x = np.ones((8, 64), np.float32)
    out = np.empty((8, 4), np.float32)
    n = x.size
    with pytest.raises(ValueError, match="scratch too small"):
        matmul_q8_0(layer.data, layer.row_bytes, x, np.empty(n, np.int8), np.empty(n // 32, np.float32),
                       np.empty(n // 32, np.float32), out)
    matmul_q8_0(layer.data, layer.row_bytes, x, np.empty(3 * n, np.int8), np.empty(6 * (n // 32), np.float32),
                   np.empty(n // 32, np.float32), out)
    np.testing.assert_allclose(out, np.ones((8, 1)) * layer.dequantize().sum(axis=1), rtol=2.0 ** -9)


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_tokens_innermost_matches_numpy(dtype):
    """The Q4_K/Q6_K eight-token gemms read each group of eight tokens' scales and activation sums side by side
    (numpy reference: a transpose within each group); tokens past the last full group are left out."""
    from edgellm.quant.matmul_kquant import _tokens_innermost
    n_tokens, per = 21, 5
    src = np.arange(n_tokens * per).astype(dtype)
    dst = np.zeros((n_tokens // 8) * 8 * per, dtype)
    _tokens_innermost(src, n_tokens, per, dst)
    want = src[:16 * per].reshape(2, 8, per).transpose(0, 2, 1).reshape(-1)
    np.testing.assert_array_equal(dst, want)


@njit(cache=True)
def _halves_in_pairs(bits):
    n = bits.size // 2
    rows, pair = np.empty(n, np.float32), np.empty(n, np.float32)
    for i in range(0, n - 1, 2):
        pair[i], pair[n - 1 - i] = load_f16_pair(bits, 2 * i, 2 * (n - 1 - i))
    for i in range(0, n - 3, 4):  # lanes 0-1 from the first offset, 2-3 from the second (here the next pair)
        v = load_f16x2_rows(bits, 2 * i + 4, 2 * i)
        rows[i], rows[i + 1], rows[i + 2], rows[i + 3] = f32x4_lane(v, 2), f32x4_lane(v, 3), f32x4_lane(v, 0), \
            f32x4_lane(v, 1)
    return rows, pair


def test_paired_f16_loads_convert_every_half_exactly():
    """load_f16x2_rows (two rows' d and m) and load_f16_pair (two rows' scales) convert as numpy does, every half."""
    halves = np.arange(65536, dtype=np.uint16)
    want = halves.view(np.float16).astype(np.float32)
    for got in _halves_in_pairs(halves.view(np.uint8)):
        finite = np.isfinite(want)
        np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])


def test_splat_f16_load_converts_every_half_exactly_into_every_lane():
    """load_f16_splat8 (the tiles' block scales) converts as numpy does, every half, into all eight lanes."""
    from edgellm.quant.simd import load_f16_splat8, store_f32x8

    @njit
    def splats(raw, n, out):
        for i in range(n):
            store_f32x8(out, 8 * i, load_f16_splat8(raw, 2 * i))

    halves = np.arange(65536, dtype=np.uint16)
    want = np.repeat(halves.view(np.float16).astype(np.float32), 8)
    got = np.empty(8 * 65536, np.float32)
    splats(halves.view(np.uint8), 65536, got)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))  # -0.0 and subnormals
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])


@njit(cache=True)
def _prefetch_then_sum(a, distance):
    total = 0
    for i in range(a.size):
        prefetch(a, i + distance)  # up to `distance` elements past the end: a hint, never a fault
        total += a[i]
    return total


def test_prefetch_past_the_end_is_harmless():
    a = np.arange(1000, dtype=np.int64)
    assert _prefetch_then_sum(a, 1 << 20) == a.sum()


def _rows_one_at_a_time(record, w, row_bytes, n_out, nb, xq, xd, xs):
    """The format's one-row dot (vec_dot_<fmt>_q8_0 in its dots module) for each row in turn."""
    vec_dot = getattr(__import__(f"edgellm.quant.{record.dots}", fromlist=["_"]), f"vec_dot_{record.suffix}_q8_0")
    act = (xd, xs, 0) if record.driver == DRIVER_MINS else (xd, 0)
    return np.array([vec_dot(w, r * row_bytes, nb, xq, 0, *act) for r in range(n_out)], np.float32)


@pytest.mark.parametrize("name", Q8_0_ACT_FORMATS)
@pytest.mark.parametrize("n_out", [37, 40])  # a row block ending in an odd row, and only pairs
def test_decode_rows_in_pairs_equal_rows_one_at_a_time(name, n_out):
    """A single token goes two rows at a time (vec_dot2_<fmt>); each row must still give the one-row kernel's bits
    (the bits llama.cpp's vec_dot gives, which the real-model tests check)."""
    fmt = quant.format_by_name(name)
    n_in = 512
    layer = quant.QuantLinear(matrix(fmt, n_out, n_in, seed=11), name, (n_out, n_in))
    x = np.random.default_rng(12).standard_normal(n_in).astype(np.float32)
    got = np.empty(n_out, np.float32)
    layer.matvec(x, got)
    xq, xd, xs = np.empty(n_in, np.int8), np.empty(n_in // 32, np.float32), np.empty(n_in // 32, np.float32)
    quantize_act_q8_0(x, xq, xd, xs)
    want = _rows_one_at_a_time(kernels_for(name), layer.data, layer.row_bytes, n_out, n_in // 32, xq, xd, xs)
    if layer.rows8:  # a matrix llama.cpp repacks (Q4_0, MXFP4): its gemv's order (the record's rows8), not vec_dot's
        want = kernels_for(name).rows8_reference()(layer.data, n_out, n_in, xq, xd)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_kquant_kernel_for_picks_the_eight_token_kernels_only_when_needed():
    """Q4_K/Q6_K batches without eight-token work run kernels that leave it out (less to compile for decode and
    short prompts), and where the CPU has the 512-bit tiles every batch with gemm tokens runs the wide kernel; Q4_K's
    two narrow kernels give the same bits on the same rows (its eight-token gemm is two four-token groups lane by
    lane)."""
    from edgellm.quant import linear, matmul_kquant as mk
    from edgellm.quant.registry import kernels_for
    q4k, q6k = kernels_for("Q4_K"), kernels_for("Q6_K")

    def kernel_for(record, sizes):
        return record.row_kinds_kernel(record.row_kinds_of(40, sizes))

    # with the 512-bit tiles, a batch with gemm tokens runs the wide kernel
    wide4, wide6 = (mk.matmul_q4_k_wide, mk.matmul_q6_k_wide) if simd.HAS_WIDE_TILES else (None, None)
    assert kernel_for(q4k, (3,)) is mk.matmul_q4_k_few  # no gemm token (groups of four)
    assert kernel_for(q4k, (7,)) is (wide4 or mk.matmul_q4_k_few)
    assert kernel_for(q4k, (3, 5, 4)) is (wide4 or mk.matmul_q4_k_few)  # no aligned eight
    assert kernel_for(q4k, (3, 5, 8)) is (wide4 or mk.matmul_q4_k)
    assert kernel_for(q4k, (9,)) is (wide4 or mk.matmul_q4_k)
    assert kernel_for(q6k, (1,) * 8) is mk.matmul_q6_k_few
    assert kernel_for(q6k, (8,)) is (wide6 or mk.matmul_q6_k)
    iq4xs = kernels_for("IQ4_XS")  # one kernel for both kinds
    assert kernel_for(iq4xs, (1,)) is kernel_for(iq4xs, (8,)) is iq4xs.matmul_kernel()
    fmt = quant.format_by_name("Q4_K")
    layer = quant.QuantLinear(matrix(fmt, 40, 512, seed=21), "Q4_K", (40, 512))
    x = np.random.default_rng(22).standard_normal((21, 512)).astype(np.float32)
    kinds = q4k.row_kinds_of(40, (21,))
    outs = []
    for kernel in (mk.matmul_q4_k, mk.matmul_q4_k_few):
        scratch = linear._ActivationScratch(Q8_K, 512).reserve(21)
        out = np.empty((21, 40), np.float32)
        kernel(layer.data, layer.row_bytes, x, *scratch, out, kinds)
        outs.append(out)
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    # Q6_K's full kernel given rows without tiles computes them as matmul_q6_k_few does (vec_dot per token)
    fmt = quant.format_by_name("Q6_K")
    layer = quant.QuantLinear(matrix(fmt, 40, 512, seed=23), "Q6_K", (40, 512))
    kinds = q6k.row_kinds_of(40, (1,) * 5)
    outs = []
    for kernel in (mk.matmul_q6_k, mk.matmul_q6_k_few):
        scratch = linear._ActivationScratch(Q8_K, 512).reserve(5)
        out = np.empty((5, 40), np.float32)
        kernel(layer.data, layer.row_bytes, x[:5], *scratch, out, kinds)
        outs.append(out)
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


@pytest.mark.parametrize("name", Q8_0_ACT_FORMATS)
def test_quant_group_outputs_equal_each_layers_matmul(name):
    """Q, K, V (or gate, up) in one call: one quantization, one region; every output the layer's own bits, for
    decode, four- and eight-token tiles and their tails, with row counts that end row blocks and pairs oddly."""
    fmt = quant.format_by_name(name)
    n_in = 256
    layers = [quant.QuantLinear(matrix(fmt, n_out, n_in, seed=30 + n_out), name, (n_out, n_in))
              for n_out in (48, 17, 33)]
    x = np.random.default_rng(31).standard_normal((21, n_in)).astype(np.float32)
    for group in (quant.QuantGroup(layers), quant.QuantGroup(layers[:2])):
        for n_tokens in (1, 3, 4, 6, 7, 13, 21):  # 6, 7, 13, 21: the last rows as a padded eight-token tile
            want = []
            for layer in group.layers:
                out = np.empty((n_tokens, layer.n_out), np.float32)
                layer.matmul(x[:n_tokens], out)
                want.append(out)
            got = [np.full((n_tokens, layer.n_out), np.nan, np.float32) for layer in group.layers]
            group.matmul(x[:n_tokens], got, sizes=(1,) * n_tokens)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


def test_quant_group_refuses_what_it_cannot_group():
    q41, q80, q4k = (quant.format_by_name(n) for n in ("Q4_1", "Q8_0", "Q4_K"))
    a = quant.QuantLinear(matrix(q41, 8, 256), "Q4_1", (8, 256))
    assert quant.QuantGroup.of(a, quant.QuantLinear(matrix(q80, 8, 256), "Q8_0", (8, 256))) is None  # formats
    assert quant.QuantGroup.of(a, quant.QuantLinear(matrix(q41, 8, 512), "Q4_1", (8, 512))) is None  # widths
    k = quant.QuantLinear(matrix(q4k, 8, 256), "Q4_K", (8, 256))
    assert quant.QuantGroup.of(k, k) is None                                                          # K-quants
    assert quant.QuantGroup.of(a) is None and quant.QuantGroup.of(a, a, a, a) is None                   # counts
    group = quant.QuantGroup.of(a, a)
    x = np.ones((2, 256), np.float32)
    with pytest.raises(ValueError, match="outs must be a tuple or list of 2"):
        group.matmul(x, [np.empty((2, 8), np.float32)])
    with pytest.raises(ValueError, match=r"outs\[1\] must be a C-contiguous float32 array of shape \(2, 8\)"):
        group.matmul(x, [np.empty((2, 8), np.float32), np.empty((2, 8), np.float64)])
    with pytest.raises(ValueError, match="x must be a C-contiguous float32 array"):
        group.matmul(x[:, :128], [np.empty((2, 8), np.float32)] * 2)
    with pytest.raises(ValueError, match="sizes"):
        group.matmul(x, [np.empty((2, 8), np.float32)] * 2, sizes=(3,))


def _fma32(a, b, c):
    """float32 fma through float64: the product of two float32 is exact there, so only the sum rounds (twice; the
    magnitudes here never hit the double-rounding case)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def test_q4_k_gemv_is_llama_cpps_arithmetic():
    """A Q4_K row x one token as llama.cpp's gemv computes it, written out in numpy: per super-block the exact integer
    total of q * x * scale and of min * (16-element activation sum), each scaled by one FMA into its own float32
    accumulator (d * d_x, dmin * d_x), the row the first minus the second. Bit for bit."""
    fmt = quant.format_by_name("Q4_K")
    n_out, n_in = 9, 1024
    rng = np.random.default_rng(21)
    data = random_matrix_bytes(fmt, n_out, n_in, rng)
    layer = quant.QuantLinear(data, "Q4_K", (n_out, n_in))
    x = rng.standard_normal(n_in).astype(np.float32)
    got = np.empty(n_out, np.float32)
    layer.matvec(x, got)
    xq, xd, bsums = np.empty(n_in, np.int8), np.empty(n_in // 256, np.float32), np.empty(n_in // 16, np.int32)
    quantize_act_q8_k(x, xq, xd, bsums)
    blocks = np.asarray(data).reshape(n_out * n_in // 256, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(n_out, -1)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n_out, -1)
    sc, mn = (a.astype(np.int64).reshape(n_out, -1, 8) for a in reference.k_scale_min(blocks[:, 4:16]))
    q = (blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    q = q.reshape(n_out, -1, 8, 32).astype(np.int64)
    xs = xq.astype(np.int64).reshape(-1, 8, 32)
    half_sums = bsums.astype(np.int64).reshape(-1, 8, 2).sum(axis=2)
    for r in range(n_out):
        acc = mins = np.float32(0)
        for b in range(n_in // 256):
            itot = int((sc[r, b] * (q[r, b] * xs[b]).sum(axis=1)).sum())
            mtot = int((mn[r, b] * half_sums[b]).sum())
            acc = _fma32(np.float32(itot), np.float32(d[r, b] * xd[b]), acc)
            mins = _fma32(np.float32(mtot), np.float32(dmin[r, b] * xd[b]), mins)
        assert np.float32(acc - mins).view(np.int32) == got[r].view(np.int32), r


def test_k_quant_scale_intrinsics_match_numpy():
    """dot4_u8x32_byte_scales (four bytes of a word as the scales of four 32-element dots, its lanes' total),
    dot_u8x32_scale_pair (two int8 of sixteen as the scales of the two halves), i32x8_mins_dot (a word's bytes
    against sixteen sums, each twice) and i32x8_hsum_two against numpy; the scale pair lane by lane."""
    from edgellm.quant.simd import (dot4_u8x32_byte_scales, dot_u8x32_scale_pair, f32x8_from_i32, i32x8_hsum_two,
                                    i32x8_mins_dot, i32x8_zero, load_i8x32, load_i32x8, store_f32x8)

    @njit
    def pieces(w, x, word, ints, dots, pairs, sbuf, lanes):
        a, b = load_i32x8(ints, 0), load_i32x8(ints, 8)
        v, u = load_i8x32(w, 0), load_i8x32(x, 0)
        dots[0] = i32x8_hsum_two(dot4_u8x32_byte_scales(i32x8_zero(), v, u, v, u, v, u, v, u, word, 0), a)[0]
        dots[1] = i32x8_hsum_two(dot4_u8x32_byte_scales(a, v, u, v, u, v, u, v, u, word, 1), a)[0]
        pairs[0] = i32x8_hsum_two(i32x8_mins_dot(word, ints, 0), a)[0]
        # (lanes through float32: exact below 2**24, and these are below 2**23)
        store_f32x8(lanes, 0, f32x8_from_i32(dot_u8x32_scale_pair(v, u, sbuf, 3, 0)))
        store_f32x8(lanes, 8, f32x8_from_i32(dot_u8x32_scale_pair(v, u, sbuf, 3, 6)))
        return i32x8_hsum_two(a, b)

    rng = np.random.default_rng(22)
    w = rng.integers(0, 16, 32).astype(np.int8)
    x = rng.integers(-127, 128, 32).astype(np.int8)
    scale_bytes = rng.integers(0, 64, 8).astype(np.uint8)
    word = np.uint64(scale_bytes.view(np.uint64)[0])
    ints = rng.integers(-(1 << 20), 1 << 20, 16).astype(np.int32)
    dots, pairs = np.empty(2, np.int64), np.empty(1, np.int64)
    sbuf = rng.integers(-128, 128, 19).astype(np.int8).view(np.uint8)  # 16 scales from byte 3
    lanes = np.empty(16, np.float32)
    sums = pieces(w, x, word, ints, dots, pairs, sbuf, lanes)
    products = (w.astype(np.int64) * x).reshape(8, 4).sum(axis=1)  # lane l: elements 4l .. 4l + 3
    scales = sbuf.view(np.int8)[3:19].astype(np.int64)
    for i, g in enumerate((0, 6)):
        want = products * np.repeat(scales[[2 * g, 2 * g + 1]], 4)
        np.testing.assert_array_equal(lanes[8 * i:8 * i + 8], want)
    base = int((w.astype(np.int64) * x).sum())
    assert list(dots) == [base * int(scale_bytes[:4].sum()), int(ints[:8].sum()) + base * int(scale_bytes[4:].sum())]
    assert pairs[0] == int((np.repeat(scale_bytes.astype(np.int64), 2) * ints).sum())
    assert sums == (int(ints[:8].sum()), int(ints[8:].sum()))

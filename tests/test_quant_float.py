"""The float formats' matmul (F32, F16, BF16) against its numpy reference, bit for bit: llama.cpp's two kernels
(tinyBLAS for batches of two or more tokens, ggml_vec_dot_<type> for one token or widths not a multiple of 8) and
F16/BF16's rounding of the activations (quant.kernels_float)."""
import numpy as np
import pytest

from edgellm import quant
from edgellm.quant.kernels_float import matmul_float_ref
from edgellm.quant.registry import kernels_for

WIDTHS = (64, 72, 20)  # a multiple of 32; of 8 but not 32 (vec_dot's one-by-one tail); not of 8 (no tinyBLAS)
BATCHES = ((1,), (2,), (5,), (1, 1, 1), (3, 1, 4))


def weights(name, n_out, n_in, rng):
    """Weight bytes of the format and their exact values as float32; values over a wide range of magnitudes so that
    every difference of summation order shows in the last bits."""
    w = (rng.standard_normal((n_out, n_in)) * np.exp2(rng.integers(-6, 6, (n_out, n_in)))).astype(np.float32)
    if name == "F16":
        h = w.astype(np.float16)
        return h.view(np.uint8).reshape(-1), h.astype(np.float32)
    if name == "BF16":
        b = (w.view(np.uint32) >> 16).astype(np.uint16)
        return b.view(np.uint8).reshape(-1), (b.astype(np.uint32) << 16).view(np.float32)
    return w.view(np.uint8).reshape(-1), w


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("n_in", WIDTHS)
def test_float_matmul_is_its_reference_bit_for_bit(name, n_in):
    rng = np.random.default_rng(n_in)
    n_out = 12
    data, exact = weights(name, n_out, n_in, rng)
    layer = quant.QuantLinear(data, name, (n_out, n_in))
    record = kernels_for(name)
    for sizes in BATCHES:
        x = (rng.standard_normal((sum(sizes), n_in)) * np.exp2(rng.integers(-4, 4, (sum(sizes), n_in)))
             ).astype(np.float32)
        out = np.empty((sum(sizes), n_out), np.float32)
        layer.matmul(x, out, sizes=sizes)
        want = matmul_float_ref(exact, x, name, record.row_kinds_of(n_out, sizes))
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32), err_msg=f"{name} {n_in} {sizes}")
        if sizes == (1,):
            one = np.empty(n_out, np.float32)
            layer.matvec(x[0], one)
            np.testing.assert_array_equal(one.view(np.uint32), want[0].view(np.uint32))


def test_one_token_and_a_batch_sum_in_different_orders():
    """The two kernels are not the same arithmetic (what makes the kinds matter): a row computed alone and the same
    row in a batch of two differ in the last bits somewhere, and each equals its own reference."""
    rng = np.random.default_rng(7)
    data, exact = weights("F32", 64, 256, rng)
    layer = quant.QuantLinear(data, "F32", (64, 256))
    x = (rng.standard_normal((2, 256)) * 8).astype(np.float32)
    alone, pair = np.empty((1, 64), np.float32), np.empty((2, 64), np.float32)
    layer.matmul(x[:1], alone)
    layer.matmul(x, pair)
    assert (alone[0] != pair[0]).any()
    np.testing.assert_allclose(alone[0], pair[0], rtol=1e-5, atol=1e-4)


def test_activations_are_rounded_to_the_weight_type():
    """F16 weights multiply float16-rounded activations (llama.cpp's vec_dot_type): an input below float16's
    smallest subnormal contributes nothing, and BF16 keeps only bfloat16's 8 significant bits."""
    n_in = 32
    w16 = np.ones((1, n_in), np.float16)
    layer = quant.QuantLinear(w16.view(np.uint8).reshape(-1), "F16", (1, n_in))
    x = np.full((1, n_in), 1e-8, np.float32)
    out = np.empty((1, 1), np.float32)
    layer.matmul(x, out)
    assert out[0, 0] == 0.0
    wb = (np.ones((1, n_in), np.float32).view(np.uint32) >> 16).astype(np.uint16)
    layer = quant.QuantLinear(wb.view(np.uint8).reshape(-1), "BF16", (1, n_in))
    x = np.zeros((1, n_in), np.float32)
    x[0, 0] = 1 + 2 ** -10  # rounds to 1 in bfloat16
    layer.matmul(x, out)
    assert out[0, 0] == 1.0

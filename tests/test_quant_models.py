"""The quant package on the two real models: every tensor, every format they use.

Dequantization is compared bit for bit with gguf-py on every tensor (in row chunks, to bound memory), and
QuantLinear's integer kernels with float64 on each distinct weight format and shape.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from edgellm import quant
from edgellm.engine import gguf
from edgellm.quant import reference
from edgellm.quant.registry import FLOAT, Q8_0, Q8_K, kernels_for

CHUNK_ELEMENTS = 1 << 22     # rows are compared in chunks of about this many elements
ROWS_FOR_MATVEC = 2048       # the 49152- and 262144-row embeddings are checked on their first rows
# Real activations are not Gaussian, but the error model is the same: int8 rounding of a block's range.
REAL_WEIGHTS_NMSE = {FLOAT: 1e-11, Q8_0: 2e-4, Q8_K: 4e-4}  # by activation kind, as test_quant_kernels


def _row_chunks(tensor):
    n_rows = tensor.n_elements // tensor.shape[-1]
    rows_per_chunk = max(1, CHUNK_ELEMENTS // tensor.shape[-1])
    row_bytes = tensor.nbytes // n_rows
    for r0 in range(0, n_rows, rows_per_chunk):
        r1 = min(n_rows, r0 + rows_per_chunk)
        yield tensor.data[r0 * row_bytes:r1 * row_bytes], (r1 - r0, tensor.shape[-1])


def test_every_tensor_dequantizes_like_gguf_py(real_model):
    name, path = real_model
    seen = set()
    with gguf.open(path) as f:
        for tensor in f.tensors.values():
            seen.add(tensor.ggml_type)
            for data, shape in _row_chunks(tensor):
                ours = reference.dequantize(data, tensor.ggml_type, shape)
                theirs = gguf_dequantize(data.reshape(shape[0], -1), GGMLQuantizationType[tensor.ggml_type])
                np.testing.assert_array_equal(ours.view(np.uint32), theirs.reshape(shape).view(np.uint32),
                                              err_msg=f"{name}: {tensor.name}")
                np.testing.assert_array_equal(quant.dequantize(data, tensor.ggml_type, shape), ours,
                                              err_msg=f"{name}: {tensor.name} (Numba)")
    assert {"F32", "Q8_0"} <= seen  # both models: F32 norms and a Q8_0 token embedding


def _weight_matrices(f):
    """One 2-D tensor per distinct (format, shape), the big embeddings cut to their first rows."""
    chosen = {}
    for tensor in f.tensors.values():
        if len(tensor.shape) == 2:
            chosen.setdefault((tensor.ggml_type, tensor.shape), tensor)
    for (ggml_type, shape), tensor in sorted(chosen.items()):
        n_rows = min(shape[0], ROWS_FOR_MATVEC)
        yield tensor.name, ggml_type, tensor.data[:tensor.nbytes // shape[0] * n_rows], (n_rows, shape[1])


def test_quantlinear_on_every_real_weight_format(real_model):
    name, path = real_model
    rng = np.random.default_rng(0)
    with gguf.open(path) as f:
        checked = set()
        for tensor_name, ggml_type, data, shape in _weight_matrices(f):
            layer = quant.QuantLinear(data, ggml_type, shape)
            w = reference.dequantize(data, ggml_type, shape).astype(np.float64)
            x = rng.standard_normal((5, shape[1])).astype(np.float32)
            out = np.empty((5, shape[0]), np.float32)
            layer.matmul(x, out)
            want = x.astype(np.float64) @ w.T
            error = ((out - want) ** 2).sum() / (want ** 2).sum()
            limit = REAL_WEIGHTS_NMSE[kernels_for(layer.format).activation]
            assert error < limit, f"{name}: {tensor_name} ({ggml_type}) NMSE {error:.2e}"
            one = np.empty(shape[0], np.float32)
            layer.matvec(x[4], one)
            np.testing.assert_array_equal(one, out[4])
            checked.add(ggml_type)
    expected = {"smollm2-135m": {"Q4_1", "Q8_0"}, "gemma-3-270m": {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}}
    assert expected.get(name, set()) <= checked


def test_embedding_lookup_on_real_token_embd(real_model):
    name, path = real_model
    with gguf.open(path) as f:
        t = f.tensors["token_embd.weight"]
        layer = quant.QuantLinear(t.data, t.ggml_type, t.shape)
        ids = np.array([0, 1, t.shape[0] - 1, 12345 % t.shape[0]])
        out = np.empty((ids.size, t.shape[1]), np.float32)
        layer.get_rows(ids, out)
        row_bytes = t.nbytes // t.shape[0]
        for i, row in enumerate(ids):
            data = t.data[row * row_bytes:(row + 1) * row_bytes]
            want = gguf_dequantize(data, GGMLQuantizationType[t.ggml_type])
            np.testing.assert_array_equal(out[i], want, err_msg=f"{name}: row {row}")


def test_real_tensor_sizes_are_validated(real_model):
    _, path = real_model
    with gguf.open(path) as f:
        t = f.tensors["token_embd.weight"]
        with pytest.raises(ValueError, match="needs"):
            quant.QuantLinear(t.data[:-1], t.ggml_type, t.shape)

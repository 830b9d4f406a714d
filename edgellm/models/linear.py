"""Weight matrices as linear maps. Models get quant.QuantLinear (int8 kernels on the file's bytes, activations
rounded to 8 bits as llama.cpp does). DequantizedLinear is a float32 double with the same interface that tests
swap in (set LINEAR_CLASS) to take that rounding out of a comparison with the float64 reference.
"""

import numpy as np
from quant import QuantLinear


class DequantizedLinear:
    """The matrix dequantized once with gguf-py, then numpy float32 products."""

    def __init__(self, data_u8, ggml_type: str, shape):
        from gguf import GGMLQuantizationType  # gguf-py: only this test double needs it (an 80 ms import)
        from gguf.quants import dequantize as gguf_dequantize
        self.n_out, self.n_in = shape
        self.ggml_type = ggml_type
        qtype = GGMLQuantizationType[ggml_type]
        raw = np.asarray(data_u8).reshape(self.n_out, -1)
        self._w = np.ascontiguousarray(gguf_dequantize(raw, qtype), dtype=np.float32).reshape(self.n_out, self.n_in)

    def matvec(self, x, out):
        np.dot(self._w, x, out=out)

    def matmul(self, x, out, sizes=None):
        np.dot(x, self._w.T, out=out)

    def dequantize(self):
        return self._w.copy()

    def get_rows(self, ids, out):
        np.take(self._w, ids, axis=0, out=out)


LINEAR_CLASS = QuantLinear


def make_linear(tensor):
    """A linear map over a GGUFTensor of numpy shape (n_out, n_in)."""
    return LINEAR_CLASS(tensor.data, tensor.ggml_type, tuple(tensor.shape))

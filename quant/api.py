"""Public whole-tensor entry points: quant.dequantize (Numba kernels) and quant.quantize (numpy reference)."""

from __future__ import annotations

import numpy as np

from . import reference
from .formats import format_by_name
from .registry import kernels_for


def dequantize(data, ggml_type, shape) -> np.ndarray:
    """Raw bytes of a `ggml_type` tensor -> float32 array of `shape` (numpy order, rows last).

    Sizes are checked before any kernel runs: the last axis must split into whole blocks and `data` must
    hold exactly the bytes those blocks take. Bit-exact with gguf.quants.dequantize."""
    fmt = format_by_name(ggml_type)
    shape = reference.check_shape(fmt, shape)
    raw = reference.as_checked_bytes(data, fmt, shape)
    row_len = shape[-1]
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    out = np.empty((n_rows, row_len), np.float32)
    if out.size:
        kernels_for(fmt).dequantize_rows()(raw, fmt.row_bytes(row_len), np.arange(n_rows), out)
    return out.reshape(shape)


def quantize(x, ggml_type) -> np.ndarray:
    """float32 array (..., n) -> uint8 array (..., bytes per row) of `ggml_type` blocks.

    Supported: the formats gguf-py quantizes, bit-exact with gguf.quants.quantize (quant.reference)."""
    return reference.quantize(x, ggml_type)

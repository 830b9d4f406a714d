"""GGML block formats and the kernels that compute with them.

  formats.py          the one table of block formats (name, type id, block size, bytes, numpy block dtype)
  reference.py        numpy quantize / dequantize, bit-exact with gguf-py; activation quantization reference
  simd.py             LLVM vector-IR building blocks the Numba kernels are written in
  kernels_dequant.py  Numba dequantize for every format (also embedding lookup)
  activations.py      Numba activation quantization (Q8_0-style, Q8_K-style)
  kernels_legacy.py   int8 matmul for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (row dots in dots_legacy.py)
  kernels_kquant.py,
  matmul_kquant.py    int8 matmul for Q2_K .. Q6_K, Q8_K
  kernels_float.py    float matmul for F32, F16, BF16
  linear.py           QuantLinear, the object the models use (QuantGroup: several on one input)
"""

# Installed as edgellm.quant: edgellm/__init__.py has routed Numba's cache (edgellm.jitcache) before this runs.
from .formats import (FORMAT_NAMES, FORMATS, BlockFormat, UnknownFormatError,
                      format_by_id, format_by_name)

# The kernels (and numba, a quarter-second import) load on first use, so reading a GGUF file's header,
# which only needs the format table, stays fast.
_LAZY = {"dequantize": "api", "quantize": "api", "QuantLinear": "linear", "QuantGroup": "linear"}


def __getattr__(name):
    if name in _LAZY:
        from . import threading_layer as _threading_layer  # noqa: F401  (must run before any parallel kernel)
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'edgellm.quant' has no attribute {name!r}")

__all__ = ["BlockFormat", "FORMATS", "FORMAT_NAMES", "QuantGroup", "QuantLinear", "UnknownFormatError", "dequantize",
           "format_by_id", "format_by_name", "quantize"]

"""Arrays that start on a cache line. NumPy's arrays start wherever malloc leaves them, often 16 to 48 bytes past
one, and then a 64-byte vector load of them spans two lines and costs two loads; the 512-bit tiles load their
activations 64 bytes at a time (docs/kernels.md has the gain)."""

import numpy as np

CACHE_LINE = 64


def empty_aligned(shape, dtype) -> np.ndarray:
    """np.empty(shape, dtype) whose first byte is on a cache line."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + CACHE_LINE, np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def zeros_aligned(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype) whose first byte is on a cache line."""
    a = empty_aligned(shape, dtype)
    a.fill(0)
    return a

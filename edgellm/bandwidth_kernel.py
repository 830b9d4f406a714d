"""The kernel `edgellm bench` measures memory bandwidth with: a parallel sum, read-only like a decode step."""
import numba
from quant import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
import numpy as np


@numba.njit(parallel=True, cache=True, fastmath=True)
def _parallel_sum(a, n_chunks):
    chunk = (a.shape[0] + n_chunks - 1) // n_chunks
    partial = np.zeros(n_chunks, dtype=np.float32)
    for c in numba.prange(n_chunks):
        s = np.float32(0.0)
        for i in range(c * chunk, min((c + 1) * chunk, a.shape[0])):
            s += a[i]
        partial[c] = s
    return partial.sum()


def parallel_sum(a):
    return _parallel_sum(a, numba.get_num_threads() * 8)

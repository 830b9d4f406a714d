"""The kernel `edgellm bench` measures memory bandwidth with: a parallel sum, read-only like a decode step.

Each thread sums its chunk with 32-byte vector loads into four independent accumulators, so the loop is bound by
memory, not by an add's latency: a scalar loop reads well under the memory's bandwidth, which would make every
share of the bandwidth limit look better than it is.
"""
import numba
from edgellm.quant import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)
from edgellm.quant.simd import f32x8_add, f32x8_hsum, f32x8_zero, load_f32x8
import numpy as np

_STEP = 32  # floats per iteration: four vectors of eight


@numba.njit(parallel=True, cache=True)
def _parallel_sum(a, n_chunks):
    chunk = (a.shape[0] // n_chunks) // _STEP * _STEP
    partial = np.zeros(n_chunks + 1, dtype=np.float32)
    for c in numba.prange(n_chunks):
        s0, s1, s2, s3 = f32x8_zero(), f32x8_zero(), f32x8_zero(), f32x8_zero()
        for i in range(c * chunk, (c + 1) * chunk, _STEP):
            s0 = f32x8_add(s0, load_f32x8(a, i))
            s1 = f32x8_add(s1, load_f32x8(a, i + 8))
            s2 = f32x8_add(s2, load_f32x8(a, i + 16))
            s3 = f32x8_add(s3, load_f32x8(a, i + 24))
        partial[c] = f32x8_hsum(f32x8_add(f32x8_add(s0, s1), f32x8_add(s2, s3)))
    tail = np.float32(0)
    for i in range(n_chunks * chunk, a.shape[0]):  # what the chunks left over
        tail += a[i]
    partial[n_chunks] = tail
    return partial.sum()


def parallel_sum(a):
    """Sum of a 1-D float32 array (read once, in parallel)."""
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 1 and a.flags.c_contiguous):
        raise ValueError("parallel_sum needs a contiguous 1-D float32 array")
    return _parallel_sum(a, numba.get_num_threads() * 8)

"""Setting up Numba's CUDA simulator for the test_cuda_sim_* modules (imported only under NUMBA_ENABLE_CUDASIM=1).

The simulator runs every CUDA thread of a block as a Python thread. Its `cuda.shared.array` looks the call
site's allocation up in a dict and, when missing, creates and stores it: two steps with no lock between them
(numba-cuda 0.30, numba/cuda/simulator/kernelapi.py, FakeCUDAShared.array). When the interpreter switches
threads between them, two threads of one block get different arrays: a block reduction then sums only part of
the block and a kernel gives a wrong answer now and then. That is how the qwen3 tiny model once failed in CI
(NMSE 1.7e-3 against the reference, every run before and after it exact); tests/test_cuda_sim_kernels.py
widens the window to show it. `prepare()` makes the look-up-or-create one locked step.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

# simulated threads hand over at every barrier: the default 5 ms slice dominates the run time
SWITCH_INTERVAL_S = 2e-4

_lock = threading.Lock()


def _allocate(shape, dtype):
    """A new block-shared array (a seam: the test widens the race window here)."""
    return np.zeros(shape, dtype)


def prepare() -> None:
    """Short thread slices, and a simulator shared-array allocation that every thread of a block agrees on."""
    from numba.cuda.simulator import kernelapi

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    shared = kernelapi.FakeCUDAShared
    if getattr(shared, "_edgellm_locked", False):
        return
    original = shared.array

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # refused, or the one dynamic buffer: no call-site lookup
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):  # a Numba type such as numba.float32, as the original
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)  # one allocation per call site, as the simulator keys them
        key = (caller.f_code.co_filename, caller.f_lineno)
        with _lock:
            found = self._allocations.get(key)
            if found is None:
                found = self._allocations[key] = _allocate(shape, dtype)
        return found

    shared.array = array
    shared._edgellm_locked = True

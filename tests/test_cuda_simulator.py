"""Runs the CUDA simulator tests (test_cuda_sim_*.py) in a subprocess with NUMBA_ENABLE_CUDASIM=1.

The variable must be set before numba.cuda is first imported and would turn every CUDA kernel of the process
into the simulator, so it is never set in the main test process; those modules skip themselves there.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

import background

TESTS = Path(__file__).parent
SIMULATED_MODULES = ["test_cuda_sim_kernels.py", "test_cuda_sim_models.py"]
SIMULATOR_TIMEOUT_S = 3600  # a few minutes when it has a core to itself; in the background it waits for idle time
SIMULATOR = background.Job(
    "cuda-simulator",
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
     *(str(TESTS / name) for name in SIMULATED_MODULES)],
    env=background.child_env(NUMBA_ENABLE_CUDASIM=1), cwd=str(TESTS.parent), timeout=SIMULATOR_TIMEOUT_S)
IN_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _simulator_job(item):
    return [] if IN_SIMULATOR or importlib.util.find_spec("numba_cuda") is None else [SIMULATOR]


@pytest.mark.skipif(IN_SIMULATOR, reason="already inside the simulator run")
@pytest.mark.background(jobs=_simulator_job)
def test_cuda_kernels_and_tiny_models_in_the_simulator():
    pytest.importorskip("numba_cuda", reason="the numba-cuda package (edgellm[cuda]) brings the simulator")
    result = background.result(SIMULATOR)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"simulator tests failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert " passed" in summary and "skipped" not in summary, summary

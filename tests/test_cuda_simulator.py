"""Runs the CUDA simulator tests (test_cuda_sim_*.py) in a subprocess with NUMBA_ENABLE_CUDASIM=1.

The variable must be set before numba.cuda is first imported and would turn every CUDA kernel of the process
into the simulator, so it is never set in the main test process; those modules skip themselves there.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SIMULATED_MODULES = ["test_cuda_sim_kernels.py", "test_cuda_sim_models.py"]
SIMULATOR_TIMEOUT_S = 900  # ~1 minute on an idle 2-core machine; generous for a loaded CI runner


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="already inside the simulator run")
def test_cuda_kernels_and_tiny_models_in_the_simulator():
    pytest.importorskip("numba_cuda", reason="the numba-cuda package (edgellm[cuda]) brings the simulator")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               *(str(TESTS / name) for name in SIMULATED_MODULES)]
    result = subprocess.run(command, cwd=TESTS.parent, env=env, capture_output=True, text=True,
                            timeout=SIMULATOR_TIMEOUT_S)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"simulator tests failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert " passed" in summary and "skipped" not in summary, summary

"""Choosing the device: "cpu" never touches numba.cuda, "cuda" without a usable GPU is a DeviceError naming what
is missing (package, driver, GPU, compiler library), "auto" falls back to the CPU; and every CUDA kernel compiles
to PTX for a real GPU (no GPU needed), which the simulator alone cannot show.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgellm.engine.cuda import build_cuda_model, check_device, device, resolve_device
from edgellm.errors import DeviceError, EdgeLLMError

ROOT = Path(__file__).parent.parent
# What check_device may name as missing on a machine without a usable GPU.
MISSING_PIECES = ("numba-cuda", "driver", "GPU", "NVVM")


@pytest.fixture
def real_probe(monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)


@pytest.fixture
def gpu_unusable(real_probe):
    ok, reason = check_device()
    if ok:
        pytest.skip(f"a GPU is usable here ({reason})")
    return reason


def test_cpu_never_imports_numba_cuda():
    code = ("import sys\n"
            "from edgellm.engine.cuda import resolve_device\n"
            "assert resolve_device('cpu') == resolve_device(None) == resolve_device('CPU') == 'cpu'\n"
            "import edgellm.api, edgellm.engine.models\n"
            "print([m for m in sys.modules if m == 'numba.cuda' or m.startswith(('numba.cuda.', 'numba_cuda'))])\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:1", ""])
def test_unknown_device_names_are_refused(name):
    with pytest.raises(DeviceError, match="choose one of: cpu, cuda, auto"):
        resolve_device(name)


def test_cuda_without_a_usable_gpu_names_what_is_missing(gpu_unusable):
    assert any(piece in gpu_unusable for piece in MISSING_PIECES), gpu_unusable
    with pytest.raises(DeviceError) as err:
        resolve_device("cuda")
    message = str(err.value)
    assert message.startswith("device 'cuda' is not usable on this machine: ")
    assert gpu_unusable.rstrip(". ") in message
    assert "'cpu' or 'auto'" in message
    assert isinstance(err.value, EdgeLLMError)  # the CLI prints these as one line, without a traceback


def test_auto_falls_back_to_the_cpu(gpu_unusable):
    assert resolve_device("auto") == "cpu"


def test_missing_package_is_named(real_probe, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(device.importlib.util, "find_spec",
                        lambda name, *a: None if name == "numba_cuda" else real_find_spec(name, *a))
    ok, reason = check_device()
    assert not ok and "numba-cuda package is not installed" in reason and "edgellm[cuda]" in reason
    with pytest.raises(DeviceError, match=r"numba-cuda package is not installed \(pip install 'edgellm\[cuda\]'\)"):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu"


def test_auto_never_picks_the_simulator(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert check_device()[0] and resolve_device("auto") == "cpu"


def test_building_a_cuda_model_here_is_a_device_error(gpu_unusable):
    """What `edgellm.load(..., device="cuda")` reaches: refused before the file is read."""
    with pytest.raises(DeviceError, match="device 'cuda' is not usable"):
        build_cuda_model(gguf_file=None, n_ctx=64)


def test_load_with_device_cuda_is_a_device_error(gpu_unusable, smollm2_path):
    import edgellm
    with pytest.raises(DeviceError, match="device 'cuda' is not usable"):
        edgellm.load(smollm2_path, device="cuda")


def test_cli_device_cuda_prints_one_line_not_a_traceback(gpu_unusable, smollm2_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, "-m", "edgellm.cli", "run", str(smollm2_path), "--device", "cuda",
                             "-n", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgellm: error: device 'cuda' is not usable"), result.stderr


def _nvvm_available() -> bool:
    if importlib.util.find_spec("numba_cuda") is None:
        return False
    # NVVM lowers the kernels and NVRTC compiles the half-precision helpers: a machine can have the first (a
    # system CUDA toolkit) without the second, so probe both.
    probe = ("from numba.cuda.cudadrv import nvvm; nvvm.NVVM()\n"
             "from cuda.pathfinder import load_nvidia_dynamic_lib; load_nvidia_dynamic_lib('nvrtc')")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120).returncode == 0


def test_every_kernel_compiles_to_ptx_without_float64():
    """Type and lower every kernel for a real GPU (sm_80) through NVVM; only the rope angle may use float64."""
    if not _nvvm_available():
        pytest.skip("needs numba-cuda with the NVVM and NVRTC libraries (pip install 'numba-cuda[cu12]')")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, "-m", "edgellm.engine.cuda.ptx_check", "--cc", "8.0"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    from edgellm.engine.cuda.ptx_check import KERNEL_SIGNATURES
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert set(lines) == set(KERNEL_SIGNATURES)
    for name, line in lines.items():
        if name != "qk_norm_rope_store_kernel":
            assert line.endswith("float64 ops: none"), line

"""Which device runs the model: probing for a usable GPU and turning a device string into "cpu" or "cuda".

Nothing here imports numba.cuda at module import; check_device() imports it only when asked, so the CPU-only
install never loads it. The probe names the first missing piece, in the order a user has to fix them:
the numba-cuda package, the NVIDIA driver, a GPU, the CUDA compiler library (NVVM) the kernels are built with.
"""

from __future__ import annotations

import importlib.util
import os

from edgellm.errors import DeviceError

DEVICE_CHOICES = ("cpu", "cuda", "auto")
SIMULATOR_ENV = "NUMBA_ENABLE_CUDASIM"
INSTALL_HINT = "pip install 'edgellm[cuda]'"


def simulator_enabled() -> bool:
    """Numba's CUDA simulator runs the kernels as Python threads: for tests only, never chosen by "auto"."""
    return os.environ.get(SIMULATOR_ENV, "0") == "1"


def _driver_error(cuda) -> str:
    """The reason numba-cuda gives for an unusable driver, or a generic one."""
    try:
        from numba.cuda.cudadrv.driver import driver  # numba-cuda: an optional extra, imported only on the GPU path
        message = getattr(driver, "initialization_error", None)
    except Exception as err:  # the driver module itself failed to load
        message = str(err)
    return " ".join(str(message or "the CUDA driver could not be initialised").split())


def _nvvm_error() -> str | None:
    """None when the NVVM library that compiles the kernels is found, else why not."""
    try:
        from numba.cuda.cudadrv import nvvm  # numba-cuda: an optional extra, imported only on the GPU path
        nvvm.NVVM()
    except Exception as err:
        return " ".join(str(err).split())
    return None


def check_device() -> tuple[bool, str]:
    """(True, a description of the GPU) when CUDA kernels can run here, else (False, what is missing)."""
    if simulator_enabled():
        return True, f"Numba CUDA simulator ({SIMULATOR_ENV}=1): correct but very slow, for tests"
    if importlib.util.find_spec("numba_cuda") is None:
        return False, f"the numba-cuda package is not installed ({INSTALL_HINT})"
    try:
        from numba import cuda  # numba-cuda: an optional extra, imported only on the GPU path
    except Exception as err:
        return False, f"numba-cuda is installed but failed to import: {err}"
    try:
        driver_ok = cuda.is_available()
    except Exception:
        driver_ok = False
    if not driver_ok:
        return False, f"no usable NVIDIA CUDA driver: {_driver_error(cuda)}"
    try:
        gpus = list(cuda.gpus)
    except Exception as err:
        return False, f"the CUDA driver reports no usable GPU: {err}"
    if not gpus:
        return False, "the CUDA driver found no GPU"
    nvvm_problem = _nvvm_error()
    if nvvm_problem:
        return False, (f"the CUDA compiler library (NVVM) is missing: {nvvm_problem} "
                       "(pip install 'numba-cuda[cu12]', or 'numba-cuda[cu13]' with a CUDA 13 driver)")
    gpu = gpus[0]
    major, minor = gpu.compute_capability
    name = gpu.name.decode() if isinstance(gpu.name, bytes) else str(gpu.name)
    return True, f"{name} (compute capability {major}.{minor})"


def resolve_device(device: str | None = "cpu") -> str:
    """"cpu" | "cuda" | "auto" (None means "cpu") -> "cpu" or "cuda". DeviceError when "cuda" is asked for and
    unusable, or for a device name that is none of those."""
    name = "cpu" if device is None else str(device).strip().lower()
    if name not in DEVICE_CHOICES:
        raise DeviceError(f"unknown device {device!r}; choose one of: {', '.join(DEVICE_CHOICES)}")
    if name == "cpu":
        return "cpu"
    if name == "auto":
        if simulator_enabled():
            return "cpu"  # the simulator is a test tool, far slower than the CPU kernels
        ok, _ = check_device()
        return "cuda" if ok else "cpu"
    ok, reason = check_device()
    if not ok:
        raise DeviceError(f"device 'cuda' is not usable on this machine: {reason.rstrip('. ')}; "
                          "use device 'cpu' or 'auto' instead")
    return "cuda"

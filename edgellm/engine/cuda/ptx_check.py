"""Compile every CUDA kernel to PTX without a GPU: the check that the kernels type and lower for the real CUDA
target (the simulator runs them as Python and would accept code the compiler rejects).

Needs numba-cuda and the NVVM library (numba-cuda[cu12] brings it); no driver or GPU. The signatures are the
argument types the launchers in edgellm/engine/cuda/weights.py and models.py pass. Hot kernels must not compute in
float64 (a stray Python float literal would make them), which `float64_ops` reports.

    python -m edgellm.engine.cuda.ptx_check [--cc 8.0] [--ptxas]   # --ptxas also assembles and prints register use
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

# The argument types each kernel is launched with.
ARRAY_F32_2D = "float32[:, ::1]"
ARRAY_F32_3D = "float32[:, :, ::1]"
WEIGHT_ARGS = "int64, uint8[::1], int8[::1], float16[::1], float32[::1], int64"
KERNEL_SIGNATURES = {
    "matmul_kernel": f"void({WEIGHT_ARGS}, int64, {ARRAY_F32_2D}, {ARRAY_F32_2D}, boolean)",
    "get_rows_kernel": f"void({WEIGHT_ARGS}, int32[::1], float32, {ARRAY_F32_2D})",
    "rms_norm_kernel": f"void({ARRAY_F32_2D}, float32[::1], float32, {ARRAY_F32_2D}, boolean)",
    "qk_norm_rope_store_kernel": (f"void({ARRAY_F32_3D}, {ARRAY_F32_3D}, {ARRAY_F32_3D}, int32[::1], float64[::1], "
                                  f"boolean, float32[::1], float32[::1], boolean, float32, {ARRAY_F32_3D}, "
                                  f"{ARRAY_F32_3D}, int32[::1], float32)"),
    "attention_kernel": (f"void({ARRAY_F32_3D}, {ARRAY_F32_3D}, {ARRAY_F32_3D}, int32[::1], int64, int32[::1], "
                         f"int64, float32, {ARRAY_F32_3D}, float32)"),
    "gated_activation_kernel": f"void({ARRAY_F32_2D}, {ARRAY_F32_2D}, int64)",
    "add_bias_kernel": f"void({ARRAY_F32_2D}, float32[::1])",
    "add_scaled_kernel": f"void({ARRAY_F32_2D}, {ARRAY_F32_2D}, float32)",
}
# Kernels allowed to use float64: the rope angle is computed in float64 like edgellm.engine.ops.rope_tables.
FLOAT64_ALLOWED = {"qk_norm_rope_store_kernel"}


def _without_gpu(cc):
    """Device functions are compiled for the current device's compute capability; with no GPU, claim `cc`."""
    import numba.cuda.dispatcher as dispatcher  # numba-cuda: an optional extra, imported only on the GPU path
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=cc)


def kernels():
    from edgellm.engine.cuda import (op_kernels,  # numba-cuda: imported when compiling, not with this module
                                     quant_kernels)
    found = {}
    for module in (quant_kernels, op_kernels):
        for name in KERNEL_SIGNATURES:
            if hasattr(module, name):
                found[name] = getattr(module, name)
    missing = set(KERNEL_SIGNATURES) - set(found)
    if missing:
        raise LookupError(f"kernels listed but not defined: {sorted(missing)}")
    return found


def float64_ops(ptx: str) -> list[str]:
    """Double-precision arithmetic instructions in a PTX listing (loads/stores/conversions of f64 included)."""
    return sorted(set(re.findall(r"\b[a-z]+(?:\.[a-z0-9]+)*\.f64\b", ptx)))


def compile_all(cc=(8, 0)) -> dict:
    """kernel name -> PTX text, for compute capability cc."""
    from numba import cuda  # numba-cuda: an optional extra, imported only on the GPU path
    _without_gpu(cc)
    return {name: cuda.compile_ptx(k.py_func, KERNEL_SIGNATURES[name], cc=cc)[0] for name, k in kernels().items()}


def ptxas_report(name: str, ptx: str, cc) -> str:
    """ptxas -v's register / spill summary, or why it could not run."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        try:
            import nvidia.cuda_nvcc  # the cu12 compiler wheel, where ptxas is not on PATH
            candidate = Path(nvidia.cuda_nvcc.__path__[0]) / "bin" / "ptxas"
            ptxas = str(candidate) if candidate.exists() else None
        except ImportError:
            ptxas = None
    if ptxas is None:
        return "ptxas not found"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{name}.ptx"
        src.write_text(ptx)
        command = [ptxas, f"-arch=sm_{cc[0]}{cc[1]}", "-v", str(src), "-o", str(src.with_suffix(".cubin"))]
        result = subprocess.run(command, capture_output=True, text=True)
    lines = [ln.split("info    : ")[-1] for ln in result.stderr.splitlines() if "Used" in ln or "spill" in ln]
    return "; ".join(lines) if result.returncode == 0 else f"ptxas failed: {result.stderr.strip()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", default="8.0", help="compute capability to compile for (default 8.0)")
    parser.add_argument("--ptxas", action="store_true", help="also assemble with ptxas and print register use")
    args = parser.parse_args(argv)
    cc = tuple(int(v) for v in args.cc.split("."))
    failed = False
    for name, ptx in compile_all(cc).items():
        f64 = float64_ops(ptx)
        bad = bool(f64) and name not in FLOAT64_ALLOWED
        failed |= bad
        line = f"{name:<28} {len(ptx):>8} chars of PTX  float64 ops: {', '.join(f64) or 'none'}"
        print(line + ("  <- unexpected" if bad else ""))
        if args.ptxas:
            print(f"    {ptxas_report(name, ptx, cc)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

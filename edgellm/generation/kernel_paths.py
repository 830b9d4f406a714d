"""The kernel paths a session uses, and which of them the kernel cache already holds for a model's kind: what
`edgellm warmup` runs ahead of time and what a Model can compile at load (precompile) before anything is timed."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numba
from llvmlite import binding as llvm_binding

from edgellm import jitcache
from edgellm.engine.compile_clock import reporting_compiles

# A prompt of about 80 tokens: full 32-token blocks, then 8-, 4- and 1-token tails in the prompt kernels.
WARMUP_TEXT = ("Warm-up text with numbers 1, 22 and 333; words, punctuation (and brackets) - the quick brown fox "
               "jumps over the lazy dog. ") * 3
WARMUP_TOKENS = 4  # the most any exercise call generates
# What exercise() can run: every prompt shape then greedy decoding; sampling; a pooled batched decode step.
PATHS = ("prompt", "sampling", "batch")


def warm_key(m) -> str:
    """What decides which kernels a model's session compiles: its architecture, weight formats, KV cache type and
    the CPU Numba compiles for (the cache directory already separates source, Numba and Python versions)."""
    types = sorted({t.ggml_type for t in m.file.tensors.values()}) if m.file is not None else []
    parts = [str(m.metadata.get("general.architecture")), ",".join(types),
             getattr(getattr(m.model, "kv_type", None), "name", "?"), numba.config.CPU_NAME or llvm_binding.get_host_cpu_name()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _marker(m, path: str) -> Path | None:
    cache_dir = numba.config.CACHE_DIR or jitcache.configure()
    if cache_dir == jitcache.UNCACHED:  # nothing persists: every path is cold in every process
        return None
    return Path(cache_dir) / "warm" / f"{warm_key(m)}-{path}"


def cold_paths(m, paths=PATHS) -> list[str]:
    """The paths among `paths` that no warm-up (or precompile at load) has yet run this model's kind through."""
    return [p for p in paths if (marker := _marker(m, p)) is None or not marker.exists()]


def mark_warm(m, paths) -> None:
    for path in paths:
        marker = _marker(m, path)
        if marker is None:
            continue
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:
            pass  # an unwritable cache compiles again next time anyway


def precompile(m, paths=("prompt",), progress=None) -> float:
    """Run the model through those of `paths` not yet warm for its kind (see exercise), so their kernels compile
    now, calling progress(CompileProgress) as compilations begin and once at the end. Returns the seconds spent
    (0.0 when all were warm). The caller resets the model's state afterwards."""
    unknown = set(paths) - set(PATHS)
    if isinstance(paths, str) or unknown:
        raise ValueError(f"precompile takes paths among {PATHS}, got {paths!r}")
    todo = cold_paths(m, paths)
    if not todo:
        return 0.0
    t0 = time.perf_counter()
    with reporting_compiles(progress):
        exercise(m, todo)
    mark_warm(m, todo)
    return time.perf_counter() - t0


def exercise(m, paths=PATHS) -> None:
    """Run a loaded model through the kernel paths a session uses (see the module docstring)."""
    if "prompt" in paths:
        m.generate(WARMUP_TEXT, max_tokens=WARMUP_TOKENS)                  # prompt kernels, then greedy decode
    if "sampling" in paths:
        # a prompt of a few tokens: attention over so short a span runs its serial kernels (as a server's chunks can)
        m.generate("Hello, how are you today?", max_tokens=3, temperature=0.8, top_k=40, top_p=0.95, seed=0)
    if "batch" in paths:
        m.generate_batch([WARMUP_TEXT, "Hello"], max_tokens=3)             # pooled batched decode

"""Compile ahead of time: run each model through every kernel path its use needs, so that later processes only
load machine code from Numba's on-disk cache (`edgellm warmup`, e.g. right after install).

The paths: a prompt long enough for every token-block and tile shape of the prompt kernels, single-token
decoding, sampling, and a batched decode step (pooled caches). What a run compiles is counted through Numba's
compile events (`compile_clock.count_compiles`), so a second warmup reports 0 compiled, and a test can check that a process
compiles nothing after a warmup.

The paths and their warm markers are edgellm.generation.kernel_paths (which a Model's precompile at load also
uses); compilation is clocked and reported by edgellm.engine.compile_clock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numba

import edgellm
from edgellm.engine.compile_clock import count_compiles, reporting_compiles
from edgellm.generation.kernel_paths import PATHS, exercise, mark_warm  # noqa: F401  (exercise: tests use it here)
from edgellm.store import catalog

WARMUP_CTX = 512


@dataclass
class WarmupResult:
    model: str          # as given (catalog name or path)
    seconds: float      # load and every warm-up path, compilation included
    compiled: int       # Numba compilations this warm-up needed (0: everything came from the cache)
    cache_dir: str      # where the compiled kernels are kept


def warmup(models=None, n_threads=None, log=None, progress=None) -> list[WarmupResult]:
    """Warm each model (catalog names or paths; default: the catalog default). Returns one result per model.
    progress: called with CompileProgress as compilations begin and end, per model (see reporting_compiles)."""
    results = []
    for name in models or [catalog.DEFAULT_MODEL]:
        t0 = time.perf_counter()
        with count_compiles() as compiled, reporting_compiles(progress):
            m = edgellm.load(name, n_threads=n_threads, n_ctx=WARMUP_CTX)
            exercise(m)
        mark_warm(m, PATHS)
        cache_dir = numba.config.CACHE_DIR or edgellm.jitcache.configure()  # edgellm's own locator's directory
        r = WarmupResult(str(name), time.perf_counter() - t0, compiled.n, str(cache_dir))
        results.append(r)
        if log:
            log(f"edgellm: {r.model} warmed in {r.seconds:.1f} s ({r.compiled} kernels compiled; "
                f"cache {r.cache_dir})")
    return results

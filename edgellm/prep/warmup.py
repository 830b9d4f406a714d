"""Compile ahead of time: run each model through every kernel path its use needs, so that later processes only
load machine code from Numba's on-disk cache (`edgellm warmup`, e.g. right after install).

The paths: a prompt long enough for every token-block and tile shape of the prompt kernels, single-token
decoding, sampling, and a batched decode step (pooled caches). What a run compiles is counted through Numba's
compile events (`count_compiles`), so a second warmup reports 0 compiled, and a test can check that a process
compiles nothing after a warmup.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import numba
from numba.core import event

import edgellm
from edgellm.store import catalog

# A prompt of about 80 tokens: full 32-token blocks, then 8-, 4- and 1-token tails in the prompt kernels.
WARMUP_TEXT = ("Warm-up text with numbers 1, 22 and 333; words, punctuation (and brackets) - the quick brown fox "
               "jumps over the lazy dog. ") * 3
WARMUP_CTX = 512


@dataclass
class WarmupResult:
    model: str          # as given (catalog name or path)
    seconds: float      # load and every warm-up path, compilation included
    compiled: int       # Numba compilations this warm-up needed (0: everything came from the cache)
    cache_dir: str      # where the compiled kernels are kept


@contextmanager
def count_compiles():
    """Count Numba compilations (cache misses) inside the block: yields a one-item list holding the count."""
    count = [0]

    class _Counter(event.Listener):
        def on_start(self, ev):
            count[0] += 1

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", _Counter()):
        yield count


def exercise(m) -> None:
    """Run a loaded model through the kernel paths a session uses (see the module docstring)."""
    m.generate(WARMUP_TEXT, max_tokens=4)                                  # prompt kernels, then decode
    m.generate("Hello", max_tokens=3, temperature=0.8, top_k=40, top_p=0.95, seed=0)  # sampling
    m.generate_batch([WARMUP_TEXT, "Hello"], max_tokens=3)                 # pooled batched decode


def warmup(models=None, n_threads=None, log=None) -> list[WarmupResult]:
    """Warm each model (catalog names or paths; default: the catalog default). Returns one result per model."""
    results = []
    for name in models or [catalog.DEFAULT_MODEL]:
        t0 = time.perf_counter()
        with count_compiles() as compiled:
            m = edgellm.load(name, n_threads=n_threads, n_ctx=WARMUP_CTX)
            exercise(m)
        cache_dir = numba.config.CACHE_DIR or edgellm.jitcache.configure()  # edgellm's own locator's directory
        r = WarmupResult(str(name), time.perf_counter() - t0, compiled[0], str(cache_dir))
        results.append(r)
        if log:
            log(f"edgellm: {r.model} warmed in {r.seconds:.1f} s ({r.compiled} kernels compiled; "
                f"cache {r.cache_dir})")
    return results

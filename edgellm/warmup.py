"""Compile ahead of time: run each model through every kernel path its use needs, so that later processes only
load machine code from Numba's on-disk cache (`edgellm warmup`, e.g. right after install).

The paths: a prompt long enough for every token-block and tile shape of the prompt kernels, single-token
decoding, sampling, and a batched decode step (pooled caches). What a run compiles is counted through Numba's
compile events (`count_compiles`), so a second warmup reports 0 compiled, and a test can check that a process
compiles nothing after a warmup.

A process that finds a path's kernels never compiled for the model's kind (no warm marker in the kernel cache) can
run that path at load (`precompile`, as `edgellm chat` and `bench` do), so compilation happens before anything is
timed. Any compilation is clocked per thread (`compile_seconds`) and kept out of the generation timings, and can be
reported while it runs (`reporting_compiles`, which the CLI shows on stderr).
"""
from __future__ import annotations

import hashlib
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# A prompt of about 80 tokens: full 32-token blocks, then 8-, 4- and 1-token tails in the prompt kernels.
WARMUP_TEXT = ("Warm-up text with numbers 1, 22 and 333; words, punctuation (and brackets) - the quick brown fox "
               "jumps over the lazy dog. ") * 3
WARMUP_CTX = 512
WARMUP_TOKENS = 4  # the most any exercise call generates
# What exercise() can run: every prompt shape then greedy decoding; sampling; a pooled batched decode step.
PATHS = ("prompt", "sampling", "batch")


@dataclass
class WarmupResult:
    model: str          # as given (catalog name or path)
    seconds: float      # load and every warm-up path, compilation included
    compiled: int       # Numba compilations this warm-up needed (0: everything came from the cache)
    cache_dir: str      # where the compiled kernels are kept


@contextmanager
def count_compiles():
    """Count Numba compilations (cache misses) inside the block: yields a one-item list holding the count."""
    from numba.core import event

    count = [0]

    class _Counter(event.Listener):
        def on_start(self, ev):
            count[0] += 1

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", _Counter()):
        yield count


@dataclass
class CompileProgress:
    stage: str          # "start" (the first compilation began), "kernel" (one more began) or "done"
    kernels: int        # compilations begun so far (nested ones included, as count_compiles counts them)
    seconds: float      # since the first compilation began; at "done", the time spent compiling


class _CompileClock:
    """A Numba compile listener, installed once, keeping per-thread totals: Numba compiles in the calling thread,
    so a thread's own total is what its calls spent compiling, whatever other threads do meanwhile."""

    def __init__(self):
        self.local = threading.local()

    def state(self):
        st = self.local
        if not hasattr(st, "depth"):
            st.depth, st.t_start, st.seconds, st.kernels, st.progress = 0, 0.0, 0.0, 0, None
        return st

    def on_start(self, st):
        if st.depth == 0:
            st.t_start = time.perf_counter()
        st.depth += 1
        st.kernels += 1

    def on_end(self, st):
        st.depth -= 1
        if st.depth == 0:  # nested compilations run inside their caller's: only the outermost adds time
            st.seconds += time.perf_counter() - st.t_start


_clock = None
_clock_lock = threading.Lock()


def _compile_clock() -> _CompileClock:
    global _clock
    with _clock_lock:
        if _clock is None:
            from numba.core import event

            clock = _CompileClock()

            class _Listener(event.Listener):
                def on_start(self, ev):
                    st = clock.state()
                    clock.on_start(st)
                    if st.progress is not None:
                        st.progress(st)

                def on_end(self, ev):
                    clock.on_end(clock.state())

            event.register("numba:compile", _Listener())
            _clock = clock
    return _clock


def compile_seconds() -> float:
    """Wall time this thread has spent in Numba compilations since the clock was installed (its first call)."""
    return _compile_clock().state().seconds


def warm_key(m) -> str:
    """What decides which kernels a model's session compiles: its architecture, weight formats, KV cache type and
    the CPU Numba compiles for (the cache directory already separates source, Numba and Python versions)."""
    from numba.core import config
    from llvmlite import binding
    types = sorted({t.ggml_type for t in m.file.tensors.values()}) if m.file is not None else []
    parts = [str(m.metadata.get("general.architecture")), ",".join(types),
             getattr(getattr(m.model, "kv_type", None), "name", "?"), config.CPU_NAME or binding.get_host_cpu_name()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _marker(m, path: str) -> Path:
    import numba

    import edgellm
    cache_dir = numba.config.CACHE_DIR or edgellm.jitcache.configure()
    return Path(cache_dir) / "warm" / f"{warm_key(m)}-{path}"


def cold_paths(m, paths=PATHS) -> list[str]:
    """The paths among `paths` that no warm-up (or precompile at load) has yet run this model's kind through."""
    return [p for p in paths if not _marker(m, p).exists()]


def _mark_warm(m, paths) -> None:
    for path in paths:
        marker = _marker(m, path)
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
    _mark_warm(m, todo)
    return time.perf_counter() - t0


@contextmanager
def reporting_compiles(progress):
    """Inside the block, call progress(CompileProgress) as this thread's compilations begin, and once as the block
    ends if any did ("done"). progress None: nothing to report."""
    if progress is None:
        yield
        return
    st = _compile_clock().state()
    kernels0, seconds0, started, previous = st.kernels, st.seconds, [], st.progress

    def on_compile(s):
        n = s.kernels - kernels0
        if not started:
            started.append(time.perf_counter())
            progress(CompileProgress("start", n, 0.0))
        progress(CompileProgress("kernel", n, time.perf_counter() - started[0]))

    st.progress = on_compile
    try:
        yield
    finally:  # "done" even when the block ends in an error or Ctrl-C, so a live display stops
        st.progress = previous
        if started:  # the time compiling, as the timings count it, not what ran between compilations
            progress(CompileProgress("done", st.kernels - kernels0, st.seconds - seconds0))


def exercise(m, paths=PATHS) -> None:
    """Run a loaded model through the kernel paths a session uses (see the module docstring)."""
    if "prompt" in paths:
        m.generate(WARMUP_TEXT, max_tokens=WARMUP_TOKENS)                  # prompt kernels, then greedy decode
    if "sampling" in paths:
        m.generate("Hello", max_tokens=3, temperature=0.8, top_k=40, top_p=0.95, seed=0)
    if "batch" in paths:
        m.generate_batch([WARMUP_TEXT, "Hello"], max_tokens=3)             # pooled batched decode


def warmup(models=None, n_threads=None, log=None, progress=None) -> list[WarmupResult]:
    """Warm each model (catalog names or paths; default: the catalog default). Returns one result per model.
    progress: called with CompileProgress as compilations begin and end, per model (see reporting_compiles)."""
    import numba

    import edgellm
    from . import catalog
    results = []
    for name in models or [catalog.DEFAULT_MODEL]:
        t0 = time.perf_counter()
        with count_compiles() as compiled, reporting_compiles(progress):
            m = edgellm.load(name, n_threads=n_threads, n_ctx=WARMUP_CTX)
            exercise(m)
        _mark_warm(m, PATHS)
        cache_dir = numba.config.CACHE_DIR or edgellm.jitcache.configure()  # edgellm's own locator's directory
        r = WarmupResult(str(name), time.perf_counter() - t0, compiled[0], str(cache_dir))
        results.append(r)
        if log:
            log(f"edgellm: {r.model} warmed in {r.seconds:.1f} s ({r.compiled} kernels compiled; "
                f"cache {r.cache_dir})")
    return results

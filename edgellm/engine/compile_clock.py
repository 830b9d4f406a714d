"""Numba compilation, clocked per thread and reported while it runs: what keeps a first run's compilation out of
the prompt and generation timings, and what lets the CLI say that kernels are compiling."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass


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
        self.all_threads = 0  # compilations begun in any thread (count_compiles)

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
        self.all_threads += 1  # under Numba's compiler lock: one compilation begins at a time

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
            from numba.core import event  # numba loads on the first compile report, not at import

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


class CompileCount:
    """Numba compilations (cache misses) begun in any thread since this object was made: `.n`."""

    def __init__(self):
        self._clock = _compile_clock()
        self._before = self._clock.all_threads

    @property
    def n(self) -> int:
        return self._clock.all_threads - self._before


@contextmanager
def count_compiles():
    """Count the compilations begun inside the block (in any thread): yields a CompileCount."""
    yield CompileCount()


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

"""Pick Numba's OpenMP threading layer, and how its idle workers wait, before the first parallel kernel.

Layer: each matvec is one parallel region of a few microseconds, so the per-region cost matters. OpenMP
starts a region in ~2-3 us here; Numba's workqueue layer took 60+ us, and TBB (which Numba would otherwise
prefer when installed) costs more than OpenMP too.

Wait policy: OpenMP workers normally spin between regions (libgomp: up to 300,000 spins before they sleep), the
fastest on an idle machine (a 576x576 Q4_1 matvec on 2 threads: 16 us, against 80-100 us when workers sleep at
once). On a machine whose CPUs are already busy a spinning worker uses up its time slice and is descheduled, and
the next region then waits milliseconds for it (measured: SmolLM2 decode at 1.4 tok/s spinning vs 28 tok/s
sleeping, load average 11 on 2 CPUs). So when the load average at import already reaches the CPU count, workers
spin briefly and then sleep (GOMP_SPINCOUNT=BUSY_SPIN_COUNT): on an overloaded machine that is as good as
sleeping at once (SmolLM2 decode with 8 busy loops on 2 CPUs: 8.5-9.7 tok/s, against 8.0-8.9 with
OMP_WAIT_POLICY=PASSIVE; unbounded spinning did not finish), and when the load was only a spike that has passed
(the load average lags by a minute) decoding keeps most of its speed (116-138 tok/s, against about 40 with
PASSIVE and 137-151 with the default). Set OMP_WAIT_POLICY, GOMP_SPINCOUNT or NUMBA_THREADING_LAYER yourself to
override either choice. Both only take effect before OpenMP is loaded, i.e. before the first parallel kernel in
the process.
"""

import os

import numba


def _machine_is_busy() -> bool:
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return False


# Spins before an idle worker sleeps, on a busy machine: about 100 us here, longer than the Python between two
# kernels of a decode step, far shorter than a time slice.
BUSY_SPIN_COUNT = "10000"


def busy_wait_settings(environ, busy: bool) -> dict:
    """Environment variables to set before OpenMP loads: a bounded spin when the machine is busy, nothing when it is
    idle or the user already chose how workers wait."""
    if not busy or "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"GOMP_SPINCOUNT": BUSY_SPIN_COUNT}


class SlowThreadingWarning(UserWarning):
    """Numba's OpenMP layer could not load: parallel kernels run on a slower threading layer."""


# How to get OpenMP's runtime (libgomp.so.1), which Numba's omp layer links against.
OPENMP_FIX = ("install the OpenMP runtime: `apt install libgomp1` (Debian/Ubuntu), `apk add libgomp` (Alpine), "
              "`dnf install libgomp` (Fedora)")

# Set at import: the layer chosen and, when OpenMP was wanted but missing, why ("" otherwise).
CHOSEN = "default"
OPENMP_MISSING = ""


def chosen_layer() -> str:
    """The threading layer parallel kernels use (or will use): numba's own answer once one has run."""
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        return CHOSEN


def _fallback() -> str:
    try:
        from numba.np.ufunc import tbbpool  # noqa: F401
        return "tbb"
    except ImportError:
        return "workqueue"


def _prefer_openmp() -> None:
    global CHOSEN, OPENMP_MISSING
    if os.environ.get("NUMBA_THREADING_LAYER") or numba.config.THREADING_LAYER not in ("default", ""):
        CHOSEN = os.environ.get("NUMBA_THREADING_LAYER") or numba.config.THREADING_LAYER
        return
    os.environ.update(busy_wait_settings(os.environ, _machine_is_busy()))  # read once, when OpenMP loads (below)
    try:
        from numba.np.ufunc import omppool  # noqa: F401  (import fails where the layer is missing)
    except ImportError as e:
        CHOSEN, OPENMP_MISSING = _fallback(), str(e)
        import warnings  # only this fallback warns
        warnings.warn(f"Numba's OpenMP threading layer is unavailable ({e}); using {CHOSEN!r}, whose parallel "
                      "regions cost about 60 us each instead of a few (a large share of a decode step on small "
                      f"models). To fix it, {OPENMP_FIX}; or set NUMBA_THREADING_LAYER to silence this.",
                      SlowThreadingWarning, stacklevel=2)
        return
    numba.config.THREADING_LAYER = CHOSEN = "omp"


_pause_all = None  # omp_pause_resource_all of the loaded OpenMP runtime, looked up on first use (False: none)


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP workers; True when the runtime did. OpenMP keeps a team of workers for
    every thread that ran a parallel region, until that thread ends; the next region the thread runs starts a
    new team (about 5 ms here). A no-op, returning False, when the layer is not OpenMP or the runtime has no
    omp_pause_resource_all (OpenMP 5.0; libgomp since GCC 9)."""
    global _pause_all
    if chosen_layer() != "omp":
        return False
    if _pause_all is None:
        import ctypes  # only here: most processes never release a pool
        _pause_all = False
        for name in ("libgomp.so.1", "libomp.dylib"):  # Numba's omp layer on Linux, on macOS
            try:
                fn = ctypes.CDLL(name).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            _pause_all = fn
            break
    return bool(_pause_all) and _pause_all(2) == 0  # 2: omp_pause_hard, the team's threads end


_prefer_openmp()

from . import cache_load as _cache_load  # noqa: E402,F401  (cached kernels load without a full refresh)

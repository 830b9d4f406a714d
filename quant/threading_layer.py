"""Pick Numba's OpenMP threading layer, and how its idle workers wait, before the first parallel kernel.

Layer: each matvec is one parallel region of a few microseconds, so the per-region cost matters. OpenMP
starts a region in ~2-3 us here; Numba's workqueue layer took 60+ us, and TBB (which Numba would otherwise
prefer when installed) costs more than OpenMP too.

Wait policy: OpenMP workers normally spin between regions, the fastest on an idle machine (a 576x576 Q4_1
matvec on 2 threads: 16 us, against 31 us when workers sleep). On a machine whose CPUs are already busy a
spinning worker uses up its time slice and is descheduled, and the next region then waits milliseconds for
it (measured: SmolLM2 decode at 1.4 tok/s spinning vs 28 tok/s sleeping, load average 11 on 2 CPUs). So when
the load average at import already reaches the CPU count, workers sleep (OMP_WAIT_POLICY=PASSIVE). Set
OMP_WAIT_POLICY or NUMBA_THREADING_LAYER yourself to override either choice. Both only take effect before
OpenMP is loaded, i.e. before the first parallel kernel in the process.
"""

import os

import numba


def _machine_is_busy() -> bool:
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return False


def _prefer_openmp() -> None:
    if os.environ.get("NUMBA_THREADING_LAYER") or numba.config.THREADING_LAYER not in ("default", ""):
        return
    if "OMP_WAIT_POLICY" not in os.environ and _machine_is_busy():
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read once, when the OpenMP runtime loads (next line)
    try:
        from numba.np.ufunc import omppool  # noqa: F401  (import fails where the layer is missing)
    except ImportError:
        return
    numba.config.THREADING_LAYER = "omp"


_prefer_openmp()

from . import cache_load as _cache_load  # noqa: E402,F401  (cached kernels load without a full refresh)

"""Load cached kernels without Numba's whole-registry refresh (a third of a second of start-up, ~10 MB).

Before it loads a kernel from its on-disk cache, Numba refreshes the CPU target: it imports and installs every
implementation registry it has (linear algebra, random generators, typed containers, datetime, polynomials,
jitclass...), about 60 modules. A cached kernel is machine code: what it needs from that refresh is the
runtime's symbols (NRT allocation, which `rtsys.initialize` registers); the rest only matters for compiling, and
Numba's compiler refreshes the target itself before it compiles anything (and `get_function` on its first miss).
Measured on SmolLM2 (warm cache): `load` 0.70 -> 0.33-0.50 s, peak RSS 274 -> 264 MB, identical logits.

Kernels also set their cache up on first use instead of at definition (_DeferredCache).

Only CPU targets take this path; any other target, or a Numba whose cache class no longer has the pieces used
here, keeps Numba's own behaviour. Set EDGELLM_NUMBA_FULL_REFRESH=1 to keep it everywhere.
"""
import os

from numba.core import caching
from numba.core.dispatcher import Dispatcher

_original = caching.Cache.load_overload
_original_enable_caching = Dispatcher.enable_caching
stats = {"light_loads": 0}  # how many cache loads took the light path (tests check it)


def _light_load_overload(self, sig, target_context):
    from numba.core.cpu import CPUContext  # Numba internals: looked up per load, as install() checks them
    if not isinstance(target_context, CPUContext):
        return _original(self, sig, target_context)
    from numba.core.runtime import rtsys  # Numba internals: looked up per load, as install() checks them
    rtsys.initialize(target_context)  # the NRT symbols a cached kernel links against
    stats["light_loads"] += 1
    with self._guard_against_spurious_io_errors():
        return self._load_overload(sig, target_context)


class _DeferredCache:
    """Stands in for a kernel's FunctionCache until the kernel is first compiled or loaded from the cache. Making
    the real one looks the cache directory up, probes it and stats the source file: about 0.6 ms per kernel, paid at
    import by the hundreds of kernels a model's modules define, most of which a given file never calls."""

    def __init__(self, py_func):
        self._py_func = py_func
        self._real = None

    def __getattr__(self, name):
        if self._real is None:
            self._real = caching.FunctionCache(self._py_func)
        return getattr(self._real, name)


def _deferred_enable_caching(self):
    if getattr(self.py_func, "__module__", "").startswith("edgellm."):
        self._cache = _DeferredCache(self.py_func)
    else:
        _original_enable_caching(self)


def install() -> bool:
    """Route CPU cache loads through the light path. Returns whether it is in place."""
    if os.environ.get("EDGELLM_NUMBA_FULL_REFRESH"):
        return False
    needed = (hasattr(caching.Cache, "_guard_against_spurious_io_errors")
              and hasattr(caching.Cache, "_load_overload"))
    try:
        from numba.core.runtime import rtsys  # Numba internals: some versions lack them (no light path then)
        needed = needed and hasattr(rtsys, "initialize")
    except ImportError:
        needed = False
    if needed:
        caching.Cache.load_overload = _light_load_overload
    if hasattr(Dispatcher, "enable_caching") and hasattr(caching, "FunctionCache"):
        Dispatcher.enable_caching = _deferred_enable_caching
    return needed


installed = install()

"""edgellm: CPU-first quantized LLM inference in Python.

    import edgellm
    m = edgellm.load("smollm2-135m")          # a catalog name (pulled on first use) or a path to a .gguf file
    print(m.generate("The capital of France is", max_tokens=16))
"""
import gc as _gc

from . import jitcache as _jitcache

_jitcache.configure()  # before anything imports numba

from .errors import (CatalogError, DeviceError, EdgeLLMError, GGUFError, MemoryBudgetError, ModelBusyError,
                     ModelError, PromptError, SamplingError, TokenizerError)

__version__ = "0.1.0"


def load(model=None, n_threads=None, n_ctx=None, **kwargs):
    """Load a model by catalog name or path. See `edgellm.api.Model` for the options."""
    with _collector_paused():
        from .api import load as _load  # start-up time: `import edgellm` stays light until a model is loaded
        return _load(model, n_threads=n_threads, n_ctx=n_ctx, **kwargs)


def release_threads() -> bool:
    """Free the calling thread's OpenMP workers; True when freed. A thread that generated keeps them until it ends,
    and while it does, generation from other threads runs at about half speed: call this on the main thread after
    a warm-up when the app then generates from other threads (docs/kernels.md, "Threads")."""
    from .engine.engine_thread import release_threads as _release  # start-up time: numba loads, as for a model
    return _release()


class _collector_paused:
    """Python's cyclic garbage collector off while a model loads, its objects then counted as old.

    A first load creates ~80k objects that live as long as the process or the model (Numba's and the API's
    modules, the kernels, the model): collecting as they appear is ~170 collections, ~0.1 s of a 1 s start-up,
    that find nearly nothing. freeze() then unfreeze() moves every tracked object to the oldest generation without
    examining it, so no collection right after the load walks them all either; the next full collection still
    sees them (nothing is kept alive that would otherwise be freed)."""

    def __enter__(self):
        self._was_enabled = _gc.isenabled()
        _gc.disable()

    def __exit__(self, *exc):
        _gc.freeze()
        _gc.unfreeze()
        if self._was_enabled:
            _gc.enable()
        return False


def __getattr__(name):
    if name in ("Model", "Completion"):
        from . import api  # start-up time: the API module (numpy and more) loads when asked for
        return getattr(api, name)
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")


__all__ = ["load", "release_threads", "Model", "Completion", "EdgeLLMError", "PromptError", "ModelBusyError", "GGUFError", "ModelError", "TokenizerError", "SamplingError",
           "CatalogError", "MemoryBudgetError", "DeviceError", "__version__"]

"""edgellm: CPU-first quantized LLM inference in Python.

    import edgellm
    m = edgellm.load("smollm2-135m")          # a catalog name (pulled on first use) or a path to a .gguf file
    print(m.generate("The capital of France is", max_tokens=16))
"""
from . import jitcache as _jitcache

_jitcache.configure()  # before anything imports numba

from .errors import (CatalogError, DeviceError, EdgeLLMError, GGUFError, MemoryBudgetError, ModelBusyError,
                     ModelError, PromptError, SamplingError, TokenizerError)

__version__ = "0.1.0"


def load(model=None, n_threads=None, n_ctx=None, **kwargs):
    """Load a model by catalog name or path. See `edgellm.api.Model` for the options."""
    from .api import load as _load  # start-up time: `import edgellm` stays light until a model is loaded
    return _load(model, n_threads=n_threads, n_ctx=n_ctx, **kwargs)


def __getattr__(name):
    if name in ("Model", "Completion"):
        from . import api  # start-up time: the API module (numpy and more) loads when asked for
        return getattr(api, name)
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")


__all__ = ["load", "Model", "Completion", "EdgeLLMError", "PromptError", "ModelBusyError", "GGUFError", "ModelError", "TokenizerError", "SamplingError",
           "CatalogError", "MemoryBudgetError", "DeviceError", "__version__"]

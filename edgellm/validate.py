"""Checks made before a model runs: does it fit in the memory that is available.

(Tensor types, shapes and byte ranges are checked against the architecture in edgellm/models/loading.py, and
every byte range against the file in edgellm/gguf.py, before any kernel sees a buffer.)

`model_memory_needs(gguf_file, n_ctx)` gives the figures without allocating anything: the weights' bytes (they
stay in the file's map, but a model whose weights cannot stay resident pages them in from disk on every token)
and the KV cache that loading preallocates for n_ctx. `check_memory(weights, kv)` compares them, with headroom,
to psutil's available memory and raises MemoryBudgetError with the figures; the override is explicit
(`force=True`, or EDGELLM_SKIP_MEMORY_CHECK=1 in the environment).
"""
from __future__ import annotations

import os

from .errors import MemoryBudgetError, ModelError

SKIP_ENV = "EDGELLM_SKIP_MEMORY_CHECK"
# Beyond weights and cache: activation buffers for one batch, tokenizer tables, the JIT and the interpreter
# (measured: ~60 MiB of anonymous memory for Gemma 3's 262k-token tokenizer plus buffers).
DEFAULT_HEADROOM_BYTES = 128 << 20
KV_ITEMSIZE = 4        # float32 K and V, as edgellm.kvcache.KVCache allocates them
SLOT_POSITION_BYTES = 4  # one int32 position per cache slot


def available_memory() -> int:
    """Bytes the OS can give without swapping (free plus reclaimable page cache)."""
    import psutil
    return int(psutil.virtual_memory().available)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def check_memory(weight_bytes: int, kv_bytes_min: int, available: int | None = None, *,
                 headroom_bytes: int = DEFAULT_HEADROOM_BYTES, force: bool = False, what: str = "the model") -> int:
    """Raise MemoryBudgetError unless weights + minimal KV cache + headroom fit in `available` bytes (default:
    psutil.virtual_memory().available). Returns the bytes needed. force=True (or $EDGELLM_SKIP_MEMORY_CHECK=1)
    skips the refusal."""
    for name, value in (("weight_bytes", weight_bytes), ("kv_bytes_min", kv_bytes_min),
                        ("headroom_bytes", headroom_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    needed = weight_bytes + kv_bytes_min + headroom_bytes
    if force or os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return needed
    if available is None:
        available = available_memory()
    if needed > available:
        raise MemoryBudgetError(
            f"{what} does not fit in memory: {_mib(weight_bytes)} of weights + {_mib(kv_bytes_min)} of KV cache "
            f"+ {_mib(headroom_bytes)} headroom = {_mib(needed)}, but only {_mib(available)} is available. "
            f"Use a smaller n_ctx or a smaller model, free memory, or override (check_memory=False, "
            f"or {SKIP_ENV}=1)")
    return needed


def kv_cache_bytes(n_ctx: int, n_head_kv: int, head_dim: int, windows, n_batch: int) -> int:
    """What KVCache(n_ctx, n_head_kv, head_dim, windows, n_batch) allocates: K and V for every slot of every
    layer (a sliding-window layer keeps a ring of window + one batch), plus one position per slot."""
    from .kvcache import ring_capacity
    slots = sum(ring_capacity(n_ctx, int(w), n_batch) for w in windows)
    return slots * (2 * n_head_kv * head_dim * KV_ITEMSIZE + SLOT_POSITION_BYTES)


def model_memory_needs(gguf_file, n_ctx: int | None = None, n_batch: int | None = None) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) that loading this file with n_ctx (default: its training context) needs."""
    from .models import get_architecture
    from .models.base import DEFAULT_N_BATCH
    arch = get_architecture(gguf_file.metadata.get("general.architecture", "<missing>"))
    config = arch.config_class.from_gguf(gguf_file)
    if not 0 < config.n_layer <= len(gguf_file.tensors):   # every layer has tensors: more layers is a corrupt count
        raise ModelError(f"block_count {config.n_layer} is impossible for a file of {len(gguf_file.tensors)} tensors")
    n_ctx = n_ctx or config.n_ctx_train
    if hasattr(config, "is_sliding"):
        windows = [config.sliding_window if config.is_sliding(il) else 0 for il in range(config.n_layer)]
    else:
        windows = [0] * config.n_layer
    weights = sum(t.nbytes for t in gguf_file.tensors.values())
    return weights, kv_cache_bytes(n_ctx, config.n_head_kv, config.head_dim, windows, n_batch or DEFAULT_N_BATCH)

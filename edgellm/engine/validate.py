"""Checks made before a model runs: does it fit in the memory that is available.

(Tensor types, shapes and byte ranges are checked against the architecture in edgellm/engine/models/loading.py, and
every byte range against the file in edgellm/engine/gguf.py, before any kernel sees a buffer.)

`model_memory_needs(gguf_file, n_ctx)` gives the figures without allocating anything: the weights' bytes that must
stay resident (they stay in the file's map, but a model whose weights cannot stay resident pages them in from disk
on every token; of a mixture of experts, the shared tensors and one token's share of the experts, see
`weight_residency`) and the KV cache that loading preallocates for n_ctx. `paging_warning` words the case of a file
larger than memory whose resident part fits: it runs, its experts paged in from the file as tokens use them. `check_memory(weights, kv)` compares them, with headroom,
to the available memory (Linux's MemAvailable, psutil's elsewhere, or a cgroup's limit less its usage when that is smaller) and raises MemoryBudgetError with the figures; the override is explicit
(`force=True`, or EDGELLM_SKIP_MEMORY_CHECK=1 in the environment).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from edgellm.errors import MemoryBudgetError, ModelError

SKIP_ENV = "EDGELLM_SKIP_MEMORY_CHECK"
# Beyond weights and cache: activation buffers for one batch, tokenizer tables, the JIT and the interpreter
# (Gemma 3's 262k-token tokenizer plus its buffers take about half of it).
DEFAULT_HEADROOM_BYTES = 128 << 20


CGROUP_ROOT_ENV = "EDGELLM_CGROUP_ROOT"  # where the cgroup hierarchy is mounted (tests point it at fake files)


def available_memory() -> int:
    """Bytes this process can get without swapping or being OOM-killed: the host's available memory (free plus
    reclaimable page cache), or less when a cgroup (a container, a systemd slice) limits it."""
    host = meminfo_available(MEMINFO_PATH)
    if host is None:
        import psutil  # start-up time: only where /proc/meminfo does not say (importing it is ~30 ms)
        host = int(psutil.virtual_memory().available)
    limited = cgroup_memory_available()
    return host if limited is None else min(host, limited)


MEMINFO_PATH = "/proc/meminfo"


def meminfo_available(path: str = MEMINFO_PATH) -> int | None:
    """Linux's MemAvailable in bytes (what psutil.virtual_memory().available reports there), or None without it."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    fields = line.split()
                    return int(fields[1]) * 1024 if len(fields) >= 2 and fields[1].isdigit() else None
    except OSError:
        pass
    return None


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2 unlimited) and unreadable values: no limit


def _inactive_file(path, key):
    # page cache the kernel reclaims before OOM-killing: not counted against the limit (as kubelet's working set)
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory_available(root: str | None = None, proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """limit - usage of the tightest memory cgroup over this process (v2 memory.max, v1 memory.limit_in_bytes),
    counting its ancestors' limits too; None when no limit applies or no cgroup is visible."""
    root = root or os.environ.get(CGROUP_ROOT_ENV) or "/sys/fs/cgroup"
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    v2_path = v1_path = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    if os.path.exists(os.path.join(root, "memory.max")) or v2_path is not None and v1_path is None:
        base, limit_file, usage_file, stat_key, rel = root, "memory.max", "memory.current", "inactive_file", v2_path
    else:
        base, limit_file, usage_file, stat_key, rel = (os.path.join(root, "memory"), "memory.limit_in_bytes",
                                                        "memory.usage_in_bytes", "total_inactive_file", v1_path)
    # the process's own cgroup and each ancestor up to the mount; inside a container the mount is usually the
    # container's own cgroup, so a path that does not exist there is read at the mount itself
    parts = [p for p in (rel or "/").split("/") if p]
    dirs = [os.path.join(base, *parts[:k]) for k in range(len(parts), -1, -1)]
    best = None
    for d in dirs:
        limit = _read_int(os.path.join(d, limit_file))
        if limit is None or limit >= 1 << 60:  # v1 writes "unlimited" as a page-rounded 2^63
            continue
        usage = _read_int(os.path.join(d, usage_file)) or 0
        usage -= min(_inactive_file(os.path.join(d, "memory.stat"), stat_key), usage)
        room = max(limit - usage, 0)
        best = room if best is None else min(best, room)
    return best


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


def kv_cache_bytes(n_ctx: int, n_head_kv: int, head_dim: int, windows, n_batch: int, kv_type=None) -> int:
    """What KVCache(n_ctx, n_head_kv, head_dim, windows, n_batch, kv_type) allocates: K and V for every slot of
    every layer (a sliding-window layer keeps a ring of window + one batch), plus one position per slot, plus the
    block's alignment padding."""
    from edgellm.engine.kvcache import KVCache  # kernels: slow to import, loaded with a model
    return KVCache.planned_nbytes(n_ctx, n_head_kv, head_dim, windows, n_batch, kv_type)


def _config_and_windows(gguf_file):
    from edgellm.engine.models import get_architecture  # kernels: slow to import, loaded with a model
    arch = get_architecture(gguf_file.metadata.get("general.architecture", "<missing>"))
    config = arch.config_class.from_gguf(gguf_file)
    if not 0 < config.n_layer <= len(gguf_file.tensors):   # every layer has tensors: more layers is a corrupt count
        raise ModelError(f"block_count {config.n_layer} is impossible for a file of {len(gguf_file.tensors)} tensors")
    return config, list(config.layer_windows())


@dataclass(frozen=True)
class WeightResidency:
    """The weights' bytes: all of them, and those every token reads (for a mixture of experts, the shared tensors
    plus expert_used_count / expert_count of the experts' stacks; the rest are read only by the tokens routed to
    them, from the map, and may stay on disk). Parameters likewise."""
    total_bytes: int
    resident_bytes: int
    total_params: int
    active_params: int


EXPERT_TENSOR_SUFFIXES = ("_exps.weight",)  # ffn_{gate,up,down}_exps: llama.cpp's names for expert stacks


def weight_residency(gguf_file, config=None) -> WeightResidency:
    experts = getattr(config if config is not None else _config_and_windows(gguf_file)[0], "experts", None)
    share = experts.n_used / experts.n_expert if experts is not None and experts.n_expert else 1.0
    total = resident = params = active = 0
    for name, t in gguf_file.tensors.items():
        part = share if name.endswith(EXPERT_TENSOR_SUFFIXES) else 1.0
        total += t.nbytes
        resident += int(t.nbytes * part)
        params += t.n_elements
        active += int(t.n_elements * part)
    return WeightResidency(total, resident, params, active)


def paging_warning(gguf_file, available: int | None = None) -> str | None:
    """A warning when the whole file is larger than the memory available but what must stay resident fits (a
    mixture of experts): it runs from the map, as llama.cpp's mmap does, experts paged in from disk as tokens use
    them. None when the file fits."""
    w = weight_residency(gguf_file)
    available = available_memory() if available is None else available
    if w.total_bytes <= available:
        return None
    return (f"the file holds {_mib(w.total_bytes)} of weights, more than the {_mib(available)} of memory available; "
            f"{_mib(w.resident_bytes)} are read by every token (shared tensors and {w.active_params:,} of "
            f"{w.total_params:,} parameters active), the experts not in memory are read from the file as tokens "
            f"pick them: expect slower decoding while they are paged in")


def model_memory_needs(gguf_file, n_ctx: int | None = None, n_batch: int | None = None,
                       kv_type=None) -> tuple[int, int]:
    """(weight bytes that must stay resident, KV-cache bytes) that loading this file with n_ctx (default: its
    training context) needs."""
    from edgellm.engine.models.base import DEFAULT_N_BATCH  # kernels: slow to import, loaded with a model
    config, windows = _config_and_windows(gguf_file)
    n_ctx = n_ctx or config.n_ctx_train
    weights = weight_residency(gguf_file, config).resident_bytes
    return weights, kv_cache_bytes(n_ctx, config.n_head_kv, config.head_dim, windows, n_batch or DEFAULT_N_BATCH,
                                   kv_type)


# The smallest context n_ctx=None settles for; below it the model is refused rather than run crippled.
MIN_AUTO_CTX = 256
# Of the memory left after weights and headroom, the share the automatic context may take (the rest stays free
# for the application and the OS).
AUTO_CTX_SHARE = 0.5


@dataclass(frozen=True)
class ContextFit:
    """How n_ctx=None was chosen: n_ctx = min(trained, (share x (available - weights - headroom) - fixed) / per_token)."""
    n_ctx: int
    n_ctx_train: int
    available: int
    weights: int
    headroom: int
    share: float
    fixed_bytes: int      # sliding-window rings and alignment: the same at any n_ctx past the window
    per_token_bytes: int  # K and V of one more position in every full-attention layer, plus its slot positions

    def explain(self) -> str:
        budget = self.share * (self.available - self.weights - self.headroom)
        return (f"n_ctx {self.n_ctx} = min(trained {self.n_ctx_train}, ({self.share:.0%} x ({_mib(self.available)} "
                f"available - {_mib(self.weights)} weights - {_mib(self.headroom)} headroom) = {_mib(int(budget))} "
                f"- {_mib(self.fixed_bytes)} fixed) / {self.per_token_bytes:,} bytes per token)")


def fit_context(gguf_file, kv_type=None, n_batch: int | None = None, available: int | None = None,
                headroom_bytes: int = DEFAULT_HEADROOM_BYTES, share: float = AUTO_CTX_SHARE) -> ContextFit:
    """The context n_ctx=None picks: the largest that fits in a share of the memory free now, after the weights
    (they will be resident) and headroom, capped by the training context. MemoryBudgetError below MIN_AUTO_CTX."""
    from edgellm.engine.models.base import DEFAULT_N_BATCH  # kernels: slow to import, loaded with a model
    config, windows = _config_and_windows(gguf_file)
    n_batch = n_batch or DEFAULT_N_BATCH
    if available is None:
        available = available_memory()
    weights = weight_residency(gguf_file, config).resident_bytes
    big = max(config.n_ctx_train, max(windows) + n_batch)  # past every ring's size: the cost is linear from here

    def cost(n):
        return kv_cache_bytes(n, config.n_head_kv, config.head_dim, windows, n_batch, kv_type)

    per_token = cost(big + 1) - cost(big)
    fixed = cost(big) - per_token * big
    budget = int(share * (available - weights - headroom_bytes))
    n_ctx = config.n_ctx_train if per_token == 0 else min(config.n_ctx_train, (budget - fixed) // per_token)
    while n_ctx > 0 and cost(n_ctx) > budget:  # below the rings' full size the cost is not linear: step down
        n_ctx -= max(1, n_ctx // 64)
    floor = min(MIN_AUTO_CTX, config.n_ctx_train)
    if n_ctx < floor and os.environ.get(SKIP_ENV, "") not in ("", "0"):
        n_ctx = floor  # the override: run anyway, at the smallest useful context
    fit = ContextFit(int(n_ctx), config.n_ctx_train, available, weights, headroom_bytes, share, fixed, per_token)
    if fit.n_ctx < floor:
        raise MemoryBudgetError(f"not enough memory for even a {MIN_AUTO_CTX}-token context: {fit.explain()}. "
                                "Free memory, use a smaller model or a smaller kv_type (f16, q8_0), or give n_ctx "
                                f"and override the check (check_memory=False, or {SKIP_ENV}=1)")
    return fit

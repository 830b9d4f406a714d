"""`edgellm info`: what a GGUF file holds and what running it will cost, without building the model.

Sections: the metadata summary; tensor types (count, elements, bytes); the memory plan (weights, which stay in the
memory-mapped file, and the KV cache per layer type, sized the way edgellm/engine/kvcache.py allocates it).
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

from edgellm.engine import gguf as gguf_reader
from edgellm.engine.kvcache import KVCache, ring_capacity
from edgellm.engine.kvtypes import KV_TYPES, kv_type as parse_kv_type, row_bytes
from edgellm.engine.models import ALIASES, ARCHITECTURES, get_architecture
from edgellm.engine.models.base import DEFAULT_N_BATCH
from edgellm.engine.validate import fit_context, weight_residency
from edgellm.errors import EdgeLLMError
from edgellm.quant import threading_layer
from edgellm.quant.formats import FORMATS
from edgellm.store import catalog

MiB = 1024 * 1024


@dataclass(frozen=True)
class LayerKind:
    name: str  # "full attention" or "sliding window 512"
    n_layers: int
    bytes_per_token_per_layer: int  # K and V of one position in one layer, in the plan's kv_type
    slots: int  # positions each such layer holds at this n_ctx

    @property
    def total_bytes(self) -> int:
        return self.n_layers * self.slots * self.bytes_per_token_per_layer


@dataclass(frozen=True)
class MemoryPlan:
    n_ctx: int
    kv_type: str
    weights_bytes: int
    layer_kinds: tuple
    kv_bytes: int  # exactly what the cache allocates (values, scales, slot positions, alignment)
    per_type: dict  # kv type -> {layer kind name: bytes per token per layer}

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes


def memory_plan(gguf_file, n_ctx: int | None = None, kv_type=None) -> MemoryPlan:

    kvt = parse_kv_type(kv_type)
    config = get_architecture(gguf_file.architecture).config_class.from_gguf(gguf_file)
    n_ctx = n_ctx or config.n_ctx_train
    windows = config.layer_windows()
    counts = defaultdict(int)
    for w in windows:
        counts[w] += 1

    def per_token(t):
        return 2 * config.n_head_kv * row_bytes(t, config.head_dim)

    names = {w: "full attention" if w == 0 else f"sliding window {w}" for w in counts}
    kinds = tuple(LayerKind(names[w], n, per_token(kvt), ring_capacity(n_ctx, w, DEFAULT_N_BATCH))
                  for w, n in sorted(counts.items()))
    per_type = {t.name: {names[w]: per_token(t) for w in sorted(counts)} for t in KV_TYPES.values()
                if not t.block or config.head_dim % t.block == 0}
    weights = sum(t.nbytes for t in gguf_file.tensors.values())
    kv_bytes = KVCache.planned_nbytes(n_ctx, config.n_head_kv, config.head_dim, windows, DEFAULT_N_BATCH, kvt)
    return MemoryPlan(n_ctx, kvt.name, weights, kinds, kv_bytes, per_type)


def _fmt_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _file_type_name(value) -> str:
    if value is None:
        return "-"
    try:
        from gguf import LlamaFileType  # gguf-py: a slow import, needed here for one name table
        return f"{LlamaFileType(int(value)).name.removeprefix('MOSTLY_')} ({value})"
    except (ImportError, ValueError):
        return str(value)


def _metadata_lines(md: dict, arch: str) -> list[str]:
    def get(key, default="-"):
        value = md.get(key, default)
        return value if not hasattr(value, "__len__") or isinstance(value, str) else f"[{len(value)} items]"

    template = md.get("tokenizer.chat_template")
    rows = [
        ("name", get("general.name")),
        ("architecture", arch),
        ("file type", _file_type_name(md.get("general.file_type"))),
        ("context (trained)", get(f"{arch}.context_length")),
        ("embedding", get(f"{arch}.embedding_length")),
        ("layers", get(f"{arch}.block_count")),
        ("heads / kv heads", f"{get(f'{arch}.attention.head_count')} / {get(f'{arch}.attention.head_count_kv')}"),
        ("feed-forward", get(f"{arch}.feed_forward_length")),
        ("experts", f"{get(f'{arch}.expert_used_count')} of {get(f'{arch}.expert_count')} per token"
         if f"{arch}.expert_count" in md else "-"),
        ("rope base", get(f"{arch}.rope.freq_base")),
        ("sliding window", get(f"{arch}.attention.sliding_window")),
        ("tokenizer", f"{get('tokenizer.ggml.model')} (pre: {get('tokenizer.ggml.pre')})"),
        ("vocabulary", len(md.get("tokenizer.ggml.tokens", ()))),
        ("bos / eos ids", f"{get('tokenizer.ggml.bos_token_id')} / {get('tokenizer.ggml.eos_token_id')}"),
        ("chat template", f"yes ({len(template)} chars)" if isinstance(template, str) else "no (built-in format)"),
    ]
    return [f"  {k:<18} {v}" for k, v in rows if v not in ("-", "- / -")]


def support_lines() -> list[str]:
    """The architectures (with their aliases) and weight formats this edgellm runs, from the registries."""
    aliases = {name: sorted(a for a, target in ALIASES.items() if target == name) for name in ARCHITECTURES}
    archs = [name + (f" (also {', '.join(aliases[name])})" if aliases[name] else "") for name in sorted(ARCHITECTURES)]
    return ["supported architectures: " + ", ".join(archs),
            "supported weight formats: " + ", ".join(f.name for f in FORMATS)]


def describe(model=None, n_ctx: int | None = None, models_dir=None, kv_type=None) -> str:
    """The text `edgellm info` prints."""
    path = catalog.resolve(model, models_dir)
    with gguf_reader.open(path) as f:
        md, arch = f.metadata, f.architecture
        lines = [f"{os.path.basename(path)}  ({os.path.getsize(path) / MiB:.1f} MiB)  {path}", "", "metadata:"]
        lines += _metadata_lines(md, arch)

        by_type = defaultdict(lambda: [0, 0, 0])
        for t in f.tensors.values():
            row = by_type[t.ggml_type]
            row[0] += 1
            row[1] += t.n_elements
            row[2] += t.nbytes
        n_params = sum(r[1] for r in by_type.values())
        total = sum(r[2] for r in by_type.values())
        residency = weight_residency(f)
        active = f" ({_fmt_count(residency.active_params)} active per token)" \
            if residency.active_params != n_params else ""
        lines += ["", f"tensors: {len(f.tensors)}, {_fmt_count(n_params)} parameters{active}, {total / MiB:.1f} MiB",
                  f"  {'type':<8} {'tensors':>7} {'elements':>10} {'MiB':>9} {'share':>6} {'bits/weight':>11}"]
        for ggml_type, (count, elements, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
            lines.append(f"  {ggml_type:<8} {count:>7} {_fmt_count(elements):>10} {nbytes / MiB:>9.2f} "
                         f"{nbytes / total:>6.1%} {8 * nbytes / max(elements, 1):>11.2f}")

        plan = memory_plan(f, n_ctx, kv_type)
        lines += ["", f"memory plan at n_ctx = {plan.n_ctx}, kv_type {plan.kv_type}:",
                  f"  weights                  {plan.weights_bytes / MiB:9.1f} MiB  (memory-mapped from the file)"]
        if residency.resident_bytes != residency.total_bytes:
            lines.append(f"    read by every token    {residency.resident_bytes / MiB:9.1f} MiB  (shared tensors and "
                         "the experts' share a token uses; the rest is paged in as tokens pick experts)")
        for k in plan.layer_kinds:
            lines.append(f"  KV {k.name:<21} {k.total_bytes / MiB:9.1f} MiB  ({k.n_layers} layers x {k.slots} "
                         f"positions x {k.bytes_per_token_per_layer} bytes per position per layer)")
        lines.append(f"  total                    {plan.total_bytes / MiB:9.1f} MiB  (plus activations and logits)")
        lines += ["", "KV bytes per token per layer (K and V):"]
        kinds = list(next(iter(plan.per_type.values())))
        lines.append(f"  {'kv_type':<8}" + "".join(f"{name:>22}" for name in kinds) + f"{'whole model':>14}")
        counts = {k.name: k.n_layers for k in plan.layer_kinds}
        for t, row in plan.per_type.items():
            total = sum(row[name] * counts[name] for name in kinds if name == "full attention")
            lines.append(f"  {t:<8}" + "".join(f"{row[name]:>22,}" for name in kinds) + f"{total:>14,}")
        lines.append("  (whole model: one more token of context; sliding-window rings are fixed-size)")
        layer = threading_layer.chosen_layer()
        lines += ["", f"threading layer: {layer}" + ("" if layer == "omp" or not threading_layer.OPENMP_MISSING else
                                                     f" (OpenMP unavailable: {threading_layer.OPENMP_FIX})")]
        lines += [""] + support_lines()
        try:
            fit = fit_context(f, kv_type)
            lines += ["", "n_ctx=None (the default) would pick, with the memory available now:", "  " + fit.explain()]
        except EdgeLLMError as e:
            lines += ["", f"n_ctx=None would be refused: {e}"]
    return "\n".join(lines)

"""Session state: a snapshot of a model's KV cache and the tokens it holds, to restore later (llama-cpp-python's
save_state / load_state). An app computes a long system prompt once, saves, and restores it per conversation.

The snapshot copies only occupied cache slots, so it is as big as the context used (bytes per token: see
`edgellm info`), and it can be written to a .npz file (no pickle: loading a file never runs code).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from edgellm.atomic import atomic_write
from edgellm.errors import ModelError

_FORMAT = "edgellm-state-1"


@dataclass
class ModelState:
    model_name: str
    n_ctx: int
    tokens: list          # the token ids the cache holds, in order
    cache: dict           # KVCache.export_state()
    row_kinds: list | None = None  # how each cached row was computed (edgellm.engine.prefix); None: never reused

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.cache["layers"] for a in layer)

    def save(self, path) -> None:
        """Write to a .npz file."""
        arrays = {}
        for il, layer in enumerate(self.cache["layers"]):
            for name, a in zip(("slots", "pos", "k", "v", "k_scale", "v_scale"), layer):
                arrays[f"l{il}_{name}"] = a
        header = {"format": _FORMAT, "model_name": self.model_name, "n_ctx": self.n_ctx, "tokens": list(self.tokens),
                  "row_kinds": None if self.row_kinds is None else [int(k) for k in self.row_kinds],
                  **{k: self.cache[k] for k in ("n_past", "n_shifted", "kv_type")},
                  "capacities": list(self.cache["capacities"]), "n_layers": len(self.cache["layers"])}
        with atomic_write(path) as f:  # an interrupted save leaves the previous file, never a truncated one
            np.savez(f, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)

    @classmethod
    def load(cls, path) -> "ModelState":
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(bytes(z["header"]).decode())
                if header.get("format") != _FORMAT:
                    raise ModelError(f"{path} is not an edgellm state file (format {header.get('format')!r})")
                layers = [tuple(z[f"l{il}_{name}"] for name in ("slots", "pos", "k", "v", "k_scale", "v_scale"))
                          for il in range(int(header["n_layers"]))]
            cache = {k: header[k] for k in ("n_past", "n_shifted", "kv_type")}
            cache.update(capacities=tuple(header["capacities"]), layers=layers)
            tokens = header["tokens"]
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise ModelError(f"{path}: the state's tokens are not a list of integers")
            kinds = header.get("row_kinds")
            if kinds is not None and (not isinstance(kinds, list) or not all(type(k) is int for k in kinds)):
                raise ModelError(f"{path}: the state's row kinds are not a list of integers")
            return cls(str(header["model_name"]), int(header["n_ctx"]), tokens, cache, kinds)
        except (OSError, KeyError, ValueError, TypeError, AttributeError) as e:
            if isinstance(e, ModelError):
                raise
            raise ModelError(f"cannot read state file {path}: {type(e).__name__}: {e}") from e

"""A cache of KV-cache prefixes for many conversations: a returning conversation re-uses its prefix instead of
prefilling it again (llama.cpp's cache_prompt / slot save-restore, for any number of conversations).

Entries are KVCache.export_state() snapshots (only the occupied slots) with the tokens they hold and how each row
was computed (edgellm.engine.prefix), kept in RAM under a byte budget, least recently used first out, and looked
up by the longest common token prefix. Which part of a hit may be re-used bit for bit is still prefix.plan's
decision: the cache only proposes. A layout key (capacities and KV type) keeps a snapshot to caches it fits.

With a directory, every entry is also written there (atomically, as a state file of
edgellm.generation.state.ModelState), and files from earlier runs are indexed by their header at start. A file is
read whole only on a hit, and refused unless it fits the cache that asks, exactly: the model, layer count, slot
capacities, KV type, value shapes and dtypes, slot positions within n_past, as many tokens and row kinds as
positions, token ids in the vocabulary. A refused file is dropped from the index; nothing of it reaches a cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from edgellm.errors import ModelError
from edgellm.generation.state import ModelState

MIN_TOKENS = 16  # shorter prefixes cost less to prefill than to copy in and out
DEFAULT_DISK_BYTES = 8 << 30  # the directory's budget: oldest files removed beyond it


@dataclass
class CacheEntry:
    tokens: np.ndarray        # int32 [n]: what the snapshot's positions hold
    kinds: list               # how each row was computed (edgellm.engine.prefix)
    layout: tuple             # (kv_type, capacities) of the cache it came from
    state: dict | None        # KVCache.export_state(); None while only on disk
    nbytes: int
    path: str | None = None   # its file, with a directory


def _layout(cache) -> tuple:
    return cache.kv_type.name, tuple(int(c) for c in cache.capacities)


def _state_bytes(state: dict) -> int:
    return sum(a.nbytes for layer in state["layers"] for a in layer)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    if n == 0:
        return 0
    same = a[:n] == b[:n]
    return n if same.all() else int(np.argmin(same))


class PromptCache:
    """store(tokens, kinds, cache) after a conversation leaves a cache; lookup(ids, cache) when one arrives.
    Thread-safe (the server's scheduler and the Python API may share one)."""

    def __init__(self, ram_bytes: int, directory: str | None = None, model_name: str = "",
                 disk_bytes: int = DEFAULT_DISK_BYTES, n_vocab: int | None = None, log=None):
        if isinstance(ram_bytes, bool) or not isinstance(ram_bytes, int) or ram_bytes < 0:
            raise ValueError(f"the prompt cache's RAM budget must be a non-negative number of bytes, got {ram_bytes!r}")
        self.ram_bytes, self.disk_bytes = ram_bytes, disk_bytes
        self.directory, self.model_name, self.n_vocab = directory, model_name, n_vocab
        self.log = log or (lambda msg: print(f"edgellm: {msg}", file=sys.stderr))
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.hits = self.misses = self.refused = 0
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            self._index_directory()

    @property
    def ram_used(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.state is not None)

    def __len__(self) -> int:
        return len(self._entries)

    # -- store -------------------------------------------------------------------------------------------------
    def store(self, tokens, kinds, cache) -> bool:
        """Keep a snapshot of `cache`, which holds exactly `tokens` (unshifted); False where it is not kept."""
        n = len(tokens)
        if n < MIN_TOKENS or cache.n_shifted or cache.shift_log or cache.n_past != n or len(kinds) != n:
            return False
        ids = np.asarray(tokens, np.int32)
        key = self._key(ids)
        layout = _layout(cache)
        with self._lock:
            for k, e in self._entries.items():
                if e.layout == layout and e.tokens.size >= n and common_prefix(e.tokens, ids) == n:
                    self._entries.move_to_end(k)  # already held (or a longer conversation that contains it)
                    return True
        state = cache.export_state()
        nbytes = _state_bytes(state)
        if nbytes > self.ram_bytes:
            return False
        entry = CacheEntry(ids, [int(k) for k in kinds], layout, state, nbytes)
        with self._lock:
            for k in [k for k, e in self._entries.items()
                      if e.layout == layout and e.tokens.size < n and common_prefix(e.tokens, ids) == e.tokens.size]:
                self._remove(k)  # a prefix of this conversation: superseded
            self._entries[key] = entry
            self._evict_ram()
        if self.directory is not None:
            self._write(key, entry, cache.n_ctx)
        return True

    def _evict_ram(self) -> None:
        used = self.ram_used
        for k in list(self._entries):
            if used <= self.ram_bytes:
                break
            e = self._entries[k]
            if e.state is None:
                continue
            used -= e.nbytes
            if e.path is not None:
                e.state = None  # still on disk: read back on a hit
            else:
                del self._entries[k]

    def _remove(self, key) -> None:
        e = self._entries.pop(key)
        if e.path is not None:
            try:
                os.unlink(e.path)
            except OSError:
                pass

    # -- lookup ------------------------------------------------------------------------------------------------
    def lookup(self, ids, cache):
        """The entry sharing the longest token prefix with ids among those that fit `cache` (a CacheEntry with its
        state loaded), or None."""
        ids = np.asarray(ids, np.int32)
        layout = _layout(cache)
        with self._lock:
            best, best_n = None, 0
            for k, e in self._entries.items():
                if e.layout == layout:
                    n = common_prefix(e.tokens, ids)
                    if n > best_n:
                        best, best_n = k, n
            if best is None or best_n < MIN_TOKENS:
                self.misses += 1
                return None
            entry = self._entries[best]
            self._entries.move_to_end(best)
        if entry.state is None:
            try:
                self._read(entry, cache)
            except ModelError as e:
                self.log(f"prompt cache: refused {entry.path}: {e}")
                with self._lock:
                    self.refused += 1
                    if best in self._entries:
                        self._remove(best)
                    self.misses += 1
                return None
            with self._lock:
                self._evict_ram()
        with self._lock:
            self.hits += 1
            # a copy: another thread's eviction may drop the entry's state while the caller imports it
            return CacheEntry(entry.tokens, list(entry.kinds), entry.layout, entry.state, entry.nbytes, entry.path)

    # -- the directory -----------------------------------------------------------------------------------------
    def _key(self, ids: np.ndarray) -> str:
        h = hashlib.sha256(self.model_name.encode() + b"\0" + ids.tobytes()).hexdigest()[:32]
        return h

    def _write(self, key: str, entry: CacheEntry, n_ctx: int) -> None:
        path = os.path.join(self.directory, f"{key}.npz")
        try:
            ModelState(self.model_name, n_ctx, entry.tokens.tolist(), entry.state, entry.kinds).save(path)
        except OSError as e:
            self.log(f"prompt cache: cannot write {path}: {e}")
            return
        entry.path = path
        self._trim_directory()

    def _trim_directory(self) -> None:
        files = []
        for name in os.listdir(self.directory):
            if name.endswith(".npz"):
                p = os.path.join(self.directory, name)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                files.append((st.st_mtime, st.st_size, p))
        total = sum(f[1] for f in files)
        for _, size, p in sorted(files):
            if total <= self.disk_bytes:
                break
            total -= size
            with self._lock:
                for k in [k for k, e in self._entries.items() if e.path == p]:
                    if self._entries[k].state is None:
                        del self._entries[k]
                    else:
                        self._entries[k].path = None
            try:
                os.unlink(p)
            except OSError:
                pass

    def _index_directory(self) -> None:
        """Index the directory's files by their headers (their arrays are read on a hit)."""
        for name in sorted(os.listdir(self.directory)):
            if not name.endswith(".npz"):
                continue
            path = os.path.join(self.directory, name)
            try:
                with np.load(path, allow_pickle=False) as z:
                    header = json.loads(bytes(z["header"]).decode())
                tokens = header["tokens"]
                if header.get("model_name") != self.model_name or not isinstance(tokens, list) or \
                        not all(type(t) is int for t in tokens):
                    continue
                layout = (str(header["kv_type"]), tuple(int(c) for c in header["capacities"]))
                nbytes = os.path.getsize(path)
            except Exception as e:  # (a damaged zip raises zipfile's own errors) nothing of it is kept
                self.log(f"prompt cache: skipped {path}: {type(e).__name__}: {e}")
                continue
            ids = np.asarray(tokens, np.int32)
            self._entries[name[:-4]] = CacheEntry(ids, [], layout, None, nbytes, path)

    def _read(self, entry: CacheEntry, cache) -> None:
        """Load an indexed file's state, all checked against `cache` before anything is kept (ModelError if not)."""
        try:
            state = ModelState.load(entry.path)
        except ModelError:
            raise
        except Exception as e:  # a damaged zip raises zipfile's own errors
            raise ModelError(f"cannot read {entry.path}: {type(e).__name__}: {e}") from e
        n = len(state.tokens)
        if state.model_name != self.model_name:
            raise ModelError(f"saved from {state.model_name!r}, not {self.model_name!r}")
        if state.n_ctx != cache.n_ctx:
            raise ModelError(f"saved with a context of {state.n_ctx}, this cache has {cache.n_ctx}")
        cache.check_state(state.cache)  # layer count, capacities, KV type, shapes, dtypes, slots and positions
        if state.cache["n_past"] != n or state.cache["n_shifted"] != 0:
            raise ModelError(f"{n} tokens for {state.cache['n_past']} positions "
                             f"({state.cache['n_shifted']} shifted)")
        if state.row_kinds is None or len(state.row_kinds) != n:
            raise ModelError("the row kinds do not match the tokens")
        if n and self.n_vocab is not None and not all(0 <= t < self.n_vocab for t in state.tokens):
            raise ModelError(f"a token id lies outside the vocabulary [0, {self.n_vocab})")
        if not np.array_equal(np.asarray(state.tokens, np.int32), entry.tokens):
            raise ModelError("the file changed since it was indexed")
        for il, (layer, kv) in enumerate(zip(state.cache["layers"], cache.layers)):
            # the positions the next query attends to, all present: [0, n) in a full layer, the window's in a ring
            pos = np.sort(layer[1].astype(np.int64))
            first = max(0, n - kv.window + 1) if kv.window else 0
            if pos.size < n - first or not np.array_equal(pos[pos.size - (n - first):], np.arange(first, n)):
                raise ModelError(f"layer {il} does not hold positions [{first}, {n})")
        entry.kinds = list(state.row_kinds)
        entry.state = state.cache
        entry.nbytes = _state_bytes(state.cache)

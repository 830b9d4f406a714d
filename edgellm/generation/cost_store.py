"""Speculation's forward costs (speculative.ForwardCosts) kept between processes, so that a process's first
generation drafts with what earlier processes measured instead of trying every size of verification again (a
128-token generation spends much of its gain doing that: docs/speculative.md).

One small JSON file per model file, drafter, thread count, KV cache type, CPU (and Numba's pinned target) and
source version, under the user cache (~/.cache/edgellm/speculation). EDGELLM_SPEC_COSTS set to a directory keeps
them there instead, and "off" keeps none. A table is a hint: one that cannot be read, or holds no valid table, is ignored and replaced at the
next save, and a save that fails is dropped, so a generation never fails for it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from pathlib import Path

from edgellm.atomic import atomic_write
from edgellm.jitcache import source_hash, user_cache

ENV = "EDGELLM_SPEC_COSTS"
MAX_FILE_BYTES = 1 << 16  # a saved table is a few hundred bytes
PRUNE_AFTER_S = 30 * 24 * 3600  # tables unused this long (other source versions, files gone) are removed


def store_dir() -> Path | None:
    """Where tables are kept; None when EDGELLM_SPEC_COSTS is "off"."""
    setting = os.environ.get(ENV, "")
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting)
    return user_cache() / "speculation"


@functools.lru_cache(maxsize=1)
def _host() -> str:
    """The CPU model (what the costs depend on besides the code), or the architecture where none is named."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Hardware", "CPU part")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


@functools.lru_cache(maxsize=1)
def _source() -> str:
    return source_hash()  # the kernels' version: new code, new costs


def _file_id(path: str) -> list:
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def table_path(model_path: str, mode: str, draft_path: str | None, n_threads: int, kv_type: str) -> Path | None:
    """The file for this model, drafter and set-up; None where tables are not kept or the files cannot be
    identified (a model built from parts, a file gone)."""
    directory = store_dir()
    if directory is None:
        return None
    try:
        ident = [_file_id(model_path), mode, _file_id(draft_path) if draft_path else None, int(n_threads),
                 str(kv_type), _host(), os.cpu_count(), _source(),
                 # a Numba pinned to another CPU compiles other kernels (e.g. AVX2 ones on an AVX-512 host)
                 os.environ.get("NUMBA_CPU_NAME", ""), os.environ.get("NUMBA_CPU_FEATURES", "")]
    except OSError:
        return None
    digest = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:24]
    return directory / f"{Path(model_path).stem[:64]}-{mode}-{digest}.json"


def load(costs, path: Path | None) -> bool:
    """Start `costs` from the table at `path` (ForwardCosts.load); False, and `costs` untouched, when there is no
    valid one."""
    if path is None:
        return False
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            return False
        costs.load(json.loads(raw))
    except (OSError, ValueError):  # (json's decode errors are ValueErrors)
        return False
    return True


def save(costs, path: Path | None) -> bool:
    """Write `costs` (ForwardCosts.saved) to `path`, whole or not at all; False when it could not be."""
    if path is None:
        return False
    try:
        if not path.exists():  # a new table: every upgrade or edit of the source starts new ones
            _prune(path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "w") as f:
            json.dump(costs.saved(), f)
    except OSError:
        return False
    return True


def _prune(directory: Path) -> None:
    now = time.time()
    try:
        for p in directory.glob("*.json"):
            if now - p.stat().st_mtime > PRUNE_AFTER_S:
                p.unlink()
    except OSError:
        pass

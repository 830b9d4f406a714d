"""GGUF models from the Hugging Face Hub, through the official `huggingface_hub` client.

The client brings what a download needs and edgellm does not rewrite: HF_TOKEN and saved logins, HF_ENDPOINT
mirrors, HF_HOME / HF_HUB_CACHE and its cache layout (shared with every other Hub tool), HF_HUB_OFFLINE, retries
that resume a dropped transfer with a Range request, and progress bars. edgellm adds the choice of file, the memory
check before a download starts, a sha256 check of what arrived (the client checks only the size of a plain HTTP
download) and clear errors.

Sections: names (org/repo, org/repo:QUANT, org/repo/path/file.gguf); listing a repository's GGUF files (the Hub,
else the cache); choosing one as llama.cpp's -hf does; the memory check before a download (file sizes and the
header, read with a ranged request); pull; the cache (list, remove).
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from edgellm.engine import gguf, validate
from edgellm.errors import CatalogError, EdgeLLMError, GGUFError


class HubError(CatalogError):
    """A Hugging Face Hub model cannot be found, reached, authorised or verified."""


# ---------------------------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------------------------

_PREFIXES = ("hf://", "https://huggingface.co/", "huggingface.co/", "hf.co/")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's choice when a repository is named without a tag
# Files beside a model that are not a model to run (llama.cpp's gguf_filename_is_model)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    quant: str | None = None      # org/repo:QUANT
    filename: str | None = None   # org/repo/path/in/repo.gguf, or a glob pattern (from_pretrained)
    revision: str = "main"

    def __str__(self):
        tail = f":{self.quant}" if self.quant else (f"/{self.filename}" if self.filename else "")
        return self.repo_id + tail


def parse_ref(name: str) -> HubRef | None:
    """The Hub reference a model name spells, or None when it is not one (a catalog name or a path)."""
    if not isinstance(name, str):
        return None
    s = name.strip()
    for p in _PREFIXES:
        if s.startswith(p):
            s = s[len(p):]
            break
    parts = s.split("/")
    if len(parts) < 2 or not all(parts) or not _NAME.match(parts[0]):
        return None
    if len(parts) == 2:
        repo, _, tag = parts[1].partition(":")
        if not _NAME.match(repo) or repo.lower().endswith(".gguf") or (tag and not _TAG.match(tag)):
            return None
        return HubRef(f"{parts[0]}/{repo}", quant=tag or None)
    if not _NAME.match(parts[1]) or not parts[-1].lower().endswith(".gguf") or ".." in parts:
        return None
    return HubRef(f"{parts[0]}/{parts[1]}", filename="/".join(parts[2:]))


# ---------------------------------------------------------------------------------------------------------------
# A repository's GGUF files
# ---------------------------------------------------------------------------------------------------------------

_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})$", re.IGNORECASE)
_QUANT_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


@dataclass(frozen=True)
class HubFile:
    path: str                  # inside the repository
    size: int | None
    sha256: str | None = None  # the LFS object id, when the Hub gives it

    @property
    def split(self) -> tuple[str, int, int]:
        """(prefix, part number from 1, part count) as llama.cpp reads the name; (stem, 1, 1) for a single file."""
        stem = self.path[:-5] if self.path.lower().endswith(".gguf") else self.path
        m = _SPLIT.match(stem)
        return (m["prefix"], int(m["no"]), int(m["count"])) if m else (stem, 1, 1)

    @property
    def quant(self) -> str:
        """The quant tag at the end of the name (Q4_K_M, F16 ...), upper case; '' when there is none."""
        m = _QUANT_TAG.search(self.split[0])
        return m[1].upper() if m else ""

    @property
    def is_model(self) -> bool:
        base = self.path.rsplit("/", 1)[-1]
        return base.lower().endswith(".gguf") and not any(k in base for k in _NOT_MODELS)


@dataclass(frozen=True)
class RepoListing:
    repo_id: str
    revision: str
    commit: str | None
    files: tuple          # every GGUF file, sorted by path
    source: str           # "hub" or "cache" (offline, or the Hub unreachable)
    cache_dir: str | None = None

    def models(self) -> list[tuple[HubFile, ...]]:
        """The runnable models: each a tuple of its files (a split model's parts in order)."""
        groups: dict[tuple, list[HubFile]] = {}
        for f in self.files:
            if f.is_model:
                prefix, _, count = f.split
                groups.setdefault((prefix, count) if count > 1 else (f.path, 1), []).append(f)
        return [tuple(sorted(g, key=lambda f: f.split[1])) for g in groups.values()]


def _hf():
    try:
        import huggingface_hub  # loaded by the first Hub request, not with the catalog
    except ImportError:  # a dependency; only a broken install lacks it
        raise HubError("Hugging Face Hub models need the huggingface_hub package: pip install huggingface_hub") from None
    return huggingface_hub


def _has_token() -> bool:
    try:
        return bool(_hf().get_token())
    except Exception:  # no token store is the same as no token here
        return False


def _hub_error(e: Exception, repo_id: str, what: str = "") -> HubError:
    """One clear sentence for the client's exceptions (their classes moved across huggingface_hub versions)."""
    from huggingface_hub import errors as hf_errors  # loaded by the first Hub request
    where = f"{repo_id}{'/' + what if what else ''}"
    status = getattr(getattr(e, "response", None), "status_code", None)
    token_hint = ("the Hub refused the token HF_TOKEN (or the saved login) holds: accept the repository's terms on "
                  "its Hub page with that account" if _has_token() else
                  "it needs a Hugging Face token: accept its terms on its Hub page, then set HF_TOKEN "
                  "(or run `hf auth login`)")
    if isinstance(e, hf_errors.GatedRepoError):
        return HubError(f"{where}: this repository is gated (HTTP {status}); {token_hint}")
    if isinstance(e, hf_errors.RepositoryNotFoundError):
        return HubError(f"{repo_id}: no such model repository on the Hub, or it is private or gated "
                        f"(HTTP {status}); if it exists, {token_hint}")
    if status in (401, 403):
        return HubError(f"{where}: access refused (HTTP {status}); {token_hint}")
    if isinstance(e, hf_errors.RevisionNotFoundError):
        return HubError(f"{repo_id}: no such revision on the Hub")
    entry_missing = tuple(getattr(hf_errors, n) for n in ("RemoteEntryNotFoundError", "EntryNotFoundError")
                          if hasattr(hf_errors, n))
    if isinstance(e, entry_missing) and not isinstance(e, hf_errors.LocalEntryNotFoundError):
        return HubError(f"{where}: no such file in the repository")
    if isinstance(e, (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled)):
        return HubError(f"{where} is not in the Hugging Face cache and the Hub cannot be reached"
                        f"{' (HF_HUB_OFFLINE is set)' if _offline() else ''}")
    return HubError(f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def _offline() -> bool:
    c = _hf().constants
    return bool(c.is_offline_mode() if hasattr(c, "is_offline_mode") else getattr(c, "HF_HUB_OFFLINE", False))


def list_files(repo_id: str, revision: str = "main", cache_dir: str | None = None) -> RepoListing:
    """The repository's GGUF files from the Hub; offline (HF_HUB_OFFLINE) or when the Hub cannot be reached, the
    files of it that the cache holds, as llama.cpp falls back to its cache."""
    hf = _hf()
    from huggingface_hub import errors as hf_errors  # loaded by the first Hub request
    reach_error = None
    if not _offline():
        try:
            info = hf.HfApi().model_info(repo_id, revision=revision, files_metadata=True)
        except hf_errors.HfHubHTTPError as e:
            status = getattr(getattr(e, "response", None), "status_code", None)
            if status is None or status < 500:
                raise _hub_error(e, repo_id) from None
            reach_error = e  # the Hub is down: the cache may still serve
        except hf_errors.OfflineModeIsEnabled as e:
            reach_error = e
        except Exception as e:  # the transport's own errors (connection refused, DNS, timeout) differ by version
            reach_error = e
        else:
            files = tuple(sorted(
                (HubFile(s.rfilename, s.lfs.size if s.lfs else s.size, s.lfs.sha256 if s.lfs else None)
                 for s in info.siblings or () if s.rfilename.lower().endswith(".gguf")), key=lambda f: f.path))
            return RepoListing(repo_id, revision, info.sha, files, "hub", cache_dir)
    cached = _cached_listing(repo_id, revision, cache_dir)
    if cached is None:
        why = "HF_HUB_OFFLINE is set" if reach_error is None or _offline() else f"the Hub cannot be reached ({reach_error})"
        raise HubError(f"{repo_id}: {why}, and the Hugging Face cache holds nothing of this repository")
    return cached


def _cached_listing(repo_id: str, revision: str, cache_dir: str | None) -> RepoListing | None:
    repo = _cached_repo(repo_id, cache_dir)
    if repo is None:
        return None
    revs = list(repo.revisions)
    chosen = [r for r in revs if revision in r.refs or r.commit_hash == revision]
    if not chosen and revision == "main":
        chosen = sorted(revs, key=lambda r: r.last_modified, reverse=True)[:1]
    if not chosen:
        return None
    rev = chosen[0]
    files = tuple(sorted(
        (HubFile(str(f.file_path.relative_to(rev.snapshot_path).as_posix()), f.size_on_disk)
         for f in rev.files if f.file_name.lower().endswith(".gguf")), key=lambda f: f.path))
    return RepoListing(repo_id, revision, rev.commit_hash, files, "cache", cache_dir)


def _scan(cache_dir: str | None):
    # scan_cache_dir's own default is the cache path at import; downloads use the one at call time
    hf = _hf()
    return hf.scan_cache_dir(cache_dir or hf.constants.HF_HUB_CACHE)


def _cached_repo(repo_id: str, cache_dir: str | None):
    try:
        info = _scan(cache_dir)
    except Exception:  # CacheNotFound (no cache yet) or an unreadable one: nothing cached
        return None
    for repo in info.repos:
        if repo.repo_type == "model" and repo.repo_id == repo_id:
            return repo
    return None


# ---------------------------------------------------------------------------------------------------------------
# Choosing the model's files (llama.cpp's common_download_get_hf_plan / find_best_model)
# ---------------------------------------------------------------------------------------------------------------

def _describe(listing: RepoListing) -> str:
    models = listing.models()
    if not models:
        return "it holds no GGUF model file"
    return "available: " + ", ".join(m[0].path + (f" ({len(m)} parts)" if len(m) > 1 else "") for m in models)


def _group_of(listing: RepoListing, f: HubFile) -> tuple[HubFile, ...]:
    prefix, _, count = f.split
    if count == 1:
        return (f,)
    for group in listing.models():
        if group[0].split[0] == prefix and group[0].split[2] == count:
            return group
    return (f,)


def choose(listing: RepoListing, quant: str | None = None, filename: str | None = None) -> tuple[HubFile, ...]:
    """The files of one model: by exact path (case-insensitive) or glob pattern; else by quant tag (the tag then
    '.' or '-' in the path, case-insensitive, first part of a split model); else Q4_K_M, then Q8_0, then the
    first model file, as llama.cpp's -hf picks."""
    if filename is not None:
        exact = [f for f in listing.files if f.path.lower() == filename.lower()]
        matches = exact or [f for f in listing.files if fnmatch.fnmatchcase(f.path, filename)
                            or fnmatch.fnmatchcase(f.path.rsplit("/", 1)[-1], filename)]
        groups = {_group_of(listing, f) for f in matches}
        if not groups:
            raise HubError(f"{listing.repo_id}: no GGUF file matches {filename!r}; {_describe(listing)}")
        if len(groups) > 1:
            names = ", ".join(sorted(g[0].path for g in groups))
            raise HubError(f"{listing.repo_id}: {filename!r} matches {len(groups)} models ({names}); name one")
        return _complete(listing, groups.pop())
    for tag in ([quant] if quant else DEFAULT_QUANTS):
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        for f in listing.files:
            if f.is_model and pattern.search(f.path) and (f.split[2] == 1 or f.split[1] == 1):
                return _complete(listing, _group_of(listing, f))
    if quant:
        quants = sorted({m[0].quant for m in listing.models() if m[0].quant})
        raise HubError(f"{listing.repo_id}: no GGUF file with quant type {quant!r}"
                       f" (the repository has {', '.join(quants) if quants else 'no tagged files'}; {_describe(listing)})")
    models = listing.models()
    if not models:
        raise HubError(f"{listing.repo_id}: {_describe(listing)}")
    return _complete(listing, models[0])


def _complete(listing: RepoListing, group: tuple[HubFile, ...]) -> tuple[HubFile, ...]:
    count = group[0].split[2]
    if count > 1 and [f.split[1] for f in group] != list(range(1, count + 1)):
        have = ", ".join(f.path for f in group)
        where = "the Hub" if listing.source == "hub" else "the cache"
        raise HubError(f"{listing.repo_id}: split model {group[0].split[0]} has {count} parts, but {where} holds "
                       f"only {len(group)} ({have})")
    return group


# ---------------------------------------------------------------------------------------------------------------
# The memory check before a download: sizes, and the header read with ranged requests
# ---------------------------------------------------------------------------------------------------------------

HEADER_FIRST_READ = 1 << 20   # most headers fit; a 262k-token vocabulary takes ~5 MiB
HEADER_MAX_READ = 64 << 20    # past this the check uses the file sizes alone


def _read_range(repo_id: str, filename: str, revision: str, start: int, end: int) -> bytes | None:
    """Bytes [start, end) of a file on the Hub, or None when the server does not honour the Range."""
    hf = _hf()
    # loaded by the first Hub request, not with the catalog
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff
    url = hf.hf_hub_url(repo_id, filename, revision=revision)
    headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    with http_stream_backoff("GET", url, headers=headers) as r:
        if r.status_code >= 400:
            r.read()  # the error's body, for the client's error message
        hf_raise_for_status(r)
        if r.status_code != 206:
            return None  # a whole-file answer: do not read it into memory
        return r.read()


def remote_header(repo_id: str, f: HubFile, revision: str):
    """The GGUF header of a file on the Hub (gguf.GGUFHeader), from as few leading bytes as it takes."""
    if not f.size:
        return None
    data, want = b"", min(HEADER_FIRST_READ, f.size)
    while True:
        more = _read_range(repo_id, f.path, revision, len(data), want)
        if more is None:
            return None
        data += more
        try:
            return gguf.read_header(data, f.size, f"{repo_id}/{f.path}")
        except gguf.HeaderIncomplete as e:
            want = min(f.size, max(e.needed, 2 * len(data)))
            if want > HEADER_MAX_READ or len(more) == 0:
                return None


def check_fits(listing: RepoListing, files: tuple[HubFile, ...], n_ctx: int | None = None,
               kv_type: str | None = None) -> None:
    """Before a download: MemoryBudgetError if the model cannot run here, ModelError if edgellm cannot run its
    architecture. Reads the header (and each split part's tensor table) from the Hub; on files whose header is
    not at hand, the file sizes alone."""
    what = f"{listing.repo_id}/{files[0].path}"
    header = None
    try:
        for f in files:
            h = remote_header(listing.repo_id, f, listing.commit or listing.revision)
            if h is None:
                header = None
                break
            if header is None:
                header = h
            else:
                header.add_part(h)
    except (GGUFError, EdgeLLMError):
        raise
    except Exception as e:  # the header is a refinement; sizes still say whether the weights alone fit
        if getattr(getattr(e, "response", None), "status_code", None) in (401, 403):
            raise _hub_error(e, listing.repo_id, files[0].path) from None
        header = None
    if header is None:
        validate.check_memory(sum(f.size or 0 for f in files), 0, what=what)
        return
    if n_ctx is None:
        validate.fit_context(header, kv_type)
    else:
        weights, kv = validate.model_memory_needs(header, n_ctx, kv_type=kv_type)
        validate.check_memory(weights, kv, what=what)


# ---------------------------------------------------------------------------------------------------------------
# Pull
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    listing: RepoListing
    files: tuple          # HubFile of the chosen model, first part first
    cached: tuple         # per file: its path in the cache, or None when it would be downloaded

    @property
    def download_bytes(self) -> int:
        return sum(f.size or 0 for f, c in zip(self.files, self.cached) if c is None)

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


def plan(ref: HubRef | str, cache_dir: str | None = None) -> Plan:
    """What pulling `ref` involves: its files and which of them the cache already holds. Downloads nothing."""
    ref = _as_ref(ref)
    listing = list_files(ref.repo_id, ref.revision, cache_dir)
    files = choose(listing, ref.quant, ref.filename)
    cached = tuple(_cached_path(listing, f) for f in files)
    if listing.source == "cache" and any(c is None for c in cached):
        raise HubError(f"{ref}: not all of it is in the Hugging Face cache, and the Hub cannot be reached")
    return Plan(listing, files, cached)


def _as_ref(ref) -> HubRef:
    if isinstance(ref, HubRef):
        return ref
    parsed = parse_ref(ref)
    if parsed is None:
        raise HubError(f"{ref!r} is not a Hub model name (org/repo, org/repo:QUANT or org/repo/file.gguf)")
    return parsed


def _cached_path(listing: RepoListing, f: HubFile) -> str | None:
    hf = _hf()
    if listing.commit is None:
        return None
    p = hf.try_to_load_from_cache(listing.repo_id, f.path, cache_dir=listing.cache_dir, revision=listing.commit)
    return p if isinstance(p, str) and os.path.isfile(p) else None


def pull(ref: HubRef | str, cache_dir: str | None = None, check_memory: bool = True, n_ctx: int | None = None,
         kv_type: str | None = None, quiet: bool = False) -> Path:
    """Make sure the model `ref` names is in the Hugging Face cache, downloading what is missing (after the
    memory check, unless check_memory=False); return the path of its file (a split model's first part, beside
    the others)."""
    p = plan(ref, cache_dir)
    missing = [f for f, c in zip(p.files, p.cached) if c is None]
    if missing and check_memory:
        check_fits(p.listing, p.files, n_ctx, kv_type)
    if missing and not quiet:
        print(f"edgellm: downloading {p.listing.repo_id}: {len(missing)} file(s), {p.download_bytes / 1e6:,.1f} MB",
              file=sys.stderr, flush=True)
    paths = [c if c is not None else _download(p.listing, f) for f, c in zip(p.files, p.cached)]
    return Path(paths[0])


def _download(listing: RepoListing, f: HubFile) -> str:
    hf = _hf()
    try:
        path = hf.hf_hub_download(listing.repo_id, f.path, revision=listing.revision, cache_dir=listing.cache_dir)
    except Exception as e:
        from huggingface_hub import errors as hf_errors  # loaded by the first Hub request
        if isinstance(e, (hf_errors.HfHubHTTPError, hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled)):
            raise _hub_error(e, listing.repo_id, f.path) from None
        raise HubError(f"{listing.repo_id}/{f.path}: download failed: {e}") from None
    if f.sha256:
        _verify(path, f, listing.repo_id)
    return path


def _verify(path: str, f: HubFile, repo_id: str) -> None:
    """The client checks a plain HTTP download's size only: check the sha256 the Hub lists, and on a mismatch
    remove the file so that no corrupt copy stays in the cache."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    if h.hexdigest() == f.sha256.lower():
        return
    blob = os.path.realpath(path)
    for p in {path, blob}:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    raise HubError(f"{repo_id}/{f.path}: checksum mismatch after download (sha256 {h.hexdigest()}, the Hub lists "
                   f"{f.sha256}); the file was removed from the cache, pull again")


def pull_pretrained(repo_id: str, filename: str | None = None, revision: str = "main",
                    cache_dir: str | None = None, **fit) -> Path:
    """llama-cpp-python's from_pretrained shape: filename a path in the repository or a glob pattern; None picks
    as `org/repo` does."""
    if not isinstance(repo_id, str) or parse_ref(repo_id) is None or parse_ref(repo_id).filename:
        raise HubError(f"repo_id must be 'org/repo', got {repo_id!r}")
    base = parse_ref(repo_id)
    ref = HubRef(base.repo_id, quant=base.quant, filename=filename, revision=revision)
    return pull(ref, cache_dir=cache_dir, **fit)


# ---------------------------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CachedModel:
    name: str             # org/repo/path.gguf (the first part of a split model)
    size: int             # bytes on disk, all parts
    parts: int
    path: str


def cached_models(cache_dir: str | None = None) -> list[CachedModel]:
    """GGUF models in the Hugging Face cache (every cached revision's files, newest first per name)."""
    try:
        info = _scan(cache_dir)
    except Exception:  # no cache directory yet
        return []
    out, seen = [], set()
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            files = tuple(HubFile(f.file_path.relative_to(rev.snapshot_path).as_posix(), f.size_on_disk)
                          for f in rev.files if f.file_name.lower().endswith(".gguf"))
            listing = RepoListing(repo.repo_id, "", rev.commit_hash, tuple(sorted(files, key=lambda f: f.path)), "cache")
            for group in listing.models():
                name = f"{repo.repo_id}/{group[0].path}"
                if name in seen:
                    continue
                seen.add(name)
                out.append(CachedModel(name, sum(f.size or 0 for f in group), len(group),
                                       str(rev.snapshot_path / group[0].path)))
    return out


def remove(name: str, cache_dir: str | None = None) -> list[str]:
    """Remove from the cache a whole repository (org/repo) or one model of it (org/repo:QUANT, org/repo/file.gguf,
    a split model's every part). Returns the removed files' names; [] when nothing matched."""
    ref = _as_ref(name)
    repo = _cached_repo(ref.repo_id, cache_dir)
    if repo is None:
        return []
    if ref.quant is None and ref.filename is None:
        hashes = [r.commit_hash for r in repo.revisions]
        names = sorted({f.file_path.relative_to(r.snapshot_path).as_posix() for r in repo.revisions for f in r.files})
        _scan(cache_dir).delete_revisions(*hashes).execute()
        return [f"{ref.repo_id}/{n}" for n in names]
    removed = []
    blob_users: dict[str, int] = {}
    for r in repo.revisions:
        for f in r.files:
            blob_users[str(f.blob_path)] = blob_users.get(str(f.blob_path), 0) + 1
    for r in repo.revisions:
        listing = _cached_listing(ref.repo_id, r.commit_hash, cache_dir)
        try:
            group = choose(listing, ref.quant, ref.filename)
        except HubError:
            continue
        for f in group:
            pointer = r.snapshot_path / f.path
            blob = os.path.realpath(pointer)
            if pointer.is_symlink() or pointer.exists():
                pointer.unlink()
                removed.append(f"{ref.repo_id}/{f.path}")
            blob_users[blob] = blob_users.get(blob, 1) - 1
            if blob_users[blob] <= 0 and os.path.exists(blob) and blob != str(pointer):
                os.unlink(blob)
    left = _cached_repo(ref.repo_id, cache_dir)
    if removed and left is not None and not any(r.files for r in left.revisions):
        _scan(cache_dir).delete_revisions(*(r.commit_hash for r in left.revisions)).execute()
    return removed


__all__ = ["HubError", "HubRef", "HubFile", "RepoListing", "Plan", "CachedModel", "parse_ref", "list_files",
           "choose", "plan", "pull", "pull_pretrained", "check_fits", "remote_header",
           "cached_models", "remove"]

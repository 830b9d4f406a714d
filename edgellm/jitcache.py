"""Where Numba keeps compiled kernels: a directory per version of edgellm's source.

Numba's own cache is keyed by each function's source file, so a change in a helper that a kernel inlines from
another file leaves the kernel's cache stale; and it writes next to the package, which fails where the package
directory is read-only. Keying one user-cache directory by a hash of all of edgellm's source, edgellm.quant's
included (plus the Numba and Python versions) fixes both. Set NUMBA_CACHE_DIR yourself to override. Only edgellm's
own functions are routed there; a HOME that cannot be written falls back to the temporary directory with a warning.
"""
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

def _source_dirs() -> dict:
    """Package name -> directory of edgellm's sources: edgellm.quant lies inside edgellm when installed, and in
    the repository's quant/ (a package-dir mapping) in an editable install. Found without importing it."""
    dirs = {"edgellm": Path(__file__).resolve().parent}
    spec = importlib.util.find_spec("edgellm.quant")
    if spec is not None and spec.origin:  # None only where edgellm is imported from a tree that was not installed
        dirs["edgellm.quant"] = Path(spec.origin).resolve().parent
    return dirs


_DIRS = _source_dirs()


def source_hash() -> str:
    h = hashlib.sha256()
    seen = set()
    for pkg, d in _DIRS.items():
        for path in sorted(d.rglob("*.py")):
            if path in seen:  # edgellm.quant's files, inside edgellm's directory when installed
                continue
            seen.add(path)
            h.update(f"{pkg}/{path.relative_to(d)}".encode())
            h.update(path.read_bytes())
    # The installed Numba, identified without importing it (that costs a quarter of a second).
    spec = importlib.util.find_spec("numba")
    if spec is not None and spec.origin:
        st = os.stat(spec.origin)
        h.update(f"{spec.origin}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def user_cache() -> Path:
    """edgellm's directory in the user cache: $XDG_CACHE_HOME/edgellm, else ~/.cache/edgellm."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgellm"


def cache_root() -> Path:
    return user_cache() / "numba"


PRUNE_AFTER_S = 14 * 24 * 3600  # other source versions' caches unused this long are removed


def _writable(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".probe-"):
            pass
        return True
    except OSError:
        return False


def _prune(root: Path, keep: Path) -> None:
    # one directory per source version accumulates with every upgrade or edit; drop the long-unused ones
    now = time.time()
    try:
        siblings = [p for p in root.iterdir() if p.is_dir() and p != keep]
    except OSError:
        return
    for p in siblings:
        try:
            if now - p.stat().st_mtime > PRUNE_AFTER_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def choose_cache_dir() -> Path | None:
    """This source version's directory under the user cache, or, where that cannot be written (a read-only or
    missing HOME), one under the temporary directory, with a warning; None (no caching) where neither can be."""
    h = source_hash()
    preferred = cache_root() / h
    if _writable(preferred):
        os.utime(preferred)  # marks it in use for pruning
        _prune(preferred.parent, preferred)
        return preferred
    try:
        temp = Path(tempfile.gettempdir())
    except OSError:  # gettempdir raises when none of its candidates can be written
        temp = None
    fallback = temp / f"edgellm-numba-{os.getuid() if hasattr(os, 'getuid') else 'user'}" / h if temp else None
    if fallback is not None and _writable(fallback):
        warnings.warn(f"edgellm: cannot write the kernel cache at {preferred}; using {fallback} (set "
                      "XDG_CACHE_HOME or NUMBA_CACHE_DIR to a writable directory to keep compiled kernels)",
                      RuntimeWarning, stacklevel=3)
        return fallback
    warnings.warn(f"edgellm: neither {preferred} nor a temporary directory can be written: kernels will be compiled again in "
                  "every process (set NUMBA_CACHE_DIR to a writable directory to keep them)",
                  RuntimeWarning, stacklevel=3)
    return None


def _owns(py_file: str) -> bool:
    try:
        path = Path(py_file).resolve()
    except OSError:
        return False
    return any(path.is_relative_to(d) for d in _DIRS.values())


_configured = None
UNCACHED = "(uncached: no writable directory)"


def configure() -> str:
    """Cache edgellm's kernels (edgellm.quant's included) in this source version's directory. Only their functions
    are sent there (a Numba cache locator of their own): other Numba users in the process keep their cache locations.
    NUMBA_CACHE_DIR, when set, is honoured as Numba itself would. Returns the directory."""
    global _configured
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    if _configured is not None:
        return _configured
    chosen = choose_cache_dir()
    _configured = str(chosen) if chosen is not None else UNCACHED
    from numba.core import caching  # only when edgellm routes the cache (NUMBA_CACHE_DIR unset)
    route(caching)
    return _configured


def configure_cuda() -> None:
    """The same routing for CUDA kernels: numba-cuda keeps a caching module of its own. Called by edgellm's CUDA
    package before it defines kernels, so a CPU-only process never imports numba.cuda."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    configure()
    try:
        from numba.cuda.core import caching  # numba-cuda's own copy; older ones share numba.core's (routed already)
    except ImportError:
        return
    route(caching)


_routed = set()


def route(caching) -> None:
    """Put edgellm's locator first in `caching`'s list (numba.core.caching or numba-cuda's twin), once."""
    if id(caching) in _routed:
        return
    _routed.add(id(caching))
    d = _configured

    class EdgeLLMCacheLocator(caching._UserProvidedCacheLocator if hasattr(caching, "_UserProvidedCacheLocator")
                              else caching.UserProvidedCacheLocator):
        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = os.path.join(d, self.get_suitable_cache_subpath(py_file))

        @classmethod
        def from_function(cls, py_func, py_file):
            if not _owns(py_file):
                return None
            return super(cls.__mro__[1], cls).from_function(py_func, py_file)

        def ensure_cache_path(self):
            if d != UNCACHED:
                super().ensure_cache_path()

    if d == UNCACHED:
        # Nowhere to write: edgellm's functions get a disabled cache (never read, never written), others are untouched.
        enable = caching.Cache.enable

        def enable_unless_uncached(cache):
            if isinstance(cache._impl.locator, EdgeLLMCacheLocator):
                cache.disable()
            else:
                enable(cache)
        caching.Cache.enable = enable_unless_uncached

    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # renamed in Numba 0.61
    impl._locator_classes.insert(0, EdgeLLMCacheLocator)
    _locators.append(EdgeLLMCacheLocator)


_locators = []  # the locator classes installed, for tests

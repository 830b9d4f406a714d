"""Where Numba keeps compiled kernels: a directory per version of edgellm's source.

Numba's own cache is keyed by each function's source file, so a change in a helper that a kernel inlines from
another file leaves the kernel's cache stale; and it writes next to the package, which fails where the package
directory is read-only. Keying one user-cache directory by a hash of all of edgellm's and quant's source (plus
the Numba and Python versions) fixes both. Set NUMBA_CACHE_DIR yourself to override.
"""
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = ("edgellm", "quant")


def source_hash() -> str:
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for path in sorted((_ROOT / pkg).rglob("*.py")):
            h.update(str(path.relative_to(_ROOT)).encode())
            h.update(path.read_bytes())
    # The installed Numba, identified without importing it (that costs a quarter of a second).
    spec = importlib.util.find_spec("numba")
    if spec is not None and spec.origin:
        st = os.stat(spec.origin)
        h.update(f"{spec.origin}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgellm" / "numba"


def configure() -> str:
    """Point Numba's cache at this source version's directory (before numba is imported). Returns the directory."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    d = cache_root() / source_hash()
    os.environ["NUMBA_CACHE_DIR"] = str(d)
    if "numba" in sys.modules:  # imported first by someone else: tell its config too (before any kernel compiles)
        import numba
        numba.config.CACHE_DIR = str(d)
    return str(d)

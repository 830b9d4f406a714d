"""Writing a file so that its name only ever refers to a complete file: the old one, or the new one whole.

The bytes go to a unique temporary file beside the target (same filesystem, so the rename is atomic; unique, so
two writers never share one), which is fsynced before os.replace and whose directory is fsynced after, so a power
loss cannot leave the name on a file whose data never reached the disk. On any error or interrupt the temporary
file is removed and the target is left as it was.
"""
from __future__ import annotations

import contextlib
import os
import tempfile


def fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return  # a platform or filesystem without directory handles: nothing more can be done
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb"):
    """with atomic_write(path) as f: write to f; path is replaced only when the block ends without an error."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


def unique_temp_path(path) -> str:
    """A new empty file beside `path`, for writers that open their output by name (GGUFWriter)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    os.close(fd)
    return tmp


def replace_synced(tmp: str, path) -> None:
    """fsync the finished `tmp`, rename it over `path`, and fsync the directory that holds both."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(os.path.dirname(os.path.abspath(os.fspath(path))))

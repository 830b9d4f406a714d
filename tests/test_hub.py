"""Models from the Hugging Face Hub and split GGUF files, without the internet.

The official huggingface_hub client talks to tests/fake_hub.py (a local server speaking the Hub's endpoints) through
HF_ENDPOINT, with its cache in a temporary HF_HOME. The repository holds a single-file Q8_0 model, a Q4_0 model
split in three by gguf-py's writer (the layout gguf-split writes), and an mmproj file that is never a model to run.
"""
import hashlib
import os
import shutil

import numpy as np
import pytest

import edgellm
from edgellm import cli
from edgellm.engine import gguf, validate
from edgellm.store import hub
from edgellm.errors import GGUFError, MemoryBudgetError
from fake_hub import FakeHub, FakeRepo
from hardening_tiny import tiny_spec, write_loadable_tiny_model

REPO = "tiny-org/tiny-GGUF"
SINGLE = "tiny-Q8_0.gguf"
SPLIT = [f"tiny-Q4_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
MMPROJ = "mmproj-tiny-F16.gguf"
PROMPT = "hello world"
LOAD = dict(n_ctx=64, n_threads=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    single = write_loadable_tiny_model(d / SINGLE, tiny_spec())
    parts = write_loadable_tiny_model(d / "tiny-Q4_0.gguf", tiny_spec(weight_type="Q4_0", seed=1), split_max_tensors=8)
    assert [os.path.basename(p) for p in parts] == SPLIT
    # the same Q4_0 weights in one file, to compare the split model against
    (d / "whole").mkdir()
    whole = write_loadable_tiny_model(d / "whole" / "tiny-Q4_0.gguf", tiny_spec(weight_type="Q4_0", seed=1))
    data = {SINGLE: open(single, "rb").read(), MMPROJ: b"GGUF not a model"}
    data.update({name: open(p, "rb").read() for name, p in zip(SPLIT, parts)})
    return {"dir": d, "single": str(single), "parts": parts, "whole": str(whole), "data": data}


@pytest.fixture(scope="module")
def server():
    s = FakeHub()
    yield s
    s.stop()


@pytest.fixture
def hub_env(server, files, tmp_path, monkeypatch):
    """HF_ENDPOINT at the fake server, HF_HOME in tmp_path, no token. huggingface_hub reads these at import, so its
    constants are set too (another test may have imported it first)."""
    import huggingface_hub.constants as C
    home = tmp_path / "hf"
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(C, "ENDPOINT", server.url)
    monkeypatch.setattr(C, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(C, "HF_HOME", str(home))
    monkeypatch.setattr(C, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(C, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
    server.repos.clear()
    server.repos[REPO] = FakeRepo(dict(files["data"]))
    server.log.clear()
    return home / "hub"


def _go_offline(monkeypatch, server):
    import huggingface_hub.constants as C
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    server.log.clear()


def _reference(path):
    m = edgellm.load(path, **LOAD)
    return m.generate(PROMPT, max_tokens=8), m.logits(m.tokenize(PROMPT))


def _cached_gguf(cache):
    return [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs if f.endswith(".gguf") or "blobs" in d]


# -- names ----------------------------------------------------------------------------------------------------------

def test_names_parse_as_llama_cpp_and_ollama_spell_them():
    assert hub.parse_ref("org/repo") == hub.HubRef("org/repo")
    assert hub.parse_ref("org/repo:q4_k_m") == hub.HubRef("org/repo", quant="q4_k_m")
    assert hub.parse_ref("hf.co/org/repo:Q8_0") == hub.HubRef("org/repo", quant="Q8_0")
    assert hub.parse_ref("org/repo/sub/x-Q4_0.gguf") == hub.HubRef("org/repo", filename="sub/x-Q4_0.gguf")
    for not_hub in ("smollm2-135m", "models/x.gguf", "./a/b.gguf", "/abs/a/b.gguf", "a/b/../c.gguf", "a/b/c.txt"):
        assert hub.parse_ref(not_hub) is None, not_hub


def test_quant_tags_and_split_names_read_as_llama_cpp_reads_them():
    f = hub.HubFile("dir/Model-7B-Q4_K_M-00002-of-00003.gguf", 1)
    assert (f.quant, f.split) == ("Q4_K_M", ("dir/Model-7B-Q4_K_M", 2, 3))
    assert hub.HubFile("model.f16.gguf", 1).quant == "F16"
    assert not hub.HubFile("mmproj-model-f16.gguf", 1).is_model


# -- split files ----------------------------------------------------------------------------------------------------

def test_split_model_opens_from_its_first_part_and_runs_as_the_single_file(files):
    with gguf.open(files["parts"][0]) as f, gguf.open(files["whole"]) as whole:
        assert [p.path for p in f.parts] == files["parts"][1:]
        assert f.metadata["split.count"] == 3 and f.metadata["split.tensors.count"] == len(whole.tensors)
        assert set(f.tensors) == set(whole.tensors)
        # each part's tensors are views into that part's own map, never copies
        assert {t.file for t in f.tensors.values()} == set(files["parts"])
        for name, t in f.tensors.items():
            assert t.data.base is not None and not t.data.flags.owndata
            assert bytes(t.data) == bytes(whole.tensors[name].data)
            with open(t.file, "rb") as fh:
                fh.seek(t.offset)
                assert fh.read(t.nbytes) == bytes(t.data)
    text, logits = _reference(files["parts"][0])
    ref_text, ref_logits = _reference(files["whole"])
    assert text == ref_text
    np.testing.assert_array_equal(logits, ref_logits)


def test_missing_or_mismatched_split_part_is_a_clear_error(files, tmp_path):
    parts = [shutil.copy(p, tmp_path) for p in files["parts"]]
    os.rename(parts[1], parts[1] + ".away")
    with pytest.raises(GGUFError, match=r"part 2 of 3 of this split model is missing"):
        gguf.open(parts[0])
    # a part of another split model (four parts) in its place
    (tmp_path / "o").mkdir()
    other = write_loadable_tiny_model(tmp_path / "o" / "tiny-Q4_0.gguf", tiny_spec(), split_max_tensors=6)
    shutil.copy(other[1], parts[1])
    with pytest.raises(GGUFError, match=r"split.count is 4, expected 3 .* do not belong together"):
        gguf.open(parts[0])
    with pytest.raises(GGUFError, match=r"is part 2 of a 4-part split model; open its first part"):
        gguf.open(other[1])
    os.remove(parts[1])
    with pytest.raises(GGUFError, match=r"part 2 of 3 .* missing"):
        edgellm.load(parts[0], **LOAD)


def test_header_reads_from_the_first_bytes_and_asks_for_more(files):
    data = open(files["single"], "rb").read()
    with pytest.raises(gguf.HeaderIncomplete) as e:
        gguf.read_header(data[:100], len(data))
    h = gguf.read_header(data[:e.value.needed * 64], len(data))
    with gguf.open(files["single"]) as f:
        assert {n: (t.shape, t.nbytes, t.offset) for n, t in h.tensors.items()} == \
               {n: (t.shape, t.nbytes, t.offset) for n, t in f.tensors.items()}
        assert validate.model_memory_needs(h, 64) == validate.model_memory_needs(f, 64)
    with pytest.raises(GGUFError, match="runs past the end"):  # a size the tensor table does not fit in
        gguf.read_header(data[:-1], len(data) - 1)


# -- the Hub --------------------------------------------------------------------------------------------------------

def test_pull_repo_lists_its_gguf_models_and_quant_types(hub_env, server, capsys):
    assert cli.main(["pull", REPO]) == 0
    out = capsys.readouterr().out
    assert "Q8_0" in out and SINGLE in out and f"{SPLIT[0]} (3 parts)" in out and "Q4_0" in out
    assert MMPROJ not in out and SPLIT[1] not in out
    assert "* Q8_0" in out  # no Q4_K_M: Q8_0 is what llama.cpp picks next
    assert server.downloads() == [] and not _cached_gguf(hub_env)


def test_quant_tags_pick_files_case_insensitively_and_splits_whole(hub_env):
    listing = hub.list_files(REPO)
    assert [f.path for f in hub.choose(listing, "q4_0")] == SPLIT
    assert [f.path for f in hub.choose(listing, "Q8_0")] == [SINGLE]
    assert [f.path for f in hub.choose(listing, filename=SPLIT[2])] == SPLIT  # any part means the whole model
    assert [f.path for f in hub.choose(listing, filename="*Q4_0-0000[12]*")] == SPLIT
    with pytest.raises(hub.HubError, match=r"no GGUF file with quant type 'Q5_K_M' .*Q4_0, Q8_0"):
        hub.choose(listing, "Q5_K_M")
    with pytest.raises(hub.HubError, match=r"matches 2 models"):
        hub.choose(listing, filename="tiny-*.gguf")


def test_load_by_quant_downloads_a_split_model_after_the_memory_check(hub_env, server, files):
    m = edgellm.load(f"{REPO}:Q4_0", **LOAD)
    assert os.path.basename(m.path) == SPLIT[0] and hub_env in __import__("pathlib").Path(m.path).parents
    text, logits = m.generate(PROMPT, max_tokens=8), m.logits(m.tokenize(PROMPT))
    ref_text, ref_logits = _reference(files["whole"])
    assert text == ref_text
    np.testing.assert_array_equal(logits, ref_logits)
    # every part's header was read with a ranged request before any file was downloaded
    gets = [(e[1].rsplit("/", 1)[-1], e[2]) for e in server.log if e[0] == "BYTES"]
    first_download = next(i for i, (_, r) in enumerate(gets) if r is None)
    assert {n for n, r in gets[:first_download] if r and r.startswith("bytes=0-")} == set(SPLIT)
    assert sorted(n for n, r in gets if r is None) == sorted(SPLIT)
    # a second load needs nothing from the network beyond the listing
    server.log.clear()
    edgellm.load(f"{REPO}:q4_0", **LOAD)
    assert server.downloads() == []


def test_from_pretrained_takes_a_glob_and_a_file_name(hub_env, server, files):
    m = edgellm.Model.from_pretrained(REPO, "*Q8_0.gguf", **LOAD)
    assert os.path.basename(m.path) == SINGLE
    assert open(m.path, "rb").read() == files["data"][SINGLE]
    assert m.generate(PROMPT, max_tokens=8) == _reference(files["single"])[0]
    assert edgellm.load(f"{REPO}/{SINGLE}", **LOAD).path == m.path
    with pytest.raises(hub.HubError, match=r"no GGUF file matches '\*Q6_K\*'"):
        edgellm.Model.from_pretrained(REPO, "*Q6_K*", **LOAD)


def test_memory_check_refuses_before_downloading(hub_env, server, monkeypatch):
    monkeypatch.setattr(validate, "available_memory", lambda: 1 << 20)
    with pytest.raises(MemoryBudgetError):
        edgellm.load(f"{REPO}:Q8_0")
    assert any(e[0] == "BYTES" and e[2].startswith("bytes=0-") for e in server.log)  # the header was read ...
    assert server.downloads() == [] and not _cached_gguf(hub_env)       # ... and nothing downloaded


def test_dropped_connection_resumes_with_a_range_request(hub_env, server, files, monkeypatch):
    import huggingface_hub.constants as C
    # the client writes (and so can resume from) whole chunks, 10 MB by default: small ones for a small file
    monkeypatch.setattr(C, "DOWNLOAD_CHUNK_SIZE", 4096)
    size = len(files["data"][SINGLE])
    server.repos[REPO].drop_at[SINGLE] = size // 2 + 100
    path = hub.pull(f"{REPO}:Q8_0", quiet=True)
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == server.repos[REPO].sha256(SINGLE)
    assert [e[2] for e in server.downloads(SINGLE)] == [None, f"bytes={(size // 2 + 100) // 4096 * 4096}-"]


def test_checksum_mismatch_is_an_error_and_leaves_no_file(hub_env, server):
    server.repos[REPO].corrupt.add(SINGLE)
    with pytest.raises(hub.HubError, match=r"checksum mismatch .* removed from the cache"):
        hub.pull(f"{REPO}:Q8_0", quiet=True, check_memory=False)
    assert server.downloads(SINGLE) and not _cached_gguf(hub_env)


def test_offline_a_cached_model_loads_without_the_network(hub_env, server, files, monkeypatch):
    path = hub.pull(f"{REPO}:Q4_0", quiet=True)
    _go_offline(monkeypatch, server)
    m = edgellm.load(f"{REPO}:Q4_0", **LOAD)
    assert m.path == str(path) and m.generate(PROMPT, max_tokens=8) == _reference(files["whole"])[0]
    assert edgellm.Model.from_pretrained(REPO, "*Q4_0-00001-of-00003.gguf", **LOAD).path == str(path)
    with pytest.raises(hub.HubError, match=r"no GGUF file with quant type 'Q8_0'"):
        edgellm.load(f"{REPO}:Q8_0", **LOAD)  # only what the cache holds can be chosen offline
    assert server.log == []


def test_gated_repo_without_a_token_names_hf_token(hub_env, server, files, monkeypatch):
    server.repos[REPO].gated = True
    with pytest.raises(hub.HubError, match=r"gated .*HF_TOKEN"):
        edgellm.load(f"{REPO}:Q8_0", **LOAD)
    assert not _cached_gguf(hub_env)
    server.log.clear()
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token")  # the client sends it; the fake Hub lets any token in
    assert os.path.basename(hub.pull(f"{REPO}:Q8_0", quiet=True)) == SINGLE
    assert {e[3] for e in server.log if e[0] == "HEAD"} == {"Bearer hf_fake_token"}
    assert {e[3] for e in server.downloads(SINGLE)} == {None}  # not forwarded to the storage host


def test_split_model_missing_a_part_on_the_hub_is_a_clear_error(hub_env, server):
    del server.repos[REPO].files[SPLIT[2]]
    with pytest.raises(hub.HubError, match=r"split model tiny-Q4_0 has 3 parts, but the Hub holds only 2"):
        edgellm.load(f"{REPO}:Q4_0", **LOAD)
    assert server.downloads() == []


def test_unknown_repository_is_a_clear_error(hub_env):
    with pytest.raises(hub.HubError, match=r"nobody/nothing: no such model repository on the Hub"):
        edgellm.load("nobody/nothing:Q4_K_M", **LOAD)


def test_cli_dry_run_models_and_rm(hub_env, server, files, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_MODELS", str(tmp_path / "models"))
    assert cli.main(["pull", "--dry-run", "smollm2-135m"]) == 0  # a catalog model: its size, nothing fetched
    assert "would download 98.4 MB" in capsys.readouterr().out and not (tmp_path / "models").exists()
    assert cli.main(["pull", "--dry-run", f"{REPO}:Q4_0"]) == 0
    out = capsys.readouterr().out
    total = sum(len(server.repos[REPO].files[n]) for n in SPLIT)
    assert out.count("would download") == 3 and f"to download: 3 file(s), {total / 1e6:,.1f} MB" in out
    assert server.downloads() == [] and not _cached_gguf(hub_env)

    assert cli.main(["pull", f"{REPO}:Q4_0", f"{REPO}/{SINGLE}"]) == 0
    capsys.readouterr()
    assert cli.main(["pull", "--dry-run", f"{REPO}:Q4_0"]) == 0
    assert "to download: 0 file(s)" in capsys.readouterr().out

    (tmp_path / "models").mkdir()
    shutil.copy(files["single"], tmp_path / "models" / "mine.gguf")
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "gemma-3-270m" in out
    assert f"{REPO}/{SPLIT[0]}" in out and "3 parts" in out and f"{REPO}/{SINGLE}" in out
    assert "mine.gguf" in out and "local" in out

    assert cli.main(["rm", f"{REPO}:Q4_0", "mine.gguf"]) == 0
    out = capsys.readouterr().out
    assert out.count("removed") == 4 and all(f"removed {REPO}/{n}" in out for n in SPLIT)
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert SPLIT[0] not in out and f"{REPO}/{SINGLE}" in out and "mine.gguf" not in out
    assert cli.main(["rm", REPO]) == 0
    assert not _cached_gguf(hub_env)
    assert cli.main(["rm", REPO]) == 1


def test_catalog_names_still_resolve_through_the_catalog(hub_env, server):
    from edgellm.store import catalog
    entry = catalog.lookup("smollm2-135m")
    if not (catalog.models_dir() / entry.file).is_file():
        pytest.skip("the catalog model is not cached here")
    assert catalog.resolve("smollm2-135m") == catalog.models_dir() / entry.file
    assert server.log == []

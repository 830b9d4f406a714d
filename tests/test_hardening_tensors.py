"""Corrupt model files are refused before any kernel runs, through edgellm.load: a tensor of the wrong shape, a
norm in a quantized format, a missing tensor, each named in a ModelError; config values no file could hold
(xfail where the loader does not check them yet). Weights that load but overflow the logits are in
test_hardening_numeric.py."""
import contextlib
import resource
import sys

import numpy as np
import pytest

import edgellm
import edgellm.engine.gguf
import edgellm.engine.validate as validate
from edgellm.errors import MemoryBudgetError, ModelError
from hardening_tiny import N_VOCAB, patch_uint32_key, tiny_spec, write_loadable_tiny_model
from helpers_tiny_gguf import random_matrix_bytes

SPEC = tiny_spec()


def load(path):
    return edgellm.load(str(path), n_threads=1, n_ctx=64)


def test_the_uncorrupted_tiny_model_loads_and_generates(tmp_path):
    m = load(write_loadable_tiny_model(tmp_path / "ok.gguf"))
    assert len(m.complete("hello", max_tokens=4, ignore_eos=True).tokens) == 4


def test_attn_q_of_the_wrong_shape_is_refused_by_name(tmp_path):
    rng = np.random.default_rng(0)
    wrong = random_matrix_bytes(rng, (SPEC.n_embd + 32, SPEC.n_embd), "Q8_0")  # 96 query rows where 64 belong
    path = write_loadable_tiny_model(tmp_path / "q.gguf", replace={"blk.1.attn_q.weight": (wrong, "Q8_0")})
    with pytest.raises(ModelError, match=r"blk\.1\.attn_q\.weight.*shape \(96, 64\).*\(64, 64\)"):
        load(path)


def test_transposed_ffn_matrix_is_refused_by_name(tmp_path):
    rng = np.random.default_rng(0)
    transposed = random_matrix_bytes(rng, (SPEC.n_embd, SPEC.n_ff), "Q8_0")  # ffn_up is (n_ff, n_embd)
    path = write_loadable_tiny_model(tmp_path / "up.gguf", replace={"blk.0.ffn_up.weight": (transposed, "Q8_0")})
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_up\.weight.*shape"):
        load(path)


def test_quantized_norm_is_refused_by_name(tmp_path):
    rng = np.random.default_rng(0)
    q8_norm = random_matrix_bytes(rng, (1, SPEC.n_embd), "Q8_0").reshape(-1)   # a (64,) vector in Q8_0 blocks
    path = write_loadable_tiny_model(tmp_path / "norm.gguf", replace={"blk.0.ffn_norm.weight": (q8_norm, "Q8_0")})
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_norm\.weight.*type Q8_0"):
        load(path)


def test_missing_tensor_is_refused_by_name(tmp_path):
    path = write_loadable_tiny_model(tmp_path / "missing.gguf", drop={"blk.1.attn_v.weight"})
    with pytest.raises(ModelError, match=r"lacks tensor 'blk\.1\.attn_v\.weight'"):
        load(path)


def test_embedding_width_disagreeing_with_the_config_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    narrow = random_matrix_bytes(rng, (N_VOCAB, SPEC.n_embd - 32), "Q8_0")
    path = write_loadable_tiny_model(tmp_path / "embd.gguf", replace={"token_embd.weight": (narrow, "Q8_0")})
    with pytest.raises(ModelError, match=r"token_embd\.weight.*shape"):
        load(path)


ADDRESS_SPACE_HEADROOM = 1 << 30   # bytes of address space a capped load may add: far above a tiny model's needs


@contextlib.contextmanager
def address_space_capped(extra_bytes):
    """Cap this process's address space at what is mapped now plus extra_bytes, for the block only."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_head_count_past_the_embedding_width_is_refused(tmp_path):
    path = patch_uint32_key(write_loadable_tiny_model(tmp_path / "heads.gguf"), "llama.attention.head_count", 2**31)
    with pytest.raises(ModelError, match="head"):
        load(path)


def test_block_count_beyond_the_file_is_refused(tmp_path):
    path = patch_uint32_key(write_loadable_tiny_model(tmp_path / "blocks.gguf"), "llama.block_count", 4 * 10**9)
    with pytest.raises(ModelError, match="block_count"):
        load(path)


def test_block_count_beyond_the_file_is_refused_by_the_memory_estimate(tmp_path):
    path = patch_uint32_key(write_loadable_tiny_model(tmp_path / "blocks.gguf"), "llama.block_count", 4 * 10**9)
    with edgellm.engine.gguf.open(path) as f, pytest.raises(ModelError, match="block_count 4000000000"):
        validate.model_memory_needs(f)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_context_length_no_memory_could_hold_is_refused_with_figures(tmp_path, monkeypatch):
    path = patch_uint32_key(write_loadable_tiny_model(tmp_path / "ctx.gguf"), "llama.context_length", 4 * 10**9)
    # capped, so that while the check is missing the 16 GB of positions fail to allocate instead of being written
    with address_space_capped(ADDRESS_SPACE_HEADROOM), pytest.raises(MemoryBudgetError, match="MiB of KV cache"):
        edgellm.load(str(path), n_threads=1, n_ctx=4 * 10**9)  # asked for explicitly: refused with the figures
    # by default the context is sized to the memory that is free (here 1 GiB), far below the file's claim
    monkeypatch.setattr(validate, "available_memory", lambda: 1 << 30)
    m = edgellm.load(str(path), n_threads=1)
    assert m.n_ctx == m.context_fit.n_ctx < 4 * 10**9
    assert m.model.cache.nbytes < 1 << 29
    assert m.generate("hello", max_tokens=2, ignore_eos=True) is not None

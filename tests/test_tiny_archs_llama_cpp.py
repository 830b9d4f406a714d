"""The tiny file of each added architecture (gemma2, llama with a sliding window, smollm3, granite, olmo2, llama with
F16 and BF16 layers, and the
mixtures of experts qwen3moe (8 experts top 2, 32 top 4) and llama with experts (Mixtral's layout); see
tests/helpers_tiny_archs.py) against llama.cpp's logits on it (tools/record_tiny_archs.py; no llama.cpp here).

The file is rebuilt from its seed and must hash as the recorded one. Teacher-forced rows (40 ids as one batch)
must be llama.cpp's bits, and so must the decode-path rows (30 ids as one batch, then one id at a time: the files'
F32 matrices then go through llama.cpp's one-token dot, quant.kernels_float). The decode path's prompt batch
computes every row's logits, as llama-cpp-python's logits_all does (Q6_K's output kernel depends on the rows).
"""
import numpy as np
import pytest
from conftest import FIXTURES

import edgellm.engine.gguf
from edgellm.engine.models import build_model
from exact_host import EXACT_HOST, EXACT_HOST_REASON
from helpers_tiny_archs import TINY_ARCHS, prompt_tokens, write_tiny_arch

pytestmark = pytest.mark.skipif(not EXACT_HOST, reason=EXACT_HOST_REASON)



@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_path):
    """name -> (fixture, forced rows, decode rows) computed once per architecture."""
    cache = {}

    def get(name):
        if name not in cache:
            rec = np.load(FIXTURES / f"tiny_arch_{name}.npz")
            path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
            assert write_tiny_arch(path, TINY_ARCHS[name], smollm2_path) == str(rec["gguf_sha256"])
            ids, p = rec["tokens"], int(rec["prompt_len"])
            assert np.array_equal(ids, prompt_tokens(TINY_ARCHS[name]))
            with edgellm.engine.gguf.open(path) as f:
                model = build_model(f, n_ctx=128, n_threads=2)
                forced = model.forward(ids, all_logits=True).copy()
                model.reset()
                decode = [model.forward(ids[:p], all_logits=True)[-1].copy()]
                decode += [model.forward(ids[i:i + 1])[0].copy() for i in range(p, len(ids))]
            cache[name] = (rec, forced, np.stack(decode))
        return cache[name]
    return get


def row_hash(row) -> bytes:
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(row, np.float32).tobytes()).digest()


@pytest.mark.parametrize("name", sorted(TINY_ARCHS))
def test_teacher_forced_rows_are_llama_cpp_bits(name, runs):
    rec, forced, _ = runs(name)
    bad = [i for i, row in enumerate(forced) if row_hash(row) != rec["forced_sha256"][i].tobytes()]
    assert not bad, f"{name}: rows {bad} differ; row {bad[0]} top ids {np.argsort(-forced[bad[0]])[:8]} vs " \
                    f"{rec['forced_top_ids'][bad[0]]}"


@pytest.mark.parametrize("name", sorted(TINY_ARCHS))
def test_decode_rows(name, runs):
    rec, _, decode = runs(name)
    exact = [row_hash(row) == rec["decode_sha256"][i].tobytes() for i, row in enumerate(decode)]
    assert all(exact), f"{name}: decode rows {[i for i, e in enumerate(exact) if not e]} differ"

"""Each op against what llama.cpp computed on the same inputs, bit for bit.

tests/fixtures/llama_ops_<model>.npz hold tensors llama.cpp (llama-cpp-python 0.3.36, x86-64 Linux, AVX2/FMA
build, its defaults: f16 KV cache, no flash attention) computed inside one prompt batch and the decode step after
it (tools/llama_cpp_dump_ops.py). Each test feeds our op llama.cpp's input and wants llama.cpp's output exactly:
the models amplify a last-bit difference into tenths of a logit within a few dozen tokens, so "close" is not
enough to give llama.cpp's answers. Our kernels use no CPU-specific rounding (explicit FMAs, exact integer
lanes), but cos/sin/tanh/pow come from the C library: the comparison is exact on Linux (glibc), as llama.cpp's.
"""

import numpy as np
import pytest
from conftest import FIXTURES, GEMMA, REFERENCE_FILES, SMOLLM2
from exact_host import EXACT_HOST, EXACT_HOST_REASON

import edgellm.engine.gguf
from edgellm.engine import ops
from edgellm.engine.kvcache import KVCache
from edgellm.engine.models import build_model

pytestmark = pytest.mark.skipif(not EXACT_HOST, reason=EXACT_HOST_REASON)

N_CTX = 64


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    f = edgellm.engine.gguf.open(smollm2_path)
    yield build_model(f, n_ctx=N_CTX, n_threads=2), np.load(FIXTURES / f"llama_ops_{REFERENCE_FILES[SMOLLM2]}.npz")
    f.close()


@pytest.fixture(scope="module")
def gemma(gemma_path):
    f = edgellm.engine.gguf.open(gemma_path)
    yield build_model(f, n_ctx=N_CTX, n_threads=2), np.load(FIXTURES / f"llama_ops_{REFERENCE_FILES[GEMMA]}.npz")
    f.close()


def rows(a):
    """A recorded [1, tokens, n] activation as [tokens, n]."""
    return np.ascontiguousarray(a.reshape(-1, a.shape[-1]))


def assert_bits(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32).reshape(np.shape(got))
    differ = int((got != want).sum())
    assert differ == 0, f"{what}: {differ} of {got.size} values differ from llama.cpp (max |diff| " \
                        f"{np.abs(got - want).max():.3g})"


def batch_positions(dump):
    n = len(dump["tokens"]) - 1
    return np.arange(n, dtype=np.int32), np.array([n], np.int32)


@pytest.mark.parametrize("layer", [0, 7])
@pytest.mark.parametrize("step", ["batch", "step"])
def test_norm_matmul_swiglu_bits(smollm2, layer, step):
    model, dump = smollm2
    w = model.layers[layer]
    x = rows(dump[f"ffn_inp@{layer}/{step}#0"])
    normed = np.empty_like(x)
    ops.rms_norm(x, w.ffn_norm, model.config.norm_eps, normed)
    assert_bits(normed, rows(dump[f"ffn_norm@{layer}/{step}#0"]), "rms_norm")
    gate, up = (np.empty((x.shape[0], w.ffn_gate.n_out), np.float32) for _ in range(2))
    w.ffn_gate.matmul(normed, gate)  # Q4_1 with Q8_1 activations
    w.ffn_up.matmul(normed, up)
    assert_bits(gate, rows(dump[f"ffn_gate@{layer}/{step}#0"]), "Q4_1 matmul (gate)")
    assert_bits(up, rows(dump[f"ffn_up@{layer}/{step}#0"]), "Q4_1 matmul (up)")
    ops.silu_mul(gate, up)
    assert_bits(gate, rows(dump[f"ffn_swiglu@{layer}/{step}#0"]), "SwiGLU")


def _check_rope(model, dump, layer, names):
    batch_pos, step_pos = batch_positions(dump)
    neox = model.layer_rope(layer)[1]
    for step, positions in (("batch", batch_pos), ("step", step_pos)):
        for before, after in names:
            x = np.ascontiguousarray(dump[before.format(layer=layer, step=step)])
            cos, sin = (np.empty((len(positions), model.config.n_rot // 2), np.float32) for _ in range(2))
            ops.rope_tables(positions, _rope_of(model, layer), cos, sin)
            ops.apply_rope(x, cos, sin, neox)
            assert_bits(x, dump[after.format(layer=layer, step=step)], f"rope of {before} ({step})")


def _rope_of(model, layer):
    if hasattr(model, "rope"):
        return model.rope
    return model.rope_local if model.config.is_sliding(layer) else model.rope_global


@pytest.mark.parametrize("layer", [0, 7])
def test_rope_bits_llama(smollm2, layer):
    model, dump = smollm2
    _check_rope(model, dump, layer, [("Qcur@{layer}/{step}#1", "Qcur@{layer}/{step}#2"),
                                     ("Kcur@{layer}/{step}#1", "Kcur@{layer}/{step}#2")])


@pytest.mark.parametrize("layer", [0, 5])  # a sliding-window layer (rope base 10k) and a global one (1M)
def test_qk_norm_and_rope_bits_gemma(gemma, layer):
    model, dump = gemma
    w, eps = model.layers[layer], model.config.norm_eps
    for step in ("batch", "step"):
        for name, weight in (("Qcur", w.attn_q_norm), ("Kcur", w.attn_k_norm)):
            x = np.ascontiguousarray(dump[f"{name}@{layer}/{step}#1"])
            ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, x.reshape(-1, x.shape[-1]))
            assert_bits(x, dump[f"{name}_normed@{layer}/{step}#0"], f"{name} norm ({step})")
    _check_rope(model, dump, layer, [("Qcur_normed@{layer}/{step}#0", "Qcur@{layer}/{step}#2"),
                                     ("Kcur_normed@{layer}/{step}#0", "Kcur@{layer}/{step}#2")])


def _check_attention(model, dump, layer, window, scale):
    """The prompt batch through an f16 cache, then the decode step: both against llama.cpp's kqv."""
    cfg = model.config
    batch_pos, step_pos = batch_positions(dump)
    cache = KVCache(N_CTX, cfg.n_head_kv, cfg.head_dim, [window], 16, "f16").layers[0]
    for step, positions in (("batch", batch_pos), ("step", step_pos)):
        k = np.ascontiguousarray(dump[f"Kcur@{layer}/{step}#2"]).reshape(len(positions), cfg.n_head_kv, -1)
        v = np.ascontiguousarray(dump[f"Vcur@{layer}/{step}#1"]).reshape(len(positions), cfg.n_head_kv, -1)
        q = np.ascontiguousarray(dump[f"Qcur@{layer}/{step}#2"]).reshape(len(positions), cfg.n_head, -1)
        q = q * np.float32(cfg.q_scale)  # Gemma's graph scales q in float32 before attention; llama's by 1
        ops.kv_store(k, v, positions, cache.k, cache.v, cache.slot_pos)
        out = np.empty_like(q)
        ops.attention(q, cache.k, cache.v, cache.slot_pos, positions, window, scale, out)
        assert_bits(out, dump[f"kqv@{layer}/{step}#0"].transpose(1, 0, 2), f"attention ({step}, layer {layer})")


@pytest.mark.parametrize("layer", [0, 7])
def test_attention_bits_llama(smollm2, layer):
    model, dump = smollm2
    _check_attention(model, dump, layer, 0, model.config.attn_scale)


@pytest.mark.parametrize("layer", [0, 5])
def test_attention_bits_gemma(gemma, layer):
    model, dump = gemma
    window = model.config.sliding_window if model.config.is_sliding(layer) else 0
    _check_attention(model, dump, layer, window, model.config.attn_scale)


@pytest.mark.parametrize("layer", [0, 5])  # ffn_down is Q6_K in layer 0 and Q4_K in layer 5; attn_output Q4_K
@pytest.mark.parametrize("step", ["batch", "step"])  # 13 tokens: Q4_K gemm + gemv, Q6_K tiled; 1: gemv, vec_dot
def test_kquant_matmul_norm_geglu_bits_gemma(gemma, layer, step):
    model, dump = gemma
    w, eps = model.layers[layer], model.config.norm_eps
    key = f"@{layer}/{step}#0"
    attn = rows(dump["kqv_out" + key])
    projected = np.empty((attn.shape[0], w.attn_output.n_out), np.float32)
    w.attn_output.matmul(attn, projected)
    ops.rms_norm(projected, w.post_attention_norm, eps, projected)
    assert_bits(projected, rows(dump["attn_post_norm" + key]), "Q4_K attn_output, then the post-attention norm")
    gate, up = rows(dump["ffn_gate" + key]).copy(), rows(dump["ffn_up" + key])
    ops.gelu_tanh_mul(gate, up)
    assert_bits(gate, rows(dump["ffn_geglu" + key])[:gate.shape[0]], "GeGLU")
    geglu = rows(dump["ffn_geglu" + key])
    down = np.empty((geglu.shape[0], w.ffn_down.n_out), np.float32)
    w.ffn_down.matmul(geglu, down)
    assert_bits(down, rows(dump["ffn_out" + key]), f"{w.ffn_down.ggml_type} ffn_down")
    x = rows(dump["sa_out" + key]).copy()
    ops.add_post_norm(x, down, w.post_ffw_norm, eps)
    assert_bits(x, rows(dump["l_out" + key]), "post-FFN norm and residual")

"""Tiny random-weight models of every architecture: the fast path against the independent numpy reference,
cached decoding against full recomputation, and the checks that refuse a malformed model.

Most tests swap quant.QuantLinear for the float32 DequantizedLinear (fixture `exact_linear`), so that what remains is
the forward pass's own arithmetic and a tight bound catches any structural slip (rope order, masks, norms).
The weight-format tests run the real int8 kernels as well, under a bound sized to activation rounding.
"""

import numpy as np
import pytest

import edgellm.engine.gguf
import edgellm.engine.models.linear
from edgellm.errors import ModelError
from edgellm.engine.models import ALIASES, ARCHITECTURES, build_model, get_architecture
from edgellm.engine.models.gemma3 import Gemma3Model
from edgellm.engine.models.llama import LlamaModel
from edgellm.engine.reference import ReferenceModel
from helpers_tiny_gguf import TinySpec, write_tiny_from_registry, write_tiny_model

# Fast path with float32 matmuls vs float64 reference: float32 rounding only.
EXACT_VS_REFERENCE_NMSE = 1e-9
# quant.QuantLinear rounds activations to 8 bits before each matmul, as llama.cpp does (~1e-4 relative per
# matmul); random tiny models amplify it to at most ~4e-3 (measured, Q6_K). A wrong kernel gives ~1.
QUANTIZED_VS_REFERENCE_NMSE = 1e-2
# Token-by-token decoding vs one batch: the same arithmetic up to summation order, except where llama.cpp uses
# other kernels for one token and for a batch (attention's lanes; Q4_K's gemm and gemv, Q6_K's tiled matmul and
# vec_dot), which we follow: measured up to 6.7e-5 (Q6_K) on these random models.
DECODE_VS_BATCH_NMSE = 2e-4
# Gemma's GELU is looked up in llama.cpp's float16 table (2**-11 relative per activation): measured 6.6e-9.
GEMMA_VS_REFERENCE_NMSE = 1e-7

N_PROMPT = 19


def nmse(got, want):
    want = np.asarray(want, dtype=np.float64)
    return float(np.sum((got - want) ** 2) / np.sum(want**2))


def open_tiny(tmp_path, spec, name="tiny.gguf"):
    return edgellm.engine.gguf.open(write_tiny_model(tmp_path / name, spec))


def tokens_for(spec, n=N_PROMPT, seed=7):
    return np.random.default_rng(seed).integers(0, spec.n_vocab, n).astype(np.int32)


@pytest.fixture
def exact_linear(monkeypatch):
    """Build models with the float32 stand-in instead of quant.QuantLinear."""
    monkeypatch.setattr(edgellm.engine.models.linear, "LINEAR_CLASS", edgellm.engine.models.linear.DequantizedLinear)


def check_fast_matches_reference(tmp_path, spec, n_batch=512, n_tokens=N_PROMPT, bound=EXACT_VS_REFERENCE_NMSE):
    with open_tiny(tmp_path, spec) as f:
        model = build_model(f, n_ctx=64, n_threads=2, n_batch=n_batch, kv_type="f32")
        tokens = tokens_for(spec, n_tokens)
        fast = model.forward(tokens, all_logits=True)
        want = ReferenceModel(f).logits(tokens)
        assert fast.shape == (n_tokens, spec.n_vocab)
        assert nmse(fast, want) < bound
        return model, tokens, fast


def check_decode_matches_batch(model, tokens, batch_logits):
    model.reset()
    assert model.n_past == 0
    decoded = np.stack([model.forward(tokens[i:i + 1])[0].copy() for i in range(len(tokens))])
    assert model.n_past == len(tokens)
    assert nmse(decoded, batch_logits) < DECODE_VS_BATCH_NMSE
    # a prefix batch then single tokens lands on the same logits too
    model.reset()
    model.forward(tokens[:11])
    last = model.forward(tokens[11:])
    assert nmse(last[0], batch_logits[-1]) < DECODE_VS_BATCH_NMSE


# --- llama: head layouts, every weight format ---------------------------------------------------------------

HEAD_LAYOUTS = [  # (n_embd, n_head, n_head_kv, n_ff)
    (64, 4, 4, 96),  # multi-head
    (64, 4, 2, 96),  # grouped-query
    (96, 6, 1, 160),  # multi-query
    (72, 9, 3, 128),  # SmolLM2's 9/3 heads, head size 8
]


@pytest.mark.parametrize("n_embd,n_head,n_head_kv,n_ff", HEAD_LAYOUTS)
def test_llama_head_layouts(tmp_path, exact_linear, n_embd, n_head, n_head_kv, n_ff):
    spec = TinySpec(n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, weight_type="F32", tied=False)
    model, tokens, fast = check_fast_matches_reference(tmp_path, spec)
    check_decode_matches_batch(model, tokens, fast)


# K-quants need rows of 256: every matrix's input length is 256 or 512 here.
WEIGHT_FORMATS = ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]


@pytest.mark.parametrize("weight_type", WEIGHT_FORMATS)
def test_llama_weight_formats(tmp_path, weight_type):
    spec = TinySpec(n_embd=256, n_head=4, n_head_kv=2, n_ff=512, weight_type=weight_type, embd_type="Q8_0")
    model, tokens, fast = check_fast_matches_reference(tmp_path, spec, bound=QUANTIZED_VS_REFERENCE_NMSE)
    check_decode_matches_batch(model, tokens, fast)


@pytest.mark.parametrize("weight_type", WEIGHT_FORMATS)
def test_llama_weight_formats_exact(tmp_path, weight_type, exact_linear):
    """The same files through float32 matmuls: what the file holds is read with the right layout."""
    spec = TinySpec(n_embd=256, n_head=4, n_head_kv=2, n_ff=512, weight_type=weight_type, embd_type="Q8_0")
    check_fast_matches_reference(tmp_path, spec)


def test_llama_untied_output_is_used(tmp_path):
    """With output.weight present the logits come from it, not from the embedding."""
    spec = TinySpec(weight_type="F32", tied=False)
    with open_tiny(tmp_path, spec) as f:
        model = build_model(f, n_ctx=32, n_threads=1, kv_type="f32")
        assert model.output is not model.token_embd
    with open_tiny(tmp_path, TinySpec(weight_type="F32", tied=True), "tied.gguf") as f:
        model = build_model(f, n_ctx=32, n_threads=1, kv_type="f32")
        assert model.output is model.token_embd


def test_llama_batches_split_across_n_batch(tmp_path, exact_linear):
    spec = TinySpec(weight_type="Q8_0")
    model, tokens, fast = check_fast_matches_reference(tmp_path, spec, n_batch=4)
    model.reset()
    assert nmse(model.forward(tokens)[0], fast[-1]) < DECODE_VS_BATCH_NMSE


def test_a_prompt_that_fits_the_context_runs_in_n_batch_batches(tmp_path):
    """With context shift on (the default), a prompt that fits the context goes in n_batch batches, as llama.cpp
    runs it; only one that will shift is cut to n_ctx - n_keep. The batch picks a row's kernels (Q6_K's tiled
    matmul from 8 rows), so a context-filling prompt cut 12 + 4 gave its last rows other bits."""
    spec = TinySpec(weight_type="Q6_K", n_embd=256, n_ff=256)
    tokens = tokens_for(spec, 16)
    with open_tiny(tmp_path, spec) as f:
        model = build_model(f, n_ctx=16, n_threads=2, n_batch=16, kv_type="f32")
        assert model.context_shift and model.n_keep > 0
        batches = []
        run = model.forward_batch
        model.forward_batch = lambda t, *a, **k: (batches.append(len(t)), run(t, *a, **k))[1]
        full = model.forward(tokens, all_logits=True)
        assert batches == [16]
        model.reset()
        batches.clear()
        model.forward(tokens_for(spec, 20))  # past the context: batches that fit beside the kept positions
        assert batches == [16 - model.n_keep, 4 + model.n_keep]
        roomy = build_model(f, n_ctx=64, n_threads=2, n_batch=16, kv_type="f32")
        assert np.array_equal(full, roomy.forward(tokens, all_logits=True))


# --- qwen2, qwen3, gemma3 -----------------------------------------------------------------------------------

def test_qwen2_with_qkv_biases(tmp_path, exact_linear):
    spec = TinySpec(arch="qwen2", weight_type="Q8_0", n_head=4, n_head_kv=2)
    model, tokens, fast = check_fast_matches_reference(tmp_path, spec)
    check_decode_matches_batch(model, tokens, fast)
    assert model.config.qkv_bias and model.config.rope_neox


def test_qwen3_with_qk_norm_and_wide_heads(tmp_path, exact_linear):
    spec = TinySpec(arch="qwen3", weight_type="Q8_0", n_embd=64, n_head=4, n_head_kv=2, head_dim=32)
    model, tokens, fast = check_fast_matches_reference(tmp_path, spec)
    check_decode_matches_batch(model, tokens, fast)
    assert model.config.head_dim == 32 and model.config.qk_norm


GEMMA_WINDOW = 5  # much shorter than the prompt, so the sliding-window layers really slide


def gemma_spec(**kw):
    base = dict(arch="gemma3", weight_type="Q8_0", n_layer=7, n_embd=64, n_head=2, n_head_kv=1, head_dim=32,
                sliding_window=GEMMA_WINDOW)
    return TinySpec(**{**base, **kw})


def test_gemma3_sliding_window_and_global_layers(tmp_path, exact_linear):
    model, tokens, fast = check_fast_matches_reference(tmp_path, gemma_spec(), bound=GEMMA_VS_REFERENCE_NMSE)
    assert [kv.window for kv in model.cache.layers] == [GEMMA_WINDOW] * 5 + [0] + [GEMMA_WINDOW]
    check_decode_matches_batch(model, tokens, fast)


def test_gemma3_ring_wraps_during_chunked_prefill(tmp_path, exact_linear):
    """n_batch 3 + window 5: the ring holds 7 slots, so a 19-token prompt wraps it several times."""
    model, _, _ = check_fast_matches_reference(tmp_path, gemma_spec(), n_batch=3, bound=GEMMA_VS_REFERENCE_NMSE)
    assert model.cache.layers[0].slot_pos.shape[0] == GEMMA_WINDOW + 3 - 1


def test_gemma3_window_matters(tmp_path):
    """Sanity check of the test itself: the same weights without a window give other logits."""
    spec = gemma_spec()
    with open_tiny(tmp_path, spec) as f:
        windowed = build_model(f, n_ctx=64, n_threads=1, kv_type="f32").forward(tokens_for(spec), all_logits=True)
    wide = gemma_spec(sliding_window=1000)
    with open_tiny(tmp_path, wide, "wide.gguf") as f:
        unwindowed = build_model(f, n_ctx=64, n_threads=1, kv_type="f32").forward(tokens_for(spec), all_logits=True)
    assert nmse(windowed[:GEMMA_WINDOW], unwindowed[:GEMMA_WINDOW]) < DECODE_VS_BATCH_NMSE
    assert nmse(windowed[-1], unwindowed[-1]) > 1e-3


# --- every registered architecture, from its own tensor list ----------------------------------------------------

# The loosest of the activations' own rounding (Gemma's float16 GELU table, above); a structural slip gives ~1.
ANY_ARCH_VS_REFERENCE_NMSE = GEMMA_VS_REFERENCE_NMSE
# Seven layers, so that a period-6 sliding-window pattern has a global layer; the window is shorter than the prompt.
REGISTRY_SPEC = dict(weight_type="Q8_0", n_layer=7, n_embd=64, n_head=2, n_head_kv=1, head_dim=32,
                     sliding_window=GEMMA_WINDOW)


# Keys an architecture requires beyond the shared ones, and spec changes it needs (OLMo 2 refuses a window).
# Caps far below Gemma 2's real 50 / 30, so that tanh bends these small random scores and logits.
ARCH_KEYS = {"gemma2": {"gemma2.attn_logit_softcapping": 0.5, "gemma2.final_logit_softcapping": 1.5},
             "qwen3moe": {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2,
                          "qwen3moe.expert_feed_forward_length": 64},
             "granite": {"granite.logit_scale": 3.0, "granite.embedding_scale": 2.5, "granite.residual_scale": 0.6,
                         "granite.attention.scale": 0.125},
             # gpt-oss: its rope scaling as the released files have it (YaRN, factor 32 over 4,096 positions)
             "gpt-oss": {"gpt-oss.expert_count": 8, "gpt-oss.expert_used_count": 2,
                         "gpt-oss.expert_feed_forward_length": 64, "gpt-oss.rope.scaling.type": "yarn",
                         "gpt-oss.rope.scaling.factor": 32.0, "gpt-oss.rope.scaling.original_context_length": 256}}
ARCH_SPEC = {"olmo2": {"sliding_window": 0}}


def registry_spec(arch, **kw):
    return TinySpec(arch=arch, **{**REGISTRY_SPEC, "extra_keys": ARCH_KEYS.get(arch, {}), **ARCH_SPEC.get(arch, {}),
                                  **kw})


@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES) | set(ALIASES)))
def test_every_registered_architecture_against_the_reference(tmp_path, exact_linear, arch):
    """A tiny model holding exactly the tensors the architecture's tensor_specs require: the fast path against the
    float64 reference (edgellm/engine/reference.py, which a new architecture must also be written into), cached decoding
    against one batch, and the KV cache sized by its layer_windows()."""
    spec = registry_spec(arch)
    path = write_tiny_from_registry(tmp_path / f"{arch}.gguf", spec)
    with edgellm.engine.gguf.open(path) as f:
        model = build_model(f, n_ctx=64, n_threads=2, kv_type="f32")
        tokens = tokens_for(spec)
        fast = model.forward(tokens, all_logits=True)
        assert nmse(fast, ReferenceModel(f).logits(tokens)) < ANY_ARCH_VS_REFERENCE_NMSE
        assert tuple(kv.window for kv in model.cache.layers) == model.config.layer_windows()
        check_decode_matches_batch(model, tokens, fast)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_decode_steps_bound_to_their_buffers_keep_the_bits(tmp_path, arch):
    """A forward of one-row groups (a decode step, a verified draft) runs its layers' products and norms as callables
    bound once to its buffers (DecoderModel.decode_steps, where the architecture's forward pass uses them): every
    step's and every verified row's logits equal those of the same forwards through each op's own checks and kernel
    choice (bound_decode off), bit for bit, with the quantized kernels, past a ring wrap of the sliding-window
    layers."""
    spec = registry_spec(arch)
    path = write_tiny_from_registry(tmp_path / f"{arch}.gguf", spec)
    prompt, steps = tokens_for(spec, 9), tokens_for(spec, 30, seed=8)
    with edgellm.engine.gguf.open(path) as f:
        model = build_model(f, n_ctx=64, n_threads=2, n_batch=16)  # rings of window + 15 slots: they wrap
        runs = []
        for bound in (True, False):
            model.bound_decode = bound
            model.reset()
            model.forward(prompt)
            rows = [model.forward(steps[i:i + 1])[0].copy() for i in range(len(steps))]
            for n in (2, 3, 5, 7, 16):  # verified drafts: one-row groups (several sizes padded to a tile or not)
                start = model.n_past
                rows += list(model.forward_verify(steps[:n]))
                model.truncate(start)
            runs.append(np.stack(rows))
        assert runs[0].tobytes() == runs[1].tobytes()
        if type(model).forward_pass in (LlamaModel.forward_pass, Gemma3Model.forward_pass):
            assert set(model._decode_steps) == {(n, None if n == 1 else (1,) * n) for n in (1, 2, 3, 5, 7, 16)}
            assert all(len(steps) == model.config.n_layer for _, steps in model._decode_steps.values())


@pytest.mark.parametrize("kv_type, parallel", [("f16", False), ("f16", True), ("q8_0", False)])
def test_bound_decode_attention_keeps_the_bits(tmp_path, kv_type, parallel, monkeypatch):
    """The decode step's bound attention (ops.bound_decode_attention) takes attention()'s kernel for each position:
    the serial ones here, the parallel ones with their threshold at zero; a q8_0 cache goes through attend() as it
    is. Bit for bit against the steps with bound_decode off, as above."""
    from edgellm.engine.ops import attention_drivers
    if parallel:
        monkeypatch.setattr(attention_drivers, "ATTENTION_PARALLEL_MIN_WORK", 0)
    spec = registry_spec("llama", n_head=4, n_head_kv=2)
    prompt, steps = tokens_for(spec, 9), tokens_for(spec, 30, seed=9)
    with edgellm.engine.gguf.open(write_tiny_from_registry(tmp_path / "m.gguf", spec)) as f:
        model = build_model(f, n_ctx=64, n_threads=2, kv_type=kv_type)
        runs = []
        for bound in (True, False):
            model.bound_decode = bound
            model.reset()
            model.forward(prompt)
            runs.append(np.stack([model.forward(steps[i:i + 1])[0].copy() for i in range(len(steps))]))
        assert runs[0].tobytes() == runs[1].tobytes()
        assert all((st[2] is None) == (kv_type == "q8_0") for st in model._decode_steps[(1, None)][1])


def test_llama_sliding_window_is_honoured(tmp_path, exact_linear):
    """llama.attention.sliding_window (Mistral 7B v0.1) limits every layer: against the reference, and the same
    weights without the key give other logits once the prompt is longer than the window."""
    spec = TinySpec(arch="llama", weight_type="Q8_0", n_layer=3, sliding_window=GEMMA_WINDOW)
    model, tokens, windowed = check_fast_matches_reference(tmp_path, spec)
    assert [kv.window for kv in model.cache.layers] == [GEMMA_WINDOW] * 3
    check_decode_matches_batch(model, tokens, windowed)
    with open_tiny(tmp_path, TinySpec(arch="llama", weight_type="Q8_0", n_layer=3), "full.gguf") as f:
        full = build_model(f, n_ctx=64, n_threads=1, kv_type="f32").forward(tokens, all_logits=True)
    assert nmse(windowed[:GEMMA_WINDOW], full[:GEMMA_WINDOW]) < EXACT_VS_REFERENCE_NMSE
    assert nmse(windowed[-1], full[-1]) > 1e-3


@pytest.mark.parametrize("arch, drop, change, message", [
    ("gemma2", "gemma2.attn_logit_softcapping", {}, "lacks required key 'gemma2.attn_logit_softcapping'"),
    ("gemma2", "gemma2.final_logit_softcapping", {}, "lacks required key 'gemma2.final_logit_softcapping'"),
    ("gemma2", None, {"gemma2.attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be positive"),
    ("granite", "granite.logit_scale", {}, "lacks required key 'granite.logit_scale'"),
    ("granite", None, {"granite.rope.scaling.finetuned": False}, "without rope"),
    ("olmo2", None, {"olmo2.attention.sliding_window": 4096}, "OLMo 3"),
    ("llama", None, {"llama.attention.sliding_window": -1}, "must not be negative"),
    ("gpt-oss", "gpt-oss.attention.sliding_window", {}, "lacks required key 'gpt-oss.attention.sliding_window'"),
    ("gpt-oss", "gpt-oss.expert_count", {}, "expert_count is missing or 0"),
])
def test_added_architectures_refuse_keys_they_cannot_honour(tmp_path, arch, drop, change, message):
    with edgellm.engine.gguf.open(write_tiny_from_registry(tmp_path / "m.gguf", registry_spec(arch))) as f:
        view = _Renamed(f)
        view.metadata = {k: v for k, v in {**f.metadata, **change}.items() if k != drop}
        with pytest.raises(ModelError, match=message):
            build_model(view, n_ctx=64)


@pytest.mark.parametrize("arch", ["gemma2", "smollm3", "granite", "olmo2", "qwen3moe", "gpt-oss"])
def test_added_architectures_decode_several_sequences_as_one(tmp_path, arch):
    """forward_multi over a KVPool (gemma2's capped and gpt-oss's sink attention run per sequence; smollm3's rope-less
    layers, granite's scales and olmo2's norms in one batch of rows) gives each row the bits of decoding it alone."""
    from edgellm.engine.kvcache import KVPool
    with edgellm.engine.gguf.open(write_tiny_from_registry(tmp_path / "m.gguf", registry_spec(arch))) as f:
        model = build_model(f, n_ctx=64, n_threads=1)
        cfg = model.config
        pool = KVPool(3, 64, cfg.n_head_kv, cfg.head_dim, cfg.layer_windows(), model.n_batch, model.cache.kv_type)
        prompts = [tokens_for(registry_spec(arch), n, seed=n) for n in (9, 4, 7)]
        for cache, ids in zip(pool.caches, prompts):
            model.forward(ids, cache=cache)
        rows = model.forward_multi([5, 6, 7], pool.caches).copy()
        for ids, token, row in zip(prompts, [5, 6, 7], rows):
            model.reset()
            model.forward(ids)
            assert model.forward(np.array([token], np.int32))[0].tobytes() == row.tobytes()


# --- registry and refusals ------------------------------------------------------------------------------------

def test_registry_aliases_and_unknown_architecture():
    assert get_architecture("mistral") is get_architecture("llama")
    with pytest.raises(ModelError, match="unsupported model architecture 'mamba'"):
        get_architecture("mamba")


def test_alias_builds(tmp_path, exact_linear):
    spec = TinySpec(arch="mistral", weight_type="F32")
    check_fast_matches_reference(tmp_path, spec)


class _Renamed:
    """A GGUF file view with one tensor removed or replaced, to provoke the checks."""

    def __init__(self, f, drop=None, replace=None):
        self.metadata = f.metadata
        self.tensors = dict(f.tensors)
        if drop:
            del self.tensors[drop]
        if replace:
            self.tensors.update(replace)


def test_missing_tensor_is_named(tmp_path):
    with open_tiny(tmp_path, TinySpec()) as f:
        with pytest.raises(ModelError, match="blk.1.ffn_up.weight"):
            build_model(_Renamed(f, drop="blk.1.ffn_up.weight"), n_ctx=16)


def test_wrong_shape_is_named(tmp_path):
    with open_tiny(tmp_path, TinySpec()) as f:
        wrong = f.tensors["blk.0.attn_q.weight"]  # (64, 64) where attn_k (32, 64) belongs
        with pytest.raises(ModelError, match="blk.0.attn_k.weight.*shape"):
            build_model(_Renamed(f, replace={"blk.0.attn_k.weight": wrong}), n_ctx=16)


def test_quantized_norm_is_refused(tmp_path):
    with open_tiny(tmp_path, TinySpec()) as f:
        with pytest.raises(ModelError, match="output_norm.weight"):
            build_model(_Renamed(f, replace={"output_norm.weight": f.tensors["blk.0.attn_q.weight"]}), n_ctx=16)


def test_partial_biases_are_refused(tmp_path):
    with open_tiny(tmp_path, TinySpec(arch="qwen2")) as f:
        view = _Renamed(f, drop="blk.0.attn_k.bias")
        view.metadata = {**f.metadata, "general.architecture": "llama"}  # llama: biases optional, all or none
        view.metadata = {k.replace("qwen2.", "llama."): v for k, v in view.metadata.items()}
        with pytest.raises(ModelError, match="layer 0 has only some"):
            build_model(view, n_ctx=16, kv_type="f32")
    with open_tiny(tmp_path, TinySpec(arch="qwen2"), "q2.gguf") as f:  # qwen2: biases required
        with pytest.raises(ModelError, match="blk.0.attn_k.bias"):
            build_model(_Renamed(f, drop="blk.0.attn_k.bias"), n_ctx=16)


def test_missing_config_key_is_named(tmp_path):
    with open_tiny(tmp_path, TinySpec()) as f:
        view = _Renamed(f)
        view.metadata = {k: v for k, v in f.metadata.items() if k != "llama.feed_forward_length"}
        with pytest.raises(ModelError, match="llama.feed_forward_length"):
            build_model(view, n_ctx=16, kv_type="f32")


def test_bad_tokens_and_full_context(tmp_path):
    spec = TinySpec()
    with open_tiny(tmp_path, spec) as f:
        model = build_model(f, n_ctx=8, n_threads=1, kv_type="f32")
        with pytest.raises(ModelError, match="outside the vocabulary"):
            model.forward([spec.n_vocab])
        with pytest.raises(ModelError, match="at least one token"):
            model.forward([])
        model.context_shift = False  # with it (the default) a full context shifts instead: tests/test_kv_ring_*
        model.forward(np.arange(6))
        with pytest.raises(ModelError, match="context full"):
            model.forward(np.arange(3))
        assert model.n_past == 6
        model.forward(np.arange(2))
        assert model.n_past == 8


@pytest.mark.parametrize("ggml_type", ["F32", "F16", "BF16"])
def test_norm_vectors_read_as_gguf_py_dequantizes_them(ggml_type):
    """Norm weights and biases are read with numpy alone (gguf-py stays out of the load path): the values must be
    gguf-py's dequantization exactly; an F32 vector stays a view of the file's bytes (no copy at load)."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from edgellm.engine.models.loading import _as_float32_vector
    values = np.random.default_rng(0).standard_normal(576).astype(np.float32) * 3
    values[:4] = [0.0, -0.0, 65504.0, 1e-8]
    if ggml_type == "F32":
        raw = values.view(np.uint8)
    elif ggml_type == "F16":
        raw = values.astype("<f2").view(np.uint8)
    else:  # BF16: the top 16 bits of each float32 (truncated)
        raw = (values.view("<u4") >> 16).astype("<u2").view(np.uint8)
    raw = np.frombuffer(raw.tobytes(), np.uint8)  # read-only, as a mapped file
    got = _as_float32_vector(SimpleNamespace(data=raw, ggml_type=ggml_type))
    want = np.asarray(gguf_dequantize(raw, GGMLQuantizationType[ggml_type]), np.float32).reshape(-1)
    assert got.dtype == np.float32 and got.shape == (576,)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit, signed zeros included
    assert np.shares_memory(got, raw) == (ggml_type == "F32")


# --- fused GGUF tensors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_tokens", [1, 5])
def test_fused_projections_load_as_themselves_and_split_into_the_separate_products(n_tokens):
    """A fused blk.N.attn_qkv.weight (Q, K, V stacked by rows, as llama.cpp's converter writes phi3) and an ffn_up
    holding gate then up keep their own names on the layer (the derived QuantGroups are qkv_group / gate_up_group,
    names no GGUF tensor has), and their split product equals the separate matrices' bit for bit (Q8_0: every row
    is its own dot product, whatever the matrix's height)."""
    from edgellm.quant import QuantLinear

    from edgellm.engine.models.linear import group_projections, project_gate_up, project_qkv
    from edgellm.engine.models.loading import layer_weights
    from helpers_tiny_gguf import random_matrix_bytes

    rng = np.random.default_rng(3)
    d, q_dim, kv_dim, n_ff = 64, 64, 32, 96
    parts = {name: random_matrix_bytes(rng, (rows, d), "Q8_0")
             for name, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim), ("ffn_gate", n_ff),
                                ("ffn_up", n_ff))}
    separate = {f"blk.0.{name}.weight": QuantLinear(b, "Q8_0", (b.shape[0], d)) for name, b in parts.items()}
    qkv_bytes = np.concatenate([parts["attn_q"], parts["attn_k"], parts["attn_v"]])
    gate_up_bytes = np.concatenate([parts["ffn_gate"], parts["ffn_up"]])
    fused = {"blk.0.attn_qkv.weight": QuantLinear(qkv_bytes, "Q8_0", (q_dim + 2 * kv_dim, d)),
             "blk.0.ffn_up.weight": QuantLinear(gate_up_bytes, "Q8_0", (2 * n_ff, d))}

    plain, joined = layer_weights(separate, 0), layer_weights(fused, 0)
    for layer in (plain, joined):
        group_projections(layer)
    assert joined.attn_qkv is fused["blk.0.attn_qkv.weight"] and joined.ffn_up is fused["blk.0.ffn_up.weight"]
    assert joined.qkv_group is None and joined.gate_up_group is None
    assert plain.qkv_group is not None and plain.gate_up_group is not None  # Q8_0 groups: the grouped path runs

    x = rng.standard_normal((n_tokens, d)).astype(np.float32)
    outs = {}
    for key, layer in (("plain", plain), ("joined", joined)):
        q, k, v = (np.empty((n_tokens, n), np.float32) for n in (q_dim, kv_dim, kv_dim))
        gate, up = (np.empty((n_tokens, n_ff), np.float32) for _ in range(2))
        project_qkv(layer, x, q, k, v, None)
        project_gate_up(layer, x, gate, up, None)
        outs[key] = (q, k, v, gate, up)
    for want, got in zip(outs["plain"], outs["joined"]):
        np.testing.assert_array_equal(got, want)

"""Mixture-of-experts feed-forward (edgellm/engine/models/moe.py): the routing kernel against its reference, the F32
one-row product llama.cpp's router takes on decode, only the chosen experts read, each once per batch, and several
sequences in one batch getting each sequence's own bits. Exactness against llama.cpp: test_tiny_archs_llama_cpp.py
(qwen3moe_8x2, qwen3moe_32x4, mixtral_8x2)."""
import numpy as np
import pytest

import edgellm
import edgellm.engine.gguf
from edgellm.engine.kvcache import KVPool
from edgellm.engine.models import build_model, moe
from edgellm.engine.reference import ReferenceModel
from edgellm.errors import ModelError
from edgellm.quant import QuantLinear
from edgellm.quant.kernels_float import matmul_f32
from helpers_tiny_gguf import TinySpec, write_tiny_from_registry
from test_models_tiny import (ANY_ARCH_VS_REFERENCE_NMSE, check_decode_matches_batch, exact_linear,  # noqa: F401
                              nmse, tokens_for)

# float32 softmax and division against float64: a few ulps of the weights.
ROUTE_WEIGHTS_RTOL = 1e-5
EXPERT_KEYS = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 64}


def moe_spec(arch="qwen3moe", **keys):
    keys = {f"{arch}.{k}": v for k, v in {**EXPERT_KEYS, **keys}.items()}
    return TinySpec(arch=arch, weight_type="Q8_0", n_layer=3, n_embd=64, n_head=2, n_head_kv=1, head_dim=32,
                    extra_keys=keys)


@pytest.mark.parametrize("n_expert, n_used", [(8, 2), (12, 3), (32, 4), (128, 8)])
def test_route_matches_reference(n_expert, n_used):
    rng = np.random.default_rng(n_expert)
    logits = (rng.standard_normal((37, n_expert)) * 3).astype(np.float32)
    ids = np.zeros((37, n_used), np.int32)
    weights = np.zeros((37, n_used), np.float32)
    ref_ids, ref_w = moe.route_ref(logits, n_used)
    moe.route(logits.copy(), n_used, 0.0, ids, weights)
    assert np.array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=ROUTE_WEIGHTS_RTOL)
    moe.route(logits.copy(), n_used, 2.5, ids, weights)  # expert_weights_scale
    np.testing.assert_allclose(weights, 2.5 * ref_w, rtol=ROUTE_WEIGHTS_RTOL)


def _ggml_vec_dot_f32(w, x):
    """ggml_vec_dot_f32's order (AVX2) in float32 numpy. Its fma is a float64 product (exact for float32 factors)
    plus the accumulator, rounded to float64 and then to float32: fma's bits except in rare double-rounding ties,
    which this seed's data does not hit. The last len % 32 products are rounded, then added."""
    acc = np.zeros((4, 8), np.float32)
    n32 = len(x) - len(x) % 32
    for k in range(0, n32, 32):
        for j in range(4):
            sl = slice(k + 8 * j, k + 8 * j + 8)
            acc[j] = (w[sl].astype(np.float64) * x[sl].astype(np.float64) + acc[j].astype(np.float64)).astype(
                np.float32)
    v = (acc[0] + acc[2]) + (acc[1] + acc[3])
    t = v[:4] + v[4:]
    s = (t[0] + t[1]) + (t[2] + t[3])
    for k in range(n32, len(x)):
        s = s + w[k] * x[k]
    return s


@pytest.mark.parametrize("n_in", [256, 48])  # 48: a row with 16 products past the last 32
def test_f32_one_row_product_sums_as_llama_cpp(n_in):
    """A one-row F32 product (a decode step's router, any F32 matrix) in ggml_vec_dot_f32's order; the rows of a
    batch keep the batched order, and a batch of one-row sequences takes the one-row order per row."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, n_in)) * 2.0 ** rng.integers(-3, 3, (24, n_in))).astype(np.float32)
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    lin = QuantLinear(w.view(np.uint8).reshape(-1), "F32", w.shape)
    one = np.empty(24, np.float32)
    lin.matvec(x[0], one)
    assert np.array_equal(one, np.array([_ggml_vec_dot_f32(w[r], x[0]) for r in range(24)], np.float32))
    batch = np.empty((3, 24), np.float32)
    lin.matmul(x, batch)
    assert not np.array_equal(batch[0], one)  # this data is chosen so the two orders round apart
    several = np.empty((3, 24), np.float32)
    lin.matmul(x, several, sizes=(1, 2))
    assert np.array_equal(several[0], one) and np.array_equal(several[1:], batch[1:])
    out = np.empty((3, 24), np.float32)
    matmul_f32(lin.data, lin.row_bytes, x, out, np.zeros(3, np.int8))  # every row a batch of its own
    lin.matmul(x, batch, sizes=(1, 1, 1))
    assert np.array_equal(out, batch)


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_experts_against_the_reference(tmp_path, exact_linear, arch):
    spec = moe_spec(arch)
    with edgellm.engine.gguf.open(write_tiny_from_registry(tmp_path / "m.gguf", spec)) as f:
        model = build_model(f, n_ctx=64, n_threads=2, kv_type="f32")
        assert model.config.experts.n_expert == 8 and model.config.experts.n_used == 2
        tokens = tokens_for(spec)
        fast = model.forward(tokens, all_logits=True)
        assert nmse(fast, ReferenceModel(f).logits(tokens)) < ANY_ARCH_VS_REFERENCE_NMSE
        check_decode_matches_batch(model, tokens, fast)


def test_only_chosen_experts_are_read_each_once_per_batch(tmp_path, monkeypatch):
    calls = []
    real = moe.ExpertMatrices.matmul

    def spy(self, e, x, out, group_sizes):
        calls.append((id(self), e, x.shape[0]))
        real(self, e, x, out, group_sizes)
    monkeypatch.setattr(moe.ExpertMatrices, "matmul", spy)
    spec = moe_spec()
    with edgellm.engine.gguf.open(write_tiny_from_registry(tmp_path / "m.gguf", spec)) as f:
        model = build_model(f, n_ctx=64, n_threads=1)
        tokens = tokens_for(spec)
        model.forward(tokens)
        n_rows = len(tokens) * model.config.experts.n_used
        for layer in model.layers:
            for stack in (layer.ffn_gate_exps, layer.ffn_up_exps, layer.ffn_down_exps):
                mine = [(e, n) for i, e, n in calls if i == id(stack)]
                experts = [e for e, _ in mine]
                assert len(experts) == len(set(experts))  # each chosen expert once for the whole batch
                assert sum(n for _, n in mine) == n_rows  # every routed row, in one call per expert
        calls.clear()
        chosen = []
        real_chosen = moe.ExpertMatrices.matmul_chosen
        monkeypatch.setattr(moe.ExpertMatrices, "matmul_chosen",
                            lambda self, ids, *a, **k: (chosen.append(tuple(ids)), real_chosen(self, ids, *a, **k)))
        model.forward(tokens[:1])  # decode: only the top-k experts of that row, in one call per stage
        assert not calls and len(chosen) == 2 * model.config.n_layer
        assert all(len(ids) == len(set(ids)) == model.config.experts.n_used for ids in chosen)


def test_several_sequences_in_one_batch_get_their_own_bits(tmp_path):
    """forward_multi (decode) and a prompt batch of two sequences: each row equals its sequence run alone."""
    spec = moe_spec(expert_count=8, expert_used_count=3)
    with edgellm.engine.gguf.open(write_tiny_from_registry(tmp_path / "m.gguf", spec)) as f:
        model = build_model(f, n_ctx=64, n_threads=1)
        cfg = model.config
        prompts = [tokens_for(spec, n, seed=n) for n in (9, 4, 7)]
        pool = KVPool(3, 64, cfg.n_head_kv, cfg.head_dim, cfg.layer_windows(), model.n_batch, model.cache.kv_type)
        for cache, ids in zip(pool.caches, prompts):
            model.forward(ids, cache=cache)
        rows = model.forward_multi([5, 6, 7], pool.caches).copy()
        alone = []
        for ids, token, row in zip(prompts, [5, 6, 7], rows):
            model.reset()
            alone.append(model.forward(ids, all_logits=True).copy())
            assert model.forward(np.array([token], np.int32))[0].tobytes() == row.tobytes()
        pool = KVPool(2, 64, cfg.n_head_kv, cfg.head_dim, cfg.layer_windows(), model.n_batch, model.cache.kv_type)
        tokens = np.concatenate(prompts[:2]).astype(np.int32)
        positions = np.concatenate([np.arange(len(p)) for p in prompts[:2]]).astype(np.int32)
        logits = np.empty((len(tokens), cfg.n_vocab), np.float32)
        n0 = len(prompts[0])
        model.forward_batch(tokens, positions, logits, groups=((0, n0, pool.caches[0]),
                                                               (n0, len(tokens), pool.caches[1])))
        assert logits[:n0].tobytes() == alone[0].tobytes() and logits[n0:].tobytes() == alone[1].tobytes()


@pytest.mark.parametrize("keys, message", [
    ({"expert_count": 0}, "expert_count is missing or 0"),
    ({"expert_used_count": 9}, "between 1 and expert_count"),
    ({"expert_shared_count": 1}, "shared experts"),
    ({"expert_gating_func": 2}, "softmax gating only"),
])
def test_expert_keys_it_cannot_honour_are_refused(tmp_path, keys, message):
    good = write_tiny_from_registry(tmp_path / "m.gguf", moe_spec())
    with edgellm.engine.gguf.open(good) as f:
        class View:
            metadata = {**f.metadata, **{f"qwen3moe.{k}": v for k, v in keys.items()}}
            tensors = f.tensors
        with pytest.raises(ModelError, match=message):
            build_model(View(), n_ctx=64)


def test_generate_batch_equals_each_prompt_alone(tmp_path, smollm2_path):
    """generate_batch on a qwen3moe file (tests/helpers_tiny_archs.py's, SmolLM2's tokenizer): the tokens of
    each prompt decoded alone, with the prompts' routed rows grouped by expert across sequences."""
    from helpers_tiny_archs import TINY_ARCHS, write_tiny_arch
    path = tmp_path / "moe.gguf"
    write_tiny_arch(path, TINY_ARCHS["qwen3moe_8x2"], smollm2_path)
    m = edgellm.load(str(path), n_ctx=128, n_threads=2)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    batch = [c.tokens for c in m.complete_batch(prompts, **kw)]
    assert batch == [m.complete(p, **kw).tokens for p in prompts]


def test_memory_counts_what_every_token_reads(tmp_path):
    """The up-front check counts the shared tensors and one token's share of the experts; a file larger than the
    memory available gets a warning giving the figures; `info` shows the total and active parameters."""
    from edgellm.engine import validate
    from edgellm.prep.info import _fmt_count, describe
    spec = moe_spec(expert_count=8, expert_used_count=2)
    path = write_tiny_from_registry(tmp_path / "m.gguf", spec)
    with edgellm.engine.gguf.open(path) as f:
        w = validate.weight_residency(f)
        experts = [t for n, t in f.tensors.items() if n.endswith("_exps.weight")]
        expert_bytes, expert_params = sum(t.nbytes for t in experts), sum(t.n_elements for t in experts)
        assert w.total_bytes == sum(t.nbytes for t in f.tensors.values())
        assert w.resident_bytes == w.total_bytes - expert_bytes + expert_bytes * 2 // 8
        assert w.active_params == w.total_params - expert_params + expert_params * 2 // 8
        weights, _ = validate.model_memory_needs(f, 64)
        assert weights == w.resident_bytes
        from edgellm.prep.bench import weight_bytes_per_token
        assert weight_bytes_per_token(f) == w.resident_bytes  # the bandwidth bound of `edgellm bench` (tied output)
        assert validate.paging_warning(f, available=w.total_bytes) is None
        warning = validate.paging_warning(f, available=w.total_bytes - 1)
        assert f"{w.active_params:,} of {w.total_params:,} parameters active" in warning
    text = describe(str(path))
    assert f"({_fmt_count(w.active_params)} active per token)" in text and "read by every token" in text


def test_load_warns_when_the_file_is_paged(tmp_path, smollm2_path, monkeypatch):
    """edgellm.load passes paging_warning's text on as a warning (and loads)."""
    from edgellm.engine import validate
    from helpers_tiny_archs import TINY_ARCHS, write_tiny_arch
    path = tmp_path / "moe.gguf"
    write_tiny_arch(path, TINY_ARCHS["qwen3moe_8x2"], smollm2_path)
    seen = []
    monkeypatch.setattr(validate, "paging_warning", lambda f, available=None: seen.append(f.path) or "paged in")
    with pytest.warns(UserWarning, match="moe.gguf: paged in"):
        m = edgellm.load(str(path), n_ctx=64)
    assert seen == [str(path)] and m.n_ctx == 64


@pytest.mark.parametrize("weight_type", ["Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q4_0", "Q8_0"])
def test_one_token_chosen_experts_in_one_call_keep_the_bits(tmp_path, monkeypatch, weight_type):
    """Decode runs a token's chosen experts of a stack in one kernel call per stage
    (ExpertMatrices.matmul_chosen): the logits equal the per-expert QuantLinear calls' bit for bit, with the
    experts each token picks differing from step to step."""
    spec = TinySpec(arch="qwen3moe", weight_type=weight_type, n_layer=2, n_embd=256, n_head=2, n_head_kv=1,
                    head_dim=128, extra_keys={"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 3,
                                              "qwen3moe.expert_feed_forward_length": 256})
    path = write_tiny_from_registry(tmp_path / "m.gguf", spec)
    tokens = tokens_for(spec, 12)
    chosen = []
    real = moe.ExpertMatrices.matmul_chosen

    def spy(self, ids, *args, **kwargs):
        chosen.append(tuple(ids))
        real(self, ids, *args, **kwargs)
    monkeypatch.setattr(moe.ExpertMatrices, "matmul_chosen", spy)

    codes = {}

    def use_fused(model, fused):
        for layer in model.layers:
            for stack in (layer.ffn_gate_exps, layer.ffn_up_exps, layer.ffn_down_exps):
                assert stack.ggml_type == weight_type and codes.setdefault(id(stack), stack.code) >= 0
                stack.code = codes[id(stack)] if fused else -1

    def decode(fused):
        codes.clear()
        with edgellm.engine.gguf.open(path) as f:
            model = build_model(f, n_ctx=64, n_threads=2)
            use_fused(model, fused)
            return np.stack([model.forward(tokens[i:i + 1])[0].copy() for i in range(len(tokens))])

    fused = decode(True)
    assert len(chosen) == 2 * 2 * len(tokens)  # gate+up, then down: two calls per layer and token
    assert len(set(chosen)) > 1
    chosen.clear()
    assert decode(False).tobytes() == fused.tobytes() and not chosen
    # This file's random K-quant bytes give hidden states so large that routing is one-hot; the block alone, on
    # inputs whose every chosen expert has weight, must agree too.
    rng = np.random.default_rng(1)
    codes.clear()
    with edgellm.engine.gguf.open(path) as f:
        model = build_model(f, n_ctx=64, n_threads=2)
        cfg, buf = model.config.experts, model.expert_buffers
        for _ in range(4):
            m = (rng.standard_normal((1, spec.n_embd)) * 0.02).astype(np.float32)
            outs = []
            for fused in (True, False):
                use_fused(model, fused)
                out = np.empty_like(m)
                moe.expert_ffn(model.layers[1], m, out, cfg, buf, None)
                outs.append(out)
            assert buf.weights[0].min() > 0.02  # each chosen expert counts
            assert outs[0].tobytes() == outs[1].tobytes()

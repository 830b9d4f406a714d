"""Tiny random models end to end on the CUDA path, in Numba's CUDA simulator: a prompt split into batches, then
token-by-token decoding, against the float64 numpy reference. (The CPU path meets the same reference on the same
architectures and formats in tests/test_models_tiny.py; comparing with it here too would only compile CPU kernels in
this child process while the main test process compiles them.)

Runs only under NUMBA_ENABLE_CUDASIM=1 (see tests/test_cuda_simulator.py, which runs it in a subprocess).
n_batch = 4 splits the 6-token prompt and, for Gemma, makes the sliding-window layers' ring (window 4 + 4 - 1
slots) wrap within the 9 positions; 9 positions also span two of the simulator's 8-slot attention tiles.
"""

import os

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("CUDA simulator tests: run through tests/test_cuda_simulator.py", allow_module_level=True)

import helpers_cudasim  # noqa: E402

helpers_cudasim.prepare()  # before any kernel runs: see its docstring

import edgellm.engine.gguf  # noqa: E402
from edgellm.engine.cuda import build_cuda_model  # noqa: E402
from edgellm.engine.reference import ReferenceModel  # noqa: E402
from helpers_tiny_gguf import TinySpec, write_tiny_model  # noqa: E402

# Device (float32 activations, dequantized weights) vs the float64 reference on the same weights: only float32
# rounding, ~1e-14 measured; a wrong op gives ~1e-1.
DEVICE_VS_REFERENCE_NMSE = 1e-9

N_CTX, N_BATCH, N_PROMPT, N_DECODE = 16, 4, 6, 3
SPECS = {
    # the real models' formats: SmolLM2 is Q4_1 with a Q8_0 embedding and an untied output here to use it;
    # Gemma 3 mixes Q5_0 with a Q8_0 embedding; qwen2 (q/k/v biases) and qwen3 (qk norm) with one layer each
    "llama": TinySpec(arch="llama", n_embd=64, n_head=2, n_head_kv=1, n_ff=64, n_vocab=64, weight_type="Q4_1",
                      embd_type="Q8_0", tied=False),
    "gemma3": TinySpec(arch="gemma3", n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=64, n_vocab=64,
                       sliding_window=4, weight_type="Q5_0", embd_type="Q8_0"),
    "qwen2": TinySpec(arch="qwen2", n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=64, n_vocab=64,
                      weight_type="Q8_0"),
    "qwen3": TinySpec(arch="qwen3", n_layer=1, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=64, n_vocab=64,
                      weight_type="Q8_0"),
    # llama.attention.sliding_window (Mistral 7B v0.1): every layer's ring slides on the device too
    "llama_swa": TinySpec(arch="llama", n_embd=64, n_head=2, n_head_kv=1, n_ff=64, n_vocab=64, weight_type="Q8_0",
                          sliding_window=3),
}
# Added architectures on the device, each on test_models_tiny's registry-built file of it (gemma2's capped scores
# and logits, granite's multipliers, olmo2's whole-projection QK norm and post-norms, phi3's fused matrices, smollm3's
# rope-less fourth layer)
REGISTRY_ARCHS = ("gemma2", "granite", "olmo2", "phi3", "smollm3")
# Architectures with no device forward pass: the GPU refuses them by name rather than run another model's.
CPU_ONLY = ("qwen3moe",)


def nmse(got, want):
    want = np.asarray(want, dtype=np.float64)
    return float(np.sum((got - want) ** 2) / np.sum(want**2))


def run_prompt_then_decode(model, tokens):
    """Logits of every position: the prompt in one call (split by n_batch inside), then one token per call."""
    prompt = model.forward(tokens[:N_PROMPT], all_logits=True)
    decoded = [model.forward(tokens[i:i + 1])[0].copy() for i in range(N_PROMPT, len(tokens))]
    return np.concatenate([prompt, np.stack(decoded)])


@pytest.mark.parametrize("arch", list(SPECS))
def test_tiny_model_matches_the_reference(tmp_path, arch):
    spec = SPECS[arch]
    tokens = np.random.default_rng(1).integers(0, spec.n_vocab, N_PROMPT + N_DECODE).astype(np.int32)
    with edgellm.engine.gguf.open(write_tiny_model(tmp_path / f"{arch}.gguf", spec)) as f:
        model = build_cuda_model(f, n_ctx=N_CTX, n_batch=N_BATCH)
        assert (model.n_vocab, model.n_ctx, model.n_past) == (spec.n_vocab, N_CTX, 0)
        device_logits = run_prompt_then_decode(model, tokens)
        assert model.n_past == len(tokens)
        reference = ReferenceModel(f).logits(tokens)
    assert device_logits.shape == (len(tokens), spec.n_vocab)
    assert nmse(device_logits, reference) < DEVICE_VS_REFERENCE_NMSE


@pytest.mark.parametrize("arch", REGISTRY_ARCHS)
def test_added_architecture_matches_the_reference(tmp_path, arch):
    from helpers_tiny_gguf import write_tiny_from_registry
    from test_models_tiny import registry_spec
    spec = registry_spec(arch, n_layer=4)  # (smollm3's fourth layer is rope-less; gemma2's layers alternate)
    tokens = np.random.default_rng(2).integers(0, spec.n_vocab, N_PROMPT + N_DECODE).astype(np.int32)
    with edgellm.engine.gguf.open(write_tiny_from_registry(tmp_path / f"{arch}.gguf", spec)) as f:
        device_logits = run_prompt_then_decode(build_cuda_model(f, n_ctx=N_CTX, n_batch=N_BATCH), tokens)
        reference = ReferenceModel(f).logits(tokens)
    assert nmse(device_logits, reference) < DEVICE_VS_REFERENCE_NMSE


@pytest.mark.parametrize("n_ctx", [512, 256])  # past phi3's original context (the long factors), and within
def test_phi3_longrope_on_the_device(tmp_path, n_ctx):
    """Fused q/k/v and gate/up matrices split by rows on the device, longrope's factors for the context and its
    attn_factor on cos and sin (helpers_tiny_llama_cpp's phi3 file, as the converter writes it)."""
    from helpers_tiny_llama_cpp import write_case
    tokens = np.random.default_rng(3).integers(0, 160, N_PROMPT + N_DECODE).astype(np.int32)
    with edgellm.engine.gguf.open(write_case(tmp_path / "phi3.gguf", "phi3_longrope_long")) as f:
        device_logits = run_prompt_then_decode(build_cuda_model(f, n_ctx=n_ctx, n_batch=N_BATCH), tokens)
        reference = ReferenceModel(f, n_ctx=n_ctx).logits(tokens)
    assert nmse(device_logits, reference) < DEVICE_VS_REFERENCE_NMSE


@pytest.mark.parametrize("arch", CPU_ONLY)
def test_architectures_without_a_device_pass_are_refused(tmp_path, arch):
    from edgellm.errors import ModelError
    from helpers_tiny_gguf import write_tiny_from_registry
    from test_models_tiny import registry_spec
    with edgellm.engine.gguf.open(write_tiny_from_registry(tmp_path / f"{arch}.gguf", registry_spec(arch))) as f:
        with pytest.raises(ModelError, match=f"architecture '{arch}' has no CUDA forward pass"):
            build_cuda_model(f, n_ctx=N_CTX, n_batch=N_BATCH)


def test_llama_with_experts_is_refused_on_the_device(tmp_path):
    from edgellm.errors import ModelError
    from helpers_tiny_gguf import write_tiny_from_registry
    from test_moe import moe_spec
    with edgellm.engine.gguf.open(write_tiny_from_registry(tmp_path / "mixtral.gguf", moe_spec("llama"))) as f:
        with pytest.raises(ModelError, match="llama files with experts .* have no CUDA forward pass"):
            build_cuda_model(f, n_ctx=N_CTX, n_batch=N_BATCH)


def test_reset_and_prefix_rewind_on_the_device(tmp_path):
    """After reset() a sequence starts over; rewinding the cache the way the API reuses a prompt prefix (host slot
    positions >= n marked empty, n_past = n) continues exactly like a fresh run, although the device keeps the
    stale slots (which the causal mask hides)."""
    spec = SPECS["gemma3"]
    rng = np.random.default_rng(2)
    first = rng.integers(0, spec.n_vocab, 7).astype(np.int32)  # positions 0..6 fill the 7-slot rings
    second = np.concatenate([first[:4], rng.integers(0, spec.n_vocab, 2).astype(np.int32)])
    with edgellm.engine.gguf.open(write_tiny_model(tmp_path / "gemma3.gguf", spec)) as f:
        model = build_cuda_model(f, n_ctx=N_CTX, n_batch=N_BATCH)
        fresh = model.forward(second, all_logits=True)
        model.reset()
        assert model.n_past == 0
        model.forward(first, all_logits=False)
        for layer in model.cache.layers:  # what edgellm.api.Model._rewind_cache does
            layer.slot_pos[layer.slot_pos >= 4] = -1
        model.cache.n_past = 4
        resumed = model.forward(second[4:], all_logits=True)
    assert nmse(resumed, fresh[4:]) < DEVICE_VS_REFERENCE_NMSE

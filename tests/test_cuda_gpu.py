"""The CUDA path on a real GPU, with the real launch shapes: kernels on larger shapes, tiny models of every
architecture, and the two real models against the CPU path and llama.cpp's recorded top-1 tokens.
Skipped where no GPU is usable (and under the simulator, which tests/test_cuda_simulator.py covers).
"""

import numpy as np
import pytest

from edgellm.engine.cuda import check_device, simulator_enabled

if simulator_enabled() or not check_device()[0]:
    pytest.skip(f"no usable GPU: {check_device()[1]}", allow_module_level=True)

from conftest import load_reference  # noqa: E402
from numba import cuda  # noqa: E402

import edgellm.engine.gguf  # noqa: E402
from edgellm.engine.cuda import build_cuda_model  # noqa: E402
from edgellm.engine.cuda.weights import DeviceMatrix  # noqa: E402
from edgellm.engine.models import build_model  # noqa: E402
from edgellm.engine.reference import ReferenceModel  # noqa: E402
from helpers_tiny_gguf import TinySpec, random_matrix_bytes, write_tiny_model  # noqa: E402
from edgellm.quant.reference import dequantize  # noqa: E402
from edgellm.quant.registry import records  # noqa: E402

# float32 accumulation (in another order than the simulator's, and with fused multiply-adds) vs float64.
MATMUL_NMSE = 1e-10
DEVICE_VS_REFERENCE_NMSE = 1e-9
# Real models: the CPU path rounds activations to 8 bits before each product; the device does not.
REAL_DEVICE_VS_CPU_NMSE = 1e-2
# Of the positions where llama.cpp's top-1 leads its runner-up by NEAR_TIE_LOGITS, the share we must match.
NEAR_TIE_LOGITS = 0.5
TOP1_AGREEMENT = 0.99
FORMATS = [r.name for r in records() if r.cuda]  # the formats with a CUDA branch
SPECS = {  # rows of 256 so K-quants fit; head sizes as the real models (64) and Gemma (256)
    "llama": TinySpec(arch="llama", n_embd=576, n_head=9, n_head_kv=3, n_ff=256, weight_type="Q4_1",
                      embd_type="Q8_0"),
    "gemma3": TinySpec(arch="gemma3", n_embd=256, n_head=4, n_head_kv=1, head_dim=256, n_ff=512,
                       sliding_window=8, weight_type="Q4_K", embd_type="Q8_0"),
    "qwen2": TinySpec(arch="qwen2", n_embd=256, n_head=4, n_head_kv=2, n_ff=512, weight_type="Q6_K"),
    "qwen3": TinySpec(arch="qwen3", n_embd=256, n_head=4, n_head_kv=2, head_dim=128, n_ff=512, weight_type="Q5_K"),
}


def nmse(got, want):
    want = np.asarray(want, dtype=np.float64)
    return float(np.sum((got - want) ** 2) / np.sum(want**2))


@pytest.mark.parametrize("ggml_type", FORMATS)
@pytest.mark.parametrize("n_tokens", [1, 19])
def test_matmul_on_the_gpu(ggml_type, n_tokens):
    shape = (67, 1024)  # rows not a multiple of the row group; 32 chunks: every lane of a warp has one
    raw = np.ascontiguousarray(random_matrix_bytes(np.random.default_rng(0), shape, ggml_type)).view(np.uint8)
    matrix = DeviceMatrix(raw.reshape(-1), ggml_type, shape)
    w = dequantize(raw.reshape(-1), ggml_type, shape).astype(np.float64)
    x = np.random.default_rng(1).standard_normal((n_tokens, shape[1])).astype(np.float32)
    out = cuda.device_array((n_tokens, shape[0]), dtype=np.float32)
    matrix.matmul(cuda.to_device(x), out)
    assert nmse(out.copy_to_host(), x.astype(np.float64) @ w.T) < MATMUL_NMSE


@pytest.mark.parametrize("arch", list(SPECS))
def test_tiny_models_on_the_gpu(tmp_path, arch):
    spec = SPECS[arch]
    tokens = np.random.default_rng(1).integers(0, spec.n_vocab, 40).astype(np.int32)
    with edgellm.engine.gguf.open(write_tiny_model(tmp_path / f"{arch}.gguf", spec)) as f:
        model = build_cuda_model(f, n_ctx=64, n_batch=16)
        prompt = model.forward(tokens[:30], all_logits=True)
        decoded = np.stack([model.forward(tokens[i:i + 1])[0].copy() for i in range(30, 40)])
        reference = ReferenceModel(f).logits(tokens)
    assert nmse(np.concatenate([prompt, decoded]), reference) < DEVICE_VS_REFERENCE_NMSE


def test_real_models_on_the_gpu(real_model):
    name, path = real_model
    _, npz = load_reference(name)
    ids = npz["p0_ids"]
    with edgellm.engine.gguf.open(path) as f:
        gpu = build_cuda_model(f, n_ctx=1024).forward(ids, all_logits=True)
        cpu = build_model(f, n_ctx=1024, n_threads=2).forward(ids, all_logits=True)
    assert nmse(gpu, cpu) < REAL_DEVICE_VS_CPU_NMSE
    top_ids, top_logits = npz["p0_topk_ids"], npz["p0_topk_logits"]
    decisive = top_logits[:, 0] - top_logits[:, 1] > NEAR_TIE_LOGITS
    agree = gpu.argmax(axis=-1) == top_ids[:, 0]
    assert agree[decisive].mean() >= TOP1_AGREEMENT

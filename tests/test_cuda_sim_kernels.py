"""Every CUDA kernel, run in Numba's CUDA simulator on small shapes, against the numpy references
(quant.reference.dequantize then float64 products; edgellm.engine.ops' *_ref functions).

Runs only under NUMBA_ENABLE_CUDASIM=1, which must be set before numba.cuda is first imported: the main suite
collects this module and skips it, and tests/test_cuda_simulator.py runs it in a subprocess with the variable set.
The shapes are chosen against the simulator's launch shapes (edgellm/engine/cuda/*_kernels.py): several lanes per row,
a row stride, two token tiles, attention over more than one tile of slots.
"""

import os

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("CUDA simulator tests: run through tests/test_cuda_simulator.py", allow_module_level=True)

import helpers_cudasim  # noqa: E402

helpers_cudasim.prepare()  # before any kernel runs: see its docstring

from numba import cuda  # noqa: E402

from edgellm.engine import ops  # noqa: E402
from edgellm.engine.cuda import op_kernels, weights  # noqa: E402
from edgellm.engine.cuda.kvcache import DeviceKVCache  # noqa: E402
from helpers_tiny_gguf import random_matrix_bytes  # noqa: E402
from edgellm.quant.reference import dequantize  # noqa: E402
from edgellm.quant.registry import records  # noqa: E402

# float32 accumulation against a float64 product: relative error ~1e-7 per output, so NMSE ~1e-14; 1e-10 leaves
# room for long rows while any wrong scale, nibble or offset gives NMSE ~1e-2 or worse.
MATMUL_NMSE = 1e-10
# Norms, rope, attention, activations: float32 arithmetic against float64 references.
OP_MAX_REL = 1e-5

# The formats with a CUDA branch (the registry's cuda flag): one 32-weight chunk a block, or eight a super-block
LEGACY_FORMATS = [r.name for r in records() if r.cuda and r.format.block_size <= 32]
K_FORMATS = [r.name for r in records() if r.cuda and r.format.block_size == 256]
N_TOKENS = 5  # two token tiles of the simulator's TOKENS_PER_BLOCK = 4


def nmse(got, want):
    want = np.asarray(want, dtype=np.float64)
    return float(np.sum((got - want) ** 2) / np.sum(want**2))


def max_rel(got, want):
    want = np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def weight_bytes(ggml_type, shape, seed=0):
    """Raw bytes of a random (n_out, n_in) matrix: quantized by gguf-py, or valid random K-quant blocks."""
    values = random_matrix_bytes(np.random.default_rng(seed), shape, ggml_type)
    return np.ascontiguousarray(values).view(np.uint8).reshape(-1)


def shape_for(ggml_type):
    # 5 rows: one full and one partial row group of 4; legacy rows of 4 chunks and K rows of 2 super-blocks
    # (16 chunks) so each of the 2 lanes strides over several chunks
    return (5, 128) if ggml_type in LEGACY_FORMATS else (3, 512)


@pytest.mark.parametrize("ggml_type", LEGACY_FORMATS + K_FORMATS)
def test_matmul_matches_dequantized_float64_product(ggml_type):
    shape = shape_for(ggml_type)
    raw = weight_bytes(ggml_type, shape)
    matrix = weights.DeviceMatrix(raw, ggml_type, shape)
    w = dequantize(raw, ggml_type, shape).astype(np.float64)
    x = np.random.default_rng(1).standard_normal((N_TOKENS, shape[1])).astype(np.float32)
    out = cuda.device_array((N_TOKENS, shape[0]), dtype=np.float32)
    matrix.matmul(cuda.to_device(x), out)
    assert nmse(out.copy_to_host(), x.astype(np.float64) @ w.T) < MATMUL_NMSE
    # decode: a single token
    one = cuda.device_array((1, shape[0]), dtype=np.float32)
    matrix.matmul(cuda.to_device(x[2:3]), one)
    assert nmse(one.copy_to_host(), x[2:3].astype(np.float64) @ w.T) < MATMUL_NMSE


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q6_K"])
def test_matmul_accumulates_into_the_residual(ggml_type):
    shape = shape_for(ggml_type)
    raw = weight_bytes(ggml_type, shape, seed=3)
    matrix = weights.DeviceMatrix(raw, ggml_type, shape)
    w = dequantize(raw, ggml_type, shape).astype(np.float64)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, shape[1])).astype(np.float32)
    residual = rng.standard_normal((2, shape[0])).astype(np.float32)
    out = cuda.to_device(residual)
    matrix.matmul(cuda.to_device(x), out, accumulate=True)
    assert nmse(out.copy_to_host(), residual + x.astype(np.float64) @ w.T) < MATMUL_NMSE


@pytest.mark.parametrize("ggml_type", LEGACY_FORMATS + K_FORMATS)
def test_get_rows_is_the_reference_dequantization(ggml_type):
    """The simulator evaluates the same float32 operations in the same order as quant.reference: equal bits."""
    shape = shape_for(ggml_type)
    raw = weight_bytes(ggml_type, shape, seed=5)
    matrix = weights.DeviceMatrix(raw, ggml_type, shape)
    w = dequantize(raw, ggml_type, shape)
    ids = np.array([2, 0, 2], dtype=np.int32)
    out = cuda.device_array((3, shape[1]), dtype=np.float32)
    matrix.get_rows(cuda.to_device(ids), out, scale=1.0)
    np.testing.assert_array_equal(out.copy_to_host(), w[ids])
    matrix.get_rows(cuda.to_device(ids[:1]), out[:1], scale=2.5)  # gemma scales its embeddings
    np.testing.assert_array_equal(out[:1].copy_to_host(), w[ids[:1]] * np.float32(2.5))


def test_unsupported_format_and_row_length_are_refused():
    from edgellm.errors import ModelError
    for r in records():  # every format without a CUDA branch, by name, before anything reaches the device
        if not r.cuda:
            fmt = r.format
            with pytest.raises(ModelError, match=f"'blk.0.ffn_down.weight' is {r.name}; the CUDA kernels read"):
                weights.DeviceMatrix(np.zeros(fmt.row_bytes(256), np.uint8), r.name, (1, 256), "blk.0.ffn_down.weight")
    with pytest.raises(ModelError, match="multiple of 32"):
        weights.DeviceMatrix(np.zeros(4 * 40, np.uint8), "F32", (1, 40), "odd")


@pytest.mark.parametrize("accumulate", [False, True])
def test_rms_norm(accumulate):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 37)).astype(np.float32)  # 37: a partial last stride of the block's threads
    w = (1 + 0.2 * rng.standard_normal(37)).astype(np.float32)
    base = rng.standard_normal((3, 37)).astype(np.float32)
    out = cuda.to_device(base if accumulate else np.zeros_like(x))
    weights.rms_norm(cuda.to_device(x), cuda.to_device(w), 1e-6, out, accumulate=accumulate)
    want = ops.rms_norm_ref(x, w, 1e-6).astype(np.float64) + (base if accumulate else 0)
    assert max_rel(out.copy_to_host(), want) < OP_MAX_REL


@pytest.mark.parametrize("neox,use_norm,n_rot", [(False, False, 16), (True, True, 16), (True, False, 12)])
def test_qk_norm_rope_store(neox, use_norm, n_rot):
    """q and k normed per head (qwen3, gemma3) and rotated; k and v land in ring slots p % capacity."""
    rng = np.random.default_rng(7)
    n_tokens, n_head, n_head_kv, head_dim = 3, 4, 2, 16
    q = rng.standard_normal((n_tokens, n_head, head_dim)).astype(np.float32)
    k = rng.standard_normal((n_tokens, n_head_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((n_tokens, n_head_kv, head_dim)).astype(np.float32)
    q_norm = (1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32)
    k_norm = (1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32)
    positions = np.array([6, 7, 8], dtype=np.int32)
    inv_freq = ops.rope_inv_freq(n_rot, 10000.0)
    cache = DeviceKVCache(n_ctx=64, n_head_kv=n_head_kv, head_dim=head_dim, windows=[3], n_batch=3)  # 5 slots
    kv = cache.layers[0]
    q_dev, k_dev = cuda.to_device(q), cuda.to_device(k)
    weights.qk_norm_rope_store(q_dev, k_dev, cuda.to_device(v), cuda.to_device(positions), cuda.to_device(inv_freq),
                               neox, cuda.to_device(q_norm), cuda.to_device(k_norm), use_norm, 1e-6, kv)
    if use_norm:
        q = ops.rms_norm_ref(q.reshape(-1, head_dim), q_norm, 1e-6).reshape(q.shape)
        k = ops.rms_norm_ref(k.reshape(-1, head_dim), k_norm, 1e-6).reshape(k.shape)
    want_q, want_k = ops.rope_ref(q, positions, inv_freq, neox), ops.rope_ref(k, positions, inv_freq, neox)
    assert max_rel(q_dev.copy_to_host(), want_q) < OP_MAX_REL
    assert max_rel(k_dev.copy_to_host(), want_k) < OP_MAX_REL
    slots = positions % 5
    np.testing.assert_array_equal(kv.slot_pos_device.copy_to_host()[slots], positions)
    k_cache, v_cache = kv.k.copy_to_host(), kv.v.copy_to_host()
    assert max_rel(k_cache[:, slots].transpose(1, 0, 2), want_k) < OP_MAX_REL
    np.testing.assert_array_equal(v_cache[:, slots].transpose(1, 0, 2), v)


ATTENTION_CASES = {
    # name: (slot positions (-1 empty), query positions, window)
    "full, two tiles": (list(range(11)) + [-1], [8, 9, 10], 0),
    "ring, unordered": ([8, 9, 10, 11, 4, 5, 6, 7, -1, -1], [10, 11], 0),
    "window, first tile all too old": (list(range(12)), [10, 11], 3),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_over_cache_slots(case):
    slot_positions, q_positions, window = ATTENTION_CASES[case]
    slot_positions, q_positions = np.array(slot_positions, np.int32), np.array(q_positions, np.int32)
    rng = np.random.default_rng(8)
    n_head, n_head_kv, head_dim, capacity = 4, 2, 16, len(slot_positions)  # grouped-query: 2 heads per kv head
    q = rng.standard_normal((len(q_positions), n_head, head_dim)).astype(np.float32)
    k = rng.standard_normal((n_head_kv, capacity, head_dim)).astype(np.float32)
    v = rng.standard_normal((n_head_kv, capacity, head_dim)).astype(np.float32)
    kv = type("KV", (), {})()
    kv.k, kv.v, kv.window = cuda.to_device(k), cuda.to_device(v), window
    kv.slot_pos_device = cuda.to_device(slot_positions)
    out = cuda.device_array(q.shape, dtype=np.float32)
    scale = 1 / np.sqrt(head_dim)
    weights.attention(cuda.to_device(q), kv, capacity, cuda.to_device(q_positions), scale, out)
    held = slot_positions >= 0
    want = ops.attention_ref(q, k[:, held].transpose(1, 0, 2), v[:, held].transpose(1, 0, 2), q_positions,
                             slot_positions[held], window, scale)
    assert max_rel(out.copy_to_host(), want) < OP_MAX_REL


@pytest.mark.parametrize("kind", [op_kernels.ACT_SILU, op_kernels.ACT_GELU_TANH])
def test_gated_activations(kind):
    rng = np.random.default_rng(9)
    gate = (3 * rng.standard_normal((2, 13))).astype(np.float32)
    up = rng.standard_normal((2, 13)).astype(np.float32)
    gate_dev = cuda.to_device(gate)
    weights.gated_activation(gate_dev, cuda.to_device(up), kind)
    ref = ops.silu_mul_ref if kind == op_kernels.ACT_SILU else ops.gelu_tanh_mul_ref
    assert max_rel(gate_dev.copy_to_host(), ref(gate, up)) < OP_MAX_REL


def test_add_bias():
    rng = np.random.default_rng(10)
    x, bias = rng.standard_normal((3, 11)).astype(np.float32), rng.standard_normal(11).astype(np.float32)
    x_dev = cuda.to_device(x)
    weights.add_bias(x_dev, cuda.to_device(bias))
    np.testing.assert_array_equal(x_dev.copy_to_host(), x + bias)


def test_every_thread_of_a_block_shares_one_shared_array(monkeypatch):
    """helpers_cudasim.prepare(): with the simulator's look-up-or-create window widened to 2 ms (long enough for
    the block's other threads to run into it), every thread still gets the block's one array. Unpatched, some
    blocks split (measured: the original allocation path with the same delay gives wrong sums)."""
    import time

    from numba.cuda.simulator import kernelapi

    class SlowNumpy:  # the unpatched path allocates with kernelapi.np.empty
        def __getattr__(self, name):
            return getattr(np, name)

        def empty(self, *args, **kwargs):
            time.sleep(0.002)
            return np.empty(*args, **kwargs)

    def slow_allocate(shape, dtype):
        time.sleep(0.002)
        return np.zeros(shape, dtype)

    monkeypatch.setattr(kernelapi, "np", SlowNumpy())
    monkeypatch.setattr(helpers_cudasim, "_allocate", slow_allocate)
    threads, blocks = 8, 6

    @cuda.jit
    def block_total(out):
        tid = cuda.threadIdx.x
        shared = cuda.shared.array(threads, np.int32)
        shared[tid] = tid + 1
        cuda.syncthreads()
        total = 0
        for i in range(threads):
            total += shared[i]
        out[cuda.blockIdx.x, tid] = total

    out = np.zeros((blocks, threads), np.int32)
    block_total[blocks, threads](out)
    np.testing.assert_array_equal(out, threads * (threads + 1) // 2)

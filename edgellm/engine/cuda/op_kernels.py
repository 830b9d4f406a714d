"""CUDA kernels for the transformer ops between the matrix products; each mirrors an edgellm.engine.ops function
(the numpy references there are what the simulator tests compare with).

Sections: block reductions; RMSNorm; per-head norm + RoPE + KV-cache store; attention over the device KV cache;
gated activations; bias add.

Reductions go through shared memory and syncthreads (the CUDA simulator has no warp shuffles), so every block
size here is a power of two. Float constants are float32 on purpose: a bare Python float computes in float64.
"""

import math

import numpy as np
from numba import cuda

from edgellm import jitcache
from edgellm.engine.cuda.device import simulator_enabled

jitcache.configure_cuda()  # CUDA kernels cached beside the CPU ones, not next to the package

# Threads per block: NORM_THREADS per row in rms_norm_kernel, HEAD_THREADS per (token, head) in
# qk_norm_rope_store_kernel, ATTN_THREADS per (token, head) in attention_kernel (also the cache slots per tile).
# The simulator pays per Python thread and per block barrier: it gets small blocks, which also make short test
# sequences span several attention tiles.
# Elementwise kernels stride over their elements with at most MAX_ACT_BLOCKS blocks of ACT_THREADS.
if simulator_enabled():
    NORM_THREADS, HEAD_THREADS, ATTN_THREADS, ACT_THREADS, MAX_ACT_BLOCKS, MAX_HEAD_DIM = 8, 8, 8, 8, 1, 64
else:
    NORM_THREADS, HEAD_THREADS, ATTN_THREADS, ACT_THREADS, MAX_ACT_BLOCKS, MAX_HEAD_DIM = 128, 64, 128, 256, 4096, 512
DIMS_PER_THREAD = MAX_HEAD_DIM // ATTN_THREADS  # attention keeps q in shared memory; each thread owns these outputs

NO_SCORE = np.float32(-1.0e30)  # a finite stand-in for -inf
ACT_SILU = 0  # gate <- silu(gate) * up        (llama, qwen)
ACT_GELU_TANH = 1  # gate <- gelu_tanh(gate) * up   (gemma)
GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.7978845608028654)

# ----------------------------------------------------------------------------------------------------------------
# Block reductions: every thread of the block passes its value and gets the block's total (or maximum).


@cuda.jit(device=True)
def block_sum(scratch, tid, value):
    """scratch: shared f32 [blockDim.x], blockDim.x a power of two."""
    scratch[tid] = value
    cuda.syncthreads()
    width = cuda.blockDim.x // 2
    while width > 0:
        if tid < width:
            scratch[tid] += scratch[tid + width]
        cuda.syncthreads()
        width //= 2
    total = scratch[0]
    cuda.syncthreads()  # everyone has read scratch[0] before it is reused
    return total


@cuda.jit(device=True)
def block_max(scratch, tid, value):
    scratch[tid] = value
    cuda.syncthreads()
    width = cuda.blockDim.x // 2
    while width > 0:
        if tid < width:
            scratch[tid] = max(scratch[tid], scratch[tid + width])
        cuda.syncthreads()
        width //= 2
    total = scratch[0]
    cuda.syncthreads()
    return total


# ----------------------------------------------------------------------------------------------------------------
# RMSNorm: out = x / sqrt(mean(x^2) + eps) * w, or out += that (Gemma's post-norms feeding the residual)


@cuda.jit(cache=True)
def rms_norm_kernel(x, weight, eps, out, accumulate):
    """x, out: [R, d] (may alias when not accumulating); weight: [d]. One block of NORM_THREADS per row."""
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    d = x.shape[1]
    scratch = cuda.shared.array(NORM_THREADS, np.float32)
    sum_sq = np.float32(0.0)
    for i in range(tid, d, NORM_THREADS):
        sum_sq += x[r, i] * x[r, i]
    sum_sq = block_sum(scratch, tid, sum_sq)
    inv_rms = np.float32(1.0) / math.sqrt(sum_sq / np.float32(d) + eps)
    for i in range(tid, d, NORM_THREADS):
        y = x[r, i] * inv_rms * weight[i]
        if accumulate:
            out[r, i] += y
        else:
            out[r, i] = y


# ----------------------------------------------------------------------------------------------------------------
# Per-head RMSNorm (qwen3, gemma3), rotary embedding, and the store of k and v into the cache, in one launch.
# Rotation of pair i at position p by p * inv_freq[i] (angles in float64, as edgellm.engine.ops.rope_tables);
# normal ordering rotates (2i, 2i+1), NeoX (i, i + n_rot/2). Position p goes to cache slot p % capacity.


@cuda.jit(cache=True)
def qk_norm_rope_store_kernel(q, k, v, positions, inv_freq, neox, q_norm, k_norm, use_norm, eps,
                              k_cache, v_cache, slot_pos, mscale):
    """q: [T, H, hd]; k, v: [T, H_kv, hd] (q, k rotated in place); inv_freq: [n_rot/2] f64; mscale: the factor on
    cos and sin (rope.scaling.attn_factor, e.g. phi3's longrope; 1 otherwise);
    q_norm, k_norm: [hd] (read only when use_norm); k_cache, v_cache: [H_kv, capacity, hd]; slot_pos: [capacity].
    Grid (T, H + H_kv): block (t, g) handles query head g, or kv head g - H."""
    t = cuda.blockIdx.x
    g = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    n_heads = q.shape[1]
    head_dim = q.shape[2]
    is_query = g < n_heads
    kv_head = g - n_heads
    vec = q[t, g] if is_query else k[t, kv_head]
    scratch = cuda.shared.array(HEAD_THREADS, np.float32)
    if use_norm:
        norm_w = q_norm if is_query else k_norm
        sum_sq = np.float32(0.0)
        for i in range(tid, head_dim, HEAD_THREADS):
            sum_sq += vec[i] * vec[i]
        sum_sq = block_sum(scratch, tid, sum_sq)
        inv_rms = np.float32(1.0) / math.sqrt(sum_sq / np.float32(head_dim) + eps)
        for i in range(tid, head_dim, HEAD_THREADS):
            vec[i] = vec[i] * inv_rms * norm_w[i]
        cuda.syncthreads()
    half = inv_freq.shape[0]
    p = positions[t]
    for i in range(tid, half, HEAD_THREADS):
        if neox:
            a = i
            b = i + half
        else:
            a = 2 * i
            b = 2 * i + 1
        angle = np.float64(p) * inv_freq[i]
        c = np.float32(math.cos(angle)) * mscale
        s = np.float32(math.sin(angle)) * mscale
        x0 = vec[a]
        x1 = vec[b]
        vec[a] = x0 * c - x1 * s
        vec[b] = x0 * s + x1 * c
    if not is_query:
        cuda.syncthreads()
        capacity = slot_pos.shape[0]
        slot = p % capacity
        for i in range(tid, head_dim, HEAD_THREADS):
            k_cache[kv_head, slot, i] = vec[i]
            v_cache[kv_head, slot, i] = v[t, kv_head, i]
        if tid == 0 and kv_head == 0:
            slot_pos[slot] = p


# ----------------------------------------------------------------------------------------------------------------
# Attention over the KV cache, as edgellm.engine.ops.attention: a query at position p sees the key at kp when
# 0 <= p - kp (and p - kp < window for sliding-window layers); empty slots hold -1. Query head h reads kv head
# h // (H / H_kv). The slots are walked in tiles of ATTN_THREADS (one score per thread) with an online softmax,
# so no [T, H, n_ctx] score buffer is needed.


@cuda.jit(cache=True)
def attention_kernel(q, k_cache, v_cache, slot_pos, n_slots, q_positions, window, scale, out, softcap):
    """q, out: [T, H, hd]; k_cache, v_cache: [H_kv, capacity, hd]; slot_pos: [capacity]; slots [0, n_slots) are
    scanned; window 0 = full attention; softcap > 0 caps each score as cap * tanh(score / cap) (Gemma 2). Grid
    (T, H), block ATTN_THREADS."""
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    head_dim = q.shape[2]
    kv = h // (q.shape[1] // k_cache.shape[0])
    p = q_positions[t]
    q_shared = cuda.shared.array(MAX_HEAD_DIM, np.float32)
    probs = cuda.shared.array(ATTN_THREADS, np.float32)
    scratch = cuda.shared.array(ATTN_THREADS, np.float32)
    for d in range(tid, head_dim, ATTN_THREADS):
        q_shared[d] = q[t, h, d]
    acc = cuda.local.array(DIMS_PER_THREAD, np.float32)
    for k in range(DIMS_PER_THREAD):
        acc[k] = np.float32(0.0)
    running_max = NO_SCORE
    denom = np.float32(0.0)
    cuda.syncthreads()
    for start in range(0, n_slots, ATTN_THREADS):
        j = start + tid
        visible = False
        score = NO_SCORE
        if j < n_slots:
            kp = slot_pos[j]
            if kp >= 0 and kp <= p and (window == 0 or p - kp < window):
                visible = True
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += q_shared[d] * k_cache[kv, j, d]
                score = dot * scale
                if softcap > np.float32(0.0):
                    score = softcap * math.tanh(score * (np.float32(1.0) / softcap))
        tile_max = block_max(scratch, tid, score)
        if tile_max > NO_SCORE:  # the same in every thread: some slot of the tile is visible
            new_max = max(running_max, tile_max)
            correction = math.exp(running_max - new_max)
            prob = math.exp(score - new_max) if visible else np.float32(0.0)
            probs[tid] = prob
            denom = denom * correction + block_sum(scratch, tid, prob)  # its barrier publishes probs too
            n_tile = min(ATTN_THREADS, n_slots - start)
            for k in range(DIMS_PER_THREAD):
                d = tid + k * ATTN_THREADS
                if d < head_dim:
                    a = acc[k] * correction
                    for jj in range(n_tile):
                        a += probs[jj] * v_cache[kv, start + jj, d]
                    acc[k] = a
            running_max = new_max
            cuda.syncthreads()  # probs is rewritten by the next tile
    inv = np.float32(1.0) / denom
    for k in range(DIMS_PER_THREAD):
        d = tid + k * ATTN_THREADS
        if d < head_dim:
            out[t, h, d] = acc[k] * inv


# ----------------------------------------------------------------------------------------------------------------
# Gated feed-forward activations, gate <- act(gate) * up (edgellm.engine.ops.silu_mul / gelu_tanh_mul), and a bias add


@cuda.jit(cache=True)
def gated_activation_kernel(gate, up, kind):
    """gate, up: [T, n_ff]; kind ACT_SILU or ACT_GELU_TANH. Threads stride over the elements."""
    n_ff = gate.shape[1]
    for idx in range(cuda.grid(1), gate.shape[0] * n_ff, cuda.gridsize(1)):
        t = idx // n_ff
        i = idx % n_ff
        g = gate[t, i]
        if kind == ACT_SILU:
            y = g / (np.float32(1.0) + math.exp(-g))
        else:
            inner = SQRT_2_OVER_PI * g * (np.float32(1.0) + GELU_COEF_A * g * g)
            y = np.float32(0.5) * g * (np.float32(1.0) + math.tanh(inner))
        gate[t, i] = y * up[t, i]


@cuda.jit(cache=True)
def add_bias_kernel(x, bias):
    """x: [T, n] += bias [n] (qwen2's q, k, v biases). Threads stride over the elements."""
    n = x.shape[1]
    for idx in range(cuda.grid(1), x.shape[0] * n, cuda.gridsize(1)):
        x[idx // n, idx % n] += bias[idx % n]


@cuda.jit(cache=True)
def add_scaled_kernel(x, y, alpha):
    """x: [T, n] += y * alpha (Granite's residual multiplier: the product rounded to float32, then the sum, as the
    CPU path's two ops). Threads stride over the elements."""
    n = x.shape[1]
    for idx in range(cuda.grid(1), x.shape[0] * n, cuda.gridsize(1)):
        scaled = y[idx // n, idx % n] * alpha
        x[idx // n, idx % n] += scaled


def elementwise_grid(n_elements: int):
    return (min(MAX_ACT_BLOCKS, (n_elements + ACT_THREADS - 1) // ACT_THREADS),), (ACT_THREADS,)

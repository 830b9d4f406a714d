"""Each Numba op in edgellm.engine.ops against its numpy reference, under a named normalised-error limit."""

import numpy as np
import pytest

from edgellm.engine import ops
from edgellm.engine.ops import attention_drivers

# float32 kernels vs float64 references: only rounding differs, ~1e-7 relative per value.
NMSE_F32 = 1e-10
# Attention sums over many keys in llama.cpp's order (different summation order than the reference).
NMSE_ATTENTION = 1e-10
# GELU looks x up in llama.cpp's float16 table: ~2**-11 relative error per value.
GELU_F16_NMSE = 1e-6
# Rope angles in float32 as llama.cpp computes them, against the float64 reference's (see test_rope_...).
ROPE_NMSE = 1e-8


def nmse(got, want):
    want = np.asarray(want, dtype=np.float64)
    return float(np.sum((got - want) ** 2) / max(np.sum(want**2), 1e-30))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.mark.parametrize("rows,d", [(1, 64), (7, 576), (3, 640)])
def test_rms_norm_matches_reference(rng, rows, d):
    x = (rng.standard_normal((rows, d)) * 3).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    out = np.empty_like(x)
    ops.rms_norm(x, w, 1e-6, out)
    assert nmse(out, ops.rms_norm_ref(x, w, 1e-6)) < NMSE_F32


def test_rms_norm_in_place_equals_out_of_place(rng):
    x = rng.standard_normal((5, 32)).astype(np.float32)
    w = rng.standard_normal(32).astype(np.float32)
    out = np.empty_like(x)
    ops.rms_norm(x, w, 1e-5, out)
    ops.rms_norm(x, w, 1e-5, x)
    np.testing.assert_array_equal(x, out)


def test_add_rms_norm_is_residual_then_norm(rng):
    x = rng.standard_normal((4, 48)).astype(np.float32)
    delta = rng.standard_normal((4, 48)).astype(np.float32)
    w = rng.standard_normal(48).astype(np.float32)
    want_x, want_out = x + delta, ops.rms_norm_ref(x + delta, w, 1e-6)
    ops.add_rms_norm(x, delta, w, 1e-6, delta)  # output over the delta buffer, as the models call it
    assert nmse(x, want_x) < NMSE_F32
    assert nmse(delta, want_out) < NMSE_F32


def test_add_post_norm_is_gemma_sandwich(rng):
    x = rng.standard_normal((3, 40)).astype(np.float32)
    delta = (rng.standard_normal((3, 40)) * 7).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    want = x + ops.rms_norm_ref(delta, w, 1e-6)
    ops.add_post_norm(x, delta, w, 1e-6)
    assert nmse(x, want) < NMSE_F32


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 31, 32, 37, 64, 130])
def test_norms_give_each_row_its_own_bits_however_rows_are_split(rng, rows):
    """The norms sum four rows' squares side by side and split rows across threads from NORM_PARALLEL_MIN_ROWS on;
    every row must still get the bits of the row-by-row loop (its float64 sum in order, then llama.cpp's float32
    steps), for all three kinds, including the leftover rows past a multiple of four and out aliasing delta."""
    from numba import njit

    @njit(error_model="numpy")
    def row_by_row(x, weight, eps, out, delta, mode):
        for r in range(x.shape[0]):
            if mode == ops.NORM_ADD:
                for i in range(x.shape[1]):
                    x[r, i] += delta[r, i]
            src = delta[r] if mode == ops.NORM_POST else x[r]
            total = 0.0
            for i in range(src.shape[0]):
                total += np.float64(src[i] * src[i])
            scale = np.float32(1.0) / np.float32(np.sqrt(np.float32(total / src.shape[0]) + np.float32(eps)))
            for i in range(x.shape[1]):
                if mode == ops.NORM_POST:
                    x[r, i] += delta[r, i] * scale * weight[i]
                else:
                    out[r, i] = x[r, i] * scale * weight[i]

    d = 576
    x = (rng.standard_normal((rows, d)) * 3).astype(np.float32)
    delta = (rng.standard_normal((rows, d)) * 5).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    for mode, call in ((ops.NORM_PLAIN, lambda a, b, o: ops.rms_norm(a, w, 1e-6, o)),
                       (ops.NORM_ADD, lambda a, b, o: ops.add_rms_norm(a, b, w, 1e-6, b)),
                       (ops.NORM_POST, lambda a, b, o: ops.add_post_norm(a, b, w, 1e-6))):
        got_x, got_d, got_o = x.copy(), delta.copy(), np.zeros_like(x)
        want_x, want_d, want_o = x.copy(), delta.copy(), np.zeros_like(x)
        call(got_x, got_d, got_o)
        row_by_row(want_x, w, 1e-6, want_d if mode == ops.NORM_ADD else want_o, want_d, mode)
        for got, want in ((got_x, want_x), (got_d, want_d), (got_o, want_o)):
            np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("with_bias,with_norm,neox", [(False, False, False), (True, False, True), (False, True, True)])
def test_finish_qkv_is_bias_norm_rope_store(rng, with_bias, with_norm, neox):
    T, H, H_kv, hd, capacity = 3, 4, 2, 16, 8
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k = rng.standard_normal((T, H_kv, hd)).astype(np.float32)
    v = rng.standard_normal((T, H_kv, hd)).astype(np.float32)
    none = np.zeros(0, np.float32)
    biases = [rng.standard_normal(a.shape[1] * hd).astype(np.float32) if with_bias else none for a in (q, k, v)]
    norms = [rng.standard_normal(hd).astype(np.float32) if with_norm else none for _ in range(2)]
    positions = np.array([5, 6, 7], np.int32)
    rope = ops.Rope(hd, 10000.0)
    inv_freq = rope.inv_freq
    cos, sin = np.empty((T, hd // 2), np.float32), np.empty((T, hd // 2), np.float32)
    ops.rope_tables(positions, rope, cos, sin)
    # the reference composition, step by step
    wq, wk, wv = q.copy(), k.copy(), v.copy()
    if with_bias:
        wq, wk, wv = (a + b.reshape(a.shape[1:]) for a, b in zip((wq, wk, wv), biases))
    if with_norm:
        wq, wk = ops.rms_norm_ref(wq, norms[0], 1e-6), ops.rms_norm_ref(wk, norms[1], 1e-6)
    wq, wk = ops.rope_ref(wq, positions, inv_freq, neox), ops.rope_ref(wk, positions, inv_freq, neox)
    k_cache, v_cache = np.zeros((H_kv, capacity, hd), np.float32), np.zeros((H_kv, capacity, hd), np.float32)
    slot_pos = np.full(capacity, -1, np.int32)
    ops.finish_qkv(q, k, v, *biases, *norms, 1e-6, cos, sin, neox, positions, k_cache, v_cache, slot_pos)
    assert nmse(q, wq) < NMSE_F32
    assert nmse(k_cache[:, 5:8].transpose(1, 0, 2), wk) < NMSE_F32
    assert nmse(v_cache[:, 5:8].transpose(1, 0, 2), wv) < NMSE_F32
    assert list(slot_pos) == [-1] * 5 + [5, 6, 7]


# fast_exp is llama.cpp's expf polynomial: within 1.5 ulp (+ 0.5 for the final rounding) of exp; below float32's
# smallest normal it flushes toward 0 like llama.cpp (its two-step scaling), above 88.72 it overflows to inf.
FAST_EXP_MAX_REL_ERROR = 2.5e-7


def test_fast_exp_matches_numpy():
    x = np.concatenate([np.linspace(-87, 88, 200001), [-1e30, -np.inf, -110.0, 0.0, 1e-8, 89.0]]).astype(np.float32)
    got = np.empty_like(x)
    ops.fast_exp_array(x, got)
    inside = (x > -87) & (x < 88.5)
    want = np.exp(x[inside].astype(np.float64))
    assert np.max(np.abs(got[inside] / want - 1)) < FAST_EXP_MAX_REL_ERROR
    assert (got[x < -104] == 0).all()  # masked scores underflow to exactly zero
    assert np.isinf(got[x == 89.0]).all()



def test_fast_exp_keeps_its_bits_with_32_bit_exponent_arithmetic():
    """fast_exp builds 2^n with f32_shl23_add (32-bit wrapping integer arithmetic, so loops over it vectorise eight
    lanes wide); it must give exactly the bits of the formulation it replaced, which widened n's bits to int64 before
    shifting (llama.cpp's bits: the exact-op tests compare those), on every range and edge value."""
    from numba import njit
    from edgellm.quant.simd import f32_bits, f32_from_bits, fma32

    @njit(error_model="numpy")
    def widened(xs, out):
        for i in range(xs.shape[0]):
            x = xs[i]
            z = fma32(x, ops.EXP_INV_LN2, ops.EXP_SHIFT)
            n = z - ops.EXP_SHIFT
            b = fma32(-n, ops.EXP_LN2_LO, fma32(-n, ops.EXP_LN2_HI, x))
            e = np.int64(f32_bits(z)) << 23
            k = f32_from_bits(e + 0x3F800000)
            u = b * b
            p1, p2, p3, p4, p5 = ops.EXP_POLY
            j = fma32(fma32(fma32(p5, b, p4), u, fma32(p3, b, p2)), u, p1 * b)
            normal = fma32(j, k, k)
            g = 0x82000000 if n <= np.float32(0.0) else 0
            s1 = f32_from_bits(g + 0x7F000000)
            scaled = fma32(f32_from_bits(e - g), j, f32_from_bits(e - g)) * s1
            big = abs(n)
            far = s1 * s1 if big > np.float32(192.0) else scaled
            out[i] = far if big > np.float32(126.0) else normal

    rng = np.random.default_rng(11)
    x = np.concatenate([np.linspace(-110, 100, 2_000_001), rng.uniform(-300, 300, 1_000_000),
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 88.72, 88.73, -87.33, -103.9, -104.0,
                         -126 * np.log(2), 126 * np.log(2), -192 * np.log(2), 192 * np.log(2)]]).astype(np.float32)
    got, want = np.empty_like(x), np.empty_like(x)
    ops.fast_exp_array(x, got)
    widened(x, want)
    same = (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), x[~same][:5]

@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("head_dim,n_rot", [(64, 64), (256, 256), (64, 32)])
def test_rope_matches_reference(rng, neox, head_dim, n_rot):
    T, H = 5, 3
    x = rng.standard_normal((T, H, head_dim)).astype(np.float32)
    positions = np.array([0, 1, 7, 100, 4000], dtype=np.int32)
    rope = ops.Rope(n_rot, 10000.0)
    cos = np.empty((T, n_rot // 2), np.float32)
    sin = np.empty((T, n_rot // 2), np.float32)
    ops.rope_tables(positions, rope, cos, sin)
    got = x.copy()
    ops.apply_rope(got, cos, sin, neox)
    # llama.cpp's float32 angles (p * theta_scale^i by repeated multiplication) drift from the float64 reference's
    # by ~i ulp of the angle: at position 4000 that is ~3e-4 radians, hence the looser bound.
    assert nmse(got, ops.rope_ref(x, positions, rope.inv_freq, neox)) < ROPE_NMSE
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])  # unrotated tail passes through
    np.testing.assert_allclose(got[0], x[0], rtol=0, atol=0)  # position 0 is the identity


def test_rope_orderings_differ(rng):
    """Guards against the two orderings silently collapsing into one."""
    x = rng.standard_normal((1, 1, 8)).astype(np.float32)
    inv_freq = ops.rope_inv_freq(8, 10000.0)
    a, b = ops.rope_ref(x, np.array([3]), inv_freq, False), ops.rope_ref(x, np.array([3]), inv_freq, True)
    assert not np.allclose(a, b)


def test_rope_scaling_and_factors():
    base = ops.rope_inv_freq(8, 10000.0)
    np.testing.assert_allclose(ops.rope_inv_freq(8, 10000.0, freq_scale=0.25), base * 0.25)
    np.testing.assert_allclose(ops.rope_inv_freq(8, 10000.0, factors=[1, 2, 4, 8]), base / [1, 2, 4, 8])
    np.testing.assert_allclose(base, 10000.0 ** (-np.arange(0, 8, 2) / 8))


def scores_for(q, capacity):
    return ops.attention_scratch(capacity, q.shape[2])


def _cache_from(k, v, positions, capacity):
    """Store k, v [S, H_kv, hd] with kv_store into a cache of the given capacity."""
    h_kv, hd = k.shape[1], k.shape[2]
    k_cache = np.zeros((h_kv, capacity, hd), np.float32)
    v_cache = np.zeros((h_kv, capacity, hd), np.float32)
    slot_pos = np.full(capacity, -1, np.int32)
    ops.kv_store(k, v, positions, k_cache, v_cache, slot_pos)
    return k_cache, v_cache, slot_pos


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (4, 1, 256)])
@pytest.mark.parametrize("n_past,n_new", [(0, 1), (0, 9), (12, 1), (12, 5), (150, 1), (130, 40)])
def test_attention_matches_reference(rng, n_heads, n_kv_heads, head_dim, n_past, n_new):
    S = n_past + n_new
    k = rng.standard_normal((S, n_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((S, n_kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((n_new, n_heads, head_dim)).astype(np.float32)
    positions = np.arange(S, dtype=np.int32)
    k_cache, v_cache, slot_pos = _cache_from(k, v, positions, capacity=200)
    out = np.empty_like(q)
    scale = 1.0 / np.sqrt(head_dim)
    ops.attention(q, k_cache, v_cache, slot_pos, positions[n_past:], 0, scale, out, scores_for(q, 200))
    want = ops.attention_ref(q, k, v, positions[n_past:], positions, 0, scale)
    assert nmse(out, want) < NMSE_ATTENTION


@pytest.mark.parametrize("kernels", [(attention_drivers._attention_serial, attention_drivers._attention_serial_vec),
                                     (attention_drivers._attention_parallel, attention_drivers._attention_parallel_vec)])
@pytest.mark.parametrize("n_new", [1, 6])  # one query row and several: llama.cpp's two summation orders
def test_serial_parallel_scalar_and_vector_attention_agree(rng, kernels, n_new):
    """ops.attention picks serial or parallel by the amount of work, and the vector path where the cache type and
    head size allow: each gives the reference's answer, and the vector path the scalar one's bits."""
    q = rng.standard_normal((n_new, 4, 32)).astype(np.float32)
    k = rng.standard_normal((30, 2, 32)).astype(np.float32)
    v = rng.standard_normal((30, 2, 32)).astype(np.float32)
    positions = np.arange(30, dtype=np.int32)
    k_cache, v_cache, slot_pos = _cache_from(k, v, positions, capacity=40)
    outs = []
    for kernel in kernels:
        out = np.empty_like(q)
        kernel(q, k_cache, v_cache, ops.NO_SCALES, ops.NO_SCALES, slot_pos, positions[-n_new:], 9, 0.2, out,
               scores_for(q, 40))
        assert nmse(out, ops.attention_ref(q, k, v, positions[-n_new:], positions, 9, 0.2)) < NMSE_ATTENTION
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])



def _f16_ring(rng, S, H_kv, hd, capacity):
    """S positions of random keys and values (float16 values) stored through an f16 ring of `capacity` slots."""
    k = rng.standard_normal((S, H_kv, hd)).astype(np.float16).astype(np.float32)
    v = rng.standard_normal((S, H_kv, hd)).astype(np.float16).astype(np.float32)
    positions = np.arange(S, dtype=np.int32)
    k_cache = np.zeros((H_kv, capacity, hd), np.uint16)
    v_cache = np.zeros((H_kv, capacity, hd), np.uint16)
    slot_pos = np.full(capacity, -1, np.int32)
    ops.kv_store(k, v, positions, k_cache, v_cache, slot_pos)
    return k, v, positions, k_cache, v_cache, slot_pos


def _scalar_and_vector_attention_agree(q, k_cache, v_cache, slot_pos, rows, scale):
    """The scalar kernel's output, after checking that the serial and parallel vector kernels give its bits."""
    outs = []
    for kernel in (attention_drivers._attention_serial, attention_drivers._attention_serial_vec, attention_drivers._attention_parallel_vec):
        out = np.empty_like(q)
        kernel(q, k_cache, v_cache, ops.NO_SCALES, ops.NO_SCALES, slot_pos, rows, 0, scale, out,
               scores_for(q, slot_pos.shape[0]))
        outs.append(out)
    np.testing.assert_array_equal(outs[1].view(np.int32), outs[0].view(np.int32))
    np.testing.assert_array_equal(outs[2].view(np.int32), outs[0].view(np.int32))
    return outs[0]


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("capacity,S", [(100, 163), (700, 1000)])
def test_single_query_head_dim_64_scores_keep_the_bits(rng, holes, capacity, S):
    """One query row, head_dim 64, over an f16 ring that has wrapped (two runs of slots): the vector path scores
    the keys with the query held in registers (_score_run_single64) and must give the scalar path's bits, which
    are llama.cpp's; empty slots inside the run (holes) are masked. The larger ring's runs span several of the
    value pass's blocks (ops.WEIGH_BLOCK_SLOTS), starting and ending off their boundaries."""
    H, H_kv, hd = 9, 3, 64
    k, v, positions, k_cache, v_cache, slot_pos = _f16_ring(rng, S, H_kv, hd, capacity)
    if holes:
        slot_pos[[5, 17, 18, 90]] = -1
    q = rng.standard_normal((1, H, hd)).astype(np.float32)
    last = positions[-1:]
    out = _scalar_and_vector_attention_agree(q, k_cache, v_cache, slot_pos, last, 0.125)
    visible = np.sort(slot_pos[slot_pos >= 0])
    want = ops.attention_ref(q, k[visible], v[visible], last, visible, 0, 0.125, f16_operands=True)
    assert nmse(out, want) < NMSE_ATTENTION


@pytest.mark.parametrize("H,H_kv,hd", [(4, 1, 256), (9, 3, 64), (14, 2, 64), (6, 2, 32)])
@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_single_token_grouped_heads_keep_the_bits(rng, H, H_kv, hd, chunk):
    """A single token's attention with grouped-query heads runs a KV head's query heads together, `chunk` at a
    time (ops.attention picks the chunk from the threads: _heads_chunk); each head must get the scalar path's bits,
    over a wrapped f16 ring with empty slots, serial and parallel, and through ops.attention itself."""
    capacity, S = 300, 420
    _, _, positions, k_cache, v_cache, slot_pos = _f16_ring(rng, S, H_kv, hd, capacity)
    slot_pos[[7, 8, 150]] = -1
    q = rng.standard_normal((1, H, hd)).astype(np.float32)
    last = positions[-1:]
    want = np.empty_like(q)
    attention_drivers._attention_serial(q, k_cache, v_cache, ops.NO_SCALES, ops.NO_SCALES, slot_pos, last, 0, 0.125,
                                        want, scores_for(q, capacity))
    for kernel in (attention_drivers._attention_heads_serial_vec, attention_drivers._attention_heads_parallel_vec):
        out = np.full_like(q, np.nan)
        kernel(q, k_cache, v_cache, slot_pos, last, 0, 0.125, chunk, out, scores_for(q, capacity))
        np.testing.assert_array_equal(out.view(np.int32), want.view(np.int32))
    out = np.full_like(q, np.nan)
    ops.attention(q, k_cache, v_cache, slot_pos, last, 0, 0.125, out, scores_for(q, capacity))
    np.testing.assert_array_equal(out.view(np.int32), want.view(np.int32))


def test_heads_chunk_shares_conversions_where_the_threads_stay_busy():
    """Up to four query heads of a group share each key's conversion; a lone KV head on two threads splits its
    group in two rather than leave a thread idle, and three KV heads of three on two threads stay one head per item
    (three long items on two threads would finish later)."""
    chunk = attention_drivers._heads_chunk
    assert chunk(4, 1, 2) == 2 and chunk(4, 1, 1) == 4
    assert chunk(9, 3, 2) == 1 and chunk(9, 3, 1) == 3
    assert chunk(32, 8, 2) == 4 and chunk(14, 2, 2) == 4 and chunk(16, 2, 4) == 4
    assert chunk(8, 1, 16) == 1 and chunk(8, 8, 2) == 1


@pytest.mark.parametrize("head_dim,n_new", [(256, 1), (64, 6), (256, 6)])
def test_vector_attention_over_many_value_blocks_keeps_the_bits(rng, head_dim, n_new):
    """A wrapped f16 ring of 700 slots: the value pass walks each run in blocks of ops.WEIGH_BLOCK_SLOTS, each lane's
    slots in order, for the one-row (32 lanes) and the several-row (8 lanes) summation orders; the vector kernels
    must give the scalar path's bits."""
    H, H_kv, capacity, S = 4, 1, 700, 1000
    assert capacity > 2 * ops.WEIGH_BLOCK_SLOTS
    _, _, positions, k_cache, v_cache, slot_pos = _f16_ring(rng, S, H_kv, head_dim, capacity)
    q = rng.standard_normal((n_new, H, head_dim)).astype(np.float32)
    _scalar_and_vector_attention_agree(q, k_cache, v_cache, slot_pos, positions[-n_new:], 0.0625)


@pytest.mark.parametrize("n_heads", [1, 4])
def test_parallel_prompt_order_takes_every_item_once_and_halves_the_work(n_heads):
    """prange gives each thread a contiguous range of indices; causal row blocks cost more the later they are, so
    the drivers map index i to _balanced(i): every item exactly once, and the first half of the indices holds
    half of the work to within one block's cost (block b's cost taken as b + 1; in index order the first half of
    eleven blocks would hold 15 of their 66)."""
    for n_blocks in range(1, 12):
        n_items = n_blocks * n_heads
        items = [attention_drivers._balanced(i, n_items, n_heads) for i in range(n_items)]
        assert sorted(items) == list(range(n_items))
        cost = [item // n_heads + 1 for item in items]
        half = n_blocks // 2 * n_heads
        assert abs(sum(cost[:half]) - sum(cost) / 2) <= n_blocks * n_heads


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("a,b", [(0, 40), (3, 16), (29, 40)])  # runs whose length is or is not a multiple of 4
def test_wide_prompt_attention_loops_keep_the_bits(rng, dtype, a, b):
    """The 512-bit scores and weighing loops of the several-row path (chosen where simd.HAS_WIDE_TILES; LLVM splits
    their vectors elsewhere, so this runs on every host) against the 256-bit ones, bit for bit: rows that see
    different slots (masked scores, weights of 0), an f16 and an f32 cache, short last groups of keys."""
    from edgellm.engine.ops import attention_rows as ar
    H_kv, capacity, hd = 2, 40, 64
    vals = rng.standard_normal((2, H_kv, capacity, hd)).astype(np.float16)
    k_cache, v_cache = (vals.view(np.uint16) if dtype == np.uint16 else vals.astype(np.float32))
    slot_pos = np.arange(capacity, dtype=np.int32)
    q_rows = rng.standard_normal(ar.ROWS * hd).astype(np.float16).astype(np.float32)
    lo, p = (a, a + 2, a, a + 5), (b - 4, b - 1, b - 2, b - 3)
    inf = np.float32(-np.inf)
    width = ar.ROWS * capacity + ar.ROWS * ar.LANES_BATCH * hd
    narrow, wide = np.zeros(width, np.float32), np.zeros(width, np.float32)
    tops = ar._rows_scores(k_cache, slot_pos, 1, a, b, q_rows, lo, p, np.float32(0.125), narrow, (inf,) * 4)
    tops_wide = ar._rows_scores_wide(k_cache, slot_pos, 1, a, b, q_rows, lo, p, np.float32(0.125), wide, (inf,) * 4)
    assert tops_wide == tops
    np.testing.assert_array_equal(wide.view(np.int32), narrow.view(np.int32))
    assert np.isneginf(narrow[:ar.ROWS * capacity].reshape(ar.ROWS, capacity)[:, a:b]).any()  # some slots masked
    weights = np.where(np.isneginf(narrow), np.float32(0.0), np.exp(narrow / 8)).astype(np.float32)
    acc_narrow, acc_wide = weights.copy(), weights.copy()
    acc0 = ar.ROWS * capacity
    ar._rows_weigh(v_cache, 1, a, b, acc_narrow, acc_narrow, acc0)
    ar._rows_weigh_wide(v_cache, 1, a, b, acc_wide, acc_wide, acc0)
    np.testing.assert_array_equal(acc_wide.view(np.int32), acc_narrow.view(np.int32))
    assert np.abs(acc_narrow[acc0:]).sum() > 0


@pytest.mark.parametrize("window,capacity", [(4, 8), (5, 5 + 3 - 1)])
def test_sliding_window_attention_on_a_ring(rng, window, capacity):
    """Write 20 positions through a ring smaller than the sequence, 3 at a time, then check the last batch:
    each query sees exactly the keys within `window` positions, wherever the ring put them."""
    H, H_kv, hd, S = 2, 1, 8, 20
    k = rng.standard_normal((S, H_kv, hd)).astype(np.float32)
    v = rng.standard_normal((S, H_kv, hd)).astype(np.float32)
    positions = np.arange(S, dtype=np.int32)
    k_cache = np.zeros((H_kv, capacity, hd), np.float32)
    v_cache = np.zeros((H_kv, capacity, hd), np.float32)
    slot_pos = np.full(capacity, -1, np.int32)
    for start in range(0, S, 3):
        ops.kv_store(k[start:start + 3], v[start:start + 3], positions[start:start + 3], k_cache, v_cache, slot_pos)
    last = positions[18:]
    q = rng.standard_normal((len(last), H, hd)).astype(np.float32)
    out = np.empty_like(q)
    ops.attention(q, k_cache, v_cache, slot_pos, last, window, 0.3, out, scores_for(q, capacity))
    want = ops.attention_ref(q, k, v, last, positions, window, 0.3)
    assert nmse(out, want) < NMSE_ATTENTION
    assert sorted(slot_pos) == list(range(S - capacity, S))  # the ring holds the newest positions


def test_window_masks_old_keys(rng):
    """A key exactly `window` positions back is invisible (llama.cpp: masked when p - kp >= window)."""
    k = np.zeros((3, 1, 4), np.float32)
    v = np.array([[[1, 0, 0, 0]], [[0, 1, 0, 0]], [[0, 0, 1, 0]]], np.float32)
    k_cache, v_cache, slot_pos = _cache_from(k, v, np.arange(3, dtype=np.int32), 4)
    q = np.zeros((1, 1, 4), np.float32)
    out = np.empty_like(q)
    ops.attention(q, k_cache, v_cache, slot_pos, np.array([2], np.int32), 2, 1.0, out, scores_for(q, 4))
    np.testing.assert_allclose(out[0, 0], [0, 0.5, 0.5, 0], atol=1e-7)


def test_silu_mul_matches_reference(rng):
    gate = (rng.standard_normal((3, 100)) * 4).astype(np.float32)
    up = rng.standard_normal((3, 100)).astype(np.float32)
    want = ops.silu_mul_ref(gate, up)
    ops.silu_mul(gate, up)
    assert nmse(gate, want) < NMSE_F32


def test_gelu_tanh_mul_matches_reference(rng):
    gate = (rng.standard_normal((3, 100)) * 4).astype(np.float32)
    up = rng.standard_normal((3, 100)).astype(np.float32)
    want = ops.gelu_tanh_mul_ref(gate, up)
    ops.gelu_tanh_mul(gate, up)
    assert nmse(gate, want) < GELU_F16_NMSE
    # known values of the tanh approximation of GELU
    g = np.array([[-3.0, 0.0, 1.0, 3.0]], np.float32)
    ops.gelu_tanh_mul(g, np.ones_like(g))
    np.testing.assert_allclose(g[0], [-0.0036373, 0.0, 0.8411920, 2.9963627], rtol=2.0**-10, atol=1e-6)


def test_gelu_table_is_float16_gelu():
    """Every entry of the lookup table is GELU of that float16 value rounded to float16, up to the float32
    evaluation llama.cpp uses (here against float64): one float16 ulp, or the float32 cancellation of
    1 + tanh(y) near -1 for large negative x (|x| * 2**-22)."""
    table = ops.gelu_table().view(np.float16).astype(np.float64)
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)
    inside = np.isfinite(x) & (np.abs(x) < 10)
    x, got = x[inside], table[inside]
    exact = 0.5 * x * (1 + np.tanh(0.7978845608028654 * x * (1 + 0.044715 * x * x)))
    want = exact.astype(np.float16).astype(np.float64)
    ulp = np.abs(np.nextafter(want.astype(np.float16), np.float16(np.inf)).astype(np.float64) - want)
    assert (np.abs(got - exact) <= ulp + np.abs(x) * 2.0**-22).all()
    assert (got == want).mean() > 0.99


def test_softcap_matches_reference(rng):
    x = (rng.standard_normal((2, 50)) * 60).astype(np.float32)
    want = ops.softcap_ref(x, 30.0)
    ops.softcap(x, 30.0)
    assert nmse(x, want) < NMSE_F32
    assert np.abs(x).max() <= 30.0


@pytest.mark.parametrize("n_new", [1, 6])  # one query row and several: llama.cpp's two summation orders
@pytest.mark.parametrize("window", [0, 5])
def test_softcap_attention_matches_reference(rng, n_new, window):
    """Gemma 2's capped scores: cap * tanh(q·k / cap) before the softmax, against the float64 reference; with a
    cap well inside the scores' range, so that a missing cap fails."""
    q = (3.0 * rng.standard_normal((n_new, 4, 64))).astype(np.float32)
    k = rng.standard_normal((20, 2, 64)).astype(np.float32)
    v = rng.standard_normal((20, 2, 64)).astype(np.float32)
    positions = np.arange(20, dtype=np.int32)
    k_cache, v_cache, slot_pos = _cache_from(k, v, positions, capacity=32)
    out = np.empty_like(q)
    ops.attention(q, k_cache, v_cache, slot_pos, positions[-n_new:], window, 0.125, out, scores_for(q, 32), cap=2.0)
    want = ops.attention_ref(q, k, v, positions[-n_new:], positions, window, 0.125, cap=2.0)
    assert nmse(out, want) < NMSE_ATTENTION
    uncapped = ops.attention_ref(q, k, v, positions[-n_new:], positions, window, 0.125)
    assert nmse(uncapped, want) > 1e-3

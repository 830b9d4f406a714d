"""The hand-written K-quant kernels, Q4_K and Q6_K: their row dots, and matmuls that follow llama.cpp's split of a
batch between two kernels (the registry's row_kinds: kinds[t] picks the kernel for token t), with matmul_<fmt>_few
for batches without eight-token work. The other K-quants are generated (quant.matmul_kgroups); the scheme and the
matmul contract are kernels_kquant's.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from . import threading_layer as _threading_layer  # noqa: F401  (before any parallel kernel)

from .kernels_kquant import (ROW_CHUNK, _decoded_dot, _group_q4_k, _group_q6_k, _quantize_tokens, _row_chunk_buffers,
                             _scales_q6_k, _scales_q45_k)
from .dots_block32 import PREFETCH_BYTES, _lanes8
from .kernels_dequant import k_scales_mins
from .simd import (LANES, TILE_VECTORS, lanes_fma, lanes_mul, lanes_splat, load_lanes, q4_k_pair_sums_1x1,
                   q4_k_pair_sums_tile, q6_k_superblock_sums_1x1, q6_k_superblock_sums_tile, store_lanes)
from .simd import (dot_i8x32_2scales, dot_u8x32_2scales, dot4_u8x32_byte_scales, dot_u8x32_scale_pair, f32x8_fma,
                   f32x8_fma_i32, f32x8_fma_lanes, f32x8_from_i32, f32x8_hsum, f32x8_mul, f32x8_splat,
                   f32x8_sub, f32x8_zero, fma32, i8x32_and, i8x32_or, i8x32_shl, i8x32_shr, i32x8_add, i32x8_mins_dot,
                   i32x8_hsum, i32x8_hsum4, i32x8_hsum8, i32x8_hsum_two, i32x8_madd, i32x8_mul, i32x8_splat, i32x8_zero,
                   load_f16, load_f32, load_f32x8, load_i8x32, load_i32, load_i32x8, pair_dot_i8_i32,
                   prefetch, store_f32x8, store_i8x32)

_F32 = np.float32
ROW_PARTS = 64  # runs of rows shared out to the threads when several tokens share a row (_rows_q4_k, _rows_q6_k)


@njit(cache=True, inline="always")
def _prefetch_block(w, o, nbytes):
    """Hint the cache lines of the nbytes-long super-block PREFETCH_BYTES past byte o (see dots_block32)."""
    for k in range(0, nbytes, 64):
        prefetch(w, o + PREFETCH_BYTES + k)

# --- Q4_K ---------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _nibbles_q4_k(w, o):
    """The Q4_K super-block at byte o's 256 quants (0..15) as eight 32-value groups, in order."""
    q0, q1 = load_i8x32(w, o + 16), load_i8x32(w, o + 48)
    q2, q3 = load_i8x32(w, o + 80), load_i8x32(w, o + 112)
    return (i8x32_and(q0, 15), i8x32_and(i8x32_shr(q0, 4), 15), i8x32_and(q1, 15), i8x32_and(i8x32_shr(q1, 4), 15),
            i8x32_and(q2, 15), i8x32_and(i8x32_shr(q2, 4), 15), i8x32_and(q3, 15), i8x32_and(i8x32_shr(q3, 4), 15))


@njit(cache=True, inline="always")
def _lanes_q4_k(q, scales, mins, xq, xo, bsums, bo):
    """Lanes totalling (sum of q * x * scale over a super-block, sum of min * bsum over its sixteen 16-element
    halves), exact integers, from its decoded groups q (_nibbles_q4_k) and its scales and mins words
    (k_scales_mins). Only the totals count, so the groups may land in any lanes (dot4_u8x32_byte_scales,
    i32x8_mins_dot)."""
    low = dot4_u8x32_byte_scales(i32x8_zero(), q[0], load_i8x32(xq, xo), q[1], load_i8x32(xq, xo + 32), q[2],
                                 load_i8x32(xq, xo + 64), q[3], load_i8x32(xq, xo + 96), scales, 0)
    high = dot4_u8x32_byte_scales(i32x8_zero(), q[4], load_i8x32(xq, xo + 128), q[5], load_i8x32(xq, xo + 160), q[6],
                                  load_i8x32(xq, xo + 192), q[7], load_i8x32(xq, xo + 224), scales, 1)
    return i32x8_add(low, high), i32x8_mins_dot(mins, bsums, bo)


@njit(cache=True, inline="always")
def _sums_q4_k(q, scales, mins, xq, xo, bsums, bo):
    """_lanes_q4_k's two totals."""
    isum, msum = _lanes_q4_k(q, scales, mins, xq, xo, bsums, bo)
    return i32x8_hsum_two(isum, msum)


@njit(cache=True, inline="always")
def _superblock_q4_k(w, o, xq, xo, bsums, bo):
    """_sums_q4_k of the super-block at byte o for one token."""
    scales, mins = k_scales_mins(w, o + 4)
    return _sums_q4_k(_nibbles_q4_k(w, o), scales, mins, xq, xo, bsums, bo)


@njit(cache=True)
def _decode_q4_k(w, o, qbuf, qo, scales, mins, so):
    for g in range(8):
        q, scales[so + 2 * g], scales[so + 2 * g + 1], mins[so + 2 * g], mins[so + 2 * g + 1] = _group_q4_k(w, o, g)
        store_i8x32(qbuf, qo + 32 * g, q)
    return _scales_q45_k(w, o)


@njit(cache=True, inline="always")
def _decoded_pair(qbuf, scales, mins, qo, xq, xo, bsums, p):
    """Exact integer sums of the 32-value groups 2p and 2p+1 of a decoded super-block: (scaled dot, mins term)."""
    isum, msum = i32x8_zero(), 0
    for g in range(2 * p, 2 * p + 2):
        so, bo = qo // 16 + 2 * g, xo // 16 + 2 * g
        isum = i32x8_add(isum, dot_i8x32_2scales(load_i8x32(qbuf, qo + 32 * g), load_i8x32(xq, xo + 32 * g),
                                                 load_i32(scales, so), load_i32(scales, so + 1)))
        msum += load_i32(mins, so) * load_i32(bsums, bo) + load_i32(mins, so + 1) * load_i32(bsums, bo + 1)
    return i32x8_hsum(isum), msum


@njit(cache=True)
def _gemm_q4_k_decoded(qbuf, scales, mins, dd, dmins, i, t, xq, xd, bsums):
    """Decoded row i (a ROW_CHUNK buffer) x token t as llama.cpp's repacked Q4_K 4-row gemm
    (ggml_gemm_q4_K_8x8_q8_K, AVX2): the FMAs go per pair of 32-value groups, four per super-block, for the sum
    and (in an accumulator of their own) for the mins."""
    n_in = qbuf.shape[0] // ROW_CHUNK
    nsb = n_in // 256
    acc, mn = _F32(0), _F32(0)
    for b in range(nsb):
        qo, xo = i * n_in + 256 * b, t * n_in + 256 * b
        dx = load_f32(xd, t * nsb + b)
        ds, dm = load_f32(dd, i * nsb + b) * dx, load_f32(dmins, i * nsb + b) * dx
        for p in range(4):
            isum, msum = _decoded_pair(qbuf, scales, mins, qo, xq, xo, bsums, p)
            acc = fma32(_F32(isum), ds, acc)
            mn = fma32(_F32(msum), dm, mn)
    return acc - mn


@njit(cache=True, inline="always")
def _mins_pair(mins, so, bsums, bo):
    """The exact integer mins term of one pair of 32-value groups (its four 16-value halves)."""
    return (load_i32(mins, so) * load_i32(bsums, bo) + load_i32(mins, so + 1) * load_i32(bsums, bo + 1)) + \
        (load_i32(mins, so + 2) * load_i32(bsums, bo + 2) + load_i32(mins, so + 3) * load_i32(bsums, bo + 3))


@njit(cache=True)
def _gemm_q4_k_decoded_four(qbuf, scales, mins, dd, dmins, i, t, xq, xd, bsums):
    """_gemm_q4_k_decoded for tokens t..t+3: each decoded group and its scale loaded once for the four, the four
    integer totals of a pair reduced together (i32x8_hsum4), the float arithmetic per token unchanged."""
    n_in = qbuf.shape[0] // ROW_CHUNK
    nsb, bs = n_in // 256, n_in // 16
    a0 = a1 = a2 = a3 = m0 = m1 = m2 = m3 = _F32(0)
    for b in range(nsb):
        qo, xo = i * n_in + 256 * b, t * n_in + 256 * b
        d, dmin, xb = load_f32(dd, i * nsb + b), load_f32(dmins, i * nsb + b), t * nsb + b
        dx0, dx1, dx2, dx3 = load_f32(xd, xb), load_f32(xd, xb + nsb), load_f32(xd, xb + 2 * nsb), \
            load_f32(xd, xb + 3 * nsb)
        for p in range(4):
            s0, s1, s2, s3 = i32x8_zero(), i32x8_zero(), i32x8_zero(), i32x8_zero()
            for g in range(2 * p, 2 * p + 2):
                q = load_i8x32(qbuf, qo + 32 * g)  # decoded quants are 0..15: no sign flip
                sc = load_i32(scales, qo // 16 + 2 * g)  # Q4_K: one scale for both halves of a group
                s0 = i32x8_add(s0, dot_u8x32_2scales(q, load_i8x32(xq, xo + 32 * g), sc, sc))
                s1 = i32x8_add(s1, dot_u8x32_2scales(q, load_i8x32(xq, xo + n_in + 32 * g), sc, sc))
                s2 = i32x8_add(s2, dot_u8x32_2scales(q, load_i8x32(xq, xo + 2 * n_in + 32 * g), sc, sc))
                s3 = i32x8_add(s3, dot_u8x32_2scales(q, load_i8x32(xq, xo + 3 * n_in + 32 * g), sc, sc))
            h0, h1, h2, h3 = i32x8_hsum4(s0, s1, s2, s3)
            so, bo = qo // 16 + 4 * p, xo // 16 + 4 * p
            a0 = fma32(_F32(h0), d * dx0, a0)
            a1 = fma32(_F32(h1), d * dx1, a1)
            a2 = fma32(_F32(h2), d * dx2, a2)
            a3 = fma32(_F32(h3), d * dx3, a3)
            m0 = fma32(_F32(_mins_pair(mins, so, bsums, bo)), dmin * dx0, m0)
            m1 = fma32(_F32(_mins_pair(mins, so, bsums, bo + bs)), dmin * dx1, m1)
            m2 = fma32(_F32(_mins_pair(mins, so, bsums, bo + 2 * bs)), dmin * dx2, m2)
            m3 = fma32(_F32(_mins_pair(mins, so, bsums, bo + 3 * bs)), dmin * dx3, m3)
    return a0 - m0, a1 - m1, a2 - m2, a3 - m3


@njit(cache=True)
def _zeros8():
    z = i32x8_zero()
    return z, z, z, z, z, z, z, z


@njit(cache=True)
def _dot2(q, x, lo, hi, signed):
    """dot_i8x32_2scales for signed values, dot_u8x32_2scales for 0..127 ones; `signed` is a constant at every
    call site, so the branch folds away once inlined."""
    if signed:
        return dot_i8x32_2scales(q, x, lo, hi)
    return dot_u8x32_2scales(q, x, lo, hi)


@njit(cache=True)
def _group_eight(sums, q, xq, k, n_in, lo, hi, signed):
    """One decoded 32-value group q (values 0-15 scaled by lo, 16-31 by hi) times eight tokens' activations (at k,
    k + n_in, ...), added to their eight integer accumulators. Q6_K's decoded values are signed, Q4_K's 0..15."""
    s0, s1, s2, s3, s4, s5, s6, s7 = sums
    s0 = i32x8_add(s0, _dot2(q, load_i8x32(xq, k), lo, hi, signed))
    s1 = i32x8_add(s1, _dot2(q, load_i8x32(xq, k + n_in), lo, hi, signed))
    s2 = i32x8_add(s2, _dot2(q, load_i8x32(xq, k + 2 * n_in), lo, hi, signed))
    s3 = i32x8_add(s3, _dot2(q, load_i8x32(xq, k + 3 * n_in), lo, hi, signed))
    s4 = i32x8_add(s4, _dot2(q, load_i8x32(xq, k + 4 * n_in), lo, hi, signed))
    s5 = i32x8_add(s5, _dot2(q, load_i8x32(xq, k + 5 * n_in), lo, hi, signed))
    s6 = i32x8_add(s6, _dot2(q, load_i8x32(xq, k + 6 * n_in), lo, hi, signed))
    s7 = i32x8_add(s7, _dot2(q, load_i8x32(xq, k + 7 * n_in), lo, hi, signed))
    return s0, s1, s2, s3, s4, s5, s6, s7


@njit(cache=True)
def _any_set(kinds):
    """kinds.any() as a loop: the array method would make a cached kernel load Numba's array-math registry at
    start-up (a third of a second, see quant.cache_load)."""
    for j in range(kinds.shape[0]):
        if kinds[j]:
            return True
    return False


@njit(cache=True)
def _all_eight(kinds, t):
    """kinds[t..t+7] all set (a loop: an array slice's .all() costs seconds more to compile)."""
    for j in range(t, t + 8):
        if not kinds[j]:
            return False
    return True


@njit(cache=True)
def _tokens_innermost(src, n_tokens, per_token, dst):
    """src[t * per_token + k] (a value per token and super-block or sub-block) as dst[(g * per_token + k) * 8 + j]
    for t = 8g + j: each group of eight tokens' values side by side, one vector per k, for the eight-token gemms."""
    for g in range(n_tokens // 8):
        for j in range(8):
            for k in range(per_token):
                dst[(g * per_token + k) * 8 + j] = src[(8 * g + j) * per_token + k]


@njit(cache=True)
def _gemm_q4_k_decoded_eight(qbuf, scales, mins, dd, dmins, i, t, xq, xdt, bst):
    """_gemm_q4_k_decoded for tokens t..t+7 (t a multiple of 8), the tokens in vector lanes: each pair's eight
    exact integer totals reduced into one vector (i32x8_hsum8), their mins terms computed eight at a time, and
    the two FMAs per pair done for the eight tokens at once. Each lane's arithmetic is the scalar kernel's."""
    n_in = qbuf.shape[0] // ROW_CHUNK
    nsb, n16, g8 = n_in // 256, n_in // 16, t // 8
    acc, mn = f32x8_zero(), f32x8_zero()
    for b in range(nsb):
        qo, xo = i * n_in + 256 * b, t * n_in + 256 * b
        dx = load_f32x8(xdt, (g8 * nsb + b) * 8)
        ds, dm = f32x8_mul(f32x8_splat(load_f32(dd, i * nsb + b)), dx), \
            f32x8_mul(f32x8_splat(load_f32(dmins, i * nsb + b)), dx)
        for p in range(4):
            sums = _zeros8()
            for g in range(2 * p, 2 * p + 2):
                sc = load_i32(scales, qo // 16 + 2 * g)  # Q4_K: one scale for both halves of a group
                # decoded quants are 0..15: no sign flip
                sums = _group_eight(sums, load_i8x32(qbuf, qo + 32 * g), xq, xo + 32 * g, n_in, sc, sc, False)
            so, bo = qo // 16 + 4 * p, (g8 * n16 + (256 * b) // 16 + 4 * p) * 8
            m = i32x8_mul(i32x8_splat(load_i32(mins, so)), load_i32x8(bst, bo))
            m = i32x8_add(m, i32x8_mul(i32x8_splat(load_i32(mins, so + 1)), load_i32x8(bst, bo + 8)))
            m = i32x8_add(m, i32x8_mul(i32x8_splat(load_i32(mins, so + 2)), load_i32x8(bst, bo + 16)))
            m = i32x8_add(m, i32x8_mul(i32x8_splat(load_i32(mins, so + 3)), load_i32x8(bst, bo + 24)))
            acc = f32x8_fma_lanes(acc, i32x8_hsum8(*sums), ds)
            mn = f32x8_fma_lanes(mn, m, dm)
    return _lanes8(f32x8_sub(acc, mn))


@njit(cache=True)
def vec_dot_q4_k_q8_k(w, o, nsb, xq, xo, xd, bsums):
    """One row x one token as llama.cpp's repacked Q4_K gemv (ggml_gemv_q4_K_8x8_q8_K, AVX2): per super-block
    one FMA of its exact integer total into A and one of its mins total into Mn; the result is A - Mn."""
    acc, mins = _F32(0), _F32(0)
    for b in range(nsb):
        _prefetch_block(w, o + 144 * b, 144)
        isum, msum = _superblock_q4_k(w, o + 144 * b, xq, xo + 256 * b, bsums, (xo + 256 * b) // 16)
        d, dmin = _scales_q45_k(w, o + 144 * b)
        dx = load_f32(xd, xo // 256 + b)
        acc = fma32(_F32(isum), d * dx, acc)
        mins = fma32(_F32(msum), dmin * dx, mins)
    return acc - mins


@njit(cache=True, inline="always")
def _four_tokens_q4_k(q, scales, mins, xq, x0, n_in, bsums):
    """_lanes_q4_k for the four tokens whose activations start at x0, x0 + n_in, ...: (their sums' lanes, their
    mins' lanes)."""
    i0, m0 = _lanes_q4_k(q, scales, mins, xq, x0, bsums, x0 // 16)
    i1, m1 = _lanes_q4_k(q, scales, mins, xq, x0 + n_in, bsums, (x0 + n_in) // 16)
    i2, m2 = _lanes_q4_k(q, scales, mins, xq, x0 + 2 * n_in, bsums, (x0 + 2 * n_in) // 16)
    i3, m3 = _lanes_q4_k(q, scales, mins, xq, x0 + 3 * n_in, bsums, (x0 + 3 * n_in) // 16)
    return (i0, i1, i2, i3), (m0, m1, m2, m3)


@njit(cache=True, inline="always")
def _scalar_fmas_q4_k(acc, t, n_tokens, isum, msum, d, dmin, dx):
    """Token t's two gemv FMAs into acc (its sums at t, its mins terms at n_tokens + t)."""
    acc[t] = fma32(_F32(isum), d * dx, acc[t])
    acc[n_tokens + t] = fma32(_F32(msum), dmin * dx, acc[n_tokens + t])


@njit(cache=True)
def _rows_q4_k(w, o, nsb, xq, xd, xdt, bsums, out, r, acc):
    """out[t, r] for every token t, vec_dot_q4_k_q8_k's bits for the row at byte o: each super-block's quants and
    scales decoded once for all the tokens (sequences decoding together), then per token the gemv's integer sums
    and its two FMAs; eight tokens at a time the sums are reduced into one vector and the FMAs run in its lanes
    (xdt: xd with each eight tokens' scales side by side, _tokens_innermost). acc: 2 x tokens floats of scratch."""
    n_tokens, n_in = out.shape[0], 256 * nsb
    acc[:] = 0
    for b in range(nsb):
        ob = o + 144 * b
        _prefetch_block(w, ob, 144)
        scales, mins = k_scales_mins(w, ob + 4)
        d, dmin = _scales_q45_k(w, ob)
        q = _nibbles_q4_k(w, ob)
        t = 0
        while t + 8 <= n_tokens:
            x0 = t * n_in + 256 * b
            i, m = _four_tokens_q4_k(q, scales, mins, xq, x0, n_in, bsums)
            j, n = _four_tokens_q4_k(q, scales, mins, xq, x0 + 4 * n_in, n_in, bsums)
            dx = load_f32x8(xdt, ((t // 8) * nsb + b) * 8)
            store_f32x8(acc, t, f32x8_fma_lanes(load_f32x8(acc, t),
                                                i32x8_hsum8(i[0], i[1], i[2], i[3], j[0], j[1], j[2], j[3]),
                                                f32x8_mul(f32x8_splat(d), dx)))
            store_f32x8(acc, n_tokens + t, f32x8_fma_lanes(load_f32x8(acc, n_tokens + t),
                                                           i32x8_hsum8(m[0], m[1], m[2], m[3], n[0], n[1], n[2], n[3]),
                                                           f32x8_mul(f32x8_splat(dmin), dx)))
            t += 8
        while t + 4 <= n_tokens:
            x0 = t * n_in + 256 * b
            i, m = _four_tokens_q4_k(q, scales, mins, xq, x0, n_in, bsums)
            isums, msums = i32x8_hsum4(i[0], i[1], i[2], i[3]), i32x8_hsum4(m[0], m[1], m[2], m[3])
            for k in range(4):
                _scalar_fmas_q4_k(acc, t + k, n_tokens, isums[k], msums[k], d, dmin, load_f32(xd, (t + k) * nsb + b))
            t += 4
        while t < n_tokens:
            xo = t * n_in + 256 * b
            isum, msum = _sums_q4_k(q, scales, mins, xq, xo, bsums, xo // 16)
            _scalar_fmas_q4_k(acc, t, n_tokens, isum, msum, d, dmin, load_f32(xd, t * nsb + b))
            t += 1
    for t in range(n_tokens):
        out[t, r] = acc[t] - acc[n_tokens + t]


@njit(cache=True)
def _decoded_chunk_q4_k(w, row_bytes, c, n_out, n_in):
    """Rows [ROW_CHUNK c, ROW_CHUNK c + ROW_CHUNK) decoded into int8 once for every token: (first row, rows, qbuf,
    scales, mins, dd, dmins)."""
    nsb = n_in // 256
    qbuf, scales, mins, dd, dmins = _row_chunk_buffers(n_in)
    r0 = c * ROW_CHUNK
    n_rows = min(ROW_CHUNK, n_out - r0)
    for i in range(n_rows * nsb):
        qo = (i // nsb) * n_in + 256 * (i % nsb)
        o = (r0 + i // nsb) * row_bytes + 144 * (i % nsb)
        _prefetch_block(w, o, 144)
        dd[i], dmins[i] = _decode_q4_k(w, o, qbuf, qo, scales, mins, qo // 16)
    return r0, n_rows, qbuf, scales, mins, dd, dmins


@njit(cache=True)
def _step_q4_k(w, row_bytes, r, i, t, kinds, qbuf, scales, mins, dd, dmins, xq, xd, bsums, out):
    """Row r (row i of the decoded chunk) for token t with the four-token gemm, the one-token gemm or the gemv, as
    kinds says; returns the next token."""
    n_tokens, n_in = out.shape[0], qbuf.shape[0] // ROW_CHUNK
    if t + 3 < n_tokens and kinds[t] and kinds[t + 1] and kinds[t + 2] and kinds[t + 3]:
        out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = \
            _gemm_q4_k_decoded_four(qbuf, scales, mins, dd, dmins, i, t, xq, xd, bsums)
        return t + 4
    if kinds[t]:
        out[t, r] = _gemm_q4_k_decoded(qbuf, scales, mins, dd, dmins, i, t, xq, xd, bsums)
    else:
        out[t, r] = vec_dot_q4_k_q8_k(w, r * row_bytes, n_in // 256, xq, t * n_in, xd, bsums)
    return t + 1


@njit(parallel=True, cache=True)
def matmul_q4_k_few(w, row_bytes, x, xq, xd, bsums, out, kinds):
    """matmul_q4_k for batches without an eight-token group of gemm rows (decode, short prompts): the same bits,
    without the eight-token gemm, whose compilation a first run with a short prompt then skips. Several tokens that
    are all the gemv's (sequences decoding together, a verified draft) share each super-block's decoding
    (_rows_q4_k)."""
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    _quantize_tokens(x, xq, xd, bsums, kinds)
    if not _any_set(kinds):  # (gemm rows come in groups of 4 tokens)
        if n_tokens == 1:
            for r in prange(n_out):
                out[0, r] = vec_dot_q4_k_q8_k(w, r * row_bytes, nsb, xq, 0, xd, bsums)
            return
        xdt = np.empty((n_tokens // 8) * 8 * nsb, np.float32)
        _tokens_innermost(xd, n_tokens, nsb, xdt)
        n_parts = min(n_out, ROW_PARTS)
        for part in prange(n_parts):
            acc = np.empty(2 * n_tokens, np.float32)
            for r in range(part * n_out // n_parts, (part + 1) * n_out // n_parts):
                _rows_q4_k(w, r * row_bytes, nsb, xq, xd, xdt, bsums, out, r, acc)
        return
    for c in prange((n_out + ROW_CHUNK - 1) // ROW_CHUNK):
        r0, n_rows, qbuf, scales, mins, dd, dmins = _decoded_chunk_q4_k(w, row_bytes, c, n_out, n_in)
        for i in range(n_rows):
            t = 0
            while t < n_tokens:
                t = _step_q4_k(w, row_bytes, r0 + i, i, t, kinds, qbuf, scales, mins, dd, dmins, xq, xd, bsums, out)


@njit(parallel=True, cache=True)
def matmul_q4_k(w, row_bytes, x, xq, xd, bsums, out, kinds):
    """kinds[t] (row_kinds): 1 for the rows llama.cpp multiplies with its repacked 4-row gemm, 0 for the gemv.
    With gemm rows, ROW_CHUNK weight rows are decoded once into int8 and reused for every token; aligned groups of
    eight gemm tokens go eight at a time (the bits of two four-token groups)."""
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    _quantize_tokens(x, xq, xd, bsums, kinds)
    xdt = np.empty((n_tokens // 8) * 8 * nsb, np.float32)
    bst = np.empty((n_tokens // 8) * 8 * (n_in // 16), np.int32)
    _tokens_innermost(xd, n_tokens, nsb, xdt)
    _tokens_innermost(bsums, n_tokens, n_in // 16, bst)
    for c in prange((n_out + ROW_CHUNK - 1) // ROW_CHUNK):
        r0, n_rows, qbuf, scales, mins, dd, dmins = _decoded_chunk_q4_k(w, row_bytes, c, n_out, n_in)
        for i in range(n_rows):
            t, r = 0, r0 + i
            while t < n_tokens:
                if t % 8 == 0 and t + 7 < n_tokens and _all_eight(kinds, t):
                    (out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r], out[t + 4, r], out[t + 5, r],
                     out[t + 6, r], out[t + 7, r]) = _gemm_q4_k_decoded_eight(qbuf, scales, mins, dd, dmins, i, t,
                                                                            xq, xdt, bst)
                    t += 8
                else:
                    t = _step_q4_k(w, row_bytes, r, i, t, kinds, qbuf, scales, mins, dd, dmins, xq, xd, bsums, out)


# The wide prompt gemms (Q4_K here, Q6_K below): the same per-token arithmetic as _gemm_q4_k_decoded, with one token
# per lane of a vector (simd.token_lanes: 16 with the 512-bit tiles, else 8). Weights are read as packed from the
# file, a 4-byte word broadcast to every lane and masked to its nibbles, so no rows are decoded; the gemm tokens'
# activations are interleaved once per call (WIDE_LANES tokens x 4 bytes a step), and each activation load serves
# two rows.
WIDE_LANES = LANES  # tokens a vector: 16 with simd.HAS_WIDE_TILES, else 8
WIDE_ROWS = 16  # rows per block: the block's accumulators and one super-block of activations stay in L1
WIDE_PARTS = 64  # runs of blocks shared out to the threads


@njit(cache=True, inline="always")
def _wide_scales(w, o):
    """A super-block's (scales word, mins word, d, dmin): k_scales_mins and the two float16 scales, read once."""
    scales, mins = k_scales_mins(w, o + 4)
    return scales, mins, load_f16(w, o), load_f16(w, o + 2)


@njit(cache=True, inline="always")
def _pair_scales(words, p):
    """Group pair p's (scale 2p, scale 2p+1, min 2p, min 2p+1) and the super-block's (d, dmin) as splats."""
    scales, mins, d, dmin = words
    return (lanes_splat(_F32((scales >> (16 * p)) & 63)), lanes_splat(_F32((scales >> (16 * p + 8)) & 63)),
            lanes_splat(_F32((mins >> (16 * p)) & 63)), lanes_splat(_F32((mins >> (16 * p + 8)) & 63)),
            lanes_splat(d), lanes_splat(dmin))


@njit(cache=True, inline="always")
def _wide_pair(acc, mn, ao, s0, s1, scales, b0, b1, dx):
    """One group pair into a row's accumulators for a vector of tokens, as _gemm_q4_k_decoded's two FMAs: acc += (s0 sc0
    + s1 sc1) (d dx), mn += (min0 b0 + min1 b1) (dmin dx). The integer products and sums are below 2**24, so the
    float arithmetic before the FMAs is exact and gives the scalar kernel's integers."""
    sc0, sc1, m0, m1, d, dmin = scales
    isum = lanes_fma(lanes_mul(s0, sc0), s1, sc1)
    store_lanes(acc, ao, lanes_fma(load_lanes(acc, ao), isum, lanes_mul(d, dx)))
    msum = lanes_fma(lanes_mul(m0, b0), m1, b1)
    store_lanes(mn, ao, lanes_fma(load_lanes(mn, ao), msum, lanes_mul(dmin, dx)))


@njit(cache=True)
def _wide_superblock(w, o, row_bytes, two, xt, xdt, bt, b, n_in, v0, tile, acc, mn, ao, per_row):
    """Super-block b of the row at byte o and, where `two`, the next row (its accumulators per_row lanes on), times
    token vectors v0..v0 + TILE_VECTORS - 1 where `tile`, else v0 alone."""
    nsb, n32, tvs = n_in // 256, n_in // 32, n_in * WIDE_LANES
    words = _wide_scales(w, o)
    words2 = _wide_scales(w, o + row_bytes) if two else words
    for p in range(4):
        xo, g = v0 * tvs + (256 * b + 64 * p) * WIDE_LANES, 8 * b + 2 * p
        first = _pair_scales(words, p)
        if two and tile:
            second = _pair_scales(words2, p)
            s = q4_k_pair_sums_tile(w, o + 16 + 32 * p, row_bytes, xt, xo, tvs)
            for j in range(TILE_VECTORS):
                v = v0 + j
                dx = load_lanes(xdt, (v * nsb + b) * WIDE_LANES)
                b0, b1 = load_lanes(bt, (v * n32 + g) * WIDE_LANES), load_lanes(bt, (v * n32 + g + 1) * WIDE_LANES)
                _wide_pair(acc, mn, ao + v * WIDE_LANES, s[j], s[TILE_VECTORS + j], first, b0, b1, dx)
                _wide_pair(acc, mn, ao + per_row + v * WIDE_LANES, s[2 * TILE_VECTORS + j], s[3 * TILE_VECTORS + j],
                           second, b0, b1, dx)
        else:
            s0, s1 = q4_k_pair_sums_1x1(w, o + 16 + 32 * p, row_bytes, xt, xo, tvs)
            _wide_pair(acc, mn, ao + v0 * WIDE_LANES, s0, s1, first, load_lanes(bt, (v0 * n32 + g) * WIDE_LANES),
                       load_lanes(bt, (v0 * n32 + g + 1) * WIDE_LANES), load_lanes(xdt, (v0 * nsb + b) * WIDE_LANES))


@njit(cache=True)
def _gemm_tokens(kinds):
    """The indices of the tokens with kinds[t] set, in order."""
    n_g = 0
    for t in range(kinds.shape[0]):
        n_g += kinds[t] != 0
    toks = np.empty(n_g, np.int64)
    n_g = 0
    for t in range(kinds.shape[0]):
        if kinds[t]:
            toks[n_g] = t
            n_g += 1
    return toks


@njit(cache=True)
def _wide_tokens(xq, xd, toks, n_in):
    """The tokens toks' activations interleaved for the lanes, WIDE_LANES tokens a vector: (xt, four bytes a token per
    64-byte step; xdt, their super-block scales side by side). Lanes past the last token are 0."""
    nsb, n4 = n_in // 256, n_in // 4
    n_tv = (toks.shape[0] + WIDE_LANES - 1) // WIDE_LANES
    xt, xdt = np.zeros(n_tv * WIDE_LANES * n_in, np.int8), np.zeros(n_tv * nsb * WIDE_LANES, np.float32)
    x32, xt32 = xq.view(np.int32), xt.view(np.int32)
    for j in range(toks.shape[0]):
        t, v, lane = toks[j], j // WIDE_LANES, j % WIDE_LANES
        for k in range(n4):
            xt32[(v * n4 + k) * WIDE_LANES + lane] = x32[t * n4 + k]
        for b in range(nsb):
            xdt[(v * nsb + b) * WIDE_LANES + lane] = xd[t * nsb + b]
    return xt, xdt


@njit(cache=True)
def _wide_sums(bsums, toks, n_in, per, factor, dst):
    """factor x each token's activation sums per `per` values (a multiple of 16), in the lanes of dst (float32 for
    Q4_K's groups, int32 for Q6_K's sub-blocks; exact either way). Lanes past the last token stay as dst has them."""
    n, halves = n_in // per, per // 16
    for j in range(toks.shape[0]):
        t, v, lane = toks[j], j // WIDE_LANES, j % WIDE_LANES
        for g in range(n):
            total = 0
            for h in range(halves):
                total += bsums[(t * n + g) * halves + h]
            dst[(v * n + g) * WIDE_LANES + lane] = factor * total
    return dst


@njit(cache=True)
def _wide_results(out, toks, r0, n_rows, per_row, acc, mn):
    """A block's gemm tokens into out[:, r0:r0 + n_rows]: acc - mn (mn None: acc)."""
    for r in range(n_rows):
        for j in range(toks.shape[0]):
            if mn is None:
                out[toks[j], r0 + r] = acc[r * per_row + j]
            else:
                out[toks[j], r0 + r] = acc[r * per_row + j] - mn[r * per_row + j]


@njit(cache=True)
def _wide_block_q4_k(w, row_bytes, r0, n_rows, n_in, xt, xdt, bt, n_tv, acc, mn):
    """Rows r0..r0 + n_rows for every token vector: acc and mn (per row, n_tv * WIDE_LANES lanes) from zero."""
    acc[:] = 0
    mn[:] = 0
    per_row = n_tv * WIDE_LANES
    for b in range(n_in // 256):
        v0 = 0
        while v0 < n_tv:
            tile = v0 + TILE_VECTORS <= n_tv
            r = 0
            while r < n_rows:
                two = tile and r + 1 < n_rows
                _wide_superblock(w, (r0 + r) * row_bytes + 144 * b, row_bytes, two, xt, xdt, bt, b, n_in, v0, tile,
                                 acc, mn, r * per_row, per_row)
                r += 2 if two else 1
            v0 += TILE_VECTORS if tile else 1


@njit(parallel=True, cache=True)
def matmul_q4_k_wide(w, row_bytes, x, xq, xd, bsums, out, kinds):
    """matmul_q4_k's bits with a gemm token per vector lane (above): blocks of WIDE_ROWS rows in WIDE_PARTS runs,
    each run with its own accumulators; the gemv's tokens as matmul_q4_k."""
    n_in, n_out = x.shape[1], out.shape[1]
    _quantize_tokens(x, xq, xd, bsums, kinds)
    toks = _gemm_tokens(kinds)
    n_tv = (toks.shape[0] + WIDE_LANES - 1) // WIDE_LANES
    xt, xdt = _wide_tokens(xq, xd, toks, n_in)
    bt = _wide_sums(bsums, toks, n_in, 32, 1, np.zeros(n_tv * (n_in // 32) * WIDE_LANES, np.float32))
    n_blocks = (n_out + WIDE_ROWS - 1) // WIDE_ROWS
    n_parts = min(n_blocks, WIDE_PARTS)
    for part in prange(n_parts):  # accumulators per part, not per block: fewer allocations
        acc = np.empty(WIDE_ROWS * n_tv * WIDE_LANES, np.float32)
        mn = np.empty(WIDE_ROWS * n_tv * WIDE_LANES, np.float32)
        for blk in range(part * n_blocks // n_parts, (part + 1) * n_blocks // n_parts):
            r0 = blk * WIDE_ROWS
            n_rows = min(WIDE_ROWS, n_out - r0)
            _wide_block_q4_k(w, row_bytes, r0, n_rows, n_in, xt, xdt, bt, n_tv, acc, mn)
            _wide_results(out, toks, r0, n_rows, n_tv * WIDE_LANES, acc, mn)
            for t in range(x.shape[0]):  # the gemv's tokens
                if not kinds[t]:
                    for r in range(r0, r0 + n_rows):
                        out[t, r] = vec_dot_q4_k_q8_k(w, r * row_bytes, n_in // 256, xq, t * n_in, xd, bsums)


# --- Q6_K ---------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _codes_q6_k(w, o, g):
    """The unsigned 6-bit codes (0..63) of values 32g..32g+31 of the super-block at byte o."""
    h, j = g >> 2, g & 3
    low = i8x32_and(i8x32_shr(load_i8x32(w, o + 64 * h + 32 * (j & 1)), 4 * (j >> 1)), 15)
    high = i8x32_and(i8x32_shr(load_i8x32(w, o + 128 + 32 * h), 2 * j), 3)
    return i8x32_or(low, i8x32_shl(high, 4))


@njit(cache=True, inline="always")
def _codes8_q6_k(w, o):
    """The Q6_K super-block at byte o's 256 codes (0..63) as eight 32-value groups, in order."""
    return (_codes_q6_k(w, o, 0), _codes_q6_k(w, o, 1), _codes_q6_k(w, o, 2), _codes_q6_k(w, o, 3),
            _codes_q6_k(w, o, 4), _codes_q6_k(w, o, 5), _codes_q6_k(w, o, 6), _codes_q6_k(w, o, 7))


@njit(cache=True, inline="always")
def _token_lanes_q6_k(c, w, o, xq, xo, bsums, bo):
    """llama.cpp's 8 int32 lanes of one Q6_K super-block (at byte o, its codes c from _codes8_q6_k) for one token:
    the unsigned codes times the activations, scaled per 16 values, with the codes' -32 offset taken out through
    the activation sums, lane l for the 16-value groups 2l and 2l+1 (ggml_vec_dot_q6_K_q8_K, AVX2). Exact
    integers; only their split into lanes matters. Each group's scale lanes are fixed when compiled (a loop over
    the groups kept them variable: 35 instructions a group against about 12)."""
    s = o + 192
    lanes = i32x8_add(i32x8_add(i32x8_add(dot_u8x32_scale_pair(c[0], load_i8x32(xq, xo), w, s, 0),
                                          dot_u8x32_scale_pair(c[1], load_i8x32(xq, xo + 32), w, s, 1)),
                                i32x8_add(dot_u8x32_scale_pair(c[2], load_i8x32(xq, xo + 64), w, s, 2),
                                          dot_u8x32_scale_pair(c[3], load_i8x32(xq, xo + 96), w, s, 3))),
                      i32x8_add(i32x8_add(dot_u8x32_scale_pair(c[4], load_i8x32(xq, xo + 128), w, s, 4),
                                          dot_u8x32_scale_pair(c[5], load_i8x32(xq, xo + 160), w, s, 5)),
                                i32x8_add(dot_u8x32_scale_pair(c[6], load_i8x32(xq, xo + 192), w, s, 6),
                                          dot_u8x32_scale_pair(c[7], load_i8x32(xq, xo + 224), w, s, 7))))
    return i32x8_madd(lanes, pair_dot_i8_i32(w, s, bsums, bo), -32)


@njit(cache=True, inline="always")
def _lanes_q6_k(w, o, xq, xo, bsums, bo):
    """_token_lanes_q6_k of the super-block at byte o."""
    return _token_lanes_q6_k(_codes8_q6_k(w, o), w, o, xq, xo, bsums, bo)


@njit(cache=True)
def vec_dot_q6_k_q8_k(w, o, nsb, xq, xo, xd, bsums):
    """One row x one token as llama.cpp's ggml_vec_dot_q6_K_q8_K (AVX2): per super-block, lanes[l] in float times
    d_w * d_x, FMA'd into 8 float lanes; the lanes summed at the end as hsum_float_8."""
    acc = f32x8_zero()
    for b in range(nsb):
        _prefetch_block(w, o + 210 * b, 210)
        lanes = _lanes_q6_k(w, o + 210 * b, xq, xo + 256 * b, bsums, (xo + 256 * b) // 16)
        acc = f32x8_fma_i32(acc, lanes, load_f16(w, o + 210 * b + 208) * load_f32(xd, xo // 256 + b))
    return f32x8_hsum(acc)


@njit(cache=True)
def _rows_q6_k(w, o, nsb, xq, xd, bsums, out, r, acc):
    """out[t, r] for every token t, vec_dot_q6_k_q8_k's bits for the row at byte o: each super-block's codes
    decoded once for all the tokens, then per token the gemv's lanes and FMA. acc: 8 x tokens floats of scratch."""
    n_tokens, n_in = out.shape[0], 256 * nsb
    acc[:] = 0
    for b in range(nsb):
        ob = o + 210 * b
        _prefetch_block(w, ob, 210)
        c = _codes8_q6_k(w, ob)
        d = load_f16(w, ob + 208)
        for t in range(n_tokens):
            xo = t * n_in + 256 * b
            lanes = _token_lanes_q6_k(c, w, ob, xq, xo, bsums, xo // 16)
            store_f32x8(acc, 8 * t, f32x8_fma_i32(load_f32x8(acc, 8 * t), lanes, d * load_f32(xd, t * nsb + b)))
    for t in range(n_tokens):
        out[t, r] = f32x8_hsum(load_f32x8(acc, 8 * t))


@njit(cache=True)
def _decode_q6_k(w, o, qbuf, qo, scales, mins, so):
    for g in range(8):
        q, scales[so + 2 * g], scales[so + 2 * g + 1], mins[so + 2 * g], mins[so + 2 * g + 1] = _group_q6_k(w, o, g)
        store_i8x32(qbuf, qo + 32 * g, q)
    return _scales_q6_k(w, o)


@njit(cache=True)
def _tiled_q6_k_decoded(qbuf, scales, dd, i, t, xq, xd):
    """Decoded row i (signed values q - 32) x token t as llama.cpp's tiled K-quant matmul (batches of 8 or more
    tokens): per super-block res = d_w * float(exact total), then acc = fma(res, d_x, acc)."""
    n_in = qbuf.shape[0] // ROW_CHUNK
    nsb = n_in // 256
    acc = _F32(0)
    for b in range(nsb):
        qo, xo = i * n_in + 256 * b, t * n_in + 256 * b
        res = load_f32(dd, i * nsb + b) * _F32(i32x8_hsum(_decoded_dot(qbuf, qo, scales, xq, xo)))
        acc = fma32(res, load_f32(xd, t * nsb + b), acc)
    return acc


@njit(cache=True)
def _tiled_q6_k_decoded_eight(qbuf, scales, dd, i, t, xq, xdt):
    """_tiled_q6_k_decoded for tokens t..t+7 (t a multiple of 8), the tokens in vector lanes: the eight exact
    super-block totals reduced into one vector (i32x8_hsum8), then res = d_w * float(total) and one FMA with d_x
    for the eight at once. Each lane's arithmetic is the scalar kernel's."""
    n_in = qbuf.shape[0] // ROW_CHUNK
    nsb, g8 = n_in // 256, t // 8
    acc = f32x8_zero()
    for b in range(nsb):
        qo, xo = i * n_in + 256 * b, t * n_in + 256 * b
        sums = _zeros8()
        for g in range(8):
            sums = _group_eight(sums, load_i8x32(qbuf, qo + 32 * g), xq, xo + 32 * g, n_in,
                                load_i32(scales, qo // 16 + 2 * g), load_i32(scales, qo // 16 + 2 * g + 1), True)
        res = f32x8_mul(f32x8_splat(load_f32(dd, i * nsb + b)), f32x8_from_i32(i32x8_hsum8(*sums)))
        acc = f32x8_fma(acc, res, load_f32x8(xdt, (g8 * nsb + b) * 8))
    return _lanes8(acc)


@njit(parallel=True, cache=True)
def matmul_q6_k(w, row_bytes, x, xq, xd, bsums, out, kinds):
    """kinds[t] (row_kinds): 1 for the rows llama.cpp multiplies with its tiled matmul, 0 for vec_dot.
    ROW_CHUNK weight rows are decoded once into int8 and reused for every tiled token. Batches without tiled rows
    (kernel_for) go to matmul_q6_k_few, which skips the decode."""
    _quantize_tokens(x, xq, xd, bsums)
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    xdt = np.empty((n_tokens // 8) * 8 * nsb, np.float32)
    _tokens_innermost(xd, n_tokens, nsb, xdt)  # (Q6_K's tiles need no activation sums)
    for c in prange((n_out + ROW_CHUNK - 1) // ROW_CHUNK):
        qbuf, scales, mins, dd, dmins = _row_chunk_buffers(n_in)
        r0 = c * ROW_CHUNK
        n_rows = min(ROW_CHUNK, n_out - r0)
        for i in range(n_rows * nsb):
            qo = (i // nsb) * n_in + 256 * (i % nsb)
            o = (r0 + i // nsb) * row_bytes + 210 * (i % nsb)
            _prefetch_block(w, o, 210)
            dd[i], dmins[i] = _decode_q6_k(w, o, qbuf, qo, scales, mins, qo // 16)
        for i in range(n_rows):
            t = 0
            while t < n_tokens:
                if t % 8 == 0 and t + 7 < n_tokens and _all_eight(kinds, t):
                    r = r0 + i
                    (out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r], out[t + 4, r], out[t + 5, r],
                     out[t + 6, r], out[t + 7, r]) = _tiled_q6_k_decoded_eight(qbuf, scales, dd, i, t, xq, xdt)
                    t += 8
                    continue
                if kinds[t]:
                    out[t, r0 + i] = _tiled_q6_k_decoded(qbuf, scales, dd, i, t, xq, xd)
                else:
                    out[t, r0 + i] = vec_dot_q6_k_q8_k(w, (r0 + i) * row_bytes, nsb, xq, t * n_in, xd, bsums)
                t += 1


@njit(parallel=True, cache=True)
def matmul_q6_k_few(w, row_bytes, x, xq, xd, bsums, out, kinds):
    """matmul_q6_k for batches without tiled rows (no batch of 8 tokens or more: decode, short prompts): vec_dot's
    bits per token, without compiling the tiled matmul (a first run with a short prompt skips it); several tokens
    share each super-block's decoding (_rows_q6_k)."""
    _quantize_tokens(x, xq, xd, bsums)
    n_tokens, n_in = x.shape
    nsb, n_out = n_in // 256, out.shape[1]
    if n_tokens == 1:
        for r in prange(n_out):
            out[0, r] = vec_dot_q6_k_q8_k(w, r * row_bytes, nsb, xq, 0, xd, bsums)
        return
    n_parts = min(n_out, ROW_PARTS)
    for part in prange(n_parts):
        acc = np.empty(8 * n_tokens, np.float32)
        for r in range(part * n_out // n_parts, (part + 1) * n_out // n_parts):
            _rows_q6_k(w, r * row_bytes, nsb, xq, xd, bsums, out, r, acc)


# The wide Q6_K prompt matmul: _tiled_q6_k_decoded's arithmetic with a token per vector lane, as matmul_q4_k_wide;
# the rows' 6-bit codes decoded once per block of rows, each 4-byte word of them broadcast from memory, and each
# sub-block's dot started at -32 x its activation sum (the codes' offset).


@njit(cache=True, inline="always")
def _wide_q6_k(acc, ao, total, d, dx):
    """acc += (d_w * float(total)) * d_x with one rounding, as _tiled_q6_k_decoded, for a vector of tokens."""
    store_lanes(acc, ao, lanes_fma(load_lanes(acc, ao), lanes_mul(d, total), dx))


@njit(cache=True)
def _wide_block_q6_k(w, row_bytes, r0, n_rows, n_in, codes, xt, xdt, offs, n_tv, acc):
    """Rows r0..r0 + n_rows for every token vector into acc (per row, n_tv * WIDE_LANES lanes, from zero)."""
    nsb, n16, L = n_in // 256, n_in // 16, WIDE_LANES
    for r in range(n_rows):
        for b in range(nsb):
            o = (r0 + r) * row_bytes + 210 * b
            for g in range(8):
                store_i8x32(codes, r * n_in + 256 * b + 32 * g, _codes_q6_k(w, o, g))
    acc[:] = 0
    per_row = n_tv * L
    for b in range(nsb):
        v0 = 0
        while v0 < n_tv:
            tile = v0 + TILE_VECTORS <= n_tv
            r = 0
            while r < n_rows:
                o, co, xo, oo = (r0 + r) * row_bytes + 210 * b, r * n_in + 256 * b, v0 * n_in * L + 256 * b * L, \
                    (v0 * n16 + 16 * b) * L
                d = lanes_splat(load_f16(w, o + 208))
                if tile and r + 1 < n_rows:
                    s = q6_k_superblock_sums_tile(codes, co, n_in, w, o + 192, row_bytes, xt, xo, n_in * L, offs, oo,
                                                 n16 * L)
                    d2 = lanes_splat(load_f16(w, o + row_bytes + 208))
                    for j in range(TILE_VECTORS):
                        dx = load_lanes(xdt, ((v0 + j) * nsb + b) * L)
                        _wide_q6_k(acc, r * per_row + (v0 + j) * L, s[j], d, dx)
                        _wide_q6_k(acc, (r + 1) * per_row + (v0 + j) * L, s[TILE_VECTORS + j], d2, dx)
                    r += 2
                else:
                    s = q6_k_superblock_sums_1x1(codes, co, n_in, w, o + 192, row_bytes, xt, xo, n_in * L, offs, oo,
                                                 n16 * L)
                    _wide_q6_k(acc, r * per_row + v0 * L, s[0], d, load_lanes(xdt, (v0 * nsb + b) * L))
                    r += 1
            v0 += TILE_VECTORS if tile else 1


@njit(parallel=True, cache=True)
def matmul_q6_k_wide(w, row_bytes, x, xq, xd, bsums, out, kinds):
    """matmul_q6_k's bits with a tiled token per vector lane (above), in the row blocks and runs of
    matmul_q4_k_wide; vec_dot's tokens as matmul_q6_k."""
    _quantize_tokens(x, xq, xd, bsums)
    n_in, n_out = x.shape[1], out.shape[1]
    toks = _gemm_tokens(kinds)
    n_tv = (toks.shape[0] + WIDE_LANES - 1) // WIDE_LANES
    xt, xdt = _wide_tokens(xq, xd, toks, n_in)
    offs = _wide_sums(bsums, toks, n_in, 16, -32, np.zeros(n_tv * (n_in // 16) * WIDE_LANES, np.int32))
    n_blocks = (n_out + WIDE_ROWS - 1) // WIDE_ROWS
    n_parts = min(n_blocks, WIDE_PARTS)
    for part in prange(n_parts):
        acc = np.empty(WIDE_ROWS * n_tv * WIDE_LANES, np.float32)
        codes = np.empty(WIDE_ROWS * n_in, np.int8)
        for blk in range(part * n_blocks // n_parts, (part + 1) * n_blocks // n_parts):
            r0 = blk * WIDE_ROWS
            n_rows = min(WIDE_ROWS, n_out - r0)
            _wide_block_q6_k(w, row_bytes, r0, n_rows, n_in, codes, xt, xdt, offs, n_tv, acc)
            _wide_results(out, toks, r0, n_rows, n_tv * WIDE_LANES, acc, None)
            for t in range(x.shape[0]):  # vec_dot's tokens
                if not kinds[t]:
                    for r in range(r0, r0 + n_rows):
                        out[t, r] = vec_dot_q6_k_q8_k(w, r * row_bytes, n_in // 256, xq, t * n_in, xd, bsums)

"""CUDA kernels over GGUF weight blocks, read straight from the raw bytes uploaded once (never a dequantized copy).

Sections: format codes; dequantize_chunk (one device function, a branch per format); the matrix product
(decode and prompt alike); the embedding row lookup.

Every format is walked in chunks of 32 consecutive weights of a row: a legacy block is one chunk, a K-quant
super-block of 256 is eight. A weight buffer is one flat device allocation seen four ways (uint8, int8,
float16, float32 views of the same bytes), so int8 quants, float16 scales and F32 rows are read as such without
copies; every block size and field offset below is even, so the float16 views line up.

Bytes are widened with np.int32 before any arithmetic: the CUDA simulator follows NumPy 2's scalar rules, in
which uint8 arithmetic wraps. Floats are kept float32 with explicit casts (a bare Python float would make the
compiled kernel compute in float64).
"""

import numpy as np
from numba import cuda

from edgellm import jitcache
from edgellm.engine.cuda.device import simulator_enabled
from edgellm.quant.formats import format_by_name
from edgellm.quant.registry import records

jitcache.configure_cuda()  # CUDA kernels cached beside the CPU ones, not next to the package

CHUNK = 32  # weights per chunk: one legacy block, one eighth of a K-quant super-block

# The GGML type id of each format the kernels read; the kernels branch on these (uniform across a block), as
# compile-time constants. The registry's `cuda` flag says which formats have a branch here.
F32 = format_by_name("F32").type_id
F16 = format_by_name("F16").type_id
Q4_0 = format_by_name("Q4_0").type_id
Q4_1 = format_by_name("Q4_1").type_id
Q5_0 = format_by_name("Q5_0").type_id
Q5_1 = format_by_name("Q5_1").type_id
Q8_0 = format_by_name("Q8_0").type_id
Q4_K = format_by_name("Q4_K").type_id
Q5_K = format_by_name("Q5_K").type_id
Q6_K = format_by_name("Q6_K").type_id
SUPPORTED_FORMATS = tuple(r.name for r in records() if r.cuda)

# Matrix product launch shape: LANES threads per output row, ROWS_PER_BLOCK rows per block at a time (blocks
# stride over the rows, at most MAX_ROW_BLOCKS of them), TOKENS_PER_BLOCK tokens sharing every dequantized chunk
# (the prompt case; decode has one). The simulator runs every thread as a Python thread: it gets the smallest
# shapes that still take every path (several lanes, rows per block, row strides and token tiles).
# ROWS_THREADS: chunks per block in get_rows_kernel.
if simulator_enabled():
    LANES, ROWS_PER_BLOCK, MAX_ROW_BLOCKS, TOKENS_PER_BLOCK, ROWS_THREADS = 2, 4, 1, 4, 4
else:
    LANES, ROWS_PER_BLOCK, MAX_ROW_BLOCKS, TOKENS_PER_BLOCK, ROWS_THREADS = 32, 4, 65535, 8, 64

# ----------------------------------------------------------------------------------------------------------------
# Dequantizing one chunk


@cuda.jit(device=True)
def half_at(wh, byte_offset):
    return np.float32(wh[byte_offset >> 1])


@cuda.jit(device=True)
def k_scale_min(w8, scales, sub):
    """Q4_K / Q5_K packed 6-bit (scale, min) of sub-block `sub` (0..7), scales = byte offset of the 12 bytes."""
    if sub < 4:
        sc = np.int32(w8[scales + sub]) & 63
        mn = np.int32(w8[scales + sub + 4]) & 63
    else:
        packed = np.int32(w8[scales + sub + 4])
        sc = (packed & 15) | ((np.int32(w8[scales + sub - 4]) >> 6) << 4)
        mn = (packed >> 4) | ((np.int32(w8[scales + sub]) >> 6) << 4)
    return sc, mn


@cuda.jit(device=True)
def dequantize_chunk(fmt, w8, wi, wh, wf, row_start, chunk, vals):
    """vals[0:32] = weights chunk*32 .. chunk*32+31 of the row whose blocks start at byte row_start.
    Layouts as quant/reference.py (and ggml's block structs); offsets are bytes within the block."""
    if fmt == F32:
        base = (row_start >> 2) + chunk * CHUNK
        for i in range(CHUNK):
            vals[i] = wf[base + i]
    elif fmt == F16:
        base = (row_start >> 1) + chunk * CHUNK
        for i in range(CHUNK):
            vals[i] = np.float32(wh[base + i])
    elif fmt == Q4_0:  # d f16 @0, qs[16] @2: element i low nibble of qs[i], element i+16 its high nibble
        base = row_start + chunk * 18
        d = half_at(wh, base)
        for i in range(16):
            b = np.int32(w8[base + 2 + i])
            vals[i] = d * np.float32((b & 15) - 8)
            vals[i + 16] = d * np.float32((b >> 4) - 8)
    elif fmt == Q4_1:  # d @0, m @2, qs[16] @4
        base = row_start + chunk * 20
        d = half_at(wh, base)
        m = half_at(wh, base + 2)
        for i in range(16):
            b = np.int32(w8[base + 4 + i])
            vals[i] = d * np.float32(b & 15) + m
            vals[i + 16] = d * np.float32(b >> 4) + m
    elif fmt == Q5_0 or fmt == Q5_1:  # Q5_0: d @0, qh[4] @2, qs @6; Q5_1: d @0, m @2, qh @4, qs @8
        has_min = fmt == Q5_1
        base = row_start + chunk * (24 if has_min else 22)
        d = half_at(wh, base)
        m = half_at(wh, base + 2) if has_min else np.float32(0.0)
        qh = base + (4 if has_min else 2)
        qs = qh + 4
        zero_point = 0 if has_min else 16
        for i in range(16):
            b = np.int32(w8[qs + i])
            # bit j of the little-endian 32-bit qh is the fifth bit of element j
            high_lo = (np.int32(w8[qh + (i >> 3)]) >> (i & 7)) & 1
            high_hi = (np.int32(w8[qh + 2 + (i >> 3)]) >> (i & 7)) & 1
            vals[i] = d * np.float32(((b & 15) | (high_lo << 4)) - zero_point) + m
            vals[i + 16] = d * np.float32(((b >> 4) | (high_hi << 4)) - zero_point) + m
    elif fmt == Q8_0:  # d @0, qs int8[32] @2
        base = row_start + chunk * 34
        d = half_at(wh, base)
        for i in range(CHUNK):
            vals[i] = d * np.float32(wi[base + 2 + i])
    elif fmt == Q4_K or fmt == Q5_K:
        # d @0, dmin @2, scales[12] @4, then Q4_K: qs[128] @16; Q5_K: qh[32] @16, qs[128] @48.
        # Sub-block s (32 weights): nibble (s & 1) of qs[(s >> 1) * 32 + i]; Q5_K's fifth bit is bit s of qh[i].
        has_high = fmt == Q5_K
        base = row_start + (chunk >> 3) * (176 if has_high else 144)
        sub = chunk & 7
        sc, mn = k_scale_min(w8, base + 4, sub)
        scale = half_at(wh, base) * np.float32(sc)
        offset = half_at(wh, base + 2) * np.float32(mn)
        qs = base + (48 if has_high else 16) + (sub >> 1) * 32
        shift = (sub & 1) * 4
        for i in range(CHUNK):
            q = (np.int32(w8[qs + i]) >> shift) & 15
            if has_high:
                q |= ((np.int32(w8[base + 16 + i]) >> sub) & 1) << 4
            vals[i] = scale * np.float32(q) - offset
    elif fmt == Q6_K:
        # ql[128] @0, qh[64] @128, scales int8[16] @192, d @208. Sub-block s = 4h + j (h: which 128-half):
        # low nibble (j >> 1) of ql[h*64 + (j & 1)*32 + i], high 2 bits (2j) of qh[h*32 + i], scale 2s + i // 16.
        base = row_start + (chunk >> 3) * 210
        sub = chunk & 7
        half = sub >> 2
        j = sub & 3
        ql = base + half * 64 + (j & 1) * 32
        qh = base + 128 + half * 32
        low_shift = (j >> 1) * 4
        high_shift = 2 * j
        d = half_at(wh, base + 208)
        for i in range(CHUNK):
            q = ((np.int32(w8[ql + i]) >> low_shift) & 15) | (((np.int32(w8[qh + i]) >> high_shift) & 3) << 4)
            scale = d * np.float32(wi[base + 192 + 2 * sub + (i >> 4)])
            vals[i] = scale * np.float32(q - 32)


# ----------------------------------------------------------------------------------------------------------------
# Matrix product: out[t, r] (+)= sum_i W[r, i] * x[t, i]


@cuda.jit(cache=True)
def matmul_kernel(fmt, w8, wi, wh, wf, row_bytes, n_chunks, x, out, accumulate):
    """x: [T, n_in] f32; out: [T, n_out] f32, overwritten or (accumulate) added to (the residual add).
    Block (LANES, ROWS_PER_BLOCK), grid (row blocks, token tiles): lane l of a row takes chunks l, l + LANES, ...;
    each dequantized chunk serves every token of the tile; the lane partials are summed through shared memory."""
    lane = cuda.threadIdx.x
    ry = cuda.threadIdx.y
    t0 = cuda.blockIdx.y * TOKENS_PER_BLOCK
    n_tile = min(TOKENS_PER_BLOCK, x.shape[0] - t0)
    n_out = out.shape[1]
    vals = cuda.local.array(CHUNK, np.float32)
    acc = cuda.local.array(TOKENS_PER_BLOCK, np.float32)
    partial = cuda.shared.array((ROWS_PER_BLOCK, TOKENS_PER_BLOCK, LANES), np.float32)
    # the same trip count in every thread of the block, so all of them reach the barriers
    for first_row in range(cuda.blockIdx.x * ROWS_PER_BLOCK, n_out, cuda.gridDim.x * ROWS_PER_BLOCK):
        row = first_row + ry
        for t in range(TOKENS_PER_BLOCK):
            acc[t] = np.float32(0.0)
        if row < n_out:
            row_start = row * row_bytes
            for c in range(lane, n_chunks, LANES):
                dequantize_chunk(fmt, w8, wi, wh, wf, row_start, c, vals)
                col = c * CHUNK
                for t in range(n_tile):
                    s = np.float32(0.0)
                    for i in range(CHUNK):
                        s += vals[i] * x[t0 + t, col + i]
                    acc[t] += s
        for t in range(n_tile):
            partial[ry, t, lane] = acc[t]
        cuda.syncthreads()
        if row < n_out:  # lane l adds up the partials of tokens l, l + LANES, ... (no tree needed)
            for t in range(lane, n_tile, LANES):
                total = np.float32(0.0)
                for i in range(LANES):
                    total += partial[ry, t, i]
                if accumulate:
                    out[t0 + t, row] += total
                else:
                    out[t0 + t, row] = total
        cuda.syncthreads()  # partial is rewritten for the next rows


def matmul_grid(n_out: int, n_tokens: int):
    """(grid, block) for matmul_kernel."""
    row_blocks = min(MAX_ROW_BLOCKS, (n_out + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK)
    return (row_blocks, (n_tokens + TOKENS_PER_BLOCK - 1) // TOKENS_PER_BLOCK), (LANES, ROWS_PER_BLOCK)


# ----------------------------------------------------------------------------------------------------------------
# Embedding rows: out[t, :] = W[ids[t], :] * scale


@cuda.jit(cache=True)
def get_rows_kernel(fmt, w8, wi, wh, wf, row_bytes, ids, scale, out):
    """ids: [T] int32; out: [T, n_in] f32. One thread per (chunk, token); grid (chunk blocks, T)."""
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    if c * CHUNK < out.shape[1]:
        vals = cuda.local.array(CHUNK, np.float32)
        dequantize_chunk(fmt, w8, wi, wh, wf, np.int64(ids[t]) * row_bytes, c, vals)
        for i in range(CHUNK):
            out[t, c * CHUNK + i] = vals[i] * scale


def get_rows_grid(n_in: int, n_tokens: int):
    n_chunks = n_in // CHUNK
    return ((n_chunks + ROWS_THREADS - 1) // ROWS_THREADS, n_tokens), (ROWS_THREADS,)

"""Record llama.cpp's own MXFP4 outputs as compact fixtures: the quantizer's bytes and the dot's float bits.

Run with the llama-cpp-python environment (its libggml-base / libggml-cpu, called through ctypes):

    /work/llama-venv/bin/python tools/record_mxfp4_llama_cpp.py      # writes tests/fixtures/llama_cpp_mxfp4.json

What it calls: quantize_mxfp4 (quantize_row_mxfp4_ref underneath) on the deterministic inputs of
tests/test_quant_mxfp4 (`cos` and `lcg` as in tests/test_quantize_kquants, and `edges`: block maxima one ulp under a
power of two, where log2f rounds up, and values halfway between two levels, where the first index wins), written
out again below; quantize_row_q8_0 and ggml_vec_dot_mxfp4_q8_0 (the library's AVX2 path) for every (token, row) of
an integer-LCG matrix and LCG activations, for an even and an odd number of blocks; and for matrices of a multiple of
8 rows, which llama.cpp repacks at load, ggml_gemv_mxfp4_8x8_q8_0 on the rows interleaved as its repack does (per 8
rows and block: the 8 scale bytes, then 16 chunks of 8 quant bytes, chunk i from row i % 8, bytes (i // 8) * 8 on),
checking on the way that ggml_gemm_mxfp4_8x8_q8_0 gives every group of four tokens the same bits (its activations
interleaved likewise, 4 tokens, as ggml_quantize_mat_q8_0_4x8 lays them out). It stores the first 16 hex digits of
each output's sha256 and the first token's bits in clear.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "llama_cpp_mxfp4.json"
BLOCK_BYTES, Q8_0_BYTES = 17, 34
DOT_SHAPES = {256: (23, 11), 288: (19, 13)}  # n_in: (rows, tokens); 8 and 9 blocks a row, rows not in eights
GEMV_SHAPES = {256: (24, 11), 288: (16, 9)}  # the repacked path: rows in eights
KVALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


def cos_data(n=4096):
    return (0.1 + 2 * np.cos(np.arange(n, dtype=np.float64))).astype(np.float32)


def lcg_weights(rows=8, cols=1024):
    i = np.arange(rows * cols * 4, dtype=np.uint64)
    u = ((i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(1 << 32)).astype(np.float64) / 2**32
    g = u.reshape(-1, 4).sum(axis=1) - 2.0
    x = (g.reshape(rows, cols) * (0.02 * (1 + np.arange(rows)))[:, None]).astype(np.float32)
    x[1] = 0
    x[2, 7] = 1.5
    x[3, :300] = 0
    return x


def edge_data():
    """64 blocks: block k's largest magnitude one float32 ulp under 2^(k - 32) (either sign), so log2f of it rounds
    to the integer for the larger |k - 32|; its other values halfway between neighbouring levels at that block's
    scale, and a few exact levels."""
    x = np.zeros((64, 32), np.float32)
    for k in range(64):
        top = np.nextafter(np.float32(2.0 ** (k - 32)), np.float32(0))
        # the scale llama.cpp picks either way: 2^(k - 32 - 3 - 1) (rounded up) or half that (not)
        for j in range(1, 32):
            lv = KVALUES[j % 8], KVALUES[(j % 8) + 1] if j % 8 < 7 else KVALUES[j % 8]
            half = np.float32((lv[0] + lv[1]) / 2) * np.float32(2.0 ** (k - 32 - 4 - (j % 2)))
            x[k, j] = -half if j % 3 == 0 else half
        x[k, 0] = -top if k % 2 else top
    return x


def lcg_bytes(n, seed):
    i = np.arange(n, dtype=np.uint64) + np.uint64(seed)
    return (((i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(1 << 32)) >> np.uint64(13)).astype(np.uint8)


def lcg_mxfp4_matrix(n_out, n_in):
    """MXFP4 bytes from an integer LCG; e = 116 + k % 11 (scales 2^-12 .. 2^-2)."""
    raw = lcg_bytes(n_out * n_in // 32 * BLOCK_BYTES, 7).reshape(-1, BLOCK_BYTES)
    raw[:, 0] = 116 + np.arange(raw.shape[0]) % 11
    return raw.reshape(-1)


def lcg_activations(n_tokens, n_in):
    b = lcg_bytes(n_tokens * n_in, 99).astype(np.float64).reshape(n_tokens, n_in)
    return ((b - 127.5) / 64.0 * (1 + np.arange(n_tokens)[:, None] % 3)).astype(np.float32)


DATASETS = {"cos": lambda: cos_data().reshape(1, -1), "lcg": lcg_weights, "edges": edge_data}


def _libs():
    import llama_cpp
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(sorted(glob.glob(str(lib_dir / "libggml-base.so*")))[0], mode=os.RTLD_GLOBAL)
    cpu = ctypes.CDLL(sorted(glob.glob(str(lib_dir / "libggml-cpu.so*")))[0], mode=os.RTLD_GLOBAL)
    cpu.ggml_cpu_init()
    base.quantize_mxfp4.restype = ctypes.c_size_t
    base.quantize_mxfp4.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    cpu.quantize_row_q8_0.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    cpu.ggml_vec_dot_mxfp4_q8_0.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                            ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for f in (cpu.ggml_gemv_mxfp4_8x8_q8_0, cpu.ggml_gemm_mxfp4_8x8_q8_0):
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                      ctypes.c_int]
    return base, cpu


def _interleave(blocks, n_group, scale_bytes):
    """[n_group * g, nb, scale_bytes + q] blocks -> per group of n_group and block: the n_group scales, then 8-byte
    chunks of the quants, chunk i from member i % n_group, bytes (i // n_group) * 8 on."""
    n, nb, size = blocks.shape
    q = size - scale_bytes
    out = np.zeros((n // n_group, nb, n_group * size), np.uint8)
    for g in range(n // n_group):
        for m in range(n_group):
            out[g, :, m * scale_bytes:(m + 1) * scale_bytes] = blocks[g * n_group + m, :, :scale_bytes]
        for i in range(n_group * q // 8):
            src = scale_bytes + (i // n_group) * 8
            dst = n_group * scale_bytes + 8 * i
            out[g, :, dst:dst + 8] = blocks[g * n_group + i % n_group, :, src:src + 8]
    return out


def _gemv(cpu, n_out, n_in, n_tokens):
    """ggml_gemv_mxfp4_8x8_q8_0 for each token; asserts that the four-token gemm gives the same bits."""
    nb = n_in // 32
    w = _interleave(lcg_mxfp4_matrix(n_out, n_in).reshape(n_out, nb, BLOCK_BYTES), 8, 1)
    x = lcg_activations(n_tokens, n_in)
    q8 = np.zeros((n_tokens, nb, Q8_0_BYTES), np.uint8)
    out = np.zeros((n_tokens, n_out), np.float32)
    for t in range(n_tokens):
        cpu.quantize_row_q8_0(_ptr(np.ascontiguousarray(x[t])), _ptr(q8[t]), n_in)
        cpu.ggml_gemv_mxfp4_8x8_q8_0(n_in, _ptr(out[t]), 0, _ptr(w), _ptr(q8[t]), 1, n_out)
    for t in range(0, n_tokens - n_tokens % 4, 4):
        s = np.zeros((4, n_out), np.float32)
        cpu.ggml_gemm_mxfp4_8x8_q8_0(n_in, _ptr(s), n_out, _ptr(w), _ptr(_interleave(q8[t:t + 4], 4, 2)), 4, n_out)
        assert np.array_equal(s.view(np.uint32), out[t:t + 4].view(np.uint32)), "gemm and gemv differ"
    return out


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def _sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def main():
    base, cpu = _libs()
    quantize = {}
    for name, make in DATASETS.items():
        x = np.ascontiguousarray(make(), np.float32)
        out = np.zeros(x.size // 32 * BLOCK_BYTES, np.uint8)
        base.quantize_mxfp4(_ptr(x), _ptr(out), x.shape[0], x.shape[1], None)
        quantize[name] = _sha(out)
    dots = {}
    for n_in, (n_out, n_tokens) in DOT_SHAPES.items():
        w = lcg_mxfp4_matrix(n_out, n_in)
        x = lcg_activations(n_tokens, n_in)
        out = np.zeros((n_tokens, n_out), np.float32)
        row = n_in // 32 * BLOCK_BYTES
        for t in range(n_tokens):
            xt = np.ascontiguousarray(x[t])
            q8 = np.zeros(n_in // 32 * Q8_0_BYTES, np.uint8)
            cpu.quantize_row_q8_0(_ptr(xt), _ptr(q8), n_in)
            for r in range(n_out):
                s = np.zeros(1, np.float32)
                wr = np.ascontiguousarray(w[r * row:(r + 1) * row])
                cpu.ggml_vec_dot_mxfp4_q8_0(n_in, _ptr(s), 0, _ptr(wr), 0, _ptr(q8), 0, 1)
                out[t, r] = s[0]
        dots[str(n_in)] = {"rows": n_out, "tokens": n_tokens, "sha256_16": _sha(out),
                           "first_token_bits": [int(v) for v in out[0].view(np.uint32)]}
    gemv = {}
    for n_in, (n_out, n_tokens) in GEMV_SHAPES.items():
        out = _gemv(cpu, n_out, n_in, n_tokens)
        gemv[str(n_in)] = {"rows": n_out, "tokens": n_tokens, "sha256_16": _sha(out),
                           "first_token_bits": [int(v) for v in out[0].view(np.uint32)]}
    OUT.write_text(json.dumps({"source": "llama-cpp-python 0.3.36 libggml-base/libggml-cpu via ctypes",
                               "quantize_mxfp4_sha256_16": quantize, "vec_dot_mxfp4_q8_0": dots,
                               "gemv_mxfp4_8x8_q8_0": gemv}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

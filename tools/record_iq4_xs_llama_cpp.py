"""Record llama.cpp's own IQ4_XS outputs as compact fixtures: the quantizer's bytes and the dot's float bits.

Run with the llama-cpp-python environment (its libggml-base / libggml-cpu, called through ctypes):

    /work/llama-venv/bin/python tools/record_iq4_xs_llama_cpp.py      # writes tests/fixtures/llama_cpp_iq4_xs.json

What it calls: quantize_iq4_xs (no importance matrix) on the two deterministic inputs of tests/test_quantize_kquants
(`cos`, `lcg`, written out again below); quantize_row_q8_K and ggml_vec_dot_iq4_xs_q8_K (the library's AVX2 path)
for every (token, row) of an integer-LCG matrix and LCG activations, the same generators as tests/test_quant_iq4_xs.
It stores the first 16 hex digits of each output's sha256 and, for the dot, a few values in clear.
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
OUT = ROOT / "tests" / "fixtures" / "llama_cpp_iq4_xs.json"
BLOCK_BYTES, Q8K_BYTES = 136, 292
DOT_SHAPES = {256: (24, 11), 768: (19, 13)}  # n_in: (rows, tokens)


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


def lcg_bytes(n, seed):
    i = np.arange(n, dtype=np.uint64) + np.uint64(seed)
    return (((i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(1 << 32)) >> np.uint64(13)).astype(np.uint8)


def lcg_iq4_xs_matrix(n_out, n_in):
    """IQ4_XS bytes from an integer LCG; d = (k % 13 - 6) / 512 (exact halves: zeros and both signs)."""
    raw = lcg_bytes(n_out * n_in // 256 * BLOCK_BYTES, 7).reshape(-1, BLOCK_BYTES)
    d = ((np.arange(raw.shape[0]) % 13) - 6).astype(np.float16) * np.float16(2.0 ** -9)
    raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def lcg_activations(n_tokens, n_in):
    b = lcg_bytes(n_tokens * n_in, 99).astype(np.float64).reshape(n_tokens, n_in)
    return ((b - 127.5) / 64.0 * (1 + np.arange(n_tokens)[:, None] % 3)).astype(np.float32)


def _libs():
    import llama_cpp
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(sorted(glob.glob(str(lib_dir / "libggml-base.so*")))[0], mode=os.RTLD_GLOBAL)
    cpu = ctypes.CDLL(sorted(glob.glob(str(lib_dir / "libggml-cpu.so*")))[0], mode=os.RTLD_GLOBAL)
    cpu.ggml_cpu_init()
    base.quantize_iq4_xs.restype = ctypes.c_size_t
    base.quantize_iq4_xs.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    cpu.quantize_row_q8_K.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    cpu.ggml_vec_dot_iq4_xs_q8_K.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                             ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return base, cpu


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def _sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def main():
    base, cpu = _libs()
    quantize = {}
    for name, x in (("cos", cos_data().reshape(1, -1)), ("lcg", lcg_weights())):
        x = np.ascontiguousarray(x, np.float32)
        out = np.zeros(x.shape[0] * x.shape[1] // 256 * BLOCK_BYTES, np.uint8)
        base.quantize_iq4_xs(_ptr(x), _ptr(out), x.shape[0], x.shape[1], None)
        quantize[name] = _sha(out)
    dots = {}
    for n_in, (n_out, n_tokens) in DOT_SHAPES.items():
        w = lcg_iq4_xs_matrix(n_out, n_in)
        x = lcg_activations(n_tokens, n_in)
        out = np.zeros((n_tokens, n_out), np.float32)
        row = n_in // 256 * BLOCK_BYTES
        for t in range(n_tokens):
            xt = np.ascontiguousarray(x[t])
            q8 = np.zeros(n_in // 256 * Q8K_BYTES, np.uint8)
            cpu.quantize_row_q8_K(_ptr(xt), _ptr(q8), n_in)
            for r in range(n_out):
                s = np.zeros(1, np.float32)
                wr = np.ascontiguousarray(w[r * row:(r + 1) * row])
                cpu.ggml_vec_dot_iq4_xs_q8_K(n_in, _ptr(s), 0, _ptr(wr), 0, _ptr(q8), 0, 1)
                out[t, r] = s[0]
        dots[str(n_in)] = {"rows": n_out, "tokens": n_tokens, "sha256_16": _sha(out),
                           "first_row_bits": [int(v) for v in out[0].view(np.uint32)]}
    OUT.write_text(json.dumps({"source": "llama-cpp-python 0.3.36 libggml-base/libggml-cpu via ctypes",
                               "quantize_iq4_xs_sha256_16": quantize, "vec_dot_iq4_xs_q8_K": dots}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

"""Tiny random-weight models checked against llama.cpp's own logits: rope scaling beyond the original context, and
file layouts (a pure Q4_0 file).

Each case is a TinySpec (tests/helpers_tiny_gguf.py) plus the prompt its fixture was recorded on. The files carry
no tokenizer: tokenizer.ggml.model "none" with {arch}.vocab_size, which llama.cpp loads as dummy tokens, and the
tests drive both sides with token ids. tools/record_tiny_llama_cpp.py writes the files with these specs
and records llama.cpp's logits; the tests (test_rope_scaling_llama_cpp.py, ...) write them again and compare.
"""

import hashlib

import numpy as np
from helpers_tiny_gguf import TinySpec, write_tiny_model

N_CTX = 160         # the context both sides run with: past every rope case's original context
PROMPT_TOKENS = 120  # teacher-forced rows; then DECODE_TOKENS more one at a time
DECODE_TOKENS = 6

CASES = {
    # llama with YaRN: factor 4 over an original context of 32 positions (trained context 128), base 10000: the
    # correction dims fall inside the 8 rotated pairs, so pairs take the extrapolated, blended and interpolated angle
    "llama_yarn": TinySpec(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_vocab=160,
                           weight_type="Q8_0", context_length=128, seed=11,
                           extra_keys={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                       "llama.rope.scaling.original_context_length": 32,
                                       "tokenizer.ggml.model": "none", "llama.vocab_size": 160}),
    # qwen2 (NeoX pairs, biases) with YaRN, factor 2.5 and a partial original context: another corr-dims split
    "qwen2_yarn": TinySpec(arch="qwen2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_vocab=160,
                           weight_type="Q8_0", context_length=100, seed=12, rope_base=1000.0,
                           extra_keys={"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 2.5,
                                       "qwen2.rope.scaling.original_context_length": 40,
                                       "tokenizer.ggml.model": "none", "qwen2.vocab_size": 160}),
    # a pure Q4_0 file (every matrix, the token embedding and the untied output too), as ARM users pick for
    # llama.cpp's repacked Q4_0 kernels
    "llama_q4_0_pure": TinySpec(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_vocab=160,
                                weight_type="Q4_0", tied=False, context_length=256, seed=13,
                                extra_keys={"tokenizer.ggml.model": "none", "llama.vocab_size": 160}),
}


def prompt(spec: TinySpec) -> list[int]:
    """PROMPT_TOKENS + DECODE_TOKENS token ids from an integer LCG (the same on every platform)."""
    i = np.arange(PROMPT_TOKENS + DECODE_TOKENS, dtype=np.uint64) + np.uint64(spec.seed)
    return [int(v) for v in ((i * np.uint64(2654435761) + np.uint64(12345)) >> np.uint64(7)) % np.uint64(spec.n_vocab)]


def write_case(path, name: str):
    write_tiny_model(path, CASES[name])
    return path


def file_sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()[:16]

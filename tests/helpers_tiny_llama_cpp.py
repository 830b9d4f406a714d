"""Tiny random-weight models checked against llama.cpp's own logits: rope scaling beyond the original context, file
layouts (a pure Q4_0 file) and architectures (phi3 with longrope).

Each case is a TinySpec (tests/helpers_tiny_gguf.py) plus the prompt its fixture was recorded on. The files carry
no tokenizer: tokenizer.ggml.model "none" with {arch}.vocab_size, which llama.cpp loads as dummy tokens, and the
tests drive both sides with token ids. tools/record_tiny_llama_cpp.py writes the files with these specs
and records llama.cpp's logits; the tests (test_rope_scaling_llama_cpp.py, ...) write them again and compare.
"""

import hashlib

import numpy as np
from gguf import GGUFWriter
from helpers_tiny_gguf import TinySpec, _MetadataOnly, _write_tensor, add_typed_keys, tiny_metadata, write_tiny_model

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
    # IQ4_XS everywhere (rows of 256 and 512: whole super-blocks), quantized by edgellm: llama.cpp reads the bytes and
    # computes every matrix with ggml_vec_dot_iq4_xs_q8_K
    "llama_iq4_xs": TinySpec(arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=160,
                             weight_type="IQ4_XS", tied=False, context_length=256, seed=15,
                             extra_keys={"tokenizer.ggml.model": "none", "llama.vocab_size": 160}),
}


# phi3 (fused attn_qkv and gate-up ffn_up) with longrope as the converter writes it: rope_factors_long/short, the
# original context 256 (llama.cpp rounds its context up to a multiple of 256, so the choice is exact there), and
# attn_factor sqrt(1 + ln(scale) / ln(original)) for scale 4; a sliding window that llama.cpp ignores for phi3.
# Run with n_ctx 512 (the long factors, positions up to 306) and 256 (the short ones).
PHI3_ORIG_CTX = 256
_PHI3 = TinySpec(arch="phi3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_vocab=160, weight_type="Q8_0",
                 tied=False, context_length=4 * PHI3_ORIG_CTX, seed=14,
                 extra_keys={"phi3.rope.dimension_count": 16, "phi3.rope.scaling.original_context_length": PHI3_ORIG_CTX,
                             "phi3.rope.scaling.attn_factor": float(np.sqrt(1 + np.log(4) / np.log(PHI3_ORIG_CTX))),
                             "phi3.attention.sliding_window": 2047,
                             "tokenizer.ggml.model": "none", "phi3.vocab_size": 160})
CASES["phi3_longrope_long"] = _PHI3
CASES["phi3_longrope_short"] = _PHI3
RUN = {"phi3_longrope_long": (512, 300), "phi3_longrope_short": (256, 120)}  # name: (n_ctx, prompt tokens)


def run_settings(name: str) -> tuple[int, int]:
    """(n_ctx, prompt tokens) of a case."""
    return RUN.get(name, (N_CTX, PROMPT_TOKENS))


def longrope_factors(n_pairs: int) -> dict:
    """Long factors growing from 1 to 8 over the pairs (the slow ones stretched most, as Phi-3's), short ones near 1."""
    i = np.arange(n_pairs, dtype=np.float64) / (n_pairs - 1)
    return {"rope_factors_long.weight": (1 + 7 * i ** 2).astype(np.float32),
            "rope_factors_short.weight": (1 + 0.05 * i).astype(np.float32)}


def _write_phi3(path, spec: TinySpec):
    """The tensors edgellm's phi3 specs require (llama.cpp's converter layout), then the longrope factors."""
    from edgellm.engine.models import get_architecture
    arch = get_architecture(spec.arch)
    config = arch.config_class.from_gguf(_MetadataOnly(spec))
    rng = np.random.default_rng(spec.seed)
    writer = GGUFWriter(str(path), spec.arch)
    add_typed_keys(writer, tiny_metadata(spec))
    for t in arch.model_class.tensor_specs(config):
        if not t.optional or t.name == "output.weight":
            _write_tensor(writer, rng, spec, t.name, t.shape, t.is_matrix)
    for name, data in longrope_factors(config.n_rot // 2).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def prompt(spec: TinySpec, n_prompt: int = PROMPT_TOKENS) -> list[int]:
    """n_prompt + DECODE_TOKENS token ids from an integer LCG (the same on every platform)."""
    i = np.arange(n_prompt + DECODE_TOKENS, dtype=np.uint64) + np.uint64(spec.seed)
    return [int(v) for v in ((i * np.uint64(2654435761) + np.uint64(12345)) >> np.uint64(7)) % np.uint64(spec.n_vocab)]


def write_case(path, name: str):
    if CASES[name].arch == "phi3":
        return _write_phi3(path, CASES[name])
    write_tiny_model(path, CASES[name])
    return path


def file_sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()[:16]

"""Tiny GGUF files of the architectures added after llama/qwen/gemma3, laid out as llama.cpp's converter writes
them, for the llama.cpp fixtures (tools/record_tiny_archs.py records; tests/test_tiny_archs_llama_cpp.py checks).

Each file: four layers of tiny dims (d 256, four heads of 64, two KV heads, n_ff 512), random weights in the
formats real files use (one layer each of Q8_0, Q4_K + Q6_K (as Q4_K_M files mix them), F32 and Q6_K; F16 and BF16
for llama_f16; MXFP4 expert stacks for gpt-oss), norm weights near 1, biases near 0, and SmolLM2's real tokenizer (its 49,152-token vocabulary, copied key by key from the catalog
file), so llama.cpp loads it as a real model. Generation is deterministic (numpy's PCG64 from a fixed seed and
gguf-py's writer), so a test rebuilds the file and checks its sha256 against the recorded one instead of keeping
megabytes of weights in git.
"""

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from helpers_tiny_gguf import _add, random_matrix_bytes

N_LAYER, N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF = 4, 256, 4, 2, 64, 512
# Matrix format of each layer; Q4_K_M's mix in layer 1 (Q6_K for attn_v and ffn_down, as llama.cpp's quantizer).
LAYER_TYPES = ("Q8_0", "Q4_K", "F32", "Q6_K")
Q6_K_IN_Q4_K_M = ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")
# Mixture-of-experts files: Q4_0 (which llama.cpp repacks) in place of Q6_K; the router is F32 as llama.cpp's
# converter writes it (and its quantizer leaves it).
MOE_LAYER_TYPES = ("Q8_0", "Q4_K", "F32", "Q4_0")
ROUTER = "ffn_gate_inp.weight"


@dataclass(frozen=True)
class TinyArch:
    name: str  # fixture name
    arch: str  # general.architecture
    example: str  # a real model of this architecture, for the README and the report
    embd_type: str
    keys: dict = field(default_factory=dict)  # the architecture's own keys, without the "{arch}." prefix
    seed: int = 0
    layer_types: tuple = LAYER_TYPES  # matrix format of layer i: layer_types[i % len]
    expert_type: str = ""  # the expert stacks' format in every layer (gpt-oss: MXFP4); "": the layer's


TINY_ARCHS = {
    "gemma2": TinyArch("gemma2", "gemma2", "google/gemma-2-2b-it", "Q6_K", {
        "attention.sliding_window": 16, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 30.0,
        "rope.freq_base": 10000.0, "context_length": 8192}, seed=1),
    "llama_swa": TinyArch("llama_swa", "llama", "mistralai/Mistral-7B-v0.1", "Q8_0", {
        # longer than the prompt: llama.cpp ignores the key, so only rows inside the window can be compared
        "attention.sliding_window": 64, "rope.freq_base": 10000.0, "context_length": 32768}, seed=2),
    "smollm3": TinyArch("smollm3", "smollm3", "HuggingFaceTB/SmolLM3-3B", "Q8_0", {
        "rope.freq_base": 5000000.0, "context_length": 65536}, seed=3),
    "granite": TinyArch("granite", "granite", "ibm-granite/granite-3.1-2b-instruct", "Q8_0", {
        "embedding_scale": 12.0, "residual_scale": 0.22, "attention.scale": 0.015625, "logit_scale": 8.0,
        "rope.freq_base": 5000000.0, "context_length": 131072}, seed=4),
    "olmo2": TinyArch("olmo2", "olmo2", "allenai/OLMo-2-0425-1B-Instruct", "Q8_0", {
        "rope.freq_base": 500000.0, "context_length": 4096}, seed=5),
    # the float formats unquantized files hold (convert_hf_to_gguf's default F16, and BF16), output tied to F16
    "llama_f16": TinyArch("llama_f16", "llama", "F16 / BF16 files of any llama model", "F16", {
        "rope.freq_base": 10000.0, "context_length": 4096}, seed=6, layer_types=("F16", "BF16")),
    "qwen3moe_8x2": TinyArch("qwen3moe_8x2", "qwen3moe", "Qwen/Qwen3-30B-A3B", "Q8_0", {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 256,
        "rope.freq_base": 1000000.0, "context_length": 40960}, seed=6, layer_types=MOE_LAYER_TYPES),
    "qwen3moe_32x4": TinyArch("qwen3moe_32x4", "qwen3moe", "Qwen/Qwen3-30B-A3B", "Q8_0", {
        "expert_count": 32, "expert_used_count": 4, "expert_feed_forward_length": 256,
        "rope.freq_base": 1000000.0, "context_length": 40960}, seed=7, layer_types=("Q8_0", "Q4_K", "Q4_0", "Q4_K_S")),
    "mixtral_8x2": TinyArch("mixtral_8x2", "llama", "mistralai/Mixtral-8x7B-Instruct-v0.1", "Q8_0", {
        "expert_count": 8, "expert_used_count": 2, "rope.freq_base": 1000000.0, "context_length": 32768},
        seed=8, layer_types=MOE_LAYER_TYPES),
    # gpt-oss: every expert stack MXFP4 as in the released files, the attention in four formats (MXFP4's dense
    # matmul in layer 1); a window shorter than the prompt, so that both kinds of layer matter; YaRN as the file has it
    "gptoss_8x4": TinyArch("gptoss_8x4", "gpt-oss", "openai/gpt-oss-20b", "Q8_0", {
        "expert_count": 8, "expert_used_count": 4, "expert_feed_forward_length": 256,
        "attention.sliding_window": 16, "rope.freq_base": 150000.0, "context_length": 131072,
        "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 4096,
        "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0},
        seed=9, layer_types=("Q8_0", "MXFP4", "F32", "F16"), expert_type="MXFP4"),
}


@functools.lru_cache(maxsize=4)
def tokenizer_fields(tokenizer_gguf):
    """(key, value, type, sub_type) of every tokenizer.* key of a GGUF file: read once per file (gguf-py's reader
    takes seconds over a 49,152-token vocabulary, and every tiny file copies the same one). Callers must not
    mutate the values."""
    out = []
    for key, f in GGUFReader(tokenizer_gguf).fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            out.append((key, f.contents(), f.types[0], sub))
    return tuple(out)


def _metadata(spec: TinyArch) -> dict:
    keys = {"block_count": N_LAYER, "embedding_length": N_EMBD, "feed_forward_length": N_FF,
            "attention.head_count": N_HEAD, "attention.head_count_kv": N_HEAD_KV,
            "attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM,
            "rope.dimension_count": HEAD_DIM, "attention.layer_norm_rms_epsilon": 1e-6, **spec.keys}
    return {f"{spec.arch}.{k}": v for k, v in keys.items()}


def _matrix_type(spec: TinyArch, name: str) -> str:
    if not name.startswith("blk."):  # token_embd, and output where the architecture has its own
        return spec.embd_type
    if name.endswith(ROUTER):
        return "F32"
    if spec.expert_type and "_exps." in name:
        return spec.expert_type
    kind = spec.layer_types[int(name.split(".")[1]) % len(spec.layer_types)]
    if kind == "Q4_K_S":  # Q4_K throughout, as the layers Q4_K_M leaves without Q6_K
        return "Q4_K"
    return "Q6_K" if kind == "Q4_K" and name.endswith(Q6_K_IN_Q4_K_M) else kind


def write_tiny_arch(path, spec: TinyArch, tokenizer_gguf) -> str:
    """Write the file; returns its sha256 (hex)."""
    from edgellm.engine.models import get_architecture
    from helpers_tiny_gguf import TinySpec, _MetadataOnly
    meta = _metadata(spec)
    probe = _MetadataOnly(TinySpec(arch=spec.arch, n_layer=N_LAYER, n_embd=N_EMBD, n_vocab=49152))
    probe.metadata = {"general.architecture": spec.arch, **meta}
    arch = get_architecture(spec.arch)
    config = arch.config_class.from_gguf(probe)
    rng = np.random.default_rng(spec.seed)
    writer = GGUFWriter(str(path), spec.arch)
    writer.add_name(f"tiny-{spec.name}")
    for key, value in meta.items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    for key, value, vtype, sub in tokenizer_fields(tokenizer_gguf):
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in arch.model_class.tensor_specs(config):
        if t.optional:
            continue
        if t.is_matrix:
            ggml_type = _matrix_type(spec, t.name)
            scale = 1.0 if t.name == "token_embd.weight" else 0.1
            rows = (int(np.prod(t.shape[:-1])), t.shape[-1])  # experts: their stack's rows, one after another
            data = random_matrix_bytes(rng, rows, ggml_type, scale)
            _add(writer, t.name, data.reshape(*t.shape[:-1], data.shape[-1]), ggml_type)
        elif t.name.endswith(".bias"):  # (only gpt-oss's files have biases that are not optional)
            writer.add_tensor(t.name, (0.1 * rng.standard_normal(t.shape)).astype(np.float32))
        else:
            writer.add_tensor(t.name, (1.0 + 0.2 * rng.standard_normal(t.shape)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file_sha256(path)


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prompt_tokens(spec: TinyArch, n: int = 40) -> np.ndarray:
    """A fixed random prompt (ids past the special tokens)."""
    return np.random.default_rng(100 + spec.seed).integers(100, 49152, n).astype(np.int32)

"""A tiny random-weight llama GGUF that edgellm.load() accepts end to end (real reader, tokenizer, kernels and KV
cache, in milliseconds), with hooks to corrupt it: tensors replaced by other shapes or types, or left out.

Weights come from helpers_tiny_gguf, the tokenizer metadata (a byte-level BPE vocabulary of 272 tokens) from
fake_model. Generations from it are arbitrary but deterministic, which is all the hardening tests need.
"""
import struct

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from fake_model import fake_metadata
from helpers_tiny_gguf import TinySpec, add_typed_keys, random_matrix_bytes, tensor_shapes

TOKENIZER = fake_metadata()
N_VOCAB = len(TOKENIZER["tokenizer.ggml.tokens"])


def tiny_spec(**kw) -> TinySpec:
    return TinySpec(**{"n_vocab": N_VOCAB, "n_layer": 2, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_ff": 96,
                       "weight_type": "Q8_0", "context_length": 256, **kw})


def _write_tensor(writer, name, value):
    if isinstance(value, tuple):               # (raw uint8 blocks, ggml type name)
        raw, ggml_type = value
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[ggml_type])
    else:
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))


def write_loadable_tiny_model(path, spec: TinySpec | None = None, replace=None, drop=(), tokenizer=None, extra=None,
                              split_max_tensors=0):
    """replace: tensor name -> float32 array, or (uint8 blocks, ggml type), written instead of the random one;
    drop: tensor names left out; tokenizer: tokenizer metadata overriding fake_model's (same keys); extra: metadata
    key -> str, int (uint32) or float (float32) added. Returns path; with split_max_tensors, gguf-py writes a split
    model as gguf-split does (NAME-00001-of-0000N.gguf beside path, split.* keys in every part) and returns the
    parts' paths."""
    spec = spec or tiny_spec()
    replace = replace or {}
    rng = np.random.default_rng(spec.seed)
    arch = spec.arch
    writer = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    for key, value in ((f"{arch}.block_count", spec.n_layer), (f"{arch}.context_length", spec.context_length),
                       (f"{arch}.embedding_length", spec.n_embd), (f"{arch}.feed_forward_length", spec.n_ff),
                       (f"{arch}.attention.head_count", spec.n_head),
                       (f"{arch}.attention.head_count_kv", spec.n_head_kv)):
        writer.add_uint32(key, value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", spec.rope_base)
    add_typed_keys(writer, extra or {})
    md = {**TOKENIZER, **(tokenizer or {})}
    writer.add_tokenizer_model(md["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    writer.add_token_list(md["tokenizer.ggml.tokens"])
    writer.add_token_types([int(t) for t in md["tokenizer.ggml.token_type"]])
    writer.add_token_merges(md["tokenizer.ggml.merges"])
    writer.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(False)
    for name, (shape, is_matrix) in tensor_shapes(spec).items():
        if name in drop:
            continue
        if name in replace:
            _write_tensor(writer, name, replace[name])
        elif is_matrix:
            scale = 1.0 if name == "token_embd.weight" else 0.1
            _write_tensor(writer, name, (random_matrix_bytes(rng, shape, spec.weight_type, scale), spec.weight_type))
        else:
            _write_tensor(writer, name, 1.0 + 0.2 * rng.standard_normal(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    parts = [str(p) for p in writer.format_shard_names(writer.path)] if split_max_tensors else None
    writer.close()
    return parts if split_max_tensors else path


def patch_uint32_key(path, key: str, value: int):
    """Overwrite the value of a UINT32 metadata key in place (a corrupt config value, the layout unchanged)."""
    data = bytearray(open(path, "rb").read())
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (vtype,) = struct.unpack_from("<I", data, at)
    assert vtype == 4, f"{key} is not a UINT32"
    struct.pack_into("<I", data, at + 4, value)
    with open(path, "wb") as f:
        f.write(data)
    return path

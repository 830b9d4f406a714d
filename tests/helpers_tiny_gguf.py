"""Tiny random-weight GGUF models (written with gguf-py's GGUFWriter) for the model tests; others may reuse them.

write_tiny_model(path, TinySpec(...)) writes one file: the architecture's metadata keys and every tensor the
forward pass reads, matrices in the requested GGML format. Formats gguf-py can quantize go through
gguf.quants.quantize; K-quants (which gguf-py cannot quantize) are written as random but valid blocks whose
float16 scales are set to sane values. No tokenizer metadata: the models are driven with token ids.
"""

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize as gguf_quantize

QUANTIZABLE_BY_GGUF_PY = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# Byte offsets of the float16 scale fields inside one K-quant block, and a scale that keeps weights ~O(0.1).
K_QUANT_SCALES = {
    "Q2_K": ((80, 0.01), (82, 0.005)),  # d, dmin (after scales[16], qs[64])
    "Q3_K": ((108, 0.003),),  # d (after hmask[32], qs[64], scales[12])
    "Q4_K": ((0, 0.002), (2, 0.001)),  # d, dmin
    "Q5_K": ((0, 0.001), (2, 0.0005)),  # d, dmin
    "Q6_K": ((208, 0.0001),),  # d (after ql[128], qh[64], scales[16])
}
WEIGHT_TYPES = QUANTIZABLE_BY_GGUF_PY + tuple(K_QUANT_SCALES)


@dataclass
class TinySpec:
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None  # written as attention.key_length when given (qwen3, gemma3)
    n_ff: int = 96
    n_vocab: int = 160
    weight_type: str = "Q8_0"
    embd_type: str | None = None  # token_embd format; default weight_type
    tied: bool = True  # no output.weight
    sliding_window: int = 0  # gemma3
    context_length: int = 1024
    rope_base: float = 10000.0
    seed: int = 0
    extra_keys: dict = field(default_factory=dict)


def random_matrix_bytes(rng, shape, ggml_type: str, scale: float = 0.1) -> np.ndarray:
    """(n_out, n_in) weights in ggml_type: float32/float16 arrays, or uint8 [n_out, row bytes] blocks."""
    if ggml_type in QUANTIZABLE_BY_GGUF_PY:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        return gguf_quantize(values, GGMLQuantizationType[ggml_type])
    if ggml_type in ("IQ4_XS", "MXFP4"):  # edgellm's quantizers, whose bytes are llama.cpp's (tests/test_quant_<fmt>)
        from edgellm.quant.quantize_kernels import quantize_fast
        values = (rng.standard_normal((int(np.prod(shape[:-1])), shape[-1])) * scale).astype(np.float32)
        return quantize_fast(values, ggml_type).reshape(*shape[:-1], -1)  # (an expert stack's 3-D shape too)
    if ggml_type not in K_QUANT_SCALES:
        raise ValueError(f"no tiny-model writer for {ggml_type}")
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    n_out, n_in = int(np.prod(shape[:-1])), shape[-1]  # (an expert stack's [n_expert, n_out, n_in] too)
    blocks = rng.integers(0, 256, size=(n_out, n_in // block_size, type_size), dtype=np.uint8)
    for offset, typical in K_QUANT_SCALES[ggml_type]:
        d = (typical * rng.uniform(0.5, 1.5, size=blocks.shape[:2])).astype(np.float16)
        blocks[:, :, offset: offset + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(*shape[:-1], -1)


def _add(writer, name, data, ggml_type):
    if data.dtype == np.uint8 or ggml_type == "BF16":
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[ggml_type])
    else:
        writer.add_tensor(name, data)


def tensor_shapes(spec: TinySpec):
    """name -> (numpy shape, is_matrix) for everything the architecture reads."""
    hd = spec.head_dim or spec.n_embd // spec.n_head
    d, q_dim, kv_dim = spec.n_embd, spec.n_head * hd, spec.n_head_kv * hd
    shapes = {"token_embd.weight": ((spec.n_vocab, d), True), "output_norm.weight": ((d,), False)}
    if not spec.tied:
        shapes["output.weight"] = ((spec.n_vocab, d), True)
    for il in range(spec.n_layer):
        blk = f"blk.{il}."
        shapes.update({
            blk + "attn_norm.weight": ((d,), False),
            blk + "attn_q.weight": ((q_dim, d), True),
            blk + "attn_k.weight": ((kv_dim, d), True),
            blk + "attn_v.weight": ((kv_dim, d), True),
            blk + "attn_output.weight": ((d, q_dim), True),
            blk + "ffn_norm.weight": ((d,), False),
            blk + "ffn_gate.weight": ((spec.n_ff, d), True),
            blk + "ffn_up.weight": ((spec.n_ff, d), True),
            blk + "ffn_down.weight": ((d, spec.n_ff), True),
        })
        if spec.arch == "qwen2":
            shapes.update({blk + "attn_q.bias": ((q_dim,), False), blk + "attn_k.bias": ((kv_dim,), False),
                           blk + "attn_v.bias": ((kv_dim,), False)})
        if spec.arch in ("qwen3", "gemma3"):
            shapes.update({blk + "attn_q_norm.weight": ((hd,), False), blk + "attn_k_norm.weight": ((hd,), False)})
        if spec.arch == "gemma3":
            shapes.update({blk + "post_attention_norm.weight": ((d,), False),
                           blk + "post_ffw_norm.weight": ((d,), False)})
    return shapes


def add_typed_keys(writer, keys):
    """Metadata key -> value written by type: str as a string, float as float32, int as uint32."""
    for key, value in keys.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)


def tiny_metadata(spec: TinySpec) -> dict:
    """The architecture's metadata keys for spec (general.architecture aside), in the order they are written."""
    arch = spec.arch
    keys = {f"{arch}.block_count": spec.n_layer, f"{arch}.context_length": spec.context_length,
            f"{arch}.embedding_length": spec.n_embd, f"{arch}.feed_forward_length": spec.n_ff,
            f"{arch}.attention.head_count": spec.n_head, f"{arch}.attention.head_count_kv": spec.n_head_kv,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.rope.freq_base": float(spec.rope_base)}
    if spec.head_dim:
        keys[f"{arch}.attention.key_length"] = keys[f"{arch}.attention.value_length"] = spec.head_dim
    if spec.sliding_window:
        keys[f"{arch}.attention.sliding_window"] = spec.sliding_window
    return {**keys, **spec.extra_keys}


def _write_tensor(writer, rng, spec: TinySpec, name, shape, is_matrix):
    if is_matrix:
        ggml_type = spec.embd_type if name == "token_embd.weight" and spec.embd_type else spec.weight_type
        # embeddings are larger (like real models) so the residual stream is not dominated by the blocks
        scale = 1.0 if name == "token_embd.weight" else 0.1
        _add(writer, name, random_matrix_bytes(rng, shape, ggml_type, scale), ggml_type)
    elif name.endswith(".bias"):
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    else:  # norm weights near 1, as trained models have
        writer.add_tensor(name, (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32))


def _write(path, spec: TinySpec, shapes):
    rng = np.random.default_rng(spec.seed)
    writer = GGUFWriter(str(path), spec.arch)
    add_typed_keys(writer, tiny_metadata(spec))
    for name, (shape, is_matrix) in shapes.items():
        _write_tensor(writer, rng, spec, name, shape, is_matrix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_model(path, spec: TinySpec):
    return _write(path, spec, tensor_shapes(spec))


class _MetadataOnly:
    """What a config reads before any tensor data: the metadata, token_embd's shape and the tensor count."""

    def __init__(self, spec: TinySpec):
        self.metadata = {"general.architecture": spec.arch, **tiny_metadata(spec)}
        self.tensors = {"token_embd.weight": SimpleNamespace(shape=(spec.n_vocab, spec.n_embd))}
        self.tensors.update({f"blk.{il}": None for il in range(spec.n_layer)})  # the block_count check's count


def write_tiny_from_registry(path, spec: TinySpec):
    """A tiny model of whatever architecture spec.arch names in edgellm's registry, holding exactly the tensors its
    tensor_specs require (GGUF names, numpy shapes: llama.cpp's converter layout), the optional ones left out (so
    the output is tied). A newly registered architecture gets one with no edit here."""
    from edgellm.engine.models import get_architecture
    arch = get_architecture(spec.arch)
    config = arch.config_class.from_gguf(_MetadataOnly(spec))
    shapes = {t.name: (t.shape, t.is_matrix) for t in arch.model_class.tensor_specs(config) if not t.optional}
    return _write(path, spec, shapes)

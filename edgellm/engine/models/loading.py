"""Reading a model out of a GGUF file: config keys, and tensors checked against the config before any kernel
sees them (a wrong-sized buffer must become a ModelError naming the tensor, never a crash or garbage)."""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from edgellm.quant.formats import format_by_name

from edgellm.errors import ModelError
from edgellm.engine.models.linear import make_linear
from edgellm.engine.models.moe import ExpertMatrices

_REQUIRED = object()

# Norm weights and biases are small; any of these float formats is read into float32.
VECTOR_TYPES = ("F32", "F16", "BF16")


def read_key(metadata: dict, key: str, kind=int, default=_REQUIRED):
    """metadata[key] converted to kind; ModelError naming the key when it is missing and has no default."""
    if key not in metadata:
        if default is _REQUIRED:
            raise ModelError(f"GGUF metadata lacks required key {key!r}")
        return default
    value = metadata[key]
    if isinstance(value, (list, tuple, np.ndarray)):
        values = {kind(v) for v in np.asarray(value).ravel()}
        if len(values) != 1:
            raise ModelError(f"{key!r} varies per layer ({sorted(values)}); only uniform values are supported")
        return values.pop()
    try:
        return kind(value)
    except (TypeError, ValueError) as err:
        raise ModelError(f"GGUF key {key!r} = {value!r} is not a valid {kind.__name__}") from err


def check_shape_keys(gguf_file, arch: str, n_layer: int, n_embd: int, n_head: int, head_dim: int) -> None:
    """Refuse config values no file could back, before anything is sized from them: a corrupt block_count or
    head_count must be a ModelError, not gigabytes of tensor specs or a division by zero."""
    n_tensors = len(gguf_file.tensors)
    if not 0 < n_layer <= n_tensors:  # every layer has tensors of its own
        raise ModelError(f"{arch}.block_count {n_layer} is impossible for a file of {n_tensors} tensors")
    if not 0 < n_head <= n_embd:
        raise ModelError(f"{arch}.attention.head_count {n_head} must be between 1 and embedding_length {n_embd}")
    if not 0 < head_dim <= n_embd * 64:
        raise ModelError(f"{arch}: head size {head_dim} (attention.key_length) is not a usable size")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple  # numpy order, outermost first: a matrix is (n_out, n_in)
    is_matrix: bool  # matrices go through a linear map (any quant format); vectors become float32 arrays
    optional: bool = False
    experts: bool = False  # a [n_expert, n_out, n_in] stack of matrices (moe.ExpertMatrices)


def matrix(name, shape, optional=False):
    return TensorSpec(name, tuple(int(s) for s in shape), True, optional)


def experts(name, shape, optional=False):
    return TensorSpec(name, tuple(int(s) for s in shape), True, optional, experts=True)


def vector(name, length, optional=False):
    return TensorSpec(name, (int(length),), False, optional)


def vector_rows(name, shape, optional=False):
    """A float tensor of several vectors, e.g. an expert stack's biases [n_expert, n_out], loaded as float32 rows."""
    return TensorSpec(name, tuple(int(s) for s in shape), False, optional)


def _expected_nbytes(ggml_type: str, shape) -> int:
    fmt = format_by_name(ggml_type)  # UnknownFormatError (a KeyError): a type no kernel here computes with
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return n_rows * fmt.row_bytes(shape[-1])  # ValueError when a row does not split into whole blocks


def _check(tensor, spec: TensorSpec) -> None:
    got_shape = tuple(int(s) for s in tensor.shape)
    if got_shape != spec.shape:
        raise ModelError(f"tensor {spec.name!r} has shape {got_shape}, expected {spec.shape} from the model config")
    if not spec.is_matrix and tensor.ggml_type not in VECTOR_TYPES:
        raise ModelError(f"tensor {spec.name!r} has type {tensor.ggml_type}; expected one of {VECTOR_TYPES}")
    try:
        expected = _expected_nbytes(tensor.ggml_type, got_shape)
    except (KeyError, ValueError) as err:
        raise ModelError(f"tensor {spec.name!r}: unsupported type {tensor.ggml_type} or layout ({err})") from err
    if tensor.data.nbytes != expected:
        raise ModelError(f"tensor {spec.name!r} holds {tensor.data.nbytes} bytes; {tensor.ggml_type} "
                         f"{got_shape} needs {expected}")


def _as_float32_vector(tensor) -> np.ndarray:
    """A norm weight or bias (F32, F16 or BF16, checked by _check) as float32: F32 stays a view of the map (read
    on first use, not at load: each touch of a page-cache folio would map all of it), the others are converted."""
    raw = np.ascontiguousarray(np.asarray(tensor.data).reshape(-1))
    if tensor.ggml_type == "F32":
        return np.ascontiguousarray(raw.view("<f4"), dtype=np.float32)  # no copy on a little-endian machine
    if tensor.ggml_type == "F16":
        return raw.view("<f2").astype(np.float32)
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)  # BF16: the top half of a float32


def load_tensors(gguf_file, specs) -> dict:
    """Check every spec first, then build: name -> linear map (matrix), float32 array (vector), None (absent)."""
    tensors = gguf_file.tensors
    for spec in specs:
        if spec.name not in tensors:
            if spec.optional:
                continue
            raise ModelError(f"GGUF file lacks tensor {spec.name!r}")
        _check(tensors[spec.name], spec)
    loaded = {}
    for spec in specs:
        tensor = tensors.get(spec.name)
        if tensor is None:
            loaded[spec.name] = None
        elif spec.is_matrix:
            try:
                loaded[spec.name] = ExpertMatrices(tensor) if spec.experts else make_linear(tensor)
            except (NotImplementedError, KeyError, ValueError) as err:
                raise ModelError(f"tensor {spec.name!r}: cannot use type {tensor.ggml_type} ({err})") from err
        else:
            loaded[spec.name] = _as_float32_vector(tensor).reshape(spec.shape)
    return loaded


def layer_weights(loaded: dict, il: int) -> SimpleNamespace:
    """Layer il's tensors as attributes named like GGUF:
    blk.3.attn_q.weight -> .attn_q, blk.3.attn_q.bias -> .attn_q_bias."""
    prefix = f"blk.{il}."
    fields = {}
    for name, value in loaded.items():
        if name.startswith(prefix):
            stem, kind = name[len(prefix):].rsplit(".", 1)
            fields[stem if kind == "weight" else f"{stem}_{kind}"] = value
    return SimpleNamespace(**fields)


NONE = np.zeros(0, np.float32)  # an absent bias or norm: ops.finish_qkv skips that step
# Steps between the q/k/v projections and attention that a layer has in full or not at all.
OPTIONAL_QKV_STEPS = (("attn_q_bias", "attn_k_bias", "attn_v_bias"), ("attn_q_norm", "attn_k_norm"))


def fill_absent_qkv_steps(layer, il: int) -> None:
    """Set the layer's absent q/k/v biases and QK norms to NONE (size 0), as DecoderModel.attend reads them;
    ModelError when a layer has only some of one group."""
    for group in OPTIONAL_QKV_STEPS:
        present = [getattr(layer, name, None) is not None for name in group]
        if any(present) and not all(present):
            raise ModelError(f"layer {il} has only some of {group}; expected all or none")
        for name in group:
            if getattr(layer, name, None) is None:
                setattr(layer, name, NONE)

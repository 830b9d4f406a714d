"""Quantize a GGUF file into another GGUF file: `edgellm quantize IN.gguf OUT.gguf TYPE`, as llama-quantize does.

Sections:
  1. file types: llama.cpp's LLAMA_FTYPE values, their default tensor type, and the names llama-quantize accepts
  2. the per-tensor plan, llama.cpp's src/llama-quant.cpp rules: which tensors may be quantized, the mixes
     (attn_v / ffn_down / attn_output / output get more bits in some layers), the fallback for rows that do not
     split into blocks; tensors are visited in llama.cpp's order (by layer, then by name) because the mix rules
     count attn_v and ffn_down tensors as they go
  3. metadata: every key of the input carried over with its GGUF value type, file_type and quantization_version set
  4. `quantize_file`: streams tensor by tensor (dequantize a slab of rows -> quantize -> write), so peak memory is
     about one output tensor plus one slab, never the model
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import sys
import time
from dataclasses import dataclass

import numpy as np

from edgellm.engine import gguf as gguf_reader
from edgellm.atomic import replace_synced, unique_temp_path
from edgellm.errors import EdgeLLMError
from edgellm.quant.formats import format_by_name
from edgellm.quant.registry import records as format_records

# ---------------------------------------------------------------------------------------------------------
# 1. file types


@dataclass(frozen=True)
class FileType:
    name: str          # llama-quantize's name, e.g. "Q4_K_M"
    ftype: int         # LLAMA_FTYPE_* value written to general.file_type
    default_type: str  # GGML type most tensors get


FILE_TYPES = {ft.name: ft for ft in (
    FileType("F32", 0, "F32"), FileType("F16", 1, "F16"), FileType("BF16", 32, "BF16"),
    FileType("Q4_0", 2, "Q4_0"), FileType("Q4_1", 3, "Q4_1"), FileType("Q5_0", 8, "Q5_0"),
    FileType("Q5_1", 9, "Q5_1"), FileType("Q8_0", 7, "Q8_0"),
    FileType("Q2_K", 10, "Q2_K"),
    FileType("Q3_K_S", 11, "Q3_K"), FileType("Q3_K_M", 12, "Q3_K"), FileType("Q3_K_L", 13, "Q3_K"),
    FileType("Q4_K_S", 14, "Q4_K"), FileType("Q4_K_M", 15, "Q4_K"),
    FileType("Q5_K_S", 16, "Q5_K"), FileType("Q5_K_M", 17, "Q5_K"),
    FileType("Q6_K", 18, "Q6_K"), FileType("IQ4_NL", 25, "IQ4_NL"),
    FileType("IQ4_XS", 30, "IQ4_XS"),
)}
FILE_TYPE_ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # as llama-quantize
FLOAT_TYPES = ("F32", "F16", "BF16")
TENSOR_TYPES = FLOAT_TYPES + tuple(r.name for r in format_records() if r.quantizer)  # those with a Numba quantizer
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION


def file_type_by_name(name: str) -> FileType:
    key = str(name).upper()
    key = FILE_TYPE_ALIASES.get(key, key)
    if key not in FILE_TYPES:
        known = ", ".join(list(FILE_TYPES) + list(FILE_TYPE_ALIASES))
        raise EdgeLLMError(f"unknown quantization type {name!r}; known: {known}")
    return FILE_TYPES[key]


def _tensor_type(name: str | None, what: str) -> str | None:
    if name is None:
        return None
    key = str(name).upper()
    if key not in TENSOR_TYPES:
        raise EdgeLLMError(f"{what}: unknown tensor type {name!r}; known: {', '.join(TENSOR_TYPES)}")
    return key


# ---------------------------------------------------------------------------------------------------------
# 2. the per-tensor plan


def _block_size(ggml_type: str) -> int:
    return format_by_name(ggml_type).block_size


def llama_tensor_order(names) -> list[str]:
    """llama.cpp's weights_map order: tensors outside blocks first, then by layer number, each group by name."""
    def key(name):
        m = re.match(r"blk\.(\d+)\.", name)
        return (int(m.group(1)) if m else -1, name)
    return sorted(names, key=key)


def _category(name: str) -> str:
    """llama-quant.cpp's tensor_get_category (broad roles, not exact names)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                      ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                      ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                      ("ffn_down", "ffn_down")):
        if part in name:
            return cat
    return "other"


# Substrings of tensors llama.cpp never quantizes (small, or numerically delicate).
_NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj",
                    "ssm_conv1d", "shortconv.conv.weight", "time_mix_", "attn_rel_b.weight", ".position_embd",
                    ".rel_pos", ".patch_embd", ".patch_merger")


def allows_quantization(name: str, shape: tuple) -> bool:
    """tensor_allows_quantization: 2-D (or 3-D) weights only; norms, routers and a few small tensors stay."""
    n_dims = len(shape) - next((i for i, d in enumerate(shape) if d > 1), len(shape) - 1)  # ggml_n_dims
    if n_dims < 2 or not name.endswith("weight"):
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not any(part in name for part in _NEVER_QUANTIZED)


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


@dataclass
class _MixState:
    """The counters and model facts llama_tensor_get_type_impl consults."""
    arch: str
    n_layer: int
    n_gqa: int
    n_expert: int
    n_attention_wv: int
    tied_embeddings: bool
    i_attention_wv: int = 0
    i_ffn_down: int = 0


def _mix_type(st: _MixState, name: str, shape: tuple, new_type: str, ft: FileType, output_tensor_type):
    """llama_tensor_get_type_impl for the file types above (no importance matrix: IQ4_NL takes its rules without one)."""
    cat, f, falcon = _category(name), ft.name, st.arch == "falcon"
    if cat == "output" or (st.tied_embeddings and cat == "token_embd"):
        if output_tensor_type is not None:
            return output_tensor_type
        if falcon or shape[-1] % _block_size(new_type):
            return "Q8_0"
        return "Q6_K" if new_type != "Q8_0" else new_type
    if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        if f == "Q2_K":
            new_type = "Q4_K" if st.n_gqa >= 4 else "Q3_K"
        elif f == "Q3_K_M":
            new_type = "Q5_K" if st.i_attention_wv < 2 else "Q4_K"
        elif f == "Q3_K_L":
            new_type = "Q5_K"
        elif f in ("Q4_K_M", "Q5_K_M") and _use_more_bits(st.i_attention_wv, st.n_attention_wv):
            new_type = "Q6_K"
        elif f in ("IQ4_NL", "IQ4_XS") and st.n_gqa >= 4:
            new_type = "Q5_K"
        elif f == "Q4_K_S" and st.i_attention_wv < 4:
            new_type = "Q5_K"
        if st.n_expert == 8:
            new_type = "Q8_0"
        st.i_attention_wv += 1
    elif cat == "attn_k":
        if st.n_expert == 8:
            new_type = "Q8_0"
    elif cat == "ffn_down":
        i_layer, n_layer = st.i_ffn_down, st.n_layer
        if st.n_expert > 1:  # expert tensors are not consecutive: the layer comes from the name
            i_layer = int(re.match(r"blk\.(\d+)\.", name).group(1))
        if f == "Q2_K":
            new_type = "Q3_K"
        elif f == "Q3_K_M":
            new_type = ("Q5_K" if i_layer < n_layer // 16
                        else "Q4_K" if not falcon or _use_more_bits(i_layer, n_layer) else "Q3_K")
        elif f == "Q3_K_L":
            new_type = "Q4_K" if falcon else "Q5_K"
        elif f == "Q4_K_M":
            if falcon:
                new_type = ("Q6_K" if i_layer < n_layer // 16
                            else "Q5_K" if _use_more_bits(i_layer, n_layer) else "Q4_K")
            elif _use_more_bits(i_layer, n_layer):
                new_type = "Q6_K"
        elif f in ("IQ4_NL", "IQ4_XS") and i_layer < n_layer // 8:  # (llama.cpp: without an importance matrix)
            new_type = "Q5_K"
        elif f == "Q5_K_M" and _use_more_bits(i_layer, n_layer):
            new_type = "Q6_K"
        elif f == "Q4_K_S" and not falcon and i_layer < n_layer // 8:
            new_type = "Q5_K"
        st.i_ffn_down += 1
    elif cat == "attn_output":
        if not falcon:
            if st.n_expert == 8:
                if f in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ4_NL", "IQ4_XS"):
                    new_type = "Q5_K"
            else:
                new_type = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(f, new_type)
        elif f == "Q3_K_L":
            new_type = "Q4_K"
    # (llama.cpp's later branch for attn_qkv is unreachable: the attn_v branch above takes those tensors)
    return new_type


# Where rows do not split into the type's blocks: llama-quant.cpp's tensor_type_fallback.
_FALLBACK = {"IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _fallback(shape: tuple, new_type: str) -> tuple[str, bool]:
    n_cols = shape[-1]
    if n_cols % _block_size(new_type) == 0:
        return new_type, False
    new_type = _FALLBACK.get(new_type, new_type)
    if n_cols % _block_size(new_type):
        new_type = "F16"  # not even a multiple of 32: llama.cpp uses F16 too
    return new_type, True


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple       # numpy order
    src_type: str
    dst_type: str
    fell_back: bool    # the mix's type did not fit the row length


def plan_tensor_types(src, file_type, pure: bool = False, output_tensor_type=None,
                      token_embedding_type=None) -> list[TensorPlan]:
    """The type of every tensor of the open GGUFFile `src` in the output, in llama.cpp's tensor order."""
    ft = file_type if isinstance(file_type, FileType) else file_type_by_name(file_type)
    output_tensor_type = _tensor_type(output_tensor_type, "output tensor type")
    token_embedding_type = _tensor_type(token_embedding_type, "token embedding type")
    meta, arch = src.metadata, src.metadata.get("general.architecture", "")

    def hparam(key, default):
        v = meta.get(f"{arch}.{key}", default)
        return int(np.asarray(v).ravel()[0]) if np.size(v) else default

    names = llama_tensor_order(src.tensors)
    n_head = hparam("attention.head_count", 1)
    st = _MixState(arch=arch, n_layer=hparam("block_count", 0),
                   n_gqa=n_head // max(1, hparam("attention.head_count_kv", n_head)),
                   n_expert=hparam("expert_count", 0),
                   n_attention_wv=sum(_category(n) in ("attn_v", "attn_qkv", "attn_kv_b") for n in names),
                   tied_embeddings="output.weight" not in src.tensors)
    quantized_default = ft.default_type not in FLOAT_TYPES
    plan = []
    for name in names:
        t = src.tensors[name]
        dst, fell_back = t.ggml_type, False
        if allows_quantization(name, t.shape):
            cat = _category(name)
            if token_embedding_type is not None and cat == "token_embd":
                dst = token_embedding_type
            elif output_tensor_type is not None and cat == "output":
                dst = output_tensor_type
            else:
                dst = ft.default_type
                if quantized_default:
                    if not pure:
                        dst = _mix_type(st, name, t.shape, dst, ft, output_tensor_type)
                    dst, fell_back = _fallback(t.shape, dst)
        if t.shape[-1] % _block_size(dst):
            raise EdgeLLMError(f"tensor {name!r} of shape {t.shape} cannot be stored as {dst}: its rows of "
                               f"{t.shape[-1]} values do not split into {_block_size(dst)}-value blocks")
        plan.append(TensorPlan(name, tuple(t.shape), t.ggml_type, dst, fell_back))
    return plan


# ---------------------------------------------------------------------------------------------------------
# 3. metadata, with the value types of the input file


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9
_SKIPPED_KEYS = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment",
                 "split.no", "split.count", "split.tensors.count")


def metadata_value_types(path) -> dict[str, tuple[int, int | None]]:
    """key -> (GGUF value type, element type for arrays), read from the file's key-value section.

    edgellm.engine.gguf gives plain Python values; writing them back needs the original types (uint32 vs int32 ...)."""
    types = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        u32, u64 = struct.Struct("<I"), struct.Struct("<Q")
        n_kv = u64.unpack_from(mm, 16)[0]
        pos = 24
        for _ in range(n_kv):
            n = u64.unpack_from(mm, pos)[0]
            key = mm[pos + 8: pos + 8 + n].decode("utf-8")
            pos += 8 + n
            vtype = u32.unpack_from(mm, pos)[0]
            pos += 4
            sub = None
            if vtype == _STRING:
                pos += 8 + u64.unpack_from(mm, pos)[0]
            elif vtype == _ARRAY:
                sub, count = u32.unpack_from(mm, pos)[0], u64.unpack_from(mm, pos + 4)[0]
                pos += 12
                if sub == _STRING:
                    for _ in range(count):
                        pos += 8 + u64.unpack_from(mm, pos)[0]
                else:
                    pos += count * _SCALAR_SIZES[sub]
            else:
                pos += _SCALAR_SIZES[vtype]
            types[key] = (vtype, sub)
    return types


def copy_metadata(writer, src, file_type: FileType) -> None:
    """Every key of `src` (its tokenizer, chat template, hyper-parameters ...) with its original value type."""
    from gguf import GGUFValueType  # gguf-py: a slow import, left out of the CLI's start
    types = metadata_value_types(src.path)
    for key in src.metadata.keys():
        if key in _SKIPPED_KEYS:
            continue
        vtype, sub = types[key]
        value = src.metadata[key]
        if isinstance(value, np.ndarray):
            value = value.tolist()  # GGUFWriter wants a Sequence
        writer.add_key_value(key, value, GGUFValueType(vtype), sub_type=None if sub is None else GGUFValueType(sub))
    writer.add_uint32("general.quantization_version", QUANTIZATION_VERSION)
    writer.add_uint32("general.file_type", file_type.ftype)


# ---------------------------------------------------------------------------------------------------------
# 4. quantize_file


SLAB_VALUES = 1 << 24  # values dequantized at a time (64 MiB of float32)


@dataclass
class QuantizeReport:
    plan: list
    in_bytes: int
    out_bytes: int
    seconds: float
    n_fallback: int


def _convert_tensor(t, dst_type: str) -> np.ndarray:
    """The tensor's bytes in dst_type: copied when the type is unchanged, else dequantized and quantized in slabs
    of whole rows into one preallocated output buffer."""
    from edgellm.quant import dequantize  # numba kernels: loaded to convert tensors
    from edgellm.quant.quantize_kernels import quantize_fast
    if dst_type == t.ggml_type:
        return np.asarray(t.data)
    src_fmt, dst_fmt = format_by_name(t.ggml_type), format_by_name(dst_type)
    n_cols = t.shape[-1]
    n_rows = t.n_elements // n_cols
    src_row, dst_row = src_fmt.row_bytes(n_cols), dst_fmt.row_bytes(n_cols)
    out = np.empty((n_rows, dst_row), dtype=np.uint8)
    rows_per_slab = max(1, SLAB_VALUES // n_cols)
    for r0 in range(0, n_rows, rows_per_slab):
        r1 = min(n_rows, r0 + rows_per_slab)
        x = dequantize(t.data[r0 * src_row: r1 * src_row], t.ggml_type, (r1 - r0, n_cols))
        out[r0:r1] = quantize_fast(x, dst_type)
    return out.reshape(-1)


class _Progress:
    """A one-line progress bar on stderr (bytes of input processed), redrawn in place at most 10 times a second."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self.t0 = max(total, 1), 0, enabled, time.perf_counter()
        self.last_draw = 0.0

    def update(self, nbytes: int, label: str) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if not self.enabled or (now - self.last_draw < 0.1 and self.done < self.total):
            return
        self.last_draw = now
        frac = self.done / self.total
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r[{bar:<30}] {100 * frac:5.1f}% {time.perf_counter() - self.t0:6.1f}s  {label[:48]:<48}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def quantize_file(in_path, out_path, type_or_mix, pure: bool = False, output_tensor_type=None,
                  token_embedding_type=None, allow_requantize: bool = False, progress: bool = True) -> QuantizeReport:
    """Write `in_path` re-encoded as `type_or_mix` (a llama-quantize type name such as "Q4_K_M" or "Q8_0")."""
    from gguf import GGMLQuantizationType, GGUFWriter  # gguf-py: a slow import, left out of the CLI's start
    ft = file_type_by_name(type_or_mix)
    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    if os.path.exists(out_path) and os.path.samefile(in_path, out_path):
        raise EdgeLLMError(f"the output {out_path} is the input file: write to another path")
    t0 = time.perf_counter()
    with gguf_reader.open(in_path) as src:
        plan = plan_tensor_types(src, ft, pure, output_tensor_type, token_embedding_type)
        requant = [p for p in plan if p.dst_type != p.src_type and p.src_type not in FLOAT_TYPES]
        if requant and not allow_requantize:
            p = requant[0]
            raise EdgeLLMError(
                f"{in_path} is already quantized ({len(requant)} tensors, e.g. {p.name} is {p.src_type}): "
                f"quantizing it again to {ft.name} adds a second rounding error on top of the first, so the result "
                f"is worse than quantizing the original weights. Start from an F32/F16/BF16 file, or pass "
                f"allow_requantize=True (--allow-requantize) to do it anyway")
        tmp_path = unique_temp_path(out_path)  # beside the output; unique, so two runs never share it
        writer = GGUFWriter(tmp_path, src.architecture)
        try:
            copy_metadata(writer, src, ft)
            for p in plan:
                nbytes = p.shape[-1] // format_by_name(p.dst_type).block_size * format_by_name(p.dst_type).type_size
                nbytes *= int(np.prod(p.shape[:-1], dtype=np.int64))
                writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), nbytes,
                                       raw_dtype=GGMLQuantizationType[p.dst_type])
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            bar = _Progress(sum(src.tensors[p.name].nbytes for p in plan), progress)
            for i, p in enumerate(plan):
                writer.write_tensor_data(_convert_tensor(src.tensors[p.name], p.dst_type))
                bar.update(src.tensors[p.name].nbytes, f"[{i + 1}/{len(plan)}] {p.name} {p.src_type}->{p.dst_type}")
            bar.close()
            writer.close()
            replace_synced(tmp_path, out_path)
        except BaseException:
            writer.close()
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
            raise
        in_bytes = sum(src.tensors[p.name].nbytes for p in plan)
    out_bytes = os.path.getsize(out_path)
    return QuantizeReport(plan, in_bytes, out_bytes, time.perf_counter() - t0, sum(p.fell_back for p in plan))

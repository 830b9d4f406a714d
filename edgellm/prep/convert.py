"""Convert a Hugging Face checkpoint directory into a GGUF file, as llama.cpp's convert_hf_to_gguf.py does, for
llama (and Mixtral), qwen2, qwen3, qwen3moe, gemma2, gemma3, granite, olmo2 and smollm3:
`edgellm convert HF_DIR OUT.gguf --type F16`.

Sections:
  1. safetensors, read with numpy (8-byte header length, JSON header, raw little-endian data)
  2. architectures: config.json -> GGUF hyper-parameters, HF tensor names -> llama.cpp's, and the per-tensor
     changes llama.cpp makes (llama's Q/K row permutation for its interleaved RoPE, gemma's norm weight + 1,
     gemma's embedding rows cut to the vocabulary); a mixture of experts' per-expert matrices stacked into
     llama.cpp's [n_expert, n_out, n_in] tensors
  3. tokenizer: gpt2 BPE from tokenizer.json, or SentencePiece from tokenizer.model; special tokens, merges and
     the chat template through gguf-py's SpecialVocab
  4. `convert_checkpoint`: streams tensor by tensor into gguf-py's GGUFWriter. F32 / F16 / BF16 / Q8_0 are written
     directly (llama.cpp's converter types); any quantize type (Q4_K_M, ...) goes through an F32 file and
     edgellm.prep.quantize
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgellm.atomic import replace_synced, unique_temp_path
from edgellm.engine import gguf as gguf_reader
from edgellm.errors import EdgeLLMError
from edgellm.prep.quantize import file_type_by_name, quantize_file
from edgellm.quant.formats import format_by_name

# ---------------------------------------------------------------------------------------------------------
# 1. safetensors

_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
              "I8": "i1", "U8": "u1", "BOOL": "u1"}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


class SafetensorsFile:
    """One .safetensors file, memory-mapped; `.tensors` maps name -> (dtype name, shape, byte offset, byte length)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        size = len(self._map)
        if size < 8:
            raise EdgeLLMError(f"{self.path}: too small to be a safetensors file")
        (n,) = struct.unpack_from("<Q", self._map, 0)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise EdgeLLMError(f"{self.path}: header length {n} does not fit the {size}-byte file")
        try:
            header = json.loads(self._map[8:8 + n].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise EdgeLLMError(f"{self.path}: the header is not valid JSON ({e})") from None
        data_start, self.tensors = 8 + n, {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if dtype not in _ST_DTYPES:
                raise EdgeLLMError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[dtype]).itemsize
            if end - begin != nbytes or data_start + end > size or begin < 0:
                raise EdgeLLMError(f"{self.path}: tensor {name!r} {dtype}{list(shape)} has bad data offsets "
                                   f"[{begin}, {end})")
            self.tensors[name] = (dtype, shape, data_start + begin, nbytes)

    def load_f32(self, name: str) -> np.ndarray:
        dtype, shape, offset, nbytes = self.tensors[name]
        raw = np.frombuffer(self._map, dtype=_ST_DTYPES[dtype], count=nbytes // np.dtype(_ST_DTYPES[dtype]).itemsize,
                            offset=offset)
        if dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return raw.astype(np.float32).reshape(shape)


def open_checkpoint(hf_dir: Path) -> dict[str, SafetensorsFile]:
    """HF tensor name -> the file holding it, over every *.safetensors file of the directory."""
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise EdgeLLMError(f"{hf_dir}: no *.safetensors files (PyTorch .bin checkpoints are not supported)")
    where = {}
    for path in files:
        st = SafetensorsFile(path)
        for name in st.tensors:
            if name in where:
                raise EdgeLLMError(f"tensor {name!r} is in both {where[name].path} and {path}")
            where[name] = st
    return where


# ---------------------------------------------------------------------------------------------------------
# 2. architectures


@dataclass(frozen=True)
class ArchSpec:
    gguf_arch: str
    layer_names: dict   # HF name after "model.layers.{i}." -> GGUF name after "blk.{i}."
    permute_qk: bool    # llama's rotary pairs are (i, i + half) in HF but adjacent in GGUF
    norm_plus_one: bool  # Gemma3RMSNorm multiplies by (1 + weight); llama.cpp stores 1 + weight
    experts: "ExpertLayout | None" = None  # a mixture of experts: how the checkpoint names them


@dataclass(frozen=True)
class ExpertLayout:
    """Where a checkpoint keeps its experts, after "model.layers.{i}.": the router, one matrix per expert
    ("{prefix}{e}.{name}") and, in newer checkpoints, the experts already stacked ("{prefix}{name}", 3-D;
    gate_up_proj holds gate then up)."""
    prefix: str
    per_expert: dict  # HF matrix name -> llama.cpp's stacked tensor
    config_keys: tuple  # (experts, experts per token) keys of config.json


_EXPERT_NAMES = {"gate_proj.weight": "ffn_gate_exps.weight", "up_proj.weight": "ffn_up_exps.weight",
                 "down_proj.weight": "ffn_down_exps.weight"}
QWEN3_MOE_EXPERTS = ExpertLayout("mlp.experts.", _EXPERT_NAMES, ("num_experts", "num_experts_per_tok"))
# Mixtral's w1, w2, w3 are gate, down, up
MIXTRAL_EXPERTS = ExpertLayout("block_sparse_moe.experts.", {"w1.weight": "ffn_gate_exps.weight",
                                                             "w2.weight": "ffn_down_exps.weight",
                                                             "w3.weight": "ffn_up_exps.weight"},
                               ("num_local_experts", "num_experts_per_tok"))
FUSED_EXPERTS = {"down_proj": "ffn_down_exps.weight", "gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight")}


_ATTN_FFN = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_PRE_NORM = {**_ATTN_FFN, "post_attention_layernorm.weight": "ffn_norm.weight"}
_SANDWICH_NORM = {**_ATTN_FFN, "post_attention_layernorm.weight": "post_attention_norm.weight",
                  "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                  "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
# OLMo 2 has no norm before attention or the FFN, only after (its q/k norms span the whole projection)
_POST_NORM = {**{k: v for k, v in _ATTN_FFN.items() if k != "input_layernorm.weight"},
              "post_attention_layernorm.weight": "post_attention_norm.weight",
              "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}

# Phi-3 fuses q, k and v into one projection, and gate and up (gate first) into ffn_up, as llama.cpp keeps them
_PHI3 = {"input_layernorm.weight": "attn_norm.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}

ARCHITECTURES = {  # config.json "architectures"[0] -> spec
    "LlamaForCausalLM": ArchSpec("llama", _PRE_NORM, True, False),
    "MistralForCausalLM": ArchSpec("llama", _PRE_NORM, True, False),
    "Qwen2ForCausalLM": ArchSpec("qwen2", _PRE_NORM, False, False),
    "Qwen3ForCausalLM": ArchSpec("qwen3", _PRE_NORM, False, False),
    "Gemma3ForCausalLM": ArchSpec("gemma3", _SANDWICH_NORM, False, True),
    "Gemma3ForConditionalGeneration": ArchSpec("gemma3", _SANDWICH_NORM, False, True),
    "Gemma2ForCausalLM": ArchSpec("gemma2", _SANDWICH_NORM, False, True),
    "GraniteForCausalLM": ArchSpec("granite", _PRE_NORM, True, False),
    "SmolLM3ForCausalLM": ArchSpec("smollm3", _PRE_NORM, True, False),
    "Olmo2ForCausalLM": ArchSpec("olmo2", _POST_NORM, False, False),
    "Phi3ForCausalLM": ArchSpec("phi3", _PHI3, False, False),
    "Qwen3MoeForCausalLM": ArchSpec("qwen3moe", {**_PRE_NORM, "mlp.gate.weight": "ffn_gate_inp.weight"}, False,
                                    False, QWEN3_MOE_EXPERTS),
    "MixtralForCausalLM": ArchSpec("llama", {**_PRE_NORM, "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"},
                                   True, False, MIXTRAL_EXPERTS),
}
LLAMA_CONVERTED = ("llama", "granite", "smollm3")  # llama.cpp converts these with its LlamaModel class
SMOLLM3_NO_ROPE_INTERVAL = 4  # what llama.cpp builds; other intervals are refused
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."))
_IGNORED = ("rotary_emb.inv_freq", "vision_tower.", "multi_modal_projector.", "model.vision_tower.",
            "model.multi_modal_projector.")  # llama.cpp drops these from the text model too


def gguf_tensor_name(spec: ArchSpec, hf_name: str) -> str | None:
    """llama.cpp's name for an HF tensor; None for tensors the text model does not use."""
    for old, new in _PREFIXES:
        if hf_name.startswith(old):
            hf_name = new + hf_name[len(old):]
    if any(part in hf_name for part in _IGNORED):
        return None
    if hf_name == "lm_head.weight" and spec.gguf_arch == "gemma2":
        return None  # llama.cpp's Gemma 2 always multiplies by the embedding (its converter drops lm_head)
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in spec.layer_names:
        return f"blk.{parts[2]}.{spec.layer_names[parts[3]]}"
    raise EdgeLLMError(f"tensor {hf_name!r} has no llama.cpp name for {spec.gguf_arch}: unsupported checkpoint layout")


def expert_tensor(spec: ArchSpec, hf_name: str):
    """[(llama.cpp's stacked tensor name, expert index (None: the checkpoint's tensor is already stacked), which
    half of a stacked gate_up (None: all of it)), ...] for an expert matrix of the checkpoint; None for any other
    tensor."""
    parts = hf_name.split(".", 3)
    if spec.experts is None or len(parts) < 4 or parts[:2] != ["model", "layers"] or \
            not parts[3].startswith(spec.experts.prefix):
        return None
    blk, rest = f"blk.{parts[2]}.", parts[3][len(spec.experts.prefix):]
    index, _, name = rest.partition(".")
    if index.isdigit() and name in spec.experts.per_expert:
        return [(blk + spec.experts.per_expert[name], int(index), None)]
    fused = FUSED_EXPERTS.get(rest.removesuffix(".weight"))
    if isinstance(fused, str):
        return [(blk + fused, None, None)]
    if fused is not None:
        return [(blk + fused[0], None, 0), (blk + fused[1], None, 1)]
    raise EdgeLLMError(f"tensor {hf_name!r}: an expert matrix this converter does not know")


def permute_for_interleaved_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of each head reordered from HF's (first half, second half) rotary pairs to GGUF's adjacent pairs
    (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_config(hf_dir: Path) -> tuple[ArchSpec, dict]:
    try:
        with open(hf_dir / "config.json", encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise EdgeLLMError(f"{hf_dir}: no config.json (is this a Hugging Face checkpoint directory?)") from None
    hf_arch = (config.get("architectures") or ["<none>"])[0]
    if hf_arch not in ARCHITECTURES:
        raise EdgeLLMError(f"{hf_dir}: architecture {hf_arch!r} is not supported; supported: "
                           f"{', '.join(ARCHITECTURES)}")
    if "text_config" in config:  # multimodal configs keep the language model's settings there
        config = {**config, **config["text_config"]}
    return ARCHITECTURES[hf_arch], config


def _rope_parameters(cfg: dict) -> dict:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    rope = rope.get("full_attention", rope)
    if "rope_theta" not in rope and "rope_theta" in cfg:
        rope["rope_theta"] = cfg["rope_theta"]
    return rope


def add_hyperparameters(writer, spec: ArchSpec, cfg: dict) -> list[tuple[str, np.ndarray]]:
    """The {arch}.* keys llama.cpp's converter writes; returns extra tensors (llama3's rope_freqs)."""
    from gguf import RopeScalingType  # gguf-py: a slow import, left out of the CLI's start
    gemma = spec.gguf_arch == "gemma3"
    if spec.gguf_arch == "granite" and cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) != \
            cfg["hidden_size"] // cfg["num_attention_heads"]:
        raise EdgeLLMError("Granite with head_dim != hidden_size / num_attention_heads: llama.cpp ignores head_dim")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg.get("max_position_embeddings", 131072 if gemma else 4096))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    n_head = cfg.get("num_attention_heads", 8) if gemma else cfg["num_attention_heads"]
    writer.add_head_count(n_head)
    writer.add_head_count_kv(cfg.get("num_key_value_heads", 4 if gemma else n_head))
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    rope = _rope_parameters(cfg)
    writer.add_rope_freq_base(rope.get("rope_theta", 1_000_000.0 if gemma else 10_000.0))
    if "head_dim" in cfg or gemma:
        writer.add_key_length(cfg.get("head_dim", 256))
        writer.add_value_length(cfg.get("head_dim", 256))
    extra = []
    rope_type = str(rope.get("rope_type") or "").lower()
    if spec.gguf_arch == "phi3":
        extra += phi3_rope(writer, cfg, rope)
    elif rope_type == "linear" and rope.get("factor"):
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn" and rope.get("factor"):
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope_type == "llama3" and spec.gguf_arch == "llama":
        extra.append(("rope_freqs.weight", llama3_rope_factors(cfg, rope)))
    elif rope_type not in ("", "default"):
        raise EdgeLLMError(f"RoPE scaling type {rope_type!r} is not supported by this converter")
    if spec.gguf_arch in LLAMA_CONVERTED:
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    _add_arch_keys(writer, spec.gguf_arch, cfg)
    if spec.experts is not None:
        _add_expert_keys(writer, spec, cfg)
    if gemma:
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(cfg["sliding_window"])
        local_theta = cfg.get("rope_local_base_freq",
                              (cfg.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta"))
        if local_theta is not None:
            writer.add_rope_freq_base_swa(local_theta)
    return extra


def _add_arch_keys(writer, arch: str, cfg: dict) -> None:
    """The keys of gemma2, granite, smollm3 and olmo2 that llama.cpp's converter writes, and the refusals of
    settings its graphs cannot run."""
    if arch == "gemma2":
        d, n_head, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
        expected = d // n_head if cfg["num_hidden_layers"] == 46 else hd  # llama.cpp's q scale rule
        if cfg.get("query_pre_attn_scalar", expected) != expected:
            raise EdgeLLMError(f"Gemma 2 with query_pre_attn_scalar {cfg['query_pre_attn_scalar']}: llama.cpp "
                               f"scales q by 1/sqrt({expected}) for this size")
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
    elif arch == "granite":
        for hf_key, add in (("attention_multiplier", writer.add_attention_scale),
                            ("embedding_multiplier", writer.add_embedding_scale),
                            ("residual_multiplier", writer.add_residual_scale),
                            ("logits_scaling", writer.add_logit_scale)):
            if cfg.get(hf_key):
                add(cfg[hf_key])
    elif arch == "smollm3":
        n = cfg["num_hidden_layers"]
        interval = cfg.get("no_rope_layer_interval", SMOLLM3_NO_ROPE_INTERVAL)
        layers = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        if [int(x) for x in layers[:n]] != [int((i + 1) % SMOLLM3_NO_ROPE_INTERVAL != 0) for i in range(n)]:
            raise EdgeLLMError("SmolLM3 whose rope-less layers are not every fourth: llama.cpp fixes that pattern")
    elif arch == "olmo2" and cfg.get("sliding_window"):
        raise EdgeLLMError("OLMo 3 (olmo2 with sliding_window) is not supported")


def phi3_rope(writer, cfg: dict, rope: dict) -> list[tuple[str, np.ndarray]]:
    """Phi-3's keys and longrope factor tensors, as convert_hf_to_gguf.py's Phi3MiniModel writes them."""
    n_embd, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    rope_dims = int(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) * n_embd) // n_head
    max_ctx = cfg.get("max_position_embeddings", 4096)
    orig_ctx = cfg.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", max_ctx))
    writer.add_rope_scaling_orig_ctx_len(orig_ctx)
    writer.add_rope_dimension_count(rope_dims)
    writer.add_sliding_window(cfg.get("sliding_window") or 0)  # 0 marks Phi-4's files; llama.cpp ignores it
    long_factors, short_factors = rope.get("long_factor"), rope.get("short_factor")
    if not long_factors:
        return []
    rope_type, scale = str(rope.get("rope_type") or "").lower(), max_ctx / orig_ctx
    if rope_type in ("su", "longrope"):
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig_ctx)) if scale > 1.0 else 1.0
    elif rope_type == "yarn":
        attn_factor = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    else:
        raise EdgeLLMError(f"Phi-3 RoPE scaling type {rope_type!r} is not supported (longrope, su, yarn are)")
    if short_factors is None or len(long_factors) != len(short_factors) or 2 * len(long_factors) != rope_dims:
        raise EdgeLLMError(f"Phi-3 longrope needs long and short factors of {rope_dims // 2} values each")
    writer.add_rope_scaling_attn_factors(attn_factor)
    return [("rope_factors_long.weight", np.asarray(long_factors, np.float32)),
            ("rope_factors_short.weight", np.asarray(short_factors, np.float32))]
def _add_expert_keys(writer, spec: ArchSpec, cfg: dict) -> None:
    """expert_count, expert_used_count (and qwen3moe's expert_feed_forward_length), as llama.cpp's converter; the
    settings its graph cannot run are refused."""
    n_expert, n_used = (cfg[k] for k in spec.experts.config_keys)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(n_used)
    if spec.gguf_arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            raise EdgeLLMError("Qwen3-MoE with dense layers (decoder_sparse_step, mlp_only_layers) is not supported")
        if not cfg.get("norm_topk_prob", True):
            raise EdgeLLMError("Qwen3-MoE with norm_topk_prob false: llama.cpp always renormalises the weights")
    if cfg.get("shared_expert_intermediate_size"):
        raise EdgeLLMError("shared experts are not supported")


def _expert_plan(spec: ArchSpec, cfg: dict, checkpoint: dict, pieces: dict, out_type: str) -> dict:
    """llama.cpp's stacked expert tensors: name -> (loader, shape, type), from expert_tensor's pieces."""
    n_expert = cfg[spec.experts.config_keys[0]]
    plan = {}
    for gguf_name, parts in sorted(pieces.items()):
        if parts[0][0] is None:  # already stacked: [n_expert, n_out, n_in], gate_up split in halves
            (_, half, hf_name), = parts
            shape = checkpoint[hf_name].tensors[hf_name][1]
            rows = shape[1] // 2 if half is not None else shape[1]

            def load(hf_name=hf_name, half=half, rows=rows):
                w = checkpoint[hf_name].load_f32(hf_name)
                return w if half is None else w[:, half * rows:(half + 1) * rows]
            shape = (shape[0], rows, shape[2])
        else:
            by_index = {index: hf_name for index, _, hf_name in parts}
            if sorted(by_index) != list(range(n_expert)):
                raise EdgeLLMError(f"{gguf_name}: the checkpoint has experts {sorted(by_index)}, config.json "
                                   f"{n_expert}")
            names = [by_index[e] for e in range(n_expert)]
            shape = (n_expert,) + tuple(checkpoint[names[0]].tensors[names[0]][1])

            def load(names=names):
                return np.stack([checkpoint[n].load_f32(n) for n in names])
        if shape[0] != n_expert:
            raise EdgeLLMError(f"{gguf_name}: {shape[0]} experts in the checkpoint, {n_expert} in config.json")
        plan[gguf_name] = (lambda load=load: np.ascontiguousarray(load(), np.float32), shape,
                           _output_type(gguf_name, shape, out_type))
    return plan


def llama3_rope_factors(cfg: dict, rope: dict) -> np.ndarray:
    """Per-frequency divisors of llama 3's RoPE scaling (convert_hf_to_gguf.py's generate_extra_tensors)."""
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope.get("rope_theta", 10000.0) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# ---------------------------------------------------------------------------------------------------------
# 3. tokenizer

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# The Split regexes of known tokenizer.json pre-tokenizers -> llama.cpp's tokenizer.ggml.pre name. llama.cpp
# identifies a pre-tokenizer by hashing the tokens of a test string; without HF's tokenizers library we
# recognise the configuration itself.
_SPLIT_REGEX_PRE = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}


def detect_bpe_pre(tokenizer_json: dict) -> str:
    pt = tokenizer_json.get("pre_tokenizer") or {}
    steps = pt.get("pretokenizers", []) if pt.get("type") == "Sequence" else [pt]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"  # StarCoder/SmolLM: single digits, then GPT-2's split
    for s in steps:
        if s.get("type") == "Split" and isinstance(s.get("pattern"), dict):
            name = _SPLIT_REGEX_PRE.get(s["pattern"].get("Regex"))
            if name:
                return name
    raise EdgeLLMError("tokenizer.json has a pre-tokenizer this converter does not recognise "
                       f"({json.dumps(pt)[:200]}); pass pre_tokenizer= (--pre) with llama.cpp's name for it")


def looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special: added tokens that act as control tokens."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>")) or (token.startswith("<unused") and token.endswith(">")))


def bpe_vocab(hf_dir: Path, vocab_size: int | None) -> tuple[list[str], list[int], dict]:
    with open(hf_dir / "tokenizer.json", encoding="utf-8") as f:
        tj = json.load(f)
    model = tj.get("model", {})
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise EdgeLLMError("tokenizer.json is not a BPE tokenizer; give a tokenizer.model for SentencePiece models")
    by_id = {i: tok for tok, i in model["vocab"].items()}
    added = {}
    for t in tj.get("added_tokens", []):
        by_id[t["id"]] = t["content"]
        added[t["id"]] = t
    n = vocab_size or max(by_id) + 1
    if max(by_id) >= n:
        raise EdgeLLMError(f"tokenizer.json has token id {max(by_id)} but the model's vocabulary has {n} entries")
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        elif i in added:
            tok = by_id[i]
            if added[i].get("special") or looks_special(tok):
                types.append(TOKEN_CONTROL)
            else:
                tok = tok.replace("\u2581", " ")  # llama.cpp stores user-defined tokens pre-normalised
                types.append(TOKEN_USER_DEFINED)
            tokens.append(tok)
        else:
            tokens.append(by_id[i])
            types.append(TOKEN_NORMAL)
    return tokens, types, tj


def sentencepiece_vocab(hf_dir: Path, vocab_size: int | None):
    """tokens (bytes), scores, types as convert_hf_to_gguf.py's _create_vocab_sentencepiece."""
    from sentencepiece import SentencePieceProcessor  # only SentencePiece checkpoints need it
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(hf_dir / "tokenizer.model"))
    n = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores, types = [-10000.0] * n, [TOKEN_UNUSED] * n
    for i in range(min(n, sp.vocab_size())):
        tokens[i], scores[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i)
        types[i] = (TOKEN_UNKNOWN if sp.IsUnknown(i) else TOKEN_CONTROL if sp.IsControl(i)
                    else TOKEN_UNUSED if sp.IsUnused(i) else TOKEN_BYTE if sp.IsByte(i) else TOKEN_NORMAL)
    added_file = hf_dir / "added_tokens.json"
    if added_file.is_file():
        for text, i in json.loads(added_file.read_text(encoding="utf-8")).items():
            if i < n:
                tokens[i], scores[i], types[i] = text.encode("utf-8"), -1000.0, TOKEN_USER_DEFINED
    config_file = hf_dir / "tokenizer_config.json"
    if config_file.is_file():
        decoder = json.loads(config_file.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
        for key, data in decoder.items():
            i, text = int(key), data["content"]
            if i >= n:
                continue
            if data.get("special") or looks_special(text):
                types[i] = TOKEN_CONTROL
            else:
                text, types[i] = text.replace("\u2581", " "), TOKEN_USER_DEFINED
            scores[i], tokens[i] = -1000.0, text.encode("utf-8")
    return tokens, scores, types


def add_tokenizer(writer, hf_dir: Path, spec: ArchSpec, cfg: dict, pre_tokenizer: str | None) -> int:
    """Tokenizer metadata, llama.cpp's way for the architecture; returns the number of tokens."""
    from gguf import SpecialVocab  # gguf-py: a slow import, left out of the CLI's start
    vocab_size = cfg.get("vocab_size")
    config_file = hf_dir / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if spec.gguf_arch == "llama" and tok_config.get("add_prefix_space") is not None:
        writer.add_add_space_prefix(tok_config["add_prefix_space"])
    if (hf_dir / "tokenizer.model").is_file():
        tokens, scores, types = sentencepiece_vocab(hf_dir, vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        SpecialVocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
        if spec.gguf_arch in ("gemma2", "gemma3"):
            writer.add_add_space_prefix(False)
    elif (hf_dir / "tokenizer.json").is_file():
        tokens, types, tj = bpe_vocab(hf_dir, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer or detect_bpe_pre(tj))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        SpecialVocab(hf_dir, load_merges=True).add_to_gguf(writer, quiet=True)
    else:
        raise EdgeLLMError(f"{hf_dir}: no tokenizer.model or tokenizer.json")
    if spec.gguf_arch == "llama" and vocab_size == 49152:
        writer.add_add_bos_token(False)  # llama.cpp's rule for the 49152-token granite/SmolLM vocabularies
    return len(tokens)


# ---------------------------------------------------------------------------------------------------------
# 4. convert_checkpoint

DIRECT_TYPES = {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7}  # output type -> LLAMA_FTYPE


def _output_type(gguf_name: str, shape: tuple, ftype: str) -> str:
    """convert_hf_to_gguf.py's choice: 1-D tensors, norms and biases in F32, the rest in the file type
    (Q8_0 falls back to F16 when a row does not split into 32-value blocks)."""
    if len(shape) <= 1 or gguf_name.endswith(("_norm.weight", "ffn_gate_inp.weight")) or \
            not gguf_name.endswith(".weight"):
        return "F32"  # (the experts' router too, as llama.cpp's converter keeps it)
    if ftype == "Q8_0" and shape[-1] % 32:
        return "F16"
    return ftype


@dataclass
class ConvertReport:
    architecture: str
    n_tensors: int
    out_bytes: int


def convert_checkpoint(hf_dir, out_path, out_type: str = "F16", pre_tokenizer: str | None = None,
                       progress: bool = True) -> ConvertReport:
    """Write the checkpoint in `hf_dir` as a GGUF file of `out_type` (F32, F16, BF16, Q8_0, or any type
    `edgellm quantize` accepts)."""
    from gguf import GGMLQuantizationType, GGUFWriter  # gguf-py: a slow import, left out of the CLI's start

    from edgellm.quant.quantize_kernels import quantize_fast  # numba kernels: loaded to convert tensors
    hf_dir, out_path, out_type = Path(hf_dir), os.fspath(out_path), str(out_type).upper()
    if out_type not in DIRECT_TYPES:
        file_type_by_name(out_type)  # fail before any work on an unknown name
        tmp = unique_temp_path(out_path)
        try:
            convert_checkpoint(hf_dir, tmp, "F32", pre_tokenizer, progress)
            quantize_file(tmp, out_path, out_type, progress=progress)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        with gguf_reader.open(out_path) as f:
            return ConvertReport(f.architecture, len(f.tensors), os.path.getsize(out_path))

    spec, cfg = load_config(hf_dir)
    checkpoint = open_checkpoint(hf_dir)
    tmp_path = unique_temp_path(out_path)
    writer = GGUFWriter(tmp_path, spec.gguf_arch)
    try:
        writer.add_type("model")
        writer.add_name(cfg.get("_name_or_path") or hf_dir.name)
        extra = add_hyperparameters(writer, spec, cfg)
        writer.add_file_type(DIRECT_TYPES[out_type])
        writer.add_quantization_version(2)
        n_tokens = add_tokenizer(writer, hf_dir, spec, cfg, pre_tokenizer)

        # name -> (loader, shape, type); shapes are known from the headers, so every tensor info is written first
        n_head = cfg.get("num_attention_heads", 8)
        n_head_kv = cfg.get("num_key_value_heads", n_head)
        plan = {}
        for name, values in extra:
            plan[name] = (lambda v=values: v, values.shape, "F32")
        expert_pieces = {}  # stacked expert tensor -> [(expert index, gate/up half, HF name), ...]
        for hf_name in sorted(checkpoint):
            found = expert_tensor(spec, hf_name)
            if found is not None:
                for gguf_name, index, half in found:
                    expert_pieces.setdefault(gguf_name, []).append((index, half, hf_name))
                continue
            gguf_name = gguf_tensor_name(spec, hf_name)
            if gguf_name is None:
                continue
            shape = checkpoint[hf_name].tensors[hf_name][1]
            if gguf_name == "token_embd.weight" and spec.gguf_arch == "gemma3":
                shape = (min(shape[0], n_tokens),) + shape[1:]  # llama.cpp drops rows past the vocabulary

            def load(hf_name=hf_name, gguf_name=gguf_name, shape=shape):
                w = checkpoint[hf_name].load_f32(hf_name)[:shape[0]]
                if spec.permute_qk and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
                    w = permute_for_interleaved_rope(w, n_head)
                elif spec.permute_qk and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
                    w = permute_for_interleaved_rope(w, n_head_kv)
                if spec.norm_plus_one and gguf_name.endswith("norm.weight"):
                    w = w + np.float32(1.0)
                return np.ascontiguousarray(w, dtype=np.float32)
            plan[gguf_name] = (load, shape, _output_type(gguf_name, shape, out_type))
        plan.update(_expert_plan(spec, cfg, checkpoint, expert_pieces, out_type) if spec.experts else {})
        if "token_embd.weight" not in plan:
            raise EdgeLLMError(f"{hf_dir}: the checkpoint has no embedding table (model.embed_tokens.weight)")

        for name, (_, shape, ggml_type) in plan.items():
            fmt = format_by_name(ggml_type)
            nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * fmt.row_bytes(shape[-1])
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=GGMLQuantizationType[ggml_type])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, (name, (load, shape, ggml_type)) in enumerate(plan.items()):
            w = load()
            writer.write_tensor_data(quantize_fast(w.reshape(-1, shape[-1]), ggml_type).reshape(-1))
            if progress:
                print(f"\r[{i + 1}/{len(plan)}] {name:<40} {ggml_type:<5}", end="", flush=True, file=sys.stderr)
        if progress:
            print(file=sys.stderr)
        writer.close()
        replace_synced(tmp_path, out_path)
    except BaseException:
        writer.close()
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
    return ConvertReport(spec.gguf_arch, len(plan), os.path.getsize(out_path))

"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head QK RMSNorm, NeoX rope) with a
mixture-of-experts feed-forward in every layer, as llama.cpp's src/models/qwen3moe.cpp: softmax over
expert_count experts, the expert_used_count largest, renormalised weights (moe.py). Experts have
expert_feed_forward_length rows; the file's feed_forward_length (the dense size) is not used."""

from dataclasses import dataclass

from edgellm.engine.models.llama import LlamaModel
from edgellm.engine.models.qwen3 import Qwen3Config


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    REQUIRES_EXPERTS = True


Qwen3MoeModel = LlamaModel

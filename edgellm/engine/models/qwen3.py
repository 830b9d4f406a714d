"""Qwen3: the llama forward pass with a per-head RMSNorm on q and k before rope, NeoX rope ordering, and a head
size from attention.key_length rather than n_embd / n_head (llama.cpp src/models/qwen3.cpp).
Only the config differs; its flags switch those steps on in LlamaModel."""

from dataclasses import dataclass

from edgellm.engine.models.llama import LlamaConfig, LlamaModel


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    ROPE_NEOX = True
    READS_SLIDING_WINDOW = False  # as llama.cpp: Qwen's windows are off in the models it converts
    QK_NORM = True


Qwen3Model = LlamaModel

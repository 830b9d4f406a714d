"""Qwen2: the llama forward pass with biases on the q, k, v projections and NeoX rope ordering
(llama.cpp src/models/qwen2.cpp). Only the config differs; its flags switch those steps on in LlamaModel."""

from dataclasses import dataclass

from edgellm.engine.models.llama import LlamaConfig, LlamaModel


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    ROPE_NEOX = True
    READS_SLIDING_WINDOW = False  # as llama.cpp: Qwen's windows are off in the models it converts
    QKV_BIAS = True


Qwen2Model = LlamaModel

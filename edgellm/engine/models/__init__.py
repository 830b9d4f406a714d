"""Model registry: general.architecture -> the module that builds it. Adding an architecture is one new file
and one line in ARCHITECTURES (plus aliases for names that share a forward pass)."""

import importlib
from dataclasses import dataclass

from edgellm.engine.kvtypes import kv_type as parse_kv_type
from edgellm.engine.models.base import DEFAULT_N_BATCH
from edgellm.errors import ModelError


@dataclass(frozen=True)
class Architecture:
    """An architecture's config and model classes, named by module (edgellm.engine.models.<module>) and imported
    on first use: loading a file imports its own architecture's module only (start-up time)."""
    name: str
    module: str
    config_name: str
    model_name: str

    def _get(self, attr: str) -> type:
        return getattr(importlib.import_module(f"{__name__}.{self.module}"), attr)

    @property
    def config_class(self) -> type:
        return self._get(self.config_name)

    @property
    def model_class(self) -> type:
        return self._get(self.model_name)


ARCHITECTURES = {
    "llama": Architecture("llama", "llama", "LlamaConfig", "LlamaModel"),
    "gemma3": Architecture("gemma3", "gemma3", "Gemma3Config", "Gemma3Model"),
    "qwen2": Architecture("qwen2", "qwen2", "Qwen2Config", "Qwen2Model"),
    "qwen3": Architecture("qwen3", "qwen3", "Qwen3Config", "Qwen3Model"),
    "phi3": Architecture("phi3", "phi3", "Phi3Config", "Phi3Model"),
    "gemma2": Architecture("gemma2", "gemma2", "Gemma2Config", "Gemma2Model"),
    "granite": Architecture("granite", "granite", "GraniteConfig", "GraniteModel"),
    "olmo2": Architecture("olmo2", "olmo2", "Olmo2Config", "Olmo2Model"),
    "smollm3": Architecture("smollm3", "smollm3", "SmolLM3Config", "SmolLM3Model"),
    "qwen3moe": Architecture("qwen3moe", "qwen3moe", "Qwen3MoeConfig", "Qwen3MoeModel"),
    "gpt-oss": Architecture("gpt-oss", "gptoss", "GptOssConfig", "GptOssModel"),
}

# GGUF architecture names whose forward pass is one of the above, unchanged.
ALIASES = {
    "mistral": "llama",
}


def get_architecture(name: str) -> Architecture:
    key = ALIASES.get(name, name)
    if key not in ARCHITECTURES:
        known = sorted(set(ARCHITECTURES) | set(ALIASES))
        raise ModelError(f"unsupported model architecture {name!r}; supported: {', '.join(known)}")
    return ARCHITECTURES[key]


def build_model(gguf_file, n_ctx: int | None = None, n_threads: int = 1, n_batch: int = DEFAULT_N_BATCH,
                kv_type=None):
    """A CPU model ready for forward(); n_ctx defaults to the model's training context (the GPU model:
    edgellm.engine.cuda.build_cuda_model). kv_type: the KV cache's storage (edgellm.engine.kvtypes: f32, f16
    (default) or q8_0)."""
    kvt = parse_kv_type(kv_type)  # ValueError for an unknown name, before anything is built
    arch = get_architecture(gguf_file.metadata.get("general.architecture", "<missing>"))
    config = arch.config_class.from_gguf(gguf_file)
    return arch.model_class(gguf_file, config, n_ctx or config.n_ctx_train, n_threads, n_batch, kv_type=kvt)


__all__ = ["ARCHITECTURES", "ALIASES", "Architecture", "build_model", "get_architecture"]

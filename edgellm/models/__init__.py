"""Model registry: general.architecture -> the module that builds it. Adding an architecture is one new file
and one line in ARCHITECTURES (plus aliases for names that share a forward pass)."""

from dataclasses import dataclass

from edgellm.errors import ModelError
from edgellm.models.base import DEFAULT_N_BATCH
from edgellm.models.gemma3 import Gemma3Config, Gemma3Model
from edgellm.models.llama import LlamaConfig, LlamaModel
from edgellm.models.qwen2 import Qwen2Config, Qwen2Model
from edgellm.models.qwen3 import Qwen3Config, Qwen3Model


@dataclass(frozen=True)
class Architecture:
    name: str
    config_class: type
    model_class: type


ARCHITECTURES = {
    "llama": Architecture("llama", LlamaConfig, LlamaModel),
    "gemma3": Architecture("gemma3", Gemma3Config, Gemma3Model),
    "qwen2": Architecture("qwen2", Qwen2Config, Qwen2Model),
    "qwen3": Architecture("qwen3", Qwen3Config, Qwen3Model),
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
                device: str = "cpu", kv_type=None):
    """A model ready for forward(); n_ctx defaults to the model's training context. device "cuda" builds the
    GPU model (edgellm.cuda), which imports numba-cuda only then. kv_type: the KV cache's storage
    (edgellm.kvtypes: f32, f16 (default) or q8_0); the CUDA model keeps an f32 cache."""
    from edgellm.kvtypes import kv_type as parse_kv_type
    kvt = parse_kv_type(kv_type)  # ValueError for an unknown name, before anything is built
    if device != "cpu":
        from edgellm.cuda import build_cuda_model, resolve_device
        if resolve_device(device) == "cuda":
            if kv_type is not None and kvt.name != "f32":
                raise ValueError(f"the CUDA model stores its KV cache in f32; kv_type {kvt.name!r} is CPU-only")
            return build_cuda_model(gguf_file, n_ctx=n_ctx, n_batch=n_batch)
    arch = get_architecture(gguf_file.metadata.get("general.architecture", "<missing>"))
    config = arch.config_class.from_gguf(gguf_file)
    return arch.model_class(gguf_file, config, n_ctx or config.n_ctx_train, n_threads, n_batch, kv_type=kvt)


__all__ = ["ARCHITECTURES", "ALIASES", "Architecture", "build_model", "get_architecture"]

"""Model registry: general.architecture -> the module that builds it. Adding an architecture is one new file
and one line in ARCHITECTURES (plus aliases for names that share a forward pass)."""

from dataclasses import dataclass

from edgellm.engine.kvtypes import kv_type as parse_kv_type
from edgellm.engine.models.base import DEFAULT_N_BATCH
from edgellm.errors import ModelError
from edgellm.engine.models.gemma2 import Gemma2Config, Gemma2Model
from edgellm.engine.models.gemma3 import Gemma3Config, Gemma3Model
from edgellm.engine.models.granite import GraniteConfig, GraniteModel
from edgellm.engine.models.llama import LlamaConfig, LlamaModel
from edgellm.engine.models.olmo2 import Olmo2Config, Olmo2Model
from edgellm.engine.models.phi3 import Phi3Config, Phi3Model
from edgellm.engine.models.qwen2 import Qwen2Config, Qwen2Model
from edgellm.engine.models.qwen3 import Qwen3Config, Qwen3Model
from edgellm.engine.models.qwen3moe import Qwen3MoeConfig, Qwen3MoeModel
from edgellm.engine.models.smollm3 import SmolLM3Config, SmolLM3Model


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
    "phi3": Architecture("phi3", Phi3Config, Phi3Model),
    "gemma2": Architecture("gemma2", Gemma2Config, Gemma2Model),
    "granite": Architecture("granite", GraniteConfig, GraniteModel),
    "olmo2": Architecture("olmo2", Olmo2Config, Olmo2Model),
    "smollm3": Architecture("smollm3", SmolLM3Config, SmolLM3Model),
    "qwen3moe": Architecture("qwen3moe", Qwen3MoeConfig, Qwen3MoeModel),
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

"""What every architecture's config shares: the keys read from GGUF metadata (`{arch}.block_count`, ...), their
checks, and the attention window of each layer. An architecture subclasses ModelConfig, adds its own fields and
extends read_keys; the cache, validation and `edgellm info` size everything from layer_windows()."""

import math
from dataclasses import dataclass

import numpy as np

from edgellm.errors import ModelError
from edgellm.engine.models.loading import check_shape_keys, read_key


class ArchKeys:
    """Reads `{arch}.<name>` keys of one file: keys("block_count") -> metadata["llama.block_count"]."""

    def __init__(self, gguf_file):
        self.gguf_file = gguf_file
        self.metadata = gguf_file.metadata
        self.arch = gguf_file.metadata.get("general.architecture")

    def __call__(self, name: str, kind=int, **default):
        return read_key(self.metadata, f"{self.arch}.{name}", kind, **default)


@dataclass(frozen=True)
class RopeScaling:
    """What rope reads beyond base and dimensions, as llama.cpp takes it from the file (rope.scaling.*)."""
    kind: str = "none"          # none, linear or yarn
    factor: float = 1.0         # rope.scaling.factor (freq_scale = 1 / factor)
    attn_factor: float = 1.0    # rope.scaling.attn_factor: a factor on cos and sin
    ext_factor: float = 0.0     # YaRN's blend of extrapolated angles: 1 for yarn, 0 otherwise (llama.cpp's default)
    n_ctx_orig: int = 0         # rope.scaling.original_context_length, default the training context (YaRN's
                                # correction dims; phi3's choice of long or short rope factors)
    beta_fast: float = 32.0     # YaRN's correction range in rotations (llama.cpp's defaults)
    beta_slow: float = 1.0


YARN_KEYS_FIXED = {"rope.scaling.yarn_log_multiplier": 0.0}  # keys whose other values change the formula


def read_rope_scaling(keys: ArchKeys, n_ctx_train: int) -> RopeScaling:
    """Linear and YaRN scaling as llama.cpp computes them; other schemes (longrope's factors are tensors, read by
    the architectures that have them) and YaRN variants it does not compute are refused, not approximated."""
    kind = keys("rope.scaling.type", str, default="none")
    factor = keys("rope.scaling.factor", float, default=0.0)
    attn_factor = keys("rope.scaling.attn_factor", float, default=1.0)
    n_ctx_orig = keys("rope.scaling.original_context_length", default=n_ctx_train)
    if kind in ("none", "linear") or (kind != "yarn" and factor in (0.0, 1.0)):
        return RopeScaling(kind, factor if factor > 0.0 else 1.0, attn_factor, n_ctx_orig=n_ctx_orig)
    if kind != "yarn":
        raise ModelError(f"rope scaling type {kind!r} is not supported")
    for name, value in YARN_KEYS_FIXED.items():
        if keys(name, float, default=value) != value:
            raise ModelError(f"{keys.arch}.{name} = {keys(name, float)} is not supported (YaRN with {value} only)")
    return RopeScaling("yarn", factor if factor > 0.0 else 1.0, attn_factor, 1.0, n_ctx_orig,
                       keys("rope.scaling.yarn_beta_fast", float, default=32.0),
                       keys("rope.scaling.yarn_beta_slow", float, default=1.0))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # general.architecture as the file names it (an alias stays itself, e.g. "mistral")
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # attention.key_length (= value_length), default n_embd / n_head
    n_ff: int
    n_vocab: int  # rows of token_embd
    n_ctx_train: int
    norm_eps: float  # RMSNorm epsilon
    rope_base: float
    rope_freq_scale: float  # 1 / rope scaling factor (in float32, as llama.cpp)
    rope_scaling: RopeScaling
    n_rot: int  # leading dimensions of each head that rope rotates (partial rotary when < head_dim)
    rope_neox: bool  # NeoX pair ordering (i, i + n_rot/2) instead of adjacent pairs (2i, 2i + 1)
    attn_scale: float  # on the scores, q·k * attn_scale
    q_scale: float  # on q after rope, in float32, for graphs that scale q rather than the scores (1: none)

    # Defaults an architecture may change: what llama.cpp assumes when the file lacks the key.
    N_CTX_TRAIN_DEFAULT = 4096
    ROPE_BASE_DEFAULT = 10000.0
    ROPE_NEOX = False

    @classmethod
    def from_gguf(cls, gguf_file):
        return cls(**cls.read_keys(ArchKeys(gguf_file)))

    @classmethod
    def read_keys(cls, keys: ArchKeys) -> dict:
        """The shared fields from the file's metadata, checked before anything is sized from them. An architecture
        extends the dict with its own fields (and may replace a shared one, e.g. attn_scale)."""
        n_embd = keys("embedding_length")
        n_head = keys("attention.head_count")
        n_head_kv = keys("attention.head_count_kv", default=n_head)
        if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
            raise ModelError(f"head_count {n_head} must be a positive multiple of head_count_kv {n_head_kv}")
        head_dim = keys("attention.key_length", default=n_embd // n_head)
        n_layer = keys("block_count")
        check_shape_keys(keys.gguf_file, keys.arch, n_layer, n_embd, n_head, head_dim)
        if keys("attention.value_length", default=head_dim) != head_dim:
            raise ModelError("attention.value_length differs from key_length; not supported")
        n_rot = keys("rope.dimension_count", default=head_dim)
        if n_rot % 2 or n_rot > head_dim:
            raise ModelError(f"rope.dimension_count {n_rot} must be even and at most the head size {head_dim}")
        n_ctx_train = keys("context_length", default=cls.N_CTX_TRAIN_DEFAULT)
        scaling = read_rope_scaling(keys, n_ctx_train)
        if "token_embd.weight" not in keys.gguf_file.tensors:
            raise ModelError("GGUF file lacks tensor 'token_embd.weight'")
        return dict(
            architecture=keys.arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=keys("feed_forward_length"),
            n_vocab=int(keys.gguf_file.tensors["token_embd.weight"].shape[0]),
            n_ctx_train=n_ctx_train,
            norm_eps=keys("attention.layer_norm_rms_epsilon", float),
            rope_base=keys("rope.freq_base", float, default=cls.ROPE_BASE_DEFAULT),
            rope_freq_scale=float(np.float32(1) / np.float32(scaling.factor)),
            rope_scaling=scaling,
            n_rot=n_rot,
            rope_neox=cls.ROPE_NEOX,
            attn_scale=keys("attention.scale", float, default=0.0) or 1.0 / math.sqrt(head_dim),
            q_scale=1.0,
        )

    def layer_windows(self) -> tuple:
        """Each layer's attention window in positions, 0 for global attention: the one place that says which
        layers slide (the KV cache's ring sizes, the memory checks and `edgellm info` all read it)."""
        return (0,) * self.n_layer

"""SmolLM3: the llama forward pass with no rotary embedding on every fourth layer (NoPE layers il % 4 == 3), as
llama.cpp's src/models/smollm3.cpp, which fixes the interval at 4 (the converter writes no key for it; Hugging
Face's no_rope_layer_interval is 4 for SmolLM3-3B).

A NoPE layer's q and k go through rope tables of angle 0 (cos 1, sin 0), which leave every value as it is, so
the shared attention step needs no branch; its keys are likewise left alone by a context shift (inv_freq 0)."""

from dataclasses import dataclass

import numpy as np

from edgellm.engine import ops
from edgellm.engine.models.base import DEFAULT_N_BATCH, RopeRows
from edgellm.engine.models.llama import LlamaConfig, LlamaModel

NO_ROPE_INTERVAL = 4  # llama.cpp: hparams.n_no_rope_layer_step = 4 for smollm3


@dataclass(frozen=True)
class SmolLM3Config(LlamaConfig):
    READS_SLIDING_WINDOW = False  # llama.cpp builds SmolLM3 with full attention only

    def uses_rope(self, il: int) -> bool:
        return (il + 1) % NO_ROPE_INTERVAL != 0


class SmolLM3Model(LlamaModel):
    def __init__(self, gguf_file, config: SmolLM3Config, n_ctx: int, n_threads: int,
                 n_batch: int = DEFAULT_N_BATCH, kv_type=None):
        super().__init__(gguf_file, config, n_ctx, n_threads, n_batch, kv_type)
        self.no_rope = ops.Rope(config.n_rot, config.rope_base, freq_scale=0.0)  # every angle 0
        half = config.n_rot // 2
        self.identity_cos = np.ones((self.n_batch, half), np.float32)  # [n_batch, n_rot/2]
        self.identity_sin = np.zeros((self.n_batch, half), np.float32)  # [n_batch, n_rot/2]

    def layer_rope(self, il: int):
        return (self.rope if self.config.uses_rope(il) else self.no_rope).inv_freq, self.config.rope_neox

    def attend(self, il: int, layer, s, b, rope: RopeRows) -> None:
        if not self.config.uses_rope(il):
            n = b.n_tokens
            rope = RopeRows(self.identity_cos[:n], self.identity_sin[:n], rope.neox)
        super().attend(il, layer, s, b, rope)

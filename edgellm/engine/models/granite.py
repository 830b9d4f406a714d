"""Granite (3.x dense), as llama.cpp's src/models/granite.cpp: the llama block with four multipliers.

    x = token_embd[ids] * embedding_scale
    per layer:  h = x + residual_scale * W_o · attention(rope(W_q·n), rope(W_k·n), W_v·n)   (scores * attention.scale)
                x = h + residual_scale * W_down · (silu(W_gate·m) * W_up·m)
    logits = (W_out · rmsnorm(x)·output_norm) * (1 / logit_scale)

Each multiply is one float32 op (llama.cpp's ggml_scale). An absent embedding, residual or attention scale is
llama.cpp's 0 (no multiply; attention then scales by 1/sqrt(head size)); logit_scale is required, as llama.cpp
requires it. A file whose rope.scaling.finetuned is false (Granite's switch for no rope at all) is refused.
"""

from dataclasses import dataclass

import numpy as np

from edgellm.errors import ModelError
from edgellm.engine import ops
from edgellm.engine.models.base import Batch
from edgellm.engine.models.linear import project_gate_up, project_qkv
from edgellm.engine.models.llama import LlamaConfig, LlamaModel


@dataclass(frozen=True)
class GraniteConfig(LlamaConfig):
    embedding_scale: float  # 0: none
    residual_scale: float  # 0: none
    logit_scale: float  # logits are multiplied by float32(1 / logit_scale)

    READS_SLIDING_WINDOW = False  # dense Granite has none (GraniteSWA is an architecture of its own)

    @classmethod
    def read_keys(cls, keys) -> dict:
        if not keys("rope.scaling.finetuned", bool, default=True):
            raise ModelError(f"{keys.arch}.rope.scaling.finetuned is false (a Granite without rope); not supported")
        logit_scale = keys("logit_scale", float)
        if not logit_scale > 0.0:
            raise ModelError(f"{keys.arch}.logit_scale must be positive, got {logit_scale}")
        return {**super().read_keys(keys),
                "embedding_scale": keys("embedding_scale", float, default=0.0),
                "residual_scale": keys("residual_scale", float, default=0.0),
                "logit_scale": logit_scale}


class GraniteModel(LlamaModel):
    def forward_pass(self, b: Batch):
        cfg, eps, sizes = self.config, self.config.norm_eps, b.sizes
        embd_scale, res_scale = np.float32(cfg.embedding_scale), np.float32(cfg.residual_scale)
        s = self.buffers.for_tokens(b.n_tokens)
        rope = b.rope_rows(self.rope, s.rope_cos, s.rope_sin, cfg.rope_neox)
        self.token_embd.get_rows(b.tokens, s.x)
        if embd_scale:
            s.x *= embd_scale
        for il, layer in enumerate(self.layers):
            # attention block: x += residual_scale * W_o · attention(...)
            ops.rms_norm(s.x, layer.attn_norm, eps, s.xn)
            project_qkv(layer, s.xn, s.q, s.k, s.v, sizes)
            self.attend(il, layer, s, b, rope)
            layer.attn_output.matmul(s.attn, s.xn, sizes)
            if res_scale:
                s.xn *= res_scale
            ops.add_rms_norm(s.x, s.xn, layer.ffn_norm, eps, s.xn)
            # feed-forward block: x += residual_scale * W_down · (silu(W_gate m) * W_up m)
            project_gate_up(layer, s.xn, s.gate, s.up, sizes)
            ops.silu_mul(s.gate, s.up)
            layer.ffn_down.matmul(s.gate, s.xn, sizes)
            if res_scale:
                s.xn *= res_scale
            s.x += s.xn
        self.logits_head(s, b)

    def logits_head(self, s, b: Batch) -> None:
        super().logits_head(s, b)
        if b.logits_out is not None:
            b.logits_out *= np.float32(1.0) / np.float32(self.config.logit_scale)

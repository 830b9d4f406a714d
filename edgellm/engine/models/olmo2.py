"""OLMo 2, as llama.cpp's src/models/olmo2.cpp: no norm before attention or the FFN, an RMSNorm after each
(added to the residual), and q and k each RMS-normed over the whole projection (all heads together, not per head)
before NeoX rope.

    per layer:  q, k, v = rmsnorm(W_q·x)·q_norm, rmsnorm(W_k·x)·k_norm, W_v·x
                h = x + rmsnorm(W_o · attention(rope(q), rope(k), v))·post_attention_norm
                x = h + rmsnorm(W_down · (silu(W_gate·h) * W_up·h))·post_ffw_norm
    logits = W_out · rmsnorm(x)·output_norm

OLMo 3 files (olmo2 with attention.sliding_window) are refused: their window layers use other rope settings.
"""

from dataclasses import dataclass

from edgellm.errors import ModelError
from edgellm.engine import ops
from edgellm.engine.models.base import DEFAULT_N_BATCH, Batch
from edgellm.engine.models.config import ModelConfig
from edgellm.engine.models.linear import project_gate_up, project_qkv
from edgellm.engine.models.llama import LlamaModel, attention_specs, ffn_specs
from edgellm.engine.models.loading import NONE, matrix, vector


@dataclass(frozen=True)
class Olmo2Config(ModelConfig):
    ROPE_NEOX = True

    @classmethod
    def read_keys(cls, keys) -> dict:
        if keys("attention.sliding_window", default=0):
            raise ModelError(f"{keys.arch}.attention.sliding_window is set (OLMo 3); not supported")
        shared = super().read_keys(keys)
        if shared["n_rot"] != shared["head_dim"]:
            raise ModelError(f"{keys.arch}.rope.dimension_count must equal the head size {shared['head_dim']}")
        return shared


def tensor_specs(cfg: Olmo2Config):
    d, q_dim, kv_dim = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    specs = [matrix("token_embd.weight", (cfg.n_vocab, d)), vector("output_norm.weight", d),
             matrix("output.weight", (cfg.n_vocab, d))]  # llama.cpp requires it: OLMo 2 is never tied
    for il in range(cfg.n_layer):
        blk = f"blk.{il}."
        norms = [vector(blk + "attn_q_norm.weight", q_dim), vector(blk + "attn_k_norm.weight", kv_dim)]
        specs += [*attention_specs(cfg, blk, norms), vector(blk + "post_attention_norm.weight", d),
                  *ffn_specs(cfg, blk), vector(blk + "post_ffw_norm.weight", d)]
    return specs


class Olmo2Model(LlamaModel):
    tensor_specs = staticmethod(tensor_specs)

    def __init__(self, gguf_file, config: Olmo2Config, n_ctx: int, n_threads: int, n_batch: int = DEFAULT_N_BATCH,
                 kv_type=None):
        super().__init__(gguf_file, config, n_ctx, n_threads, n_batch, kv_type)
        for layer in self.layers:  # whole-projection norms, applied here; attend()'s per-head step is skipped
            layer.q_norm, layer.k_norm = layer.attn_q_norm, layer.attn_k_norm
            layer.attn_q_norm = layer.attn_k_norm = NONE

    def forward_pass(self, b: Batch):
        cfg, eps, sizes = self.config, self.config.norm_eps, b.sizes
        s = self.buffers.for_tokens(b.n_tokens)
        rope = b.rope_rows(self.rope, s.rope_cos, s.rope_sin, cfg.rope_neox)
        self.token_embd.get_rows(b.tokens, s.x)
        for il, layer in enumerate(self.layers):
            # attention block: x += post_norm(W_o · attention(rope(norm(W_q x)), rope(norm(W_k x)), W_v x))
            project_qkv(layer, s.x, s.q, s.k, s.v, sizes)
            ops.rms_norm(s.q, layer.q_norm, eps, s.q)
            ops.rms_norm(s.k, layer.k_norm, eps, s.k)
            self.attend(il, layer, s, b, rope)
            layer.attn_output.matmul(s.attn, s.xn, sizes)
            ops.add_post_norm(s.x, s.xn, layer.post_attention_norm, eps)
            # feed-forward block: x += post_norm(W_down · (silu(W_gate x) * W_up x))
            project_gate_up(layer, s.x, s.gate, s.up, sizes)
            ops.silu_mul(s.gate, s.up)
            layer.ffn_down.matmul(s.gate, s.xn, sizes)
            ops.add_post_norm(s.x, s.xn, layer.post_ffw_norm, eps)
        self.logits_head(s, b)

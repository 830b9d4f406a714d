"""gpt-oss (gpt-oss-20b, gpt-oss-120b), as llama.cpp's src/models/openai-moe.cpp builds it:

    per layer:  n = rmsnorm(x)·attn_norm;  q, k, v = W_q·n + b_q, W_k·n + b_k, W_v·n + b_v
                h = x + W_o · attention(rope(q), rope(k), v) + b_o     every head's softmax has a sink: a learned
                                                                       logit in its denominator
                x = h + moe(rmsnorm(h)·post_attention_norm)
    logits = W_out · rmsnorm(x)·output_norm

moe (moe.expert_ffn, gating top_k_softmax): router logits W_r·m + b_r, the k largest, softmax over those k; each
chosen expert computes W_down[e] · swiglu_oai(W_gate[e]·m + b_gate[e], W_up[e]·m + b_up[e]) + b_down[e] (ops.swiglu_oai:
the clamped SwiGLU, alpha 1.702, limit 7), weighted and summed. The experts are MXFP4 in the released files.

Even layers attend over a sliding window (128 positions), odd ones globally (llama.cpp's pattern 2, unless the file
gives attention.sliding_window_pattern). Rope is NeoX-ordered with the file's YaRN scaling on both kinds of layer
(rope.freq_base_swa may give the window layers their own base); scores are scaled by 1/sqrt(n_rot).
"""

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from edgellm.engine import ops
from edgellm.engine.models.base import DEFAULT_N_BATCH, Batch, DecoderModel
from edgellm.engine.models.config import ModelConfig
from edgellm.engine.models.llama import WindowedBlockBuffers, attention_specs
from edgellm.engine.models.linear import project_qkv
from edgellm.engine.models.loading import experts, matrix, vector, vector_rows
from edgellm.engine.models.moe import ExpertBuffers, ExpertConfig, expert_ffn, read_expert_keys
from edgellm.errors import ModelError

SWA_PERIOD_DEFAULT = 2  # llama.cpp: load_swa_pattern(ml, 2) for gpt-oss


@dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    rope_base_local: float  # sliding-window layers' rope base (rope.freq_base_swa, default the global one)
    sliding_window: int
    swa_period: int  # layer il is global when il % swa_period == swa_period - 1
    experts: ExpertConfig

    ROPE_NEOX = True

    @classmethod
    def read_keys(cls, keys) -> dict:
        shared = super().read_keys(keys)
        window = keys("attention.sliding_window")
        period = keys("attention.sliding_window_pattern", default=SWA_PERIOD_DEFAULT)
        if window <= 0 or period <= 0:
            raise ModelError(f"{keys.arch}: sliding_window {window} and its pattern {period} must be positive")
        moe = read_expert_keys(keys, shared["n_ff"], required=True)
        n_rot = np.float32(shared["n_rot"])
        return {**shared,
                "attn_scale": float(np.float32(1) / np.float32(math.sqrt(n_rot))),  # 1.0f/sqrtf(n_rot)
                "rope_base_local": keys("rope.freq_base_swa", float, default=shared["rope_base"]),
                "sliding_window": window,
                "swa_period": period,
                "experts": dataclasses.replace(moe, gating="top_k_softmax", activation="swiglu_oai")}

    def layer_windows(self) -> tuple:
        return tuple(self.sliding_window if il % self.swa_period < self.swa_period - 1 else 0
                     for il in range(self.n_layer))


def tensor_specs(cfg: GptOssConfig):
    d, q_dim, kv_dim = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    n_expert, f = cfg.experts.n_expert, cfg.experts.n_ff
    specs = [matrix("token_embd.weight", (cfg.n_vocab, d)), vector("output_norm.weight", d),
             matrix("output.weight", (cfg.n_vocab, d))]
    for il in range(cfg.n_layer):
        blk = f"blk.{il}."
        specs += [vector(blk + "attn_norm.weight", d), *attention_specs(cfg, blk),
                  vector(blk + "attn_q.bias", q_dim), vector(blk + "attn_k.bias", kv_dim),
                  vector(blk + "attn_v.bias", kv_dim), vector(blk + "attn_output.bias", d),
                  vector(blk + "attn_sinks.weight", cfg.n_head),
                  vector(blk + "post_attention_norm.weight", d),
                  matrix(blk + "ffn_gate_inp.weight", (n_expert, d)), vector(blk + "ffn_gate_inp.bias", n_expert),
                  experts(blk + "ffn_gate_exps.weight", (n_expert, f, d)),
                  vector_rows(blk + "ffn_gate_exps.bias", (n_expert, f)),
                  experts(blk + "ffn_up_exps.weight", (n_expert, f, d)),
                  vector_rows(blk + "ffn_up_exps.bias", (n_expert, f)),
                  experts(blk + "ffn_down_exps.weight", (n_expert, d, f)),
                  vector_rows(blk + "ffn_down_exps.bias", (n_expert, d))]
    return specs


class GptOssModel(DecoderModel):
    tensor_specs = staticmethod(tensor_specs)

    def __init__(self, gguf_file, config: GptOssConfig, n_ctx: int, n_threads: int, n_batch: int = DEFAULT_N_BATCH,
                 kv_type=None):
        super().__init__(config, n_ctx, n_threads, n_batch, kv_type)
        self.load_weights(gguf_file, self.tensor_specs(config))
        for layer in self.layers:  # writable copies (n_head floats): Numba types a read-only view of the map apart,
            layer.attn_sinks = layer.attn_sinks.copy()  # which would compile the sink attention drivers twice
        scaling = config.rope_scaling
        self.rope_local = ops.Rope(config.n_rot, config.rope_base_local, config.rope_freq_scale, None, scaling)
        self.rope_global = ops.Rope(config.n_rot, config.rope_base, config.rope_freq_scale, None, scaling)
        self.windows = config.layer_windows()
        self.make_cache()
        self.buffers = WindowedBlockBuffers(config, self.n_batch)
        self.expert_buffers = ExpertBuffers(config.experts, config.n_embd, self.n_batch)

    def layer_rope(self, il: int):
        return (self.rope_local if self.windows[il] else self.rope_global).inv_freq, self.config.rope_neox

    def forward_pass(self, b: Batch):
        cfg, eps, sizes = self.config, self.config.norm_eps, b.sizes
        s = self.buffers.for_tokens(b.n_tokens)
        rope_local = b.rope_rows(self.rope_local, s.cos_local, s.sin_local, cfg.rope_neox)
        rope_global = b.rope_rows(self.rope_global, s.cos_global, s.sin_global, cfg.rope_neox)
        self.token_embd.get_rows(b.tokens, s.x)
        for il, layer in enumerate(self.layers):
            # attention block: n = norm(x); x += W_o · attention(rope(W_q n + b_q), rope(W_k n + b_k), W_v n + b_v) + b_o
            ops.rms_norm(s.x, layer.attn_norm, eps, s.xn)
            project_qkv(layer, s.xn, s.q, s.k, s.v, sizes)
            self.attend(il, layer, s, b, rope_local if self.windows[il] else rope_global)
            layer.attn_output.matmul(s.attn, s.xn, sizes)
            s.xn += layer.attn_output_bias
            ops.add_rms_norm(s.x, s.xn, layer.post_attention_norm, eps, s.xn)  # the residual add, then m = norm(x)
            # feed-forward block: x += the chosen experts' weighted sum
            expert_ffn(layer, s.xn, s.xn, cfg.experts, self.expert_buffers, sizes)
            s.x += s.xn
        self.logits_head(s, b)

    def attend(self, il: int, layer, s, b: Batch, rope) -> None:
        """DecoderModel.attend's per-sequence path (q/k/v biases, no QK norms) with each head's sink."""
        cfg = self.config
        biases = (layer.attn_q_bias, layer.attn_k_bias, layer.attn_v_bias, layer.attn_q_norm, layer.attn_k_norm)
        for b0, b1, cache in b.groups:
            kv = cache.layers[il]
            q, k, v, cos, sin, pos, out = (a[b0:b1] for a in (s.q_heads, s.k_heads, s.v_heads, rope.cos, rope.sin,
                                                              b.positions, s.attn_heads))
            ops.finish_qkv(q, k, v, *biases, cfg.norm_eps, cos, sin, rope.neox, pos, kv.k, kv.v, kv.slot_pos,
                           kv.k_scale, kv.v_scale, cfg.q_scale)
            ops.attention(q, kv.k, kv.v, kv.slot_pos, pos, kv.window, cfg.attn_scale, out, self.attn_scratch(kv),
                          kv.k_scale, kv.v_scale, sinks=layer.attn_sinks)

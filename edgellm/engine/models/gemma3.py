"""Gemma 3 decoder, as llama.cpp's src/models/gemma3.cpp (the sliding-window variant it always builds).

    x = token_embd[ids] * sqrt(n_embd)
    per layer:  n = rmsnorm(x)·attn_norm;  q, k = rmsnorm_per_head(W_q·n)·q_norm, (W_k·n)·k_norm;  v = W_v·n
                h = x + rmsnorm(W_o · attention(rope(q), rope(k), v))·post_attention_norm
                x = h + rmsnorm(W_down · (gelu_tanh(W_gate·m) * W_up·m))·post_ffw_norm,   m = rmsnorm(h)·ffn_norm
    logits = token_embd · rmsnorm(x)·output_norm   (tied; llama.cpp applies no final softcap to Gemma 3)

Five of every six layers attend over a sliding window with rope base 10000; every sixth layer (il % 6 == 5)
attends globally with the file's rope base (and its linear rope scaling, if any).
Norm weights are used as stored: the converter already folded Gemma's (1 + w) into the GGUF.
"""

import math
from dataclasses import dataclass

import numpy as np

from edgellm.engine import ops
from edgellm.errors import ModelError
from edgellm.engine.models.base import DEFAULT_N_BATCH, DecoderModel
from edgellm.engine.models.llama import BlockBuffers, linear_rope_scale
from edgellm.engine.models.linear import group_projections, project_gate_up, project_qkv
from edgellm.engine.models.loading import check_shape_keys, layer_weights, load_tensors, matrix, read_key, vector

SWA_PERIOD_DEFAULT = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3
ROPE_BASE_LOCAL_DEFAULT = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3
N_LAYER_27B = 62  # llama.cpp scales attention by n_embd / n_head instead of head size for the 27B model


@dataclass(frozen=True)
class Gemma3Config:
    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float  # global layers
    rope_freq_scale: float  # global layers (1 / linear scaling factor)
    rope_base_local: float  # sliding-window layers, unscaled
    n_rot: int
    sliding_window: int
    swa_period: int  # layer il is global when il % swa_period == swa_period - 1
    attn_scale: float  # on the scores: 1, since llama.cpp's Gemma graph scales q instead
    q_scale: float  # on q after rope, in float32, before attention rounds q to f16

    def is_sliding(self, il: int) -> bool:
        return il % self.swa_period < self.swa_period - 1

    @classmethod
    def from_gguf(cls, gguf_file):
        meta, arch = gguf_file.metadata, gguf_file.metadata.get("general.architecture")
        n_embd = read_key(meta, f"{arch}.embedding_length")
        n_layer = read_key(meta, f"{arch}.block_count")
        n_head = read_key(meta, f"{arch}.attention.head_count")
        n_head_kv = read_key(meta, f"{arch}.attention.head_count_kv", default=n_head)
        if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
            raise ModelError(f"head_count {n_head} must be a positive multiple of head_count_kv {n_head_kv}")
        head_dim = read_key(meta, f"{arch}.attention.key_length", default=n_embd // n_head)
        check_shape_keys(gguf_file, arch, read_key(meta, f"{arch}.block_count"), n_embd, n_head, head_dim)
        if read_key(meta, f"{arch}.attention.value_length", default=head_dim) != head_dim:
            raise ModelError("attention.value_length differs from key_length; not supported")
        window = read_key(meta, f"{arch}.attention.sliding_window")
        if window <= 0:
            raise ModelError(f"{arch}.attention.sliding_window must be positive, got {window}")
        if "token_embd.weight" not in gguf_file.tensors:
            raise ModelError("GGUF file lacks tensor 'token_embd.weight'")
        scale_dim = n_embd / n_head if n_layer == N_LAYER_27B else head_dim
        return cls(
            architecture=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=read_key(meta, f"{arch}.feed_forward_length"),
            n_vocab=int(gguf_file.tensors["token_embd.weight"].shape[0]),
            n_ctx_train=read_key(meta, f"{arch}.context_length", default=32768),
            norm_eps=read_key(meta, f"{arch}.attention.layer_norm_rms_epsilon", float),
            rope_base=read_key(meta, f"{arch}.rope.freq_base", float, default=1000000.0),
            rope_freq_scale=linear_rope_scale(meta, arch),
            rope_base_local=read_key(meta, f"{arch}.rope.freq_base_swa", float, default=ROPE_BASE_LOCAL_DEFAULT),
            n_rot=head_dim,
            sliding_window=window,
            swa_period=read_key(meta, f"{arch}.attention.sliding_window_pattern", default=SWA_PERIOD_DEFAULT),
            attn_scale=1.0,
            q_scale=1.0 / math.sqrt(scale_dim),
        )


def tensor_specs(cfg: Gemma3Config):
    d, q_dim, kv_dim, hd = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.head_dim
    specs = [matrix("token_embd.weight", (cfg.n_vocab, d)), vector("output_norm.weight", d),
             matrix("output.weight", (cfg.n_vocab, d), optional=True)]
    for il in range(cfg.n_layer):
        blk = f"blk.{il}."
        specs += [
            vector(blk + "attn_norm.weight", d),
            matrix(blk + "attn_q.weight", (q_dim, d)),
            matrix(blk + "attn_k.weight", (kv_dim, d)),
            matrix(blk + "attn_v.weight", (kv_dim, d)),
            vector(blk + "attn_q_norm.weight", hd),
            vector(blk + "attn_k_norm.weight", hd),
            matrix(blk + "attn_output.weight", (d, q_dim)),
            vector(blk + "post_attention_norm.weight", d),
            vector(blk + "ffn_norm.weight", d),
            matrix(blk + "ffn_gate.weight", (cfg.n_ff, d)),
            matrix(blk + "ffn_up.weight", (cfg.n_ff, d)),
            matrix(blk + "ffn_down.weight", (d, cfg.n_ff)),
            vector(blk + "post_ffw_norm.weight", d),
        ]
    return specs


class Gemma3Buffers(BlockBuffers):
    def __init__(self, cfg: Gemma3Config, n_tokens: int):
        super().__init__(cfg, n_tokens)
        T, f32, half = n_tokens, np.float32, cfg.n_rot // 2
        self.cos_local = np.zeros((T, half), f32)  # [T, n_rot/2] sliding-window layers' rope
        self.sin_local = np.zeros((T, half), f32)
        self.cos_global = np.zeros((T, half), f32)  # [T, n_rot/2] global layers' rope
        self.sin_global = np.zeros((T, half), f32)


NONE = np.zeros(0, np.float32)  # no q/k/v biases in Gemma


class Gemma3Model(DecoderModel):
    def __init__(self, gguf_file, config: Gemma3Config, n_ctx: int, n_threads: int, n_batch: int = DEFAULT_N_BATCH,
                 kv_type=None):
        super().__init__(config, n_ctx, n_threads, n_batch, kv_type)
        w = load_tensors(gguf_file, tensor_specs(config))
        self.token_embd = w["token_embd.weight"]
        self.output_norm = w["output_norm.weight"]
        self.output = w["output.weight"] if w["output.weight"] is not None else self.token_embd  # tied when absent
        self.layers = [layer_weights(w, il) for il in range(config.n_layer)]
        for layer in self.layers:
            group_projections(layer)
        self.rope_local = ops.Rope(config.n_rot, config.rope_base_local)
        self.rope_global = ops.Rope(config.n_rot, config.rope_base, config.rope_freq_scale)
        self.embd_scale = np.float32(math.sqrt(config.n_embd))
        windows = [config.sliding_window if config.is_sliding(il) else 0 for il in range(config.n_layer)]
        self.make_cache(windows)
        self.buffers = Gemma3Buffers(config, self.n_batch)

    def layer_rope(self, il: int):
        return (self.rope_local if self.config.is_sliding(il) else self.rope_global).inv_freq, True

    def forward_batch(self, tokens, positions, logits_out, groups=None):
        cfg, eps, T = self.config, self.config.norm_eps, len(tokens)
        groups = groups or ((0, T, self.cache),)
        # several sequences: each one's rows get the arithmetic of a batch of its own size, as if run alone
        sizes = None if len(groups) == 1 else tuple(b1 - b0 for b0, b1, _ in groups)
        s = self.buffers.for_tokens(T)
        ops.rope_tables(positions, self.rope_local, s.cos_local, s.sin_local)
        ops.rope_tables(positions, self.rope_global, s.cos_global, s.sin_global)
        self.token_embd.get_rows(tokens, s.x)
        s.x *= self.embd_scale
        for il, layer in enumerate(self.layers):
            cos, sin = (s.cos_global, s.sin_global) if self.cache.layers[il].window == 0 else (s.cos_local, s.sin_local)
            # attention block: n = norm(x); x += post_norm(W_o · attention(rope(norm(W_q n)), rope(norm(W_k n)), W_v n))
            ops.rms_norm(s.x, layer.attn_norm, eps, s.xn)
            project_qkv(layer, s.xn, s.q, s.k, s.v, sizes)
            self.attend(il, s, positions, cos, sin, True, (NONE, NONE, NONE), (layer.attn_q_norm, layer.attn_k_norm),
                        groups)
            layer.attn_output.matmul(s.attn, s.xn, sizes)
            ops.add_post_norm(s.x, s.xn, layer.post_attention_norm, eps)
            # feed-forward block: m = norm(x); x += post_norm(W_down · (gelu(W_gate m) * W_up m))
            ops.rms_norm(s.x, layer.ffn_norm, eps, s.xn)
            project_gate_up(layer, s.xn, s.gate, s.up, sizes)
            ops.gelu_tanh_mul(s.gate, s.up)
            layer.ffn_down.matmul(s.gate, s.xn, sizes)
            ops.add_post_norm(s.x, s.xn, layer.post_ffw_norm, eps)
        if logits_out is not None:
            self.logits_head(s, T, logits_out, sizes)

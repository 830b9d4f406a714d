"""edgellm.prep.convert: tiny Hugging Face checkpoints built here (random weights written as safetensors, a small
tokenizer) are converted to GGUF, loaded with edgellm, and must give the logits of a numpy forward pass that
follows the Hugging Face modeling code on the ORIGINAL weights.

The forward pass below is written from transformers' modeling_{llama,qwen2,qwen3,gemma3,phi3,qwen3_moe,mixtral}.py
conventions
(rotate_half RoPE, Gemma's (1 + w) norms and sandwich norms, GELU-tanh, sqrt(d) embedding scale, sliding
windows) and shares no code with the converter: a wrong permutation, a missing +1, a swapped norm or a
mis-mapped tensor changes the logits.
"""

import json
import struct

import numpy as np
import pytest

import edgellm
import edgellm.engine.gguf as gguf_reader
from edgellm.prep.convert import convert_checkpoint
from edgellm.errors import EdgeLLMError

F32_LOGIT_ATOL = 5e-4  # float32 fast path vs float64 reference (measured ~1e-6) on logits of size ~1-3
# Gemma's GELU goes through llama.cpp's float16 lookup table (2**-11 relative per activation), as llama.cpp's
# does: measured 2.8e-3 on these logits.
GELU_F16_LOGIT_ATOL = 1e-2
Q8_LOGIT_ATOL = 0.15   # Q8_0 weights round to ~0.4% of each 32-block's max
SEQ = [1, 5, 9, 40, 7, 99, 3, 3, 12, 250, 61, 8, 30, 2]  # token ids; longer than the tiny sliding window

# ---------------------------------------------------------------------------------------------------------
# writing a checkpoint


def write_safetensors(path, tensors: dict, dtype: str = "F32"):
    """The safetensors layout: u64 header length, JSON header, raw little-endian data."""
    header, chunks, offset = {}, [], 0
    for name, value in tensors.items():
        if dtype == "BF16":
            raw = (np.asarray(value, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            raw = np.asarray(value, {"F32": "<f4", "F16": "<f2"}[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"".join(chunks))


def stored_values(tensors: dict, dtype: str) -> dict:
    """What the checkpoint holds after rounding to its dtype, as float64."""
    out = {}
    for name, v in tensors.items():
        v = np.asarray(v, np.float32)
        if dtype == "BF16":
            v = ((v.view(np.uint32) >> 16) << 16).view(np.float32)
        elif dtype == "F16":
            v = v.astype(np.float16).astype(np.float32)
        out[name] = v.astype(np.float64)
    return out


def byte_chars():
    """GPT-2's byte -> printable character table."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in printable]
    return {b: chr(b) if b in printable else chr(256 + extra.index(b)) for b in range(256)}


MERGES = [("t", "h"), ("th", "e"), ("\u0120", "the"), ("c", "a"), ("ca", "t")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_bpe_tokenizer(hf_dir, pre_tokenizer: dict) -> dict:
    chars = byte_chars()
    vocab = {chars[b]: i for i, b in enumerate(range(256))}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    added = [{"id": len(vocab) + i, "content": s, "special": True, "normalized": False, "single_word": False,
              "lstrip": False, "rstrip": False} for i, s in enumerate(SPECIALS)]
    tj = {"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": pre_tokenizer,
          "model": {"type": "BPE", "vocab": vocab, "merges": [f"{a} {b}" for a, b in MERGES]}}
    (hf_dir / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"}),
        encoding="utf-8")
    return vocab


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
QWEN2_SPLIT = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


def write_sentencepiece_tokenizer(hf_dir, vocab_size: int):
    import sentencepiece as spm
    text = hf_dir / "corpus.txt"
    text.write_text("\n".join(["the cat sat on the mat", "a dog and a cat", "tiny models are fun to test",
                               "hello world", "numbers 1 2 3 4"] * 20), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(hf_dir / "tokenizer"), vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, bos_id=2, eos_id=1, pad_id=0, unk_id=3,
                                   add_dummy_prefix=False, normalization_rule_name="identity",  # as Gemma's
                                   minloglevel=2)
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "add_bos_token": True}), encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# the tiny models

ARCH_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=256, tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  max_position_embeddings=256, tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, max_position_embeddings=256, tie_word_embeddings=True),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                   rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=4, sliding_window_pattern=6,
                   query_pre_attn_scalar=32, max_position_embeddings=256, hidden_activation="gelu_pytorch_tanh",
                   bos_token_id=2, eos_token_id=1, pad_token_id=0),
    # soft caps well inside these random models' ranges, so that a missing cap shows
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                   sliding_window=3, query_pre_attn_scalar=32, attn_logit_softcapping=0.5,
                   final_logit_softcapping=2.0, max_position_embeddings=256, hidden_activation="gelu_pytorch_tanh",
                   bos_token_id=2, eos_token_id=1, pad_token_id=0),
    "granite": dict(architectures=["GraniteForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                    max_position_embeddings=256, tie_word_embeddings=True, embedding_multiplier=3.0,
                    residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5),
    "smollm3": dict(architectures=["SmolLM3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                    max_position_embeddings=256, tie_word_embeddings=True, no_rope_layer_interval=4,
                    no_rope_layers=[1, 1, 1, 0]),
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=500000.0,
                  max_position_embeddings=256, tie_word_embeddings=False),
    # Phi-4-mini's shape of config: partial rotary, longrope factors past the original context (12 rotary dims of
    # 16: 6 factors each, far from 1 so that a swap of long and short shows)
    "phi3": dict(architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=256, original_max_position_embeddings=64, partial_rotary_factor=0.75,
                 rope_scaling={"type": "longrope", "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
                               "short_factor": [1.0, 1.2, 1.7, 2.3, 3.1, 4.0]},
                 sliding_window=None, tie_word_embeddings=True),
    # mixtures of experts: experts one matrix each, as the checkpoints on the Hub store them
    "qwen3moe": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=96,
                     moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=256, tie_word_embeddings=False),
    "mixtral": dict(architectures=["MixtralForCausalLM"], hidden_size=64, intermediate_size=48, num_local_experts=4,
                    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=256, tie_word_embeddings=False),
}
CHECKPOINT_DTYPE = {"llama": "F32", "qwen2": "F16", "qwen3": "F32", "gemma3": "BF16", "gemma2": "BF16",
                    "granite": "F32", "smollm3": "F16", "olmo2": "F32", "qwen3moe": "BF16", "mixtral": "F32",
                    "phi3": "BF16"}
GGUF_ARCH = {"mixtral": "llama"}
# HF module names of the experts: (router, experts' prefix, gate, up, down)
MOE_NAMES = {"qwen3moe": ("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
             "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")}
GEMMA_HF = ("gemma2", "gemma3")


def random_weights(cfg: dict, arch: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    d, ff, nv = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim", d // cfg["num_attention_heads"])
    q_dim, kv_dim = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):  # Gemma stores w with the model using (1 + w): keep both conventions near 1 overall
        return (rng.uniform(-0.3, 0.3, n) if arch in GEMMA_HF else rng.uniform(0.7, 1.3, n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((nv, d)).astype(np.float32), "model.norm.weight": norm(d)}
    if not cfg.get("tie_word_embeddings", arch in GEMMA_HF):
        w["lm_head.weight"] = mat(nv, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                  p + "self_attn.q_proj.weight": mat(q_dim, d), p + "self_attn.k_proj.weight": mat(kv_dim, d),
                  p + "self_attn.v_proj.weight": mat(kv_dim, d), p + "self_attn.o_proj.weight": mat(d, q_dim),
                  p + "mlp.gate_proj.weight": mat(ff, d), p + "mlp.up_proj.weight": mat(ff, d),
                  p + "mlp.down_proj.weight": mat(d, ff)})
        if arch in MOE_NAMES:
            for n in ("gate", "up", "down"):
                del w[p + f"mlp.{n}_proj.weight"]
            router, experts, gate, up, down = MOE_NAMES[arch]
            n_expert = cfg.get("num_experts") or cfg["num_local_experts"]
            fe = cfg.get("moe_intermediate_size", ff)
            w[p + router + ".weight"] = mat(n_expert, d) * np.float32(4.0)  # peaked enough to route unevenly
            for e in range(n_expert):
                w.update({p + f"{experts}.{e}.{gate}.weight": mat(fe, d), p + f"{experts}.{e}.{up}.weight": mat(fe, d),
                          p + f"{experts}.{e}.{down}.weight": mat(d, fe)})
        if arch == "qwen2":
            for n, k in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                w[p + f"self_attn.{n}_proj.bias"] = (rng.standard_normal(k) * 0.5).astype(np.float32)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = norm(hd), norm(hd)
        if arch == "olmo2":  # norms over the whole projections, and after attention and the FFN only
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = norm(q_dim), norm(kv_dim)
            del w[p + "input_layernorm.weight"]
            w[p + "post_feedforward_layernorm.weight"] = norm(d)
        if arch in GEMMA_HF:
            w[p + "pre_feedforward_layernorm.weight"] = norm(d)
            w[p + "post_feedforward_layernorm.weight"] = norm(d)
        if arch == "phi3":  # Phi3Attention's qkv_proj and Phi3MLP's gate_up_proj (gate rows first)
            w[p + "self_attn.qkv_proj.weight"] = np.concatenate([w.pop(p + f"self_attn.{n}_proj.weight")
                                                                 for n in "qkv"])
            w[p + "mlp.gate_up_proj.weight"] = np.concatenate([w.pop(p + "mlp.gate_proj.weight"),
                                                               w.pop(p + "mlp.up_proj.weight")])
    return w


def make_checkpoint(hf_dir, arch: str):
    """Writes config.json, model.safetensors and a tokenizer; returns (config, stored weights as float64)."""
    cfg = dict(ARCH_CONFIGS[arch])
    if arch in GEMMA_HF:
        cfg["vocab_size"] = 300
        write_sentencepiece_tokenizer(hf_dir, cfg["vocab_size"])
    else:
        pre = QWEN2_SPLIT if arch.startswith("qwen") else BYTE_LEVEL
        cfg["vocab_size"] = len(write_bpe_tokenizer(hf_dir, pre)) + len(SPECIALS)
    (hf_dir / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    weights = random_weights(cfg, arch)
    write_safetensors(hf_dir / "model.safetensors", weights, CHECKPOINT_DTYPE[arch])
    return cfg, stored_values(weights, CHECKPOINT_DTYPE[arch])


# ---------------------------------------------------------------------------------------------------------
# the Hugging Face forward pass, in float64


def hf_rms_norm(x, w, eps, gemma):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * (1.0 + w) if gemma else y * w


def hf_rope(x, positions, theta, rot=None, factors=1.0, attention_factor=1.0):
    """transformers' apply_rotary_pos_emb on the first rot dims (partial_rotary_factor; default all): x * cos +
    rotate_half(x) * sin, rotate_half = (-x2, x1); longrope divides the frequencies by its factors and scales cos
    and sin by its attention factor."""
    rot = rot or x.shape[-1]
    inv_freq = 1.0 / (np.asarray(factors, np.float64) * theta ** (np.arange(0, rot, 2) / rot))
    ang = positions[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None] * attention_factor
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None] * attention_factor
    xr = x[..., :rot]
    rotated = np.concatenate([-xr[..., rot // 2:], xr[..., :rot // 2]], axis=-1)
    return np.concatenate([xr * cos + rotated * sin, x[..., rot:]], axis=-1)


def phi3_rope_args(cfg, hd, seq_len):
    """Phi-3's rotary dims, longrope factors for this sequence length, and attention factor (transformers'
    longrope: the long factors past original_max_position_embeddings)."""
    rope, orig = cfg["rope_scaling"], cfg["original_max_position_embeddings"]
    scale = cfg["max_position_embeddings"] / orig
    factors = rope["long_factor"] if seq_len > orig else rope["short_factor"]
    attention = np.sqrt(1 + np.log(scale) / np.log(orig)) if scale > 1 else 1.0
    return int(hd * cfg.get("partial_rotary_factor", 1.0)), factors, attention


def hf_moe(cfg, w, p, arch, x):
    """Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock: softmax over the router's logits, the top num_experts_per_tok,
    their weights renormalised (Qwen3's norm_topk_prob; Mixtral always), the experts' SwiGLU outputs summed."""
    router, experts, gate, up, down = MOE_NAMES[arch]
    z = x @ w[p + router + ".weight"].T
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t])[:cfg["num_experts_per_tok"]]
        for e in top:
            g = x[t] @ w[p + f"{experts}.{e}.{gate}.weight"].T
            y = (g / (1 + np.exp(-g)) * (x[t] @ w[p + f"{experts}.{e}.{up}.weight"].T)) @ \
                w[p + f"{experts}.{e}.{down}.weight"].T
            out[t] += probs[t, e] / probs[t, top].sum() * y
    return out


def hf_forward(cfg, w, arch, ids):
    gemma = arch in GEMMA_HF
    d, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", d // nh)
    eps, T = cfg["rms_norm_eps"], len(ids)
    pos = np.arange(T, dtype=np.float64)
    h = w["model.embed_tokens.weight"][ids]
    residual = cfg.get("residual_multiplier", 1.0)  # Granite's multipliers (absent: 1)
    if gemma:
        h = h * np.sqrt(d)
    h = h * cfg.get("embedding_multiplier", 1.0)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = hf_rms_norm(h, w[p + "input_layernorm.weight"], eps, gemma) if arch != "olmo2" else h
        if arch == "phi3":
            qkv = x @ w[p + "self_attn.qkv_proj.weight"].T
            q, k, v = qkv[:, :nh * hd], qkv[:, nh * hd: (nh + nkv) * hd], qkv[:, (nh + nkv) * hd:]
        else:
            q, k, v = (x @ w[p + f"self_attn.{n}_proj.weight"].T + w.get(p + f"self_attn.{n}_proj.bias", 0.0)
                       for n in "qkv")
        if arch == "olmo2":  # Olmo2Attention: q_norm / k_norm over the whole projections
            q, k = hf_rms_norm(q, w[p + "self_attn.q_norm.weight"], eps, False), \
                hf_rms_norm(k, w[p + "self_attn.k_norm.weight"], eps, False)
        q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        if p + "self_attn.q_norm.weight" in w and arch != "olmo2":
            q = hf_rms_norm(q, w[p + "self_attn.q_norm.weight"], eps, gemma)
            k = hf_rms_norm(k, w[p + "self_attn.k_norm.weight"], eps, gemma)
        if arch == "gemma2":
            sliding = i % 2 == 0  # Gemma2Attention: even layers slide
        else:
            sliding = gemma and (i + 1) % cfg["sliding_window_pattern"] != 0
        theta = cfg["rope_local_base_freq"] if sliding and arch == "gemma3" else cfg["rope_theta"]
        if arch == "phi3":
            rot, factors, attention = phi3_rope_args(cfg, hd, T)
            q, k = hf_rope(q, pos, theta, rot, factors, attention), hf_rope(k, pos, theta, rot, factors, attention)
        elif arch != "smollm3" or cfg["no_rope_layers"][i]:
            q, k = hf_rope(q, pos, theta), hf_rope(k, pos, theta)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        scale = cfg["query_pre_attn_scalar"] ** -0.5 if gemma else cfg.get("attention_multiplier", hd ** -0.5)
        scores = np.einsum("qhd,khd->hqk", q, k) * scale
        if arch == "gemma2":
            cap = cfg["attn_logit_softcapping"]
            scores = np.tanh(scores / cap) * cap
        allowed = np.tril(np.ones((T, T), bool))
        if sliding:
            allowed &= (np.arange(T)[:, None] - np.arange(T)[None, :]) < cfg["sliding_window"]
        scores = np.where(allowed[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        if gemma:
            h = h + hf_rms_norm(attn, w[p + "post_attention_layernorm.weight"], eps, True)
            x = hf_rms_norm(h, w[p + "pre_feedforward_layernorm.weight"], eps, True)
            g = x @ w[p + "mlp.gate_proj.weight"].T
            act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
            mlp = (act * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
            h = h + hf_rms_norm(mlp, w[p + "post_feedforward_layernorm.weight"], eps, True)
        elif arch == "olmo2":
            h = h + hf_rms_norm(attn, w[p + "post_attention_layernorm.weight"], eps, False)
            g = h @ w[p + "mlp.gate_proj.weight"].T
            mlp = (g / (1 + np.exp(-g)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
            h = h + hf_rms_norm(mlp, w[p + "post_feedforward_layernorm.weight"], eps, False)
        elif arch == "phi3":
            h = h + attn
            x = hf_rms_norm(h, w[p + "post_attention_layernorm.weight"], eps, False)
            g, up = np.split(x @ w[p + "mlp.gate_up_proj.weight"].T, 2, axis=-1)
            h = h + (up * (g / (1 + np.exp(-g)))) @ w[p + "mlp.down_proj.weight"].T
        elif arch in MOE_NAMES:
            h = h + attn
            h = h + hf_moe(cfg, w, p, arch, hf_rms_norm(h, w[p + "post_attention_layernorm.weight"], eps, False))
        else:
            h = h + attn * residual
            x = hf_rms_norm(h, w[p + "post_attention_layernorm.weight"], eps, False)
            g = x @ w[p + "mlp.gate_proj.weight"].T
            mlp = (g / (1 + np.exp(-g)) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
            h = h + mlp * residual
    h = hf_rms_norm(h, w["model.norm.weight"], eps, gemma)
    logits = h @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T / cfg.get("logits_scaling", 1.0)
    if arch == "gemma2":
        cap = cfg["final_logit_softcapping"]
        logits = np.tanh(logits / cap) * cap
    return logits


# ---------------------------------------------------------------------------------------------------------
# tests


@pytest.fixture(scope="module", params=sorted(ARCH_CONFIGS))
def converted(request, tmp_path_factory):
    arch = request.param
    hf_dir = tmp_path_factory.mktemp(f"hf_{arch}")
    cfg, weights = make_checkpoint(hf_dir, arch)
    out = hf_dir / "model-f32.gguf"
    convert_checkpoint(hf_dir, out, "F32", progress=False)
    return arch, hf_dir, cfg, weights, out


def test_converted_model_matches_hf_forward_on_original_weights(converted):
    arch, _, cfg, weights, out = converted
    expected = hf_forward(cfg, weights, arch, np.array(SEQ))
    got = edgellm.load(str(out), n_ctx=64, n_threads=1, kv_type="f32").logits(SEQ)  # no KV rounding either
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=GELU_F16_LOGIT_ATOL if arch in GEMMA_HF else F32_LOGIT_ATOL, rtol=0)


def test_converted_file_has_llama_cpp_names_types_and_keys(converted):
    arch, _, cfg, _, out = converted
    gguf_arch = GGUF_ARCH.get(arch, arch)
    with gguf_reader.open(out) as f:
        meta, tensors = f.metadata, f.tensors
        assert f.architecture == gguf_arch
        assert meta[f"{gguf_arch}.block_count"] == cfg["num_hidden_layers"]
        assert meta[f"{gguf_arch}.attention.head_count_kv"] == cfg["num_key_value_heads"]
        assert meta["general.file_type"] == 0
        assert tensors["blk.0.attn_qkv.weight" if arch == "phi3" else "blk.0.attn_q.weight"].ggml_type == "F32"
        first_norm = "post_attention_norm" if arch == "olmo2" else "attn_norm"
        assert tensors[f"blk.0.{first_norm}.weight"].shape == (cfg["hidden_size"],)
        assert ("output.weight" in tensors) == ("lm_head.weight" in random_weights(cfg, arch))
        if arch == "gemma2":
            assert meta["gemma2.attn_logit_softcapping"] == cfg["attn_logit_softcapping"]
            assert meta["gemma2.final_logit_softcapping"] == cfg["final_logit_softcapping"]
        if arch == "granite":
            assert (meta["granite.embedding_scale"], meta["granite.residual_scale"], meta["granite.logit_scale"]) \
                == (cfg["embedding_multiplier"], cfg["residual_multiplier"], cfg["logits_scaling"])
            assert np.isclose(meta["granite.attention.scale"], cfg["attention_multiplier"])
        if arch == "olmo2":
            assert tensors["blk.0.attn_q_norm.weight"].shape == (cfg["hidden_size"],)  # the whole projection
        if arch == "phi3":
            scaling = cfg["rope_scaling"]
            assert (meta["phi3.rope.dimension_count"], meta["phi3.rope.scaling.original_context_length"]) == (12, 64)
            assert np.isclose(meta["phi3.rope.scaling.attn_factor"], np.sqrt(1 + np.log(4) / np.log(64)))
            assert meta["phi3.attention.sliding_window"] == 0
            for kind in ("long", "short"):
                np.testing.assert_array_equal(tensors[f"rope_factors_{kind}.weight"].data.view(np.float32),
                                              np.float32(scaling[f"{kind}_factor"]))
            assert tensors["blk.0.ffn_up.weight"].shape == (2 * cfg["intermediate_size"], cfg["hidden_size"])
        if arch in MOE_NAMES:  # experts stacked as llama.cpp's [n_expert, n_out, n_in]; the router stays F32
            n_expert, fe = meta[f"{gguf_arch}.expert_count"], cfg.get("moe_intermediate_size", cfg["intermediate_size"])
            assert (n_expert, meta[f"{gguf_arch}.expert_used_count"]) == \
                (cfg.get("num_experts") or cfg["num_local_experts"], cfg["num_experts_per_tok"])
            assert tensors["blk.1.ffn_gate_exps.weight"].shape == (n_expert, fe, cfg["hidden_size"])
            assert tensors["blk.1.ffn_down_exps.weight"].shape == (n_expert, cfg["hidden_size"], fe)
            assert tensors["blk.1.ffn_gate_inp.weight"].shape == (n_expert, cfg["hidden_size"])
            assert "blk.0.ffn_gate.weight" not in tensors
            if arch == "qwen3moe":
                assert meta["qwen3moe.expert_feed_forward_length"] == fe
        if arch in GEMMA_HF:
            assert meta[f"{arch}.attention.sliding_window"] == cfg["sliding_window"]
            assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is False
            assert "blk.0.post_ffw_norm.weight" in tensors
            assert ("blk.0.attn_q_norm.weight" in tensors) == (arch == "gemma3")
        else:
            assert meta["tokenizer.ggml.model"] == "gpt2"
            assert meta["tokenizer.ggml.pre"] == ("qwen2" if arch.startswith("qwen") else "gpt-2")
            assert meta["tokenizer.ggml.merges"] == [f"{a} {b}" for a, b in MERGES]
            assert "<|im_start|>" in meta["tokenizer.chat_template"]


def test_bpe_tokenizer_round_trips_through_edgellm(converted):
    arch, hf_dir, _, _, out = converted
    if arch in GEMMA_HF:
        pytest.skip("SentencePiece model: see test_sentencepiece_tokenizer_matches_sentencepiece")
    vocab = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    m = edgellm.load(str(out), n_ctx=64, n_threads=1)
    # merges th, the, Ġthe and ca, cat must all apply; the special token is one control token
    assert m.tokenize("the the cat", add_special=False) == [vocab["the"], vocab["\u0120the"], vocab["\u0120"],
                                                             vocab["cat"]]
    eot = len(vocab) + SPECIALS.index("<|im_end|>")
    assert m.tokenize("<|im_end|>", add_special=False, parse_special=True) == [eot]
    assert m.tokenizer.eos_id == eot
    assert m.detokenize(m.tokenize("the cat sat", add_special=False)) == "the cat sat"


def test_sentencepiece_tokenizer_matches_sentencepiece(converted):
    arch, hf_dir, _, _, out = converted
    if arch not in GEMMA_HF:
        pytest.skip("BPE model")
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    with gguf_reader.open(out) as f:
        assert f.metadata["tokenizer.ggml.tokens"][:sp.vocab_size()] == [sp.IdToPiece(i) for i in range(sp.vocab_size())]
        np.testing.assert_array_equal(f.metadata["tokenizer.ggml.scores"][:sp.vocab_size()],
                                      np.array([sp.GetScore(i) for i in range(sp.vocab_size())], np.float32))
        assert f.metadata["tokenizer.ggml.bos_token_id"] == sp.bos_id()
    m = edgellm.load(str(out), n_ctx=64, n_threads=1)
    text = "the cat sat on the mat"
    assert m.tokenize(text, add_special=False) == sp.encode(text)


def test_q8_0_conversion_stays_close_and_quantize_types_go_through_edgellm_quantize(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    cfg, weights = make_checkpoint(hf_dir, "llama")
    expected = hf_forward(cfg, weights, "llama", np.array(SEQ))
    convert_checkpoint(hf_dir, tmp_path / "q8.gguf", "Q8_0", progress=False)
    convert_checkpoint(hf_dir, tmp_path / "q4km.gguf", "Q4_K_M", progress=False)
    with gguf_reader.open(tmp_path / "q8.gguf") as f:
        assert f.tensors["blk.0.ffn_up.weight"].ggml_type == "Q8_0" and f.metadata["general.file_type"] == 7
    with gguf_reader.open(tmp_path / "q4km.gguf") as f:
        assert f.metadata["general.file_type"] == 15
        assert f.tensors["blk.0.attn_q.weight"].ggml_type == "Q5_0"  # 64 columns: Q4_K falls back as llama.cpp
    got = edgellm.load(str(tmp_path / "q8.gguf"), n_ctx=64, n_threads=1).logits(SEQ)
    np.testing.assert_allclose(got, expected, atol=Q8_LOGIT_ATOL, rtol=0)
    assert not (tmp_path / "q4km.gguf.f32.tmp").exists()


def test_convert_refuses_what_it_cannot_convert(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}), encoding="utf-8")
    with pytest.raises(EdgeLLMError, match="GPT2LMHeadModel"):
        convert_checkpoint(tmp_path, tmp_path / "out.gguf", "F16", progress=False)
    hf_dir = tmp_path / "bad"
    hf_dir.mkdir()
    make_checkpoint(hf_dir, "llama")
    (hf_dir / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(EdgeLLMError, match="header length"):
        convert_checkpoint(hf_dir, tmp_path / "out.gguf", "F16", progress=False)
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("arch, change, message", [
    ("gemma2", {"query_pre_attn_scalar": 100}, "query_pre_attn_scalar"),
    ("smollm3", {"no_rope_layers": [1, 0, 1, 1]}, "every fourth"),
    ("olmo2", {"sliding_window": 4096}, "OLMo 3"),
    ("qwen3moe", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("qwen3moe", {"mlp_only_layers": [1]}, "dense layers"),
    ("mixtral", {"num_local_experts": 3}, "experts"),
])
def test_convert_refuses_settings_llama_cpp_cannot_run(tmp_path, arch, change, message):
    make_checkpoint(tmp_path, arch)
    cfg = json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}), encoding="utf-8")
    with pytest.raises(EdgeLLMError, match=message):
        convert_checkpoint(tmp_path, tmp_path / "out.gguf", "F32", progress=False)
    assert not (tmp_path / "out.gguf").exists()


def test_stacked_expert_checkpoints_convert_as_per_expert_ones(tmp_path):
    """Newer Qwen3-MoE checkpoints store each layer's experts stacked (mlp.experts.gate_up_proj [E, 2 n_ff, d],
    mlp.experts.down_proj [E, d, n_ff]): the same GGUF tensors as one matrix per expert; Q4_K_M quantizes the
    stacks and keeps the router F32, as llama.cpp's quantizer."""
    per_dir, fused_dir = tmp_path / "per", tmp_path / "fused"
    per_dir.mkdir()
    fused_dir.mkdir()
    cfg, _ = make_checkpoint(per_dir, "qwen3moe")
    make_checkpoint(fused_dir, "qwen3moe")
    w = random_weights(cfg, "qwen3moe")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        n = cfg["num_experts"]
        w[p + "gate_up_proj"] = np.stack([np.concatenate([w.pop(p + f"{e}.gate_proj.weight"),
                                                          w.pop(p + f"{e}.up_proj.weight")]) for e in range(n)])
        w[p + "down_proj"] = np.stack([w.pop(p + f"{e}.down_proj.weight") for e in range(n)])
    write_safetensors(fused_dir / "model.safetensors", w, CHECKPOINT_DTYPE["qwen3moe"])
    convert_checkpoint(per_dir, tmp_path / "per.gguf", "F32", progress=False)
    convert_checkpoint(fused_dir, tmp_path / "fused.gguf", "F32", progress=False)
    with gguf_reader.open(tmp_path / "per.gguf") as a, gguf_reader.open(tmp_path / "fused.gguf") as b:
        assert sorted(a.tensors) == sorted(b.tensors)
        for name, t in a.tensors.items():
            assert t.shape == b.tensors[name].shape and np.array_equal(t.data, b.tensors[name].data), name
    convert_checkpoint(per_dir, tmp_path / "q4km.gguf", "Q4_K_M", progress=False)
    with gguf_reader.open(tmp_path / "q4km.gguf") as f:
        assert f.tensors["blk.0.ffn_gate_inp.weight"].ggml_type == "F32"
        assert f.tensors["blk.0.ffn_up_exps.weight"].ggml_type != "F32"


def test_cli_convert(tmp_path, capsys):
    from edgellm.cli import main
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    make_checkpoint(hf_dir, "qwen3")
    assert main(["convert", str(hf_dir), str(tmp_path / "out.gguf"), "--outtype", "f16", "-q"]) == 0
    assert "qwen3" in capsys.readouterr().out
    with gguf_reader.open(tmp_path / "out.gguf") as f:
        assert f.metadata["general.file_type"] == 1 and f.tensors["blk.1.ffn_down.weight"].ggml_type == "F16"
        assert f.tensors["blk.1.attn_q_norm.weight"].ggml_type == "F32"
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "x.gguf")]) == 1
    assert "config.json" in capsys.readouterr().err

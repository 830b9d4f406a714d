"""A plain numpy reference forward pass, deliberately independent of the fast path: it reads the config keys
itself, dequantizes every weight to float32 with gguf-py, computes in float64, keeps no cache and recomputes
every position with a dense masked softmax. Slow, but simple enough to check by eye against llama.cpp's
src/models/{llama,qwen2,qwen3,qwen3moe,smollm3,granite,olmo2,gemma2,gemma3,openai-moe}.cpp (experts: build_moe_ffn); the
tests compare the fast path with it.
"""

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

NEOX_ARCHITECTURES = ("qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "olmo2", "phi3")
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "smollm3", "granite", "phi3")
WINDOWED_LLAMA = ("llama", "mistral")  # the llama-likes whose attention.sliding_window is honoured
VOCAB_SLICE = 16384  # output rows cast to float64 at a time


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _yarn_freqs(freqs, extrap, base, n_rot, freq_scale, yarn):
    """YaRN (jquesnelle/yarn, as llama.cpp's rope_yarn): pairs below the correction dim of beta_fast rotations in
    the original context keep the extrapolated frequency, those past beta_slow's the interpolated one, a linear ramp
    between; cos and sin scaled by attn_factor * (1 + 0.1 ln(1 / freq_scale))."""
    def corr_dim(n_turns):
        return n_rot * np.log(yarn["n_ctx_orig"] / (n_turns * 2 * np.pi)) / (2 * np.log(base))
    low = max(0.0, np.floor(corr_dim(yarn["beta_fast"])))
    high = min(n_rot - 1.0, np.ceil(corr_dim(yarn["beta_slow"])))
    mix = (1 - np.clip((np.arange(n_rot // 2) - low) / max(0.001, high - low), 0, 1)) * yarn["ext_factor"]
    return freqs * (1 - mix) + extrap * mix, yarn["attn_factor"] * (1 + 0.1 * np.log(1 / freq_scale))


def _rope(x, positions, base, n_rot, neox, freq_scale=1.0, factors=None, yarn=None, attn_factor=1.0):
    """x: [T, H, hd] float64. Rotates pairs (i, i + n_rot/2) for NeoX, else (2i, 2i + 1). yarn: a dict of YaRN's
    parameters (n_ctx_orig, beta_fast, beta_slow, ext_factor, attn_factor), or None; attn_factor: a factor on cos
    and sin without YaRN (phi3's longrope)."""
    half = n_rot // 2
    extrap = 1.0 / base ** (np.arange(half) * 2.0 / n_rot)
    if factors is not None:
        extrap = extrap / factors
    freqs, mscale = freq_scale * extrap, attn_factor
    if yarn is not None:
        freqs, mscale = _yarn_freqs(freqs, extrap, base, n_rot, freq_scale, yarn)
    angle = positions[:, None] * freqs[None, :]  # [T, half]
    cos, sin = mscale * np.cos(angle)[:, None, :], mscale * np.sin(angle)[:, None, :]
    if neox:
        first, second = np.arange(half), np.arange(half) + half
    else:
        first, second = np.arange(0, n_rot, 2), np.arange(1, n_rot, 2)
    out = x.copy()
    out[..., first] = x[..., first] * cos - x[..., second] * sin
    out[..., second] = x[..., first] * sin + x[..., second] * cos
    return out


def _attention(q, k, v, scale, window=0, cap=0.0, sinks=None):
    """q: [T, H, hd], k, v: [T, H_kv, hd]; causal, optionally limited to the last `window` positions; scores
    soft-capped to cap * tanh(s / cap) first when cap > 0; sinks [H]: a logit per head in the softmax's sum only."""
    n_tokens, n_heads, _ = q.shape
    group = n_heads // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k)
    if cap > 0.0:
        scores = cap * np.tanh(scores / cap)
    scores = scores * scale
    distance = np.arange(n_tokens)[:, None] - np.arange(n_tokens)[None, :]
    allowed = (distance >= 0) & ((distance < window) if window > 0 else True)
    scores = np.where(allowed, scores, -np.inf)
    if sinks is not None:  # the sink as one more column of scores, whose value vector is zero
        scores = np.concatenate([scores, np.broadcast_to(sinks[:, None, None], (n_heads, n_tokens, 1))], axis=-1)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs[..., :n_tokens], v)


def _experts(m, router, gate, up, down, n_used, scale):
    """m [T, d]; router [E, d]; gate, up [E, n_ff, d]; down [E, d, n_ff]: each row's k most probable experts
    (softmax over all of them), weighted by their probabilities renormalised to sum 1."""
    z = m @ router.T
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out = np.zeros_like(m)
    for t in range(m.shape[0]):
        chosen = np.argsort(-p[t], kind="stable")[:n_used]
        w = p[t, chosen] / p[t, chosen].sum() * (scale if scale not in (0.0, 1.0) else 1.0)
        for e, we in zip(chosen, w):
            g = gate[e] @ m[t]
            out[t] += we * (down[e] @ (g / (1.0 + np.exp(-g)) * (up[e] @ m[t])))
    return out


def _gpt_oss_experts(m, W, B, n_used, alpha=1.702, limit=7.0):
    """gpt-oss's experts: m [T, d]; W(name), B(name) a layer's weights and biases. The k largest router logits,
    softmax over those k; each expert W_down (min(g, limit) sigmoid(alpha g) (clip(u, -limit, limit) + 1)) + b_down,
    g and u its biased gate and up."""
    z = m @ W("ffn_gate_inp").T + B("ffn_gate_inp")
    out = np.zeros_like(m)
    for t in range(m.shape[0]):
        chosen = np.argsort(-z[t], kind="stable")[:n_used]
        w = np.exp(z[t, chosen] - z[t, chosen].max())
        for e, we in zip(chosen, w / w.sum()):
            g = np.minimum(W("ffn_gate_exps")[e] @ m[t] + B("ffn_gate_exps")[e], limit)
            u = np.clip(W("ffn_up_exps")[e] @ m[t] + B("ffn_up_exps")[e], -limit, limit)
            out[t] += we * (W("ffn_down_exps")[e] @ (g / (1.0 + np.exp(-alpha * g)) * (u + 1.0)) + B("ffn_down_exps")[e])
    return out


class ReferenceModel:
    def __init__(self, gguf_file, n_ctx=None):
        """n_ctx: the context the fast path was built with, where the math depends on it (phi3's longrope)."""
        self.file = gguf_file
        self.n_ctx = n_ctx
        self.meta = gguf_file.metadata
        self.arch = self.meta["general.architecture"]
        self._cache = {}

    def key(self, suffix, default=None):
        value = self.meta.get(f"{self.arch}.{suffix}", default)
        if value is None:
            raise KeyError(f"{self.arch}.{suffix}")
        return value

    def has(self, name):
        return name in self.file.tensors

    def weight(self, name) -> np.ndarray:
        """Weights in numpy shape (n_out, n_in) or (n,): float64, except the vocabulary-sized matrices, kept in
        float32 (a 262k x 640 embedding would take 1.3 GB in float64)."""
        if name not in self._cache:
            t = self.file.tensors[name]
            raw = np.asarray(t.data)
            rows = raw.reshape(int(np.prod(t.shape[:-1])), -1) if len(t.shape) > 1 else raw
            w = gguf_dequantize(rows, GGMLQuantizationType[t.ggml_type]).reshape(t.shape)
            vocab_sized = name in ("token_embd.weight", "output.weight")
            self._cache[name] = w.astype(np.float32 if vocab_sized else np.float64)
        return self._cache[name]

    def _output(self, x):
        """x: [R, d] float64 -> logits [R, n_vocab], in float64 one vocabulary slice at a time."""
        tied = not self.has("output.weight") or self.arch == "gemma2"  # llama.cpp's gemma2 always reads token_embd
        w = self.weight("token_embd.weight" if tied else "output.weight")
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
        for start in range(0, w.shape[0], VOCAB_SLICE):
            out[:, start: start + VOCAB_SLICE] = x @ w[start: start + VOCAB_SLICE].astype(np.float64).T
        return out

    def logits(self, tokens, last_n=None) -> np.ndarray:
        """float32 [T, n_vocab] (or the last `last_n` rows) for tokens processed from position 0."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if self.arch in LLAMA_LIKE:
            x = self._llama_like(tokens)
        elif self.arch in ("gemma2", "gemma3"):
            x = self._gemma(tokens)
        elif self.arch == "olmo2":
            x = self._olmo2(tokens)
        elif self.arch == "gpt-oss":
            x = self._gpt_oss(tokens)
        else:
            raise NotImplementedError(self.arch)
        if last_n is not None:
            x = x[-last_n:]
        eps = self.key("attention.layer_norm_rms_epsilon")
        logits = self._output(_rms_norm(x, self.weight("output_norm.weight"), eps))
        if self.arch == "gemma2":
            cap = self.key("final_logit_softcapping")
            logits = (cap * np.tanh(logits.astype(np.float64) / cap)).astype(np.float32)
        if self.arch == "granite":
            logits = (logits.astype(np.float64) / self.key("logit_scale")).astype(np.float32)
        return logits

    def _yarn(self):
        """YaRN's parameters where the file asks for it (llama.cpp's defaults where it names none), else None."""
        if self.key("rope.scaling.type", "none") != "yarn":
            return None
        return dict(n_ctx_orig=self.key("rope.scaling.original_context_length", self.key("context_length")),
                    beta_fast=self.key("rope.scaling.yarn_beta_fast", 32.0),
                    beta_slow=self.key("rope.scaling.yarn_beta_slow", 1.0), ext_factor=1.0,
                    attn_factor=self.key("rope.scaling.attn_factor", 1.0))

    def _heads(self, tokens):
        n_head = self.key("attention.head_count")
        n_head_kv = self.key("attention.head_count_kv", n_head)
        head_dim = self.key("attention.key_length", self.key("embedding_length") // n_head)
        return n_head, n_head_kv, head_dim, len(tokens)

    def _llama_like(self, tokens):
        eps = self.key("attention.layer_norm_rms_epsilon")
        n_head, n_head_kv, hd, T = self._heads(tokens)
        n_rot = self.key("rope.dimension_count", hd)
        base = self.key("rope.freq_base", 10000.0)
        factor = self.meta.get(f"{self.arch}.rope.scaling.factor", 0.0) or 1.0
        factors = self.weight("rope_freqs.weight") if self.has("rope_freqs.weight") else None
        if factors is None and self.has("rope_factors_long.weight"):  # phi3's longrope: by the context length
            orig = self.key("rope.scaling.original_context_length", self.key("context_length"))
            long = self.n_ctx is not None and self.n_ctx > orig
            factors = self.weight("rope_factors_long.weight" if long else "rope_factors_short.weight")
        yarn = self._yarn()
        attn_factor = self.key("rope.scaling.attn_factor", 1.0)
        scale = self.meta.get(f"{self.arch}.attention.scale", 0.0) or 1.0 / np.sqrt(hd)
        neox = self.arch in NEOX_ARCHITECTURES
        window = self.meta.get(f"{self.arch}.attention.sliding_window", 0) if self.arch in WINDOWED_LLAMA else 0
        granite = self.arch == "granite"
        embd_scale = self.meta.get("granite.embedding_scale", 0.0) or 1.0 if granite else 1.0
        res_scale = self.meta.get("granite.residual_scale", 0.0) or 1.0 if granite else 1.0
        positions = np.arange(T, dtype=np.float64)
        x = self.weight("token_embd.weight")[tokens].astype(np.float64) * embd_scale
        for il in range(self.key("block_count")):
            nope = self.arch == "smollm3" and il % 4 == 3  # SmolLM3: no rope on every fourth layer
            W = lambda n: self.weight(f"blk.{il}.{n}.weight")  # noqa: E731
            n = _rms_norm(x, W("attn_norm"), eps)
            if self.has(f"blk.{il}.attn_qkv.weight"):  # phi3: Q, K, V stacked by rows
                q, k, v = np.split(n @ W("attn_qkv").T, [n_head * hd, (n_head + n_head_kv) * hd], axis=1)
            else:
                q, k, v = n @ W("attn_q").T, n @ W("attn_k").T, n @ W("attn_v").T
            if self.arch == "qwen2":
                q, k, v = (a + self.weight(f"blk.{il}.attn_{c}.bias") for a, c in ((q, "q"), (k, "k"), (v, "v")))
            q, k, v = q.reshape(T, n_head, hd), k.reshape(T, n_head_kv, hd), v.reshape(T, n_head_kv, hd)
            if self.arch in ("qwen3", "qwen3moe"):
                q, k = _rms_norm(q, W("attn_q_norm"), eps), _rms_norm(k, W("attn_k_norm"), eps)
            if not nope:
                q = _rope(q, positions, base, n_rot, neox, 1.0 / factor, factors, yarn, attn_factor)
                k = _rope(k, positions, base, n_rot, neox, 1.0 / factor, factors, yarn, attn_factor)
            h = x + res_scale * (_attention(q, k, v, scale, window).reshape(T, -1) @ W("attn_output").T)
            m = _rms_norm(h, W("ffn_norm"), eps)
            if self.has(f"blk.{il}.ffn_gate_inp.weight"):  # experts: softmax, top-k, renormalised weights
                x = h + _experts(m, W("ffn_gate_inp"), W("ffn_gate_exps"), W("ffn_up_exps"), W("ffn_down_exps"),
                                 self.key("expert_used_count"), self.key("expert_weights_scale", 0.0))
                continue
            if self.has(f"blk.{il}.ffn_gate.weight"):
                gate, up = m @ W("ffn_gate").T, m @ W("ffn_up").T
            else:  # phi3: ffn_up holds gate then up
                gate, up = np.split(m @ W("ffn_up").T, 2, axis=1)
            x = h + res_scale * ((gate / (1.0 + np.exp(-gate)) * up) @ W("ffn_down").T)
        return x

    def _olmo2(self, tokens):
        eps = self.key("attention.layer_norm_rms_epsilon")
        n_head, n_head_kv, hd, T = self._heads(tokens)
        base = self.key("rope.freq_base", 10000.0)
        factor = self.meta.get(f"{self.arch}.rope.scaling.factor", 0.0) or 1.0
        positions = np.arange(T, dtype=np.float64)
        x = self.weight("token_embd.weight")[tokens].astype(np.float64)
        for il in range(self.key("block_count")):
            W = lambda n: self.weight(f"blk.{il}.{n}.weight")  # noqa: E731
            q = _rms_norm(x @ W("attn_q").T, W("attn_q_norm"), eps).reshape(T, n_head, hd)  # whole projection
            k = _rms_norm(x @ W("attn_k").T, W("attn_k_norm"), eps).reshape(T, n_head_kv, hd)
            v = (x @ W("attn_v").T).reshape(T, n_head_kv, hd)
            q, k = _rope(q, positions, base, hd, True, 1.0 / factor), _rope(k, positions, base, hd, True, 1.0 / factor)
            a = _attention(q, k, v, 1.0 / np.sqrt(hd)).reshape(T, -1) @ W("attn_output").T
            h = x + _rms_norm(a, W("post_attention_norm"), eps)
            g = h @ W("ffn_gate").T
            x = h + _rms_norm((g / (1.0 + np.exp(-g)) * (h @ W("ffn_up").T)) @ W("ffn_down").T, W("post_ffw_norm"), eps)
        return x

    def _gemma(self, tokens):
        """Gemma 3, or Gemma 2: no QK norms, capped scores, pattern 2, the file's rope (base and scaling) on every
        layer unless rope.freq_base_swa gives the window layers another base."""
        eps = self.key("attention.layer_norm_rms_epsilon")
        n_head, n_head_kv, hd, T = self._heads(tokens)
        n_embd, n_layer = self.key("embedding_length"), self.key("block_count")
        gemma2 = self.arch == "gemma2"
        window = self.key("attention.sliding_window")
        period = self.meta.get(f"{self.arch}.attention.sliding_window_pattern", 2 if gemma2 else 6)
        factor = self.meta.get(f"{self.arch}.rope.scaling.factor", 0.0) or 1.0
        scale = 1.0 / np.sqrt(n_embd // n_head if n_layer == (46 if gemma2 else 62) else hd)
        cap = self.key("attn_logit_softcapping") if gemma2 else 0.0
        local_base = self.key("rope.freq_base_swa", self.key("rope.freq_base") if gemma2 else 10000.0)
        positions = np.arange(T, dtype=np.float64)
        x = self.weight("token_embd.weight")[tokens].astype(np.float64) * np.sqrt(np.float32(n_embd))
        for il in range(n_layer):
            W = lambda n: self.weight(f"blk.{il}.{n}.weight")  # noqa: E731
            is_global = il % period == period - 1
            base = self.key("rope.freq_base") if is_global else local_base
            freq_scale = 1.0 / factor if is_global or gemma2 else 1.0
            n = _rms_norm(x, W("attn_norm"), eps)
            q = (n @ W("attn_q").T).reshape(T, n_head, hd)
            k = (n @ W("attn_k").T).reshape(T, n_head_kv, hd)
            if not gemma2:
                q, k = _rms_norm(q, W("attn_q_norm"), eps), _rms_norm(k, W("attn_k_norm"), eps)
            v = (n @ W("attn_v").T).reshape(T, n_head_kv, hd)
            q, k = _rope(q, positions, base, hd, True, freq_scale), _rope(k, positions, base, hd, True, freq_scale)
            a = _attention(q * scale, k, v, 1.0, 0 if is_global else window, cap).reshape(T, -1) @ W("attn_output").T
            h = x + _rms_norm(a, W("post_attention_norm"), eps)
            m = _rms_norm(h, W("ffn_norm"), eps)
            g = m @ W("ffn_gate").T
            gelu = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))
            f = (gelu * (m @ W("ffn_up").T)) @ W("ffn_down").T
            x = h + _rms_norm(f, W("post_ffw_norm"), eps)
        return x

    def _gpt_oss(self, tokens):
        """Biased q/k/v/o, a sink per head, window layers where il % period < period - 1 (period 2 unless the file
        says), NeoX rope with the file's scaling on both kinds; the norm before the experts is post_attention_norm."""
        eps = self.key("attention.layer_norm_rms_epsilon")
        n_head, n_head_kv, hd, T = self._heads(tokens)
        n_rot = self.key("rope.dimension_count", hd)
        base = self.key("rope.freq_base", 10000.0)
        factor = self.meta.get(f"{self.arch}.rope.scaling.factor", 0.0) or 1.0
        window, period = self.key("attention.sliding_window"), self.key("attention.sliding_window_pattern", 2)
        yarn, attn_factor = self._yarn(), self.key("rope.scaling.attn_factor", 1.0)
        positions = np.arange(T, dtype=np.float64)
        x = self.weight("token_embd.weight")[tokens].astype(np.float64)
        for il in range(self.key("block_count")):
            W = lambda n: self.weight(f"blk.{il}.{n}.weight")  # noqa: E731
            B = lambda n: self.weight(f"blk.{il}.{n}.bias")  # noqa: E731
            sliding = il % period < period - 1
            layer_base = self.key("rope.freq_base_swa", base) if sliding else base
            n = _rms_norm(x, W("attn_norm"), eps)
            q = (n @ W("attn_q").T + B("attn_q")).reshape(T, n_head, hd)
            k = (n @ W("attn_k").T + B("attn_k")).reshape(T, n_head_kv, hd)
            v = (n @ W("attn_v").T + B("attn_v")).reshape(T, n_head_kv, hd)
            q = _rope(q, positions, layer_base, n_rot, True, 1.0 / factor, None, yarn, attn_factor)
            k = _rope(k, positions, layer_base, n_rot, True, 1.0 / factor, None, yarn, attn_factor)
            a = _attention(q, k, v, 1.0 / np.sqrt(n_rot), window if sliding else 0, sinks=W("attn_sinks"))
            h = x + a.reshape(T, -1) @ W("attn_output").T + B("attn_output")
            x = h + _gpt_oss_experts(_rms_norm(h, W("post_attention_norm"), eps), W, B,
                                     self.key("expert_used_count"))
        return x

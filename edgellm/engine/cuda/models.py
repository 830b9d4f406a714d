"""Decoder models on the GPU: the same forward passes as edgellm/engine/models/llama.py (and the llama-like qwen2,
qwen3, smollm3, granite), olmo2.py and gemma3.py, with every
weight, activation and the KV cache in device memory. Per batch the token ids and positions go up and the
requested logits come back; nothing else crosses the bus.

The configs and tensor lists are the CPU modules' own (one reading of the GGUF keys); the forward passes are
repeated here op for op so each still reads top to bottom. The DecoderModel base gives the shared interface:
forward(tokens, all_logits), reset(), n_past, n_vocab, n_ctx.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
from numba import cuda

from edgellm.engine import ops as cpu_ops
from edgellm.engine.cuda import weights as dev
from edgellm.engine.cuda.device import simulator_enabled
from edgellm.engine.cuda.kvcache import DeviceKVCache, kv_cache_nbytes
from edgellm.engine.cuda.op_kernels import ACT_GELU_TANH, ACT_SILU, MAX_HEAD_DIM
from edgellm.errors import MemoryBudgetError, ModelError
from edgellm.quant.formats import format_by_name
from edgellm.engine.models import gemma2 as cpu_gemma2
from edgellm.engine.models import gemma3 as cpu_gemma3
from edgellm.engine.models import llama as cpu_llama
from edgellm.engine.models import olmo2 as cpu_olmo2
from edgellm.engine.models import phi3 as cpu_phi3
from edgellm.engine.models.base import DEFAULT_N_BATCH, DecoderModel
from edgellm.engine.models.loading import VECTOR_TYPES, layer_weights

# ----------------------------------------------------------------------------------------------------------------
# Loading


def check_tensor(tensor, spec) -> None:
    shape = tuple(int(s) for s in tensor.shape)
    if shape != spec.shape:
        raise ModelError(f"tensor {spec.name!r} has shape {shape}, expected {spec.shape} from the model config")
    if not spec.is_matrix and tensor.ggml_type not in VECTOR_TYPES:
        raise ModelError(f"tensor {spec.name!r} has type {tensor.ggml_type}; expected one of {VECTOR_TYPES}")


def check_device_memory(needed: int) -> None:
    """MemoryBudgetError when the GPU's free memory cannot hold `needed` bytes (skipped in the simulator)."""
    if simulator_enabled():
        return
    free, total = cuda.current_context().get_memory_info()
    if needed > free:
        raise MemoryBudgetError(f"the model needs {needed / 2**20:.0f} MiB of GPU memory (weights, KV cache, "
                                f"activations) but only {free / 2**20:.0f} of {total / 2**20:.0f} MiB are free; "
                                "lower n_ctx or use the CPU")


def upload_tensors(gguf_file, specs) -> dict:
    """Check every spec, then upload: name -> DeviceMatrix (matrix), float32 device array (vector), None (absent)."""
    tensors = gguf_file.tensors
    for spec in specs:
        if spec.name in tensors:
            check_tensor(tensors[spec.name], spec)
        elif not spec.optional:
            raise ModelError(f"GGUF file lacks tensor {spec.name!r}")
    loaded = {}
    for spec in specs:
        tensor = tensors.get(spec.name)
        if tensor is None:
            loaded[spec.name] = None
        elif spec.is_matrix:
            loaded[spec.name] = dev.DeviceMatrix(tensor.data, tensor.ggml_type, spec.shape, spec.name)
        else:
            loaded[spec.name] = dev.upload_vector(tensor)
    return loaded


def weights_nbytes(gguf_file, specs) -> int:
    return sum(int(gguf_file.tensors[s.name].data.nbytes) for s in specs if s.name in gguf_file.tensors)


# ----------------------------------------------------------------------------------------------------------------
# Activations on the device


class DeviceBuffers:
    """Device activations for up to n_batch tokens: name -> [n_batch, *tail]. for_tokens(T) gives views of the
    first T rows (plus `*_flat` views [T, H*hd] of the per-head ones), cached for the decode and full sizes."""

    def __init__(self, n_batch: int, **tails):
        self.n_batch = n_batch
        self._arrays = {name: cuda.device_array((n_batch, *tail), dtype=np.float32) for name, tail in tails.items()}
        self._views = {}

    def for_tokens(self, n: int) -> SimpleNamespace:
        views = self._views.get(n)
        if views is None:
            views = SimpleNamespace()
            for name, array in self._arrays.items():
                rows = array[:n]
                setattr(views, name, rows)
                if rows.ndim == 3:
                    setattr(views, name + "_flat", rows.reshape(n, rows.shape[1] * rows.shape[2]))
            if n in (1, self.n_batch):
                self._views[n] = views
        return views


class CudaDecoderModel(DecoderModel):
    """What every architecture shares on the device: uploading, the embeddings, output and layers' weights, the
    token/position upload, the logits head."""

    SUPPORTS_MULTI = False  # batched decoding (forward_multi) is CPU-only for now

    def __init__(self, gguf_file, config, n_ctx: int, n_batch: int, specs):
        super().__init__(config, n_ctx, 1, n_batch, kv_type="f32")
        self.context_shift = False  # DeviceKVCache cannot shift yet: a full context raises ModelError
        if config.head_dim > MAX_HEAD_DIM:
            raise ModelError(f"head size {config.head_dim} exceeds the CUDA attention kernel's {MAX_HEAD_DIM}")
        windows = config.layer_windows()
        kv_bytes = kv_cache_nbytes(self.n_ctx, config.n_head_kv, config.head_dim, windows, self.n_batch)
        check_device_memory(weights_nbytes(gguf_file, specs) + kv_bytes + self.activation_nbytes())
        self.weights = upload_tensors(gguf_file, specs)
        self.cache = DeviceKVCache(self.n_ctx, config.n_head_kv, config.head_dim, windows, self.n_batch)
        self._ids = cuda.device_array(self.n_batch, dtype=np.int32)
        self._positions = cuda.device_array(self.n_batch, dtype=np.int32)
        self._logits = cuda.device_array((1, self.n_vocab), dtype=np.float32)  # grown when more rows are asked
        w = self.weights
        self.token_embd = w["token_embd.weight"]
        self.output_norm = w["output_norm.weight"]
        output = w.get("output.weight")
        self.output = self.token_embd if output is None else output  # tied if absent
        self.layers = [layer_weights(w, il) for il in range(config.n_layer)]
        self.unit_norm = cuda.to_device(np.ones(config.head_dim, dtype=np.float32))  # stands in when no qk norm

    @staticmethod
    def row_kinds(offsets, n):
        """The GPU kernels' arithmetic is not mapped row by row: a row's code is its batch's shape and its place in
        it, so only rows of an identically split prompt are reused."""
        return (np.asarray(offsets, np.int64) << 32) | n

    def layer_buffers(self) -> DeviceBuffers:
        """The activations every architecture here uses: the residual, a normed copy, q, k, v, attention, gate, up."""
        c = self.config
        return DeviceBuffers(self.n_batch, x=(c.n_embd,), xn=(c.n_embd,), q=(c.n_head, c.head_dim),
                             k=(c.n_head_kv, c.head_dim), v=(c.n_head_kv, c.head_dim), attn=(c.n_head, c.head_dim),
                             gate=(c.n_ff,), up=(c.n_ff,))

    def activation_nbytes(self) -> int:
        c = self.config
        per_token = 2 * c.n_embd + 2 * c.n_head * c.head_dim + 2 * c.n_head_kv * c.head_dim + 2 * c.n_ff
        return 4 * (self.n_batch * per_token + self.n_vocab)

    def start_batch(self, tokens, positions):
        """The batch's activation views, its token ids and positions uploaded, and the context's end after it."""
        ids, pos = self.upload_batch(tokens, positions)
        return self.buffers.for_tokens(len(tokens)), ids, pos, int(positions[-1]) + 1

    def upload_batch(self, tokens, positions):
        n = len(tokens)
        ids, pos = self._ids[:n], self._positions[:n]
        ids.copy_to_device(np.ascontiguousarray(tokens, dtype=np.int32))
        pos.copy_to_device(np.ascontiguousarray(positions, dtype=np.int32))
        self.cache.record(np.asarray(positions))
        return ids, pos

    def logits_head(self, x, normed, logits_out):
        """logits_out (host) <- output · rmsnorm(last rows of x) · output_norm; normed: device scratch [>= n, d]."""
        n = logits_out.shape[0]
        if self._logits.shape[0] < n:
            self._logits = cuda.device_array((n, self.n_vocab), dtype=np.float32)
        rows, normed, logits = x[x.shape[0] - n:], normed[:n], self._logits[:n]
        dev.rms_norm(rows, self.output_norm, self.config.norm_eps, normed)
        self.output.matmul(normed, logits)
        logits.copy_to_host(logits_out)


# ----------------------------------------------------------------------------------------------------------------
# Llama family (llama, mistral, qwen2, qwen3; smollm3's rope-less layers; granite's multipliers): see
# edgellm/engine/models/llama.py, smollm3.py and granite.py for the math


class CudaLlamaModel(CudaDecoderModel):
    TENSOR_SPECS = staticmethod(cpu_llama.tensor_specs)

    def __init__(self, gguf_file, config, n_ctx: int, n_batch: int = DEFAULT_N_BATCH):
        super().__init__(gguf_file, config, n_ctx, n_batch, self.TENSOR_SPECS(config))
        factors = self.weights["rope_freqs.weight"]  # llama3 per-pair frequency factors, when present
        factors = None if factors is None else factors.copy_to_host()
        inv_freq = cuda.to_device(cpu_ops.rope_inv_freq(config.n_rot, config.rope_base, config.rope_freq_scale,
                                                        factors))
        # smollm3's rope-less layers rotate by angle 0 (cos 1, sin 0), which leaves q and k as they are
        no_rope = cuda.to_device(np.zeros(config.n_rot // 2, np.float64))
        uses_rope = getattr(config, "uses_rope", lambda il: True)
        self.layer_inv_freq = [inv_freq if uses_rope(il) else no_rope for il in range(config.n_layer)]
        self.rope_mscale = float(cpu_ops.rope_mscale_ref(config.rope_freq_scale, config.rope_scaling))
        # granite's multipliers (0: none, as llama.cpp)
        self.embd_scale = float(getattr(config, "embedding_scale", 0.0) or 1.0)
        self.residual_scale = float(getattr(config, "residual_scale", 0.0))
        logit_scale = getattr(config, "logit_scale", 0.0)
        self.logit_mul = np.float32(1.0) / np.float32(logit_scale) if logit_scale else None
        self.buffers = self.layer_buffers()

    def _residual(self, matrix, x_in, s):
        """x += W x_in, or x += residual_scale * (W x_in) where the model has the multiplier."""
        if self.residual_scale:
            matrix.matmul(x_in, s.xn)
            dev.add_scaled(s.x, s.xn, self.residual_scale)
        else:
            matrix.matmul(x_in, s.x, accumulate=True)

    def forward_batch(self, tokens, positions, logits_out):
        cfg, eps = self.config, self.config.norm_eps
        s, ids, pos, end_pos = self.start_batch(tokens, positions)
        self.token_embd.get_rows(ids, s.x, scale=self.embd_scale)
        for layer, kv, inv_freq in zip(self.layers, self.cache.layers, self.layer_inv_freq):
            # attention block
            dev.rms_norm(s.x, layer.attn_norm, eps, s.xn)
            layer.attn_q.matmul(s.xn, s.q_flat)
            layer.attn_k.matmul(s.xn, s.k_flat)
            layer.attn_v.matmul(s.xn, s.v_flat)
            if cfg.qkv_bias:
                dev.add_bias(s.q_flat, layer.attn_q_bias)
                dev.add_bias(s.k_flat, layer.attn_k_bias)
                dev.add_bias(s.v_flat, layer.attn_v_bias)
            q_norm = layer.attn_q_norm if cfg.qk_norm else self.unit_norm
            k_norm = layer.attn_k_norm if cfg.qk_norm else self.unit_norm
            dev.qk_norm_rope_store(s.q, s.k, s.v, pos, inv_freq, cfg.rope_neox, q_norm, k_norm, cfg.qk_norm,
                                   eps, kv, self.rope_mscale)
            dev.attention(s.q, kv, min(kv.slot_pos.shape[0], end_pos), pos, cfg.attn_scale * cfg.q_scale, s.attn)
            self._residual(layer.attn_output, s.attn_flat, s)
            # feed-forward block
            dev.rms_norm(s.x, layer.ffn_norm, eps, s.xn)
            layer.ffn_gate.matmul(s.xn, s.gate)
            layer.ffn_up.matmul(s.xn, s.up)
            dev.gated_activation(s.gate, s.up, ACT_SILU)
            self._residual(layer.ffn_down, s.gate, s)
        if logits_out is not None:
            self.logits_head(s.x, s.xn, logits_out)
            if self.logit_mul is not None:
                logits_out *= self.logit_mul


class CudaPhi3Model(CudaLlamaModel):
    """Phi-3: the llama pass on q, k, v and gate, up split out of the fused matrices by rows (gate first), rope with
    longrope's factors for this context and its attn_factor on cos and sin; see edgellm/engine/models/phi3.py."""
    TENSOR_SPECS = staticmethod(cpu_phi3.tensor_specs)

    def __init__(self, gguf_file, config, n_ctx: int, n_batch: int = DEFAULT_N_BATCH):
        super().__init__(gguf_file, config, n_ctx, n_batch)
        q_dim, kv_dim = config.n_head * config.head_dim, config.n_head_kv * config.head_dim
        for il, layer in enumerate(self.layers):
            if config.fused_qkv:
                layer.attn_q, layer.attn_k, layer.attn_v = split_rows(
                    gguf_file.tensors[f"blk.{il}.attn_qkv.weight"], (q_dim, kv_dim, kv_dim))
                layer.attn_qkv = self.weights[f"blk.{il}.attn_qkv.weight"] = None  # the fused copy is freed
            layer.ffn_gate, layer.ffn_up = split_rows(gguf_file.tensors[f"blk.{il}.ffn_up.weight"],
                                                      (config.n_ff, config.n_ff))
            self.weights[f"blk.{il}.ffn_up.weight"] = None
        factors = cpu_phi3.longrope_factors(gguf_file, config, self.n_ctx)
        if factors is not None:
            inv_freq = cuda.to_device(cpu_ops.rope_inv_freq(config.n_rot, config.rope_base, config.rope_freq_scale,
                                                            factors))
            self.layer_inv_freq = [inv_freq] * config.n_layer


def split_rows(tensor, counts) -> list:
    """Device matrices of consecutive row ranges of a fused GGUF matrix, uploaded from the file's bytes."""
    n_in = tensor.shape[1]
    row_bytes = format_by_name(tensor.ggml_type).row_bytes(n_in)
    parts, r = [], 0
    for n in counts:
        parts.append(dev.DeviceMatrix(tensor.data[r * row_bytes:(r + n) * row_bytes], tensor.ggml_type, (n, n_in),
                                      tensor.name))
        r += n
    return parts


# ----------------------------------------------------------------------------------------------------------------
# OLMo 2: see edgellm/engine/models/olmo2.py for the math


class CudaOlmo2Model(CudaDecoderModel):
    def __init__(self, gguf_file, config, n_ctx: int, n_batch: int = DEFAULT_N_BATCH):
        super().__init__(gguf_file, config, n_ctx, n_batch, cpu_olmo2.tensor_specs(config))
        self.inv_freq = cuda.to_device(cpu_ops.rope_inv_freq(config.n_rot, config.rope_base, config.rope_freq_scale))
        self.rope_mscale = float(cpu_ops.rope_mscale_ref(config.rope_freq_scale, config.rope_scaling))
        self.buffers = self.layer_buffers()

    def forward_batch(self, tokens, positions, logits_out):
        cfg, eps = self.config, self.config.norm_eps
        s, ids, pos, end_pos = self.start_batch(tokens, positions)
        self.token_embd.get_rows(ids, s.x)
        for layer, kv in zip(self.layers, self.cache.layers):
            # attention block: no norm before it; q and k normed over their whole projections, then roped
            layer.attn_q.matmul(s.x, s.q_flat)
            layer.attn_k.matmul(s.x, s.k_flat)
            layer.attn_v.matmul(s.x, s.v_flat)
            dev.rms_norm(s.q_flat, layer.attn_q_norm, eps, s.q_flat)
            dev.rms_norm(s.k_flat, layer.attn_k_norm, eps, s.k_flat)
            dev.qk_norm_rope_store(s.q, s.k, s.v, pos, self.inv_freq, cfg.rope_neox, self.unit_norm, self.unit_norm,
                                   False, eps, kv, self.rope_mscale)
            dev.attention(s.q, kv, min(kv.slot_pos.shape[0], end_pos), pos, cfg.attn_scale * cfg.q_scale, s.attn)
            layer.attn_output.matmul(s.attn_flat, s.xn)
            dev.rms_norm(s.xn, layer.post_attention_norm, eps, s.x, accumulate=True)
            # feed-forward block: no norm before it either, a norm after
            layer.ffn_gate.matmul(s.x, s.gate)
            layer.ffn_up.matmul(s.x, s.up)
            dev.gated_activation(s.gate, s.up, ACT_SILU)
            layer.ffn_down.matmul(s.gate, s.xn)
            dev.rms_norm(s.xn, layer.post_ffw_norm, eps, s.x, accumulate=True)
        if logits_out is not None:
            self.logits_head(s.x, s.xn, logits_out)


# ----------------------------------------------------------------------------------------------------------------
# Gemma 3, and Gemma 2 (no QK norms, capped scores and logits): see edgellm/engine/models/gemma3.py and gemma2.py


class CudaGemma3Model(CudaDecoderModel):
    TENSOR_SPECS = staticmethod(cpu_gemma3.tensor_specs)
    LOCAL_ROPE_SCALED = True  # the sliding layers' rope takes the file's rope scaling (its attn_factor) too

    def __init__(self, gguf_file, config, n_ctx: int, n_batch: int = DEFAULT_N_BATCH):
        super().__init__(gguf_file, config, n_ctx, n_batch, self.TENSOR_SPECS(config))
        self.rope_mscale = float(cpu_ops.rope_mscale_ref(config.rope_freq_scale, config.rope_scaling))
        self.local_mscale = float(cpu_ops.rope_mscale_ref(1.0, config.rope_scaling)) if self.LOCAL_ROPE_SCALED else 1.0
        self.attn_softcap = float(getattr(config, "attn_softcap", 0.0))
        self.final_softcap = float(getattr(config, "final_softcap", 0.0))
        self.inv_freq_local = cuda.to_device(cpu_ops.rope_inv_freq(config.n_rot, config.rope_base_local))
        self.inv_freq_global = cuda.to_device(cpu_ops.rope_inv_freq(config.n_rot, config.rope_base,
                                                                    config.rope_freq_scale))
        self.embd_scale = np.float32(math.sqrt(config.n_embd))
        self.buffers = self.layer_buffers()

    def forward_batch(self, tokens, positions, logits_out):
        cfg, eps = self.config, self.config.norm_eps
        s, ids, pos, end_pos = self.start_batch(tokens, positions)
        self.token_embd.get_rows(ids, s.x, scale=self.embd_scale)
        for layer, kv in zip(self.layers, self.cache.layers):
            inv_freq = self.inv_freq_local if kv.window else self.inv_freq_global
            # attention block
            dev.rms_norm(s.x, layer.attn_norm, eps, s.xn)
            layer.attn_q.matmul(s.xn, s.q_flat)
            layer.attn_k.matmul(s.xn, s.k_flat)
            layer.attn_v.matmul(s.xn, s.v_flat)
            qk_norm = getattr(layer, "attn_q_norm", None) is not None
            q_norm, k_norm = (layer.attn_q_norm, layer.attn_k_norm) if qk_norm else (self.unit_norm, self.unit_norm)
            mscale = self.local_mscale if kv.window else self.rope_mscale
            dev.qk_norm_rope_store(s.q, s.k, s.v, pos, inv_freq, cfg.rope_neox, q_norm, k_norm, qk_norm, eps, kv,
                                   mscale)
            dev.attention(s.q, kv, min(kv.slot_pos.shape[0], end_pos), pos, cfg.attn_scale * cfg.q_scale, s.attn,
                          self.attn_softcap)
            layer.attn_output.matmul(s.attn_flat, s.xn)
            dev.rms_norm(s.xn, layer.post_attention_norm, eps, s.x, accumulate=True)
            # feed-forward block
            dev.rms_norm(s.x, layer.ffn_norm, eps, s.xn)
            layer.ffn_gate.matmul(s.xn, s.gate)
            layer.ffn_up.matmul(s.xn, s.up)
            dev.gated_activation(s.gate, s.up, ACT_GELU_TANH)
            layer.ffn_down.matmul(s.gate, s.xn)
            dev.rms_norm(s.xn, layer.post_ffw_norm, eps, s.x, accumulate=True)
        if logits_out is not None:
            self.logits_head(s.x, s.xn, logits_out)
            if self.final_softcap:
                cpu_ops.softcap(logits_out, self.final_softcap)


class CudaGemma2Model(CudaGemma3Model):
    TENSOR_SPECS = staticmethod(cpu_gemma2.tensor_specs)
    LOCAL_ROPE_SCALED = False


# Architecture (after the CPU registry's aliases) -> device model class.
CUDA_MODELS = {"llama": CudaLlamaModel, "qwen2": CudaLlamaModel, "qwen3": CudaLlamaModel, "smollm3": CudaLlamaModel,
               "granite": CudaLlamaModel, "olmo2": CudaOlmo2Model, "phi3": CudaPhi3Model, "gemma2": CudaGemma2Model,
               "gemma3": CudaGemma3Model}

"""Mixture-of-experts feed-forward, as llama.cpp's build_moe_ffn computes it with softmax gating (qwen3moe, and
llama files with experts: Mixtral):

    p = softmax(W_router · m)                        over all experts, float32 (the router is an F32 matrix)
    e_1..e_k = the k largest p, in descending order  w_i = p[e_i] / sum_j p[e_j]   (renormalised; Mixtral's
                                                     softmax over the top-k logits is the same value)
    y = (w_1 · f_1(m) + w_2 · f_2(m)) + ...          f_e(m) = W_down[e] · (silu(W_gate[e] m) * W_up[e] m)

gpt-oss (gating top_k_softmax): the router and every expert product have a bias, the k largest logits are chosen
first and softmax runs over those k alone, and f_e uses its clamped SwiGLU (ops.swiglu_oai).

Experts are 3-D tensors [n_expert, n_out, n_in] in the map; each expert is a linear map over its slice, with no
copy. A batch is grouped by expert (llama.cpp's mul_mat_id): each chosen expert's weights are read once for all
the rows routed to it, and an expert no row picks is never touched, so the pages that stay resident follow the
experts in use.

Sections: config keys; routing (kernel and reference); expert matrices; the feed-forward block.
"""

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from edgellm.engine import ops
from edgellm.engine.models import linear
from edgellm.errors import ModelError
from edgellm.quant import QuantLinear

# ----------------------------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class ExpertConfig:
    n_expert: int  # expert_count; 0: a dense feed-forward
    n_used: int  # expert_used_count: experts per token (top-k)
    n_ff: int  # rows of each expert's gate and up (expert_feed_forward_length, default feed_forward_length)
    weights_scale: float  # expert_weights_scale: a factor on the routing weights (0 or 1: none)
    gating: str = "softmax"  # softmax: over all experts, then top-k renormalised; top_k_softmax: over the top-k
    activation: str = "silu"  # silu: SwiGLU; swiglu_oai: gpt-oss's clamped SwiGLU (ops.swiglu_oai)


DENSE = ExpertConfig(0, 0, 0, 0.0)


def read_expert_keys(keys, n_ff: int, required: bool = False) -> ExpertConfig:
    """{arch}.expert_count and friends; DENSE when the file has no experts (required: refuse that)."""
    n_expert = keys("expert_count", default=0)
    if n_expert == 0:
        if required:
            raise ModelError(f"{keys.arch}.expert_count is missing or 0; a mixture-of-experts needs experts")
        return DENSE
    n_used = keys("expert_used_count", default=0)
    if not 0 < n_used <= n_expert:
        raise ModelError(f"{keys.arch}.expert_used_count {n_used} must be between 1 and expert_count {n_expert}")
    if keys("expert_gating_func", default=1) != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelError(f"{keys.arch}.expert_gating_func {keys('expert_gating_func')} is not supported (softmax "
                         "gating only)")
    if keys("expert_shared_count", default=0):
        raise ModelError(f"{keys.arch}.expert_shared_count: shared experts are not supported")
    return ExpertConfig(n_expert, n_used, keys("expert_feed_forward_length", default=n_ff),
                        keys("expert_weights_scale", float, default=0.0))


# ----------------------------------------------------------------------------------------------------------------
# Routing: softmax over the experts' logits, top-k, renormalised weights, in llama.cpp's float32 steps

WEIGHTS_SUM_MIN = np.float32(6.103515625e-5)  # llama.cpp clamps the weights' sum to the smallest normal float16


@njit(cache=True, inline="always")
def _top_k(p, n_used, ids):
    """ids[:n_used] = the indices of p's n_used largest values, in descending order (ties: the lower index)."""
    for j in range(n_used):
        best = -1
        for i in range(p.shape[0]):
            taken = False
            for jj in range(j):
                if ids[jj] == i:
                    taken = True
            if not taken and (best < 0 or p[i] > p[best]):
                best = i
        ids[j] = best


@njit(cache=True, error_model="numpy")
def route(logits, n_used, scale, ids, weights):
    """logits [T, E] (overwritten with the probabilities); ids [T, k] int32, weights [T, k] float32 out.

    Softmax as ggml's soft_max: the max, exp(x - max) eight lanes at a time (each 8-lane sum in float32, the
    sums in float64), the rest with libm's expf, then a multiply by float32(1 / sum). Top-k in descending order
    (ties: the lower index). The weights' sum in float64 (ggml_vec_sum_f32), clamped, one float32 division each;
    then scale when it is neither 0 nor 1."""
    n_rows, n_expert = logits.shape
    for t in range(n_rows):
        p = logits[t]
        top = p[0]
        for i in range(1, n_expert):
            if p[i] > top:
                top = p[i]
        total = 0.0
        i = 0
        while i + 8 <= n_expert:
            e0, e1, e2, e3 = (ops.fast_exp(p[i] - top), ops.fast_exp(p[i + 1] - top), ops.fast_exp(p[i + 2] - top),
                              ops.fast_exp(p[i + 3] - top))
            e4, e5, e6, e7 = (ops.fast_exp(p[i + 4] - top), ops.fast_exp(p[i + 5] - top),
                              ops.fast_exp(p[i + 6] - top), ops.fast_exp(p[i + 7] - top))
            p[i], p[i + 1], p[i + 2], p[i + 3], p[i + 4], p[i + 5], p[i + 6], p[i + 7] = e0, e1, e2, e3, e4, e5, e6, e7
            total += np.float64(((e0 + e4) + (e2 + e6)) + ((e1 + e5) + (e3 + e7)))
            i += 8
        while i < n_expert:
            e = np.float32(math.exp(np.float32(p[i] - top)))
            p[i] = e
            total += np.float64(e)
            i += 1
        inv = np.float32(1.0 / total)
        for i in range(n_expert):
            p[i] = p[i] * inv
        _top_k(p, n_used, ids[t])
        wsum = 0.0
        for j in range(n_used):
            weights[t, j] = p[ids[t, j]]
            wsum += np.float64(p[ids[t, j]])
        s = max(np.float32(wsum), WEIGHTS_SUM_MIN)
        for j in range(n_used):
            weights[t, j] = weights[t, j] / s
            if scale != 0.0 and scale != 1.0:
                weights[t, j] = weights[t, j] * np.float32(scale)


@njit(cache=True, error_model="numpy")
def route_top_k_softmax(logits, n_used, ids, weights):
    """gpt-oss's gating (llama.cpp's SOFTMAX_WEIGHT): logits [T, E]; ids [T, k] int32, weights [T, k] float32 out.
    The k largest logits in descending order (ties: the lower index), then soft_max over those k alone: the max,
    libm's expf of each difference (k is below a vector's width), a float64 sum, a multiply by float32(1 / sum)."""
    n_rows, n_expert = logits.shape
    for t in range(n_rows):
        p = logits[t]
        _top_k(p, n_used, ids[t])
        top = p[ids[t, 0]]
        for j in range(1, n_used):
            top = max(top, p[ids[t, j]])
        total = 0.0
        for j in range(n_used):
            e = np.float32(math.exp(np.float32(p[ids[t, j]] - top)))
            weights[t, j] = e
            total += np.float64(e)
        inv = np.float32(1.0 / total)
        for j in range(n_used):
            weights[t, j] = weights[t, j] * inv


def route_top_k_softmax_ref(logits, n_used):
    """float64: (ids [T, k], weights [T, k]) of top-k over the logits, then softmax over the chosen k."""
    z = np.asarray(logits, np.float64)
    ids = np.argsort(-z, axis=1, kind="stable")[:, :n_used]
    w = np.exp(np.take_along_axis(z, ids, 1) - z.max(axis=1, keepdims=True))
    return ids, w / w.sum(axis=1, keepdims=True)


def route_ref(logits, n_used, scale=0.0):
    """float64: (ids [T, k], weights [T, k]) of softmax, top-k and renormalisation."""
    z = np.asarray(logits, np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :n_used]
    w = np.take_along_axis(p, ids, 1)
    w /= w.sum(axis=1, keepdims=True)
    return ids, w * (scale if scale not in (0.0, 1.0) else 1.0)


# ----------------------------------------------------------------------------------------------------------------
# Expert matrices

# Where llama.cpp's mul_mat_id multiplies every routed row alone, whatever the number of rows an expert gets: the
# formats it repacks on AVX2 when the rows come in eights (a one-row gemv per row), and F32 (ggml_vec_dot_f32 per
# row; mul_mat_id has no sgemm path). Other formats' rows take the arithmetic of a batch of the expert's rows
# (vec_dot, or the tiled K-quant matmul from 8 rows).
REPACKED_ONE_ROW = frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"})
_NO_OUTPUT = np.zeros((0, 0), np.float32)  # matmul_chosen's second output when there is one stack


class ExpertMatrices:
    """A [n_expert, n_out, n_in] tensor as n_expert linear maps over its slices (no copy)."""

    def __init__(self, tensor):
        if len(tensor.shape) != 3:
            raise ModelError(f"tensor {tensor.name!r} has shape {tensor.shape}; experts need 3 dimensions")
        self.n_expert, self.n_out, self.n_in = (int(n) for n in tensor.shape)
        self.ggml_type = tensor.ggml_type
        per_expert = np.asarray(tensor.data).reshape(self.n_expert, -1)
        self.experts = [linear.LINEAR_CLASS(per_expert[e], tensor.ggml_type, (self.n_out, self.n_in))
                        for e in range(self.n_expert)]
        self.one_row_each = tensor.ggml_type == "F32" or (tensor.ggml_type in REPACKED_ONE_ROW and self.n_out % 8 == 0)
        self.nbytes = per_expert.nbytes
        # one token's chosen experts in one kernel call (quant.matmul_experts), for the stack formats it serves
        # (not when the experts are another linear class, as the float64 reference's)
        self.code, self.kernel, self.q8_k = -1, None, False
        if isinstance(self.experts[0], QuantLinear):
            # imported here: a dense model's load imports only its own formats' kernel modules
            from edgellm.quant.matmul_experts import (BLOCK32_CODES, K_QUANT_CODES, chosen_experts,
                                                      chosen_experts_block32)
            if tensor.ggml_type in K_QUANT_CODES:
                self.code, self.kernel, self.q8_k = K_QUANT_CODES[tensor.ggml_type], chosen_experts, True
            elif tensor.ggml_type in BLOCK32_CODES and (self.one_row_each or tensor.ggml_type == "Q8_0"):
                self.code, self.kernel = BLOCK32_CODES[tensor.ggml_type], chosen_experts_block32
        self.stack = per_expert.reshape(-1)
        self.expert_bytes = per_expert.shape[1]
        self.row_bytes = per_expert.shape[1] // self.n_out

    def __repr__(self) -> str:
        return f"ExpertMatrices({self.ggml_type}, n_expert={self.n_expert}, n_out={self.n_out}, n_in={self.n_in})"

    def matmul(self, e: int, x, out, group_sizes):
        """out = W[e] x for the rows routed to expert e; group_sizes: their counts per sequence (None: one)."""
        n = x.shape[0]
        sizes = (1,) * n if self.one_row_each and n > 1 else group_sizes
        self.experts[e].matmul(x, out, sizes)

    def matmul_chosen(self, ids, x, out, buf: "ExpertBuffers", other=None, other_out=None) -> None:
        """out[j] = W[ids[j]] x_j (x_j = x[j], or x[0] for all j), and the same of `other` into other_out when
        given, in one kernel call (callers check self.code >= 0, and other's kernel is the same)."""
        b = other if other is not None else self
        sums = buf.bsums if self.q8_k else buf.xs  # Q8_K's int sums, Q8_0's float ones
        self.kernel(self.code, self.stack, self.expert_bytes, self.row_bytes, out, b.code, b.stack, b.expert_bytes,
                    b.row_bytes, other_out if other is not None else _NO_OUTPUT, ids, x, buf.xq, buf.xd, sums)


# ----------------------------------------------------------------------------------------------------------------
# The feed-forward block


class ExpertBuffers:
    """Scratch of the expert block for up to n_tokens rows, shared by the layers."""

    def __init__(self, experts: ExpertConfig, n_embd: int, n_tokens: int):
        T, k, f32 = n_tokens, experts.n_used, np.float32
        self.logits = np.zeros((T, experts.n_expert), f32)  # [T, E] router logits, then probabilities
        self.ids = np.zeros((T, k), np.int32)  # [T, k] chosen experts, descending probability
        self.weights = np.zeros((T, k), f32)  # [T, k] their renormalised weights
        self.outputs = np.zeros((T, k, n_embd), f32)  # [T, k, d] each chosen expert's output
        self.x = np.zeros((T, n_embd), f32)  # [T, d] the rows routed to one expert
        self.gate = np.zeros((T, experts.n_ff), f32)  # [T, n_ff]
        self.up = np.zeros((T, experts.n_ff), f32)  # [T, n_ff]
        self.y = np.zeros((T, n_embd), f32)  # [T, d] one expert's outputs
        # one token's k experts at once (ExpertMatrices.matmul_chosen): gate and up [k, n_ff], their activations
        width = max(n_embd, experts.n_ff)
        self.gate_k, self.up_k = np.zeros((k, experts.n_ff), f32), np.zeros((k, experts.n_ff), f32)
        self.xq = np.zeros(k * width, np.int8)
        self.xd = np.zeros(max(1, k * width // 32), f32)  # a scale per 256 (Q8_K) or per 32 (Q8_0)
        self.bsums = np.zeros(max(1, k * width // 16), np.int32)  # Q8_K's sums of 16
        self.xs = np.zeros(max(1, k * width // 32), f32)  # Q8_0's d * sum per 32


# Biases a layer may have (as layer_weights names them): the router's [E], gate's and up's [E, n_ff], down's [E, d].
# ggml adds each after its product (add_id for the experts'), in float32, as numpy's += does here.
EXPERT_BIASES = ("ffn_gate_inp_bias", "ffn_gate_exps_bias", "ffn_up_exps_bias", "ffn_down_exps_bias")


def expert_ffn(layer, m, out, cfg: ExpertConfig, buf: ExpertBuffers, sizes) -> None:
    """out [T, d] <- the experts' weighted sum for m [T, d] (out may be m). sizes: the batch's sequences' row
    counts (Batch.sizes), so that every sequence's rows get the arithmetic of a batch of their own."""
    n_rows, k = m.shape[0], cfg.n_used
    logits, ids, weights = buf.logits[:n_rows], buf.ids[:n_rows], buf.weights[:n_rows]
    layer.ffn_gate_inp.matmul(m, logits, sizes)
    biases = [getattr(layer, name, None) for name in EXPERT_BIASES]  # gpt-oss: router and experts' biases
    if biases[0] is not None:
        logits += biases[0]
    if cfg.gating == "top_k_softmax":
        route_top_k_softmax(logits, k, ids, weights)
        if cfg.weights_scale not in (0.0, 1.0):
            weights *= np.float32(cfg.weights_scale)
    else:
        route(logits, k, cfg.weights_scale, ids, weights)
    outputs = buf.outputs[:n_rows].reshape(n_rows * k, -1)
    gate_up, down = layer.ffn_gate_exps, layer.ffn_down_exps
    if (n_rows == 1 and gate_up.code >= 0 and layer.ffn_up_exps.code >= 0 and down.code >= 0
            and gate_up.kernel is layer.ffn_up_exps.kernel):
        # decode: every chosen expert's rows in one call per stage (each row the one-token matmul's bits)
        gate, up = buf.gate_k, buf.up_k
        gate_up.matmul_chosen(ids[0], m, gate, buf, layer.ffn_up_exps, up)
        _activate(gate, up, biases, ids[0], cfg)
        down.matmul_chosen(ids[0], gate, outputs, buf)
        if biases[3] is not None:
            outputs += biases[3][ids[0]]
        _weighted_sum(outputs.reshape(1, k, -1), weights, out)
        return
    slots = np.argsort(ids.reshape(-1), kind="stable")  # (row, choice) slots grouped by expert, rows in order
    counts = np.bincount(ids.reshape(-1), minlength=cfg.n_expert)
    group_of_row = None if sizes is None else np.repeat(np.arange(len(sizes)), sizes)
    begin = 0
    for e in np.flatnonzero(counts):
        mine = slots[begin: begin + counts[e]]
        begin += counts[e]
        rows = mine // k
        n = rows.shape[0]
        group_sizes = None
        if group_of_row is not None:
            per_group = np.bincount(group_of_row[rows])
            group_sizes = tuple(int(c) for c in per_group[per_group > 0])
            if len(group_sizes) == 1:
                group_sizes = None
        x, gate, up, y = buf.x[:n], buf.gate[:n], buf.up[:n], buf.y[:n]
        np.take(m, rows, axis=0, out=x)
        layer.ffn_gate_exps.matmul(e, x, gate, group_sizes)
        layer.ffn_up_exps.matmul(e, x, up, group_sizes)
        _activate(gate, up, biases, e, cfg)
        layer.ffn_down_exps.matmul(e, gate, y, group_sizes)
        if biases[3] is not None:
            y += biases[3][e]
        outputs[mine] = y
    _weighted_sum(outputs.reshape(n_rows, k, -1), weights, out)


def _activate(gate, up, biases, experts, cfg: ExpertConfig) -> None:
    """gate <- the activation of gate and up, after the experts' gate and up biases where the layer has them
    (experts: the expert of the rows, or one expert per row)."""
    if biases[1] is not None:
        gate += biases[1][experts]
        up += biases[2][experts]
    if cfg.activation == "swiglu_oai":
        ops.swiglu_oai(gate, up)
    else:
        ops.silu_mul(gate, up)


def _weighted_sum(outputs, weights, out) -> None:
    """out [T, d] <- sum over j of outputs[:, j] * weights[:, j], in float32, in order j = 0, 1, ... (ggml's adds)."""
    np.multiply(outputs[:, 0], weights[:, 0:1], out=out)
    for j in range(1, outputs.shape[1]):
        out += outputs[:, j] * weights[:, j:j + 1]


"""Weights on the device and the calls that launch kernels on them.

DeviceMatrix holds one GGUF matrix as its raw block bytes (uploaded once, still quantized) and offers the same
products as quant.QuantLinear, on device arrays: matmul (decode is the one-token case) and get_rows.
upload_vector turns a norm weight or bias into a float32 device array. The launch helpers below wrap the op
kernels with their grid shapes, so a model's forward pass reads as a list of ops.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from edgellm.engine.cuda import op_kernels as ops
from edgellm.engine.cuda import quant_kernels as qk
from edgellm.errors import ModelError
from edgellm.quant.formats import format_by_name
from edgellm.quant.reference import dequantize


def _quiet_small_grid_warnings():
    """Decoding one token launches small grids on purpose; numba-cuda would warn once per kernel otherwise."""
    try:
        from numba.cuda.core import config  # numba-cuda: an optional extra, imported only on the GPU path
    except ImportError:  # another numba-cuda layout: keep its default
        return
    config.CUDA_LOW_OCCUPANCY_WARNINGS = 0


_quiet_small_grid_warnings()


class DeviceMatrix:
    """A (n_out, n_in) weight matrix in its GGML format on the device; rows are n_in // 32 chunks of 32."""

    def __init__(self, data_u8, ggml_type: str, shape, name: str = "<matrix>"):
        if ggml_type not in qk.SUPPORTED_FORMATS:
            raise ModelError(f"tensor {name!r} is {ggml_type}; the CUDA kernels read "
                             f"{', '.join(qk.SUPPORTED_FORMATS)}")
        self.n_out, self.n_in = (int(s) for s in shape)
        if self.n_in % qk.CHUNK:
            raise ModelError(f"tensor {name!r}: rows of {self.n_in} are not a multiple of {qk.CHUNK} (CUDA path)")
        fmt = format_by_name(ggml_type)
        self.ggml_type = ggml_type
        self.fmt = fmt.type_id
        self.row_bytes = fmt.row_bytes(self.n_in)
        raw = np.ascontiguousarray(np.asarray(data_u8, dtype=np.uint8).reshape(-1))
        if raw.size != self.row_bytes * self.n_out:
            raise ModelError(f"tensor {name!r} holds {raw.size} bytes; {ggml_type} {tuple(shape)} needs "
                             f"{self.row_bytes * self.n_out}")
        padded = np.zeros(-(-raw.size // 4) * 4, dtype=np.uint8)  # whole float32 words, for the float32 view
        padded[: raw.size] = raw
        self.w8 = cuda.to_device(padded)  # the only copy on the device; the two views below share its memory
        self.wi = self.w8.view(np.int8)
        self.wh = self.w8.view(np.float16)
        self.wf = self.w8.view(np.float32)
        self.nbytes = padded.nbytes

    def matmul(self, x, out, accumulate: bool = False):
        """out[T, n_out] = x[T, n_in] @ W.T, or += when accumulate (the residual add)."""
        grid, block = qk.matmul_grid(self.n_out, x.shape[0])
        qk.matmul_kernel[grid, block](self.fmt, self.w8, self.wi, self.wh, self.wf, self.row_bytes,
                                      self.n_in // qk.CHUNK,
                                      x, out, accumulate)

    def get_rows(self, ids, out, scale: float = 1.0):
        """out[T, n_in] = W[ids] * scale; ids: int32 device array [T]."""
        grid, block = qk.get_rows_grid(self.n_in, ids.shape[0])
        qk.get_rows_kernel[grid, block](self.fmt, self.w8, self.wi, self.wh, self.wf, self.row_bytes, ids,
                                        np.float32(scale), out)


def upload_vector(tensor) -> object:
    """A GGUF vector (F32, F16 or BF16) as a float32 device array."""
    values = dequantize(np.asarray(tensor.data), tensor.ggml_type, tuple(tensor.shape))
    return cuda.to_device(np.ascontiguousarray(values, dtype=np.float32))


# ----------------------------------------------------------------------------------------------------------------
# Launch helpers (device arrays in, device arrays out)


def rms_norm(x, weight, eps, out, accumulate: bool = False):
    """out = rmsnorm(x) * weight (or out += that); x, out: [R, d]."""
    ops.rms_norm_kernel[x.shape[0], ops.NORM_THREADS](x, weight, np.float32(eps), out, accumulate)


def qk_norm_rope_store(q, k, v, positions, inv_freq, neox, q_norm, k_norm, use_norm, eps, kv, mscale=1.0):
    """Per-head norm of q and k (when use_norm; else q_norm, k_norm are any float32 vectors, unread), rotary
    embedding (cos and sin times mscale), then k and v into kv's slots for their positions."""
    grid = (q.shape[0], q.shape[1] + k.shape[1])
    ops.qk_norm_rope_store_kernel[grid, ops.HEAD_THREADS](
        q, k, v, positions, inv_freq, bool(neox), q_norm, k_norm, bool(use_norm), np.float32(eps),
        kv.k, kv.v, kv.slot_pos_device, np.float32(mscale))


def attention(q, kv, n_slots, positions, scale, out, softcap: float = 0.0):
    grid = (q.shape[0], q.shape[1])
    ops.attention_kernel[grid, ops.ATTN_THREADS](q, kv.k, kv.v, kv.slot_pos_device, int(n_slots), positions,
                                                 int(kv.window), np.float32(scale), out, np.float32(softcap))


def gated_activation(gate, up, kind: int):
    grid, block = ops.elementwise_grid(gate.shape[0] * gate.shape[1])
    ops.gated_activation_kernel[grid, block](gate, up, kind)


def add_bias(x, bias):
    grid, block = ops.elementwise_grid(x.shape[0] * x.shape[1])
    ops.add_bias_kernel[grid, block](x, bias)


def add_scaled(x, y, alpha: float):
    grid, block = ops.elementwise_grid(x.shape[0] * x.shape[1])
    ops.add_scaled_kernel[grid, block](x, y, np.float32(alpha))

"""Weight matrices as linear maps. Models get quant.QuantLinear (int8 kernels on the file's bytes, activations
rounded to 8 bits as llama.cpp does). DequantizedLinear is a float32 double with the same interface that tests
swap in (set LINEAR_CLASS) to take that rounding out of a comparison with the float64 reference.
"""

from functools import partial

import numpy as np
from edgellm.engine import prefix
from edgellm.quant import QuantLinear
from edgellm.quant.linear import QuantGroup, StepScratch, run_all
from edgellm.quant.registry import ROWS_GEMM4, ROWS_TILED8


class DequantizedLinear:
    """The matrix dequantized once with gguf-py, then numpy float32 products."""

    def __init__(self, data_u8, ggml_type: str, shape):
        from gguf import GGMLQuantizationType  # gguf-py: only this test double needs it (a slow import)
        from gguf.quants import dequantize as gguf_dequantize
        self.n_out, self.n_in = shape
        self.ggml_type = ggml_type
        qtype = GGMLQuantizationType[ggml_type]
        raw = np.asarray(data_u8).reshape(self.n_out, -1)
        self._w = np.ascontiguousarray(gguf_dequantize(raw, qtype), dtype=np.float32).reshape(self.n_out, self.n_in)

    def matvec(self, x, out):
        np.dot(self._w, x, out=out)

    def matmul(self, x, out, sizes=None):
        np.dot(x, self._w.T, out=out)

    def dequantize(self):
        return self._w.copy()

    def get_rows(self, ids, out):
        np.take(self._w, ids, axis=0, out=out)


LINEAR_CLASS = QuantLinear


def make_linear(tensor):
    """A linear map over a GGUFTensor of numpy shape (n_out, n_in)."""
    return LINEAR_CLASS(tensor.data, tensor.ggml_type, tuple(tensor.shape))


def row_kind_bits(loaded) -> int:
    """The bits of a row's kind (edgellm.engine.prefix) that these loaded tensors' kernels make a difference to:
    attention's always, Q4_K's gemm and the tiled K-quant kernels only where a matrix takes them (a file of 32-element
    formats reuses a prompt's rows up to its last two); every bit for a matrix of other kernels (experts, test doubles)."""
    bits = prefix.SEVERAL_ROWS
    for m in loaded:
        if m is None or isinstance(m, np.ndarray):  # a vector: no batch in its arithmetic
            continue
        if type(m) is not QuantLinear:
            return prefix.ALL_KIND_BITS
        rule = m.kernels.row_kinds
        bits |= prefix.GEMM4_ROWS if rule == ROWS_GEMM4 else prefix.TILED8_ROWS if rule == ROWS_TILED8 else 0
    return bits


def group_projections(layer) -> None:
    """Group a layer's projections that share an input (Q, K, V; gate, up) into QuantGroups where their formats
    allow: one kernel call, one activation quantization and one parallel region per group. Q and K alone form a group
    where V's format differs (Gemma-3 has Q8_0 V beside Q5_0 Q and K in half its layers). The groups are kept as
    qkv_group and gate_up_group, names no GGUF tensor has: a file's own fused blk.N.attn_qkv.weight loads as
    layer.attn_qkv and stays that matrix."""
    layer.qkv_group = layer.gate_up_group = None
    if getattr(layer, "attn_qkv", None) is None:
        layer.qkv_group = QuantGroup.of(layer.attn_q, layer.attn_k, layer.attn_v) or \
            QuantGroup.of(layer.attn_q, layer.attn_k)
    if getattr(layer, "ffn_gate", None) is not None:
        layer.gate_up_group = QuantGroup.of(layer.ffn_gate, layer.ffn_up)


def project_qkv(layer, x, q, k, v, sizes) -> None:
    """q, k, v = W_q x, W_k x, W_v x (see group_projections). A fused attn_qkv holds W_q, W_k, W_v stacked by
    rows (llama.cpp's converter layout): one product, then its columns are split."""
    fused = getattr(layer, "attn_qkv", None)
    if fused is not None:
        _split_product(fused, x, (q, k, v), sizes)
        return
    group = layer.qkv_group
    if group is None:
        layer.attn_q.matmul(x, q, sizes)
        layer.attn_k.matmul(x, k, sizes)
        layer.attn_v.matmul(x, v, sizes)
    elif len(group.layers) == 3:
        group.matmul(x, (q, k, v), sizes)
    else:
        group.matmul(x, (q, k), sizes)
        layer.attn_v.matmul(x, v, sizes)


def project_gate_up(layer, x, gate, up, sizes) -> None:
    """gate, up = W_gate x, W_up x (see group_projections). Without ffn_gate, ffn_up holds W_gate then W_up stacked
    by rows ([2 n_ff, d], llama.cpp's fused SwiGLU layout, as phi3 has): one product, then split."""
    if getattr(layer, "ffn_gate", None) is None:
        _split_product(layer.ffn_up, x, (gate, up), sizes)
    elif layer.gate_up_group is None:
        layer.ffn_gate.matmul(x, gate, sizes)
        layer.ffn_up.matmul(x, up, sizes)
    else:
        layer.gate_up_group.matmul(x, (gate, up), sizes)


def bound_matmul(matrix, x, out, scratch: StepScratch, sizes=None):
    """matrix.matmul(x, out, sizes) as a callable bound to these buffers (QuantLinear.bound); a matrix of another
    kind is called through its matmul."""
    bound = getattr(matrix, "bound", None)
    return bound(x, out, scratch, sizes) if bound is not None else partial(matrix.matmul, x, out, sizes)


def bound_qkv(layer, x, q, k, v, scratch: StepScratch, sizes=None):
    """project_qkv(layer, x, q, k, v, sizes) as a callable bound to these buffers."""
    group = layer.qkv_group
    if getattr(layer, "attn_qkv", None) is not None:
        return partial(project_qkv, layer, x, q, k, v, sizes)
    if group is None:
        return run_all(*(bound_matmul(m, x, out, scratch, sizes) for m, out in
                         ((layer.attn_q, q), (layer.attn_k, k), (layer.attn_v, v))))
    if len(group.layers) == 3:
        return group.bound(x, (q, k, v), scratch, sizes)
    return run_all(group.bound(x, (q, k), scratch, sizes), bound_matmul(layer.attn_v, x, v, scratch, sizes))


def bound_gate_up(layer, x, gate, up, scratch: StepScratch, sizes=None):
    """project_gate_up(layer, x, gate, up, sizes) as a callable bound to these buffers."""
    if getattr(layer, "ffn_gate", None) is None:
        return partial(project_gate_up, layer, x, gate, up, sizes)
    if layer.gate_up_group is None:
        return run_all(bound_matmul(layer.ffn_gate, x, gate, scratch, sizes),
                       bound_matmul(layer.ffn_up, x, up, scratch, sizes))
    return layer.gate_up_group.bound(x, (gate, up), scratch, sizes)


def _split_product(fused, x, outs, sizes) -> None:
    """outs = the column blocks of fused · x, in order (each out [T, its width]): the fused matrix's own product,
    as llama.cpp computes it before taking views of it."""
    widths = [out.shape[1] for out in outs]
    if fused.n_out != sum(widths):
        raise ValueError(f"fused matrix has {fused.n_out} rows; the outputs take {sum(widths)}")
    whole = np.empty((x.shape[0], fused.n_out), np.float32)  # only files with fused tensors pay this allocation
    fused.matmul(x, whole, sizes)
    begin = 0
    for out, width in zip(outs, widths):
        out[...] = whole[:, begin:begin + width]
        begin += width

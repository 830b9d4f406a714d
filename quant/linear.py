"""QuantLinear: y = W x for a GGML-quantized weight matrix, computed in place on the file's bytes.

Layout choice (measured on a 2-vCPU AVX2 EPYC, see tools/bench_kernels.py): the kernels read GGML's own
block layout straight from the mmap, with no repacking at load. Decoding a block into 32 signed bytes is a
handful of vector instructions (quant.simd), and in place a one-thread matvec already reads 9-11 GB/s of
Q4_1 / Q4_K and ~14 GB/s of Q8_0, against ~14-18 GB/s of DRAM read bandwidth per thread: a repacked
layout has little speed left to win, while any repack costs memory (a full int8 unpack doubles 4-bit
weights; even float32 scales beside the nibbles add 20-40%). In place, QuantLinear adds nothing to the
model's RSS beyond the activation scratch, and the weights stay shared with the page cache.

Activations are quantized per call to int8 (Q8_0-style for the 32-element formats, Q8_K-style for the
K-quants, as llama.cpp does); F32/F16/BF16 weights use float32 activations. The activation scratch is shared
by every QuantLinear with the same input width and kind and grows with the longest batch seen; kernels hold
the GIL, so sharing is safe for calls from any one thread at a time.
"""

from __future__ import annotations

import threading
from functools import partial

import numpy as np

from .aligned import empty_aligned
from .formats import format_by_name
from .reference import as_checked_bytes, check_shape
from .registry import FLOAT, Q8_0, kernels_for
from .simd import HAS_WIDE_TILES, IS_ZEN


class _ActivationScratch:
    """int8 quants + per-block scales (+ sums) for up to `capacity` tokens of width n_in, each on a cache line."""

    def __init__(self, activation: str, n_in: int):
        self.activation, self.n_in, self.capacity = activation, n_in, 0
        self.args: tuple = ()
        self.reserve(1)

    def reserve(self, n_tokens: int) -> tuple:
        if n_tokens > self.capacity:  # matmul only: matvec always fits
            n = n_tokens * self.n_in
            if self.activation == Q8_0:  # xq, d per 32, d*sum(q) per 32, each followed by the 8-token tiles' copy
                self.args = (empty_aligned(3 * n, np.int8), empty_aligned(6 * (n // 32), np.float32),
                             empty_aligned(n // 32, np.float32))
            else:                        # xq, d per 256, int sums per 16
                self.args = (empty_aligned(n, np.int8), empty_aligned(n // 256, np.float32),
                             empty_aligned(n // 16, np.int32))
            self.capacity = n_tokens
        return self.args


_THREAD_SCRATCH = threading.local()  # .buffers: {(activation, n_in): _ActivationScratch} for this thread
_UNIT_STRIDE = (4,)  # a contiguous 1-D float32 array


# Which of llama.cpp's kernels computes each row, per (format, repackable, rows, batch sizes), and the kernel that
# runs them: see the registry's row_kinds_of and row_kinds_kernel. Small and read-only once built; shared by all
# threads.
_ROW_KINDS: dict = {}


def _scratch_for(key) -> _ActivationScratch:
    # Per thread: parallel kernels release the GIL, so two threads sharing one buffer would corrupt each
    # other's quantized activations (two models of the same widths, each on its own thread).
    scratch = getattr(_THREAD_SCRATCH, "buffers", None)
    if scratch is None:
        scratch = _THREAD_SCRATCH.buffers = {}
    if key not in scratch:
        scratch[key] = _ActivationScratch(*key)
    return scratch[key]


class StepScratch:
    """Activation scratch for products bound to one step's buffers (QuantLinear.bound, QuantGroup.bound), which run
    one after another on one thread: per input width and kind, buffers for the step's rows, owned by the step's
    products alone (the shared per-thread scratch may be grown, and so replaced, by other calls between two steps)."""

    def __init__(self):
        self._by_key = {}

    def rows(self, key, n_tokens: int) -> tuple:
        if key is None:  # float weights: no quantized activations
            return ()
        if key not in self._by_key:
            self._by_key[key] = _ActivationScratch(*key)
        return self._by_key[key].reserve(n_tokens)  # (grown: products bound before keep the buffers they have)


_F32 = np.dtype(np.float32)


def _check_f32(name: str, a, shape: tuple[int, ...], writable: bool = False) -> None:
    if not (isinstance(a, np.ndarray) and a.dtype == _F32 and a.shape == shape and a.flags.c_contiguous):
        got = f"{a.dtype} {a.shape}{'' if a.flags.c_contiguous else ' non-contiguous'}" \
            if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a C-contiguous float32 array of shape {shape}, got {got}")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} must be writable")


def _check_sizes(sizes, n_tokens: int) -> None:
    if sizes is not None and (sum(sizes) != n_tokens or min(sizes, default=0) < 1):
        raise ValueError(f"sizes {sizes} must be positive and add up to the {n_tokens} rows of x")


class QuantLinear:
    """A (n_out, n_in) weight matrix of any registered format, used without copying its bytes."""

    def __init__(self, data, ggml_type: str, shape):
        self.format = format_by_name(ggml_type)
        shape = check_shape(self.format, shape)
        if len(shape) != 2 or shape[0] == 0 or shape[1] == 0:
            raise ValueError(f"QuantLinear needs a non-empty 2-D (n_out, n_in) shape, got {shape}")
        self.data = as_checked_bytes(data, self.format, shape)  # flat uint8 view, no copy when contiguous
        self.n_out, self.n_in = shape
        self.ggml_type = self.format.name
        self.row_bytes = self.format.row_bytes(self.n_in)
        self.kernels = kernels_for(self.format)
        self._kernel = self.kernels.matmul_kernel_for(self.n_out)
        self.rows8 = self._kernel is not self.kernels.matmul_kernel()  # llama.cpp's repacked arithmetic (registry)
        # One matrix through the two-or-three-matrix driver (the other two without columns), with the same bits:
        # a model then compiles one parallel driver per format, not two (a first run's compilation is mostly these).
        self._kernel3 = None if self.rows8 else self.kernels.matmul3_kernel()
        activation = self.kernels.activation
        self._scratch_key = None if activation == FLOAT else (activation, self.n_in)
        self._x_shape, self._out_shape = (self.n_in,), (self.n_out,)

    @classmethod
    def concat_rows(cls, layers: list["QuantLinear"]) -> "QuantLinear":
        """One QuantLinear whose rows are the given layers' rows in order (same format and n_in), e.g. Q, K
        and V stacked so that decode pays one kernel call instead of three. Copies the weight bytes."""
        first = layers[0]
        if any(layer.ggml_type != first.ggml_type or layer.n_in != first.n_in for layer in layers):
            raise ValueError("concat_rows needs layers of one format and one input width, got "
                             + ", ".join(repr(layer) for layer in layers))
        data = np.concatenate([layer.data for layer in layers])
        return cls(data, first.ggml_type, (sum(layer.n_out for layer in layers), first.n_in))

    def __repr__(self) -> str:
        return f"QuantLinear({self.ggml_type}, n_out={self.n_out}, n_in={self.n_in})"

    @property
    def nbytes(self) -> int:
        return self.data.size

    def matvec(self, x: np.ndarray, out: np.ndarray) -> None:
        """out[:] = W @ x for one token (decode)."""
        # The common case in a few attribute checks (this runs hundreds of times per token); anything
        # unusual goes through the full checks, which name the problem.
        if not (type(x) is np.ndarray and type(out) is np.ndarray and x.dtype is _F32 and out.dtype is _F32
                and x.shape == self._x_shape and out.shape == self._out_shape and x.strides == _UNIT_STRIDE
                and out.strides == _UNIT_STRIDE and out.flags.writeable):
            _check_f32("x", x, self._x_shape)
            _check_f32("out", out, self._out_shape, writable=True)
        self._run(x.reshape(1, self.n_in), out.reshape(1, self.n_out))

    def matmul(self, x: np.ndarray, out: np.ndarray, sizes: tuple[int, ...] | None = None) -> None:
        """out[t] = W @ x[t] for x of shape (T, n_in) (prompt processing), with llama.cpp's arithmetic for a batch
        of T tokens: for most formats each row equals matvec's bits; for Q4_K and Q6_K llama.cpp uses other
        kernels (other rounding) for larger batches, and so does this. sizes: the rows are independent batches
        of these sizes (several sequences at once; sum(sizes) == T), each computed as a batch of its size alone
        would be (sizes of 1: every row equals matvec's bits)."""
        # As matvec: the common case (decode calls this hundreds of times per token) in a few attribute checks,
        # anything unusual through the full checks, which name the problem.
        if not (type(x) is np.ndarray and type(out) is np.ndarray and x.dtype is _F32 and out.dtype is _F32
                and x.ndim == 2 and out.ndim == 2 and x.shape[1] == self.n_in and out.shape[1] == self.n_out
                and out.shape[0] == x.shape[0] and x.strides == (4 * self.n_in, 4)
                and out.strides == (4 * self.n_out, 4) and out.flags.writeable):
            if not isinstance(x, np.ndarray) or x.ndim != 2:
                raise ValueError(f"x must be a 2-D (T, {self.n_in}) float32 array")
            _check_f32("x", x, (x.shape[0], self.n_in))
            _check_f32("out", out, (x.shape[0], self.n_out), writable=True)
        n_tokens = x.shape[0]
        _check_sizes(sizes, n_tokens)
        if n_tokens:
            self._run(x, out, sizes)

    def bound(self, x: np.ndarray, out: np.ndarray, scratch: StepScratch, sizes: tuple[int, ...] | None = None):
        """A callable that does matmul(x, out, sizes) each time it is called, its checks and kernel choice made now: a
        decode step's product (or a few rows') on buffers it reuses, with matmul's kernel and bits. The arrays must
        stay these ones; scratch: the step's (StepScratch)."""
        n_tokens = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 2 else -1
        _check_f32("x", x, (max(n_tokens, 1), self.n_in))
        _check_f32("out", out, (n_tokens, self.n_out), writable=True)
        _check_sizes(sizes, n_tokens)
        if self._kernel3 is not None:
            if _tile_padding(n_tokens, self.data):  # (a copy padded to a tile: through matmul)
                return partial(self.matmul, x, out, sizes)
            w = self.data
            return partial(self._kernel3, w, w, w, self.row_bytes, x, *scratch.rows(self._scratch_key, n_tokens), out,
                           _NO_COLUMNS, _NO_COLUMNS)
        act = scratch.rows(self._scratch_key, n_tokens)
        if self.kernels.row_kinds is None:
            return partial(self._kernel, self.data, self.row_bytes, x, *act, out)
        kinds = self.kernels.row_kinds_of(self.n_out, sizes or (n_tokens,))
        return partial(self.kernels.row_kinds_kernel(kinds), self.data, self.row_bytes, x, *act, out, kinds)

    def _run(self, x: np.ndarray, out: np.ndarray, sizes=(1,)) -> None:
        if self._kernel3 is not None:
            w = self.data
            _block32_tiles(self._kernel3, (w, w, w), self.row_bytes, x, (out, _NO_COLUMNS, _NO_COLUMNS),
                           self._scratch_key)
            return
        if self.kernels.row_kinds is None:
            self._kernel(self.data, self.row_bytes, x, *_scratch_for(self._scratch_key).reserve(x.shape[0]), out)
            return
        key = (self.ggml_type, self.n_out % 8 == 0, x.shape[0], sizes)
        found = _ROW_KINDS.get(key)
        if found is None:
            kinds = self.kernels.row_kinds_of(self.n_out, sizes or (x.shape[0],))
            found = (kinds, self.kernels.row_kinds_kernel(kinds))
            if len(_ROW_KINDS) < 1024:
                _ROW_KINDS[key] = found
        kinds, kernel = found
        if self._scratch_key is None:  # float weights: no quantized activations
            kernel(self.data, self.row_bytes, x, out, kinds)
        else:
            kernel(self.data, self.row_bytes, x, *_scratch_for(self._scratch_key).reserve(x.shape[0]), out, kinds)

    def _dequantize_rows(self):
        # looked up on first use: most matrices are never dequantized, and the decoders' module is then not imported
        kernel = self.__dict__.get("_dequantize_kernel")
        if kernel is None:
            kernel = self.__dict__["_dequantize_kernel"] = self.kernels.dequantize_rows()
        return kernel

    def dequantize(self) -> np.ndarray:
        out = np.empty((self.n_out, self.n_in), np.float32)
        self._dequantize_rows()(self.data, self.row_bytes, np.arange(self.n_out), out)
        return out

    def get_rows(self, ids, out: np.ndarray) -> None:
        """out[i] = row ids[i] of W, dequantized (embedding lookup)."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or not (ids.dtype.kind in "iu" or ids.size == 0):
            raise ValueError(f"ids must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
        _check_f32("out", out, (ids.size, self.n_in), writable=True)
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.n_out:
            raise ValueError(f"row id out of range [0, {self.n_out}): {lo if lo < 0 else hi}")
        self._dequantize_rows()(self.data, self.row_bytes, ids.astype(np.int64, copy=False), out)


_NO_COLUMNS = np.empty((0, 0), np.float32)  # an output with no row blocks to compute (of a group of two, a lone matrix)

# A batch's last rows past its eight-token tiles go as a four-token tile (T % 8 >= 4), pairs and a single token;
# where a bigger tile costs less than that, they are padded with copies of the last row to one: 7 rows to an
# eight-token tile, and with the 512-bit tiles 3 rows to a four-token one (docs/kernels.md has the timings). The
# padded rows have the same bits as the one-token dots (every block32 format: its rows do not depend on the batch).
_PAD_ROWS = {3: 1, 7: 1} if HAS_WIDE_TILES else {7: 1}
# A batch's tokens after its tiles go two at a time through the two-token dots (each block decoded once for both),
# an odd last one alone. A batch of two rows goes that way too, except through a matrix far bigger than the caches
# with the 512-bit tiles, where the padded four-token tile streams it a little faster (a two-row forward's output
# matrix: Gemma-3's 262,144 x 640 at 2 threads 6.7 ms padded against 6.9 as a pair; SmolLM2's 49,152 x 576 at one
# thread 2.4-2.8 against 2.3; docs/kernels.md). Two rows after eight-token tiles stay a pair: the tiles have brought
# the weights into the caches (10 rows through Gemma-3's output: 20.7-22.9 ms as 8 + 2, 24.3-25.1 ms padded). Where
# long rows go one at a time (AMD), a pair streams in about one token's time and is not padded (Gemma-3's output
# at 2 threads, Zen 4: 6.0 ms as a pair, 6.9 padded).
_PAD_TWO_FROM_BYTES = 64 << 20 if HAS_WIDE_TILES and not IS_ZEN else None


def _tile_padding(n_tokens: int, weights) -> int:
    """Copies of the last row _block32_tiles adds to a batch of n_tokens rows through these weights."""
    if n_tokens == 2 and _PAD_TWO_FROM_BYTES is not None and weights.size >= _PAD_TWO_FROM_BYTES:
        return 2
    return _PAD_ROWS.get(n_tokens % 8, 0)


def _block32_tiles(kernel, weights, row_bytes, x, outs, scratch_key) -> None:
    """kernel (a matmul3_<fmt>) over x into outs (three, the unused ones _NO_COLUMNS), the tail padded to a tile."""
    n_tokens = x.shape[0]
    pad = _tile_padding(n_tokens, weights[0])
    if not pad:
        kernel(*weights, row_bytes, x, *_scratch_for(scratch_key).reserve(n_tokens), *outs)
        return
    n = n_tokens + pad
    xp = np.empty((n, x.shape[1]), np.float32)
    xp[:n_tokens] = x
    xp[n_tokens:] = x[n_tokens - 1]
    padded = tuple(np.empty((n, out.shape[1]), np.float32) if out.shape[1] else out for out in outs)
    kernel(*weights, row_bytes, xp, *_scratch_for(scratch_key).reserve(n), *padded)
    for out, p in zip(outs, padded):
        if out.shape[1]:
            out[:] = p[:n_tokens]


class QuantGroup:
    """Two or three QuantLinear of one 32-element block format and one input width, applied to the same input (a
    layer's Q, K and V; its gate and up): the input is quantized once and one parallel region computes every row,
    instead of a kernel call, a quantization and a region per matrix. Each output equals its layer's matmul bit for
    bit. The weights stay where they are (no copy)."""

    def __init__(self, layers):
        layers = tuple(layers)
        if not 2 <= len(layers) <= 3 or not all(isinstance(layer, QuantLinear) for layer in layers):
            raise ValueError(f"QuantGroup needs two or three QuantLinear, got {layers!r}")
        first = layers[0]
        kernel = first.kernels.matmul3_kernel()
        if kernel is None or any(layer.ggml_type != first.ggml_type or layer.n_in != first.n_in for layer in layers):
            raise ValueError("QuantGroup needs layers of one 32-element block format with Q8_0 activations "
                             "and one input width, got " + ", ".join(repr(layer) for layer in layers))
        self.layers, self.n_in = layers, first.n_in
        self._kernel = kernel
        self._weights = tuple(layer.data for layer in layers) + ((layers[1].data,) if len(layers) == 2 else ())
        self._scratch_key = first._scratch_key
        # a layer computed in llama.cpp's repacked order (QuantLinear.rows8) keeps its own kernel: each layer in turn
        self._each_layer = any(layer.rows8 for layer in layers)

    def _common_case(self, x, outs) -> bool:
        if not (type(x) is np.ndarray and x.dtype is _F32 and x.ndim == 2 and x.shape[1] == self.n_in
                and x.strides == (4 * self.n_in, 4) and type(outs) in (tuple, list) and len(outs) == len(self.layers)):
            return False
        for layer, out in zip(self.layers, outs):
            if not (type(out) is np.ndarray and out.dtype is _F32 and out.shape == (x.shape[0], layer.n_out)
                    and out.strides == (4 * layer.n_out, 4) and out.flags.writeable):
                return False
        return True

    @classmethod
    def of(cls, *layers) -> "QuantGroup | None":
        """A group of these layers, or None where they cannot be one (other formats, widths or classes)."""
        try:
            return cls(layers)
        except ValueError:
            return None

    def __repr__(self) -> str:
        return f"QuantGroup({', '.join(repr(layer) for layer in self.layers)})"

    def matmul(self, x: np.ndarray, outs, sizes: tuple[int, ...] | None = None) -> None:
        """outs[i][t] = W_i @ x[t] for each layer i (see QuantLinear.matmul; sizes change nothing for these formats,
        whose rows do not depend on the batch, and are only checked)."""
        if not self._common_case(x, outs):  # as QuantLinear.matmul: the full checks name the problem
            if not (isinstance(x, np.ndarray) and x.ndim == 2):
                raise ValueError(f"x must be a 2-D (T, {self.n_in}) float32 array")
            _check_f32("x", x, (x.shape[0], self.n_in))
            if not isinstance(outs, (tuple, list)) or len(outs) != len(self.layers):
                raise ValueError(f"outs must be a tuple or list of {len(self.layers)} arrays, "
                                 f"got {type(outs).__name__}")
            for i, (layer, out) in enumerate(zip(self.layers, outs)):
                _check_f32(f"outs[{i}]", out, (x.shape[0], layer.n_out), writable=True)
        n_tokens = x.shape[0]
        _check_sizes(sizes, n_tokens)
        if not n_tokens:
            return
        if self._each_layer:
            for layer, out in zip(self.layers, outs):
                layer.matmul(x, out, sizes)
            return
        if len(outs) == 2:
            outs = (outs[0], outs[1], _NO_COLUMNS)
        _block32_tiles(self._kernel, self._weights, self.layers[0].row_bytes, x, tuple(outs), self._scratch_key)

    def bound(self, x: np.ndarray, outs, scratch: StepScratch, sizes: tuple[int, ...] | None = None):
        """As QuantLinear.bound, for the group: matmul(x, outs, sizes) per call."""
        if not (isinstance(outs, (tuple, list)) and len(outs) == len(self.layers)):
            raise ValueError(f"outs must be a tuple or list of {len(self.layers)} arrays")
        if self._each_layer:
            return run_all(*(layer.bound(x, out, scratch, sizes) for layer, out in zip(self.layers, outs)))
        n_tokens = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 2 else -1
        _check_f32("x", x, (max(n_tokens, 1), self.n_in))
        for i, (layer, out) in enumerate(zip(self.layers, outs)):
            _check_f32(f"outs[{i}]", out, (n_tokens, layer.n_out), writable=True)
        _check_sizes(sizes, n_tokens)
        if _tile_padding(n_tokens, self._weights[0]):
            return partial(self.matmul, x, tuple(outs), sizes)
        outs = (*outs, _NO_COLUMNS) if len(outs) == 2 else tuple(outs)
        return partial(self._kernel, *self._weights, self.layers[0].row_bytes, x,
                       *scratch.rows(self._scratch_key, n_tokens), *outs)


def run_all(*calls):
    """One callable that runs these zero-argument callables in order."""
    def run():
        for call in calls:
            call()
    return run

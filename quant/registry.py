"""The format registry: for each GGML type in the format table, the code that computes with it.

quant.formats holds the layouts (byte arithmetic, block dtypes); this file says, per format, where its numpy
reference, Numba kernels, quantizer and CUDA support live. Everything that picks code by format goes through
`kernels_for(fmt)`: no other file keys code by format name or type id. The records name modules and functions
as strings and resolve them on first use, so importing this file (as reading a GGUF header does) loads neither
numba nor the kernels.

A record's fields:
  activation       what the matmul quantizes the input to: FLOAT (float32, no quantization), Q8_0 (int8 per
                   32, llama.cpp's block_q8_0, with d*sum(q) for the formats with mins) or Q8_K (int8 per 256)
  reference        "module:function" of the numpy dequantizer, (n_blocks,) block records -> (n_blocks, block_size)
  reference_quantize  "module:function" of the numpy quantizer, or None; see `reference_quantize` for the forms
  dequantize_block "module:function" of the Numba block decoder `f(w, o, out, p)`, expanded by
                   tools/gen_kernels.py into quant.dequantize_rows.dequantize_rows_<fmt>
  dots             for Q8_0 activations: the module holding vec_dot_<fmt>_q8_0 and vec_dot2_ (and where tile4 is
                   False, vec_dot4_ and tile8_<fmt>), expanded into quant.matmul_block32.matmul_<fmt> / matmul3_<fmt>;
                   matmul_block32 itself where tile4 is True
  tile4            for Q8_0 activations, whether the format's dots (vec_dot_, vec_dot2_, vec_dot22_<fmt>_q8_0, one
                   template per driver) and tiles (tile8_<fmt>, the four-token tile4_<fmt>) are generated
                   (tools/gen_kernels.py) into quant.matmul_block32 from quant.dots_block32's steps and the format's
                   decoders there (_quants_<fmt>, for two rows _quants_<fmt>_bcast with mins or
                   _quants_<fmt>_unsigned_bcast with lane sums, _tile_quants_<fmt>), for a block of an f16 scale, an
                   f16 min for the formats with mins, then the quants; otherwise its module's tile8_<fmt> and
                   four-token dots (vec_dot4_<fmt>_q8_0) serve
  driver           for Q8_0 activations, how the single-token dots take the activations' sums (DRIVER_*)
  tile_offset      for Q8_0 activations, what the eight-token tiles add to the quants (an int, or a name in `dots`,
                   in quant.dots_block32 where tile4 is True)
  matmul           for the other activations, the module holding matmul_<fmt>
  kgroups          for the K-quants built from kernels_kquant's groups: (the name of its _scales_ function,
                   whether its quants are signed), expanded into quant.matmul_kgroups; None for the hand-written
  row_kinds        where llama.cpp's x86 backend multiplies a batch's tokens with kernels that round differently
                   (ROWS_*): its matmul then takes kinds[t] per token (row_kinds_of); or None
  few              with row_kinds: the matmul module also has matmul_<fmt>_few, for batches with no eight-token
                   work, which compiles much less (decode and short prompts)
  wide_from        with row_kinds: the matmul module also has matmul_<fmt>_wide (the same bits, one token per vector
                   lane), run for batches of at least this many gemm tokens on CPUs with simd.HAS_WIDE_TILES (16
                   lanes); 0 for none
  wide_on_avx2     whether matmul_<fmt>_wide also runs on other AVX2 CPUs (8 lanes), where it is faster too, from
                   WIDE_FROM_AVX2 gemm tokens
  quantizer        "module:function" of the Numba block quantizer, expanded into quant.quantize_blocks, or None
  rows8            "module:function" of the matmul for matrices of a multiple of 8 rows, which llama.cpp's x86
                   backend repacks at load and multiplies in its own order (Q4_0, MXFP4), or None; that module also
                   holds rows8_reference, the numpy model of that order
  cuda             whether edgellm.engine.cuda.quant_kernels has a branch for this type id
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import numpy as np

from .formats import FORMATS, BlockFormat, format_by_name

FLOAT, Q8_0, Q8_K = "float", "q8_0", "q8_k"  # activation kinds

# How a Q8_0-activation format's single-token dots take the activations (tools/gen_kernels.py's DOTS):
DRIVER_PLAIN = "plain"          # the quants and d only
DRIVER_MINS = "mins"            # also s = d*sum(q) (formats with a min: w = d*q + m), as (d, s) pairs for two rows
DRIVER_LANE_SUMS = "lane_sums"  # unsigned quants in the two-row dot, the offset taken out through lane sums

# How llama.cpp (x86) splits a batch of T tokens between two kernels that round differently:
ROWS_GEMM4 = "gemm4"    # a matrix of a multiple of 8 rows is repacked at load: tokens [0, T - T % 4) go through
                        # the 4-token gemm, the rest through the gemv; other row counts take the gemv
ROWS_TILED8 = "tiled8"  # batches of at least 8 tokens go through the tiled matmul, smaller ones through vec_dot
ROWS_PAIRS = "pairs"    # batches of at least 2 tokens go through llamafile's tinyBLAS, one token through vec_dot
GEMM4_TOKENS = 4        # the repacked gemm's token group
TILED8_MIN_TOKENS = 8   # llama.cpp hands batches of at least this many tokens to its tiled K-quant matmul


@dataclass(frozen=True)
class FormatKernels:
    name: str
    activation: str
    reference: str
    reference_quantize: str | None = None
    dequantize_block: str = ""
    dots: str | None = None
    driver: str | None = None
    tile_offset: int | str = 0
    tile4: bool = False
    matmul: str | None = None
    quantizer: str | None = None
    cuda: bool = False
    rows8: str | None = None
    kgroups: tuple[str, bool] | None = None
    row_kinds: str | None = None
    few: bool = False
    wide_from: int = 0
    wide_on_avx2: bool = False

    @property
    def format(self) -> BlockFormat:
        return format_by_name(self.name)

    @property
    def suffix(self) -> str:  # the per-format function names' ending: dequantize_rows_q4_0, matmul_q4_0, ...
        return self.name.lower()

    def dequantize_rows(self):
        """Numba: f(w, row_bytes, rows, out), out[i] = row rows[i] of the tensor, dequantized."""
        return _attr("dequantize_rows", f"dequantize_rows_{self.suffix}")

    def matmul_kernel(self):
        """Numba: the matmul for this format (the contract of quant.matmul_block32 / matmul_kquant / kernels_float)."""
        module = "matmul_block32" if self.activation == Q8_0 else self.matmul
        return _attr(module, f"matmul_{self.suffix}")

    def row_kinds_of(self, n_out: int, sizes) -> np.ndarray:
        """int8 [sum(sizes)]: for each row of independent batches of these sizes, 1 where llama.cpp computes it with
        the first kernel of the format's row_kinds rule (the gemm, the tiled matmul), 0 for the other."""
        kinds = np.zeros(sum(sizes), np.int8)
        start = 0
        for n in sizes:
            if self.row_kinds == ROWS_GEMM4 and n_out % 8 == 0:
                kinds[start: start + n - n % GEMM4_TOKENS] = 1
            elif self.row_kinds == ROWS_TILED8 and n >= TILED8_MIN_TOKENS:
                kinds[start: start + n] = 1
            elif self.row_kinds == ROWS_PAIRS and n >= 2:
                kinds[start: start + n] = 1
            start += n
        return kinds

    def row_kinds_kernel(self, kinds: np.ndarray):
        """Numba: the matmul for a batch of these row kinds: matmul_<fmt>_few where the format has one and the batch
        has no eight-token work (gemm4: no aligned group of eight gemm tokens; tiled8: no tiled token), which spares
        decode and short prompts the eight-token kernels' compilation; matmul_<fmt>_wide for enough gemm tokens where
        the CPU has the 512-bit tiles; else matmul_<fmt>."""
        if self.wide_from:
            from .simd.host import HAS_AVX2, HAS_WIDE_TILES  # (here: importing the registry loads no numba)
            gemm = int(np.count_nonzero(kinds))
            if ((HAS_WIDE_TILES and gemm >= self.wide_from)
                    or (self.wide_on_avx2 and HAS_AVX2 and gemm >= max(self.wide_from, WIDE_FROM_AVX2))):
                return _attr(self.matmul, f"matmul_{self.suffix}_wide")
        if self.few:
            if self.row_kinds == ROWS_TILED8:
                eight = bool(kinds.any())
            else:
                eight = bool(kinds[:len(kinds) - len(kinds) % 8].reshape(-1, 8).all(axis=1).any())
            if not eight:
                return _attr(self.matmul, f"matmul_{self.suffix}_few")
        return self.matmul_kernel()

    def matmul_kernel_for(self, n_out: int):
        """matmul_kernel, or the rows8 kernel for a matrix of a multiple of 8 rows where the format has one."""
        return _resolve(self.rows8) if self.rows8 and n_out % 8 == 0 else self.matmul_kernel()

    def rows8_reference(self):
        """numpy: f(raw, n_out, n_in, xq, xd) -> float32 [n_out], the rows8 kernel's results for one token's Q8_0
        activations (the module of `rows8`)."""
        return _resolve(self.rows8.partition(":")[0] + ":rows8_reference")

    def matmul3_kernel(self):
        """Numba: two or three matrices on one input, or None where the format has no such kernel."""
        return _attr("matmul_block32", f"matmul3_{self.suffix}") if self.activation == Q8_0 else None

    def reference_dequantize(self):
        return _resolve(self.reference)

    def reference_quantizer(self):
        """The numpy quantizer f(x (n_blocks, block_size) float32) -> (n_blocks,) block records, or None."""
        return _resolve(self.reference_quantize) if self.reference_quantize else None

    def quantize_blocks(self):
        """Numba: f(x (n_blocks, block_size) float32, out (n_blocks, type_size) uint8), or None."""
        return _attr("quantize_blocks", f"quantize_blocks_{self.suffix}") if self.quantizer else None


def _resolve(spec: str):
    module, _, name = spec.partition(":")
    return _attr(module, name)


@functools.lru_cache(maxsize=None)  # a model's loading asks once per matrix
def _attr(module: str, name: str):
    if module != "formats":  # (the kernels' modules: the threading layer must be chosen before any parallel one)
        from . import threading_layer  # noqa: F401
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def _float(name: str) -> FormatKernels:
    low = name.lower()
    return FormatKernels(name, FLOAT, f"reference:dequantize_{low}", f"reference:quantize_{low}",
                         f"kernels_dequant:block_{low}", matmul="kernels_float", cuda=name != "BF16",
                         row_kinds=ROWS_PAIRS)


def _block32(name: str, driver: str, tile_offset, dots: str = "matmul_block32", block: str = "kernels_dequant",
             quantizer: str | None = "quantize_kernels", reference_quantize: bool = True,
             cuda: bool = True, rows8: str | None = None, tile4: bool = True) -> FormatKernels:
    low = name.lower()
    return FormatKernels(name, Q8_0, f"reference:dequantize_{low}",
                         f"reference:quantize_{low}" if reference_quantize else None,
                         f"{block}:block_{low}", dots=dots, driver=driver, tile_offset=tile_offset,
                         quantizer=f"{quantizer}:quantize_block_{low}" if quantizer else None, cuda=cuda,
                         rows8=rows8, tile4=tile4)


def _kquant(name: str, kgroups: tuple[str, bool] | None = None, row_kinds: str | None = None,
            quantizer: bool = True, cuda: bool = False, wide_from: int = 0,
            wide_on_avx2: bool = False) -> FormatKernels:
    low = name.lower()
    return FormatKernels(name, Q8_K, f"reference:dequantize_{low}", f"kquants_quantize:quantize_{low}",
                         f"kernels_dequant:block_{low}", matmul="matmul_kgroups" if kgroups else "matmul_kquant",
                         quantizer=f"quantize_kernels:quantize_block_{low}" if quantizer else None, cuda=cuda,
                         kgroups=kgroups, row_kinds=row_kinds, few=row_kinds is not None, wide_from=wide_from,
                         wide_on_avx2=wide_on_avx2)


WIDE_FROM_AVX2 = 16  # gemm tokens from which an 8-lane wide kernel runs (measured at 16 only)


RECORDS: tuple[FormatKernels, ...] = (
    _float("F32"),
    _float("F16"),
    _float("BF16"),
    _block32("Q4_0", DRIVER_PLAIN, 8, rows8="q4_0_rows8:matmul_q4_0_rows8"),
    _block32("Q4_1", DRIVER_MINS, 0),
    _block32("Q5_0", DRIVER_LANE_SUMS, 16),
    _block32("Q5_1", DRIVER_MINS, 0),
    _block32("Q8_0", DRIVER_PLAIN, "Q8_0_TILE_OFFSET"),
    _kquant("Q2_K", kgroups=("_scales_q2_k", False)),
    _kquant("Q3_K", kgroups=("_scales_q3_k", True)),
    # the wide kernels with 16 lanes: faster from the first gemm group (4 tokens, 8 for Q6_K's tiles) though most
    # lanes idle; Q4_K's 8-lane form is slower than its narrow one (docs/kernels.md)
    _kquant("Q4_K", row_kinds=ROWS_GEMM4, cuda=True, wide_from=4),
    _kquant("Q5_K", kgroups=("_scales_q45_k", False), cuda=True),
    _kquant("Q6_K", row_kinds=ROWS_TILED8, cuda=True, wide_from=8, wide_on_avx2=True),
    _kquant("Q8_K", kgroups=("_scales_q8_k", True), quantizer=False),
    _block32("IQ4_NL", DRIVER_PLAIN, "TILE_OFFSET_IQ4_NL", dots="iq4_nl", block="iq4_nl", quantizer="iq4_nl",
             cuda=False, tile4=False),
    FormatKernels("IQ4_XS", Q8_K, "reference:dequantize_iq4_xs", "reference:quantize_iq4_xs", "iq4_xs:block_iq4_xs",
                  matmul="iq4_xs", quantizer="iq4_xs:quantize_block_iq4_xs", row_kinds=ROWS_TILED8),
    _block32("MXFP4", DRIVER_PLAIN, "TILE_OFFSET_MXFP4", dots="mxfp4", block="mxfp4", quantizer="mxfp4", cuda=False,
             rows8="mxfp4:matmul_mxfp4_rows8", tile4=False),
)


def _check() -> dict[str, FormatKernels]:
    """Every format in the table has exactly one record, and each record fits its layout."""
    by_name = {r.name: r for r in RECORDS}
    if len(by_name) != len(RECORDS):
        raise AssertionError("duplicate format in the registry")
    table = {f.name for f in FORMATS}
    if set(by_name) != table:
        raise AssertionError(f"registry and format table differ: only in the registry {sorted(set(by_name) - table)}, "
                             f"only in the table {sorted(table - set(by_name))}")
    for r in RECORDS:
        fmt = r.format
        want = {"float": FLOAT, "block32": Q8_0, "k": Q8_K}[fmt.family]
        if r.activation != want:
            raise AssertionError(f"{r.name}: a {fmt.family} format computes with {want} activations, "
                                 f"not {r.activation}")
        if r.activation == Q8_0 and (fmt.block_size != 32 or r.dots is None or r.driver not in
                                     (DRIVER_PLAIN, DRIVER_MINS, DRIVER_LANE_SUMS)):
            raise AssertionError(f"{r.name}: a Q8_0-activation format needs 32-element blocks, dots and a driver")
        if r.activation != Q8_0 and r.matmul is None:
            raise AssertionError(f"{r.name}: needs a matmul module")
        if r.kgroups is not None and (r.activation != Q8_K or r.row_kinds is not None):
            raise AssertionError(f"{r.name}: kgroups kernels are Q8_K-activation kernels of one kind per token")
        if r.row_kinds not in (None, ROWS_GEMM4, ROWS_TILED8, ROWS_PAIRS) or (r.few and r.row_kinds is None):
            raise AssertionError(f"{r.name}: row_kinds must be one of ROWS_* (and few needs it)")
    return by_name


_BY_NAME = _check()

# The registered formats in the table's order, for tests and tools that run every one.
NAMES: tuple[str, ...] = tuple(f.name for f in FORMATS)


def kernels_for(fmt: str | BlockFormat) -> FormatKernels:
    """The record of a format (a name or a BlockFormat); UnknownFormatError for a type the table does not know."""
    return _BY_NAME[format_by_name(fmt).name]


def records(activation: str | None = None) -> tuple[FormatKernels, ...]:
    """Every record in the table's order, or those computing with one activation kind."""
    return tuple(_BY_NAME[n] for n in NAMES if activation is None or _BY_NAME[n].activation == activation)

"""The one table of GGML block formats.

Each entry names a format, its GGML type id (the same ids as gguf-py's GGMLQuantizationType), how many
elements one block holds, how many bytes it takes (written as arithmetic so it can be checked against the
C struct), and a numpy structured dtype for one block. The dtype's itemsize is checked against the byte
count at import, so a typo in either fails loudly before any tensor is read.

Code elsewhere dispatches on a `BlockFormat` (or its name), never on a bare type id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256       # elements in a K-quant super-block
K_SCALE_SIZE = 12  # bytes of packed 6-bit scales and mins in Q4_K / Q5_K


class UnknownFormatError(KeyError):
    """A GGML type name or id that this table does not know."""

    def __str__(self) -> str:  # KeyError's default str() wraps the message in quotes
        return str(self.args[0]) if self.args else "unknown GGML format"


@dataclass(frozen=True)
class BlockFormat:
    name: str            # GGML type name, e.g. "Q4_K"
    type_id: int         # GGML type id, as in gguf-py's GGMLQuantizationType
    block_size: int      # elements per block
    type_size: int       # bytes per block
    block_dtype: np.dtype  # numpy structured dtype of one block (itemsize == type_size)
    family: str          # "float" (no blocks), "block32" (32-element blocks) or "k" (256-element super-blocks)

    def row_bytes(self, n_elements: int) -> int:
        """Bytes taken by one row of n_elements (which must be a multiple of block_size)."""
        if n_elements % self.block_size:
            raise ValueError(f"row length {n_elements} is not a multiple of {self.name} block size {self.block_size}")
        return n_elements // self.block_size * self.type_size


def _dtype(*fields) -> np.dtype:
    return np.dtype(list(fields))  # packed: numpy adds no padding unless align=True


_F16 = "<f2"

FORMATS: tuple[BlockFormat, ...] = (
    BlockFormat("F32", 0, 1, 4, _dtype(("v", "<f4")), "float"),
    BlockFormat("F16", 1, 1, 2, _dtype(("v", _F16)), "float"),
    BlockFormat("Q4_0", 2, 32, 2 + 32 // 2,
                _dtype(("d", _F16), ("qs", "u1", (16,))), "block32"),
    BlockFormat("Q4_1", 3, 32, 2 + 2 + 32 // 2,
                _dtype(("d", _F16), ("m", _F16), ("qs", "u1", (16,))), "block32"),
    BlockFormat("Q5_0", 6, 32, 2 + 4 + 32 // 2,
                _dtype(("d", _F16), ("qh", "u1", (4,)), ("qs", "u1", (16,))), "block32"),
    BlockFormat("Q5_1", 7, 32, 2 + 2 + 4 + 32 // 2,
                _dtype(("d", _F16), ("m", _F16), ("qh", "u1", (4,)), ("qs", "u1", (16,))), "block32"),
    BlockFormat("Q8_0", 8, 32, 2 + 32,
                _dtype(("d", _F16), ("qs", "i1", (32,))), "block32"),
    BlockFormat("Q2_K", 10, QK_K, QK_K // 16 + QK_K // 4 + 2 + 2,
                _dtype(("scales", "u1", (16,)), ("qs", "u1", (64,)), ("d", _F16), ("dmin", _F16)), "k"),
    BlockFormat("Q3_K", 11, QK_K, QK_K // 8 + QK_K // 4 + 12 + 2,
                _dtype(("hmask", "u1", (32,)), ("qs", "u1", (64,)), ("scales", "u1", (12,)), ("d", _F16)), "k"),
    BlockFormat("Q4_K", 12, QK_K, 2 + 2 + K_SCALE_SIZE + QK_K // 2,
                _dtype(("d", _F16), ("dmin", _F16), ("scales", "u1", (12,)), ("qs", "u1", (128,))), "k"),
    BlockFormat("Q5_K", 13, QK_K, 2 + 2 + K_SCALE_SIZE + QK_K // 8 + QK_K // 2,
                _dtype(("d", _F16), ("dmin", _F16), ("scales", "u1", (12,)), ("qh", "u1", (32,)),
                       ("qs", "u1", (128,))), "k"),
    BlockFormat("Q6_K", 14, QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2,
                _dtype(("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", _F16)), "k"),
    BlockFormat("Q8_K", 15, QK_K, 4 + QK_K + QK_K // 16 * 2,
                _dtype(("d", "<f4"), ("qs", "i1", (256,)), ("bsums", "<i2", (16,))), "k"),
    BlockFormat("IQ4_NL", 20, 32, 2 + 32 // 2,
                _dtype(("d", _F16), ("qs", "u1", (16,))), "block32"),
    BlockFormat("IQ4_XS", 23, QK_K, 2 + 2 + QK_K // 64 + QK_K // 2,
                _dtype(("d", _F16), ("scales_h", "<u2"), ("scales_l", "u1", (4,)), ("qs", "u1", (128,))), "k"),
    BlockFormat("BF16", 30, 1, 2, _dtype(("v", "<u2")), "float"),
    BlockFormat("MXFP4", 39, 32, 1 + 32 // 2,  # e: an E8M0 scale (a power of two), qs: 32 E2M1 nibbles
                _dtype(("e", "u1"), ("qs", "u1", (16,))), "block32"),
)

for _fmt in FORMATS:
    if _fmt.block_dtype.itemsize != _fmt.type_size:
        raise AssertionError(f"{_fmt.name}: block dtype itemsize {_fmt.block_dtype.itemsize} != {_fmt.type_size} bytes")

_BY_NAME = {f.name: f for f in FORMATS}
_BY_ID = {f.type_id: f for f in FORMATS}
if len(_BY_NAME) != len(FORMATS) or len(_BY_ID) != len(FORMATS):
    raise AssertionError("duplicate name or type id in FORMATS")

FORMAT_NAMES: tuple[str, ...] = tuple(f.name for f in FORMATS)


def format_by_name(name: str | BlockFormat) -> BlockFormat:
    if isinstance(name, BlockFormat):
        return name
    try:
        return _BY_NAME[str(name).upper()]
    except KeyError:
        raise UnknownFormatError(f"unknown GGML format {name!r}; known: {', '.join(FORMAT_NAMES)}") from None


def format_by_id(type_id: int) -> BlockFormat:
    try:
        return _BY_ID[int(type_id)]
    except (KeyError, ValueError, TypeError):
        raise UnknownFormatError(f"unknown GGML type id {type_id!r}; known: "
                                 + ", ".join(f"{f.type_id} ({f.name})" for f in FORMATS)) from None

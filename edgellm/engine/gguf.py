"""A fast, memory-mapped, defensive GGUF reader (versions 2 and 3).

Sections: value types and the cursor that reads them; metadata; tensor infos and their checks; split models
(gguf-split's parts, opened together from the first); the header alone, from the first bytes of a remote file;
the public `open`.

The file is mapped once, read-only. Tensor data are zero-copy uint8 views into the map. Every length, count, offset
and dimension is checked against the real file size before it is used, so a malformed file raises `GGUFError` with
what is wrong and where, and nothing downstream (in particular no Numba kernel) ever sees an out-of-range buffer.
Large string arrays (token lists, merges) are only walked at open time; their text is decoded on first access.
"""
from __future__ import annotations

import mmap
import os
import re
import stat
import struct
import sys
from array import array
from dataclasses import dataclass

import numpy as np

from edgellm.errors import GGUFError
from edgellm.quant.formats import format_by_id

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_LENGTH = 1 << 16  # no real key is longer; a larger length means a corrupt file

# GGUF value types: id -> (name, numpy dtype or None for string/array)
_VALUE_TYPES = {
    0: ("UINT8", np.dtype("<u1")),
    1: ("INT8", np.dtype("<i1")),
    2: ("UINT16", np.dtype("<u2")),
    3: ("INT16", np.dtype("<i2")),
    4: ("UINT32", np.dtype("<u4")),
    5: ("INT32", np.dtype("<i4")),
    6: ("FLOAT32", np.dtype("<f4")),
    7: ("BOOL", np.dtype("<u1")),
    8: ("STRING", None),
    9: ("ARRAY", None),
    10: ("UINT64", np.dtype("<u8")),
    11: ("INT64", np.dtype("<i8")),
    12: ("FLOAT64", np.dtype("<f8")),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7

# Arrays this long are walked compiled (gguf_scan) where Numba is already imported; shorter ones cost little in Python
COMPILED_WALK_MIN = 1024

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class HeaderIncomplete(Exception):
    """read_header() was given fewer bytes than the header takes: `needed` bytes from the start would do (or more,
    for a later read)."""

    def __init__(self, needed: int):
        super().__init__(f"the header needs at least {needed} bytes")
        self.needed = needed


class _Cursor:
    """Reads little-endian values from the map, checking each read against the file's end. `avail` (the bytes at
    hand, when only the file's start is) below `size` turns a read past it into HeaderIncomplete, not an error."""

    def __init__(self, buf, size: int, avail: int | None = None):
        self.buf = buf
        self.size = size
        self.avail = size if avail is None else min(avail, size)
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                f"file truncated or corrupt: {what} needs {n} bytes at offset {self.pos}, "
                f"but the file has {self.size} bytes"
            )
        if self.pos + n > self.avail:
            raise HeaderIncomplete(self.pos + n)

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str, max_len: int | None = None) -> bytes:
        n = self.u64(f"length of {what}")
        if max_len is not None and n > max_len:
            raise GGUFError(f"{what} at offset {self.pos - 8} claims length {n}, over the limit of {max_len}")
        self.need(n, what)
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s

    def string(self, what: str, max_len: int | None = None) -> str:
        start = self.pos
        raw = self.raw_string(what, max_len)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what} at offset {start} is not valid UTF-8 ({e.reason})") from None


class LazyStrings:
    """A GGUF string array left in the map: element i is the UTF-8 text at buffer[offsets[i] + 8 : offsets[i + 1]]
    (offsets[i] is where its 8-byte length sits, offsets[n] the array's end), decoded with errors="replace".

    Nothing is decoded at open. A 262k-token vocabulary costs 4 bytes a string here against ~80 as list[str] (the
    str objects alone are ~19 MiB for Gemma 3), so the tokenizer reads the text in place (Metadata.lazy,
    edgellm/tokenizer/strings.py); to_list() is for readers that want every string."""

    PREFIX = 8  # the length before each element's text

    def __init__(self, buf, offsets: np.ndarray):
        self.buffer = buf
        self.offsets = offsets
        self._list: list[str] | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def to_list(self) -> list[str]:
        if self._list is None:
            buf, prefix, bounds = self.buffer, self.PREFIX, self.offsets.tolist()
            self._list = [buf[s + prefix:e].decode("utf-8", errors="replace") for s, e in zip(bounds, bounds[1:])]
        return self._list


class Metadata(dict):
    """dict of key -> plain value; string arrays are decoded to list[str] the first time they are read."""

    def __getitem__(self, key):
        v = dict.__getitem__(self, key)
        if isinstance(v, LazyStrings):
            v = v.to_list()
            dict.__setitem__(self, key, v)
        return v

    def get(self, key, default=None):
        return self[key] if key in self else default

    def lazy(self, key, default=None):
        """The value as stored: a string array not yet read through [] stays a LazyStrings (its text left in the
        map), for readers such as the tokenizer that must not turn a 262k-entry array into Python objects."""
        return dict.get(self, key, default)

    def items(self):
        return ((k, self[k]) for k in self.keys())

    def values(self):
        return (self[k] for k in self.keys())


def _read_value(cur: _Cursor, vtype: int, key: str):
    if vtype not in _VALUE_TYPES:
        raise GGUFError(f"metadata key {key!r} has unknown value type {vtype} (offset {cur.pos - 4})")
    if vtype == _STRING:
        return cur.string(f"string value of {key!r}")
    if vtype == _ARRAY:
        etype = cur.u32(f"element type of array {key!r}")
        count = cur.u64(f"element count of array {key!r}")
        if etype not in _VALUE_TYPES or etype == _ARRAY:
            raise GGUFError(f"array {key!r} has unsupported element type {etype}")
        if etype == _STRING:
            return _read_string_array(cur, count, key)
        dtype = _VALUE_TYPES[etype][1]
        nbytes = count * dtype.itemsize
        cur.need(nbytes, f"{count} elements of array {key!r}")
        arr = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=cur.pos).copy()
        cur.pos += nbytes
        return arr.astype(bool) if etype == _BOOL else arr
    dtype = _VALUE_TYPES[vtype][1]
    cur.need(dtype.itemsize, f"value of {key!r}")
    v = np.frombuffer(cur.buf, dtype=dtype, count=1, offset=cur.pos)[0]
    cur.pos += dtype.itemsize
    if vtype == _BOOL:
        return bool(v)
    return float(v) if dtype.kind == "f" else int(v)


def _read_string_array(cur: _Cursor, count: int, key: str) -> LazyStrings:
    # Each element takes at least 8 bytes (its length), so a count the file cannot hold is refused before any work.
    if count * 8 > cur.size - cur.pos:
        raise GGUFError(f"string array {key!r} claims {count} elements, more than the rest of the file can hold")
    if count >= COMPILED_WALK_MIN and "numba" in sys.modules:
        from edgellm.engine import gguf_scan  # imports Numba: only taken where a model load already has it
        offsets = gguf_scan.walk(cur.buf, cur.pos, count, cur.avail)
        if offsets is not None:
            cur.pos = int(offsets[-1])
            return LazyStrings(cur.buf, offsets)
        # not well formed: the walk below says what is wrong and where
    # Grown as elements are walked, not sized by the claimed count: a corrupt count that the file could hold
    # (up to size/8) must not reserve 8 bytes per claimed element before the walk finds the corruption.
    offsets = array("q")
    add_offset = offsets.append
    buf, size, avail, pos, unpack = cur.buf, cur.size, cur.avail, cur.pos, _U64.unpack_from
    for i in range(count):
        if pos + 8 > size:
            raise GGUFError(f"string array {key!r} truncated at element {i} (offset {pos})")
        if pos + 8 > avail:
            raise HeaderIncomplete(pos + 8)
        (n,) = unpack(buf, pos)
        add_offset(pos)
        pos += 8
        if n > size - pos:
            raise GGUFError(f"string {i} of array {key!r} claims length {n} at offset {pos - 8}, past the end of the file")
        pos += n
    if pos > avail:
        raise HeaderIncomplete(pos)
    add_offset(pos)
    cur.pos = pos
    bounds = np.frombuffer(offsets, dtype=np.int64)
    # 4 bytes an element where the array ends below 4 GiB, as metadata does in any real file
    return LazyStrings(buf, bounds.astype(np.uint32) if pos < 1 << 32 else bounds)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: str        # the block format's name, e.g. "Q4_K"
    shape: tuple          # numpy order, outermost first
    offset: int           # absolute byte offset in the file
    nbytes: int
    data: np.ndarray      # zero-copy uint8 view of the raw bytes (None in a header read without the data)
    file: str = ""        # the file that holds the data: a split model's tensors each map from their own part

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class GGUFFile:
    """An open GGUF file: `.metadata`, `.tensors`, `.version`, `.path`. Use as a context manager or call `close()`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.parts: list[GGUFFile] = []  # a split model's other parts, whose tensors are in self.tensors too
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file") from None
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise GGUFError(f"{self.path}: is a directory, not a GGUF file")
            if not stat.S_ISREG(st.st_mode):
                raise GGUFError(f"{self.path}: not a regular file")
            self.size = st.st_size
            if self.size < 24:
                raise GGUFError(f"{self.path}: {self.size} bytes is too small to be a GGUF file")
            self._mmap = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            self._parse()
        except GGUFError as e:
            self.close()
            raise GGUFError(f"{self.path}: {e}") from None
        except BaseException:
            self.close()
            raise

    # -- parsing -------------------------------------------------------------------------------------------------
    def _parse(self, buf=None, avail: int | None = None) -> None:
        """Read the header from `buf` (default: the map); with `avail` below the size, only the file's first bytes
        are at hand and tensors get no data view."""
        buf = self._mmap if buf is None else buf
        cur = _Cursor(buf, self.size, avail)
        cur.need(4, "magic")
        magic = bytes(buf[0:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"bad magic {magic!r}: not a GGUF file (expected {GGUF_MAGIC!r})")
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            hint = " (big-endian file?)" if self.version > 0xFFFF else ""
            raise GGUFError(f"unsupported GGUF version {self.version}{hint}; supported: {SUPPORTED_VERSIONS}")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # A key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor info at least 8 + 4 + 4 + 8.
        if n_kv * 13 > self.size or n_tensors * 24 > self.size:
            raise GGUFError(f"absurd counts: {n_kv} metadata entries and {n_tensors} tensors in a {self.size}-byte file")

        meta = Metadata()
        for i in range(n_kv):
            key = cur.string(f"key of metadata entry {i}", MAX_KEY_LENGTH)
            if key in meta:
                raise GGUFError(f"duplicate metadata key {key!r}")
            vtype = cur.u32(f"value type of {key!r}")
            dict.__setitem__(meta, key, _read_value(cur, vtype, key))
        self.metadata = meta

        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"general.alignment must be a positive power of two, got {alignment!r}")
        self.alignment = alignment

        infos = [self._read_tensor_info(cur, i) for i in range(n_tensors)]
        self.data_offset = -(-cur.pos // alignment) * alignment
        self.tensors = self._check_tensors(infos, buf if cur.avail == self.size else None)

    def _read_tensor_info(self, cur: _Cursor, i: int):
        name = cur.string(f"name of tensor {i}", MAX_KEY_LENGTH)
        n_dims = cur.u32(f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [cur.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
        type_id = cur.u32(f"type of tensor {name!r}")
        offset = cur.u64(f"data offset of tensor {name!r}")
        return name, dims, type_id, offset

    def _check_tensors(self, infos, buf) -> dict[str, GGUFTensor]:
        data_size = self.size - self.data_offset
        if data_size < 0:
            raise GGUFError("tensor data section starts past the end of the file")
        tensors: dict[str, GGUFTensor] = {}
        spans = []
        for name, dims, type_id, offset in infos:
            if name in tensors:
                raise GGUFError(f"duplicate tensor name {name!r}")
            try:
                fmt = format_by_id(type_id)
            except KeyError:
                raise GGUFError(f"tensor {name!r} has unknown or unsupported ggml type {type_id}") from None
            if any(d <= 0 for d in dims):
                raise GGUFError(f"tensor {name!r} has a zero dimension: {dims}")
            n_el = 1
            for d in dims:  # Python ints: no overflow; refuse what cannot fit in the file anyway
                n_el *= d
            if n_el > data_size * 8 or n_el >= 1 << 62:
                raise GGUFError(f"tensor {name!r} dimensions {dims} are absurd for a {self.size}-byte file")
            if dims[0] % fmt.block_size:
                raise GGUFError(
                    f"tensor {name!r}: row length {dims[0]} is not a multiple of {fmt.name}'s block size {fmt.block_size}"
                )
            nbytes = n_el // fmt.block_size * fmt.type_size
            if offset % self.alignment:
                raise GGUFError(f"tensor {name!r}: data offset {offset} is not aligned to {self.alignment}")
            if offset + nbytes > data_size:
                raise GGUFError(
                    f"tensor {name!r}: data [{offset}, {offset + nbytes}) runs past the end of the data section "
                    f"({data_size} bytes; file truncated?)"
                )
            spans.append((offset, offset + nbytes, name))
            start = self.data_offset + offset
            view = None if buf is None else np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start)
            tensors[name] = GGUFTensor(name, fmt.name, tuple(int(d) for d in reversed(dims)), start, nbytes, view,
                                       self.path)
        spans.sort()
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFError(f"tensors {n0!r} and {n1!r} overlap (bytes {s1}..{e0} of the data section)")
        return tensors

    # -- conveniences --------------------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: general.architecture is missing")
        return arch

    def close(self) -> None:
        # Views into the map keep it alive; drop ours and let the map close once nobody holds a view.
        self.tensors = {}
        for part in getattr(self, "parts", ()):
            part.close()
        self.parts = []
        m = getattr(self, "_mmap", None)
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # numpy views still reference it; it is released with them
            self._mmap = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, version={self.version}, tensors={len(self.tensors)}, metadata={len(self.metadata)})"


# ---------------------------------------------------------------------------------------------------------------
# Split models: gguf-split writes NAME-00001-of-00003.gguf ...; the first part holds all metadata, every part holds
# split.no (u16, from 0), split.count (u16) and split.tensors.count (i32, the total), and its own tensors.
# ---------------------------------------------------------------------------------------------------------------

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf$")


def split_part_paths(path: str, count: int) -> list[str]:
    """The paths of all parts of a split model, given its first part (llama.cpp's llama_split_path layout)."""
    head, name = os.path.split(path)
    m = _SPLIT_NAME.match(name)
    if not m or int(m["no"]) != 1 or int(m["count"]) != count:
        raise GGUFError(f"{path}: split.count is {count}, but the file name does not end in "
                        f"-00001-of-{count:05d}.gguf as gguf-split names the first part, so the others cannot be found")
    return [os.path.join(head, f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _split_int(f, key: str, path: str) -> int:
    v = f.metadata.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise GGUFError(f"{path}: split metadata {key!r} is missing or not an integer ({v!r})")
    return v


def _open_split_parts(first: GGUFFile) -> None:
    """Open a split model's other parts beside `first` and add their tensors (each mapped from its own file)."""
    count = first.metadata.get(SPLIT_COUNT)
    if count is None or (isinstance(count, int) and not isinstance(count, bool) and count <= 1):
        return
    count = _split_int(first, SPLIT_COUNT, first.path)
    no = _split_int(first, SPLIT_NO, first.path)
    if no != 0:
        raise GGUFError(f"{first.path} is part {no + 1} of a {count}-part split model; open its first part "
                        f"(-00001-of-{count:05d}.gguf), which opens the others")
    expected = _split_int(first, SPLIT_TENSORS, first.path)
    for i, part_path in enumerate(split_part_paths(first.path, count)[1:], start=1):
        if not os.path.exists(part_path):
            raise GGUFError(f"{first.path}: part {i + 1} of {count} of this split model is missing ({part_path})")
        part = GGUFFile(part_path)
        first.parts.append(part)  # closed with first, also when a check below fails
        for key, want in ((SPLIT_NO, i), (SPLIT_COUNT, count), (SPLIT_TENSORS, expected)):
            got = _split_int(part, key, part_path)
            if got != want:
                raise GGUFError(f"{part_path}: {key} is {got}, expected {want} for part {i + 1} of {count} of "
                                f"{os.path.basename(first.path)}: the parts do not belong together")
        for name, t in part.tensors.items():
            if name in first.tensors:
                raise GGUFError(f"{part_path}: tensor {name!r} is also in an earlier part of the split model")
            first.tensors[name] = t
    if len(first.tensors) != expected:
        raise GGUFError(f"{first.path}: split.tensors.count is {expected}, but the {count} parts hold "
                        f"{len(first.tensors)} tensors")


# ---------------------------------------------------------------------------------------------------------------
# The header alone: a remote file's metadata and tensor table, read from its first bytes
# ---------------------------------------------------------------------------------------------------------------

class GGUFHeader(GGUFFile):
    """Metadata and tensor infos (no data views) from the first bytes of a file of `size` bytes. Raises
    HeaderIncomplete(needed) when `data` is too short, GGUFError when the header is malformed."""

    def __init__(self, data: bytes, size: int, path: str = "<header>"):
        self.path, self.size, self.parts, self._mmap = path, int(size), [], None
        try:
            self._parse(data, len(data))
        except GGUFError as e:
            raise GGUFError(f"{self.path}: {e}") from None

    def add_part(self, part: "GGUFHeader") -> None:
        """Merge the tensors of another split part's header (for a size estimate before a download)."""
        self.tensors = {**self.tensors, **part.tensors}


def read_header(data: bytes, size: int, path: str = "<header>") -> GGUFHeader:
    return GGUFHeader(data, size, path)


def open(path: str | os.PathLike) -> GGUFFile:  # noqa: A001 - mirrors the builtin on purpose: edgellm.engine.gguf.open
    """Open and validate a GGUF file; the first part of a split model opens all its parts. Raises GGUFError on
    anything malformed, missing or mismatched."""
    f = GGUFFile(path)
    try:
        _open_split_parts(f)
    except BaseException:
        f.close()
        raise
    return f

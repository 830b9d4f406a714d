"""What tools/fuzz_gguf.py feeds the GGUF reader: seed files, mutations of them, and synthetic files.

Case i of seed s draws from random.Random(f"{s}:{i}"), so any case can be rebuilt alone (make_case). Seeds:
  * the condensed header of each real model (every array cut to its first KEEP elements, all tensor infos
    verbatim) with its data section as a sparse file of the real size, cut short, or absent;
  * the raw first 64 KB - 1 MB of each real model (the tensor data, and most of the vocabulary, cut off);
  * a small valid file with every value type and a few tensors.
Mutations write interesting values into the fields of a seed's layout (lengths, counts, types, dims, offsets;
one tensor's dims multiplied past 2**64; offsets copied from another tensor to overlap), change values' bytes,
truncate at structural boundaries, flip bytes and splice. One case in five is instead a synthetic file with random
metadata types and lengths, huge or lying counts, and hostile tensor tables.

Sections: the layout walker; seeds; mutations; synthetic files; cases.
"""
from __future__ import annotations

import mmap
import os
import random
import struct
from dataclasses import dataclass, field

KEEP = 512                        # array elements a condensed real header keeps (covers Gemma's byte tokens)
PREFIX_SIZES = (65536, 262144, 1 << 20)
ALIGN = 32
STRING, ARRAY = 8, 9
SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
GGML_TYPE_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                   10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 30: (1, 2)}
REAL_MODELS = ("smollm2-135m", "gemma-3-270m")

# ---------------------------------------------------------------------------------------------------------------
# The layout walker: where every field of a (valid) header sits
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    offset: int
    size: int
    kind: str          # magic version count key_length length text vtype etype value array ndims dim ggml_type offset
    tensor: int = -1   # index of the tensor info a field belongs to


class _End(Exception):
    pass


def field_map(buf: bytes) -> list[Field]:
    """Fields of a well-formed GGUF header, stopping quietly where the bytes end."""
    fields: list[Field] = []
    pos = 0

    def take(size, kind, tensor=-1):
        nonlocal pos
        if size < 0 or pos + size > len(buf):
            raise _End
        fields.append(Field(pos, size, kind, tensor))
        pos += size
        return int.from_bytes(buf[pos - size:pos], "little") if size in (4, 8) else None

    def string(kind="length", tensor=-1):
        n = take(8, kind, tensor)
        if n:
            take(n, "text", tensor)

    def value(vtype):
        if vtype == STRING:
            string()
        elif vtype == ARRAY:
            etype, count = take(4, "etype"), take(8, "count")
            if etype == STRING:
                for _ in range(count):
                    string()
            elif count:
                take(count * SCALAR_SIZE[etype], "array")
        else:
            take(SCALAR_SIZE[vtype], "value")

    try:
        take(4, "magic")
        take(4, "version")
        n_tensors, n_kv = take(8, "count"), take(8, "count")
        for _ in range(n_kv):
            string("key_length")
            value(take(4, "vtype"))
        for i in range(n_tensors):
            string("length", i)
            for _ in range(take(4, "ndims", i)):
                take(8, "dim", i)
            take(4, "ggml_type", i)
            take(8, "offset", i)
    except (_End, KeyError):
        pass
    return fields


# ---------------------------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Seed:
    name: str
    data: bytes            # the bytes written before any sparse tail
    data_size: int = 0     # bytes of tensor data after the (padded) header, written as a sparse tail
    fields: list = field(default_factory=list)

    def __post_init__(self):
        self.fields = field_map(self.data)
        self.ints = [f for f in self.fields if f.size in (4, 8) and f.kind not in ("text", "value", "array")]
        self.by_kind: dict[str, list[Field]] = {}
        for f in self.ints:
            self.by_kind.setdefault(f.kind, []).append(f)
        self.payload = [f for f in self.fields if f.kind in ("text", "value", "array")]
        self.boundaries = sorted({f.offset for f in self.fields} | {f.offset + f.size for f in self.fields})
        self.tensor_fields: dict[int, list[Field]] = {}
        for f in self.fields:
            if f.tensor >= 0:
                self.tensor_fields.setdefault(f.tensor, []).append(f)


def _skip_value(buf, pos, vtype) -> int:
    if vtype == STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    return pos + SCALAR_SIZE[vtype]


def condense(buf) -> tuple[bytes, int]:
    """A real file's header with every array cut to its first KEEP elements; returns (header, data size)."""
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    out, pos = bytearray(buf[:24]), 24
    for _ in range(n_kv):
        start = pos
        pos = _skip_value(buf, pos, STRING)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if vtype != ARRAY:
            pos = _skip_value(buf, pos, vtype)
            out += buf[start:pos]
            continue
        etype, count = struct.unpack_from("<IQ", buf, pos)
        elements = pos + 12
        kept = min(count, KEEP)
        if etype == STRING:
            pos = elements
            for i in range(count):
                if i == kept:
                    kept_end = pos
                pos = _skip_value(buf, pos, STRING)
            if kept == count:
                kept_end = pos
        else:
            kept_end = elements + kept * SCALAR_SIZE[etype]
            pos = elements + count * SCALAR_SIZE[etype]
        out += buf[start:elements - 8] + struct.pack("<Q", kept) + buf[elements:kept_end]
    infos = pos
    for _ in range(n_tensors):
        pos = _skip_value(buf, pos, STRING)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        pos += 4 + 8 * n_dims + 4 + 8
    out += buf[infos:pos]
    data_start = -(-pos // ALIGN) * ALIGN
    out += b"\0" * (-len(out) % ALIGN)
    return bytes(out), len(buf) - data_start


def real_model_paths() -> list[str]:
    """Paths of the real models already on disk ($EDGELLM_MODELS or the catalog's cache); nothing is downloaded."""
    from edgellm.store import catalog
    paths = [catalog.models_dir() / catalog.lookup(name).file for name in REAL_MODELS]
    return [str(p) for p in paths if p.is_file()]


def small_valid_file() -> bytes:
    """Every metadata value type, a string array, and F32 / Q8_0 / Q4_K tensors laid out aligned."""
    kvs = [_kv("general.architecture", STRING, "llama"), _kv("general.alignment", 4, 32)]
    for vtype in SCALAR_SIZE:
        kvs.append(_kv(f"test.t{vtype}", vtype, 1))
    kvs.append(_kv("test.strings", ARRAY, (STRING, ["a", "héllo", "", "🙂"])))
    kvs.append(_kv("test.floats", ARRAY, (6, [0.5, -1.0])))
    tensors = [("w.f32", [8, 3], 0), ("w.q8", [64, 2], 8), ("w.q4k", [256, 1], 12)]
    return _assemble(kvs, tensors, [None] * 3)


def load_seeds() -> list[Seed]:
    seeds = [Seed("small-valid", small_valid_file())]
    for path in real_model_paths():
        with open(path, "rb") as f:
            prefix = f.read(max(PREFIX_SIZES))
            f.seek(0)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                header, data_size = condense(m)
        stem = os.path.basename(path).split(".")[0]
        seeds.append(Seed(f"{stem}-condensed", header, data_size))
        for n in PREFIX_SIZES:
            seeds.append(Seed(f"{stem}-prefix{n // 1024}k", prefix[:n]))
    return seeds


# ---------------------------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------------------------

U32_VALUES = (0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 14, 15, 16, 30, 31, 127, 255, 2**16, 2**31 - 1, 2**31,
              2**32 - 2, 2**32 - 1)
U64_VALUES = (0, 1, 2, 8, 31, 32, 33, 255, 256, 4096, 65536, 65537, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
              2**32 + 1, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1)
DIM_VALUES = (0, 1, 2, 31, 32, 33, 256, 257, 4096, 2**31, 2**32, 2**32 + 32, 2**33, 2**62, 2**63, 2**64 - 1)
TYPE_VALUES = tuple(range(0, 42)) + (2**31, 2**32 - 1)


def interesting(rng: random.Random, f: Field, seed: Seed, old: int) -> int:
    size = len(seed.data) + seed.data_size
    kind = f.kind
    if kind in ("vtype", "etype", "ggml_type"):
        return rng.choice(TYPE_VALUES)
    if kind == "ndims":
        return rng.choice((0, 1, 2, 3, 4, 5, 8, 2**32 - 1))
    if kind == "dim":
        return rng.choice(DIM_VALUES + (old * 2, old + 1, max(old - 1, 0)))
    if kind == "offset":
        others = [int.from_bytes(seed.data[g.offset:g.offset + 8], "little")
                  for g in seed.ints if g.kind == "offset" and g is not f]
        pool = list(U64_VALUES) + [old + 1, old + ALIGN, max(old - ALIGN, 0), seed.data_size,
                                   seed.data_size - ALIGN, size]
        if others:
            pool += [rng.choice(others)] * 4      # overlap with another tensor
        return rng.choice(pool) % 2**64
    if f.size == 4:
        return rng.choice(U32_VALUES + (old + 1, max(old - 1, 0), rng.getrandbits(32)))
    return rng.choice(U64_VALUES + (old + 1, max(old - 1, 0), size, size - 1, size + 1, rng.getrandbits(64)))


def mutate(rng: random.Random, seed: Seed) -> bytearray:
    buf = bytearray(seed.data)
    for _ in range(rng.choice((1, 1, 1, 1, 2, 2, 3, 4))):
        op = rng.random()
        if op < 0.40 and seed.by_kind:          # an interesting value in a structural field, kinds equally likely
            f = rng.choice(seed.by_kind[rng.choice(sorted(seed.by_kind))])
            if f.offset + f.size <= len(buf):
                old = int.from_bytes(buf[f.offset:f.offset + f.size], "little")
                new = interesting(rng, f, seed, old) % (1 << (8 * f.size))
                buf[f.offset:f.offset + f.size] = new.to_bytes(f.size, "little")
        elif op < 0.50 and seed.payload:        # a value's bytes (token texts, ids, scores, flags): layout intact
            f = rng.choice(seed.payload)
            for _ in range(rng.randint(1, 4)):
                i = f.offset + rng.randrange(f.size)
                if i < len(buf):
                    buf[i] = rng.choice((0, 0xFF, 0x80, 0xC3, 0x3C, rng.getrandbits(8)))
        elif op < 0.57 and seed.tensor_fields:  # one tensor's dimensions multiply past 2**64
            dims = [g for g in seed.tensor_fields[rng.choice(list(seed.tensor_fields))] if g.kind == "dim"]
            for g in dims:
                if g.offset + 8 <= len(buf):
                    buf[g.offset:g.offset + 8] = rng.choice((2**32 + 32, 2**33, 2**40, 2**63)).to_bytes(8, "little")
        elif op < 0.70 and seed.boundaries:     # truncation at a structural boundary
            cut = rng.choice(seed.boundaries) + rng.choice((-1, 0, 0, 0, 1))
            del buf[max(cut, 0):]
        elif op < 0.85 and buf:                 # byte flips
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(buf))
                buf[i] = rng.choice((0, 0xFF, 0x7F, 0x80, buf[i] ^ (1 << rng.randrange(8)), rng.getrandbits(8)))
        elif buf:                               # splice: delete, duplicate or insert a chunk
            i = rng.randrange(len(buf))
            n = rng.choice((1, 4, 8, 13, 64, 500))
            kind = rng.randrange(3)
            if kind == 0:
                del buf[i:i + n]
            elif kind == 1:
                buf[i:i] = buf[i:i + n]
            else:
                buf[i:i] = bytes(rng.getrandbits(8) for _ in range(n))
    return buf


def sparse_tail(rng: random.Random, seed: Seed, header_len: int) -> int:
    """How many zero bytes follow the header: the full data section, a cut one, or none."""
    if not seed.data_size:
        return 0
    pad = -header_len % ALIGN
    choice = rng.random()
    if choice < 0.6:
        return pad + seed.data_size
    if choice < 0.9:
        return rng.randrange(pad + seed.data_size)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Synthetic files: random metadata types and lengths, hostile tensor tables
# ---------------------------------------------------------------------------------------------------------------

def _str(s) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key, vtype, value) -> bytes:
    out = _str(key) + struct.pack("<I", vtype)
    if vtype == STRING:
        return out + _str(value)
    if vtype == ARRAY:
        etype, items = value
        out += struct.pack("<IQ", etype, len(items))
        if etype == STRING:
            return out + b"".join(_str(x) for x in items)
        return out + b"".join(struct.pack(SCALAR_FMT[etype], x) for x in items)
    return out + struct.pack(SCALAR_FMT[vtype], value)


def _assemble(kvs, tensors, offsets, version=3, n_tensors=None, n_kv=None, data_extra=0) -> bytes:
    """tensors: (name, ggml dims, type id); offsets[i] None = next aligned slot, else that value."""
    infos, cursor, data_end = [], 0, 0
    for (name, dims, type_id), forced in zip(tensors, offsets):
        block, type_size = GGML_TYPE_SIZES.get(type_id, (1, 1))
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * type_size if n < 2**40 else 0
        offset = cursor if forced is None else forced
        cursor = -(-(offset + nbytes) // ALIGN) * ALIGN if forced is None else cursor
        data_end = max(data_end, min(offset + nbytes, 1 << 16))
        infos.append(_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d % 2**64) for d in dims)
                     + struct.pack("<IQ", type_id % 2**32, offset % 2**64))
    header = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                   len(kvs) if n_kv is None else n_kv)
    body = header + b"".join(kvs) + b"".join(infos)
    body += b"\0" * (-len(body) % ALIGN)
    return body + b"\0" * max(data_end + data_extra, 0)


def _random_value(rng: random.Random, vtype: int):
    if vtype == STRING:
        return rng.choice(("", "llama", "x" * rng.randint(0, 300), "é🙂", "\x00\x01"))
    fmt = SCALAR_FMT[vtype]
    bits = struct.calcsize(fmt) * 8
    if fmt[-1] in "fd":
        return rng.choice((0.0, -1.5, 1e30, float("inf"), float("nan")))
    if fmt[-1].islower():
        return rng.randrange(-(1 << (bits - 1)), 1 << (bits - 1))
    return rng.randrange(1 << bits)


def synthetic(rng: random.Random) -> bytes:
    kvs = []
    for i in range(rng.randint(0, 6)):
        key = rng.choice((f"k{i}", f"general.k{i}", "", "é" * rng.randint(1, 40)))
        roll = rng.random()
        if roll < 0.1:                          # a raw entry whose declared lengths lie
            kvs.append(_str(key) + struct.pack("<I", rng.choice(TYPE_VALUES))
                       + struct.pack("<Q", rng.choice(U64_VALUES)) + bytes(rng.randint(0, 16)))
        elif roll < 0.15:                       # a key whose bytes are not UTF-8
            kvs.append(_str(b"\xff\xfe" + bytes([rng.getrandbits(8)])) + struct.pack("<IB", 0, 1))
        elif roll < 0.35:
            etype = rng.choice(list(SCALAR_SIZE) + [STRING])
            items = [_random_value(rng, etype) for _ in range(rng.randint(0, 20))]
            kvs.append(_kv(key, ARRAY, (etype, items)))
        else:
            vtype = rng.choice(list(SCALAR_SIZE) + [STRING])
            kvs.append(_kv(key, vtype, _random_value(rng, vtype)))
    if rng.random() < 0.3:                      # alignment of a random type and value
        vtype = rng.choice((4, 4, 5, 10, 6, STRING, 7))
        value = {4: rng.choice((0, 1, 3, 16, 32, 64, 2**31, 2**32 - 1)), 5: rng.choice((-32, 0, 32)),
                 10: rng.choice((32, 2**63, 2**40)), 6: 32.0, STRING: "32", 7: 1}[vtype]
        kvs.append(_kv("general.alignment", vtype, value))
    tensors, offsets = [], []
    for i in range(rng.randint(0, 6)):
        name = rng.choice((f"t{i}", f"t{i}", "t0", "é" * 3))
        type_id = rng.choice(list(GGML_TYPE_SIZES) * 3 + [4, 5, 9, 16, 31, 40, 2**32 - 1])
        block = GGML_TYPE_SIZES.get(type_id, (1, 1))[0]
        n_dims = rng.choice((1, 2, 2, 3, 4, 0, 5))
        dims = [rng.choice((block, 2 * block, 1, 3)) if k == 0 else rng.choice((1, 2, 3, 7)) for k in range(n_dims)]
        if rng.random() < 0.25 and dims:        # huge dims; their product may pass 2**64
            for k in range(len(dims)):
                dims[k] = rng.choice(DIM_VALUES)
        offset = rng.choice((None, None, None, 0, 1, ALIGN, 2**64 - ALIGN, 2**63, 2**40))
        tensors.append((name, dims, type_id))
        offsets.append(offset)
    lie = rng.random()
    return _assemble(kvs, tensors, offsets, version=rng.choice((3, 3, 3, 2, 1, 4)),
                     n_tensors=rng.choice(U64_VALUES) if lie < 0.05 else None,
                     n_kv=rng.choice(U64_VALUES) if 0.05 <= lie < 0.1 else None,
                     data_extra=rng.choice((0, 0, -1, -ALIGN, 100)))



# ---------------------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------------------

def make_case(index: int, seed: int, seeds: list[Seed]) -> tuple[bytes, int, str]:
    """(bytes, sparse zero tail, seed name) of case `index`."""
    rng = random.Random(f"{seed}:{index}")
    if rng.random() < 0.2:
        return synthetic(rng), 0, "synthetic"
    weights = [10 if s.data_size else (3 if s.name == "small-valid" else 1) for s in seeds]
    chosen = rng.choices(seeds, weights)[0]
    data = bytes(mutate(rng, chosen))
    return data, sparse_tail(rng, chosen, len(data)), chosen.name


def write_case(workdir: str, data: bytes, tail: int) -> str:
    # A fresh inode each time: a file still mapped by an earlier case must never be truncated under its map.
    tmp, path = os.path.join(workdir, "case.tmp"), os.path.join(workdir, "case.gguf")
    with open(tmp, "wb") as f:
        f.write(data)
        if tail:
            f.truncate(len(data) + tail)
    os.replace(tmp, path)
    return path

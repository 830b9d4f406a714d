"""Writes small GGUF files byte by byte, so tests can build valid ones and break them in precise ways."""
import struct

import numpy as np

TYPE_IDS = {"UINT8": 0, "INT8": 1, "UINT16": 2, "INT16": 3, "UINT32": 4, "INT32": 5, "FLOAT32": 6, "BOOL": 7,
            "STRING": 8, "ARRAY": 9, "UINT64": 10, "INT64": 11, "FLOAT64": 12}
_FMT = {"UINT8": "<B", "INT8": "<b", "UINT16": "<H", "INT16": "<h", "UINT32": "<I", "INT32": "<i",
        "FLOAT32": "<f", "BOOL": "<?", "UINT64": "<Q", "INT64": "<q", "FLOAT64": "<d"}


def gguf_string(s) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, value) -> bytes:
    out = gguf_string(key) + struct.pack("<I", TYPE_IDS[vtype])
    if vtype == "STRING":
        return out + gguf_string(value)
    if vtype == "ARRAY":
        etype, items = value
        out += struct.pack("<IQ", TYPE_IDS[etype], len(items))
        if etype == "STRING":
            return out + b"".join(gguf_string(x) for x in items)
        return out + b"".join(struct.pack(_FMT[etype], x) for x in items)
    return out + struct.pack(_FMT[vtype], value)


def tensor_info(name, dims_ggml_order, type_id, offset) -> bytes:
    return (gguf_string(name) + struct.pack("<I", len(dims_ggml_order))
            + b"".join(struct.pack("<Q", d) for d in dims_ggml_order) + struct.pack("<IQ", type_id, offset))


def build(kvs, tensors, version=3, alignment=32, magic=b"GGUF", n_tensors=None, n_kv=None):
    """kvs: list of kv() bytes; tensors: list of (name, dims ggml order, type id, raw bytes) laid out aligned.
    Returns (file bytes, list of (name, absolute data offset))."""
    infos, blobs, offset = [], [], 0
    for name, dims, type_id, raw in tensors:
        offset = -(-offset // alignment) * alignment
        infos.append(tensor_info(name, dims, type_id, offset))
        blobs.append((offset, raw))
        offset += len(raw)
    header = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    meta = header + b"".join(kvs) + b"".join(infos)
    data_start = -(-len(meta) // alignment) * alignment
    body = bytearray(meta + b"\0" * (data_start - len(meta)))
    for off, raw in blobs:
        need = data_start + off - len(body)
        body += b"\0" * need + raw
    return bytes(body), data_start


def sample_file():
    """A small valid file: every metadata type, an F32 matrix and a Q8_0 matrix. Returns (bytes, expectations)."""
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 8)).astype(np.float32)            # numpy (3, 8): ggml dims (8, 3)
    q8 = np.zeros((2, 34 * 2), dtype=np.uint8)                       # 2 rows of 64 values: 2 Q8_0 blocks each
    q8[:, :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    q8[:, 2:34] = rng.integers(0, 256, (2, 32), dtype=np.uint8)
    q8[:, 34:36] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    q8[:, 36:] = rng.integers(0, 256, (2, 32), dtype=np.uint8)
    kvs = [
        kv("general.architecture", "STRING", "llama"),
        kv("test.u8", "UINT8", 200), kv("test.i8", "INT8", -100), kv("test.u16", "UINT16", 60000),
        kv("test.i16", "INT16", -30000), kv("test.u32", "UINT32", 4_000_000_000), kv("test.i32", "INT32", -2_000_000_000),
        kv("test.f32", "FLOAT32", 1.5), kv("test.bool", "BOOL", True), kv("test.u64", "UINT64", 2**63),
        kv("test.i64", "INT64", -(2**62)), kv("test.f64", "FLOAT64", 2.25),
        kv("test.strings", "ARRAY", ("STRING", ["a", "héllo", "", "🙂"])),
        kv("test.floats", "ARRAY", ("FLOAT32", [0.5, -1.0, 2.0])),
        kv("test.ints", "ARRAY", ("INT32", [1, -2, 3])),
    ]
    tensors = [("w.f32", (8, 3), 0, f32.tobytes()), ("w.q8", (64, 2), 8, q8.tobytes())]
    data, data_start = build(kvs, tensors)
    return data, {"f32": f32, "q8_raw": q8}

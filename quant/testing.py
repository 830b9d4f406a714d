"""Random and hand-built GGML blocks for tests and benchmarks (plain numpy: importing it compiles nothing)."""

import numpy as np

from .formats import BlockFormat, format_by_name


def random_blocks(fmt: BlockFormat, n_blocks: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """n_blocks random blocks as flat uint8: random quant bytes, finite random scales (no NaN/inf patterns)."""
    raw = rng.integers(0, 256, n_blocks * fmt.type_size, dtype=np.uint8)
    blocks = raw.view(fmt.block_dtype)
    for name in fmt.block_dtype.names:
        kind = fmt.block_dtype[name]
        if kind == np.dtype("<f2"):
            blocks[name] = (rng.standard_normal(n_blocks) * scale).astype(np.float16)
        elif kind == np.dtype("<f4"):
            blocks[name] = (rng.standard_normal(n_blocks) * scale).astype(np.float32)
    if fmt.name == "BF16":  # the top half of a finite float32
        blocks["v"] = (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if fmt.name == "MXFP4":  # E8M0 scales 2^(e - 128) within a factor 8 of `scale` either way (0 and 255 are extremes)
        blocks["e"] = int(np.rint(np.log2(scale))) + 128 + rng.integers(-3, 4, n_blocks)
    return raw


def random_matrix_bytes(fmt: BlockFormat, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    return random_blocks(fmt, n_out * n_in // fmt.block_size, rng)


def pack_k_scales(sc, mn) -> np.ndarray:
    """Q4_K / Q5_K scale bytes for 8 six-bit scales and mins, packed independently of quant's unpacking."""
    out = np.zeros(12, np.uint8)
    for j in range(8):
        if j < 4:
            out[j], out[j + 4] = sc[j], mn[j]
        else:
            out[j + 4] = (sc[j] & 15) | ((mn[j] & 15) << 4)
            out[j - 4] |= (sc[j] >> 4) << 6
            out[j] |= (mn[j] >> 4) << 6
    return out


def _block(fmt_name: str):
    return np.zeros(1, format_by_name(fmt_name).block_dtype)


def _f32(values):
    return np.asarray(values, dtype=np.float32)


def hand_built(fmt_name: str):
    """(one block as bytes, its expected float32 values), worked out by hand from the format's definition."""
    b = _block(fmt_name)
    j32, j256 = np.arange(32), np.arange(256)
    if fmt_name == "F32":
        b["v"] = 1.5
        want = _f32([1.5])
    elif fmt_name == "F16":
        b["v"] = np.array([0x3C00], np.uint16).view(np.float16)  # 1.0
        want = _f32([1.0])
    elif fmt_name == "BF16":
        b["v"] = 0x3FC0  # top half of 1.5f
        want = _f32([1.5])
    elif fmt_name == "Q4_0":  # d * (nibble - 8); low nibbles are elements 0..15
        b["d"], b["qs"] = 0.5, 0x39
        want = _f32(np.where(j32 < 16, 0.5 * (9 - 8), 0.5 * (3 - 8)))
    elif fmt_name == "Q4_1":  # d * nibble + m
        b["d"], b["m"], b["qs"] = 0.25, -1.0, 0x52
        want = _f32(np.where(j32 < 16, 0.25 * 2 - 1, 0.25 * 5 - 1))
    elif fmt_name == "Q5_0":  # d * ((nibble | qh bit j << 4) - 16)
        b["d"], b["qh"] = 2.0, [0x01, 0x00, 0x01, 0x00]  # bits 0 and 16
        b["qs"][0, 0] = 0x21
        q = np.zeros(32)
        q[0], q[16] = 1 | 16, 2 | 16
        want = _f32(2.0 * (q - 16))
    elif fmt_name == "Q5_1":  # d * (nibble | qh bit j << 4) + m
        b["d"], b["m"], b["qh"] = 1.0, 0.5, [0, 0, 0, 0x80]  # bit 31
        b["qs"][0, 15] = 0x70
        q = np.zeros(32)
        q[31] = 7 | 16
        want = _f32(q + 0.5)
    elif fmt_name == "Q8_0":
        b["d"], b["qs"] = 0.5, (j32 - 16)
        want = _f32(0.5 * (j32 - 16))
    elif fmt_name == "IQ4_NL":  # d * level[nibble]; levels -127 .. 113 (llama.cpp's kvalues_iq4nl)
        levels = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
        b["d"], b["qs"] = 0.5, np.arange(16) | (np.arange(15, -1, -1) << 4)
        want = _f32(0.5 * np.array(levels + levels[::-1]))
    elif fmt_name == "IQ4_XS":  # (d * (ls - 32)) * level[nibble]; ls = scales_l nibble | 2 scales_h bits << 4
        levels = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
        ls = np.array([32, 33, 31, 0, 63, 40, 17, 48])  # sub-block scales 0, 1, -1, -32, 31, 8, -15, 16
        b["d"], b["scales_l"] = 0.25, (ls[0::2] & 15) | ((ls[1::2] & 15) << 4)
        b["scales_h"] = sum(int(v >> 4) << (2 * i) for i, v in enumerate(ls))
        b["qs"] = np.tile(np.arange(16) | (np.arange(15, -1, -1) << 4), 8)
        want = _f32(0.25 * np.repeat(ls - 32, 32) * np.tile(np.concatenate([levels, levels[::-1]]), 8))
    elif fmt_name == "MXFP4":  # 2^(e - 128) * doubled E2M1 value[nibble]; values 0 .. 12, then -0 .. -12
        levels = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
        b["e"], b["qs"] = 126, np.arange(16) | (np.arange(15, -1, -1) << 4)  # scale 2^-2
        want = _f32(0.25 * np.array(levels + levels[::-1]))
    elif fmt_name == "Q2_K":  # (d * (scale & 15)) * q - dmin * (scale >> 4); q = bits 2j.. of qs[h*32 + l]
        b["d"], b["dmin"], b["scales"], b["qs"] = 1.0, 0.5, 0x21, 0b11100100
        q = (j256 % 128) // 32  # every byte holds 0, 1, 2, 3 in its four crumbs
        want = _f32(1.0 * q - 0.5 * 2)
    elif fmt_name == "Q3_K":  # d * (scale - 32) * (q - 4 * (hmask bit clear))
        b["d"] = 1.0
        b["scales"][0, :8], b["scales"][0, 8:] = 0x11, 0xAA  # every scale = 1 | 2 << 4 = 33
        b["qs"], b["hmask"] = 0b11100100, 0xFF
        b["hmask"][0, 0] = 0xFE  # element 0 loses its high bit
        q = ((j256 % 128) // 32).astype(np.float64)
        q[0] -= 4
        want = _f32(1.0 * q)
    elif fmt_name in ("Q4_K", "Q5_K"):  # (d * sc_j) * q - dmin * m_j per 32-element sub-block j
        sc, mn = np.array([1, 2, 3, 4, 63, 6, 7, 40]), np.array([2, 2, 2, 2, 2, 50, 2, 2])
        b["d"], b["dmin"], b["scales"] = 1.0, 0.5, pack_k_scales(sc, mn)
        b["qs"] = 0x53  # low nibble 3 for even sub-blocks, high nibble 5 for odd
        sub = j256 // 32
        q = np.where(sub % 2 == 0, 3, 5)
        if fmt_name == "Q5_K":
            b["qh"] = 0b00000100  # bit 2: fifth bit of every quant of sub-block 2
            q = q + np.where(sub == 2, 16, 0)
        want = _f32(sc[sub] * q - 0.5 * mn[sub])
    elif fmt_name == "Q6_K":  # (d * scale_s) * (q - 32), s = element // 16
        b["d"], b["scales"] = 0.5, np.arange(16) - 8
        b["ql"][0, 0], b["qh"][0, 0] = 0x0F, 0b11  # element 0: 15 | 3 << 4 = 63
        q = np.zeros(256)
        q[0] = 63
        want = _f32(0.5 * (j256 // 16 - 8) * (q - 32))
    elif fmt_name == "Q8_K":
        b["d"], b["qs"] = 0.25, (j256 - 128)
        want = _f32(0.25 * (j256 - 128))
    else:
        raise KeyError(f"no hand-built block for {fmt_name}")
    return b.view(np.uint8).copy(), want

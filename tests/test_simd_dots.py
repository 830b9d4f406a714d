"""The int8 dot intrinsics on whichever path this host compiles (x86 vpmaddubsw / vpdpbusd, AArch64 sdot, generic
widening ops) against numpy's int64 lane sums, and the AArch64 feature gating that picks the path.

The lane sums are what every kernel's bits rest on: lane m of a 32-byte dot is the sum of products 4m..4m+3, on
every path, so a kernel's float arithmetic sees the same integers everywhere. tools/arm_check.sh runs this file
under QEMU for CPUs with and without dotprod.
"""
import subprocess
import sys

import numpy as np
import pytest
from numba import literal_unroll, njit

from edgellm.quant import simd
from edgellm.quant.simd import (dot_i8x32, dot_i8x32_2scales, dot_u8x32, dot_u8x32_2scales,
                                dot4_u8x32_byte_scales, dot_u8x32_plus, dot_u8x32_scale_pair, f32x8_from_i32,
                                i32x8_hsum, i32x8_mins_dot, load_fifth_bits, load_i8x32, load_i32x8,
                                store_f32x8, store_i8x32)


@njit
def _all_dots(w, x, base, scales, out):
    """Each dot's eight lanes as float32 (exact: every lane here stays below 2**24), one row of out per dot."""
    a, b = load_i8x32(w, 0), load_i8x32(x, 0)
    store_f32x8(out, 0, f32x8_from_i32(dot_i8x32(a, b)))
    store_f32x8(out, 8, f32x8_from_i32(dot_u8x32(a, b)))
    store_f32x8(out, 16, f32x8_from_i32(dot_i8x32_2scales(a, b, np.int32(scales[0]), np.int32(scales[1]))))
    store_f32x8(out, 24, f32x8_from_i32(dot_u8x32_2scales(a, b, np.int32(scales[0]), np.int32(scales[1]))))
    store_f32x8(out, 32, f32x8_from_i32(dot_u8x32_plus(a, b, base, 0)))
    store_f32x8(out, 40, f32x8_from_i32(dot_u8x32_scale_pair(a, b, scales, 0, 3)))


def _lanes(w, x, per_element_scale=1):
    return (w.astype(np.int64) * x.astype(np.int64) * per_element_scale).reshape(8, 4).sum(axis=1)


def test_dot_lanes_match_numpy():
    rng = np.random.default_rng(21)
    for trial in range(40):
        signed_w = rng.integers(-128, 128, 32).astype(np.int8)
        unsigned_w = rng.integers(0, 128, 32).astype(np.int8)  # the dot_u8x32 family's contract
        if trial == 0:  # the extremes: |w| = 128 against x = +-127 in every product
            signed_w[:], unsigned_w[:] = -128, 127
        x = rng.integers(-127, 128, 32).astype(np.int8)
        if trial == 0:
            x[::2], x[1::2] = -127, 127
        base = rng.integers(-(1 << 20), 1 << 20, 8).astype(np.int32)
        scales = rng.integers(-128, 128, 16).astype(np.int8)  # int8 scales (Q6_K); the 2scales pair from them too
        halves = np.repeat(scales[:2].astype(np.int64), 16)
        pair3 = np.repeat(scales[6:8].astype(np.int64), 16)
        for w in (signed_w, unsigned_w):
            out = np.empty(48, np.float32)
            _all_dots(w, x, base.view(np.int8), scales, out)
            got = out.reshape(6, 8).astype(np.int64)
            np.testing.assert_array_equal(got[0], _lanes(w, x))
            np.testing.assert_array_equal(got[2], _lanes(w, x, halves))
            if w is unsigned_w:
                np.testing.assert_array_equal(got[1], _lanes(w, x))
                np.testing.assert_array_equal(got[3], _lanes(w, x, halves))
                np.testing.assert_array_equal(got[4], base + _lanes(w, x))
                np.testing.assert_array_equal(got[5], _lanes(w, x, pair3))


@njit
def _byte_scales4(w, x, base, word, out):
    """Eight 32-element groups in two calls into base's lanes, as a Q4_K super-block sums them."""
    acc = load_i32x8(base, 0)
    for h in literal_unroll((0, 1)):
        o = 128 * h
        acc = dot4_u8x32_byte_scales(acc, load_i8x32(w, o), load_i8x32(x, o), load_i8x32(w, o + 32),
                                     load_i8x32(x, o + 32), load_i8x32(w, o + 64), load_i8x32(x, o + 64),
                                     load_i8x32(w, o + 96), load_i8x32(x, o + 96), word, h)
    store_f32x8(out, 0, f32x8_from_i32(acc))


def test_byte_scales4_keep_the_total():
    """dot4_u8x32_byte_scales defines only its lanes' total (AArch64 with dotprod folds four groups into four lanes):
    the total is exact on every path, and where eight lanes are kept they are the scaled dots' own."""
    rng = np.random.default_rng(5)
    for trial in range(20):
        w = rng.integers(0, 16 if trial else 128, 256).astype(np.int8)
        x = rng.integers(-127, 128, 256).astype(np.int8)
        word_bytes = rng.integers(0, 64, 8).astype(np.uint8)
        if trial == 0:  # the largest products everywhere (a lane of eight groups stays below 2**24)
            w[:], x[:], word_bytes[:] = 15, -127, 63
        base = rng.integers(-(1 << 18), 1 << 18, 8).astype(np.int32)
        out = np.empty(8, np.float32)
        _byte_scales4(w, x, base, np.uint64(word_bytes.view("<u8")[0]), out)
        lanes = base + sum(_lanes(w[32 * g:32 * g + 32], x[32 * g:32 * g + 32], int(word_bytes[g])) for g in range(8))
        assert int(out.astype(np.int64).sum()) == int(lanes.sum())
        if not simd.HAS_DOTPROD:
            np.testing.assert_array_equal(out.astype(np.int64), lanes)


@njit
def _mins_dot(word, bsums, offset):
    return i32x8_hsum(i32x8_mins_dot(word, bsums, offset))


def test_mins_dot_keeps_the_total():
    """i32x8_mins_dot: a super-block's eight mins (bytes of a word), each against two of sixteen int32 sums, from an
    offset into the sums; the lanes' layout differs by path, the total is exact."""
    rng = np.random.default_rng(8)
    for trial in range(20):
        mins = rng.integers(0, 64, 8).astype(np.uint8)
        bsums = rng.integers(-32 * 127, 32 * 127 + 1, 40).astype(np.int32)
        offset = int(rng.integers(0, 24))
        want = int((np.repeat(mins.astype(np.int64), 2) * bsums[offset:offset + 16]).sum())
        assert _mins_dot(np.uint64(mins.view("<u8")[0]), bsums, offset) == want


@njit
def _bits(buf, offset, out):
    store_i8x32(out, 0, load_fifth_bits(buf, offset))


def test_load_fifth_bits_matches_numpy():
    """load_fifth_bits (Q5_0/Q5_1's fifth bits, a table lookup on AArch64): byte j is 16 x bit j of the
    little-endian word."""
    rng = np.random.default_rng(3)
    for trial in range(20):
        buf = rng.integers(0, 256, 9).astype(np.uint8)
        if trial < 2:
            buf[:] = 0xFF * trial
        offset = int(rng.integers(0, 5))
        out = np.empty(32, np.int8)
        _bits(buf, offset, out)
        word = int(buf[offset:offset + 4].view("<u4")[0])
        np.testing.assert_array_equal(out, [16 * ((word >> j) & 1) for j in range(32)])


def test_fifth_bits_table_spreads_each_byte_little_endian():
    """The AArch64 lookup table (x86 hosts compile the other lowering, so this is its only check outside QEMU):
    entry b, as eight little-endian bytes, is 16 x bit k of b in byte k."""
    from edgellm.quant.simd.i8x32 import _FIFTH_BITS
    table = np.frombuffer(np.array(_FIFTH_BITS, "<u8").tobytes(), np.uint8).reshape(256, 8)
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    np.testing.assert_array_equal(table, 16 * bits)


def test_path_selection_is_one_of_the_known_ones():
    """At most one instruction family is chosen, and only on its own architecture."""
    assert not (simd.HAS_AVX2 and simd.HAS_DOTPROD)
    assert simd.HAS_DOTPROD or not simd.HAS_I8MM
    if simd.HAS_DOTPROD:
        assert simd.host._is_aarch64()


@pytest.mark.parametrize("cpu, features, want", [
    ("cortex-a72", None, (False, False)),      # Pi 4: plain NEON
    ("cortex-a76", None, (True, False)),       # Pi 5: dotprod implied by the name
    ("neoverse-n2", None, (True, True)),
    ("apple-m1", None, (True, False)),
    ("apple-m4", None, (True, True)),
    ("generic", "+neon,+dotprod,+i8mm", (True, True)),   # features named outright
    ("cortex-a76", "-dotprod", (False, False)),          # a feature taken away
    ("generic", "", (False, False)),
])
def test_arm_features_follow_numba_cpu_name_and_features(monkeypatch, cpu, features, want):
    """What an AArch64 host would choose for NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (as the emulated check sets them)."""
    monkeypatch.setattr(simd.host.llvm_binding, "get_process_triple", lambda: "aarch64-unknown-linux-gnu")
    monkeypatch.setattr(simd.host.numba_config, "CPU_NAME", cpu)
    monkeypatch.setattr(simd.host.numba_config, "CPU_FEATURES", features)
    assert (simd.host._arm_has("dotprod"), simd.host._arm_has("i8mm")) == want
    assert not simd.host._host_has("avx2")


_COMPILE_FOR_CPUS = """
import sys
import llvmlite.binding as llvm
llvm.initialize_all_targets(); llvm.initialize_all_asmprinters()
name, want = sys.argv[1], sys.argv[2]
src = '''
declare <4 x i32> @llvm.aarch64.neon.NAME.v4i32.v16i8(<4 x i32>, <16 x i8>, <16 x i8>)
define <4 x i32> @f(<4 x i32> %a, <16 x i8> %b, <16 x i8> %c) {
  %r = call <4 x i32> @llvm.aarch64.neon.NAME.v4i32.v16i8(<4 x i32> %a, <16 x i8> %b, <16 x i8> %c)
  ret <4 x i32> %r
}'''.replace("NAME", name)
for cpu in sys.argv[3:]:
    m = llvm.parse_assembly(src)
    m.triple = "aarch64-unknown-linux-gnu"
    tm = llvm.Target.from_triple(m.triple).create_target_machine(cpu=cpu, features="", opt=2)
    assert want in tm.emit_assembly(m), cpu
print("ok")
"""


@pytest.mark.parametrize("intrinsic, instruction, table", [
    ("sdot", "sdot", "_ARM_DOTPROD_CPUS"), ("smmla", "smmla", "_ARM_I8MM_CPUS")])
def test_arm_cpu_tables_agree_with_llvm(intrinsic, instruction, table):
    """Every CPU the tables credit with a feature gets its instruction from Numba's LLVM with no feature string (a
    CPU LLVM does not give it would abort the compile: a subprocess keeps that from taking pytest down)."""
    try:
        import llvmlite.binding as llvm
        llvm.initialize_all_targets()
        llvm.Target.from_triple("aarch64-unknown-linux-gnu")
    except RuntimeError:
        pytest.skip("this llvmlite has no AArch64 target")
    cpus = sorted(getattr(simd.host, table))
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_CPUS, intrinsic, instruction, *cpus],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]

"""Which SIMD instructions the CPU Numba compiles for has: the flags every dot product and tile path branches on.

x86 features come from LLVM's host feature map (or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when Numba is pinned to a
CPU), AArch64's dot-product extensions from LLVM's CPU model and /proc/cpuinfo's names for them.
"""

import llvmlite.binding as llvm_binding
from numba.core import config as numba_config


def _is_x86() -> bool:
    return llvm_binding.get_process_triple().startswith(("x86_64", "i686", "i386"))


def _is_aarch64() -> bool:
    return llvm_binding.get_process_triple().startswith(("aarch64", "arm64"))


def _pinned() -> bool:
    return bool(numba_config.CPU_NAME) and numba_config.CPU_NAME != "host"


def cpu_name() -> str:
    """The CPU Numba compiles for: NUMBA_CPU_NAME when pinned, else LLVM's name for the host (e.g. znver4)."""
    return numba_config.CPU_NAME if _pinned() else llvm_binding.get_host_cpu_name()


def _host_has(feature: str) -> bool:
    """Whether the CPU Numba compiles for has an x86 feature (honours NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)."""
    if not _is_x86():
        return False
    if _pinned():
        return f"+{feature}" in (numba_config.CPU_FEATURES or "").split(",")
    return bool(llvm_binding.get_host_cpu_features().get(feature))


# AArch64 CPUs by the optional dot-product extensions LLVM's CPU model gives them (a named CPU implies its features:
# NUMBA_CPU_NAME=cortex-a76 compiles sdot without any NUMBA_CPU_FEATURES). Only names LLVM knows; a CPU missing here
# counts as having neither, which is always safe (plain NEON runs on every AArch64 core).
_ARM_I8MM_CPUS = frozenset((
    "neoverse-n2", "neoverse-n3", "neoverse-v1", "neoverse-v2", "neoverse-v3", "neoverse-v3ae", "neoverse-512tvb",
    "cortex-a510", "cortex-a520", "cortex-a520ae", "cortex-a710", "cortex-a715", "cortex-a720", "cortex-a720ae",
    "cortex-a725", "cortex-x2", "cortex-x3", "cortex-x4", "cortex-x925", "apple-a15", "apple-a16", "apple-a17",
    "apple-a18", "apple-m2", "apple-m3", "apple-m4", "oryon-1", "grace", "ampere1", "ampere1a", "ampere1b"))
_ARM_DOTPROD_CPUS = _ARM_I8MM_CPUS | frozenset((
    "cortex-a55", "cortex-a65", "cortex-a65ae", "cortex-a75", "cortex-a76", "cortex-a76ae", "cortex-a77",
    "cortex-a78", "cortex-a78ae", "cortex-a78c", "cortex-x1", "cortex-x1c", "neoverse-e1", "neoverse-n1",
    "apple-a13", "apple-a14", "apple-m1", "exynos-m4", "exynos-m5", "tsv110"))
# what the names in /proc/cpuinfo's Features line (or LLVM's host feature map) call them
_ARM_FEATURE_ALIASES = {"dotprod": ("dotprod", "asimddp"), "i8mm": ("i8mm",)}


def _arm_has(feature: str) -> bool:
    """Whether the AArch64 CPU Numba compiles for has `feature` ("dotprod" or "i8mm"): NUMBA_CPU_FEATURES' +/-
    entries first, then what NUMBA_CPU_NAME (or the host's CPU name) implies, then the host's own feature list when
    Numba compiles for the host. Under QEMU user emulation LLVM reads the emulating machine's /proc/cpuinfo and sees
    a "generic" CPU with no features, so an emulated check names the CPU through NUMBA_CPU_NAME."""
    if not _is_aarch64():
        return False
    names = _ARM_FEATURE_ALIASES[feature]
    explicit = [f.strip() for f in (numba_config.CPU_FEATURES or "").split(",") if f.strip()]
    if any(f"-{n}" in explicit for n in names):
        return False
    if any(f"+{n}" in explicit for n in names):
        return True
    table = _ARM_I8MM_CPUS if feature == "i8mm" else _ARM_DOTPROD_CPUS
    if cpu_name() in table:
        return True
    if _pinned() or numba_config.CPU_FEATURES is not None:  # Numba compiles for exactly what was named
        return False
    try:
        host = llvm_binding.get_host_cpu_features()
    except RuntimeError:  # LLVM cannot read this host's features
        return False
    return any(host.get(n) for n in names)


def _has_native_f16() -> bool:
    """True where LLVM turns `fpext half` into an instruction (x86 F16C, AArch64), not a libcall."""
    return _is_aarch64() or _host_has("f16c")


NATIVE_F16 = _has_native_f16()


# ---------------------------------------------------------------------------------------------------------
# The int8 dot product's instructions (simd.dots): on AVX2 vpmaddubsw + vpmaddwd, on AArch64 sdot or plain NEON.

HAS_AVX2 = _host_has("avx2")
# AVX-VNNI (or AVX512-VNNI with 256-bit forms): vpdpbusd sums the four unsigned x signed byte products of each lane
# straight into int32, one instruction for vpmaddubsw + vpmaddwd, without the int16 step (nothing saturates there
# either way, see above), so the lanes are the same integers.
HAS_VNNI = HAS_AVX2 and (_host_has("avxvnni") or (_host_has("avx512vnni") and _host_has("avx512vl")))

# AArch64 with the dot-product extension (Armv8.2 optional, 8.4 on): sdot sums the four signed byte products of each
# int32 lane of a 128-bit vector into that lane, the very lanes above, so two sdots make an I32x8 (no int16 step).
IS_AARCH64 = _is_aarch64()
HAS_DOTPROD = _arm_has("dotprod")
# Armv8.6's int8 matrix multiply (i8mm) is detected, not used: each of smmla's 2x2 int32 outputs sums eight products
# where the lanes above sum four, so it keeps these bits only with half its inputs zero, no faster than sdot.
HAS_I8MM = HAS_DOTPROD and _arm_has("i8mm")

# 512-bit tile steps (simd.tiles_avx512) where the CPU also has AVX-512 with VNNI (docs/kernels.md has the gain).
HAS_WIDE_TILES = HAS_VNNI and all(_host_has(f) for f in ("avx512f", "avx512bw", "avx512vnni"))
# AMD's Zen cores, by the name Numba compiles for: they stream weights best with short prefetch hints and long rows
# one at a time (quant.dots_block32, quant.linear; docs/kernels.md).
IS_ZEN = cpu_name().startswith("znver")

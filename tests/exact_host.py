"""Where our logits are llama.cpp's bits, and so where the exact tests run.

llama.cpp's fixtures were recorded by its AVX2 build on x86-64 Linux (glibc's libm for cos/sin/tanh/exp), and our
kernels were checked against them on x86-64 with AVX2 and FMA: an AVX2-only AMD Zen 3, an AVX-512 + VNNI Intel
Sapphire Rapids and an AVX-512 + VNNI + BF16 AMD Zen 4. On aarch64, or on an x86 CPU without AVX2, llama.cpp itself
runs other kernels (NEON dots, the scalar fallbacks) whose rounding those fixtures do not record, and our own
kernels take their non-AVX2 paths, so bit equality is not the contract there; the tolerance tests are.
"""
import os
import platform
import sys

from edgellm.quant import simd

# EDGELLM_EXACT_AARCH64=1 (tools/arm_check.sh) holds an AArch64 Linux host to the x86 recordings too: our kernels keep
# the x86 build's integer lanes and float order on every path (sdot, plain NEON), so their bits should be the same.
AARCH64_AS_X86 = (os.environ.get("EDGELLM_EXACT_AARCH64") == "1" and sys.platform == "linux"
                  and platform.machine().lower() in ("aarch64", "arm64"))

_MISSING = [] if AARCH64_AS_X86 else [what for what, ok in (
    ("Linux (glibc's libm)", sys.platform == "linux"),
    ("x86-64", platform.machine().lower() in ("x86_64", "amd64")),
    ("AVX2", simd.HAS_AVX2),
    ("FMA", simd.host._host_has("fma")),
) if not ok]

EXACT_HOST = not _MISSING
EXACT_HOST_REASON = (
    f"this host ({sys.platform} {platform.machine()}) lacks {', '.join(_MISSING) or 'nothing'}: llama.cpp's "
    "recorded bits come from its x86-64 AVX2/FMA kernels and glibc's libm, checked on AVX2 (Zen 3) and AVX-512 "
    "(Sapphire Rapids, Zen 4) CPUs; elsewhere both engines run other paths, so only the tolerance tests apply")

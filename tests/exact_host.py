"""Where our logits are llama.cpp's bits, and so where the exact tests run.

llama.cpp's fixtures were recorded on x86-64 Linux with AVX2 and FMA (glibc's libm for cos/sin/tanh/exp), and our
kernels were checked against them there, on the AVX2-only kind and the AVX-512 + VNNI kind. On aarch64, or on an
x86 CPU without AVX2, llama.cpp itself runs other kernels (NEON dots, the scalar fallbacks) whose rounding those
fixtures do not record, so bit equality with them is not the contract there; the tolerance tests are.
"""
import platform
import sys

from edgellm.quant import simd

EXACT_HOST = (sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
              and simd.HAS_AVX2 and simd._host_has("fma"))
EXACT_HOST_REASON = ("llama.cpp's recorded bits come from its x86-64 AVX2/FMA kernels and glibc's libm; this host "
                     f"({sys.platform} {platform.machine()}) runs other paths, so only the tolerance tests apply")

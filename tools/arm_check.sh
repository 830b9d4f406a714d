#!/usr/bin/env bash
# The AArch64 paths checked under QEMU user emulation, per emulated CPU: the int8 dot intrinsics and the feature
# gating (tests/test_simd_dots.py), the kernel tests of the formats the catalog models use (SmolLM2: Q4_1, Q8_0;
# Gemma-3: Q5_0, Q8_0, Q4_K, Q6_K), and SmolLM2's teacher-forced logits and greedy continuations against llama.cpp's
# x86 recording, bit for bit (EDGELLM_EXACT_AARCH64=1). A kernel compiled for a feature the emulated CPU lacks dies
# with SIGILL, so a pass on cortex-a72 also checks that nothing asked for dotprod there.
#
#   tools/arm_check.sh [CPU ...]        default: cortex-a72 cortex-a76 max     (root needed: chroot)
#   ARM_CHECK_TESTS="tests/..." tools/arm_check.sh cortex-a76                   another selection
#   ARM_CHECK_MODELS=0 ...              skip the real-model test
#   ARM_CHECK_MODEL_TESTS="tests/test_models_real.py -k '...'" ...    another real-model selection
# (EDGELLM_EXACT_AARCH64=1 is exported for the whole command, so a selection chained with && keeps the bit tests.)
#
# Needs ../shared/tools/arm64-chroot.sh's root (its `setup` once). Numba's cache lives in the root under /root and
# is kept between runs, per CPU name: the first run per CPU compiles under emulation (cortex-a76's kernel tests took
# 41 min cold on a loaded 2-vCPU host, docs/arm.md), later ones only what changed. CI does not run this (it needs root, QEMU and that time).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
chroot_tool=${ARM64_CHROOT:-$here/../shared/tools/arm64-chroot.sh}
[ -x "$chroot_tool" ] || chroot_tool=/work/shared/tools/arm64-chroot.sh
cpus=("$@")
[ ${#cpus[@]} -gt 0 ] || cpus=(cortex-a72 cortex-a76 max)
formats="Q4_1 or Q8_0 or Q5_0 or Q4_K or Q6_K"
kernel_tests=${ARM_CHECK_TESTS:-"tests/test_simd_dots.py && python -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py -k '$formats or intrinsic or hsum or starting_lanes or q4_k_gemv'"}
model_tests=${ARM_CHECK_MODEL_TESTS:-"tests/test_models_real.py -k 'smollm2 and (are_llama_cpp_bits or greedy_continuation)'"}

cd "$here"
"$chroot_tool" sync >/dev/null
for cpu in "${cpus[@]}"; do
  # QEMU's `max` has every feature it emulates (dotprod, i8mm, SVE); LLVM is told a CPU with the same extensions.
  case $cpu in
    max) numba_cpu=neoverse-v1 ;;
    *) numba_cpu=$cpu ;;
  esac
  for suite in kernels models; do
    [ "$suite" = models ] && [ "${ARM_CHECK_MODELS:-1}" = 0 ] && continue
    tests=$kernel_tests
    [ "$suite" = models ] && tests=$model_tests
    start=$(date +%s)
    status=0
    QEMU_CPU=$cpu NUMBA_CPU_NAME=$numba_cpu "$chroot_tool" run \
      "export EDGELLM_EXACT_AARCH64=1; python -c 'from edgellm.quant import simd; print(\"paths: dotprod\", simd.HAS_DOTPROD, \"i8mm\", simd.HAS_I8MM)' && python -m pytest -q -p no:cacheprovider $tests" || status=$?
    echo "== QEMU_CPU=$cpu NUMBA_CPU_NAME=$numba_cpu $suite: exit $status, $(( $(date +%s) - start )) s"
  done
done

"""Benchmark quant's matvec / matmul kernels at the real models' shapes, next to measured memory bandwidth.

    python tools/bench_kernels.py                 # both models' (format, shape) pairs + every format at one shape
    python tools/bench_kernels.py --quick         # fewer repetitions, no all-formats table
    python tools/bench_kernels.py --asm           # also count the vector instructions in each kernel

Effective GB/s = weight bytes read / time. "cold" cycles through copies of the matrix totalling more than the
L3 cache, as decoding a whole model does; "hot" repeats one matrix (in cache when small). Bandwidth is a
Numba read-sum over a 512 MB array (the same access pattern as matvec) and a numpy copy, at 1 and 2 threads.
Times are the best of repeated runs. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

SMOLLM2 = [("Q4_1", 576, 576), ("Q4_1", 192, 576), ("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)]
GEMMA = [("Q5_0", 1024, 640), ("Q5_0", 256, 640), ("Q8_0", 256, 640), ("Q5_0", 2048, 640), ("Q4_K", 640, 2048),
         ("Q6_K", 640, 2048), ("Q4_K", 640, 1024), ("Q8_0", 262144, 640)]
ALL_FORMATS_SHAPE = (2048, 2048)
COLD_BYTES = 192 << 20   # cycle through at least this much weight data for "cold" timings
BANDWIDTH_BYTES = 512 << 20
MATMUL_TOKENS = 128


TIME_SCALE = 1.0  # --patience multiplies every timing budget


def _timeit(fn, min_time=0.25, min_reps=3):
    """Best time of repeated runs: on a shared machine the median mostly measures the other tenants
    (a descheduled OpenMP worker stalls a 2-thread region for a whole time slice)."""
    fn()  # warm up (and compile)
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time * TIME_SCALE:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.min(times))


def measure_bandwidth(threads):
    import numba
    from numba import njit, prange

    @njit(parallel=True, fastmath=True)
    def read_sum(a):
        chunk = 1 << 16
        total = 0.0
        for c in prange(a.size // chunk):
            s = np.float32(0)
            for i in range(c * chunk, (c + 1) * chunk):
                s += a[i]
            total += s
        return total

    a = np.ones(BANDWIDTH_BYTES // 4, np.float32)
    b = np.empty_like(a)
    rows = []
    for n in threads:
        numba.set_num_threads(n)
        t_read = _timeit(lambda: read_sum(a), min_time=1.0)
        rows.append((n, a.nbytes / t_read / 1e9))
    t_copy = _timeit(lambda: np.copyto(b, a), min_time=1.0)
    return rows, 2 * a.nbytes / t_copy / 1e9


def bench_case(ggml_type, n_out, n_in, threads, rng, with_matmul=True):
    import numba

    from edgellm import quant
    from edgellm.quant.testing import random_matrix_bytes

    fmt = quant.format_by_name(ggml_type)
    one = random_matrix_bytes(fmt, n_out, n_in, rng)
    copies = max(1, -(-COLD_BYTES // one.size))
    layers = [quant.QuantLinear(one if i == 0 else one.copy(), ggml_type, (n_out, n_in)) for i in range(copies)]
    x = rng.standard_normal(n_in).astype(np.float32)
    out = np.empty(n_out, np.float32)
    xs = rng.standard_normal((MATMUL_TOKENS, n_in)).astype(np.float32)
    outs = np.empty((MATMUL_TOKENS, n_out), np.float32)
    results = []
    for n in threads:
        numba.set_num_threads(n)
        hot = _timeit(lambda: layers[0].matvec(x, out))
        state = {"i": 0}

        def cold_step():
            state["i"] = (state["i"] + 1) % copies
            layers[state["i"]].matvec(x, out)
        cold = _timeit(cold_step, min_time=0.5, min_reps=copies)
        mm = _timeit(lambda: layers[0].matmul(xs, outs), min_time=0.3, min_reps=2) if with_matmul else float("nan")
        results.append((n, one.size, hot, cold, mm))
    return results


def _row(ggml_type, n_out, n_in, result):
    n, nbytes, hot, cold, mm = result
    macs = MATMUL_TOKENS * n_out * n_in
    mm_cells = "| - | -" if mm != mm else f"| {mm * 1e3:.2f} ms | {macs / mm / 1e9:.1f}"
    return (f"| {ggml_type} | {n_out}x{n_in} | {nbytes / 1e6:.2f} | {n} | {cold * 1e6:.0f} us "
            f"| {nbytes / cold / 1e9:.2f} | {nbytes / hot / 1e9:.2f} {mm_cells} |")


HEADER = ("| format | shape (n_out x n_in) | MB | threads | matvec cold | cold GB/s | hot GB/s "
          f"| matmul T={MATMUL_TOKENS} | GMAC/s |\n|---|---|---|---|---|---|---|---|---|")


def count_vector_instructions():
    """Per matmul kernel: how many vpmaddwd / vpmaddubsw / vfmadd*ps / ymm instructions its machine code has."""
    import re

    from edgellm.quant.formats import format_by_name
    from edgellm.quant.registry import records
    from edgellm.quant.testing import random_matrix_bytes

    print("\n| kernel | vpmaddwd | vpmaddubsw | vfmadd*ps | ymm instructions |\n|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    from edgellm import quant
    for record in records():
        name, kernel = record.name, record.matmul_kernel()
        fmt = format_by_name(name)
        layer = quant.QuantLinear(random_matrix_bytes(fmt, 8, 512, rng), name, (8, 512))
        layer.matvec(np.ones(512, np.float32), np.empty(8, np.float32))
        asm = "\n".join(kernel.inspect_asm(sig) for sig in kernel.signatures)
        counts = [len(re.findall(p, asm)) for p in (r"vpmaddwd", r"vpmaddubsw", r"vfmadd\w*ps", r"%ymm")]
        print(f"| {name} | " + " | ".join(map(str, counts)) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="no all-formats table, shorter timings")
    ap.add_argument("--asm", action="store_true", help="count vector instructions (compiles in a fresh cache)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--patience", type=float, default=1.0,
                    help="multiply the time spent per measurement (more chances for a clean run on a busy machine)")
    ap.add_argument("--only", default="", help="comma-separated formats to run (default all)")
    args = ap.parse_args(argv)
    global TIME_SCALE
    TIME_SCALE = args.patience
    if args.asm:  # inspect_asm needs freshly compiled code, not code loaded from the on-disk cache
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_kernels_")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import numba

    from edgellm import quant  # noqa: F401  (selects the threading layer before the first parallel region)
    threads = [int(t) for t in args.threads.split(",")]
    threads = [t for t in threads if t <= numba.config.NUMBA_NUM_THREADS]

    bw, copy_bw = measure_bandwidth(threads)
    print(f"Numba {numba.__version__}, threading layer {numba.threading_layer()}, "
          f"{numba.config.NUMBA_NUM_THREADS} CPUs\n")
    print("| memory bandwidth | threads | GB/s |\n|---|---|---|")
    for n, gbs in bw:
        print(f"| read-sum 512 MB (Numba) | {n} | {gbs:.2f} |")
    print(f"| numpy copy 512 MB (read + write) | 1 | {copy_bw:.2f} |")

    rng = np.random.default_rng(0)
    for title, cases in (("SmolLM2-135M Q4_1", SMOLLM2), ("Gemma-3-270M Q4_K_M", GEMMA)):
        print(f"\n### {title}\n\n{HEADER}")
        for ggml_type, n_out, n_in in cases:
            if args.only and ggml_type not in args.only.split(","):
                continue
            big = n_out * n_in > 50_000_000
            for result in bench_case(ggml_type, n_out, n_in, threads, rng, with_matmul=not (big and args.quick)):
                print(_row(ggml_type, n_out, n_in, result), flush=True)

    if not args.quick:
        n_out, n_in = ALL_FORMATS_SHAPE
        print(f"\n### Every format at {n_out}x{n_in}\n\n{HEADER}")
        for fmt in quant.FORMATS:
            if args.only and fmt.name not in args.only.split(","):
                continue
            for result in bench_case(fmt.name, n_out, n_in, threads, rng):
                print(_row(fmt.name, n_out, n_in, result), flush=True)
    if args.asm:
        count_vector_instructions()


if __name__ == "__main__":
    main()

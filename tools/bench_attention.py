"""Attention kernel timings at the catalog models' shapes, at a given cache depth, best of repeated runs.

    python tools/bench_attention.py [--depth 2048] [--tokens 1,16] [--repeat 25] [--inner 10] [--shapes gpt-oss]
                                    [--sinks]

One row per (shape, query tokens): the serial and the parallel kernel (ops.attention picks between them by the
amount of work), microseconds per layer-step, with an f16 cache filled with random keys and values. Decode (one
query token) and prompt batches use llama.cpp's two summation orders, so both are timed; one token's query heads
that share a KV head run together, as ops.attention runs them. --sinks times the drivers with a sink per head
(gpt-oss's), random ones.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from edgellm.engine import ops
from edgellm.engine.ops import attention_drivers
from edgellm.engine.kvcache import KVCache

# (name, query heads, KV heads, head size, window): SmolLM2-135M, and Gemma-3-270M's global and sliding layers
SHAPES = [("smollm2", 9, 3, 64, 0), ("gemma3 global", 4, 1, 256, 0), ("gemma3 sliding", 4, 1, 256, 512)]
# gpt-oss-20b / 120b: global layers and sliding ones of 128 positions
SHAPES_GPT_OSS = [("gpt-oss global", 64, 8, 64, 0), ("gpt-oss sliding", 64, 8, 64, 128)]


def best_of(fn, repeat, inner=10):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=2048, help="positions already in the cache")
    ap.add_argument("--tokens", default="1,16", help="query tokens per call, comma list")
    ap.add_argument("--repeat", type=int, default=25)
    ap.add_argument("--inner", type=int, default=10, help="calls per timed repeat")
    ap.add_argument("--shapes", choices=("catalog", "gpt-oss"), default="catalog")
    ap.add_argument("--sinks", action="store_true", help="the sink drivers, a random sink per head")
    args = ap.parse_args(argv)
    if args.sinks:
        kernels = (attention_drivers._attention_sinks_serial_vec, attention_drivers._attention_sinks_parallel_vec)
    else:
        kernels = (attention_drivers._attention_serial_vec, attention_drivers._attention_parallel_vec)
    rng = np.random.default_rng(0)
    print("| shape | query tokens | depth | serial µs | parallel µs |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, n_head, n_kv, hd, window in (SHAPES_GPT_OSS if args.shapes == "gpt-oss" else SHAPES):
        for n_tokens in (int(t) for t in args.tokens.split(",")):
            n = args.depth + n_tokens
            layer = KVCache(n + 8, n_kv, hd, [window], n_tokens, "f16").layers[0]
            k, v = (rng.standard_normal((n, n_kv, hd)).astype(np.float32) for _ in range(2))
            positions = np.arange(n, dtype=np.int32)
            ops.kv_store(k, v, positions, layer.k, layer.v, layer.slot_pos)
            scratch = ops.attention_scratch(layer.slot_pos.shape[0], hd)
            q = rng.standard_normal((n_tokens, n_head, hd)).astype(np.float32)
            out = np.empty_like(q)
            scale = np.float32(hd ** -0.5)
            if args.sinks:
                sinks = rng.standard_normal(n_head).astype(np.float32)
                call = (q, layer.k, layer.v, layer.slot_pos, positions[-n_tokens:], window, scale, sinks, out,
                        scratch)
            else:
                call = (q, layer.k, layer.v, ops.NO_SCALES, ops.NO_SCALES, layer.slot_pos, positions[-n_tokens:],
                        window, scale, out, scratch)
            calls = [(kernel, call) for kernel in kernels]
            chunks = [attention_drivers._heads_chunk(n_head, n_kv, threads) for threads in (1, numba.get_num_threads())]
            heads = (attention_drivers._attention_heads_serial_vec, attention_drivers._attention_heads_parallel_vec)
            for i in range(2):  # what ops.attention runs for one token: heads together where that is expected faster
                if not args.sinks and n_tokens == 1 and chunks[i] > 1:
                    calls[i] = (heads[i], call[:3] + call[5:-2] + (chunks[i],) + call[-2:])
            times = []
            for kernel, arguments in calls:
                kernel(*arguments)  # compile / load
                times.append(best_of(lambda: kernel(*arguments), args.repeat, args.inner) * 1e6)
            print(f"| {name} | {n_tokens} | {args.depth} | {times[0]:.0f} | {times[1]:.0f} |", flush=True)


if __name__ == "__main__":
    main()

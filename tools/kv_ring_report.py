"""Issue 6's figures: generation far past a small context, and the KV types' perplexity and size.

For each model: greedy generation of --tokens tokens with n_ctx --ctx (the context shifts, keeping 4 attention
sinks), reporting per window of --ctx tokens the decode speed, RSS and the model's perplexity on its own
continuation; the time one context shift takes; then llama-perplexity on tests/fixtures/ppl_text.txt for each KV
type with the KV bytes per token.

    python tools/kv_ring_report.py smollm2-135m gemma-3-270m --tokens 2560 --ctx 256
"""
import argparse
import io
import math
import time
from pathlib import Path

import numpy as np
import psutil

import edgellm
from edgellm.prep.perplexity import perplexity

TEXT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "ppl_text.txt"


def ring_run(name, n_ctx, n_tokens, threads):
    m = edgellm.load(name, n_ctx=n_ctx, n_threads=threads)
    m.generate("Warm up.", max_tokens=4)
    proc = psutil.Process()
    shift_times = []
    cache = m.model.cache
    original_shift = cache.shift

    def timed_shift(*a, **k):
        t = time.perf_counter()
        original_shift(*a, **k)
        shift_times.append(time.perf_counter() - t)

    cache.shift = timed_shift
    rows, last = [], time.perf_counter()
    stream = m.stream("Once upon a time, in a small village by the sea,", max_tokens=n_tokens, ignore_eos=True,
                      logprobs=1)
    for i, _ in enumerate(stream):
        if (i + 1) % n_ctx == 0:
            now = time.perf_counter()
            rows.append([n_ctx / (now - last), proc.memory_info().rss / 2**20])
            last = now
    lp = np.array([t.logprob for t in m.last_completion.token_info])
    print(f"\n## {m.name}: {n_tokens} tokens greedy at n_ctx {n_ctx} (kv {cache.kv_type.name}, n_keep "
          f"{m.model.n_keep}); {len(shift_times)} shifts, {cache.n_shifted} positions dropped, "
          f"a shift takes {1e3 * np.median(shift_times):.2f} ms (median)")
    print("| window | tokens/s | RSS MB | perplexity of own continuation |\n|---|---|---|---|")
    for w, (tps, rss) in enumerate(rows):
        ppl = math.exp(-lp[w * n_ctx:(w + 1) * n_ctx].mean())
        print(f"| {w * n_ctx}-{(w + 1) * n_ctx} | {tps:.1f} | {rss:.1f} | {ppl:.3f} |")
    print(f"text tail: {m.last_completion.text[-160:]!r}")


def ppl_by_type(name, n_ctx, n_chunks, threads):
    text = TEXT.read_text(encoding="utf-8")
    print(f"\n| {name} kv_type | PPL ({n_chunks} x {n_ctx}) | vs f32 | KV bytes per token |\n|---|---|---|---|")
    base = None
    for kv_type in ("f32", "f16", "q8_0"):
        m = edgellm.load(name, n_ctx=n_ctx, n_threads=threads, kv_type=kv_type)
        r = perplexity(m, m.tokenize(text), n_ctx=n_ctx, n_chunks=n_chunks, out=io.StringIO())
        base = base or r.ppl
        print(f"| {kv_type} | {r.ppl:.4f} ± {r.ppl_error:.4f} | {100 * (r.ppl / base - 1):+.3f}% | "
              f"{m.model.cache.bytes_per_token():,} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=2560, help="0: skip the long generation")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--ppl-ctx", type=int, default=512)
    ap.add_argument("--ppl-chunks", type=int, default=8, help="0: skip the perplexity table")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    for name in args.models:
        if args.tokens > 0:
            ring_run(name, args.ctx, args.tokens, args.threads)
        if args.ppl_chunks > 0:
            ppl_by_type(name, args.ppl_ctx, args.ppl_chunks, args.threads)


if __name__ == "__main__":
    main()

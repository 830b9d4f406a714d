"""`edgellm bench`, modelled on llama-bench: prompt processing (pp), generation (tg) at a depth, thread sweeps,
mean ± std tokens/s, peak RSS, and each figure's share of the memory-bandwidth limit measured in the same run.

Sections: memory bandwidth; bytes a token streams; one measurement; the sweep; output (markdown, JSON, plot).
"""
from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import numba
import numpy as np

import edgellm
from edgellm.engine.kvcache import KVPool
from edgellm.engine.validate import weight_residency
from edgellm.prep.bandwidth_kernel import parallel_sum
from edgellm.quant.threading_layer import chosen_layer

_BW_BYTES = 256 << 20  # large enough to defeat the caches, small enough for any machine this runs on


def measure_bandwidth(n_threads: int, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s with n_threads, the way a decode step reads weights: a parallel sum over a
    buffer far larger than the caches. Best of `repeats`."""
    buf = np.ones(_BW_BYTES // 4, dtype=np.float32)
    numba.set_num_threads(min(n_threads, numba.config.NUMBA_NUM_THREADS))
    parallel_sum(buf[:1024])  # compile / warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        parallel_sum(buf)
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best


def weight_bytes_per_token(gguf_file) -> int:
    """Bytes of weights a decode step streams: every matrix once (the embedding only as the tied output
    projection, since a single row is read for the input), of a mixture of experts' stacks only the share of the
    experts a token uses. Norm vectors are negligible but counted."""
    tensors = gguf_file.tensors
    total = weight_residency(gguf_file).resident_bytes  # shared tensors plus a token's share of the experts
    if "token_embd.weight" in tensors and "output.weight" in tensors:
        total -= tensors["token_embd.weight"].nbytes  # only one row is read per token
    return total


def kv_bytes_per_token_read(model, depth: int) -> int:
    """KV cache bytes an attention step reads at `depth` (bounded per layer by its ring capacity)."""
    cache = getattr(model, "cache", None)
    if cache is None or not hasattr(cache, "layers"):
        return 0
    total = 0
    for layer in cache.layers:
        n_kv_heads, capacity, head_dim = layer.k.shape
        total += 2 * n_kv_heads * min(capacity, depth) * head_dim * layer.k.itemsize
    return total


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass
class Result:
    model: str
    test: str            # "pp128", "tg128", "tg128@d2048", "tg128 b8" (8 sequences decoded together)
    n_threads: int
    n_prompt: int
    n_gen: int
    depth: int
    samples_tps: list = field(default_factory=list)
    bytes_per_token: int = 0
    bandwidth: float = 0.0
    batch: int = 1       # sequences per decode step; samples_tps is then the aggregate over all of them

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples_tps)

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples_tps) if len(self.samples_tps) > 1 else 0.0

    @property
    def bound_tps(self) -> float:
        """Tokens/s if every token only had to stream its bytes at the measured bandwidth."""
        return self.bandwidth / self.bytes_per_token if self.bytes_per_token else 0.0

    @property
    def share_of_bound(self) -> float:
        return self.mean / self.bound_tps if self.bound_tps else 0.0


def _random_tokens(rng, n_vocab: int, n: int) -> np.ndarray:
    return rng.integers(0, n_vocab, n, dtype=np.int32)


def run_pp(model, n_prompt: int, repeats: int, rng) -> list:
    out = []
    for _ in range(repeats):
        model.reset()
        toks = _random_tokens(rng, model.n_vocab, n_prompt)
        t0 = time.perf_counter()
        model.forward(toks)
        out.append(n_prompt / (time.perf_counter() - t0))
    return out


def run_tg(model, n_gen: int, depth: int, repeats: int, rng) -> list:
    out = []
    for _ in range(repeats):
        model.reset()
        if depth:
            model.forward(_random_tokens(rng, model.n_vocab, depth))
        tok = np.array([int(rng.integers(0, model.n_vocab))], dtype=np.int32)
        t0 = time.perf_counter()
        for _ in range(n_gen):
            logits = model.forward(tok)
            tok[0] = int(np.argmax(logits[-1]))
        out.append(n_gen / (time.perf_counter() - t0))
    return out


BATCH_PROMPT = 16  # tokens each sequence of a batched run is prefilled with
# A warmup before a deep tg run prefills at most this many tokens: enough for decode to take the parallel attention
# kernel (ops.ATTENTION_PARALLEL_MIN_WORK) that the timed run at that depth uses.
WARMUP_DEPTH = 512


def run_tg_batch(model, n_seq: int, n_gen: int, repeats: int, rng) -> list:
    """Aggregate decode tokens/s with n_seq sequences decoded together (forward_multi), each prefilled with
    BATCH_PROMPT random tokens in its own cache of one KVPool."""
    cfg, windows = model.config, [kv.window for kv in model.cache.layers]
    pool = KVPool(n_seq, BATCH_PROMPT + n_gen + 1, cfg.n_head_kv, cfg.head_dim, windows, model.n_batch,
                  model.cache.kv_type)
    out = []
    for _ in range(repeats):
        for cache in pool.caches:
            cache.reset()
            model.forward(_random_tokens(rng, model.n_vocab, BATCH_PROMPT), cache=cache)
        toks = _random_tokens(rng, model.n_vocab, n_seq)
        t0 = time.perf_counter()
        for _ in range(n_gen):
            toks = model.forward_multi(toks, pool.caches).argmax(axis=1).astype(np.int32)
        out.append(n_seq * n_gen / (time.perf_counter() - t0))
    return out


def batch_turn(results) -> int | None:
    """The batch size from which doubling it no longer gains 1.5x aggregate throughput: where decoding turns
    from bandwidth-bound (each weight read serves more tokens for free) to compute-bound. None if it never does."""
    rows = sorted((r for r in results if r.batch > 1 or " b" in r.test), key=lambda r: r.batch)
    for prev, cur in zip(rows, rows[1:]):
        if cur.batch == 2 * prev.batch and cur.mean < 1.5 * prev.mean:
            return prev.batch
    return None


def bench(model_name, n_prompt=(128,), n_gen=(128,), depths=(0,), threads=(None,), repeats=3, warmup=True,
          profile=False, log=None, batches=(), compile_progress=None) -> dict:
    """Run the sweep; returns {"results": [Result...], "bandwidth": {threads: B/s}, "peak_rss": bytes, ...}.
    compile_progress: where given, what a cold kernel cache lacks for the prompt path (and batches, when swept)
    compiles at load, reporting through it."""
    rng = np.random.default_rng(0)
    results, bandwidths = [], {}
    say = log or (lambda *_: None)
    for nt in threads:
        n_ctx = max(max(n_prompt, default=0), max(depths, default=0) + max(n_gen, default=0)) + 16
        n_ctx = max(n_ctx, max(batches, default=0))  # a batch's step runs as one n_batch-sized forward
        paths = (("prompt", "batch") if batches else ("prompt",)) if compile_progress else ()
        m = edgellm.load(model_name, n_threads=nt, n_ctx=n_ctx, precompile=paths, compile_progress=compile_progress)
        nt = m.n_threads
        bw = bandwidths[nt] = measure_bandwidth(nt)
        say(f"threads {nt}: bandwidth {bw / 1e9:.1f} GB/s")
        model = m.model
        wbytes = weight_bytes_per_token(m.file)
        if warmup:  # compile and touch every weight page before timing
            run_pp(model, max(1, min(8, max(n_prompt, default=8))), 1, rng)
            run_tg(model, 2, 0, 1, rng)
        for p in n_prompt:
            if p <= 0:
                continue
            r = Result(m.name, f"pp{p}", nt, p, 0, 0, run_pp(model, p, repeats, rng), wbytes, bw)
            say(f"  {r.test}: {r.mean:.1f} ± {r.std:.1f} t/s")
            results.append(r)
        for n in n_gen:
            if n <= 0:
                continue
            for d in depths:
                if warmup and d:  # the decode kernels for a deep cache (parallel attention) compile here, untimed
                    run_tg(model, 2, min(d, WARMUP_DEPTH), 1, rng)
                test = f"tg{n}" + (f"@d{d}" if d else "")
                # bytes at the middle of the run's depth range stand for the run
                kv = kv_bytes_per_token_read(model, d + n // 2)
                r = Result(m.name, test, nt, 0, n, d, run_tg(model, n, d, repeats, rng), wbytes + kv, bw)
                say(f"  {r.test}: {r.mean:.1f} ± {r.std:.1f} t/s")
                results.append(r)
            for b in batches:  # the weights are read once per step for all b sequences
                if warmup:  # each batch size takes its own kernel paths: compile them untimed
                    run_tg_batch(model, b, 2, 1, rng)
                r = Result(m.name, f"tg{n} b{b}", nt, BATCH_PROMPT, n, 0, run_tg_batch(model, b, n, repeats, rng),
                           max(1, wbytes // b), bw, batch=b)
                say(f"  {r.test}: {r.mean:.1f} ± {r.std:.1f} t/s aggregate, {r.mean / b:.1f} per sequence")
                results.append(r)
        profile_rows = profile_decode(m) if profile else None
        load_s = m.timings.load_s
        del m, model
    return {"results": results, "bandwidth": bandwidths, "peak_rss": peak_rss_bytes(), "load_s": load_s,
            "threading_layer": chosen_layer(), "profile": profile_rows, "batch_turn": batch_turn(results) if batches else None}


def profile_decode(m, n_tokens: int = 16) -> list:
    """Time per operation type and per layer for decode steps, from the model's optional profiler hook."""
    model = m.model
    if not hasattr(model, "profile_step"):
        return []
    model.reset()
    model.forward(np.array([m.tokenizer.bos_id or 1], dtype=np.int32))
    rows = model.profile_step(np.array([1], dtype=np.int32), n_steps=n_tokens)
    return [{"op": op, "layer": layer, "seconds": dt} for (op, layer), dt in sorted(rows.items(), key=str)]


def to_markdown(report: dict) -> str:
    lines = ["| model | test | threads | t/s | bytes/token | bound t/s | share of bound | min latency |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        if r.batch > 1 or " b" in r.test:
            continue  # in the batch table below
        is_tg = r.test.startswith("tg")
        bound = f"{r.bound_tps:.1f}" if is_tg else "-"
        share = f"{100 * r.share_of_bound:.0f}%" if is_tg else "-"
        lat = f"{1e3 * r.bytes_per_token / r.bandwidth:.2f} ms" if is_tg and r.bandwidth else "-"
        lines.append(f"| {r.model} | {r.test} | {r.n_threads} | {r.mean:.1f} ± {r.std:.1f} | "
                     f"{r.bytes_per_token / 1e6:.1f} MB | {bound} | {share} | {lat} |")
    batched = [r for r in report["results"] if r.batch > 1 or " b" in r.test]
    if batched:
        lines += ["", "| model | batch | threads | aggregate t/s | per sequence t/s | vs b1 | weight bytes/token | "
                      "bandwidth bound t/s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        base = {r.n_threads: r.mean for r in batched if r.batch == 1}
        for r in batched:
            gain = f"{r.mean / base[r.n_threads]:.2f}x" if r.n_threads in base else "-"
            lines.append(f"| {r.model} | {r.batch} | {r.n_threads} | {r.mean:.1f} ± {r.std:.1f} | "
                         f"{r.mean / r.batch:.1f} | {gain} | {r.bytes_per_token / 1e6:.1f} MB | {r.bound_tps:.0f} |")
        turn = report.get("batch_turn")
        lines.append("")
        lines.append(f"bandwidth-bound up to batch {turn}: doubling it further gains < 1.5x" if turn else
                     "every doubling of the batch gained >= 1.5x: still bandwidth-bound at the largest batch")
    bw = ", ".join(f"{t} threads {b / 1e9:.1f} GB/s" for t, b in report["bandwidth"].items())
    lines.append("")
    lines.append(f"memory bandwidth (same run): {bw}; peak RSS {report['peak_rss'] / 1e6:.0f} MB; "
                 f"load {report['load_s']:.2f} s; threading layer {report.get('threading_layer', '-')}")
    if report.get("profile"):
        per_op, per_layer = profile_totals(report["profile"])
        total = sum(per_op.values())
        lines += ["", f"decode profile: {1e3 * total:.2f} ms per token", "", "| op | ms/token | share |",
                  "| --- | ---: | ---: |"]
        lines += [f"| {op} | {1e3 * sec:.3f} | {100 * sec / total:.1f}% |" for op, sec in per_op.items()]
        lines += ["", "| layer | ms/token | share |", "| --- | ---: | ---: |"]
        lines += [f"| {layer} | {1e3 * sec:.3f} | {100 * sec / total:.1f}% |" for layer, sec in per_layer.items()]
    return "\n".join(lines)


def profile_totals(rows) -> tuple[dict, dict]:
    """A decode profile summed per operation (largest first) and per layer ("-": outside the layers)."""
    per_op, per_layer = {}, {}
    for row in rows:
        layer = "-" if row["layer"] is None else row["layer"]
        per_op[row["op"]] = per_op.get(row["op"], 0.0) + row["seconds"]
        per_layer[layer] = per_layer.get(layer, 0.0) + row["seconds"]
    per_op = dict(sorted(per_op.items(), key=lambda kv: -kv[1]))
    per_layer = dict(sorted(per_layer.items(), key=lambda kv: (kv[0] == "-", kv[0] if kv[0] != "-" else 0)))
    return per_op, per_layer


def to_json(report: dict) -> str:
    out = dict(report)
    out["results"] = [dict(asdict(r), mean=r.mean, std=r.std, bound_tps=r.bound_tps) for r in report["results"]]
    out["bandwidth"] = {str(k): v for k, v in report["bandwidth"].items()}
    return json.dumps(out, indent=2)


def plot(report: dict, path: str) -> None:
    """Roofline-style picture: achieved decode t/s against the bandwidth bound, and the profile if present."""
    try:
        import matplotlib  # an optional extra (edgellm[plot])
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): no display needed
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'edgellm[plot]'") from None
    rows = [r for r in report["results"] if r.test.startswith("tg") and r.batch == 1 and " b" not in r.test]
    batched = [r for r in report["results"] if r.batch > 1 or " b" in r.test]
    n = 1 + bool(report.get("profile")) + bool(batched)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5), squeeze=False)
    ax = axes[0][0]
    labels = [f"{r.test}\n{r.n_threads}t" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r.bound_tps for r in rows], 0.4, label="bandwidth bound", color="#bbb")
    ax.bar(x + 0.2, [r.mean for r in rows], 0.4, yerr=[r.std for r in rows], label="edgellm", color="#3a7")
    ax.set_xticks(x, labels)
    ax.set_ylabel("tokens/s")
    ax.set_title("decode vs memory-bandwidth bound")
    ax.legend()
    if batched:  # the batch roofline: aggregate t/s against the bound of reading the weights once per step
        axb = axes[0][n - 1]
        b = [r.batch for r in batched]
        axb.plot(b, [r.mean for r in batched], "o-", color="#3a7", label="edgellm aggregate")
        axb.plot(b, [r.bound_tps for r in batched], "--", color="#999", label="bandwidth bound")
        axb.set_xscale("log", base=2)
        axb.set_yscale("log")
        axb.set_xlabel("sequences per step")
        axb.set_ylabel("tokens/s")
        if report.get("batch_turn"):
            axb.axvline(report["batch_turn"], color="#c55", lw=1, label="turns compute-bound")
        axb.set_title("batched decoding")
        axb.legend()
    if report.get("profile"):
        ax2 = axes[0][1]
        per_op = profile_totals(report["profile"])[0]
        ops = list(per_op)
        ax2.barh(ops, [1e3 * per_op[o] for o in ops], color="#37a")
        ax2.set_xlabel("ms per token")
        ax2.set_title("decode profile by operation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

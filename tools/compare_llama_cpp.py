"""edgellm against llama.cpp (through llama-cpp-python) on the same model, in one run, alternating engines.

    python tools/compare_llama_cpp.py smollm2-135m --llama-python /path/to/venv-with-llama-cpp/bin/python

Each measurement runs in a fresh worker process (so start-up and peak RSS are each engine's own), engines take
turns, and the ratios edgellm / llama.cpp come from the same run: the ratio of the means, and the median of each
repetition's ratio (its two measurements taken back to back), which one repetition slowed by a busy host moves
less. Tests: pp128, pp512, tg128, tg128 at depth 2048, start-up (imports + load + first token), peak RSS.
llama-cpp-python is only needed for this script, never by edgellm itself; without --llama-python it must be
importable by this interpreter.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

T_PROCESS_START = time.perf_counter()

TESTS = ("pp128", "pp512", "tg128", "tg128@d2048")


def _parse_test(test):
    depth = int(test.split("@d")[1]) if "@d" in test else 0
    kind, n = test[:2], int(test.split("@")[0][2:])
    return kind, n, depth


# ---- workers: run inside a fresh process, print one JSON line ------------------------------------------------

def worker_edgellm(model_path, threads, test):
    t0 = time.perf_counter()
    import numpy as np
    import edgellm
    kind, n, depth = _parse_test(test) if test != "startup" else ("startup", 1, 0)
    n_ctx = 512 if test == "startup" else depth + n + 64
    m = edgellm.load(model_path, n_threads=threads, n_ctx=n_ctx)
    model = m.model
    rng = np.random.default_rng(0)
    if test == "startup":
        model.forward(np.array([m.tokenizer.bos_id or 1], np.int32))
        return {"seconds": time.perf_counter() - t0, "peak_rss": _peak_rss()}
    toks = rng.integers(0, model.n_vocab, max(n, depth, 8), dtype=np.int32)
    model.forward(toks[:8])  # warm: compile and touch the weights
    model.forward(toks[:1])
    model.reset()
    if kind == "pp":
        t = time.perf_counter()
        model.forward(toks[:n])
        return {"tps": n / (time.perf_counter() - t), "peak_rss": _peak_rss()}
    if depth:
        model.forward(toks[:depth])
    tok = np.array([1], np.int32)
    t = time.perf_counter()
    for _ in range(n):
        logits = model.forward(tok)
        tok[0] = int(np.argmax(logits[-1]))
    return {"tps": n / (time.perf_counter() - t), "peak_rss": _peak_rss()}


def worker_llama_cpp(model_path, threads, test, no_repack=False):
    t0 = time.perf_counter()
    import numpy as np
    import llama_cpp
    if no_repack:  # llama.cpp's --no-repack: its weights stay in the map as edgellm's do, with no copy at load
        default_params = llama_cpp.llama_cpp.llama_model_default_params

        def params():
            p = default_params()
            p.use_extra_bufts = False
            return p
        llama_cpp.llama_cpp.llama_model_default_params = params
    kind, n, depth = _parse_test(test) if test != "startup" else ("startup", 1, 0)
    n_ctx = 512 if test == "startup" else depth + n + 64
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, n_ubatch=512, verbose=False)
    rng = np.random.default_rng(0)
    if test == "startup":
        llm.eval([llm.token_bos() if llm.token_bos() >= 0 else 1])
        return {"seconds": time.perf_counter() - t0, "peak_rss": _peak_rss()}
    toks = rng.integers(0, llm.n_vocab(), max(n, depth, 8)).tolist()
    llm.eval(toks[:8])
    llm.reset()
    if kind == "pp":
        t = time.perf_counter()
        llm.eval(toks[:n])
        return {"tps": n / (time.perf_counter() - t), "peak_rss": _peak_rss()}
    if depth:
        llm.eval(toks[:depth])
    tok = 1
    n_vocab = llm.n_vocab()
    t = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        # the last token's logits, read in place (llm.scores is only kept with logits_all=True)
        last = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
        tok = int(np.argmax(last))
    return {"tps": n / (time.perf_counter() - t), "peak_rss": _peak_rss()}


def _peak_rss():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- driver ----------------------------------------------------------------------------------------------------

def run_worker(python, engine, model_path, threads, test, no_repack=False):
    cmd = [python, os.path.abspath(__file__), "--worker", engine, model_path, "--threads", str(threads),
           "--test", test] + (["--llama-no-repack"] if no_repack else [])
    # Both engines start as an installed package does: with Python's bytecode caches (an environment that sets
    # PYTHONDONTWRITEBYTECODE would make every start-up recompile the modules' source).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{engine} {test} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="catalog name or .gguf path")
    ap.add_argument("--llama-python", default=sys.executable, help="python with llama-cpp-python installed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tests", default=",".join(TESTS + ("startup",)))
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama.cpp without its load-time repacking into extra buffers (its --no-repack): the "
                         "weights stay in the map, as edgellm's; by default it repacks the formats it can (a copy "
                         "of those weights in anonymous memory)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--test", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        if args.worker == "edgellm":
            print(json.dumps(worker_edgellm(args.model, args.threads, args.test)))
        else:
            print(json.dumps(worker_llama_cpp(args.model, args.threads, args.test, args.llama_no_repack)))
        return 0

    from edgellm.store import catalog
    path = str(catalog.resolve(args.model))
    tests = args.tests.split(",")
    raw = {t: {"edgellm": [], "llama.cpp": []} for t in tests}
    rss = {"edgellm": 0, "llama.cpp": 0}
    for rep in range(args.reps):
        for test in tests:
            for engine, python in (("edgellm", sys.executable), ("llama.cpp", args.llama_python)):
                r = run_worker(python, engine, path, args.threads, test, args.llama_no_repack)
                raw[test][engine].append(r.get("tps", r.get("seconds")))
                if test in ("startup", "tg128"):
                    rss[engine] = max(rss[engine], r["peak_rss"])
                print(f"rep {rep} {test:12s} {engine:9s} {raw[test][engine][-1]:8.2f}", file=sys.stderr, flush=True)

    print(f"\n{os.path.basename(path)}, {args.threads} threads, {args.reps} reps, alternating engines"
          f"{'; llama.cpp without repacking' if args.llama_no_repack else ''}\n")
    print("| test | edgellm | llama.cpp | edgellm / llama.cpp | median of paired ratios |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for test in tests:
        e, ll = raw[test]["edgellm"], raw[test]["llama.cpp"]
        me, ml = statistics.fmean(e), statistics.fmean(ll)
        unit = "s" if test == "startup" else "t/s"
        # for start-up, lower is better: report the speed ratio (llama.cpp time / edgellm time)
        ratio = ml / me if test == "startup" else me / ml
        paired = statistics.median(b / a if test == "startup" else a / b for a, b in zip(e, ll))
        se = statistics.stdev(e) if len(e) > 1 else 0
        sl = statistics.stdev(ll) if len(ll) > 1 else 0
        print(f"| {test} | {me:.2f} ± {se:.2f} {unit} | {ml:.2f} ± {sl:.2f} {unit} | {ratio:.2f}x | {paired:.2f}x |")
    print(f"| peak RSS | {rss['edgellm'] / 1e6:.0f} MB | {rss['llama.cpp'] / 1e6:.0f} MB | "
          f"{(rss['edgellm'] - rss['llama.cpp']) / 1e6:+.0f} MB | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw": raw, "peak_rss": rss, "threads": args.threads, "model": path}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

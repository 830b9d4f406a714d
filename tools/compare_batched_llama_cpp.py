"""Batched decoding against llama.cpp's own: aggregate tokens/s with B sequences decoded together, per B.

    python tools/compare_batched_llama_cpp.py MODEL --llama-python PY [--batches 1,2,4,8,16] [--reps 3]

Both engines prefill each of the B sequences with PROMPT random tokens, then time N_GEN steps that each decode
one token per sequence and take each sequence's greedy next token from its own logits:
  edgellm    Model.forward_multi over B caches of one KVPool (what generate_batch's steps run), as edgellm bench;
  llama.cpp  llama-cpp-python's low-level API: one llama_batch per step holding B tokens, each with its own
             seq_id and a logits flag, one llama_decode, then llama_get_logits_ith per sequence (a unified KV cache
             holding all B sequences, as llama.cpp's batched example and server use).
Each measurement runs in a fresh worker process, engines alternating, B by B. Ratios are edgellm's aggregate t/s
over llama.cpp's; in brackets the median of each repetition's own ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = 16   # tokens each sequence is prefilled with
N_GEN = 64    # decode steps timed


def worker_edgellm(model_path, threads, batch, n_gen):
    import numpy as np
    import edgellm
    from edgellm.prep.bench import run_tg_batch
    m = edgellm.load(model_path, n_threads=threads, n_ctx=max(512, batch * 8))
    rng = np.random.default_rng(0)
    run_tg_batch(m.model, batch, 2, 1, rng)  # warm: this batch size's kernel paths, the weights in the page cache
    tps = run_tg_batch(m.model, batch, n_gen, 1, rng)[0]
    return {"tps": tps}


def worker_llama_cpp(model_path, threads, batch, n_gen):
    import ctypes

    import numpy as np
    import llama_cpp as L
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    cparams = L.llama_context_default_params()
    cparams.n_ctx = max(512, batch * (PROMPT + n_gen + 8))
    cparams.n_batch = cparams.n_ubatch = max(512, batch * PROMPT)
    cparams.n_seq_max = batch
    cparams.kv_unified = True
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.no_perf = True
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    lbatch = L.llama_batch_init(max(batch * PROMPT, batch), 0, batch)
    rng = np.random.default_rng(0)

    def put(i, token, pos, seq, logits):
        lbatch.token[i] = int(token)
        lbatch.pos[i] = pos
        lbatch.n_seq_id[i] = 1
        lbatch.seq_id[i][0] = seq
        lbatch.logits[i] = logits

    def decode(n):
        lbatch.n_tokens = n
        rc = L.llama_decode(ctx, lbatch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def run(steps):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        prompts = rng.integers(0, n_vocab, (batch, PROMPT))
        for s in range(batch):
            for j in range(PROMPT):
                put(s * PROMPT + j, prompts[s, j], j, s, j == PROMPT - 1)
        decode(batch * PROMPT)
        toks = rng.integers(0, n_vocab, batch)
        t0 = time.perf_counter()
        for step in range(steps):
            for s in range(batch):
                put(s, toks[s], PROMPT + step, s, True)
            decode(batch)
            for s in range(batch):
                ptr = L.llama_get_logits_ith(ctx, s)
                toks[s] = int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                              shape=(n_vocab,))))
        return batch * steps / (time.perf_counter() - t0)

    run(2)  # warm
    tps = run(n_gen)
    L.llama_batch_free(lbatch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {"tps": tps}


def run_worker(python, engine, model_path, threads, batch, n_gen):
    cmd = [python, os.path.abspath(__file__), "--worker", engine, model_path, "--threads", str(threads),
           "--batch-size", str(batch), "--n-gen", str(n_gen)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{engine} B={batch} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help=".gguf path (or, for edgellm alone, a catalog name)")
    ap.add_argument("--llama-python", default=sys.executable, help="python with llama-cpp-python installed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--n-gen", type=int, default=N_GEN)
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        fn = worker_edgellm if args.worker == "edgellm" else worker_llama_cpp
        print(json.dumps(fn(args.model, args.threads, args.batch_size, args.n_gen)))
        return
    model = args.model
    if not os.path.isfile(model):  # a catalog name: llama.cpp needs the file
        import edgellm.store.catalog as catalog
        model = str(catalog.pull(model, quiet=True))
    batches = [int(b) for b in args.batches.split(",")]
    figures = {b: {"edgellm": [], "llama.cpp": []} for b in batches}
    loads = [os.getloadavg()[0]]
    for rep in range(args.reps):
        for b in batches:
            order = ("edgellm", "llama.cpp") if rep % 2 == 0 else ("llama.cpp", "edgellm")
            for engine in order:
                py = sys.executable if engine == "edgellm" else args.llama_python
                r = run_worker(py, "edgellm" if engine == "edgellm" else "llama_cpp", model, args.threads, b,
                               args.n_gen)
                figures[b][engine].append(r["tps"])
                print(f"rep {rep + 1} B={b} {engine}: {r['tps']:.1f} t/s", file=sys.stderr, flush=True)
        loads.append(os.getloadavg()[0])
    print(f"{os.path.basename(model)}, {args.threads} threads, {args.reps} repetitions, {PROMPT}-token prompts, "
          f"{args.n_gen} steps; load average (1 min) {min(loads):.2f}-{max(loads):.2f}")
    print("| sequences per step | edgellm aggregate t/s | llama.cpp aggregate t/s | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for b in batches:
        e, ll = figures[b]["edgellm"], figures[b]["llama.cpp"]
        me, ml = statistics.mean(e), statistics.mean(ll)
        paired = statistics.median(x / y for x, y in zip(e, ll))
        print(f"| {b} | {me:.1f} | {ml:.1f} | {me / ml:.2f}x ({paired:.2f}x) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(b): v for b, v in figures.items()}, f, indent=1)


if __name__ == "__main__":
    main()

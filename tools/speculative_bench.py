"""The speculative decoding benchmark (docs/speculative.md): every task of edgellm.prep.speculative_bench.TASKS,
decoded greedily without and with speculation, each run in a fresh process, the two alternating, so that load from
other processes on a shared host hits both alike. Prints a markdown table (t/s, speed-up, acceptance, identical
output, and for prompt lookup the bound of draft lengths chosen knowing the output, at forward costs measured in
one more fresh process) and optionally llama.cpp's plain decode on the same prompts. The processes share the
forward-cost table kept on disk (edgellm.generation.cost_store), as a user's successive runs do; EDGELLM_SPEC_COSTS=off measures
generations that start with none.

    python tools/speculative_bench.py MODEL [--mode lookup|draft] [--draft-model PATH] [-n 128] [-r 2] [-t 1]
        [--warm] [--llama-cpp]   # also llama-cpp-python's plain decode t/s (run with /work/llama-venv/bin/python)
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, sys, edgellm
from edgellm.prep import speculative_bench as sb
model, draft, mode, kind, index, n_gen, threads, warm = json.loads(sys.argv[1])
m = edgellm.load(model, n_threads=threads, n_ctx=2048, draft_model=draft)
ids = m.chat_prompt_ids(sb.TASKS[kind][index][1])
sb.measure(m, ids[:8], mode, 2)  # warm: the kernels of this process
if warm:  # the task once before: speculation starts from the forward costs it measured then
    sb.measure(m, ids, mode, n_gen)
print(json.dumps(sb.measure(m, ids, mode, n_gen)))
'''

BOUND_CHILD = r'''
import json, sys, edgellm
from edgellm.generation.speculative import DRAFT_MAX
from edgellm.prep import speculative_bench as sb
model, threads, tasks = json.loads(sys.argv[1])  # tasks: [[kind, index, tokens]]
m = edgellm.load(model, n_threads=threads, n_ctx=2048)
prompts = [m.chat_prompt_ids(sb.TASKS[kind][index][1]) for kind, index, _ in tasks]
sb.measure(m, prompts[0][:8], "lookup", 2)  # warm: the kernels of this process
costs = sb.forward_costs(m, prompts[0], DRAFT_MAX["lookup"] + 1)
print(json.dumps([sb.foresight_bound(ids, toks, costs, DRAFT_MAX["lookup"]) if costs else None
                  for ids, (_, _, toks) in zip(prompts, tasks)]))
'''

LLAMA_CHILD = r'''
import json, sys, time
from llama_cpp import Llama
path, prompts, n_gen, threads = json.loads(sys.argv[1])
llm = Llama(path, n_ctx=2048, n_threads=threads, verbose=False)
out = []
for ids in prompts:
    llm.reset()
    toks, t0 = [], None
    for tok in llm.generate(ids, temp=0.0):  # the prompt is evaluated before the first token comes
        toks.append(tok)
        t0 = t0 or time.perf_counter()
        if len(toks) >= n_gen or tok == llm.token_eos():
            break
    out.append([(len(toks) - 1) / (time.perf_counter() - t0) if len(toks) > 1 else 0.0, toks])
print(json.dumps(out))
'''


def child(args, mode, kind, index):
    cmd = ["nice", "-n", "10", sys.executable, "-c", CHILD,
           json.dumps([args.model, args.draft_model, mode, kind, index, args.n_gen, args.threads, args.warm])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--mode", choices=("lookup", "draft"), default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--kinds", default=None, help="comma list of task kinds (default: all)")
    ap.add_argument("--warm", action="store_true", help="measure each process's second generation of its task: a "
                    "Model keeps the forward costs speculation measured across calls, as a server or a chat does")
    ap.add_argument("--llama-cpp", default=None, metavar="PYTHON", help="a python with llama_cpp: also its plain "
                    "decode t/s on the same prompts")
    args = ap.parse_args()
    mode = args.mode or ("draft" if args.draft_model else "lookup")
    from edgellm.prep import speculative_bench as sb
    rows, where = [], []
    for kind, tasks in sb.TASKS.items():
        if args.kinds and kind not in args.kinds.split(","):
            continue
        for index, (name, _) in enumerate(tasks):
            where.append((kind, index))
            plain, spec = [], []
            for _ in range(args.repeats):
                plain.append(child(args, None, kind, index))
                spec.append(child(args, mode, kind, index))
            row = {"task": name, "kind": kind, **sb.summarise(plain, spec)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), file=sys.stderr, flush=True)
    if mode == "lookup" and rows:
        cmd = ["nice", "-n", "10", sys.executable, "-c", BOUND_CHILD,
               json.dumps([args.model, args.threads, [[k, i, r["tokens"]] for (k, i), r in zip(where, rows)]])]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        for row, bound in zip(rows, json.loads(out.stdout.strip().splitlines()[-1])):
            if bound is not None:
                row["bound"] = bound
    print(sb.to_markdown(rows))
    if args.llama_cpp:
        import edgellm
        m = edgellm.load(args.model, n_ctx=2048)
        prompts = [m.chat_prompt_ids(msgs) for kind, tasks in sb.TASKS.items() for _, msgs in tasks
                   if not args.kinds or kind in args.kinds.split(",")]
        cmd = ["nice", "-n", "10", args.llama_cpp, "-c", LLAMA_CHILD,
               json.dumps([m.path, prompts, args.n_gen, args.threads])]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results = json.loads(out.stdout.strip().splitlines()[-1])
        print("\n| task | llama.cpp plain t/s | edgellm speculative / llama.cpp | same tokens as edgellm |\n"
              "| --- | ---: | ---: | --- |")
        for row, (t, toks) in zip(rows, results):
            ratio = f"{row['spec_tps'] / t:.2f}x" if t else "-"
            same = toks[:len(row["tokens"])] == row["tokens"][:len(toks)]  # (llama.cpp's stop: its eos token)
            print(f"| {row['task']} | {t:.1f} | {ratio} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()

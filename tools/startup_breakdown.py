"""What start-up (imports + load + first token, warm caches) is made of, measured in fresh processes.

    python tools/startup_breakdown.py MODEL [--reps 5] [--threads 2] [--python PY ...]

Each repetition runs a worker in a fresh interpreter (with Python's bytecode caches: PYTHONDONTWRITEBYTECODE is
dropped) that times, in order: `import edgellm`, numpy, numba, edgellm.api, `edgellm.load`, the first token, and
counts the kernels loaded from Numba's cache, the dispatchers created and the modules imported. Several --python
interpreters (or PYTHONPATH values via --pythonpath, e.g. an exported older tree) take turns, repetition by
repetition, so that a busy host slows them alike. Prints the medians per phase and the host's load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PHASES = ("import_edgellm", "numpy", "numba", "api", "load", "first_token", "total")

WORKER = r"""
import json, resource, sys, time
marks = [(time.perf_counter(), time.process_time())]
def mark():
    marks.append((time.perf_counter(), time.process_time()))
import edgellm
mark()
import numpy as np
mark()
import numba
from numba.core import dispatcher
created = [0]
_init = dispatcher.Dispatcher.__init__
def _counting_init(self, *a, **k):
    created[0] += 1
    return _init(self, *a, **k)
dispatcher.Dispatcher.__init__ = _counting_init
mark()
import edgellm.api
mark()
m = edgellm.load(sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=512)
mark()
m.model.forward(np.array([m.tokenizer.bos_id or 1], np.int32))
mark()
from edgellm.quant import cache_load
names = ("import_edgellm", "numpy", "numba", "api", "load", "first_token")
out = {n: marks[i + 1][0] - marks[i][0] for i, n in enumerate(names)}
out.update({"cpu_" + n: marks[i + 1][1] - marks[i][1] for i, n in enumerate(names)})
out.update(total=marks[-1][0] - marks[0][0], cpu_total=marks[-1][1] - marks[0][1])
print(json.dumps({**out, "cache_loads": cache_load.stats["light_loads"], "dispatchers": created[0],
                  "modules": len(sys.modules), "edgellm_modules": sum(k.startswith("edgellm") for k in sys.modules)}))
"""


def run_once(python, pythonpath, model, threads):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # from the root directory: `python -c` puts the working directory first on sys.path, and a checkout there
    # would be imported in place of the interpreter's own edgellm
    out = subprocess.run([python, "-c", WORKER, model, str(threads)], capture_output=True, text=True, env=env,
                         timeout=900, cwd=os.sep)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help=".gguf path or catalog name")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--python", action="append", default=None, help="interpreter(s) to compare (default: this one)")
    ap.add_argument("--pythonpath", action="append", default=None,
                    help="PYTHONPATH value(s) to compare, each with the first --python ('' for none)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    args = ap.parse_args(argv)
    if os.path.exists(args.model):
        args.model = os.path.abspath(args.model)
    pythons = args.python or [sys.executable]
    paths = args.pythonpath if args.pythonpath is not None else [None]
    variants = [(py, pp) for py in pythons for pp in paths]
    for py, pp in variants:  # warm: bytecode and kernel caches, the page cache
        run_once(py, pp, args.model, args.threads)
    loads = [os.getloadavg()[0]]
    results = {v: [] for v in variants}
    for _ in range(args.reps):
        for v in variants:
            results[v].append(run_once(*v, args.model, args.threads))
        loads.append(os.getloadavg()[0])
    print(f"load average (1 min) during the run: {min(loads):.2f}-{max(loads):.2f}; median of {args.reps}, seconds")
    for title, prefix in (("wall", ""), ("CPU (process time, all threads)", "cpu_")):
        print(f"\n{title}:\n| variant | " + " | ".join(PHASES) + " | cache loads | dispatchers | modules |")
        print("| --- |" + " ---: |" * (len(PHASES) + 3))
        for (py, pp), rows in results.items():
            med = {k: statistics.median(r[prefix + k] for r in rows) for k in PHASES}
            last = rows[-1]
            if len(pythons) > 1:      # several interpreters: each one's path (a venv names its tree)
                name = py if pp is None else f"{py} {pp or 'this tree'}"
            else:
                name = (pp or "this tree") if len(variants) > 1 else os.path.basename(py)
            print(f"| {name} | " + " | ".join(f"{med[k]:.3f}" for k in PHASES)
                  + f" | {last['cache_loads']} | {last['dispatchers']} | {last['modules']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{py}|{pp}": rows for (py, pp), rows in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()

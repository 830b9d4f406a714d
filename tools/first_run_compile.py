"""What a first run compiles: runs the README command in this process and lists every Numba compilation with its
wall and thread CPU time (nested ones indented under the kernel that pulled them in).

    NUMBA_CACHE_DIR=$(mktemp -d) python tools/first_run_compile.py [--json OUT] [-- edgellm run arguments ...]

Use a fresh, empty NUMBA_CACHE_DIR: with a warm one nothing compiles. Thread CPU time stays meaningful on a busy
host, where wall time does not.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

README_RUN = ["run", "-p", "The capital of France is", "-n", "32"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="also write the compilations here")
    ap.add_argument("run_args", nargs="*", help="arguments of `edgellm` (default: the README's run command)")
    args = ap.parse_args(argv)
    from numba.core import event

    stack, log = [], []

    class Listener(event.Listener):
        def on_start(self, ev):
            f = ev.data["dispatcher"].py_func
            stack.append((f"{f.__module__}.{f.__qualname__}", time.perf_counter(), time.thread_time()))

        def on_end(self, ev):
            name, t0, c0 = stack.pop()
            log.append(dict(depth=len(stack), name=name, wall=time.perf_counter() - t0, cpu=time.thread_time() - c0))

    event.register("numba:compile", Listener())
    from edgellm import cli
    cli.main(args.run_args or README_RUN)
    top = [e for e in log if e["depth"] == 0]
    out = sys.stderr
    print(f"\n{len(log)} compilations, {len(top)} top-level: {sum(e['cpu'] for e in top):.1f} s thread CPU, "
          f"{sum(e['wall'] for e in top):.1f} s wall", file=out)
    for e in reversed(log):  # a kernel before the ones it pulled in
        print(f"{e['cpu']:7.2f} {e['wall']:7.2f}  {'  ' * e['depth']}{e['name']}", file=out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(log, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long opening a GGUF file takes with edgellm's reader (and, optionally, gguf-py's GGUFReader), and how much
resident memory opening adds: the tensor data must stay in the map, untouched, so RSS grows only by the metadata.

    python tools/bench_gguf_open.py smollm2-135m gemma-3-270m [--gguf-py] [--repeats 5]

Each open runs in a fresh process, so the figure includes nothing cached in the interpreter (the file's pages
may be in the OS page cache, as they are for llama.cpp's figure).
"""
import argparse
import json
import statistics
import subprocess
import sys

PROBE = r"""
import json, sys, time
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
which, path = sys.argv[1], sys.argv[2]
import numpy  # both readers need it; not part of the open
before = rss()
t0 = time.perf_counter()
if which == "edgellm":
    import edgellm.engine.gguf as g
    f = g.open(path)
    n = len(f.tensors)
else:
    import gguf
    f = gguf.GGUFReader(path)
    n = len(f.tensors)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "rss_growth": rss() - before, "tensors": n}))
"""


def run(which, path):
    out = subprocess.run([sys.executable, "-c", PROBE, which, path], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gguf-py", action="store_true", help="also time gguf-py's GGUFReader (slow: ~20 s on Gemma)")
    args = ap.parse_args()
    from edgellm.store import catalog
    print("| file | reader | open (s), median | RSS growth | file size |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in args.models:
        path = str(catalog.resolve(name))
        size = catalog.Path(path).stat().st_size
        readers = ["edgellm"] + (["gguf-py"] if args.gguf_py else [])
        for which in readers:
            reps = args.repeats if which == "edgellm" else 1
            runs = [run(which, path) for _ in range(reps)]
            t = statistics.median(r["seconds"] for r in runs)
            g = statistics.median(r["rss_growth"] for r in runs)
            print(f"| {catalog.Path(path).name} | {which} | {t:.3f} | {g / 1e6:.1f} MB | {size / 1e6:.0f} MB |")


if __name__ == "__main__":
    main()

"""Decode speed by calling thread: one ThreadPoolExecutor worker, then jobs spread over the executor's workers (each
job on whichever worker is free, as a web framework's thread pool hands out requests), then the main thread.

    python tools/bench_threads.py [MODEL] [--tokens 200] [--jobs 4] [--workers 4] [--main-first [--release]]

Prints tokens/s of `model.forward` decode steps per job and the thread that asked. Where several live threads each
ran OpenMP regions, every region pays a worker wake-up (docs/kernels.md, "Threads"). --main-first runs a job on the
main thread before the workers: the case the engine thread does not cover, a main thread that keeps its OpenMP team
while it waits; --release then calls edgellm.release_threads() after it, the remedy."""
import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import edgellm


def decode_rate(model, n_tokens: int) -> float:
    model.reset()
    model.forward(np.array([1, 2, 3, 4, 5], np.int32))
    t0 = time.perf_counter()
    for i in range(n_tokens):
        model.forward(np.array([100 + i % 500], np.int32))
    return n_tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--main-first", action="store_true")
    ap.add_argument("--release", action="store_true", help="with --main-first: edgellm.release_threads() after it")
    args = ap.parse_args()
    model = edgellm.load(args.model).model

    def job(tag):
        rate = decode_rate(model, args.tokens)
        print(f"{tag:12s} {threading.current_thread().name:28s} {rate:7.1f} t/s", flush=True)

    if args.main_first:
        job("main first")
        if args.release:
            edgellm.release_threads()
    with ThreadPoolExecutor(args.workers) as ex:
        ex.submit(job, "one worker").result()
        for k in range(args.jobs):
            list(ex.map(lambda _: time.sleep(0.2), range(args.workers)))  # every worker has run something
            ex.submit(job, f"spread {k}").result()
        job("main")


if __name__ == "__main__":
    main()

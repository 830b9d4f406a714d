"""`edgellm warmup` on each real model into an empty Numba cache, then a fresh process that must compile nothing,
the server's scheduler included: every kernel comes from the cache through quant.cache_load's light path (no registry refresh: a cached kernel that
used an array method such as .any() would pull Numba's array-math registry in at load), and its logits are still
llama.cpp's. And the README's first command, `edgellm run`, into an empty cache: what it shows while compiling,
and a timing line that leaves compilation out."""
import functools
import json
import os
import re
import sys

import pytest

import background
from conftest import FIXTURES, REFERENCE_FILES, SMOLLM2, _pull
from edgellm.cli import COMPILE_NOTE
from exact_host import EXACT_HOST

# Runs in a fresh process after the warm-up: load, the warm-up's paths, then the reference prompt's logits.
CHILD = r"""
import json, sys
import numpy as np
import edgellm
from edgellm.engine.compile_clock import count_compiles
from edgellm.prep.warmup import exercise
from edgellm.quant import cache_load
path, ref = sys.argv[1], sys.argv[2]
with count_compiles() as compiled:
    m = edgellm.load(path, n_threads=2, n_ctx=512)
    exercise(m)
    # what a server's first requests run: the scheduler, a chat prompt in chunks, greedy and sampled
    from edgellm.generation.options import parse_options
    from edgellm.generation.scheduler import Scheduler
    scheduler = Scheduler(m, 2)
    ids = m.chat_prompt_ids([{"role": "user", "content": "Hi there"}])
    served = [scheduler.submit(ids, parse_options("t", {"temperature": t, "max_tokens": 4, "seed": 1}, {}))
              for t in (0, 0.8)]
    for request in served:
        list(request.events())
    scheduler.close()
    npz = np.load(ref)
    m.model.reset()
    logits = m.model.forward(npz["p0_ids"], all_logits=True)
ours = np.take_along_axis(logits, npz["p0_topk_ids"], axis=1)
print(json.dumps({
    "compiled": compiled.n,
    "light_loads": cache_load.stats["light_loads"],
    "refreshed": "numba.np.linalg" in sys.modules,  # imported only by Numba's full registry refresh
    "max_diff": float(np.abs(ours - npz["p0_topk_logits"]).max()),
}))
"""


# The warm-ups of both models share one cache, empty at the start: the second model's finds only the kernels the
# two have in common. Every step is a child process; they run beside the other tests (tests/background.py), as
# nothing in them is timed.
WARMUP_CACHE = background.temp_dir("warmup-cache")
WARMUP_ENV = background.child_env(NUMBA_CACHE_DIR=WARMUP_CACHE)


@functools.cache
def _warmup_jobs_for(name):
    path, ref = _pull(name), str(FIXTURES / f"{REFERENCE_FILES[name]}.npz")
    warmup = [sys.executable, "-m", "edgellm.cli", "warmup", path, "-t", "2"]
    return [background.Job(f"warmup-{name}", warmup, env=WARMUP_ENV),
            background.Job(f"after-warmup-{name}", [sys.executable, "-c", CHILD, path, ref], env=WARMUP_ENV),
            background.Job(f"warmup-again-{name}", warmup, env=WARMUP_ENV)]


def _warmup_jobs(item):
    return _warmup_jobs_for(item.callspec.params["real_model"])


def _warmed(done):
    assert done.returncode == 0, done.stderr
    match = re.search(r"warmed in ([\d.]+) s \((\d+) kernels compiled; cache (.+)\)", done.stdout)
    assert match, done.stdout
    return float(match.group(1)), int(match.group(2)), match.group(3)


@pytest.mark.background(jobs=_warmup_jobs)
def test_warmup_fills_the_cache_and_later_processes_compile_nothing(real_model):
    name, _ = real_model
    warmup, after, again = _warmup_jobs_for(name)
    seconds, compiled, cache_dir = _warmed(background.result(warmup))
    assert compiled > 10  # an empty cache (or one with only the other model's): its kernels were compiled here
    assert cache_dir == str(WARMUP_CACHE)
    assert any(f.endswith(".nbi") for _, _, files in os.walk(cache_dir) for f in files)
    print(f"cold warm-up of {name}: {seconds:.1f} s, {compiled} kernels")

    out = background.result(after)
    assert out.returncode == 0, out.stderr  # a kernel missing a runtime symbol would have crashed the process
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["compiled"] == 0, report
    assert report["light_loads"] > 10 and not report["refreshed"], report
    if EXACT_HOST:  # the CPU paths and libm the llama.cpp reference was recorded and checked on: bit for bit
        assert report["max_diff"] == 0.0, report
    else:
        assert report["max_diff"] < 1e-2, report

    assert _warmed(background.result(again))[1] == 0  # a second warm-up finds everything cached


TIMING_LINE = re.compile(r"prompt: (\d+) tokens, ([\d.]+) t/s \| generation: \d+ tokens, [\d.]+ t/s \| load [\d.]+ s"
                         r"(?: \| compile ([\d.]+) s \(first run only\))?")
# A 5-token prompt takes well under a second once compiled; the compilation it needs takes tens of seconds, so a
# prompt time counting any real part of it would exceed this share.
PROMPT_SHARE_OF_COMPILE = 0.1


@functools.cache
def _first_run_jobs_for():
    env = background.child_env(NUMBA_CACHE_DIR=background.temp_dir("first-run-cache"))
    cmd = [sys.executable, "-m", "edgellm.cli", "run", _pull(SMOLLM2), "-p", "The capital of France is", "-n", "8",
           "-t", "2"]
    return background.Job("first-run-cold", cmd, env=env), background.Job("first-run-warm", cmd, env=env)


# Not queued in the background: its timing line's prompt speed must not depend on the main process's load.
def test_first_run_shows_compilation_and_keeps_it_out_of_the_timing_line():
    cold_job, warm_job = _first_run_jobs_for()
    cold = background.result(cold_job)
    assert cold.returncode == 0, cold.stderr
    assert COMPILE_NOTE in cold.stderr.splitlines(), cold.stderr
    compiled = re.search(r"^edgellm: compiled (\d+) kernels in ([\d.]+) s$", cold.stderr, re.M)
    assert compiled and int(compiled.group(1)) > 10, cold.stderr
    timing = TIMING_LINE.search(cold.stderr)
    assert timing and timing.group(3) is not None, cold.stderr  # compilation reported on its own
    compile_s, prompt_tps = float(timing.group(3)), float(timing.group(2))
    assert compile_s >= float(compiled.group(2))
    assert prompt_tps > 0 and int(timing.group(1)) / prompt_tps < PROMPT_SHARE_OF_COMPILE * compile_s, cold.stderr
    print(f"cold run: {compiled.group(1)} kernels in {compiled.group(2)} s; {timing.group(0)}")

    warm = background.result(warm_job)
    assert warm.returncode == 0, warm.stderr
    assert COMPILE_NOTE not in warm.stderr and "compiled" not in warm.stderr, warm.stderr
    timing = TIMING_LINE.search(warm.stderr)
    assert timing and timing.group(3) is None, warm.stderr

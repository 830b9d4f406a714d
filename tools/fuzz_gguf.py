"""Fuzz the GGUF reader: every case must end in success (with the reader's promises kept) or GGUFError.

    EDGELLM_MODELS=/work/mc python tools/fuzz_gguf.py --cases 100000          # the long run
    python tools/fuzz_gguf.py --cases 1500 --json                              # the sample tests/ runs
    python tools/fuzz_gguf.py --replay 4711 --save /tmp/case.gguf              # one case, with its traceback

The cases (mutated real headers, truncations, synthetic files) come from tools/fuzz_gguf_cases.py and are
deterministic: case i of seed s replays alone. On success a case also checks that every tensor view lies inside
the file (touching its first and last byte: outside the file that would be SIGBUS, not an exception), that all
metadata decodes to plain values, and that a tokenizer built from that metadata either works (ids in range,
out-of-range ids refused) or raises TokenizerError.

Anything else is a crash; a case over --time-limit is a hang. The run sets RLIMIT_AS to what the process has
mapped plus --mem-limit-mb, so trusting a length field shows up as MemoryError (a crash) instead of swapping.

Sections: checking one file; the campaign and its report; the command line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_gguf_cases import Seed, load_seeds, make_case, write_case  # noqa: E402

from edgellm.engine import gguf  # noqa: E402
from edgellm.errors import GGUFError, TokenizerError  # noqa: E402

PROBE_TEXT = "Hello world! 123 <|im_end|><end_of_turn> naïve 🙂\n\t x"


class CaseTimeout(BaseException):
    """Raised by SIGALRM inside a case that ran over its time bound (BaseException: no `except Exception` eats it)."""


class Violation(AssertionError):
    """A file the reader accepted breaks one of its promises."""


# ---------------------------------------------------------------------------------------------------------------
# Checking one file
# ---------------------------------------------------------------------------------------------------------------

def check_invariants(f) -> None:
    spans = []
    for name, t in f.tensors.items():
        if not (f.data_offset <= t.offset and t.offset + t.nbytes <= f.size):
            raise Violation(f"tensor {name!r} [{t.offset}, {t.offset + t.nbytes}) outside the file ({f.size})")
        if t.data.nbytes != t.nbytes or t.nbytes <= 0:
            raise Violation(f"tensor {name!r}: view of {t.data.nbytes} bytes for nbytes {t.nbytes}")
        if (t.offset - f.data_offset) % f.alignment:
            raise Violation(f"tensor {name!r} offset {t.offset} not aligned to {f.alignment}")
        _ = int(t.data[0]) + int(t.data[-1])   # outside the file this would be SIGBUS, not an exception
        spans.append((t.offset, t.offset + t.nbytes))
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1]:
            raise Violation(f"tensor spans {a} and {b} overlap")
    for key, value in f.metadata.items():
        if not isinstance(value, (bool, int, float, str, list, np.ndarray)):
            raise Violation(f"metadata {key!r} is a {type(value).__name__}")
        if isinstance(value, list) and not all(isinstance(s, str) for s in value):
            raise Violation(f"metadata {key!r} is a list of non-strings")


def probe_tokenizer(metadata) -> None:
    """A tokenizer from (possibly mutated) metadata works or raises TokenizerError; nothing else."""
    from edgellm.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(metadata)
    for parse_special in (False, True):
        ids = tok.encode(PROBE_TEXT, parse_special=parse_special)
        if not all(isinstance(i, int) and 0 <= i < tok.n_vocab for i in ids):
            raise Violation(f"encode gave ids outside [0, {tok.n_vocab}): {ids}")
    text = tok.decode(range(min(tok.n_vocab, 600)), special=True)
    if not isinstance(text, str):
        raise Violation("decode did not return a str")
    for bad in (-1, tok.n_vocab):
        try:
            tok.decode([bad])
        except TokenizerError:
            continue
        raise Violation(f"decode accepted out-of-range id {bad}")


def run_file(path: str) -> tuple[str, str]:
    """('ok', '') or ('gguf_error' | 'tokenizer_error', message); anything else propagates (a crash)."""
    try:
        f = gguf.open(path)
    except GGUFError as e:
        return "gguf_error", str(e).replace(path + ": ", "", 1)
    try:
        check_invariants(f)
        if "tokenizer.ggml.model" in f.metadata:
            try:
                probe_tokenizer(f.metadata)
            except TokenizerError as e:
                return "tokenizer_error", str(e)
        return "ok", ""
    finally:
        f.close()


def _on_alarm(signum, frame):
    raise CaseTimeout()


def message_kind(message: str) -> str:
    """A message with its numbers and quoted names blanked, to count kinds of errors rather than instances."""
    message = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", message)
    return re.sub(r"\d+", "#", message)


# ---------------------------------------------------------------------------------------------------------------
# The campaign and its report
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Report:
    cases: int = 0
    outcomes: dict = field(default_factory=dict)
    by_seed: dict = field(default_factory=dict)
    messages: set = field(default_factory=set)
    crashes: list = field(default_factory=list)
    hangs: list = field(default_factory=list)
    slowest_s: float = 0.0
    elapsed_s: float = 0.0

    def as_dict(self) -> dict:
        return {"cases": self.cases, "outcomes": self.outcomes, "by_seed": self.by_seed,
                "distinct_error_messages": len(self.messages),
                "distinct_error_kinds": len({message_kind(m) for m in self.messages}),
                "crashes": len(self.crashes), "hangs": len(self.hangs),
                "crash_examples": self.crashes[:20], "hang_examples": self.hangs[:20],
                "slowest_case_s": round(self.slowest_s, 3), "elapsed_s": round(self.elapsed_s, 1)}


def run_campaign(cases: int, seed: int = 0, start: int = 0, time_limit_s: float = 30.0, progress: bool = False,
                 seeds: list[Seed] | None = None) -> Report:
    seeds = load_seeds() if seeds is None else seeds
    report = Report()
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    t_start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="fuzz_gguf_") as workdir:
            for index in range(start, start + cases):
                data, tail, seed_name = make_case(index, seed, seeds)
                path = write_case(workdir, data, tail)
                t0 = time.perf_counter()
                signal.setitimer(signal.ITIMER_REAL, time_limit_s)
                try:
                    outcome, message = run_file(path)
                except CaseTimeout:
                    outcome, message = "hang", ""
                    report.hangs.append({"case": index, "seed_file": seed_name})
                except BaseException as e:  # noqa: BLE001 - a crash is what we are looking for
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    outcome, message = "crash", ""
                    report.crashes.append({"case": index, "seed_file": seed_name,
                                           "error": f"{type(e).__name__}: {e}"[:300]})
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                report.slowest_s = max(report.slowest_s, time.perf_counter() - t0)
                report.cases += 1
                report.outcomes[outcome] = report.outcomes.get(outcome, 0) + 1
                per_seed = report.by_seed.setdefault(seed_name, {})
                per_seed[outcome] = per_seed.get(outcome, 0) + 1
                if message:
                    report.messages.add(message)
                if progress and report.cases % 5000 == 0:
                    print(f"  {report.cases} cases, {report.outcomes}, {time.perf_counter() - t_start:.0f} s",
                          file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGALRM, old_handler)
    report.elapsed_s = time.perf_counter() - t_start
    return report


# ---------------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------------

def limit_address_space(extra_mb: int) -> int:
    """RLIMIT_AS = what is mapped now + extra_mb: an allocation sized by a lying length field fails fast."""
    with open("/proc/self/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = (vm_kb << 10) + (extra_mb << 20)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    return limit


def replay(index: int, seed: int, save: str | None) -> int:
    seeds = load_seeds()
    data, tail, seed_name = make_case(index, seed, seeds)
    with tempfile.TemporaryDirectory(prefix="fuzz_gguf_") as workdir:
        path = write_case(workdir, data, tail)
        if save:
            import shutil
            shutil.copyfile(path, save)
        print(f"case {index} (seed file {seed_name}): {len(data)} bytes + {tail} sparse zero bytes")
        try:
            print(run_file(path))
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--mem-limit-mb", type=int, default=1024, help="address space allowed beyond the start's")
    ap.add_argument("--replay", type=int, help="run this one case and show its traceback")
    ap.add_argument("--save", help="with --replay: copy the case's file here")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if args.replay is not None:
        return replay(args.replay, args.seed, args.save)
    seeds = load_seeds()
    # warm-up: the first open imports the format table (and numba) before the address space is capped
    with tempfile.TemporaryDirectory() as d:
        run_file(write_case(d, seeds[0].data, 0))
    if args.mem_limit_mb > 0:
        limit_address_space(args.mem_limit_mb)
    report = run_campaign(args.cases, args.seed, args.start, args.time_limit, progress=not args.json, seeds=seeds)
    result = report.as_dict()
    result.update(seed=args.seed, seeds=[s.name for s in seeds], mem_limit_mb=args.mem_limit_mb,
                  time_limit_s=args.time_limit)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
        print(f"reproduce: python tools/fuzz_gguf.py --cases {args.cases} --seed {args.seed}")
    return 1 if report.crashes or report.hangs else 0


if __name__ == "__main__":
    sys.exit(main())

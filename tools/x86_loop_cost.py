"""llvm-mca over the compiled loops of a model's kernels: which loops wait on a dependency chain instead of their
instructions' throughput (x86; the AArch64 costs are tools/arm_cost.py's).

    python tools/x86_loop_cost.py MODEL [--mcpu znver4] [--min-ratio 1.4] [--batch 8] [--show 3]

Loads MODEL with a fresh Numba cache (machine code loaded from a cache cannot be inspected), runs a prompt, a few
decode steps and a batched decode step so that every kernel a session uses is compiled, then takes the assembly of
every edgellm kernel. For each innermost loop with vector instructions it prints llvm-mca's cycles per iteration
next to the loop's reciprocal throughput (what its instructions alone allow) and their ratio: near 1 the loop is
bound by its ports; well above, by a chain of dependent instructions, and for those (ratio >= --min-ratio, the
--show worst) llvm-mca's critical sequence. A loop-carried chain through a register that merely hosted an unrelated
value (a `vpinsrw` into an accumulator's register, say) is what this finds. Needs llvm-mca (the newest llvm-mca-N
on PATH, as tools/arm_cost.py).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arm_cost import MCA, mca_report  # noqa: E402  (the llvm-mca lookup and runner)

_LABEL = re.compile(r"^(\.LBB\w+):")
_JUMP = re.compile(r"^\s+j\w+\s+(\.LBB\w+)\s*$")
_VECTOR = re.compile(r"%[xyz]mm")


def kernel_asm(model: str, batch: int) -> dict[str, str]:
    """{kernel name: assembly} of every edgellm kernel compiled while MODEL runs a prompt, decodes and decodes a
    batch, in this (fresh-cache) process."""
    from numba.core.dispatcher import Dispatcher

    import edgellm
    m = edgellm.load(model, n_ctx=512)
    m.generate("The capital of France is a city with many museums and old streets, " * 3, max_tokens=4)
    if batch > 1:
        m.generate_batch(["Once upon a time"] * batch, max_tokens=2)
    out = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("edgellm"):
            continue
        for v in list(vars(mod).values()):
            if isinstance(v, Dispatcher) and v.overloads and v.py_func.__module__ == mod_name:
                for i, sig in enumerate(v.signatures):
                    out[f"{mod_name.removeprefix('edgellm.')}.{v.__name__}#{i}"] = v.inspect_asm(sig)
    return out


def innermost_loops(asm: str):
    """Instruction lists of the innermost backward-branch loops that use vector registers and call nothing."""
    lines = asm.splitlines()
    labels, spans = {}, []
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = i
        j = _JUMP.match(line)
        if j and j.group(1) in labels and labels[j.group(1)] < i:
            spans.append((labels[j.group(1)], i))
    for a, b in spans:
        if any(a < c and d < b for c, d in spans if (c, d) != (a, b)):
            continue  # an outer loop
        body = [line.strip() for line in lines[a + 1:b + 1]
                if line.strip() and not line.strip().startswith(".") and not _LABEL.match(line)]
        if sum(1 for line in body if _VECTOR.search(line)) >= 4 and not any(x.startswith("call") for x in body):
            yield lines[a].split(":")[0], body


def mca(body: list[str], cpu: str, bottleneck: bool = False) -> tuple[float, float, str]:
    report, cycles = mca_report(body, cpu, *(["-bottleneck-analysis"] if bottleneck else []))
    rthroughput = float(re.search(r"Block RThroughput:\s+([\d.]+)", report).group(1))
    critical = report.split("Critical sequence based on the simulation:")[-1].split("\n\n\n")[0] if bottleneck else ""
    return cycles, rthroughput, critical


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--mcpu", default=None, help="llvm-mca's CPU model (default: the CPU Numba compiles for)")
    ap.add_argument("--min-ratio", type=float, default=1.4)
    ap.add_argument("--batch", type=int, default=8, help="sequences of the batched decode step (1: none)")
    ap.add_argument("--show", type=int, default=3, help="critical sequences printed, worst ratio first")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["NUMBA_CACHE_DIR"] = cache  # before numba loads: compiled here, so inspectable
        from edgellm.quant.simd import cpu_name
        cpu = args.mcpu or cpu_name()
        asm = kernel_asm(args.model, args.batch)
    rows = []
    for name, text in sorted(asm.items()):
        for label, body in innermost_loops(text):
            cycles, rt, _ = mca(body, cpu)
            rows.append((cycles / rt if rt else 0.0, name, label, len(body), cycles, rt, body))
    rows.sort(key=lambda r: -r[0])
    print(f"llvm-mca ({MCA}, -mcpu={cpu}): {len(rows)} innermost vector loops in {len(asm)} kernels\n")
    print("| kernel | loop | instructions | cycles / iteration | throughput bound | ratio |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for ratio, name, label, n, cycles, rt, _ in rows:
        if ratio >= args.min_ratio:
            print(f"| {name} | {label} | {n} | {cycles:.1f} | {rt:.1f} | {ratio:.2f} |")
    for ratio, name, label, _, _, _, body in rows[:args.show]:
        print(f"\n{name} {label} (ratio {ratio:.2f}): critical sequence\n{mca(body, cpu, bottleneck=True)[2]}")


if __name__ == "__main__":
    main()

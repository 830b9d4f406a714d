"""Cycles per block of the decode dot loops on AArch64 cores, without the hardware: edgellm's loops as Numba compiles
them for each CPU, and llama.cpp's NEON loops (ggml-cpu/arch/arm/quants.c) as clang compiles them, both through
llvm-mca's model of the CPU. Prints three markdown tables (docs/arm.md keeps the last ones): the decode dots against
llama.cpp's, Q4_0's eight-row decode kernel against llama.cpp's gemv over its repacked rows (ggml-cpu/arch/arm/
repack.cpp), and the prompt tiles (eight tokens x one row) against edgellm's own one-row dot.

    sudo python tools/arm_cost.py [--cpus neoverse-n1,neoverse-n2,apple-m1,cortex-a76] [--llama-src DIR]

The newest llvm-mca-N and clang-N installed are used (Debian: apt install llvm-19 clang-19, and
libc6-dev-arm64-cross libstdc++-12-dev-arm64-cross for llama.cpp's headers): LLVM 19 models the
Neoverse N1 (the Cortex-A76's core: Raspberry Pi 5, RK3588), N2 (Cortex-A710 class, i8mm) and V1; LLVM 14 costed every
Arm-designed core, the A76 included, with the Cortex-A57's model. Apple's cores use the Cyclone model in both.

Runs the dump step (`arm_cost.py dump OUT`) inside ../shared/tools/arm64-chroot.sh's root (Numba compiles AArch64
code only on AArch64; under QEMU that takes a minute or two per CPU), then llvm-mca and clang on this host.

What a figure means: llvm-mca's steady-state cycles per iteration of the innermost loop that holds the dot
instructions, divided by the (row, block) pairs one iteration covers, counted from the sdot instructions in it
(block of 32: two sdot per row and block; super-block of 256: sixteen; a tile's pairs are token-row-block
triples). Loads are assumed to hit L1; a figure ranks instruction sequences, it does not predict tokens per second
(decode is bound by memory bandwidth on most boards).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
LLAMA_SRC = Path("/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp")
ROOT = Path(os.environ.get("ARM64_ROOT", "/opt/arm64"))
CHROOT_TOOL = next((p for p in (HERE.parent / "shared/tools/arm64-chroot.sh",
                                 Path("/work/shared/tools/arm64-chroot.sh")) if p.exists()), None)

# (format, edgellm kernel, rows per call, elements per block, llama.cpp function)
KERNELS = [
    ("Q4_0", "vec_dot_q4_0_q8_0", 1, 32, "ggml_vec_dot_q4_0_q8_0"),
    ("Q4_1", "vec_dot_q4_1_q8_0", 1, 32, "ggml_vec_dot_q4_1_q8_1"),
    ("Q5_0", "vec_dot_q5_0_q8_0", 1, 32, "ggml_vec_dot_q5_0_q8_0"),
    ("Q8_0", "vec_dot_q8_0_q8_0", 1, 32, "ggml_vec_dot_q8_0_q8_0"),
    ("Q4_K", "vec_dot_q4_k_q8_k", 1, 256, "ggml_vec_dot_q4_K_q8_K"),
    ("Q6_K", "vec_dot_q6_k_q8_k", 1, 256, "ggml_vec_dot_q6_K_q8_K"),
    ("Q4_0", "vec_dot2_q4_0_q8_0", 2, 32, None),
    ("Q4_1", "vec_dot2_q4_1_q8_0", 2, 32, None),
    ("Q5_0", "vec_dot2_q5_0_q8_0", 2, 32, None),
    ("Q8_0", "vec_dot2_q8_0_q8_0", 2, 32, None),
]
# Q4_0 decode: edgellm's eight-row kernel (quant/q4_0_rows8.py, rows in the file's layout) against llama.cpp's gemv
# over rows it repacked at load (ggml-cpu/arch/arm/repack.cpp): four rows interleaved by 4 bytes on a dotprod core,
# by 8 on an i8mm one (the kernels its CPU_REPACK buffer picks there).
ROWS8 = "rows8_dot_q4_0"
LLAMA_GEMV = {"i8mm": "ggml_gemv_q4_0_4x8_q8_0", "dotprod": "ggml_gemv_q4_0_4x4_q8_0"}
FEATURES = "features"  # the dump's record of the paths edgellm chose for the CPU (quant/simd/host.py's tables)
# (format, edgellm prompt tile, the one-row dot it is compared with): eight tokens against one row per call
TILES = [
    ("Q4_0", "tile8_q4_0", "vec_dot_q4_0_q8_0"),
    ("Q4_1", "tile8_q4_1", "vec_dot_q4_1_q8_0"),
    ("Q5_0", "tile8_q5_0", "vec_dot_q5_0_q8_0"),
    ("Q8_0", "tile8_q8_0", "vec_dot_q8_0_q8_0"),
]


# --- inside the AArch64 root: compile each kernel and write its assembly -------------------------------------------


def dump(out: Path):
    import numpy as np
    from edgellm.quant import matmul_block32, matmul_kquant, simd
    out.mkdir(parents=True, exist_ok=True)
    nb = 8
    w = np.zeros(nb * 256 * 2, np.uint8)
    xq = np.zeros(nb * 256, np.int8)
    xd = np.zeros(nb * 8, np.float32)
    bsums = np.zeros(nb * 16, np.int32)
    calls = {
        "vec_dot_q4_0_q8_0": (w, 0, nb, xq, 0, xd, 0),
        "vec_dot_q4_1_q8_0": (w, 0, nb, xq, 0, xd, xd, 0),
        "vec_dot_q5_0_q8_0": (w, 0, nb, xq, 0, xd, 0),
        "vec_dot_q8_0_q8_0": (w, 0, nb, xq, 0, xd, 0),
        "vec_dot_q4_k_q8_k": (w, 0, 2, xq, 0, xd, bsums),
        "vec_dot_q6_k_q8_k": (w, 0, 2, xq, 0, xd, bsums),
        "vec_dot2_q4_0_q8_0": (w, 0, 18 * nb, nb, xq, 0, xd, 0),
        "vec_dot2_q4_1_q8_0": (w, 0, 20 * nb, nb, xq, 0, xd, 0),
        "vec_dot2_q5_0_q8_0": (w, 0, 22 * nb, nb, xq, 0, xd, 0, np.zeros(8 * nb, np.int32), 0),
        "vec_dot2_q8_0_q8_0": (w, 0, 34 * nb, nb, xq, 0, xd, 0),
    }
    xp, xt = np.zeros(2 * 8 * 32 * nb, np.int8), np.zeros(4 * 8 * nb, np.float32)  # eight tokens' tile layout
    for _, tile, _ in TILES:
        # the last argument: the lane sums' buffer, or for Q4_1 (mins, no lane sums) the offset of the token sums
        calls[tile] = (w, 0, nb, xp, 0, xt, 0, 8 * nb if tile == "tile8_q4_1" else xp)
    print(f"dotprod {simd.HAS_DOTPROD} i8mm {simd.HAS_I8MM}")
    for name, args in calls.items():
        fn = getattr(matmul_kquant, name, None) or getattr(matmul_block32, name)
        fn(*args)
        (out / f"{name}.s").write_text(fn.inspect_asm(fn.signatures[0]))
    rows8 = _rows8_wrapper()
    rows8(w, 18 * nb, nb, xq, xd, np.zeros(8, np.float32))
    (out / f"{ROWS8}.s").write_text(rows8.inspect_asm(rows8.signatures[0]))
    # written last: the host side takes a dump with this file as complete
    (out / FEATURES).write_text(" ".join(f for f, has in (("dotprod", simd.HAS_DOTPROD), ("i8mm", simd.HAS_I8MM))
                                         if has))


def _rows8_wrapper():
    """rows8_dot (eight Q4_0 rows x one token, what decode runs for Q4_0) returns a vector, which Python cannot take:
    called from a function that stores it."""
    from numba import njit
    from edgellm.quant import q4_0_rows8, simd

    @njit
    def rows8_dot_q4_0(w, row_bytes, nb, xq, xd, res):
        simd.store_f32x8(res, 0, q4_0_rows8.rows8_dot(w, 0, row_bytes, nb, xq, 0, xd, 0))
    return rows8_dot_q4_0


# --- on the host: loops, llvm-mca, clang -------------------------------------------------------------------------

_LABEL = re.compile(r"^(\.?L[\w$.]+|[\w$.]+):")
_BRANCH = re.compile(r"^\s*(b(?:\.\w+)?|cbn?z|tbn?z)\s+(?:[^,]+,\s*)*(\.?L[\w$.]+)\s*$")


def function_body(asm: str, symbol_part: str) -> list[str]:
    """The lines of the first function whose label contains symbol_part (Numba mangles its names)."""
    lines = asm.splitlines()
    start = next(i for i, l in enumerate(lines) if _LABEL.match(l) and symbol_part in l.split(":")[0]
                 and not l.startswith(".L"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip().startswith(".size")), len(lines))
    return lines[start:end]


def loops(body: list[str]):
    """(label line, back-branch line) of every backward branch."""
    labels = {}
    for i, l in enumerate(body):
        m = _LABEL.match(l)
        if m:
            labels[m.group(1)] = i
        b = _BRANCH.match(l)
        if b and b.group(2) in labels:
            yield labels[b.group(2)], i


def instructions(lines):
    out = []
    for l in lines:
        s = l.split("//")[0].split(";")[0].strip()
        if not s or s.endswith(":") or s.startswith("."):
            continue
        out.append(s)
    return out


def hot_loop(body):
    """The innermost loop with the most sdot instructions: (instructions, sdot count)."""
    best = None
    for a, b in loops(body):
        ins = instructions(body[a:b + 1])
        n = sum(1 for i in ins if i.startswith(("sdot", "udot")))
        nested = any(a < c < b for c, d in loops(body) if (c, d) != (a, b) and d < b)
        if n and not nested and (best is None or n > best[1]):
            best = (ins, n)
    return best


def newest(tool: str) -> str:
    """The highest-versioned tool-N on PATH (Debian installs llvm-mca-19, clang-19 ...), else the plain name."""
    found = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        for p in Path(d).glob(f"{tool}-[0-9]*") if Path(d).is_dir() else ():
            if p.name[len(tool) + 1:].isdigit():
                found.append((int(p.name[len(tool) + 1:]), p.name))
    return max(found)[1] if found else tool


MCA, CLANG = newest("llvm-mca"), newest("clang")


MCA_ITERATIONS = 200


def mca_report(ins: list[str], cpu: str, *options: str) -> tuple[str, float]:
    """llvm-mca's report on these instructions as a loop body for CPU cpu (options: e.g. a -mtriple), and its
    cycles per iteration."""
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write("\n".join(ins) + "\n")
    done = subprocess.run([MCA, f"-mcpu={cpu}", f"-iterations={MCA_ITERATIONS}", *options, f.name],
                          capture_output=True, text=True)
    os.unlink(f.name)
    if done.returncode:
        raise RuntimeError(done.stderr[-1500:])
    total = int(re.search(r"Total Cycles:\s+(\d+)", done.stdout).group(1))
    return done.stdout, total / MCA_ITERATIONS


def mca_cycles(ins: list[str], cpu: str) -> float:
    return mca_report(ins, cpu, "-mtriple=aarch64-linux-gnu")[1]


def per_block(asm_body, cpu, block):
    loop = hot_loop(asm_body)
    if loop is None:
        return None
    ins, n_dot = loop
    pairs = n_dot * 16 / block  # (row, block) pairs per iteration: 16 bytes per sdot
    return mca_cycles(ins, cpu) / pairs, len(ins), pairs


def llama_asm(cpu: str, src: Path, work: Path, source: str = "quants.c") -> str:
    """llama.cpp's ggml-cpu/arch/arm/<source> compiled for cpu (repack.cpp is C++: Debian's
    libstdc++-12-dev-arm64-cross gives its headers)."""
    out = work / f"llama_{Path(source).stem}_{cpu}_{CLANG}_neon.s"
    if not out.exists():
        ggml = src / "ggml"
        cxx = source.endswith(".cpp")
        compiler = CLANG.replace("clang", "clang++") if cxx else CLANG
        cxx_headers = []
        if cxx:
            found = sorted(Path("/usr/aarch64-linux-gnu/include/c++").glob("*"))
            if found:
                cxx_headers = ["-isystem", str(found[-1]), "-isystem", str(found[-1] / "aarch64-linux-gnu")]
        # NEON only: on an SVE core (Neoverse N2, V1) quants.c takes its SVE loops, which this counting does not
        # follow (vector-length-agnostic loops, 16-bit sdot)
        cmd = [compiler, "--target=aarch64-linux-gnu", "-O3", f"-mcpu={cpu}+nosve", "-S", "-o", str(out),
               *cxx_headers, "-isystem", "/usr/aarch64-linux-gnu/include", "-DNDEBUG",
               f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", f"-I{ggml / 'src/ggml-cpu'}",
               str(ggml / "src/ggml-cpu/arch/arm" / source)]
        subprocess.run(cmd, check=True)
    return out.read_text()


def rows8_costs(cpu: str, inside: Path, src: Path, work: Path):
    """(edgellm's eight-row Q4_0 decode loop, llama.cpp's repacked gemv, its name): cycles per row-block each. The
    rows8 loop's sdot count includes the two that sum the token's block for the nibbles' offset, so its rows are
    counted, not derived from its sdots; the gemv's are four rows of one block per iteration."""
    loop = hot_loop(function_body((inside / f"{ROWS8}.s").read_text(), ROWS8))
    ours = mca_cycles(loop[0], cpu) / 8 if loop else None
    name = LLAMA_GEMV["i8mm" if "i8mm" in (inside / FEATURES).read_text().split() else "dotprod"]
    try:
        theirs = per_block(function_body(llama_asm(cpu, src, work, "repack.cpp"), name), cpu, 32)
    except (subprocess.CalledProcessError, FileNotFoundError, StopIteration) as e:
        print(f"llama.cpp's repack.cpp did not give {name} for {cpu}: {e}", file=sys.stderr)
        theirs = None
    return ours, theirs[0] if theirs else None, name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="table")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--cpus", default="neoverse-n1,neoverse-n2,apple-m1,cortex-a76")
    ap.add_argument("--llama-src", default=str(LLAMA_SRC))
    ap.add_argument("--work", default="/tmp/arm_cost")
    args = ap.parse_args()
    if args.mode == "dump":
        dump(Path(args.out))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows, tiles, decode_q4_0 = [], [], []
    for cpu in args.cpus.split(","):
        inside = f"/tmp/arm_cost_{cpu}"
        env = dict(os.environ, QEMU_CPU="max", NUMBA_CPU_NAME=cpu)
        if not (ROOT / inside.lstrip("/") / FEATURES).exists():  # (remove the dump after a kernel change)
            subprocess.run([str(CHROOT_TOOL), "run",
                            f"NUMBA_CACHE_DIR=$(mktemp -d) python tools/arm_cost.py dump {inside}"],
                           check=True, env=env, cwd=HERE)
        try:
            lasm = llama_asm(cpu, Path(args.llama_src), work)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            print(f"llama.cpp's quants.c did not compile for {cpu}: {e}", file=sys.stderr)
            lasm = None
        for fmt, kernel, rows_per_call, block, llama_fn in KERNELS:
            ours = per_block(function_body((ROOT / inside.lstrip("/") / f"{kernel}.s").read_text(), kernel), cpu,
                             block)
            theirs = per_block(function_body(lasm, llama_fn), cpu, block) if lasm and llama_fn else None
            rows.append((fmt, kernel, cpu, ours, theirs))
        for fmt, tile, row_dot in TILES:
            costs = [per_block(function_body((ROOT / inside.lstrip("/") / f"{k}.s").read_text(), k), cpu, 32)
                     for k in (tile, row_dot)]
            tiles.append((fmt, tile, cpu, *costs))
        decode_q4_0.append((cpu, *rows8_costs(cpu, ROOT / inside.lstrip("/"), Path(args.llama_src), work)))
    print(f"{MCA}, llama.cpp through {CLANG}\n")
    print("| format | edgellm loop | CPU model | edgellm cycles / row-block | llama.cpp cycles / row-block | ratio |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for fmt, kernel, cpu, ours, theirs in rows:
        o = f"{ours[0]:.2f}" if ours else "n/a"
        t = f"{theirs[0]:.2f}" if theirs else "-"
        r = f"{ours[0] / theirs[0]:.2f}" if ours and theirs else "-"
        print(f"| {fmt} | {kernel} | {cpu} | {o} | {t} | {r} |")
    print("\n| Q4_0 decode | CPU model | edgellm rows8_dot cycles / row-block | llama.cpp repacked gemv | its cycles / "
          "row-block | ratio |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for cpu, ours, theirs, name in decode_q4_0:
        o = f"{ours:.2f}" if ours else "n/a"
        t = f"{theirs:.2f}" if theirs else "-"
        r = f"{ours / theirs:.2f}" if ours and theirs else "-"
        print(f"| Q4_0 | {cpu} | {o} | {name} | {t} | {r} |")
    print("\n| format | edgellm tile | CPU model | tile cycles / token-row-block | one-row dot cycles / row-block "
          "| speed-up |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for fmt, tile, cpu, ours, dot in tiles:
        if ours and dot:
            print(f"| {fmt} | {tile} | {cpu} | {ours[0]:.2f} | {dot[0]:.2f} | {dot[0] / ours[0]:.2f}x |")


if __name__ == "__main__":
    main()

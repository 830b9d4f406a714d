"""Record llama.cpp's logits on the tiny models of tests/helpers_tiny_llama_cpp.py as compact fixtures.

Two steps, the first with edgellm's environment (it writes the files with gguf-py), the second with the python that
has llama-cpp-python:

    python tools/record_tiny_llama_cpp.py write /tmp/tiny_models
    /path/to/llama-venv/bin/python tools/record_tiny_llama_cpp.py record /tmp/tiny_models \\
        tests/fixtures/llama_cpp_tiny.json

For each case: the prompt evaluated as one batch with every row's logits (teacher-forced), then the last
DECODE_TOKENS fed one at a time after the prompt alone (the decode path). Stored per row: the first 16 hex digits of
the sha256 of its float32 logits, its log-sum-exp and its top 8 (id, logit); and the sha256 of the file it ran on,
so a test that writes a different file fails on that rather than on the logits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TOP_K = 8


def _row(logits) -> dict:
    row = np.ascontiguousarray(logits, dtype=np.float32)
    top = np.argsort(-row, kind="stable")[:TOP_K]
    m = float(row.max())
    lse = m + float(np.log(np.exp(row.astype(np.float64) - m).sum()))
    return {"sha": hashlib.sha256(row.tobytes()).hexdigest()[:16], "lse": lse,
            "top": [[int(i), float(row[i])] for i in top]}


def write(out_dir: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers_tiny_llama_cpp import CASES, DECODE_TOKENS, file_sha256, prompt, run_settings, write_case
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = {}
    for name, spec in CASES.items():
        path = write_case(out_dir / f"{name}.gguf", name)
        n_ctx, n_prompt = run_settings(name)
        plan[name] = {"file": path.name, "sha256_16": file_sha256(path), "tokens": prompt(spec, n_prompt),
                      "n_ctx": n_ctx, "prompt_tokens": n_prompt, "decode_tokens": DECODE_TOKENS}
    (out_dir / "plan.json").write_text(json.dumps(plan))
    print(f"wrote {len(plan)} models and plan.json to {out_dir}")


def record(model_dir: Path, out: Path) -> None:
    import llama_cpp
    plan = json.loads((model_dir / "plan.json").read_text())
    fixtures = {}
    for name, case in plan.items():
        tokens, n_prompt = case["tokens"], case["prompt_tokens"]
        llm = llama_cpp.Llama(model_path=str(model_dir / case["file"]), n_ctx=case["n_ctx"], n_batch=512,
                              n_ubatch=512, n_threads=2, logits_all=True, verbose=False)
        llm.eval(tokens)
        teacher = [_row(llm.scores[i]) for i in range(len(tokens))]
        llm.reset()
        llm.eval(tokens[:n_prompt])
        decode = [_row(llm.scores[n_prompt - 1])]
        for t in tokens[n_prompt:-1]:
            llm.eval([t])
            decode.append(_row(llm.scores[llm.n_tokens - 1]))
        fixtures[name] = {**case, "teacher_forced": teacher, "decode": decode}
        del llm
    out.write_text(json.dumps({"source": f"llama-cpp-python {llama_cpp.__version__}", "cases": fixtures},
                              separators=(",", ":")) + "\n")
    print(f"wrote {out}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir", type=Path)
    r = sub.add_parser("record")
    r.add_argument("dir", type=Path)
    r.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.step == "write":
        write(args.dir)
    else:
        record(args.dir, args.out)


if __name__ == "__main__":
    main()

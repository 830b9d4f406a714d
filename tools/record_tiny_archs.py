"""Record llama.cpp's logits on the tiny GGUF file of each architecture as compact fixtures for
tests/test_tiny_archs_llama_cpp.py. Run with edgellm's python (it writes the files with gguf-py); llama.cpp runs
in a subprocess under the python that has llama-cpp-python:

    python tools/record_tiny_archs.py --llama-python /work/llama-venv/bin/python [--only gemma2,olmo2]

Each file is rebuilt from its seed (tests/helpers_tiny_archs.py) with SmolLM2's tokenizer from the catalog, and
tests/fixtures/tiny_arch_<name>.npz gets: the file's sha256, the 40 prompt ids and the prompt length (30) of
the decode path, a sha256 of each full float32 logit row (teacher-forced: all 40 ids as one batch; decode: the
first 30 as one batch, its last row, then each later id alone), and per row the top 8 ids and logits and the
log-sum-exp of the row, from which the test measures top-1 agreement and log-prob differences.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import helpers_tiny_archs as tiny  # noqa: E402

PROMPT_LEN = 30
TOP_K = 8


def row_hashes(rows) -> np.ndarray:
    return np.stack([np.frombuffer(hashlib.sha256(np.ascontiguousarray(r, np.float32).tobytes()).digest(), np.uint8)
                     for r in rows])


def summary(rows) -> dict:
    """Hashes, top 8 (ids and logits) and log-sum-exp of each row."""
    rows = np.asarray(rows, np.float32)
    top = np.argsort(-rows, axis=1, kind="stable")[:, :TOP_K].astype(np.int32)
    r64 = rows.astype(np.float64)
    peak = r64.max(axis=1, keepdims=True)
    lse = (peak[:, 0] + np.log(np.exp(r64 - peak).sum(axis=1)))
    return {"sha256": row_hashes(rows), "top_ids": top, "top_logits": np.take_along_axis(rows, top, 1),
            "lse": lse}


def record(name, llama_python, tokenizer_gguf, workdir):
    spec = tiny.TINY_ARCHS[name]
    path = os.path.join(workdir, f"{name}.gguf")
    sha = tiny.write_tiny_arch(path, spec, tokenizer_gguf)
    ids = tiny.prompt_tokens(spec)
    out = os.path.join(workdir, f"{name}.logits.npz")
    subprocess.run([llama_python, os.path.join(ROOT, "tools", "llama_cpp_tiny_logits.py"), path,
                    ",".join(map(str, ids)), str(PROMPT_LEN), out], check=True)
    got = np.load(out)
    fixture = {"gguf_sha256": np.asarray(sha), "tokens": ids, "prompt_len": np.int32(PROMPT_LEN),
               "settings": np.asarray(json.dumps({"llama_cpp_python": str(got["version"]), "n_ctx": 128,
                                                  "n_batch": 64, "threads": 2, "kv": "f16", "flash_attn": False}))}
    for kind in ("forced", "decode"):
        fixture.update({f"{kind}_{k}": v for k, v in summary(got[kind]).items()})
    dest = os.path.join(ROOT, "tests", "fixtures", f"tiny_arch_{name}.npz")
    np.savez_compressed(dest, **fixture)
    print(f"{name}: {os.path.getsize(path)} bytes, sha256 {sha}; {len(got['forced'])} forced + "
          f"{len(got['decode'])} decode rows -> {dest} ({os.path.getsize(dest)} bytes)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    from edgellm.store import catalog
    tokenizer_gguf = catalog.pull("smollm2-135m", quiet=True)
    names = args.only.split(",") if args.only else list(tiny.TINY_ARCHS)
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            record(name, args.llama_python, tokenizer_gguf, workdir)


if __name__ == "__main__":
    main()

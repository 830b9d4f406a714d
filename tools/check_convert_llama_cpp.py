"""Does llama.cpp load what `edgellm convert` writes for each architecture, and agree with edgellm on it?
Run with edgellm's python; llama.cpp runs in a subprocess under the python that has llama-cpp-python:

    python tools/check_convert_llama_cpp.py --llama-python /work/llama-venv/bin/python [--arch gemma2,olmo2]

For each architecture: tests/test_convert.py's tiny Hugging Face checkpoint is converted to F32, both runtimes
evaluate the same ids teacher-forced, and the largest logit difference and the top-1 agreement are printed.
(llama.cpp's own convert_hf_to_gguf.py needs torch and transformers, absent here, so its output is not compared.)
"""
import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--arch", default="gemma2,granite,smollm3,olmo2,qwen3moe,mixtral")
    args = ap.parse_args()
    import edgellm
    from edgellm.prep.convert import convert_checkpoint
    from test_convert import SEQ, make_checkpoint
    for arch in args.arch.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = Path(tmp) / "hf"
            hf_dir.mkdir()
            make_checkpoint(hf_dir, arch)
            out = Path(tmp) / f"{arch}.gguf"
            convert_checkpoint(hf_dir, out, "F32", progress=False)
            ids = list(SEQ)
            logits = Path(tmp) / "llama.npz"
            run = subprocess.run([args.llama_python, str(ROOT / "tools" / "llama_cpp_tiny_logits.py"), str(out),
                                  ",".join(map(str, ids)), str(len(ids) - 1), str(logits)],
                                 capture_output=True, text=True)
            if run.returncode:
                print(f"{arch}: llama.cpp failed to run the converted file: {run.stderr.strip()[-300:]}")
                continue
            theirs = np.load(logits)["forced"]
            ours = edgellm.load(str(out), n_ctx=128, n_threads=2).logits(ids)  # llama_cpp_tiny_logits.py's context
            top1 = float(np.mean(theirs.argmax(1) == ours.argmax(1)))
            print(f"{arch}: llama.cpp loads it; {len(ids)} rows, max |logit diff| "
                  f"{np.abs(theirs - ours).max():.3g}, top-1 agreement {top1:.3f}, "
                  f"rows bit-identical {sum(a.tobytes() == b.tobytes() for a, b in zip(ours, theirs))}")


if __name__ == "__main__":
    main()

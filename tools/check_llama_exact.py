"""Run the whole recorded prompt set through edgellm and count the rows that are llama.cpp's bits.

tests/test_exact_llama_cpp.py checks a fixed subset of the prompts in CI (the whole set takes too long on two
cores) and uses this module's comparison; this tool runs every prompt of every recorded model and reports, per
model and thread count, how many teacher-forced and decode-path rows and how many prompts are exact, and the
first differing row of each prompt that is not:

    python tools/check_llama_exact.py                      # both models, 2 threads
    python tools/check_llama_exact.py gemma-3-270m --threads 1,2 --prompts 93,94

(The same full check as a test: EDGELLM_EXACT_FULL=1 python -m pytest -q tests/test_exact_llama_cpp.py.)
"""
import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
MODEL_FILES = {"smollm2-135m": "SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m": "gemma-3-270m-q4_k_m"}


def fixture_path(name):
    return FIXTURES / f"exact_{MODEL_FILES[name]}.npz"


class Recording:
    """One model's recorded llama.cpp rows (tools/record_llama_exact.py), addressed by prompt index."""

    def __init__(self, path):
        with np.load(path) as data:
            self.data = {k: data[k] for k in data.files}
        d = self.data
        self.settings = json.loads(str(d["settings"]))
        self.perplexity = json.loads(str(d["perplexity"]))
        self.prompt_ids = [int(p) for p in d["prompt_id"]]
        self.seq_offsets = d["seq_offsets"]
        n_decode = np.diff(self.seq_offsets) - d["prompt_len"]  # one row per generated token
        self.decode_offsets = np.concatenate([[0], np.cumsum(n_decode)])
        if self.decode_offsets[-1] != len(d["decode_sha256"]) or self.seq_offsets[-1] != len(d["forced_sha256"]):
            raise ValueError(f"{path}: row counts do not match the sequences")

    def __len__(self):
        return len(self.prompt_ids)

    def ppl_rows(self, text):
        """{chunk: [sha256 of each row of its logits]} for the perplexity chunks of `text` recorded row by row."""
        rows = self.data.get("ppl_row_sha256")
        spans = self.perplexity.get(text, {}).get("row_chunks", {})
        return {int(c): [bytes(h) for h in rows[a:b]] for c, (a, b) in spans.items()}

    def sequence(self, i):
        """(tokens of prompt and continuation, prompt length) of the i-th recorded prompt."""
        a, b = self.seq_offsets[i], self.seq_offsets[i + 1]
        return self.data["seq_tokens"][a:b], int(self.data["prompt_len"][i])

    def forced(self, i):
        return [bytes(h) for h in self.data["forced_sha256"][self.seq_offsets[i]:self.seq_offsets[i + 1]]]

    def decode(self, i):
        return [bytes(h) for h in self.data["decode_sha256"][self.decode_offsets[i]:self.decode_offsets[i + 1]]]


def row_hashes(rows):
    return [hashlib.sha256(np.ascontiguousarray(r, dtype=np.float32).tobytes()).digest() for r in rows]


def forced_hashes(model, seq, n_batch):
    """Every teacher-forced row: the whole sequence evaluated in n_batch-token pieces, as llama.cpp's eval."""
    model.reset()
    got = []
    for start in range(0, len(seq), n_batch):
        got += row_hashes(model.forward(seq[start:start + n_batch], all_logits=True))
    return got


def decode_hashes(model, seq, n_prompt):
    """The decode path: the prompt's last row from one evaluation, then each continuation token alone."""
    model.reset()
    got = row_hashes(model.forward(seq[:n_prompt]))
    for token in seq[n_prompt:-1]:
        got += row_hashes(model.forward(np.array([token], np.int32)))
    return got


def differing(got, want):
    return [pos for pos, (a, b) in enumerate(zip(got, want)) if a != b] + list(range(len(got), len(want)))


def check_prompt(model, rec, i):
    """(teacher-forced positions that differ, decode rows that differ) for the i-th recorded prompt."""
    seq, n_prompt = rec.sequence(i)
    bad_forced = differing(forced_hashes(model, seq, rec.settings["n_batch"]), rec.forced(i))
    bad_decode = differing(decode_hashes(model, seq, n_prompt), rec.decode(i))
    return bad_forced, bad_decode


def build(path, rec, n_threads):
    import edgellm.engine.gguf
    from edgellm.engine.models import build_model
    f = edgellm.engine.gguf.open(path)
    return f, build_model(f, n_ctx=rec.settings["n_ctx"], n_threads=n_threads, n_batch=rec.settings["n_batch"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=list(MODEL_FILES))
    ap.add_argument("--threads", default="2", help="comma-separated thread counts")
    ap.add_argument("--prompts", default="", help="comma-separated prompt ids (default: all recorded)")
    ap.add_argument("--fixture", default="", help="a recording to check instead of tests/fixtures' (one model)")
    ap.add_argument("--progress", action="store_true", help="a line per prompt as it is checked")
    args = ap.parse_args()
    from edgellm.store import catalog
    only = {int(p) for p in args.prompts.split(",") if p}
    if args.fixture and len(args.models) != 1:
        ap.error("--fixture names one model's recording: give that model")
    for name in args.models:
        rec = Recording(Path(args.fixture) if args.fixture else fixture_path(name))
        path = catalog.pull(name, quiet=True)
        for n_threads in [int(t) for t in args.threads.split(",")]:
            f, model = build(path, rec, n_threads)
            t0 = time.time()
            n_forced = n_decode = bad_forced_rows = bad_decode_rows = n_prompts = bad_prompts = 0
            for i, pid in enumerate(rec.prompt_ids):
                if only and pid not in only:
                    continue
                seq, n_prompt = rec.sequence(i)
                bad_forced, bad_decode = check_prompt(model, rec, i)
                n_prompts += 1
                n_forced += len(seq)
                n_decode += len(seq) - n_prompt
                bad_forced_rows += len(bad_forced)
                bad_decode_rows += len(bad_decode)
                if args.progress:
                    print(f"{name} t{n_threads} prompt {pid}: {len(seq)} rows, {len(bad_forced)} teacher-forced "
                          f"and {len(bad_decode)} decode rows differ ({time.time() - t0:.0f} s)", flush=True)
                if bad_forced or bad_decode:
                    bad_prompts += 1
                    print(f"{name} t{n_threads} prompt {pid} ({n_prompt} + {len(seq) - n_prompt} tokens): "
                          f"{len(bad_forced)} teacher-forced rows differ (first at position "
                          f"{bad_forced[0] if bad_forced else '-'}), {len(bad_decode)} decode rows (first "
                          f"{bad_decode[0] if bad_decode else '-'})", flush=True)
            f.close()
            print(f"{name} at {n_threads} threads: {n_prompts - bad_prompts}/{n_prompts} prompts exact, "
                  f"{n_forced - bad_forced_rows}/{n_forced} teacher-forced rows, "
                  f"{n_decode - bad_decode_rows}/{n_decode} decode rows ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

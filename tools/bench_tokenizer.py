"""Tokenizer timings on the real models: build time from metadata, encode/decode of a ~2,000-word text.

    EDGELLM_MODELS=/work/mc python tools/bench_tokenizer.py [--repeat 5]
"""
import argparse
import random
import statistics
import time

from edgellm.store import catalog
from edgellm.engine import gguf
from edgellm.tokenizer import Tokenizer

MODELS = ["smollm2-135m", "gemma-3-270m"]
WORDS = ("the quick brown fox jumps over lazy dog model token inference runtime quantized matrix vector "
         "naïve café résumé 多线程 推理 加速 🙂 don't it's we're 3.14159 2024 <b> </b> x+y=z (a, b) [c] {d}").split()


def sample_text(n_words, seed=0):
    rng = random.Random(seed)
    words = []
    for _ in range(n_words):
        words.append(rng.choice(WORDS))
        if rng.random() < 0.08:
            words.append(rng.choice([".", ",", "!", "?", "\n", "\n\n", "  "]))
    return " ".join(words)


def timed(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--words", type=int, default=2000)
    args = ap.parse_args()
    text = sample_text(args.words)
    for name in MODELS:
        with gguf.open(catalog.pull(name, quiet=True)) as f:
            md = f.metadata
            for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
                md.get(key)      # decode the string arrays first: that is the GGUF reader's cost, not ours
            build, tok = timed(lambda: Tokenizer.from_metadata(md), args.repeat)
        cold, ids = timed(lambda: Tokenizer.encode(tok, text), 1)     # empty word cache
        warm, _ = timed(lambda: tok.encode(text), args.repeat)
        special, _ = timed(lambda: tok.encode(text, parse_special=True), args.repeat)
        dec, out = timed(lambda: tok.decode(ids), args.repeat)
        assert out == text, "round trip failed"
        print(f"{name:14s} n_vocab={tok.n_vocab:6d}  build {build * 1e3:6.1f} ms  "
              f"encode {args.words} words ({len(ids)} tokens): cold {cold * 1e3:6.1f} ms, warm {warm * 1e3:5.1f} ms, "
              f"parse_special {special * 1e3:5.1f} ms  decode {dec * 1e3:5.1f} ms")


if __name__ == "__main__":
    main()

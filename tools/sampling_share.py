"""Share of generation time spent sampling (Timings.sample_s / generate_s) on real models, for a few sampler setups.

    python tools/sampling_share.py [MODEL ...] [--tokens 32]

Each setup generates --tokens tokens (ignore_eos, so every run has the same length) after one warm-up run.
"""
import argparse

import edgellm

SETUPS = {
    "greedy": dict(temperature=0.0),
    "llama-cpp-python defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "full vocabulary (top_k=0, top_p=0.95, penalties)": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0,
                                                             repeat_penalty=1.1, presence_penalty=0.1),
    "typical_p=0.9 over the full vocabulary": dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.9),
}
PROMPT = "Once upon a time, in a small village,"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["smollm2-135m", "gemma-3-270m"])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    for name in args.models:
        m = edgellm.load(name, n_ctx=512)
        m.generate(PROMPT, max_tokens=4)  # warm-up: JIT caches, page-in
        print(f"{m.name} (vocabulary {m.n_vocab}):")
        for label, kw in SETUPS.items():
            m.generate(PROMPT, max_tokens=args.tokens, ignore_eos=True, seed=1, **kw)
            t = m.timings
            per_token_ms = 1e3 * t.sample_s / max(t.generated_tokens, 1)
            print(f"  {label:<50} sampling {per_token_ms:6.2f} ms/token = {t.sample_share:6.2%} of generation "
                  f"({t.generate_tps:.1f} t/s)")


if __name__ == "__main__":
    main()

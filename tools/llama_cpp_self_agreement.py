"""How far llama.cpp moves from its own reference logits when only its rounding changes.

Runs llama-cpp-python (must be importable by this interpreter: run it with the python that has it) on every
reference sequence of tests/fixtures/<model>.npz, teacher-forced, in several configurations (an f32 KV cache
instead of f16, flash attention, one thread, small batches), and prints top-1 agreement and |log-prob|
differences over the reference's top-40 tokens, the same figures tests/test_models_real.py computes for edgellm.

    /path/to/llama-venv/bin/python tools/llama_cpp_self_agreement.py MODEL.gguf tests/fixtures/MODEL.npz
"""
import argparse

import numpy as np

CONFIGS = {"default": {}, "kv_f32": {"type_k": 0, "type_v": 0}, "flash_attn": {"flash_attn": True},
           "threads1": {"n_threads": 1}, "batch8": {"n_batch": 8, "n_ubatch": 8}}


def log_softmax(x):
    top = x.max(axis=1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(axis=1, keepdims=True)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("reference_npz")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    import llama_cpp
    ref = np.load(args.reference_npz)
    n_prompts = len([k for k in ref.files if k.endswith("_ids") and not k.endswith("topk_ids")])
    for name in args.configs.split(","):
        llm = llama_cpp.Llama(model_path=args.model, n_ctx=1024, n_threads=2, logits_all=True, verbose=False,
                              **CONFIGS[name])
        agree = total = 0
        diffs = []
        for p in range(n_prompts):
            ids = ref[f"p{p}_ids"].tolist()
            llm.reset()
            llm.eval(ids)
            logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
            top_ids, top_logits = ref[f"p{p}_topk_ids"], ref[f"p{p}_topk_logits"]
            theirs = top_logits - ref[f"p{p}_logsumexp"][:, None]
            diffs.append(np.abs(np.take_along_axis(log_softmax(logits), top_ids, axis=1) - theirs))
            agree += int((logits.argmax(axis=1) == top_ids[:, 0]).sum())
            total += len(ids)
        d = np.concatenate(diffs)
        print(f"{name:<11} top-1 {agree}/{total} = {agree / total:.3f}   log-prob |diff| mean {d.mean():.4f} "
              f"max {d.max():.3f}", flush=True)
        del llm


if __name__ == "__main__":
    main()

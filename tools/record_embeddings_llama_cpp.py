"""Record llama.cpp's embeddings as a compact fixture for tests/test_embeddings.py.

Run with the python that has llama-cpp-python (tests never need it):

    /path/to/llama-venv/bin/python tools/record_embeddings_llama_cpp.py OUT.json MODEL.gguf [MODEL.gguf ...]

For each model and prompt: the tokens llama.cpp evaluated (its own tokenizer, BOS where the file asks), a sha256 of
each token's float32 embedding as llama.cpp returns it with pooling "none" (its result_norm: the output-normed
hidden state), and its mean-pooled vector (pooling "mean", not normalised) in full, for readable failures and a
tolerance check.
"""
import hashlib
import json
import os
import sys

import numpy as np

PROMPTS = ["The capital of France is",
           "Embeddings place texts that mean the same near each other, so a search can find a passage by its "
           "meaning rather than its words. " * 3]


def record(path: str) -> dict:
    import llama_cpp
    out = {"model": os.path.basename(path), "prompts": []}
    kw = dict(model_path=path, embedding=True, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2, verbose=False)
    per_token = llama_cpp.Llama(pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE, **kw)
    mean = llama_cpp.Llama(pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, **kw)
    for prompt in PROMPTS:
        ids = per_token.tokenize(prompt.encode("utf-8"))
        rows = np.asarray(per_token.embed(prompt, normalize=False), dtype=np.float32)
        pooled = np.asarray(mean.embed(prompt, normalize=False), dtype=np.float32)
        out["prompts"].append({"prompt": prompt, "ids": [int(i) for i in ids],
                               "row_sha256": [hashlib.sha256(r.tobytes()).hexdigest() for r in rows],
                               "mean": [float(x) for x in pooled]})
    return out


def main():
    out_path, models = sys.argv[1], sys.argv[2:]
    result = {"llama_cpp_python": __import__("llama_cpp").__version__, "models": [record(p) for p in models]}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    main()

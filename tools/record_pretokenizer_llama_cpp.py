"""Record llama.cpp's token ids for a pre-tokenizer edgellm has no real model of (gpt-4o: gpt-oss's o200k), over
SmolLM2's vocabulary and merges with `tokenizer.ggml.pre` set to that name, as tests/fixtures/
llama_cpp_pretokenizer_<pre>.npz for tests/test_tokenizer_pretokenize.py. Run with edgellm's python; llama.cpp runs
in a subprocess under the python that has llama-cpp-python:

    python tools/record_pretokenizer_llama_cpp.py --llama-python /work/llama-venv/bin/python [--pre gpt-4o]

The texts come from tests/test_tokenizer_pretokenize.py's pretokenizer_texts (seeded: mixed case runs,
contractions, digits, punctuation, newlines, accented and non-Latin letters, an emoji); the fixture keeps every
text's ids (concatenated, with offsets), so a test needs only SmolLM2's GGUF from the catalog.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

LLAMA_TOKENIZE = """
import json, sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts = json.load(open(sys.argv[2]))
json.dump({"ids": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts],
           "version": llama_cpp.__version__}, open(sys.argv[3], "w"))
"""


def write_vocab_file(path, tokenizer_gguf, pre: str) -> None:
    """A GGUF llama.cpp loads vocab-only: a stub llama config and SmolLM2's tokenizer keys, pre replaced."""
    from gguf import GGUFWriter
    from helpers_tiny_archs import tokenizer_fields
    writer = GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "embedding_length": 64, "feed_forward_length": 64,
                       "attention.head_count": 1, "context_length": 64}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value, vtype, sub in tokenizer_fields(tokenizer_gguf):
        writer.add_key_value(key, pre if key == "tokenizer.ggml.pre" else value, vtype, sub_type=sub)
    writer.add_tensor("token_embd.weight", np.zeros((1, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--pre", default="gpt-4o")
    args = ap.parse_args()
    from edgellm.store import catalog
    from test_tokenizer_pretokenize import pretokenizer_texts
    texts = pretokenizer_texts()
    with tempfile.TemporaryDirectory() as workdir:
        vocab, texts_json, out = (os.path.join(workdir, n) for n in ("vocab.gguf", "texts.json", "ids.json"))
        write_vocab_file(vocab, catalog.pull("smollm2-135m", quiet=True), args.pre)
        with open(texts_json, "w") as f:
            json.dump(texts, f)
        subprocess.run([args.llama_python, "-c", LLAMA_TOKENIZE, vocab, texts_json, out], check=True)
        with open(out) as f:
            got = json.load(f)
    ids = got["ids"]
    offsets = np.cumsum([0] + [len(i) for i in ids]).astype(np.int32)
    dest = os.path.join(ROOT, "tests", "fixtures", f"llama_cpp_pretokenizer_{args.pre}.npz")
    np.savez_compressed(dest, ids=np.concatenate([np.asarray(i, np.int32) for i in ids]), offsets=offsets,
                        n_texts=np.int32(len(texts)), llama_cpp_python=np.asarray(got["version"]))
    print(f"{len(texts)} texts, {offsets[-1]} ids -> {dest} ({os.path.getsize(dest)} bytes)")


if __name__ == "__main__":
    main()

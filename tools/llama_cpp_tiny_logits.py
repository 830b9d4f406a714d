"""Run by tools/record_tiny_archs.py under the python that has llama-cpp-python (no gguf-py or edgellm needed):
llama.cpp's logits of one GGUF file for a token sequence, teacher-forced and on the decode path.

    python llama_cpp_tiny_logits.py MODEL.gguf IDS(comma-separated) PROMPT_LEN OUT.npz

forced [T, n_vocab]: all T ids evaluated as one batch, every row; decode [T - P + 1, n_vocab]: the first P ids as
one batch (its last row), then each later id alone. Flash attention off, f16 KV cache: llama.cpp's defaults.
"""
import sys

import llama_cpp
import numpy as np


def main():
    path, ids, prompt_len, out = sys.argv[1], [int(i) for i in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4]
    def fresh():  # a new context per path, so both start from an empty cache at cell 0
        return llama_cpp.Llama(model_path=path, n_ctx=128, n_batch=64, n_ubatch=64, n_threads=2, logits_all=True,
                               verbose=False)
    llm = fresh()
    llm.eval(ids)
    forced = np.array(llm.scores[:len(ids)], np.float32)
    del llm
    llm = fresh()
    llm.eval(ids[:prompt_len])
    decode = [np.array(llm.scores[prompt_len - 1], np.float32)]
    for i in range(prompt_len, len(ids)):
        llm.eval(ids[i:i + 1])
        decode.append(np.array(llm.scores[i], np.float32))
    np.savez(out, forced=forced, decode=np.stack(decode), version=llama_cpp.__version__)


if __name__ == "__main__":
    main()

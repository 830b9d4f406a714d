"""Synthetic mixture-of-experts GGUF files of a given shape, quantized by llama.cpp's own quantizer, for
benchmarks (random weights; the tokenizer is SmolLM2's from the catalog, padded with unused tokens to the
vocabulary size). Run with edgellm's python; the quantizer runs in a subprocess under the python that has
llama-cpp-python (its llama_model_quantize):

    python tools/make_synthetic_moe.py OUT.gguf --llama-python /work/llama-venv/bin/python \
        [--shape qwen3-30b-a3b] [--type Q4_K_M] [--layers N --embd D --experts E --used K ...]

The float16 file is written tensor by tensor in llama.cpp's converter layout (expert stacks [n_expert, n_out, n_in],
the router F32), then quantized to --type and removed; the float16 file needs about 2 bytes per parameter of disk
for the time of the quantization. Shapes: qwen3-30b-a3b (48 layers, d 2048, 128 experts top 8 of 768 rows, 32 / 4
heads of 128, vocabulary 151,936: about 17 GB at Q4_K_M) or any other given with the flags.
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SHAPES = {
    "qwen3-30b-a3b": dict(layers=48, embd=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8,
                          expert_ff=768, ff=6144, vocab=151936, context=40960, rope_base=1000000.0),
    "small": dict(layers=4, embd=512, heads=8, kv_heads=2, head_dim=64, experts=16, used=4, expert_ff=256, ff=1024,
                  vocab=49152, context=4096, rope_base=1000000.0),
}
FILE_TYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q4_K_S": 14, "Q5_K_M": 17, "Q6_K": 18}  # llama_ftype values

QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def write_f16(path, shape: dict, tokenizer_gguf, seed: int = 0) -> int:
    """The float16 file; returns its parameter count."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from edgellm.engine.models import get_architecture
    from helpers_tiny_archs import tokenizer_fields
    from helpers_tiny_gguf import TinySpec, _MetadataOnly
    arch = "qwen3moe"
    keys = {"block_count": shape["layers"], "context_length": shape["context"], "embedding_length": shape["embd"],
            "feed_forward_length": shape["ff"], "attention.head_count": shape["heads"],
            "attention.head_count_kv": shape["kv_heads"], "attention.key_length": shape["head_dim"],
            "attention.value_length": shape["head_dim"], "rope.freq_base": shape["rope_base"],
            "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": shape["experts"],
            "expert_used_count": shape["used"], "expert_feed_forward_length": shape["expert_ff"]}
    probe = _MetadataOnly(TinySpec(arch=arch, n_layer=shape["layers"], n_embd=shape["embd"], n_vocab=shape["vocab"]))
    probe.metadata = {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in keys.items()}}
    config = get_architecture(arch).config_class.from_gguf(probe)
    specs = [t for t in get_architecture(arch).model_class.tensor_specs(config) if not t.optional]
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"synthetic-{arch}")
    writer.add_file_type(1)
    for key, value in keys.items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    for key, value, vtype, sub in tokenizer_fields(tokenizer_gguf):
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") and len(value) < shape["vocab"]:
            pad = shape["vocab"] - len(value)  # unused tokens up to the vocabulary size, as converters pad
            value = list(value) + ([f"[PAD{i}]" for i in range(len(value), shape["vocab"])]
                                   if key.endswith("tokens") else [5] * pad)
        writer.add_key_value(key, value, vtype, sub_type=sub)
    kinds = {}
    for t in specs:
        ggml_type = "F16" if t.is_matrix and not t.name.endswith("ffn_gate_inp.weight") else "F32"
        kinds[t.name] = ggml_type
        itemsize = 2 if ggml_type == "F16" else 4
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float16 if itemsize == 2 else np.float32),
                               int(np.prod(t.shape)) * itemsize, raw_dtype=GGMLQuantizationType[ggml_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    n_params = 0
    for i, t in enumerate(specs):
        n_params += int(np.prod(t.shape))
        if t.is_matrix:
            scale = 1.0 if t.name == "token_embd.weight" else 1.0 / np.sqrt(t.shape[-1])
            rows = int(np.prod(t.shape[:-1]))
            data = np.empty((rows, t.shape[-1]), np.float16 if kinds[t.name] == "F16" else np.float32)
            for r0 in range(0, rows, 8192):  # float32 draws a slice at a time: an expert stack of the 30B shape
                r1 = min(rows, r0 + 8192)    # is 400 MB in float16
                data[r0:r1] = rng.standard_normal((r1 - r0, t.shape[-1]), np.float32) * np.float32(scale)
            writer.write_tensor_data(data.reshape(-1))
        else:
            writer.write_tensor_data((1.0 + 0.1 * rng.standard_normal(t.shape)).astype(np.float32))
        print(f"\r[{i + 1}/{len(specs)}] {t.name:<36}", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    writer.close()
    return n_params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="Q4_K_M", choices=sorted(FILE_TYPES))
    ap.add_argument("--seed", type=int, default=0)
    for name in SHAPES["small"]:
        ap.add_argument("--" + name.replace("_", "-"), type=type(SHAPES["small"][name]))
    args = ap.parse_args()
    shape = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in SHAPES[args.shape].items()}
    from edgellm.store import catalog
    tokenizer_gguf = catalog.pull("smollm2-135m", quiet=True)
    f16 = f"{args.out}.f16.tmp"
    t0 = time.perf_counter()
    try:
        n = write_f16(f16, shape, tokenizer_gguf, args.seed)
        t1 = time.perf_counter()
        print(f"float16 file: {n:,} parameters, {os.path.getsize(f16) / 2**30:.2f} GiB in {t1 - t0:.0f} s", flush=True)
        subprocess.run([args.llama_python, "-c", QUANTIZE, f16, args.out, str(FILE_TYPES[args.type])], check=True)
        print(f"{args.out}: {args.type} by llama.cpp's quantizer, {os.path.getsize(args.out) / 2**30:.2f} GiB in "
              f"{time.perf_counter() - t1:.0f} s; shape {shape}")
    finally:
        if os.path.exists(f16):
            os.remove(f16)


if __name__ == "__main__":
    main()

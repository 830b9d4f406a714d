"""Synthetic mixture-of-experts GGUF files of a given shape, quantized by llama.cpp's own quantizer, for
benchmarks (random weights; the tokenizer is SmolLM2's from the catalog, padded with unused tokens to the
vocabulary size). Run with edgellm's python; the quantizer runs in a subprocess under the python that has
llama-cpp-python (its llama_model_quantize):

    python tools/make_synthetic_moe.py OUT.gguf --llama-python /work/llama-venv/bin/python \\
        [--shape qwen3-30b-a3b] [--type Q4_K_M] [--layers N --embd D --experts E --used K ...] [--dry-run]

The source file is written tensor by tensor in llama.cpp's converter layout (expert stacks [n_expert, n_out, n_in],
the router F32), then quantized to --type and removed. It holds float16 (2 bytes per parameter) or, with
`--via Q8_0` (the default where float16 and the output would not fit on the disk together, as at the 30B and 20B
shapes), its expert stacks as random Q8_0 blocks (1.06 bytes per parameter: uniform int8 values under one scale per
row), which llama.cpp's quantizer requantizes. --dry-run prints the parameter count and the source and output sizes
without writing anything. Shapes:

    qwen3-30b-a3b  qwen3moe: 48 layers, d 2048, 128 experts top 8 of 768 rows, 32 / 4 heads of 128, vocabulary
                   151,936 (about 17 GB at Q4_K_M); "small" is a 4-layer one
    gpt-oss-20b    gpt-oss: 24 layers, d 2880, 32 experts top 4 of 2880 rows, 64 / 8 heads of 64, vocabulary 201,088,
                   a 128-position window on alternate layers, YaRN x32 over 4,096; default type MXFP4_MOE (experts
                   MXFP4, every other matrix Q8_0, as llama.cpp's quantizer makes it; about 12 GB); "gpt-oss-small"
                   is a 4-layer one whose 16-position window a short prompt outgrows

or any other given with the flags.
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
    "qwen3-30b-a3b": dict(arch="qwen3moe", layers=48, embd=2048, heads=32, kv_heads=4, head_dim=128, experts=128,
                          used=8, expert_ff=768, ff=6144, vocab=151936, context=40960, rope_base=1000000.0, eps=1e-6),
    "small": dict(arch="qwen3moe", layers=4, embd=512, heads=8, kv_heads=2, head_dim=64, experts=16, used=4,
                  expert_ff=256, ff=1024, vocab=49152, context=4096, rope_base=1000000.0, eps=1e-6),
    "gpt-oss-20b": dict(arch="gpt-oss", layers=24, embd=2880, heads=64, kv_heads=8, head_dim=64, experts=32, used=4,
                        expert_ff=2880, ff=2880, vocab=201088, context=131072, rope_base=150000.0, eps=1e-5,
                        sliding_window=128, yarn_factor=32.0, yarn_orig_context=4096),
    "gpt-oss-small": dict(arch="gpt-oss", layers=4, embd=512, heads=8, kv_heads=2, head_dim=64, experts=16, used=4,
                          expert_ff=256, ff=256, vocab=49152, context=131072, rope_base=150000.0, eps=1e-5,
                          sliding_window=16, yarn_factor=32.0, yarn_orig_context=4096),
}
DEFAULT_TYPE = {"qwen3moe": "Q4_K_M", "gpt-oss": "MXFP4_MOE"}
# llama_ftype values; MXFP4_MOE: expert stacks MXFP4, every other quantizable matrix (embeddings, output) Q8_0
FILE_TYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q4_K_S": 14, "Q5_K_M": 17, "Q6_K": 18, "MXFP4_MOE": 38}
# bytes per weight of the quantized matrices, for --dry-run's output estimate (Q4_K_M and Q5_K_M mix in Q6_K)
TYPE_BYTES = {"Q4_0": 18 / 32, "Q8_0": 34 / 32, "Q4_K_M": 4.9 / 8, "Q4_K_S": 4.6 / 8, "Q5_K_M": 5.7 / 8,
              "Q6_K": 210 / 256}
MXFP4_BYTES, Q8_0_BYTES = 17 / 32, 34 / 32

QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = 2
params.allow_requantize = True  # the --via Q8_0 source's expert stacks
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def arch_keys(shape: dict) -> dict:
    """The `{arch}.` keys llama.cpp's converter writes for the shape's architecture."""
    keys = {"block_count": shape["layers"], "context_length": shape["context"], "embedding_length": shape["embd"],
            "feed_forward_length": shape["ff"], "attention.head_count": shape["heads"],
            "attention.head_count_kv": shape["kv_heads"], "attention.key_length": shape["head_dim"],
            "attention.value_length": shape["head_dim"], "rope.freq_base": shape["rope_base"],
            "attention.layer_norm_rms_epsilon": shape["eps"], "expert_count": shape["experts"],
            "expert_used_count": shape["used"], "expert_feed_forward_length": shape["expert_ff"]}
    if shape["arch"] == "gpt-oss":  # no expert_gating_func, as its converter: llama.cpp's graph fixes the routing
        keys.update({"attention.sliding_window": shape["sliding_window"], "rope.scaling.type": "yarn",
                     "rope.scaling.factor": shape["yarn_factor"],
                     "rope.scaling.original_context_length": shape["yarn_orig_context"]})
    return keys


def tensor_plan(shape: dict, via: str):
    """[(TensorSpec, ggml type in the source file)] of the architecture's required tensors, in edgellm's order."""
    from edgellm.engine.models import get_architecture
    from helpers_tiny_gguf import TinySpec, _MetadataOnly
    arch = shape["arch"]
    probe = _MetadataOnly(TinySpec(arch=arch, n_layer=shape["layers"], n_embd=shape["embd"], n_vocab=shape["vocab"]))
    probe.metadata = {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in arch_keys(shape).items()}}
    config = get_architecture(arch).config_class.from_gguf(probe)
    plan = []
    for t in get_architecture(arch).model_class.tensor_specs(config):
        if t.optional:
            continue
        ggml_type = "F16" if t.is_matrix and not t.name.endswith("ffn_gate_inp.weight") else "F32"
        if via == "Q8_0" and "_exps.weight" in t.name:
            ggml_type = "Q8_0"
        plan.append((t, ggml_type))
    return plan


def tensor_bytes(shape, ggml_type: str) -> int:
    n = int(np.prod(shape))
    return {"F16": 2 * n, "F32": 4 * n, "Q8_0": n // 32 * 34, "MXFP4": n // 32 * 17}[ggml_type]


def write_source(path, shape: dict, tokenizer_gguf, seed: int = 0, via: str = "F16") -> int:
    """The file llama.cpp's quantizer reads; returns its parameter count."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from helpers_tiny_archs import tokenizer_fields
    arch = shape["arch"]
    keys = arch_keys(shape)
    plan = tensor_plan(shape, via)
    specs = [t for t, _ in plan]
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"synthetic-{arch}")
    writer.add_file_type(1)
    for key, value in keys.items():
        add = writer.add_float32 if isinstance(value, float) else writer.add_string if isinstance(value, str) \
            else writer.add_uint32
        add(f"{arch}.{key}", value)
    for key, value, vtype, sub in tokenizer_fields(tokenizer_gguf):
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") and len(value) < shape["vocab"]:
            pad = shape["vocab"] - len(value)  # unused tokens up to the vocabulary size, as converters pad
            value = list(value) + ([f"[PAD{i}]" for i in range(len(value), shape["vocab"])]
                                   if key.endswith("tokens") else [5] * pad)
        writer.add_key_value(key, value, vtype, sub_type=sub)
    kinds = {t.name: ggml_type for t, ggml_type in plan}
    for t, ggml_type in plan:
        nbytes = tensor_bytes(t.shape, ggml_type)
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float16 if ggml_type == "F16" else np.float32),
                               nbytes, raw_dtype=GGMLQuantizationType[ggml_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    n_params = 0
    for i, t in enumerate(specs):
        n_params += int(np.prod(t.shape))
        if kinds[t.name] == "Q8_0":
            rows = int(np.prod(t.shape[:-1]))
            block = np.dtype([("d", "<f2"), ("q", "i1", 32)])
            # uniform int8 values with the standard deviation 1/sqrt(n_in) of the float16 path's rows
            d = np.float16(np.sqrt(3.0 / t.shape[-1]) / 127.0)
            data = np.empty((rows, t.shape[-1] // 32), block)
            for r0 in range(0, rows, 8192):
                r1 = min(rows, r0 + 8192)
                data["q"][r0:r1] = np.frombuffer(rng.bytes((r1 - r0) * t.shape[-1]), np.int8).reshape(
                    r1 - r0, -1, 32)
            data["d"] = d
            writer.write_tensor_data(data.reshape(-1).view(np.uint8))
        elif t.is_matrix:
            scale = 1.0 if t.name == "token_embd.weight" else 1.0 / np.sqrt(t.shape[-1])
            rows = int(np.prod(t.shape[:-1]))
            data = np.empty((rows, t.shape[-1]), np.float16 if kinds[t.name] == "F16" else np.float32)
            for r0 in range(0, rows, 8192):  # float32 draws a slice at a time: an expert stack of the 30B shape
                r1 = min(rows, r0 + 8192)    # is 400 MB in float16
                data[r0:r1] = rng.standard_normal((r1 - r0, t.shape[-1]), np.float32) * np.float32(scale)
            writer.write_tensor_data(data.reshape(-1))
        elif t.name.endswith(".bias"):  # (gpt-oss's attention, router and expert biases)
            writer.write_tensor_data((0.1 * rng.standard_normal(t.shape)).astype(np.float32))
        else:  # norms, and gpt-oss's attention sinks
            writer.write_tensor_data((1.0 + 0.1 * rng.standard_normal(t.shape)).astype(np.float32))
        print(f"\r[{i + 1}/{len(specs)}] {t.name:<36}", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    writer.close()
    return n_params


def sizes(shape: dict, file_type: str) -> dict:
    """Parameter count and tensor-data bytes of the source (F16, via Q8_0) and of the output: exact for MXFP4_MOE and
    Q8_0, about for the k-quant mixes. Metadata (the padded vocabulary's strings) comes on top."""
    plan = tensor_plan(shape, "F16")
    out = {"params": 0, "expert_params": 0, "F16": 0, "Q8_0": 0, "output": 0.0}
    for t, ggml_type in plan:
        n = int(np.prod(t.shape))
        stack = "_exps.weight" in t.name
        out["params"] += n
        out["expert_params"] += n if stack else 0
        out["F16"] += tensor_bytes(t.shape, ggml_type)
        out["Q8_0"] += tensor_bytes(t.shape, "Q8_0" if stack else ggml_type)
        if ggml_type == "F32":  # vectors and the router: llama.cpp's quantizer leaves them
            out["output"] += tensor_bytes(t.shape, "F32")
        elif file_type == "MXFP4_MOE":
            out["output"] += n * (MXFP4_BYTES if stack else Q8_0_BYTES)
        else:
            out["output"] += n * TYPE_BYTES[file_type]
    return out


def _default_via(shape: dict, out: str, file_type: str) -> str:
    """F16 unless its source file and the output would not fit on the output's disk together."""
    import shutil
    size = sizes(shape, file_type)
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(out)) or ".").free
    return "F16" if size["F16"] + size["output"] < 0.9 * free else "Q8_0"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--llama-python", help="the python that has llama-cpp-python (required unless --dry-run)")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--type", default=None, choices=sorted(FILE_TYPES),
                    help="llama.cpp's file type (default: " +
                         ", ".join(f"{t} for {a}" for a, t in DEFAULT_TYPE.items()) + ")")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--via", choices=("F16", "Q8_0"), default=None,
                    help="the source file's expert stacks (default: F16 where it and the output fit on the disk)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the parameter count and the source and output sizes; write nothing")
    flags = {}
    for dims in SHAPES.values():
        flags.update({k: type(v) for k, v in dims.items() if k != "arch" and k not in flags})
    for name, kind in flags.items():
        ap.add_argument("--" + name.replace("_", "-"), type=kind)
    args = ap.parse_args()
    shape = dict(SHAPES[args.shape])
    for name in flags:
        if getattr(args, name) is not None:
            if name not in shape:
                ap.error(f"--{name.replace('_', '-')} does not apply to {shape['arch']} shapes")
            shape[name] = getattr(args, name)
    file_type = args.type or DEFAULT_TYPE[shape["arch"]]
    if args.dry_run:
        size = sizes(shape, file_type)
        gib = 2 ** 30
        print(f"{args.shape} ({shape['arch']}): {size['params']:,} parameters, {size['expert_params']:,} of them in "
              f"expert stacks; shape {shape}")
        print(f"source file: {size['F16'] / gib:.2f} GiB with --via F16, {size['Q8_0'] / gib:.2f} GiB with --via Q8_0"
              f" (tensor data); default here: --via {args.via or _default_via(shape, args.out, file_type)}")
        print(f"output {file_type}: {'' if file_type in ('MXFP4_MOE', 'Q8_0') else 'about '}"
              f"{size['output'] / gib:.2f} GiB (tensor data)")
        return
    if not args.llama_python:
        ap.error("--llama-python is required (the python with llama-cpp-python, which quantizes)")
    from edgellm.store import catalog
    tokenizer_gguf = catalog.pull("smollm2-135m", quiet=True)
    via = args.via or _default_via(shape, args.out, file_type)
    source = f"{args.out}.source.tmp"
    t0 = time.perf_counter()
    try:
        n = write_source(source, shape, tokenizer_gguf, args.seed, via)
        t1 = time.perf_counter()
        print(f"source file ({via}): {n:,} parameters, {os.path.getsize(source) / 2**30:.2f} GiB in {t1 - t0:.0f} s",
              flush=True)
        subprocess.run([args.llama_python, "-c", QUANTIZE, source, args.out, str(FILE_TYPES[file_type])], check=True)
        print(f"{args.out}: {file_type} by llama.cpp's quantizer, {os.path.getsize(args.out) / 2**30:.2f} GiB in "
              f"{time.perf_counter() - t1:.0f} s; shape {shape}")
    finally:
        if os.path.exists(source):
            os.remove(source)


if __name__ == "__main__":
    main()

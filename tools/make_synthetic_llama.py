"""A Llama-shaped GGUF with random weights and a real tokenizer, quantized by llama.cpp's own quantizer: a
laptop-sized model to time without downloading one.

    python tools/make_synthetic_llama.py --shape 1b --out /tmp/llama-1b-q4_k_m.gguf --llama-python PY
    python tools/make_synthetic_llama.py --shape 8b --out /tmp/llama-8b-q4_k_m.gguf --llama-python PY
    python tools/make_synthetic_llama.py --n-embd 256 --n-layer 2 --n-head 4 --n-head-kv 2 --n-ff 512 --out t.gguf

Shapes: 1b is Llama-3.2-1B's (2048 wide, 16 layers, 32 heads of 64, 8 KV heads, 8192 FFN, tied output), 8b is
Llama-3.1-8B's (4096, 32 layers, 32 heads of 128, 8 KV heads, 14336 FFN, own output matrix); any field can be
overridden. The vocabulary is the tokenizer's (SmolLM2's by default: 49,152 tokens against Llama 3's 128,256, so
the embedding and output matrices are smaller than the real models'). Weights are N(0, 0.02) (norms 1), written as
F16 tensor by tensor (the writer streams: memory stays at one tensor), then quantized by llama.cpp's
llama_model_quantize through llama-cpp-python in --llama-python (Q4_K_M by default, as llama-quantize would), and
the F16 file is deleted unless --keep-f16. Random weights give the real model's speed, not its text.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

SHAPES = {
    "1b": dict(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192, tied=True, rope_base=500000.0),
    "8b": dict(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336, tied=False, rope_base=500000.0),
}
FTYPES = {"Q4_K_M": 15, "Q4_K_S": 14, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3}  # llama_ftype
WEIGHT_STD = 0.02


def default_tokenizer() -> str:
    from edgellm.store import catalog
    return str(catalog.pull("smollm2-135m", quiet=True))


def tensor_plan(shape: dict, n_vocab: int):
    """(name, numpy shape (outermost first), kind) of every tensor, in llama.cpp's order."""
    d, f, hd = shape["n_embd"], shape["n_ff"], shape["n_embd"] // shape["n_head"]
    kv = hd * shape["n_head_kv"]
    out = [("token_embd.weight", (n_vocab, d), "w")]
    for i in range(shape["n_layer"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,), "norm"), (b + "attn_q.weight", (d, d), "w"),
                (b + "attn_k.weight", (kv, d), "w"), (b + "attn_v.weight", (kv, d), "w"),
                (b + "attn_output.weight", (d, d), "w"), (b + "ffn_norm.weight", (d,), "norm"),
                (b + "ffn_gate.weight", (f, d), "w"), (b + "ffn_up.weight", (f, d), "w"),
                (b + "ffn_down.weight", (d, f), "w")]
    out.append(("output_norm.weight", (d,), "norm"))
    if not shape["tied"]:
        out.append(("output.weight", (n_vocab, d), "w"))
    return out


def write_f16(path: str, shape: dict, tokenizer_gguf: str, seed: int = 0) -> None:
    import gguf
    from gguf import GGUFReader

    src = GGUFReader(tokenizer_gguf)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"synthetic-llama-{shape['n_layer']}x{shape['n_embd']}")
    w.add_context_length(8192)
    w.add_embedding_length(shape["n_embd"])
    w.add_block_count(shape["n_layer"])
    w.add_feed_forward_length(shape["n_ff"])
    w.add_head_count(shape["n_head"])
    w.add_head_count_kv(shape["n_head_kv"])
    w.add_rope_dimension_count(shape["n_embd"] // shape["n_head"])
    w.add_rope_freq_base(shape["rope_base"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = 0
    for field in src.fields.values():  # the tokenizer, as the source file has it
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            if field.name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
            w.add_array(field.name, value)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(field.name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            w.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], vtype)
    w.add_vocab_size(n_vocab)
    plan = tensor_plan(shape, n_vocab)
    for name, shp, kind in plan:
        dtype = np.float32 if kind == "norm" else np.float16
        w.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp, kind in plan:
        if kind == "norm":
            w.write_tensor_data(np.ones(shp, np.float32))
            continue
        rows = np.empty(shp, np.float16)
        step = max(1, (1 << 24) // shp[1])  # a few tens of MB of float32 at a time
        for r in range(0, shp[0], step):
            rows[r:r + step] = (rng.standard_normal((min(step, shp[0] - r), shp[1]), np.float32)
                                * np.float32(WEIGHT_STD))
        w.write_tensor_data(rows)
    w.close()


QUANTIZE = r"""
import sys, llama_cpp
src, dst, ftype, nthread = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = ftype, nthread
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
sys.exit(rc)
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    for field in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff"):
        ap.add_argument("--" + field.replace("_", "-"), type=int, default=None)
    ap.add_argument("--untied", action="store_true", help="give the model its own output matrix")
    ap.add_argument("--tokenizer", default=None, help="GGUF whose tokenizer to copy (default: SmolLM2-135M's)")
    ap.add_argument("--out", required=True, help="the quantized file to write")
    ap.add_argument("--ftype", default="Q4_K_M", choices=sorted(FTYPES))
    ap.add_argument("--llama-python", default=sys.executable, help="python with llama-cpp-python installed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep-f16", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    for field in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff"):
        if getattr(args, field) is not None:
            shape[field] = getattr(args, field)
    if args.untied:
        shape["tied"] = False
    f16 = args.out + ".f16.gguf"
    t0 = time.perf_counter()
    write_f16(f16, shape, args.tokenizer or default_tokenizer(), args.seed)
    print(f"wrote {f16} ({os.path.getsize(f16) / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        out = subprocess.run([args.llama_python, "-c", QUANTIZE, f16, args.out, str(FTYPES[args.ftype]),
                              str(args.threads)], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"llama_model_quantize failed ({out.returncode}):\n{out.stderr[-2000:]}")
    finally:
        if not args.keep_f16:
            os.remove(f16)
    print(f"quantized to {args.ftype}: {args.out} ({os.path.getsize(args.out) / 1e9:.2f} GB) in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

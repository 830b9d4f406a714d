"""`edgellm quantize`, `edgellm convert` and `edgellm perplexity`: the flags of llama-quantize,
convert_hf_to_gguf.py and llama-perplexity, over edgellm.prep.quantize, edgellm.prep.convert and
edgellm.prep.perplexity."""

from __future__ import annotations

import sys

from edgellm import load
from edgellm.errors import EdgeLLMError
from edgellm.prep.convert import convert_checkpoint
from edgellm.prep.perplexity import kl_divergence, load_kl_base, perplexity
from edgellm.prep.quantize import FILE_TYPE_ALIASES, FILE_TYPES, TENSOR_TYPES, quantize_file


def cmd_quantize(args) -> int:
    r = quantize_file(args.input, args.output, args.type, pure=args.pure, output_tensor_type=args.output_tensor_type,
                      token_embedding_type=args.token_embedding_type, allow_requantize=args.allow_requantize,
                      progress=not args.quiet)
    mib = 1024 * 1024
    print(f"quantized {len(r.plan)} tensors in {r.seconds:.1f} s: {r.in_bytes / mib:.2f} MiB -> "
          f"{r.out_bytes / mib:.2f} MiB ({args.output})")
    if r.n_fallback:
        print(f"note: {r.n_fallback} tensor(s) have rows that do not split into the type's blocks and use a "
              f"fallback type, as llama.cpp does")
    return 0


def cmd_convert(args) -> int:
    r = convert_checkpoint(args.hf_dir, args.output, args.type, pre_tokenizer=args.pre, progress=not args.quiet)
    print(f"wrote {args.output}: {r.architecture}, {r.n_tensors} tensors, {r.out_bytes / (1024 * 1024):.2f} MiB")
    return 0


def cmd_perplexity(args) -> int:
    if args.kl_divergence and not args.kl_divergence_base:
        raise EdgeLLMError("--kl-divergence compares with a base file: give it with --kl-divergence-base FILE")
    if args.kl_divergence:
        n_ctx = int(load_kl_base(args.kl_divergence_base)["n_ctx"])
        model = load(args.model, n_ctx=n_ctx, n_threads=args.threads)
        kl_divergence(model, args.kl_divergence_base, n_chunks=args.chunks)
        return 0
    text_path = args.file or args.textfile
    if not text_path:
        raise EdgeLLMError("give the text to score: edgellm perplexity MODEL TEXTFILE")
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    model = load(args.model, n_ctx=args.ctx_size, n_threads=args.threads)
    tokens = model.tokenize(text)  # BOS included where the model adds one, as llama.cpp's common_tokenize
    perplexity(model, tokens, n_ctx=args.ctx_size, n_chunks=args.chunks, kl_base_path=args.kl_divergence_base)
    return 0


def add_subcommands(sub) -> None:
    """Register quantize, convert and perplexity on an argparse subparsers object."""
    p = sub.add_parser("quantize", help="re-encode a GGUF file in another type or llama.cpp mix (llama-quantize)")
    p.add_argument("input", help="input .gguf (ideally F32/F16/BF16)")
    p.add_argument("output", help="output .gguf")
    p.add_argument("type", metavar="TYPE", help="one of " + ", ".join(list(FILE_TYPES) + list(FILE_TYPE_ALIASES)))
    p.add_argument("--pure", action="store_true", help="every quantizable tensor in TYPE: no per-tensor mix")
    p.add_argument("--output-tensor-type", default=None, metavar="T", type=str.upper, choices=TENSOR_TYPES,
                   help="type of output.weight")
    p.add_argument("--token-embedding-type", default=None, metavar="T", type=str.upper, choices=TENSOR_TYPES,
                   help="type of token_embd.weight")
    p.add_argument("--allow-requantize", action="store_true",
                   help="allow an input whose tensors are already quantized (adds a second rounding error)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("convert", help="a Hugging Face checkpoint directory to GGUF (convert_hf_to_gguf.py)")
    p.add_argument("hf_dir", help="directory with config.json, *.safetensors and tokenizer.json/tokenizer.model")
    p.add_argument("output", help="output .gguf")
    p.add_argument("--type", "--outtype", default="F16",
                   help="F32, F16 (default), BF16, Q8_0, or any `edgellm quantize` type such as Q4_K_M")
    p.add_argument("--pre", default=None, help="llama.cpp's BPE pre-tokenizer name, when it is not recognised")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("perplexity", help="perplexity of a text, or KL divergence from a base model (llama-perplexity)")
    p.add_argument("model", help="catalog name or .gguf path")
    p.add_argument("textfile", nargs="?", default=None, help="text to score")
    p.add_argument("-f", "--file", default=None, help="text to score (as llama-perplexity's -f)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="score only the first N chunks")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--kl-divergence-base", default=None, metavar="FILE",
                   help="save the base model's distributions here (or, with --kl-divergence, read them)")
    p.add_argument("--kl-divergence", action="store_true",
                   help="compare this model with the base distributions in --kl-divergence-base")
    p.set_defaults(func=cmd_perplexity)


if __name__ == "__main__":  # python -m edgellm.prep.cli ... for a standalone run
    import argparse
    parser = argparse.ArgumentParser(prog="edgellm")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args()
    try:
        sys.exit(a.func(a))
    except EdgeLLMError as e:
        print(f"edgellm: error: {e}", file=sys.stderr)
        sys.exit(1)

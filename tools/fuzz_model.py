"""Fuzz past the GGUF reader: files that the reader accepts but whose contents are wrong, then load, generate
and chat with each. Mutations: config values (head counts, layer count, widths, context, rope and norm floats,
sliding windows), tensors of other shapes or types, token tables and merges, and chat templates.

Acceptable outcomes are success or one of edgellm's own errors; anything else is reported with its case.

    python tools/fuzz_model.py --cases 300 --seed 0 [--json]
"""
import argparse
import collections
import json
import random
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import hardening_tiny  # noqa: E402  (the tiny loadable llama writer the tests use)
from helpers_tiny_gguf import tensor_shapes  # noqa: E402

UINT_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv")
ODD_UINTS = (0, 1, 2, 3, 5, 7, 63, 65, 1 << 16, (1 << 31) - 1, (1 << 32) - 1)
ODD_FLOATS = (0.0, -1.0, 1e-30, 1e30, float("inf"), float("-inf"), float("nan"))
TEMPLATE_PIECES = ("{{ messages[0]['content'] }}", "{% for m in messages %}{{ m.role }}{% endfor %}",
                   "{{ bos_token }}", "{{ raise_exception('no') }}", "{{ 'x' * 10**9 }}", "{{ undefined.x }}",
                   "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                   "{{ ''.__class__.__mro__ }}", "{% if add_generation_prompt %}A:{% endif %}", "{{ messages|tojson }}",
                   "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{%", "{{ 1/0 }}", "{{ [1,2][5] }}")


def mutate(rng: random.Random):
    """(kind, keyword arguments for write_loadable_tiny_model, spec overrides)."""
    arch = "llama"
    kind = rng.choice(["uint", "float", "window", "rope_keys", "tensor_shape", "tensor_type", "tokens", "merges",
                       "token_types", "template"])
    kw, spec = {}, {}
    if kind == "uint":
        spec[rng.choice(["n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "context_length"])] = rng.choice(ODD_UINTS)
        if spec.get("n_embd", 64) > 4096 or spec.get("n_ff", 96) > 4096 or spec.get("n_layer", 2) > 64:
            kind += "_meta_only"  # tensors written at the true size, the header claims another
    elif kind == "float":
        kw["extra"] = {f"{arch}.{rng.choice(['rope.freq_scale', 'rope.scaling.factor', 'attn_logit_softcapping'])}":
                       rng.choice(ODD_FLOATS)}
    elif kind == "window":
        kw["extra"] = {f"{arch}.attention.sliding_window": rng.choice(ODD_UINTS)}
    elif kind == "rope_keys":
        kw["extra"] = {f"{arch}.rope.dimension_count": rng.choice(ODD_UINTS),
                       f"{arch}.rope.scaling.type": rng.choice(["linear", "yarn", "none", "", "weird"])}
    elif kind in ("tensor_shape", "tensor_type"):
        names = list(tensor_shapes(hardening_tiny.tiny_spec()))
        name = rng.choice(names)
        shape, _ = tensor_shapes(hardening_tiny.tiny_spec())[name]
        if kind == "tensor_shape":
            shape = tuple(max(1, s + rng.choice([-1, 1, 32, -s // 2])) for s in shape)
            if rng.random() < 0.3:
                shape = shape[::-1]
        value = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(shape).astype(np.float32)
        if kind == "tensor_type":
            value = (value.astype(np.float16).view(np.uint8).reshape(*shape[:-1], -1), "F16")
        kw["replace"] = {name: value}
    elif kind == "tokens":
        tokens = list(hardening_tiny.TOKENIZER["tokenizer.ggml.tokens"])
        op = rng.choice(["dup", "empty", "truncate", "huge"])
        if op == "dup":
            tokens[rng.randrange(len(tokens))] = tokens[rng.randrange(len(tokens))]
        elif op == "empty":
            tokens[rng.randrange(len(tokens))] = ""
        elif op == "truncate":
            tokens = tokens[:rng.randrange(1, len(tokens))]
        else:
            tokens[rng.randrange(len(tokens))] = "y" * 5000
        types = list(hardening_tiny.TOKENIZER["tokenizer.ggml.token_type"])[:len(tokens)]
        kw["tokenizer"] = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    elif kind == "merges":
        merges = list(hardening_tiny.TOKENIZER["tokenizer.ggml.merges"])
        for _ in range(rng.randrange(1, 5)):
            merges.insert(rng.randrange(len(merges) + 1), rng.choice(["a", "a b c", " ", "zz qq", "Ġ Ġ", ""]))
        kw["tokenizer"] = {"tokenizer.ggml.merges": merges}
    elif kind == "token_types":
        types = [int(t) for t in hardening_tiny.TOKENIZER["tokenizer.ggml.token_type"]]
        for _ in range(rng.randrange(1, 10)):
            types[rng.randrange(len(types))] = rng.choice([0, 2, 3, 4, 5, 6, 99, -1])
        kw["tokenizer"] = {"tokenizer.ggml.token_type": types}
    else:
        kw["extra"] = {"tokenizer.chat_template": "".join(rng.choice(TEMPLATE_PIECES)
                                                          for _ in range(rng.randrange(1, 4)))}
    return kind, kw, spec


def run_case(path, kind, kw, spec):
    from edgellm import load
    from edgellm.errors import EdgeLLMError
    meta_only = {}
    if kind.endswith("_meta_only"):
        meta_only, spec = spec, {}
    try:
        hardening_tiny.write_loadable_tiny_model(path, hardening_tiny.tiny_spec(**spec), **kw)
        for key, value in meta_only.items():
            gguf_key = {"n_layer": "block_count", "n_embd": "embedding_length", "n_ff": "feed_forward_length",
                        "n_head": "attention.head_count", "n_head_kv": "attention.head_count_kv",
                        "context_length": "context_length"}[key]
            hardening_tiny.patch_uint32_key(path, f"llama.{gguf_key}", value)
    except Exception as e:  # noqa: BLE001 - gguf-py could not write this case (e.g. a width its quantizer refuses)
        return "unwritable", type(e).__name__
    try:
        model = load(str(path), n_ctx=64, n_threads=1)
        model.generate("hello world", max_tokens=3, temperature=0)
        model.chat([{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
        return "ok", ""
    except EdgeLLMError as e:
        return "edgellm_error", type(e).__name__
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        return "other", f"{type(e).__name__}: {e} | " + traceback.format_exc(limit=-3).replace("\n", " ")[-400:]


def run(cases: int, seed: int) -> dict:
    rng = random.Random(seed)
    outcomes, kinds, others = collections.Counter(), collections.Counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(cases):
            kind, kw, spec = mutate(rng)
            outcome, detail = run_case(Path(tmp) / f"case{i}.gguf", kind, kw, spec)
            outcomes[outcome] += 1
            kinds[kind.split("_meta")[0]] += 1
            if outcome == "other":
                others.append({"case": i, "kind": kind, "error": detail})
            (Path(tmp) / f"case{i}.gguf").unlink(missing_ok=True)
    return {"cases": cases, "seed": seed, "outcomes": dict(outcomes), "kinds": dict(kinds), "others": others[:20]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    report = run(args.cases, args.seed)
    print(json.dumps(report) if args.json else json.dumps(report, indent=1))
    return 1 if report["others"] else 0


if __name__ == "__main__":
    sys.exit(main())

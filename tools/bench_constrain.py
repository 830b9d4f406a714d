"""What constrained decoding costs: the time token masks add to a decode step, and the time to first token for a
new schema.

Per model (the full mode, with forward passes): the decode step unconstrained and constrained (ms/token over the
same prompt and length, wall and the process's CPU time, which a loaded host disturbs less) and their ratio, the
mask (llguidance's mask, applying it to the logits, the closing path's checks, advancing the matcher:
Timings.mask_s) per constrained token and its share of the unconstrained step; for a new schema the llguidance
tokenizer build (once per model), the schema's compile and check, the matcher and the first mask, and the time
to first token of a call with a schema never seen before against the same call unconstrained (the prompt cached
in both). Constrained and unconstrained runs alternate, so a loaded host slows both alike. With --tokens under
128 the closing path is measured from the first token (its most expensive case). Results go to stdout as
markdown, and to --json.

    nice -n 10 python tools/bench_constrain.py smollm2-135m gemma-3-270m --schemas 8 --tokens 48
    nice -n 10 python tools/bench_constrain.py --masks-only --schemas 55 --tokens 160   # no forward passes
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import edgellm
from edgellm.generation import constrain
from edgellm.generation.constrain import ConstraintSpec, SequenceConstraint, llg_tokenizer

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "json_schemas" / "schemas.json"


def _median_ms(values) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def time_to_first_mask(m, schema, clock=time.perf_counter) -> dict:
    """Seconds for a schema never seen before: compile and check it, build its matcher, compute the first mask."""
    t0 = clock()
    spec = ConstraintSpec.json_schema(schema)
    t1 = clock()
    seq = SequenceConstraint(spec, m.tokenizer, m.n_vocab)
    t2 = clock()
    seq.mask(np.zeros(m.n_vocab, dtype=np.float32))
    t3 = clock()
    return {"compile_s": t1 - t0, "matcher_s": t2 - t1, "first_mask_s": t3 - t2}


def time_to_first_token(m, prompt, schema) -> tuple[float, float]:
    """Seconds to the first token of a call with this (new) schema, and of the same call unconstrained."""
    t0 = time.perf_counter()
    m.complete(prompt, 1, json_schema=schema)
    t1 = time.perf_counter()
    m.complete(prompt, 1)
    return t1 - t0, time.perf_counter() - t1


def bench_model(name: str, schemas: list, n_tokens: int, rounds: int) -> dict:
    m = edgellm.load(name, n_ctx=1024)
    constrain._LLG_TOKENIZERS.pop(m.tokenizer, None)  # a cold build, as the first constrained call of a process
    t0 = time.perf_counter()
    llg_tokenizer(m.tokenizer)
    tokenizer_s = time.perf_counter() - t0
    prompts = [m.chat_prompt_ids([{"role": "user", "content": f"Give me {e['subject']} as JSON."}])
               for e in schemas]
    m.complete(prompts[0], 4, json_schema=schemas[0]["schema"])  # compiles kernels, warms caches
    free_steps, masked_steps, free_cpu, masked_cpu, mask_per_token, mask_share = [], [], [], [], [], []
    tokens = 0
    for _ in range(rounds):
        for e, prompt in zip(schemas, prompts):
            c0 = time.process_time()
            done = m.complete(prompt, n_tokens, json_schema=e["schema"])
            c1 = time.process_time()
            t = m.timings
            n = t.generated_tokens
            if n < 2:
                continue
            masked_step = t.generate_s / n
            mask = t.mask_s / n
            # the same prompt and number of tokens, unconstrained (eos ignored so it runs as long)
            m.complete(prompt, n, ignore_eos=True)
            c2 = time.process_time()
            free = m.timings.generate_s / m.timings.generated_tokens
            free_steps.append(free)
            masked_steps.append(masked_step)
            masked_cpu.append((c1 - c0) / n)  # (the cached prompt's prefill is the same in both)
            free_cpu.append((c2 - c1) / n)
            mask_per_token.append(mask)
            mask_share.append(mask / free)
            tokens += len(done.tokens)
    ttft = [time_to_first_mask(m, e["schema"]) for e in schemas]
    fresh = [dict(e["schema"], title=f"fresh {i}") for i, e in enumerate(schemas)]  # never compiled before
    first = [time_to_first_token(m, prompt, schema) for schema, prompt in zip(fresh, prompts)]
    ratio = [c / f for c, f in zip(masked_steps, free_steps)]
    ratio_cpu = [c / f for c, f in zip(masked_cpu, free_cpu)]
    return {
        "model": name, "n_vocab": m.n_vocab, "runs": len(free_steps), "constrained_tokens": tokens,
        "step_ms": _median_ms(free_steps), "constrained_step_ms": _median_ms(masked_steps),
        "step_ratio_median": statistics.median(ratio),
        "step_cpu_ms": _median_ms(free_cpu), "constrained_step_cpu_ms": _median_ms(masked_cpu),
        "step_cpu_ratio_median": statistics.median(ratio_cpu),
        "mask_ms_per_token": _median_ms(mask_per_token),
        "mask_share_median": statistics.median(mask_share), "mask_share_max": max(mask_share),
        "ttft_new_schema_ms": _median_ms([c for c, _ in first]), "ttft_free_ms": _median_ms([f for _, f in first]),
        "tokenizer_build_s": tokenizer_s,
        "schema_compile_ms": _median_ms([r["compile_s"] for r in ttft]),
        "matcher_ms": _median_ms([r["matcher_s"] for r in ttft]),
        "first_mask_ms": _median_ms([r["first_mask_s"] for r in ttft]),
    }


def bench_masks_only(name: str, schemas: list, n_tokens: int) -> dict:
    """The mask's cost alone, without forward passes, in CPU time: each schema's matcher driven along the reply
    of a model that repeats itself (scores favouring '1', 'a', '}'), through the same mask/vet/advance calls as
    decoding, with the budget n_tokens: the worst case for the closing path, whose checks are counted too. The
    argmax standing in for the sampler is counted with them."""
    m = edgellm.load(name, n_ctx=256)
    constrain._LLG_TOKENIZERS.pop(m.tokenizer, None)
    t0 = time.process_time()
    llg_tokenizer(m.tokenizer)
    tokenizer_s = time.process_time() - t0
    t0 = time.process_time()
    constrain.closing_priority(m.tokenizer)
    priority_s = time.process_time() - t0
    scores = np.zeros(m.n_vocab, dtype=np.float32)
    scores[[m.tokenize(t)[0] for t in ("1", "a", "}")]] = [5, 4, 3]
    per_token, tokens = [], 0
    for e in schemas:
        seq = SequenceConstraint(ConstraintSpec.json_schema(e["schema"]), m.tokenizer, m.n_vocab)
        n, spent = 0, 0.0
        for i in range(n_tokens):
            t0 = time.thread_time()  # CPU time of this thread: a loaded host's waits left out
            token = seq.vet(int(np.argmax(seq.mask(scores, n_tokens - i))), n_tokens - i)
            spent += time.thread_time() - t0
            if m.tokenizer.is_eog(token):
                break
            t0 = time.thread_time()
            seq.advance(token)
            spent += time.thread_time() - t0
            n += 1
            if seq.complete:
                break
        per_token.append(spent / max(n, 1))
        tokens += n
    ttft = [time_to_first_mask(m, e["schema"], time.process_time) for e in schemas]
    return {"model": name, "n_vocab": m.n_vocab, "schemas": len(schemas), "tokens": tokens,
            "mask_ms_per_token_median": _median_ms(per_token), "mask_ms_per_token_max": max(per_token) * 1e3,
            "tokenizer_build_s": tokenizer_s, "closing_priority_s": priority_s,
            "schema_compile_ms": _median_ms([r["compile_s"] for r in ttft]),
            "matcher_ms": _median_ms([r["matcher_s"] for r in ttft]),
            "first_mask_ms": _median_ms([r["first_mask_s"] for r in ttft])}


def to_markdown(rows: list) -> str:
    if rows and "step_ms" not in rows[0]:
        lines = ["| model | vocab | schemas | tokens | mask ms/token (median, max over schemas) | tokenizer build s | "
                 "closing priorities s | schema compile ms | matcher ms | first mask ms |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            lines.append(f"| {r['model']} | {r['n_vocab']} | {r['schemas']} | {r['tokens']} | "
                         f"{r['mask_ms_per_token_median']:.3f}, {r['mask_ms_per_token_max']:.3f} | "
                         f"{r['tokenizer_build_s']:.2f} | {r['closing_priority_s']:.2f} | "
                         f"{r['schema_compile_ms']:.1f} | {r['matcher_ms']:.2f} | {r['first_mask_ms']:.2f} |")
        return "\n".join(lines)
    lines = ["| model | vocab | step ms, wall (free, constrained, ratio) | step ms, CPU (free, constrained, ratio) | "
             "mask ms/token | mask share (median, max) | first token ms (new schema, free) | tokenizer build s | "
             "schema compile ms | matcher ms | first mask ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['n_vocab']} | {r['step_ms']:.2f}, {r['constrained_step_ms']:.2f}, "
                     f"{r['step_ratio_median']:.3f} | {r['step_cpu_ms']:.2f}, {r['constrained_step_cpu_ms']:.2f}, "
                     f"{r['step_cpu_ratio_median']:.3f} | {r['mask_ms_per_token']:.3f} | "
                     f"{100 * r['mask_share_median']:.1f}%, {100 * r['mask_share_max']:.1f}% | "
                     f"{r['ttft_new_schema_ms']:.1f}, {r['ttft_free_ms']:.1f} | {r['tokenizer_build_s']:.2f} | "
                     f"{r['schema_compile_ms']:.1f} | {r['matcher_ms']:.2f} | {r['first_mask_ms']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["smollm2-135m", "gemma-3-270m"])
    ap.add_argument("--schemas", type=int, default=8, help="how many fixture schemas (spread over the set)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per constrained run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--masks-only", action="store_true",
                    help="time the masks alone along a self-repeating reply, without forward passes")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    every = json.loads(SCHEMAS.read_text())["schemas"]
    picked = every[::max(1, len(every) // args.schemas)][:args.schemas]
    if args.masks_only:
        rows = [bench_masks_only(name, picked, args.tokens) for name in args.models]
    else:
        rows = [bench_model(name, picked, args.tokens, args.rounds) for name in args.models]
    print(to_markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

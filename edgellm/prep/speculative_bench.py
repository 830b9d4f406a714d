"""Speculative decoding's benchmark: a task set of three kinds (input-grounded, open-ended, chat), and one
measurement that decodes a task greedily with and without speculation, alternating, and reports tokens/s, the
speed-up, the acceptance rate and whether the outputs are identical. `edgellm bench --lookup` / `--draft-model`
run it in one process; tools/speculative_bench.py runs each measurement in a fresh process. For prompt lookup it
also reports a bound: the speed-up of draft lengths chosen knowing the output, at the forward costs measured in the
same process, which no chooser can beat (foresight_bound).
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from edgellm.generation.speculative import DRAFT_MAX, PromptLookup

CODE = '''import json


def load_config(path):
    with open(path) as f:
        config = json.load(f)
    if "name" not in config:
        raise ValueError("config has no name")
    return config


def save_config(config, path):
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged
'''

PASSAGE = ("The Rhine is a river that begins in the Swiss Alps and flows north through Switzerland, along the "
           "border of France and Germany, and through the Netherlands into the North Sea. It is about 1,230 "
           "kilometres long. The river has been an important trade route since Roman times, and many castles "
           "stand on its banks in the Middle Rhine valley. Basel, Strasbourg, Cologne and Rotterdam are among "
           "the cities on the river. Rotterdam, at the mouth of the Rhine, has the largest port in Europe.")

# kind -> [(name, chat messages)]
TASKS = {
    "input-grounded": [
        ("code-edit", [{"role": "user", "content": "Rewrite this code with one change: rename the function "
                        "load_config to read_config. Output the whole code.\n\n```python\n" + CODE.rstrip()
                        + "\n```"}]),  # fenced, as code is pasted (Gemma-3 270M answers a bare one with nothing)
        ("extract", [{"role": "user", "content": PASSAGE + "\n\nCopy the sentences of this passage that "
                      "name a city, word for word."}]),
        ("answer-from-context", [{"role": "user", "content": "Context: " + PASSAGE + "\n\nUsing the context, "
                                  "answer: where does the Rhine begin, how long is it, and which port is at "
                                  "its mouth?"}]),
    ],
    "open-ended": [
        ("story", [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a "
                    "message in a bottle."}]),
    ],
    "chat": [
        ("chat", [{"role": "user", "content": "Hi! I'm planning a trip to Lisbon."},
                  {"role": "assistant", "content": "Lovely! Lisbon is great in spring. What would you like to "
                   "know?"},
                  {"role": "user", "content": "What should I see in two days?"}]),
    ],
}


def measure(model, ids, mode: str | None, n_gen: int) -> dict:
    """Decode greedily from an empty cache: tokens, generation t/s (decode steps only), drafted and accepted."""
    model.reset()
    t0 = time.perf_counter()
    c = model.complete(ids, max_tokens=n_gen, speculative=mode)
    wall = time.perf_counter() - t0
    t = model.timings
    return {"tokens": c.tokens, "n": len(c.tokens), "tps": t.generate_tps, "wall_s": wall,
            "drafted": c.draft_tokens, "accepted": c.accepted_tokens}


def compare(model, ids, mode: str, n_gen: int, repeats: int = 2) -> dict:
    """Plain and speculative runs, alternating (so that load from other processes hits both alike)."""
    plain, spec = [], []
    for _ in range(repeats):
        plain.append(measure(model, ids, None, n_gen))
        spec.append(measure(model, ids, mode, n_gen))
    return summarise(plain, spec)


def summarise(plain: list, spec: list) -> dict:
    p_tps = statistics.median(r["tps"] for r in plain)
    s_tps = statistics.median(r["tps"] for r in spec)
    drafted = sum(r["drafted"] for r in spec)
    return {"n_gen": plain[0]["n"], "tokens": plain[0]["tokens"], "plain_tps": p_tps, "spec_tps": s_tps,
            "speedup": s_tps / p_tps if p_tps else 0.0,
            "acceptance": sum(r["accepted"] for r in spec) / drafted if drafted else 0.0,
            "drafted": drafted // len(spec),
            "identical": all(r["tokens"] == plain[0]["tokens"] for r in plain + spec)}


def forward_costs(model, ids, rows_max: int, repeats: int = 5) -> dict:
    """{rows: seconds} of the target's forwards after the prompt ids (their last tokens where the prompt and the rows
    would not fit the context): a plain step (1 row) and verifications of 2 to rows_max rows, each the median of
    `repeats`; the Model's cache is emptied afterwards. None where rows_max rows do not fit a batch or the context."""
    fm = model.model
    if rows_max > fm.n_batch or rows_max >= fm.cache.n_ctx:
        return None
    ids = list(ids)[-(fm.cache.n_ctx - rows_max):]
    model.reset()
    fm.forward(np.asarray(ids, np.int32))
    start, fed = fm.cache.n_past, np.asarray((ids * rows_max)[:rows_max], np.int32)
    costs = {}
    try:
        for rows in range(1, rows_max + 1):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fm.forward(fed[:1]) if rows == 1 else fm.forward_verify(fed[:rows])
                times.append(time.perf_counter() - t0)
                fm.truncate(start)
            costs[rows] = statistics.median(times)
    finally:
        model.reset()
    return costs


def foresight_bound(ids, tokens, costs: dict, k_max: int) -> float:
    """The speed-up over plain decoding of `tokens` (a greedy output after the prompt ids) with prompt lookup's finds
    drafted to the best length chosen knowing the output: at each step the find after the history (up to k_max
    tokens) is drafted k = 0 (a plain step) to all of it, costed by costs[k + 1] (forward_costs), gaining its
    accepted tokens and the target's next; the cheapest plan over the whole output, by dynamic programming. The
    first token comes from the prompt's forward in both and is not counted."""
    history, n = list(ids) + list(tokens), len(tokens)
    if n < 2:
        return 1.0
    lookup, found = PromptLookup(), []
    for i in range(1, n):  # token i is next: the history ends with token i - 1, not yet in the cache
        end = len(ids) + i
        draft = lookup.find(history[:end], k_max)[0]
        accepted = 0
        while accepted < len(draft) and i + accepted < n and draft[accepted] == tokens[i + accepted]:
            accepted += 1
        found.append((len(draft), accepted))
    plain, best = costs[1], [0.0] * (n + 1)
    for i in range(n - 1, 0, -1):
        length, accepted = found[i - 1]
        best[i] = min([plain + best[i + 1]] + [costs[k + 1] + best[min(n, i + min(k, accepted) + 1)]
                                                for k in range(1, length + 1)])
    return (n - 1) * plain / best[1]


def to_markdown(rows) -> str:
    bound = any("bound" in r for r in rows)
    lines = ["| task | kind | tokens | plain t/s | speculative t/s | speed-up | acceptance | identical |"
             + (" bound |" if bound else ""),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |" + (" ---: |" if bound else "")]
    for r in rows:
        lines.append(f"| {r['task']} | {r['kind']} | {r['n_gen']} | {r['plain_tps']:.1f} | {r['spec_tps']:.1f} | "
                     f"{r['speedup']:.2f}x | {100 * r['acceptance']:.0f}% | {'yes' if r['identical'] else 'NO'} |"
                     + (f" {r['bound']:.2f}x |" if "bound" in r else (" - |" if bound else "")))
    if bound:
        lines.append("\nbound: the speed-up of draft lengths chosen knowing the output, at this run's forward costs")
    return "\n".join(lines)


def bench(model, mode: str, n_gen: int = 128, repeats: int = 2, kinds=None, log=None) -> list:
    """compare() on every task of TASKS (or of the given kinds) with a loaded Model; for prompt lookup each row's
    foresight_bound too, at forward costs measured once after the first task's prompt."""
    rows, costs = [], None
    for kind, tasks in TASKS.items():
        if kinds and kind not in kinds:
            continue
        for name, messages in tasks:
            if log:
                log(f"{name} ...")
            ids = model.chat_prompt_ids(messages)
            r = compare(model, ids, mode, n_gen, repeats)
            if mode == "lookup":
                if costs is None:
                    costs = forward_costs(model, ids, DRAFT_MAX["lookup"] + 1)
                if costs is not None:
                    r["bound"] = foresight_bound(ids, r["tokens"], costs, DRAFT_MAX["lookup"])
            rows.append({"task": name, "kind": kind, **r})
    return rows

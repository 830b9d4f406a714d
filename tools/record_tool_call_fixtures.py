"""Record tool-call fixtures from the real models: a few chat requests with `tools` (tool_choice "required", a named
function, "auto", and a tool result sent back), greedy, through create_chat_completion, with the rendered prompt's
token ids (as a SHA-256 and a count), the raw generated text and the reply's content, tool_calls and
finish_reason. tests/test_tool_call_fixtures.py replays each request and must get exactly the same, so a change
anywhere on the path (the chat template's rendering of tools, the format detection, the call's constraint, the
parser) shows up as a diff to review. After a deliberate change, record again and say why in the commit.

    python tools/record_tool_call_fixtures.py            # writes tests/fixtures/tool_calls_recorded.json
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "tool_calls_recorded.json"
MODELS = ("smollm2-135m", "gemma-3-270m")
N_CTX = 1024

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                         "parameters": {"type": "object",
                                                        "properties": {"tz": {"type": "string", "maxLength": 30}},
                                                        "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
REQUESTS = [
    {"name": "required", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 60},
    {"name": "named", "messages": [{"role": "user", "content": "What time is it in Tokyo?"}],
     "tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
     "max_tokens": 40},
    {"name": "auto", "messages": ASK, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 40},
    {"name": "tool_result", "messages": ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}],
     "tools": [WEATHER], "tool_choice": "none", "max_tokens": 12},
]


def request_kwargs(req: dict) -> dict:
    return {k: copy.deepcopy(v) for k, v in req.items() if k != "name"}


def replay(model, req: dict) -> dict:
    """One request, greedy: what a fixture records of it."""
    from edgellm.compat.tool_calls import ChatPlan
    kw = request_kwargs(req)
    ids = ChatPlan(model, kw["messages"], tools=kw["tools"], tool_choice=kw["tool_choice"]).ids
    r = model.create_chat_completion(temperature=0, **kw)
    choice = r["choices"][0]
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in choice["message"].get("tool_calls") or []]
    return {"prompt_tokens": len(ids), "prompt_sha256": hashlib.sha256(json.dumps(list(map(int, ids))).encode())
            .hexdigest(), "raw_text": model.last_completion.text, "content": choice["message"].get("content"),
            "tool_calls": calls, "finish_reason": choice["finish_reason"],
            "completion_tokens": r["usage"]["completion_tokens"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    import edgellm
    fixtures = {"n_ctx": N_CTX, "requests": REQUESTS, "models": {}}
    for name in MODELS:
        model = edgellm.load(name, n_ctx=N_CTX)
        fixtures["models"][name] = {"file": model.name,
                                    "results": {}}
        for req in REQUESTS:
            got = replay(model, req)
            fixtures["models"][name]["results"][req["name"]] = got
            print(f"{name} {req['name']}: {got['finish_reason']} {got['tool_calls'] or got['content']!r}",
                  file=sys.stderr)
    Path(args.out).write_text(json.dumps(fixtures, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

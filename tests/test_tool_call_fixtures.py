"""Tool calls recorded from the real models (tools/record_tool_call_fixtures.py): each chat request with `tools`
(tool_choice "required", a named function, "auto", a tool result sent back), replayed greedily on SmolLM2 and
Gemma-3, renders the same prompt tokens and gives the same raw text, content, tool_calls and finish_reason. A
change in the template's rendering of tools, the format detection, the call's constraint or the parser fails
here; record again after a deliberate change."""
import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import edgellm  # noqa: E402
from record_tool_call_fixtures import replay  # noqa: E402

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "tool_calls_recorded.json").read_text())


@pytest.fixture(scope="module", params=sorted(FIXTURES["models"]))
def recorded(request, smollm2_path, gemma_path):
    name = request.param
    path = {"smollm2-135m": smollm2_path, "gemma-3-270m": gemma_path}[name]
    return edgellm.load(path, n_ctx=FIXTURES["n_ctx"]), FIXTURES["models"][name]["results"]


def test_recorded_tool_calls_replay_exactly(recorded):
    model, results = recorded
    for req in FIXTURES["requests"]:
        expected = results[req["name"]]
        got = replay(model, req)
        assert got == expected, req["name"]
    # the fixtures hold real calls, parsed: not only text
    assert results["required"]["tool_calls"] and results["named"]["tool_calls"][0]["name"] == "get_time"
    assert results["required"]["finish_reason"] == "tool_calls"
    for name in ("required", "named"):
        for call in results[name]["tool_calls"]:
            json.loads(call["arguments"])
    assert len(results["required"]["prompt_sha256"]) == len(hashlib.sha256().hexdigest())

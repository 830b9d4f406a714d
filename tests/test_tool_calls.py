"""Tool calling: each native format's parser on a reply written the way those models write calls, tools and
tool_choice checking, the template receiving tools, and real SmolLM2 calls (generic JSON form, and the Hermes
form through a Hermes-style template) constrained by the function's parameter schema."""
import json

import pytest

jsonschema = pytest.importorskip("jsonschema")

import edgellm  # noqa: E402
from edgellm.compat.chat import JinjaChatTemplate  # noqa: E402
from edgellm.compat.tool_calls import (ChatPlan, ToolError, check_tools, detect_format, parse_tool_calls,  # noqa: E402
                                       split_reasoning)
from edgellm.compat.tool_stream import ToolCallStream  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"]}}}
QUESTION = [{"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]}]

# Replies in each model family's native syntax, as their chat templates document it
RECORDED = {
    "hermes": ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
               "I will check."),
    "llama3": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', None),
    "generic": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]}', None),
}


@pytest.mark.parametrize("fmt", sorted(RECORDED))
def test_native_formats_parse_into_tool_calls(fmt):
    text, content = RECORDED[fmt]
    got_content, calls = parse_tool_calls(fmt, text)
    assert got_content == content
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {"tz": "Europe/Paris"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)


def test_plain_replies_and_other_shapes():
    assert parse_tool_calls("hermes", "Just text.") == ("Just text.", [])
    assert parse_tool_calls("generic", '{"response": "It is sunny."}') == ("It is sunny.", [])
    _, calls = parse_tool_calls("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')
    assert calls[0]["function"]["name"] == "get_weather" and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Oslo"}
    # cut off by max_tokens: the calls written whole are kept
    _, calls = parse_tool_calls("generic", RECORDED["generic"][0][:-30])
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def _assembled(deltas):
    """What a client rebuilds from streamed deltas: content, reasoning, and per call index its name, arguments and
    the number of deltas that carried it."""
    out = {"content": "", "reasoning": "", "calls": {}}
    for d in deltas:
        out["content"] += d.get("content", "")
        out["reasoning"] += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            call = out["calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": "", "deltas": 0})
            if "id" in tc:  # the call's first delta: id, type and name, arguments still empty
                assert call["id"] is None and tc["type"] == "function" and tc["function"]["arguments"] == ""
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            else:
                assert call["id"] is not None and set(tc["function"]) == {"arguments"}
            call["arguments"] += tc["function"]["arguments"]
            call["deltas"] += 1
    return out


def _streamed(fmt, text, parallel=True):
    """Deltas of text fed a character at a time (a token can be as short), then the complete parse."""
    stream = ToolCallStream(fmt, parallel)
    deltas = [d for i in range(1, len(text) + 1) for d in stream.update(text[:i])]
    content, calls = parse_tool_calls(fmt, text)
    message = {"role": "assistant", "content": content, **({"tool_calls": calls[:None if parallel else 1]}
                                                           if calls else {})}
    return deltas, deltas + stream.finish(message)


@pytest.mark.parametrize("fmt", sorted(RECORDED))
def test_streamed_calls_come_as_openai_deltas(fmt):
    text, content = RECORDED[fmt]
    during, deltas = _streamed(fmt, text)
    got = _assembled(deltas)
    assert got["content"] == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    # sent while the reply was written, not at its end: the name first, then the arguments in several pieces
    assert _assembled(during)["calls"] == got["calls"]
    assert all(c["deltas"] > 2 for c in got["calls"].values())
    assert _assembled(_streamed(fmt, text, parallel=False)[1])["calls"].keys() == {0}


def test_streamed_content_reasoning_and_late_names():
    got = _assembled(_streamed("hermes", "  Just text, with <b>tags</b> and  spaces. ")[1])
    assert got == {"content": "Just text, with <b>tags</b> and  spaces.", "reasoning": "", "calls": {}}
    got = _assembled(_streamed("generic", '{"response": "Say \\"hi\\" \\u00e9"}')[1])
    assert got["content"] == 'Say "hi" \u00e9' and not got["calls"]
    stream = ToolCallStream("hermes", opens_thinking=False)
    text = '<think>look it up</think>\n<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'
    got = _assembled([d for i in range(1, len(text) + 1) for d in stream.update(text[:i])])
    assert got["reasoning"] == "look it up" and got["calls"][0]["name"] == "f"
    assert json.loads(got["calls"][0]["arguments"]) == {"a": [1, 2]}
    # arguments before the name: the call is announced once its name is written, with the arguments whole
    during, deltas = _streamed("generic", '{"tool_calls": [{"arguments": {"city": "Oslo"}, "name": "get_weather"}]}')
    call = _assembled(during)["calls"][0]
    assert call["deltas"] == 2 and json.loads(call["arguments"]) == {"city": "Oslo"}
    assert _assembled(deltas)["calls"] == _assembled(during)["calls"]


def test_format_detection():
    assert detect_format("{% for t in tools %}<tool_call>{% endfor %}", lambda t: False) == "hermes"
    assert detect_format("{{ tools }}<|start_header_id|>", lambda t: False) == "llama3"
    assert detect_format("{{ tools }}[TOOL_CALLS]", lambda t: False) == "mistral"
    assert detect_format("{{ messages }}", lambda t: False) == "generic"


@pytest.mark.parametrize("tools, choice, match", [
    ("get_weather", None, "tools must be a list"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "name must be"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}], None,
     "tools\\[0\\].function.parameters cannot be enforced.*uniqueItems"),
    (None, "required", "needs tools"),
])
def test_bad_tools_are_refused(tools, choice, match):
    with pytest.raises(ToolError, match=match):
        check_tools(tools, choice)


def test_reasoning_split():
    assert split_reasoning("<think>plan it</think>\nThe answer.") == ("plan it", "The answer.")
    assert split_reasoning("plan it</think>The answer.", prompt_opened=True) == ("plan it", "The answer.")
    assert split_reasoning("No thinking.") == (None, "No thinking.")


# -- real SmolLM2 ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_path):
    return edgellm.load(smollm2_path, n_ctx=1024)


def _args(call):
    return json.loads(call["function"]["arguments"])


def test_required_and_named_calls_follow_the_schema(smol):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = smol.create_chat_completion(QUESTION, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60,
                                        temperature=0)
        choice_ = r["choices"][0]
        assert choice_["finish_reason"] == "tool_calls"
        calls = choice_["message"]["tool_calls"]
        assert calls and choice_["message"]["content"] is None
        for call in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
            jsonschema.validate(_args(call), tool["function"]["parameters"])
        if isinstance(choice, dict):
            assert {c["function"]["name"] for c in calls} == {"get_time"}


def test_parallel_tool_calls_false_gives_one_call(smol):
    r = smol.create_chat_completion(QUESTION, tools=[WEATHER, TIME], tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert len(r["choices"][0]["message"]["tool_calls"]) == 1


def test_tool_results_go_back_through_the_template(smol):
    r = smol.create_chat_completion(QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    message = r["choices"][0]["message"]
    call = message["tool_calls"][0]
    history = QUESTION + [message, {"role": "tool", "tool_call_id": call["id"], "content": "18 C and sunny"}]
    plan_prompt = smol.detokenize(ChatPlan(smol, history, tools=[WEATHER]).ids, special=True)
    assert "18 C and sunny" in plan_prompt and '"get_weather"' in plan_prompt
    r = smol.create_chat_completion(history, tools=[WEATHER], tool_choice="none", max_tokens=20, temperature=0)
    assert isinstance(r["choices"][0]["message"]["content"], str)


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions. Signatures: <tools>{{ tools | tojson }}</tools>\n"
    "Reply with <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_hermes_template_receives_tools_and_the_call_is_constrained(smollm2_path):
    m = edgellm.load(smollm2_path, n_ctx=1024)
    m._chat_format = JinjaChatTemplate(HERMES_TEMPLATE)
    plan = ChatPlan(m, QUESTION, tools=[WEATHER], tool_choice="required")
    assert plan.format == "hermes" and '"get_weather"' in m.detokenize(plan.ids, special=True)
    r = m.create_chat_completion(QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    calls = r["choices"][0]["message"]["tool_calls"]
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(_args(calls[0]), WEATHER["function"]["parameters"])

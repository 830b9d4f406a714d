"""The official openai client against the real server with SmolLM2: response_format json_schema, tools with
tool_choice "required", a streamed tool call, and a bad schema refused with an OpenAI-shaped 400."""
import json

import pytest

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

import edgellm  # noqa: E402
from edgellm.server import BackgroundServer, create_app  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_path):
    m = edgellm.load(smollm2_path, n_ctx=1024)
    with BackgroundServer(create_app(m, model_name="smollm2")) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A person as JSON."}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": schema, "strict": True}},
                                       max_tokens=60, temperature=0)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"


def test_tools_required(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required",
                                       max_tokens=60, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_streamed_tool_call(client):
    chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER],
                                                 tool_choice="required", max_tokens=60, temperature=0, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    # as OpenAI streams a call: id, type and name first, then the arguments' text in pieces as it is written
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    rest = [d for d in deltas[1:] if d.index == 0]  # (a second call, if any, has its own index and header)
    fragments = [d.function.arguments for d in rest]
    assert len(fragments) > 1 and all(d.id is None and d.function.name is None for d in rest)
    assert json.loads("".join(fragments))["city"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_bad_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    assert "response_format.json_schema.schema" in str(e.value)

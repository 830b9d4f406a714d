"""OpenAI-style tool calling on chat: tools into the model's own template, the model's native call syntax parsed
back into `tool_calls`, and "required" / a named function enforced with the parameters' JSON Schema.

Sections: checking `tools` / `tool_choice`; the native formats (Hermes/Qwen `<tool_call>` JSON, Llama 3.x JSON,
Mistral `[TOOL_CALLS]`, and a generic JSON form for templates with no tool syntax), each with the grammar that
forces a call and the parser of a recorded output; preparing messages for the template (text parts joined,
tool results and earlier calls written for templates that cannot render them); `split_reasoning` for <think>.

A template that mentions `tools` renders them itself, as transformers and llama.cpp pass them. Otherwise the
generic form applies: the tools are described in a system message and the reply is constrained to JSON,
{"tool_calls": [...]} or {"response": "..."}, which is what small models without tool training can follow.
"""
from __future__ import annotations

import json
import re
import uuid

from edgellm.generation.constrain import JSON_OPTIONS, ConstraintSpec, bounded_or_given, closed_objects
from edgellm.errors import GrammarError

FORMATS = ("hermes", "llama3", "mistral", "generic")


class ToolError(GrammarError):
    """tools or tool_choice is malformed, or names a function that is not among the tools."""


# ---------------------------------------------------------------------------------------------------------------
# tools and tool_choice
# ---------------------------------------------------------------------------------------------------------------

def check_tools(tools, tool_choice=None, parallel_tool_calls=None) -> tuple[list, object, bool]:
    """(tools as plain dicts, tool_choice: "auto" | "none" | "required" | a function name, parallel)."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError(f"tool_choice={tool_choice!r} needs tools")
        return [], "none", bool(parallel_tool_calls)
    if not isinstance(tools, (list, tuple)):
        raise ToolError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got "
                        f"{type(tools).__name__}")
    checked, strict_params = [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                            "...}}")
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn["name"]):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.', "
                            f"got {fn.get('name')!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON Schema object")
        try:  # refused now if the engine cannot enforce it
            ConstraintSpec.json_schema(params, f"tools[{i}].function.parameters")
        except GrammarError as e:
            raise ToolError(str(e)) from None
        checked.append({"type": "function", "function": {**fn, "parameters": params}})
        strict_params.append(bounded_or_given(closed_objects(params)))
    names = [t["function"]["name"] for t in checked]
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
        if not isinstance(name, str):
            raise ToolError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                            "'function': {'name': ...}}")
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise ToolError(f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}")
    if choice not in ("auto", "none", "required") and choice not in names:
        raise ToolError(f"tool_choice names the function {choice!r}, which is not among the tools ({', '.join(names)})")
    if not checked:
        choice = "none"
    for tool, params in zip(checked, strict_params):  # what the grammar enforces: no invented arguments
        tool["strict_parameters"] = params
    return checked, choice, True if parallel_tool_calls is None else bool(parallel_tool_calls)


def detect_format(template_source: str | None, vocab_has) -> str:
    """The model's native tool-call syntax, read from its chat template (and vocabulary)."""
    src = template_source or ""
    if "tools" not in src:
        return "generic"
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src or vocab_has("[TOOL_CALLS]"):
        return "mistral"
    if "<|start_header_id|>" in src or "<|python_tag|>" in src:
        return "llama3"
    return "generic"


def _call_schema(tools, choice, args_key="arguments") -> dict:
    """One call: {"name": <a function>, <args_key>: <its parameters>}, restricted to the chosen function."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if choice not in ("auto", "required") and fn["name"] != choice:
            continue
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                         args_key: tool["strict_parameters"]},
                        "required": ["name", args_key], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json(schema: dict) -> str:
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _marker(tokenizer, text: str) -> str:
    """A Lark terminal for a marker: the special token itself when the vocabulary has one, else the text."""
    token_id = tokenizer.vocab.token_to_id.get(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def forced_call_grammar(fmt: str, tools, choice, parallel: bool, tokenizer) -> ConstraintSpec | None:
    """The grammar of the reply: a call (tool_choice "required" or a name), or, in the generic form, JSON that is
    either calls or a response (auto). None: the model is free (auto with a native format)."""
    if choice == "none" or (choice == "auto" and fmt != "generic"):
        return None
    many = "*" if parallel and choice in ("auto", "required") else ""
    if fmt == "generic":
        calls = {"type": "array", "items": _call_schema(tools, choice), "minItems": 1}
        if not many:
            calls["maxItems"] = 1
        forms = [{"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                  "additionalProperties": False}]
        if choice == "auto":
            forms.append({"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                          "additionalProperties": False})
        # the parameters are bounded already; a text answer is as long as max_tokens lets it be
        return ConstraintSpec.json_schema(forms[0] if len(forms) == 1 else {"anyOf": forms}, "tools", bounds={})
    if fmt == "hermes":
        block = f'{_marker(tokenizer, "<tool_call>")} "\\n" call "\\n" {_marker(tokenizer, "</tool_call>")}'
        lark = f'start: block ("\\n" block){many}\nblock: {block}\ncall: %json {_json(_call_schema(tools, choice))}'
    elif fmt == "llama3":
        lark = f'start: call (";" call){many}\ncall: %json {_json(_call_schema(tools, choice, "parameters"))}'
    else:  # mistral: [TOOL_CALLS] then a JSON list of calls
        calls = {"type": "array", "items": _call_schema(tools, choice), "minItems": 1}
        if not many:
            calls["maxItems"] = 1
        lark = f'start: {_marker(tokenizer, "[TOOL_CALLS]")} calls\ncalls: %json {_json(calls)}'
    return ConstraintSpec.lark(lark, "tools", closable=True)


# ---------------------------------------------------------------------------------------------------------------
# Parsing the model's calls
# ---------------------------------------------------------------------------------------------------------------

def _tool_call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {},
                                                                   ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _json_values(text: str):
    """Every JSON value in text, in order, with where it starts and ends (garbage between values is skipped)."""
    decoder = json.JSONDecoder()
    i = 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
                yield value, i, end
                i = end
                continue
            except json.JSONDecodeError:
                pass
        i += 1


def _as_call(obj, args_keys=("arguments", "parameters")):
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        for key in args_keys:
            if key in obj:
                return _tool_call(obj["name"], obj[key])
        return _tool_call(obj["name"], {})
    return None


def parse_hermes(text: str):
    calls, content = [], text
    for block in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL):
        for value, _, _ in _json_values(block.group(1)):
            call = _as_call(value)
            if call:
                calls.append(call)
            break
    if calls:
        content = re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.DOTALL)
    return content.strip() or None, calls


def parse_llama3(text: str):
    body = text.replace("<|python_tag|>", "").strip()
    if not body.startswith("{"):
        return text.strip() or None, []
    calls = [c for c in (_as_call(v) for v, _, _ in _json_values(body)) if c]
    return (None, calls) if calls else (text.strip() or None, [])


def parse_mistral(text: str):
    if "[TOOL_CALLS]" not in text:
        return text.strip() or None, []
    content, _, rest = text.partition("[TOOL_CALLS]")
    calls = []
    if "[ARGS]" in rest:  # the newer form: [TOOL_CALLS]name[ARGS]{...}, repeated
        for part in rest.split("[TOOL_CALLS]"):
            name, _, args = part.partition("[ARGS]")
            value = next(_json_values(args), (None,))[0]
            if name.strip():
                calls.append(_tool_call(name.strip(), value if value is not None else {}))
    else:
        value = next(_json_values(rest), (None,))[0]
        for item in value if isinstance(value, list) else [value]:
            call = _as_call(item)
            if call:
                calls.append(call)
    return content.strip() or None, calls


def parse_generic(text: str):
    stripped = text.strip()
    value = next(_json_values(stripped), (None, 0, 0))
    if isinstance(value[0], dict) and value[1] == 0:
        value = value[0]
        if isinstance(value.get("tool_calls"), list):
            calls = [c for c in (_as_call(v) for v in value["tool_calls"]) if c]
            if calls:
                return None, calls
        if isinstance(value.get("tool_call"), dict):
            call = _as_call(value["tool_call"])
            if call:
                return None, [call]
        if isinstance(value.get("response"), str):
            return value["response"], []
    elif stripped.startswith('{"tool_calls"'):  # cut off by max_tokens: the calls that were written whole
        calls = [c for c in (_as_call(v) for v, _, _ in _json_values(stripped)) if c]
        if calls:
            return None, calls
    return text.strip() or None, []


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral, "generic": parse_generic}


def parse_tool_calls(fmt: str, text: str):
    """(content or None, [OpenAI tool_call dicts]) from a reply in the given native format."""
    return PARSERS[fmt](text)


# ---------------------------------------------------------------------------------------------------------------
# Messages for the template
# ---------------------------------------------------------------------------------------------------------------

def _text_of(content, where: str):
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI's content parts: only text can go into a text model
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ToolError(f"{where}['content'][{j}] is a {kind!r} part; only text parts are supported")
        return "".join(texts)
    return content  # left for the message validation to refuse


def _call_as_plain(call) -> dict:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return {"name": fn.get("name"), "arguments": args}


def prepare_messages(messages, fmt: str, tools, choice) -> list:
    """Messages a template can render: text parts joined; in the generic form, the tools described in a system
    message, earlier calls written as the JSON the model is asked for and tool results as user turns."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        return messages  # the chat validation names the problem
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = dict(m)
        m["content"] = _text_of(m.get("content"), f"messages[{i}]")
        if m.get("tool_calls") and m.get("content") is None:
            m["content"] = ""
        if fmt == "generic":
            if m.get("role") == "assistant" and m.get("tool_calls"):
                m = {"role": "assistant",
                     "content": json.dumps({"tool_calls": [_call_as_plain(c) for c in m["tool_calls"]]})}
            elif m.get("role") == "tool":
                label = m.get("name") or m.get("tool_call_id") or "tool"
                m = {"role": "user", "content": f"Result of {label}: {m.get('content') or ''}"}
        elif m.get("tool_calls"):  # templates read arguments as objects (transformers' convention)
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _call_as_plain(c)["arguments"]}}
                               if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
                               for c in m["tool_calls"]]
        out.append(m)
    if fmt == "generic" and tools and choice != "none":
        described = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        note = ("You can call these functions:\n" + described + "\nReply with JSON only: "
                '{"tool_calls": [{"name": <function>, "arguments": {...}}]} to call functions'
                + (', or {"response": <text>} to answer directly.' if choice == "auto" else "."))
        if out and isinstance(out[0], dict) and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def split_reasoning(text: str, prompt_opened: bool = False):
    """(reasoning or None, content): what a template marks as thinking, <think>...</think>, split out."""
    if prompt_opened and "</think>" in text:  # the prompt ended with <think>: the reply starts inside it
        reasoning, _, rest = text.partition("</think>")
        return reasoning.strip() or None, rest.lstrip()
    match = re.match(r"\s*<think>(.*?)(?:</think>|$)(.*)", text, re.DOTALL)
    if not match:
        return None, text
    return match.group(1).strip() or None, match.group(2).lstrip()


# ---------------------------------------------------------------------------------------------------------------
# One chat request's plan
# ---------------------------------------------------------------------------------------------------------------

class ChatPlan:
    """What a chat request renders and enforces: prompt ids, the tool format (None: no tools), the call grammar."""

    def __init__(self, llm, messages, tools=None, tool_choice=None, parallel_tool_calls=None, functions=None,
                 function_call=None, chat_template_kwargs=None):
        if functions is not None and tools is None:  # OpenAI's older names
            if not isinstance(functions, (list, tuple)):
                raise ToolError("functions must be a list of function definitions")
            tools = [{"type": "function", "function": f} for f in functions]
            if isinstance(function_call, dict):
                tool_choice = {"type": "function", "function": function_call}
            elif function_call is not None:
                tool_choice = function_call
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ToolError("chat_template_kwargs must be an object of template variables")
        self.tools, self.choice, self.parallel = check_tools(tools, tool_choice, parallel_tool_calls)
        self.public_tools = [{k: v for k, v in t.items() if k != "strict_parameters"} for t in self.tools]
        fmt_obj = llm.chat_format()
        source = getattr(fmt_obj, "source", None)
        # earlier calls and tool results are written in the template's form even where no call is asked for now
        # (tool_choice "none", or no tools): a template with no tool syntax must not see a bare "tool" role
        history = isinstance(messages, (list, tuple)) and any(
            isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages)
        rendered = detect_format(source, lambda t: llm.tokenizer.vocab.token_to_id.get(t) is not None) \
            if self.tools or history else None
        self.format = rendered if self.tools and self.choice != "none" else None  # what is parsed and enforced
        self.messages = prepare_messages(messages, rendered or "native", self.tools, self.choice)
        variables = dict(chat_template_kwargs or {})
        if self.format not in (None, "generic"):
            variables["tools"] = self.public_tools
        self.ids = llm.chat_prompt_ids(self.messages, **variables)
        self.grammar = (forced_call_grammar(self.format, self.tools, self.choice, self.parallel, llm.tokenizer)
                        if self.format else None)
        # a template that opens the reply with <think> (e.g. Qwen3 with enable_thinking): the reply starts inside
        self.opens_thinking = llm.detokenize(self.ids[-8:], special=True).rstrip().endswith("<think>")

    def reply(self, llm, completion) -> tuple[dict, str]:
        """(the assistant message, finish_reason) of a finished completion."""
        text = completion.text
        message = {"role": "assistant", "content": text}
        finish = completion.finish_reason
        if self.format:
            raw = llm.detokenize(completion.tokens, special=True) if self.format != "generic" else text
            content, calls = parse_tool_calls(self.format, raw)
            if calls:
                if not self.parallel:
                    calls = calls[:1]
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls"
            else:
                message["content"] = content if self.format == "generic" else text
        if isinstance(message["content"], str) and ("<think>" in message["content"] or self.opens_thinking):
            reasoning, content = split_reasoning(message["content"], self.opens_thinking)
            if reasoning is not None:
                message["reasoning_content"] = reasoning
                message["content"] = content
        return message, finish

"""Streamed tool calls as OpenAI's API sends them: each call's id, type and function name in a first delta, then
its arguments' JSON text in fragments as the model writes it, and the text outside calls as content deltas.

Sections: `scan_object`, a partial-JSON scan of one object (where each top-level field's value starts and ends so
far); `scan_reply`, what a reply in a native format holds so far (reasoning, content, calls, each only as far as
later text cannot change it); `ToolCallStream`, which turns successive scans into deltas and, at the end, sends
whatever the complete parse found that the scan could not (e.g. a call whose arguments came before its name).

Arguments are streamed as the model's own JSON text, which under the call grammar is json.dumps' form.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]", None)}
ARGUMENT_KEYS = ("arguments", "parameters")


# ---------------------------------------------------------------------------------------------------------------
# Partial JSON
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class PartialObject:
    end: int | None = None  # index after the closing brace; None while the object is open
    fields: dict = field(default_factory=dict)  # top-level key -> [value start, value end or None]


def scan_object(text: str, start: int) -> PartialObject:
    """The JSON object opening at text[start] ('{'), as far as text goes."""
    obj = PartialObject()
    depth, in_string, escaped = 0, False, False
    key_start = key = None
    expecting = "key"  # at depth 1: "key", "colon", "value" or "comma"
    i = start
    while i < len(text):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1 and expecting == "key_string":
                    key = json.loads(text[key_start:i + 1])
                    expecting = "colon"
            i += 1
            continue
        if depth == 1 and expecting == "value" and not c.isspace():
            obj.fields[key] = [i, None]
            expecting = "in_value"
        if c == '"':
            in_string = True
            if depth == 1 and expecting == "key":
                key_start, expecting = i, "key_string"
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                if expecting == "in_value":
                    obj.fields[key][1] = len(text[:i].rstrip())
                obj.end = i + 1
                return obj
        elif depth == 1 and c == ":" and expecting == "colon":
            expecting = "value"
        elif depth == 1 and c == ",":
            if expecting == "in_value":
                obj.fields[key][1] = len(text[:i].rstrip())
            expecting = "key"
        i += 1
    return obj


@dataclass
class PartialCall:
    name: str | None
    arguments: str  # the arguments' JSON text so far (a prefix of the final text)
    done: bool


def _call_of(text: str, start: int) -> tuple[PartialCall, int | None]:
    obj = scan_object(text, start)
    name = None
    span = obj.fields.get("name")
    if span and span[1] is not None:
        try:
            value = json.loads(text[span[0]:span[1]])
        except json.JSONDecodeError:
            value = None
        name = value if isinstance(value, str) else None
    arguments = ""
    for key in ARGUMENT_KEYS:
        if key in obj.fields:
            vs, ve = obj.fields[key]
            raw = text[vs:ve] if ve is not None else text[vs:].rstrip()
            if raw.startswith('"'):  # arguments given as a JSON string: its text is known once it closes
                arguments = json.loads(raw) if ve is not None else ""
            else:
                arguments = raw
            break
    else:
        if obj.end is not None:
            arguments = "{}"
    return PartialCall(name, arguments, obj.end is not None), obj.end


def _calls_in_sequence(text: str, start: int, separators: str) -> list:
    """Successive call objects from text[start], with only separators and whitespace between them."""
    calls, i = [], start
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i >= len(text) or text[i] != "{":
            return calls
        call, end = _call_of(text, i)
        calls.append(call)
        if end is None:
            return calls
        i = end


def _held(text: str, marker: str) -> str:
    """text without a tail that may be the start of marker (sent once the next piece settles it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return text[:-n]
    return text


def _partial_json_string(raw: str) -> str:
    """The characters of a JSON string literal so far (raw starts at its opening quote)."""
    body = raw[1:]
    end = None
    escaped = False
    for i, c in enumerate(body):
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            end = i
            break
    body = body if end is None else body[:end]
    for cut in range(len(body), max(len(body) - 6, -1), -1):  # drop a trailing escape cut short
        try:
            return json.loads(f'"{body[:cut]}"')
        except json.JSONDecodeError:
            continue
    return ""


# ---------------------------------------------------------------------------------------------------------------
# A reply so far
# ---------------------------------------------------------------------------------------------------------------

def _split_thinking(raw: str, opened: bool) -> tuple[str | None, str | None]:
    """(reasoning so far, the text after it; None while the reasoning is still open)."""
    body = raw
    if not opened:
        stripped = raw.lstrip()
        if not stripped.startswith("<think>"):
            if "<think>".startswith(stripped) and stripped:
                return "", None
            return None, raw
        body = stripped[len("<think>"):]
    if "</think>" in body:
        reasoning, _, rest = body.partition("</think>")
        return reasoning.strip(), rest.lstrip()
    return _held(body, "</think>").strip(), None


def scan_reply(fmt: str, raw: str, opens_thinking: bool = False) -> tuple[str | None, str, list]:
    """(reasoning or None, content, [PartialCall]) of a reply so far, in the native format fmt."""
    reasoning, rest = _split_thinking(raw, opens_thinking) if fmt != "generic" else (None, raw)
    if rest is None:
        return reasoning, "", []
    content, calls = "", []
    if fmt == "hermes":
        opening, closing = MARKERS["hermes"]
        parts, pos = [], 0
        while True:
            i = rest.find(opening, pos)
            if i < 0:
                parts.append(_held(rest[pos:], opening))
                break
            parts.append(rest[pos:i])
            brace = rest.find("{", i)
            if brace < 0:
                break
            call, end = _call_of(rest, brace)
            calls.append(call)
            close = rest.find(closing, end) if end is not None else -1
            if close < 0:
                break
            pos = close + len(closing)
        content = "".join(parts)
    elif fmt == "llama3":
        body = rest.lstrip().removeprefix("<|python_tag|>").lstrip()
        if not body or "<|python_tag|>".startswith(rest.strip()):
            return reasoning, "", []
        if body.startswith("{"):
            calls = _calls_in_sequence(body, 0, ";")
        else:
            content = rest
    elif fmt == "mistral":
        marker = MARKERS["mistral"][0]
        i = rest.find(marker)
        if i < 0:
            content = _held(rest, marker)
        else:
            content, after = rest[:i], rest[i + len(marker):]
            if after.lstrip().startswith("["):
                calls = _calls_in_sequence(after, after.index("[") + 1, ",")
            elif "[ARGS]" in after:  # name[ARGS]{...}, repeated after further markers
                for part in after.split(marker):
                    name, sep, args = part.partition("[ARGS]")
                    if not sep or "{" not in args:
                        break
                    k = args.index("{")
                    end = scan_object(args, k).end
                    calls.append(PartialCall(name.strip(), args[k:end] if end else args[k:].rstrip(), end is not None))
    else:  # generic: {"tool_calls": [...]} or {"response": "..."}
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            obj = scan_object(stripped, 0)
            if "tool_calls" in obj.fields:
                vs = obj.fields["tool_calls"][0]
                calls = _calls_in_sequence(stripped, vs + 1, ",") if stripped[vs] == "[" else []
            elif "response" in obj.fields:
                vs, ve = obj.fields["response"]
                if stripped[vs] == '"':
                    content = _partial_json_string(stripped[vs:ve] if ve is not None else stripped[vs:])
                    return reasoning, content, calls  # the string's own characters, spaces included
        elif stripped:
            content = rest
    return reasoning, content.strip(), calls


# ---------------------------------------------------------------------------------------------------------------
# Deltas
# ---------------------------------------------------------------------------------------------------------------

class ToolCallStream:
    """Feed it the reply so far (update), then the parsed final message (finish); both return OpenAI deltas."""

    def __init__(self, fmt: str, parallel: bool = True, opens_thinking: bool = False):
        self.fmt, self.parallel, self.opens_thinking = fmt, parallel, opens_thinking
        self.reasoning = ""
        self.content = ""
        self.calls: list[dict] = []  # per call sent: {"id", "name", "arguments" sent so far}

    def _text_delta(self, attr: str, now: str | None, out: list) -> None:
        sent = getattr(self, attr)
        if now and not now.startswith(sent) and now.lstrip().startswith(sent):
            now = now.lstrip()  # the final text may keep leading spaces the scan left out
        if now and now.startswith(sent) and len(now) > len(sent):
            out.append({"reasoning_content" if attr == "reasoning" else "content": now[len(sent):]})
            setattr(self, attr, now)

    def _call_deltas(self, index: int, name: str, arguments: str, out: list) -> None:
        if index == len(self.calls):
            self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": ""})
            out.append({"tool_calls": [{"index": index, "id": self.calls[index]["id"], "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
        sent = self.calls[index]["arguments"]
        if arguments.startswith(sent) and len(arguments) > len(sent):
            out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments[len(sent):]}}]})
            self.calls[index]["arguments"] = arguments

    def update(self, raw: str) -> list:
        out = []
        reasoning, content, calls = scan_reply(self.fmt, raw, self.opens_thinking)
        self._text_delta("reasoning", reasoning, out)
        self._text_delta("content", content.rstrip(), out)
        for index, call in enumerate(calls if self.parallel else calls[:1]):
            if call.name is None:
                break  # a call is announced by its name; later ones wait for it
            self._call_deltas(index, call.name, call.arguments, out)
        return out

    def finish(self, message: dict) -> list:
        """What the complete parse (ChatPlan.reply's message) holds that has not been sent."""
        out = []
        self._text_delta("reasoning", message.get("reasoning_content"), out)
        self._text_delta("content", message.get("content"), out)
        for index, call in enumerate(message.get("tool_calls") or []):
            fn = call["function"]
            if index < len(self.calls):
                if self.calls[index]["name"] != fn["name"]:
                    break
                arguments = self.calls[index]["arguments"]
                try:  # the text streamed so far stands when it is the same value; else only what extends it
                    if json.loads(arguments) == json.loads(fn["arguments"]):
                        continue
                except json.JSONDecodeError:
                    pass
            self._call_deltas(index, fn["name"], fn["arguments"], out)
        return out

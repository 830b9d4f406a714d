"""Chat prompts: the model's own Jinja2 template, or a built-in format when the GGUF has none.

Sections: message validation; `JinjaChatTemplate` (the GGUF `tokenizer.chat_template`, rendered in Jinja2's
immutable sandbox with the variables llama-cpp-python passes); the built-in formats (chatml, llama.cpp's default,
and gemma, picked for gemma architectures); `chat_template_from_metadata`, which chooses between them.

Rendering only builds the prompt string. Tokenize it with special tokens parsed; a GGUF template usually writes
the BOS itself when the model wants one (llama-cpp-python then tokenizes with add_bos=False), while the built-in
formats leave BOS to the tokenizer's add_bos setting, as llama.cpp does.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

from edgellm.errors import EdgeLLMError

GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "gemma3n")


class ChatTemplateError(EdgeLLMError, ValueError):
    """The messages are malformed, or the chat template failed to render (including its own raise_exception)."""


# ---------------------------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------------------------

def validate_messages(messages) -> list[dict]:
    """Check the OpenAI-style message list; returns plain dict copies safe to hand to a template."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ChatTemplateError("messages is empty: give at least one {'role': 'user', 'content': ...}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', "
                                    f"got {type(message).__name__}")
        role = message.get("role")
        # any role name is passed through: templates decide which they accept (system, user, assistant, tool, ...)
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}]['role'] must be a non-empty string such as 'user', got {role!r}")
        content = message.get("content")
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
        checked.append(dict(message))
    return checked


# ---------------------------------------------------------------------------------------------------------------
# The GGUF's Jinja2 template
# ---------------------------------------------------------------------------------------------------------------

def _raise_exception(message: str):
    # templates call this to reject a conversation they cannot format (e.g. roles out of order)
    raise ChatTemplateError(f"chat template refused the messages: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Transformers' chat-template tojson (non-ASCII kept), which llama-cpp-python also installs
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_tag_extension():
    import jinja2.ext  # start-up time: Jinja2 loads with the first GGUF template, not with the API

    class GenerationTag(jinja2.ext.Extension):
        """Renders the body of HuggingFace's {% generation %}...{% endgeneration %} (a training-mask marker) as is."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTag


class JinjaChatTemplate:
    """A Jinja2 chat template compiled once in an immutable sandbox (no file access, no mutation of inputs)."""

    name = "gguf"

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        # start-up time: Jinja2 (and the sandbox built on it) load with the first GGUF template, not with the API
        import jinja2
        import jinja2.ext

        from edgellm.compat.template_sandbox import BoundedSandboxedEnvironment

        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("chat template must be a non-empty string")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = BoundedSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                          extensions=[jinja2.ext.loopcontrols, _generation_tag_extension()])
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {e.message}") from e

    def render(self, messages, add_generation_prompt: bool = True, **variables) -> str:
        import jinja2  # loaded by __init__ already; here for its exception types

        messages = validate_messages(messages)
        try:
            return self._template.render(
                messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt, raise_exception=_raise_exception,
                strftime_now=_strftime_now, **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # undefined variables, sandbox violations, bad filters
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------------------------
# Built-in formats (llama.cpp src/llama-chat.cpp)
# ---------------------------------------------------------------------------------------------------------------

def _c_trim(text: str) -> str:
    # llama.cpp's trim(): C isspace only, not Python's wider notion of whitespace
    return text.strip(" \t\n\v\f\r")


class ChatMLFormat:
    """<|im_start|>role\\ncontent<|im_end|>\\n ... : llama.cpp's format when a model has no template."""

    name = "chatml"

    def render(self, messages, add_generation_prompt: bool = True, **_ignored) -> str:
        parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in validate_messages(messages)]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


class GemmaFormat:
    """<start_of_turn>user\\n...<end_of_turn>\\n; assistant is "model"; system text is merged into the next user turn."""

    name = "gemma"

    def render(self, messages, add_generation_prompt: bool = True, **_ignored) -> str:
        parts, system = [], ""
        for m in validate_messages(messages):
            if m["role"] == "system":
                system += _c_trim(m["content"])
                continue
            role = "model" if m["role"] == "assistant" else m["role"]
            parts.append(f"<start_of_turn>{role}\n")
            if system and role != "model":
                parts.append(system + "\n\n")
                system = ""
            parts.append(_c_trim(m["content"]) + "<end_of_turn>\n")
        if add_generation_prompt:
            parts.append("<start_of_turn>model\n")
        return "".join(parts)


BUILTIN_FORMATS = {"chatml": ChatMLFormat, "gemma": GemmaFormat}


def chat_template_from_metadata(metadata: Mapping[str, Any], bos_token: str = "", eos_token: str = ""):
    """The chat formatter for a model: its GGUF template if it has one, else gemma for gemma models, else chatml.

    bos_token / eos_token are the token texts (llama-cpp-python passes token_get_text of the BOS and EOS ids).
    """
    source = metadata.get("tokenizer.chat_template")
    if isinstance(source, str) and source.strip():
        return JinjaChatTemplate(source, bos_token=bos_token, eos_token=eos_token)
    architecture = metadata.get("general.architecture", "")
    return GemmaFormat() if architecture in GEMMA_ARCHITECTURES else ChatMLFormat()


def render_chat(template: str | None, messages, *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, **variables) -> str:
    """One-shot render of a template string (None: chatml)."""
    formatter = ChatMLFormat() if template is None else JinjaChatTemplate(template, bos_token, eos_token)
    return formatter.render(messages, add_generation_prompt=add_generation_prompt, **variables)

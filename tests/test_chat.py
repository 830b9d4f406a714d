"""Chat prompts: the GGUF Jinja2 template in a sandbox, the built-in chatml and gemma formats, message checks."""
from pathlib import Path

import pytest

from edgellm.engine import gguf
from edgellm.compat.chat import (ChatMLFormat, ChatTemplateError, GemmaFormat, JinjaChatTemplate,
                                 chat_template_from_metadata, render_chat, validate_messages)

SMOLLM2_TEMPLATE = (Path(__file__).parent / "fixtures" / "smollm2_chat_template.jinja").read_text(encoding="utf-8")
SMOLLM2_DEFAULT_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                          "<|im_end|>\n")

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


# --- SmolLM2's real template ------------------------------------------------------------------------------------

def test_fixture_is_the_template_in_the_gguf(smollm2_path):
    with gguf.open(smollm2_path) as f:
        assert f.metadata["tokenizer.chat_template"] == SMOLLM2_TEMPLATE


def test_smollm2_template_with_generation_prompt():
    template = JinjaChatTemplate(SMOLLM2_TEMPLATE, bos_token="<|im_start|>", eos_token="<|im_end|>")
    prompt = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    # no system message given: the template inserts its own
    assert prompt == SMOLLM2_DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    without = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert without == SMOLLM2_DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n"


def test_smollm2_template_multi_turn_with_system():
    prompt = render_chat(SMOLLM2_TEMPLATE, CONVERSATION)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nHi there<|im_end|>\n"
                      "<|im_start|>assistant\nHello!<|im_end|>\n"
                      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                      "<|im_start|>assistant\n")


def test_smollm2_metadata_selects_its_template():
    meta = {"general.architecture": "llama", "tokenizer.chat_template": SMOLLM2_TEMPLATE}
    formatter = chat_template_from_metadata(meta, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert isinstance(formatter, JinjaChatTemplate) and formatter.name == "gguf"
    assert formatter.render(CONVERSATION) == render_chat(SMOLLM2_TEMPLATE, CONVERSATION)


# --- the Jinja2 environment -------------------------------------------------------------------------------------

def test_variables_bos_eos_and_whitespace_control():
    source = ("{{ bos_token }}\n{% for m in messages %}\n    {{ m.role }}:{{ m.content }}{{ eos_token }}\n"
              "{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}")
    out = render_chat(source, [{"role": "user", "content": "x"}], bos_token="<s>", eos_token="</s>")
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one
    assert out == "<s>\n    user:x</s>\nA:"


def test_template_raise_exception_becomes_chat_template_error():
    source = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}"
              "{% endif %}ok")
    assert render_chat(source, [{"role": "user", "content": "a"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation must start with user"):
        render_chat(source, [{"role": "assistant", "content": "a"}])


def test_strftime_now_tojson_loopcontrols_and_extra_variables():
    source = ("{{ strftime_now('%Y') | length }}|{{ messages[0] | tojson }}|"
              "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|"
              "{{ tools | length if tools else 'no tools' }}")
    msgs = [{"role": "user", "content": "héllo"}, {"role": "user", "content": "second"}]
    assert render_chat(source, msgs) == '4|{"role": "user", "content": "héllo"}|héllo|no tools'
    assert render_chat(source, msgs, tools=[{"type": "function"}]).endswith("|1")


def test_generation_tag_renders_its_body():
    source = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render_chat(source, [{"role": "user", "content": "a"}]) == "[a]"


@pytest.mark.parametrize("source, match", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),  # sandbox escape attempt
    ("{% set _ = messages.append({'role': 'x'}) %}", "SecurityError"),  # immutable: inputs cannot be changed
    ("{{ undefined_thing.attr }}", "UndefinedError"),
])
def test_sandbox_and_render_failures(source, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(source, [{"role": "user", "content": "a"}])


def test_syntax_error_reported_at_compile_time():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        JinjaChatTemplate("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ChatTemplateError, match="non-empty"):
        JinjaChatTemplate("   ")


# --- built-in formats -------------------------------------------------------------------------------------------

def test_chatml_fallback_format():
    assert ChatMLFormat().render(CONVERSATION[:2]) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                                       "<|im_start|>user\nHi there<|im_end|>\n"
                                                       "<|im_start|>assistant\n")
    assert ChatMLFormat().render(CONVERSATION[1:2], add_generation_prompt=False) == (
        "<|im_start|>user\nHi there<|im_end|>\n")
    assert render_chat(None, CONVERSATION[1:2]) == ChatMLFormat().render(CONVERSATION[1:2])


def test_gemma_fallback_format():
    messages = [
        {"role": "system", "content": "  Be brief.\n"},
        {"role": "user", "content": "Hi there\n"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": " What is 2+2? "},
    ]
    # llama.cpp LLM_CHAT_TEMPLATE_GEMMA: system merged into the next user turn, assistant -> model, contents trimmed
    assert GemmaFormat().render(messages) == ("<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
                                              "<start_of_turn>model\nHello!<end_of_turn>\n"
                                              "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
                                              "<start_of_turn>model\n")
    assert GemmaFormat().render(messages[1:2], add_generation_prompt=False) == (
        "<start_of_turn>user\nHi there<end_of_turn>\n")


def test_gemma_fallback_selected_for_real_gemma3_file(gemma_path):
    with gguf.open(gemma_path) as f:
        assert "tokenizer.chat_template" not in f.metadata  # the reason a fallback is needed at all
        formatter = chat_template_from_metadata(f.metadata)
    assert isinstance(formatter, GemmaFormat)


@pytest.mark.parametrize("arch, expected", [("gemma3", GemmaFormat), ("gemma2", GemmaFormat),
                                            ("llama", ChatMLFormat), ("qwen2", ChatMLFormat)])
def test_fallback_choice_by_architecture(arch, expected):
    assert isinstance(chat_template_from_metadata({"general.architecture": arch}), expected)
    blank = {"general.architecture": arch, "tokenizer.chat_template": ""}
    assert isinstance(chat_template_from_metadata(blank), expected)


# --- message validation -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("messages, match", [
    ("hello", "must be a list"),
    ([], "empty"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], r"messages\[0\]\['role'\]"),
    ([{"role": "user", "content": "ok"}, {"role": "", "content": "x"}], r"messages\[1\]\['role'\]"),
    ([{"role": "user"}], r"messages\[0\]\['content'\] must be a string"),
    ([{"role": "user", "content": 5}], "got int"),
])
def test_invalid_messages(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        validate_messages(messages)
    for formatter in (ChatMLFormat(), GemmaFormat(), JinjaChatTemplate(SMOLLM2_TEMPLATE)):
        with pytest.raises(ChatTemplateError):
            formatter.render(messages)


def test_validate_returns_copies():
    original = [{"role": "user", "content": "x", "name": "bob"}]
    checked = validate_messages(original)
    assert checked == original and checked[0] is not original[0]
    assert isinstance(ChatTemplateError("x"), ValueError)

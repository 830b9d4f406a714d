"""Chat templates are code from the model file: a runaway one must fail with ChatTemplateError, fast, not
exhaust memory, recurse into RecursionError or hang. Real templates still render as before."""
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from edgellm.compat.chat import ChatTemplateError, JinjaChatTemplate

MESSAGES = [{"role": "user", "content": "hi"}]
# each case either refuses up front or runs into the render budget (2 s); this leaves room for a loaded machine
WORST_CASE_S = 15

RUNAWAY = {
    "repeat": "{{ 'x' * 10**10 }}",
    "repeat_list": "{{ ([1] * 100000) * 100000 }}",
    "power": "{{ 10 ** (10 ** 10) }}",
    "doubling_concat": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "doubling_plus": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}{{ ns.s|length }}",
    "center_filter": "{{ 'x'|center(10**10) }}",
    "center_method": "{{ 'x'.center(10**10) }}",
    "replace_growth": "{{ ('a' * 100000).replace('a', 'b' * 100000) }}",
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "exponential_macro": "{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}"
                         "{{ f(0) }}",
}


def test_jinja2_has_the_sandbox_fixes():
    assert tuple(int(p) for p in version("jinja2").split(".")[:3]) >= (3, 1, 6)
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert '"jinja2>=3.1.6"' in pyproject


@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_runaway_template_raises_the_template_error(name):
    template = JinjaChatTemplate(RUNAWAY[name])
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError):
        template.render(MESSAGES)
    assert time.monotonic() - t0 < WORST_CASE_S


def test_ordinary_templates_render_unchanged():
    source = (Path(__file__).parent / "fixtures" / "smollm2_chat_template.jinja").read_text()
    out = JinjaChatTemplate(source).render(MESSAGES * 50 and [{"role": "user", "content": "hi " * 1000}])
    assert out.count("hi ") == 1000 and "<|im_start|>assistant" in out
    small = JinjaChatTemplate("{{ 'ab' * 3 }}{{ 'x'|center(5) }}{{ 'a' ~ 'b' }}{% for i in range(3) %}{{ i }}{% endfor %}")
    assert small.render(MESSAGES) == "ababab  x  ab012"

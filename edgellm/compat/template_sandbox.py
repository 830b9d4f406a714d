"""Jinja2's immutable sandbox with a bounded amount of work, for chat templates that come from model files.

The sandbox stops attribute escapes but not `'x' * 10**10`, a doubling loop or nested loops that never end. Here
sequence-growing operators refuse results past MAX_LENGTH, and a render has a wall-clock budget checked on every
line of the compiled template (a line trace on the template's own frames only, in the rendering thread only).
Budget overruns, recursion too deep and memory exhaustion all surface as jinja2.SecurityError, a TemplateError,
so callers handle them as any other template failure.
"""
import sys
import time

from jinja2.exceptions import SecurityError
from jinja2.compiler import CodeGenerator
from jinja2.environment import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_LENGTH = 1 << 20        # characters or items in any string or list a template builds
RENDER_BUDGET_S = 2.0       # a chat template renders in milliseconds; anything near this is runaway work
_TEMPLATE_FILENAME = "<template>"


def _size(value):
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


class _Budget:
    def __init__(self, seconds):
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds

    def check(self):
        if time.monotonic() > self.deadline:
            raise SecurityError(f"chat template ran past its {self.seconds:g} s budget")

    def trace(self, frame, event, arg):
        # only the compiled template's frames are line-traced; everything else runs at full speed
        if frame.f_code.co_filename == _TEMPLATE_FILENAME:
            return self._line
        return None

    def _line(self, frame, event, arg):
        self.check()
        return self._line


class BoundedTemplate(Template):
    def render(self, *args, **kwargs):
        budget = _Budget(self.environment.render_budget_s)
        previous = sys.gettrace()
        sys.settrace(budget.trace)
        try:
            return super().render(*args, **kwargs)
        except RecursionError as e:
            raise SecurityError("chat template recursed too deeply") from e
        except MemoryError as e:
            raise SecurityError("chat template ran out of memory") from e
        finally:
            sys.settrace(previous)


_WIDTH_METHODS = frozenset(["center", "ljust", "rjust", "zfill", "expandtabs"])
_WIDTH_FILTERS = frozenset(["center", "indent", "truncate", "wordwrap"])


def _grown_size(name, base, args, kwargs):
    """The size a str method or filter call would produce, where it can grow past its input; else 0."""
    if name in _WIDTH_METHODS | _WIDTH_FILTERS:
        width = args[0] if args else kwargs.get("width", 0)
        if name == "indent":
            width = (width if isinstance(width, int) else len(str(width))) * (str(base).count("\n") + 1)
        return width if isinstance(width, int) else 0
    if name == "replace" and len(args) >= 2 and isinstance(base, str):
        old, new = str(args[0]), str(args[1])
        hits = base.count(old) if old else len(base) + 1
        return len(base) + hits * max(len(new) - len(old), 0)
    return 0


class _BoundedCodeGenerator(CodeGenerator):
    # the ~ operator joins strings without calling into the sandbox: check what it built
    def visit_Concat(self, node, frame):
        self.write("environment.checked_size(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandboxedEnvironment(ImmutableSandboxedEnvironment):
    template_class = BoundedTemplate
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(["*", "**", "+"])
    render_budget_s = RENDER_BUDGET_S
    max_length = MAX_LENGTH

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            count, seq = (right, left) if _size(left) or isinstance(left, (str, list, tuple)) else (left, right)
            if isinstance(count, int) and isinstance(seq, (str, bytes, list, tuple)) and \
                    len(seq) * max(count, 0) > self.max_length:
                raise SecurityError(f"chat template tried to build a sequence of {len(seq) * count:,} items "
                                    f"(limit {self.max_length:,})")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    abs(left) > 1 and right * max(abs(left).bit_length(), 1) > 4096:
                raise SecurityError("chat template tried to compute a power too large")
        elif operator == "+":
            if _size(left) + _size(right) > self.max_length:
                raise SecurityError(f"chat template tried to build a sequence past {self.max_length:,} items")
        return super().call_binop(context, operator, left, right)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, fn in list(self.filters.items()):
            self.filters[name] = self._bounded_filter(name, fn)

    def _bounded_filter(self, name, fn):
        env = self

        def bounded(*args, **kwargs):
            # pass_context/pass_environment filters get those first; the value filtered follows
            base_at = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0
            if len(args) > base_at and _grown_size(name, args[base_at], args[base_at + 1:], kwargs) > env.max_length:
                raise SecurityError(f"chat template's |{name} would build more than {env.max_length:,} characters")
            return env.checked_size(fn(*args, **kwargs))

        bounded.__dict__.update(getattr(fn, "__dict__", {}))  # keeps jinja_pass_arg: what jinja2 passes first
        return bounded

    def checked_size(self, value):
        if _size(value) > self.max_length:
            raise SecurityError(f"chat template built a value of {_size(value):,} items (limit {self.max_length:,})")
        return value

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's own signature
        base = getattr(__obj, "__self__", None)
        if isinstance(base, str) and _grown_size(getattr(__obj, "__name__", ""), base, args, kwargs) > __self.max_length:
            raise SecurityError(f"chat template's .{__obj.__name__}() would build more than "
                                f"{__self.max_length:,} characters")
        return __self.checked_size(super().call(__context, __obj, *args, **kwargs))

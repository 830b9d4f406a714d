"""What a first run shows while kernels compile, and timings that keep compilation apart (fast checks; the cold
`edgellm run` into an empty kernel cache is in test_warmup.py)."""
import io
import time

import pytest
from numba import njit

import edgellm
from edgellm.generation import kernel_paths
from edgellm.cli import COMPILE_NOTE, CompileReport
from edgellm.engine.compile_clock import CompileProgress
from fake_model import fake_model, script

# The fake model's forward takes microseconds, Numba's smallest compilation tens of milliseconds: timings that
# counted the compilation would be at least this share of it.
COMPILE_SHARE_IF_COUNTED = 0.2


def _compiling_forward(model, n_calls):
    """Make the first n_calls forwards each compile a fresh Numba function, as a cold kernel cache would."""
    calls = []

    def on_forward(tokens):
        if len(calls) < n_calls:
            f = njit(lambda x: x + 1)  # a new dispatcher: compiled at its first call
            f(len(calls))
            calls.append(f)

    model.model.on_forward = on_forward
    return calls


def test_compilation_during_a_call_is_timed_apart_from_prompt_and_generation():
    m = fake_model()
    script(m, "hello world", " hello world")
    m.generate("hello world", max_tokens=3)  # the decode loop's own first-call costs (imports, cached kernels)
    m.reset()
    calls = _compiling_forward(m, 2)  # the prompt's forward and the first decode step
    t0 = time.perf_counter()
    m.generate("hello world", max_tokens=3)
    wall = time.perf_counter() - t0
    t = m.timings
    assert len(calls) == 2
    assert t.compile_s > 0
    assert t.prompt_s < COMPILE_SHARE_IF_COUNTED * t.compile_s, t
    assert t.generate_s < COMPILE_SHARE_IF_COUNTED * t.compile_s, t
    assert t.prompt_s + t.generate_s + t.compile_s <= wall
    assert f"compile {t.compile_s:.1f} s (first run only)" in t.summary()

    m.reset()
    m.generate("hello world", max_tokens=3)  # nothing left to compile
    assert m.timings.compile_s == 0.0 and "compile" not in m.timings.summary()


def test_a_prompt_compiling_on_first_use_is_reported_before_the_call_yields():
    m = fake_model()
    script(m, "hello world", " hello world")
    m.generate("hello world", max_tokens=3)
    m.reset()
    _compiling_forward(m, 2)  # the prompt's forward, reported, and the first decode step, only timed
    events = []
    m.compile_progress = events.append
    stream = m.stream("hello world", max_tokens=3)
    first = next(stream)
    assert first and [e.stage for e in events] == ["start", "kernel", "done"], events
    list(stream)
    assert [e.stage for e in events] == ["start", "kernel", "done"]
    assert events[-1].kernels == 1 and 0 < events[-1].seconds < m.timings.compile_s  # the decode step's too


def test_a_prompt_interrupted_while_compiling_still_ends_the_report():
    m = fake_model()
    script(m, "hello world", " hello world")
    m.generate("hello world", max_tokens=3)
    m.reset()
    calls = _compiling_forward(m, 1)

    def interrupted(tokens, compile_first=m.model.on_forward):
        compile_first(tokens)
        raise KeyboardInterrupt  # Ctrl-C in the middle of the prompt

    m.model.on_forward = interrupted
    events = []
    m.compile_progress = events.append
    try:
        m.generate("hello world", max_tokens=3)
    except KeyboardInterrupt:
        pass
    assert len(calls) == 1 and [e.stage for e in events] == ["start", "kernel", "done"], events


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _feed(report, kernels=5):
    report(CompileProgress("start", 1, 0.0))
    for n in range(1, kernels + 1):
        report(CompileProgress("kernel", n, 0.1 * n))
    time.sleep(1.2)  # a live terminal redraws its count every half second (margin for a loaded machine)
    report(CompileProgress("done", kernels, 12.34))


def test_compile_report_on_a_terminal_shows_a_live_count_then_the_total(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    out = _Terminal()
    _feed(CompileReport(out))
    text = out.getvalue()
    assert text.startswith(COMPILE_NOTE + "\n")
    assert "\r  5 kernels compiled, " in text
    assert text.endswith("\r\033[Kedgellm: compiled 5 kernels in 12.3 s\n")


def test_compile_report_on_a_dumb_terminal_is_two_plain_lines(monkeypatch):
    monkeypatch.setenv("TERM", "dumb")
    out = _Terminal()
    _feed(CompileReport(out))
    assert out.getvalue() == f"{COMPILE_NOTE}\nedgellm: compiled 5 kernels in 12.3 s\n"


def test_compile_report_shows_each_compilation_of_a_session(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    out = _Terminal()
    report = CompileReport(out)
    _feed(report)
    _feed(report, kernels=2)  # a chat's later prompt compiling again: its live count runs too
    assert "\r  2 kernels compiled, " in out.getvalue().split("compiled 5 kernels")[1]


def test_compile_report_in_a_log_is_two_plain_lines():
    out = io.StringIO()
    _feed(CompileReport(out))
    assert out.getvalue() == f"{COMPILE_NOTE}\nedgellm: compiled 5 kernels in 12.3 s\n"


def test_precompile_runs_a_cold_path_once_and_leaves_the_model_as_loaded(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_paths, "_marker", lambda m, path: tmp_path / f"{kernel_paths.warm_key(m)}-{path}")
    m = edgellm.load(smollm2_path, n_threads=2, n_ctx=256)
    fresh = m.generate("The capital of France is", max_tokens=6)
    m.reset()
    assert kernel_paths.cold_paths(m, ("prompt", "sampling")) == ["prompt", "sampling"]
    seconds = m.precompile(("prompt",))
    assert seconds > 0 and m.timings.compile_s == seconds
    assert kernel_paths.cold_paths(m, ("prompt", "sampling")) == ["sampling"]
    assert m.model.n_past == 0 and m.last_completion is None  # the warm-up's rows and result are gone
    assert m.generate("The capital of France is", max_tokens=6) == fresh
    assert m.precompile(("prompt",)) == 0.0  # warm now: nothing runs
    with pytest.raises(ValueError):
        m.precompile("prompt")


def test_count_compiles_counts_compilations_in_every_thread():
    import threading
    from edgellm.engine.compile_clock import count_compiles

    @njit
    def here(x):
        return x + 1

    @njit
    def elsewhere(x):
        return x * 3

    with count_compiles() as compiled:
        assert here(1) == 2
        t = threading.Thread(target=elsewhere, args=(2,))
        t.start()
        t.join()
        assert compiled.n == 2
        assert here(5) == 6  # compiled already: not counted again
    assert compiled.n == 2

"""A pytest plugin that records Numba's compile seconds per test, to find where the suite's time goes.

    PYTHONPATH=tools NUMBA_CACHE_DIR=$(mktemp -d) python -m pytest -p pytest_compile_report [tests ...]
    COMPILE_REPORT=out.json ...                         (default: compile_report.json in the working directory)

With an empty cache every kernel compiles in the first test that calls it, so a test's time splits into what it
compiled and what it ran. Only top-level compilations count (a kernel's callees compile inside it), and only in
the test process: child processes (the background jobs, subprocess tests) are not seen. Loading a kernel from the
cache is not a compilation. The report: {"sec": {test id: seconds}, "n": {test id: kernels}, "kernels": {kernel:
seconds}}, and a summary of the slowest tests and kernels.
"""
from __future__ import annotations

import json
import os
import time

from numba.core import event

_state = {"depth": 0, "t0": 0.0, "test": None, "sec": {}, "n": {}, "kernels": {}, "name": None}


class _Listener(event.Listener):
    def on_start(self, ev):
        if _state["depth"] == 0:
            _state["t0"] = time.perf_counter()
            dispatcher = (ev.data or {}).get("dispatcher")
            func = getattr(dispatcher, "py_func", None)
            _state["name"] = f"{func.__module__}.{func.__qualname__}" if func is not None else "?"
        _state["depth"] += 1

    def on_end(self, ev):
        _state["depth"] -= 1
        if _state["depth"] == 0:
            key = _state["test"] or "<collection>"
            _state["sec"][key] = _state["sec"].get(key, 0.0) + time.perf_counter() - _state["t0"]
            _state["n"][key] = _state["n"].get(key, 0) + 1
            name = _state["name"]
            _state["kernels"][name] = _state["kernels"].get(name, 0.0) + time.perf_counter() - _state["t0"]


event.register("numba:compile", _Listener())


def pytest_runtest_setup(item):
    _state["test"] = item.nodeid


def pytest_terminal_summary(terminalreporter):
    path = os.environ.get("COMPILE_REPORT", "compile_report.json")
    with open(path, "w") as f:
        json.dump({"sec": _state["sec"], "n": _state["n"], "kernels": _state["kernels"]}, f, indent=0)
    total, n = sum(_state["sec"].values()), sum(_state["n"].values())
    top = sorted(_state["sec"].items(), key=lambda kv: -kv[1])[:10]
    terminalreporter.write_line(f"numba compiled {n} kernels in {total:.1f} s in this process; report: {path}")
    for key, sec in top:
        terminalreporter.write_line(f"  {sec:7.1f} s  {_state['n'][key]:3d} kernels  {key}")
    terminalreporter.write_line("slowest kernels to compile (all their signatures):")
    for name, sec in sorted(_state["kernels"].items(), key=lambda kv: -kv[1])[:10]:
        terminalreporter.write_line(f"  {sec:7.1f} s  {name}")

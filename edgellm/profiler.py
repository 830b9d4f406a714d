"""Time per operation and per layer of one forward step (`edgellm bench --profile`), with nothing added to the
normal path: for the duration of one step the model's matrices and the edgellm.ops functions are wrapped with
timers, and the layer loop reports which layer runs.

Attribution:
  - a matrix product is named after the layer attribute that holds it (attn_qkv, attn_output, ffn_gate_up,
    ffn_down, ...); outside the layers, "embed" (the embedding rows) and "output" (the logits);
  - an ops function by its name (rms_norm, attention, finish_qkv, ...);
  - the layer is the one the forward's `for ... in self.layers` loop is on; None before and after the loop;
  - only the outermost timed call counts (an ops function called by another is part of the caller's time);
  - "other" (layer None) is the step's wall time that no timer saw: Python between the calls, numpy glue.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from edgellm import ops

OTHER = "other"


class _LayerList(list):
    """The model's layers; iterating reports each layer index to the profiler as the loop reaches it."""

    def __init__(self, layers, profiler):
        super().__init__(layers)
        self._profiler = profiler

    def __iter__(self):
        for il, layer in enumerate(list.__iter__(self)):
            self._profiler.layer = il
            yield layer
        self._profiler.layer = None


class StepProfiler:
    def __init__(self):
        self.seconds = defaultdict(float)  # (op, layer) -> seconds
        self.layer = None
        self._depth = 0

    def timed(self, op: str, fn):
        def wrapper(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[(op, self.layer)] += time.perf_counter() - t0
                self._depth -= 1
        return wrapper


def _ops_functions():
    """The public functions of edgellm.ops (Python functions and Numba dispatchers alike)."""
    return {name: value for name, value in vars(ops).items()
            if not name.startswith("_") and callable(value) and not isinstance(value, type)
            and getattr(value, "__module__", None) == ops.__name__}


def profile_step(model, tokens) -> dict:
    """Run model.forward(tokens) once under timers; returns {(op, layer): seconds}, layer an int or None."""
    prof = StepProfiler()
    patched_objects = []  # (object, method name) whose instance attribute shadows the class method
    patched_ops = _ops_functions()

    def wrap_method(obj, method, op):
        if obj is None or not hasattr(obj, method) or method in vars(obj):
            return
        setattr(obj, method, prof.timed(op, getattr(obj, method)))
        patched_objects.append((obj, method))

    layers = model.layers
    for layer in layers:
        for name, value in list(vars(layer).items()):
            wrap_method(value, "matmul", name)
    wrap_method(model.token_embd, "get_rows", "embed")
    wrap_method(model.output, "matmul", "output")
    for name, fn in patched_ops.items():
        setattr(ops, name, prof.timed(name, fn))
    model.layers = _LayerList(layers, prof)
    try:
        t0 = time.perf_counter()
        model.forward(np.asarray(tokens, dtype=np.int32))
        wall = time.perf_counter() - t0
    finally:
        model.layers = layers
        for name, fn in patched_ops.items():
            setattr(ops, name, fn)
        for obj, method in patched_objects:
            delattr(obj, method)
    timed = sum(prof.seconds.values())
    prof.seconds[(OTHER, None)] += max(0.0, wall - timed)
    return dict(prof.seconds)

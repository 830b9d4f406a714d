"""Time per operation and per layer of one forward step (`edgellm bench --profile`), with nothing added to the
normal path: for the duration of one step the model's matrices and the edgellm.engine.ops functions are wrapped with
timers, and the layer loop reports which layer runs.

Attribution:
  - a matrix product is named after the layer attribute that holds it (qkv_group, attn_output, gate_up_group,
    ffn_down, ...); outside the layers, "embed" (the embedding rows) and "output" (the logits);
  - an ops function by its name (rms_norm, attention, finish_qkv, ...), timed where the model modules call it
    (their module-level name `ops` points at a timed stand-in for the step; edgellm.engine.ops is left as it is);
  - the layer is the one the forward's `for ... in self.layers` loop is on; None before and after the loop;
  - only the outermost timed call counts (an ops function called by another is part of the caller's time);
  - "other" (layer None) is the step's wall time that no timer saw: Python between the calls, numpy glue.
"""

from __future__ import annotations

import sys
import time
import types
from collections import defaultdict

import numpy as np

from edgellm.engine import ops

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


def _timed_ops(prof) -> types.ModuleType:
    """A stand-in for the edgellm.engine.ops module whose public functions (Python functions and Numba dispatchers
    alike) are timed. The model modules see it in place of ops during the profiled steps; edgellm.engine.ops itself is
    never touched, because Numba resolves a jitted function's globals there when it compiles one (a kernel compiled
    mid-profile would otherwise find a Python wrapper where it expects a jitted function)."""
    proxy = types.ModuleType(ops.__name__)
    proxy.__dict__.update(vars(ops))
    for name, value in vars(ops).items():
        if not name.startswith("_") and callable(value) and not isinstance(value, type) \
                and (getattr(value, "__module__", None) or "").startswith(ops.__name__ + "."):
            setattr(proxy, name, prof.timed(name, value))
    return proxy


def _modules_using_ops() -> list:
    """The edgellm modules (this one aside) that call ops.<function> through a module-level name `ops`."""
    return [mod for name, mod in list(sys.modules.items())
            if name.startswith("edgellm.") and name != __name__ and getattr(mod, "ops", None) is ops]


def profile_step(model, tokens, n_steps: int = 1) -> dict:
    """Run model.forward(tokens) n_steps times under timers; returns {(op, layer): seconds per step}, layer an int
    or None. The timers are put in place once for all the steps: setting them up takes long enough for OpenMP's
    idle workers to go to sleep, and the first parallel region after it pays their wake-up."""
    prof = StepProfiler()
    patched_objects = []  # (object, method name) whose instance attribute shadows the class method
    timed_ops, users = _timed_ops(prof), _modules_using_ops()

    def wrap_method(obj, method, op):
        if obj is None or not hasattr(obj, method) or method in vars(obj):
            return
        setattr(obj, method, prof.timed(op, getattr(obj, method)))
        patched_objects.append((obj, method))

    layers = model.layers
    for layer in layers:
        for name, value in list(vars(layer).items()):
            wrap_method(value, "matmul", name)
            wrap_method(value, "matmul_chosen", name)  # a token's chosen experts (gate and up: ffn_gate_exps)
    wrap_method(model.token_embd, "get_rows", "embed")
    wrap_method(model.output, "matmul", "output")
    for mod in users:
        mod.ops = timed_ops
    model.layers = _LayerList(layers, prof)
    model.bound_decode = False  # each op through its timed function, not the step's bound callables
    tokens = np.asarray(tokens, dtype=np.int32)
    try:
        t0 = time.perf_counter()
        for _ in range(n_steps):
            model.forward(tokens)
        wall = time.perf_counter() - t0
    finally:
        model.layers = layers
        del model.bound_decode
        for mod in users:
            mod.ops = ops
        for obj, method in patched_objects:
            delattr(obj, method)
    timed = sum(prof.seconds.values())
    prof.seconds[(OTHER, None)] += max(0.0, wall - timed)
    return {key: sec / n_steps for key, sec in prof.seconds.items()}

"""Start-up stays lazy: `import edgellm`, and loading a model and running its first token, import only what that
needs. Each check runs in a fresh interpreter and fails if someone makes one of these imports eager again (the
server, constrained decoding, the Hub client, CUDA, other architectures' modules, or the K-quant kernels for a file
that has none)."""
import json
import subprocess
import sys

# Modules that neither `import edgellm` nor loading a model and running a token may import.
NEVER_AT_START = ("edgellm.server", "edgellm.serving", "edgellm.cli", "fastapi", "uvicorn", "llguidance", "jinja2",
                  "numba.cuda", "edgellm.engine.cuda.models", "ray", "edgellm.integrations.ray")

# What loading SmolLM2 (F32, Q4_1 and Q8_0 tensors, llama architecture, by its path) and one token must not import.
NOT_FOR_SMOLLM2 = NEVER_AT_START + (
    "edgellm.generation.constrain", "edgellm.compat.llama_compat", "edgellm.compat.tool_calls",
    "edgellm.store.hub",
    "edgellm.quant.matmul_kquant", "edgellm.quant.matmul_kgroups", "edgellm.quant.quantize_kernels",
    "edgellm.quant.quantize_blocks", "edgellm.engine.models.qwen3moe",
    "edgellm.engine.models.gemma3", "edgellm.engine.models.gemma2", "edgellm.engine.models.qwen2",
    "edgellm.engine.models.qwen3", "edgellm.engine.models.phi3", "edgellm.engine.models.granite",
    "edgellm.engine.models.olmo2", "edgellm.engine.models.smollm3",
) + (("psutil",) if sys.platform.startswith("linux") else ())  # the memory check reads /proc/meminfo there

CHILD = r"""
import json, sys
import edgellm
after_import = sorted(sys.modules)
if len(sys.argv) > 1:
    import numpy as np
    from numba.core.dispatcher import Dispatcher
    import gc
    collections = []
    gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
    m = edgellm.load(sys.argv[1], n_threads=1, n_ctx=64)
    during_load, collector_on = len(collections), gc.isenabled()
    gc.disable()
    edgellm.load(sys.argv[1], n_threads=1, n_ctx=64)
    collector_left_off = not gc.isenabled()
    gc.enable()
    m.model.forward(np.array([1], np.int32))
    # kernels that were compiled or loaded from the cache, by the module that defines them (a module's namespace
    # also holds the kernels it imports: iq4_nl's tiles come from dots_block32)
    used = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith("edgellm.quant."):
            n = sum(1 for v in vars(mod).values()  # its own kernels, not those it imports
                    if isinstance(v, Dispatcher) and v.overloads and v.py_func.__module__ == name)
            if n:
                used[name] = n
    # tokenizer tables the first token does not need: built by the first text encoded
    bpe = m.tokenizer._model
    deferred = {"merge ranks": bpe._rank_index is not None, "pre-tokenizer regexes": bpe._pre._compiled is not None}
    m.tokenizer.encode("Hello world")
    built = {"merge ranks": bpe._rank_index is not None, "pre-tokenizer regexes": bpe._pre._compiled is not None}
    print(json.dumps({"after_import": after_import, "after_load": sorted(sys.modules), "used": used,
                      "built_at_load": deferred, "built_by_encode": built, "gc": [during_load, collector_on,
                                                                                  collector_left_off]}))
else:
    print(json.dumps({"after_import": after_import}))
"""


def _child(*args):
    out = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_edgellm_is_light():
    mods = set(_child()["after_import"])
    assert not mods & set(NEVER_AT_START), sorted(mods & set(NEVER_AT_START))
    assert "edgellm.api" not in mods and "edgellm.engine.ops" not in mods  # loaded with a model, not at import


def test_loading_a_q4_1_model_imports_and_loads_only_its_own_kernels(smollm2_path):
    report = _child(smollm2_path)
    mods = set(report["after_load"])
    assert "edgellm.engine.models.llama" in mods and "edgellm.quant.matmul_block32" in mods  # what it does need
    assert not mods & set(NOT_FOR_SMOLLM2), sorted(mods & set(NOT_FOR_SMOLLM2))
    used = report["used"]
    assert used.get("edgellm.quant.matmul_block32", 0) >= 1, used  # the Q4_1 / Q8_0 matmuls ran
    # no K-quant or IQ4 kernel compiled or loaded from the cache, even where their module is imported
    assert not {"edgellm.quant.kernels_kquant", "edgellm.quant.iq4_xs", "edgellm.quant.iq4_nl"} & set(used), used
    assert not any(report["built_at_load"].values()) and all(report["built_by_encode"].values()), report
    # the garbage collector pauses while a model loads, and is left as the caller had it
    assert report["gc"] == [0, True, True], report["gc"]

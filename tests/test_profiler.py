"""edgellm.engine.profiler: one forward step timed per operation and layer (`edgellm bench --profile`), on tiny models
of both architectures: every layer's products and attention show up under their layer, the parts add up to the step, and
nothing stays patched afterwards (the next step gives the unprofiled bits)."""
import sys

import numpy as np
import pytest

import edgellm
import edgellm.engine.gguf
from edgellm.prep import bench
from edgellm.engine import ops
from edgellm.engine.models import build_model
from edgellm.engine.profiler import OTHER
from hardening_tiny import write_loadable_tiny_model
from helpers_tiny_gguf import TinySpec, write_tiny_model


SPECS = {"llama": TinySpec(arch="llama", weight_type="Q4_1", embd_type="Q8_0"),  # Q/K/V and gate/up grouped
         "gemma3": TinySpec(arch="gemma3", n_head=2, n_head_kv=1, head_dim=32, sliding_window=4,
                            weight_type="Q5_0", embd_type="Q8_0")}


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    """A tiny model of each architecture (a DecoderModel)."""
    path = write_tiny_model(tmp_path_factory.mktemp("prof") / f"{request.param}.gguf", SPECS[request.param])
    with edgellm.engine.gguf.open(path) as f:
        yield build_model(f, n_ctx=64, n_threads=1)


def test_every_layer_reports_its_products_and_attention(tiny):
    model = tiny
    model.reset()
    model.forward(np.arange(1, 6, dtype=np.int32))
    times = model.profile_step(np.array([7], dtype=np.int32))
    n_layer = model.config.n_layer
    for il in range(n_layer):
        ops_here = {op for op, layer in times if layer == il}
        assert {"attention", "finish_qkv", "attn_output", "ffn_down"} <= ops_here, (il, ops_here)
        assert ops_here & {"qkv_group", "attn_q"} and ops_here & {"gate_up_group", "ffn_gate"}, (il, ops_here)
    outside = {op for op, layer in times if layer is None}
    assert {"embed", "output", OTHER} <= outside
    assert {layer for _, layer in times} == set(range(n_layer)) | {None}
    assert all(sec >= 0 for sec in times.values()) and sum(times.values()) > 0
    assert model.n_past == 6  # the profiled step is a real step


def test_profiling_leaves_nothing_patched(tiny):
    model = tiny
    tokens = np.arange(1, 6, dtype=np.int32)
    before_ops = dict(vars(ops))
    model.reset()
    model.forward(tokens)
    model.profile_step(np.array([7], dtype=np.int32))
    profiled_next = model.forward(np.array([8], dtype=np.int32)).copy()
    assert dict(vars(ops)) == before_ops
    # no module keeps the timed stand-in (a module named like ops that is not ops); other modules' own `ops`
    # names (the CUDA package's op_kernels) are not the profiler's business
    assert [name for name, mod in list(sys.modules.items())
            if name.startswith("edgellm.") and mod is not None and getattr(mod, "ops", ops) is not ops
            and getattr(getattr(mod, "ops"), "__name__", None) == ops.__name__] == []
    assert type(model.layers) is list
    assert "bound_decode" not in vars(model) and model.bound_decode  # the step's bound callables back on
    assert not any("matmul" in vars(v) for layer in model.layers for v in vars(layer).values() if hasattr(v, "matmul"))
    model.reset()
    model.forward(tokens)
    model.forward(np.array([7], dtype=np.int32))
    plain_next = model.forward(np.array([8], dtype=np.int32))
    np.testing.assert_array_equal(profiled_next, plain_next)


def test_bench_profile_tables(tmp_path):
    """`edgellm bench --profile`'s tables: ops largest first, layers in order then "-" (outside the layers)."""
    m = edgellm.load(str(write_loadable_tiny_model(tmp_path / "tiny.gguf")), n_threads=1, n_ctx=64)
    rows = bench.profile_decode(m, n_tokens=2)
    per_op, per_layer = bench.profile_totals(rows)
    assert list(per_layer) == list(range(m.model.config.n_layer)) + ["-"]
    assert list(per_op.values()) == sorted(per_op.values(), reverse=True)
    md = bench.to_markdown({"results": [], "bandwidth": {}, "peak_rss": 0, "load_s": 0.0, "profile": rows})
    assert "decode profile:" in md and "| attention |" in md and "| 0 |" in md


def test_kernels_compiled_mid_profile_see_the_real_ops(tiny, monkeypatch):
    """A Numba kernel compiled during a profiled step resolves its globals in edgellm.engine.ops: they must be the
    jitted functions, not timers (the profiler times the model modules' calls through a stand-in instead)."""
    model = tiny
    seen = []
    real_forward_batch = model.forward_batch

    def forward_batch(*args, **kwargs):
        seen.append(all(getattr(ops, name) is value for name, value in REAL_OPS.items()))
        return real_forward_batch(*args, **kwargs)

    REAL_OPS = {name: value for name, value in vars(ops).items() if not name.startswith("_") and callable(value)}
    monkeypatch.setattr(model, "forward_batch", forward_batch)
    model.reset()
    times = model.profile_step(np.array([3], dtype=np.int32), n_steps=2)
    assert seen == [True, True]
    assert any(op == "rms_norm" for op, _ in times)  # the model's calls were timed all the same

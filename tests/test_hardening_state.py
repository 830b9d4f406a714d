"""Saved state files are untrusted: every field is checked against the model's cache before anything changes, so
a refused load leaves the model exactly as it was."""
import copy

import numpy as np
import pytest

import hardening_tiny
from edgellm import load
from edgellm.errors import ModelError
from edgellm.generation.state import ModelState


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = hardening_tiny.write_loadable_tiny_model(tmp_path_factory.mktemp("state") / "tiny.gguf")
    return load(str(path), n_ctx=64, n_threads=1)


def _layer(state, il, **changes):
    names = ("slots", "pos", "k", "v", "k_scale", "v_scale")
    layer = dict(zip(names, state.cache["layers"][il]))
    for name, fn in changes.items():
        layer[name] = fn(layer[name])
    state.cache["layers"][il] = tuple(layer[n] for n in names)


BAD = {
    "negative_slot": lambda s: _layer(s, 0, slots=lambda a: np.where(a == a.max(), -1, a)),
    "slot_out_of_range": lambda s: _layer(s, 0, slots=lambda a: a + 1000),
    "duplicate_slot": lambda s: _layer(s, 0, slots=lambda a: np.zeros_like(a)),
    "position_in_wrong_slot": lambda s: _layer(s, 1, pos=lambda a: a[::-1].copy()),
    "position_past_n_past": lambda s: _layer(s, 0, pos=lambda a: a + 50),
    "n_past_negative": lambda s: s.cache.update(n_past=-3),
    "n_past_past_n_ctx": lambda s: s.cache.update(n_past=10_000),
    "missing_layer": lambda s: s.cache.update(layers=s.cache["layers"][:1]),
    "k_shape": lambda s: _layer(s, 0, k=lambda a: a[:, :, :-1].copy()),
    "v_dtype": lambda s: _layer(s, 1, v=lambda a: a.astype(np.float32)),
    "float_slots": lambda s: _layer(s, 0, slots=lambda a: a.astype(np.float64)),
    "token_out_of_vocab": lambda s: s.tokens.__setitem__(0, 1 << 30),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_state_is_refused_and_the_model_is_untouched(tiny, name):
    tiny.generate("hello world", max_tokens=3, temperature=0)
    good = tiny.save_state()
    bad = copy.deepcopy(good)
    BAD[name](bad)
    tiny.generate("another prompt entirely", max_tokens=2, temperature=0)
    before, tokens_before = tiny.model.cache.export_state(), list(tiny._cached_tokens)
    with pytest.raises(ModelError):
        tiny.load_state(bad)
    after = tiny.model.cache.export_state()
    assert tiny._cached_tokens == tokens_before
    assert after["n_past"] == before["n_past"]
    for la, lb in zip(after["layers"], before["layers"]):
        assert all(np.array_equal(x, y) for x, y in zip(la, lb))
    tiny.load_state(good)  # the unmodified snapshot still loads


def test_tampered_state_file_is_refused(tiny, tmp_path):
    tiny.generate("hello world", max_tokens=3, temperature=0)
    path = tmp_path / "s.npz"
    tiny.save_state().save(path)
    with np.load(path) as z:
        arrays = dict(z)
    arrays["l0_slots"] = arrays["l0_slots"] - arrays["l0_slots"].max() - 1  # every slot negative
    np.savez(path, **arrays)
    with pytest.raises(ModelError):
        tiny.load_state(ModelState.load(path))

"""Shared fixtures: the two real models, pulled through the catalog (instant when cached)."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

# Speculation's forward costs are kept on disk between processes (edgellm.generation.cost_store): off here, so that
# no test drafts by what an earlier run, or another test, measured. The tests of that store set it themselves.
os.environ["EDGELLM_SPEC_COSTS"] = "off"

FIXTURES = Path(__file__).parent / "fixtures"
SMOLLM2 = "smollm2-135m"
GEMMA = "gemma-3-270m"
REFERENCE_FILES = {SMOLLM2: "SmolLM2-135M-Instruct.Q4_1", GEMMA: "gemma-3-270m-q4_k_m"}


def _pull(name):
    from edgellm.store import catalog
    return catalog.pull(name, quiet=True)


@pytest.fixture(scope="session")
def smollm2_path():
    return _pull(SMOLLM2)


@pytest.fixture(scope="session")
def gemma_path():
    return _pull(GEMMA)


@pytest.fixture(scope="session", params=[SMOLLM2, GEMMA])
def real_model(request):
    """(catalog name, path) for each real model."""
    return request.param, _pull(request.param)


def load_reference(name):
    """llama.cpp's reference outputs for a catalog model: (json dict, npz mapping)."""
    stem = REFERENCE_FILES[name]
    with open(FIXTURES / f"{stem}.json", encoding="utf-8") as f:
        js = json.load(f)
    return js, np.load(FIXTURES / f"{stem}.npz")


def pytest_collection_modifyitems(session, config, items):
    """Tests marked `background` run last (in their order), so their children have the whole session to finish."""
    items[:] = ([i for i in items if i.get_closest_marker("background") is None]
                + [i for i in items if i.get_closest_marker("background") is not None])


def pytest_collection_finish(session):
    """Queue the child processes of the selected tests marked `background` (tests/background.py)."""
    import background
    if session.config.option.collectonly:
        return
    for item in session.items:
        marker = item.get_closest_marker("background")
        if marker is not None:
            background.submit(marker.kwargs["jobs"](item))


def pytest_sessionfinish(session):
    import background
    background.shutdown()

"""The package structure (docs/architecture.md): edgellm's import graph, read from the source by
tools/import_graph.py, has no cycles, takes no private names across packages, and every function-local import
says why it is there; pyproject.toml installs every package the source holds."""
import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import import_graph  # noqa: E402


def test_the_module_graph_has_no_cycles():
    edges = [e for e in import_graph.imports() if e.top_level]
    assert len(edges) > 100  # the parse found the imports
    assert import_graph.cycles(import_graph.graph(edges)) == []


def test_the_package_graph_has_no_cycles_even_through_function_local_imports():
    g = import_graph.graph(import_graph.imports(), import_graph.unit)
    assert {"edgellm.engine", "edgellm.generation", "edgellm.quant"} <= set(g)
    assert import_graph.cycles(g) == []


def test_the_cycle_finder_finds_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(import_graph.cycles(g)) == [["a", "b", "c"], ["e"]]


def test_no_module_takes_another_packages_private_names():
    assert import_graph.private_reach(import_graph.imports()) == []


def test_private_names_across_packages_are_caught():
    bad = import_graph.Import("edgellm.compat.x", "edgellm.generation.y", ("_hidden",), 1, True)
    same_package = import_graph.Import("edgellm.generation.x", "edgellm.generation.y", ("_hidden",), 1, True)
    assert import_graph.private_reach([bad, same_package]) == [bad]


def test_every_function_local_import_says_why():
    missing = [f"{m}:{line} {stmt}" for m, line, stmt, commented in import_graph.local_imports() if not commented]
    assert missing == []


def test_quant_is_installed_inside_edgellm_and_imported_by_that_name():
    files = import_graph.module_files()
    assert files["edgellm.quant.formats"] == ROOT / "quant" / "formats.py"
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name == "quant" or a.name.startswith("quant.") for a in node.names), module
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module != "quant" and not node.module.startswith("quant."), module


def test_no_source_test_or_tool_imports_the_bare_name_quant():
    # from the repository's root a bare `quant` would import (a second copy of edgellm.quant), so look in the text,
    # code strings that run in subprocesses included
    bare = re.compile(r"(?:^\s*|[\"';]\s*)(?:from|import) quant\b")  # a statement, or one inside a string
    files = [p for d in ("edgellm", "quant", "tests", "tools") for p in (ROOT / d).rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1) if bare.search(line)]
    assert found == []


def test_pyproject_installs_every_package_of_the_source():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    in_source = {m for m, p in import_graph.module_files().items() if p.name == "__init__.py"}
    assert in_source <= listed
    assert listed - in_source == {"edgellm.catalog_data"}  # data only: models/catalog.json

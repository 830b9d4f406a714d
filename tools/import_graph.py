"""edgellm's import graph, read from the source without importing it: which module imports which, and which
package imports which (edgellm.quant included, from the repository's quant/ as pyproject.toml maps it).

    python tools/import_graph.py              # the graph between packages (one line per package)
    python tools/import_graph.py --modules    # the graph between modules
    python tools/import_graph.py --check      # exit 1 on a cycle, a private name taken from another package,
                                              # or a function-local import without a comment saying why

Edges are the imports a module runs when it is imported (its top-level statements, those under `if` and `try`
included); imports inside functions are listed apart, since they run only when called. tests/test_structure.py
asserts the checks.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "edgellm"


@dataclass(frozen=True)
class Import:
    importer: str    # the module whose source holds the statement
    target: str      # the edgellm module it imports
    names: tuple     # the names taken from it (empty for `import x.y`)
    line: int
    top_level: bool  # runs when the importer is imported (not inside a function)


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Package name -> source directory: edgellm/ plus pyproject.toml's package-dir mappings under it."""
    text = (root / "pyproject.toml").read_text()
    try:
        import tomllib  # Python 3.11+; the table is simple enough to read by hand on 3.10
        mapped = tomllib.loads(text)["tool"]["setuptools"].get("package-dir", {})
    except ImportError:
        section = text.split("[tool.setuptools.package-dir]", 1)[-1].split("\n[", 1)[0]
        mapped = dict(re.findall(r'^"([^"]+)"\s*=\s*"([^"]+)"', section, re.M))
    dirs = {PACKAGE: root / PACKAGE}
    dirs.update({name: root / d for name, d in mapped.items() if name.startswith(PACKAGE + ".")})
    return dirs


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the installed package."""
    files = {}
    for pkg, d in package_dirs(root).items():
        for path in sorted(d.rglob("*.py")):
            parts = list(path.relative_to(d).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([pkg] + parts)] = path
    return files


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module
    base = module if is_package else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def _walk(tree: ast.AST):
    """(node, inside a function) for every import statement."""
    stack = [(tree, False)]
    while stack:
        node, in_func = stack.pop()
        for child in ast.iter_child_nodes(node):
            nested = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_func
            stack.append((child, nested))


def imports(root: Path = ROOT) -> list[Import]:
    files = module_files(root)
    out = []
    for module, path in files.items():
        text = path.read_text()
        is_package = path.name == "__init__.py"
        for node, in_func in _walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ImportFrom):
                base = _resolve_from(node, module, is_package)
                if base != PACKAGE and not base.startswith(PACKAGE + "."):
                    continue
                rest = []
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in files:  # `from package import module`
                        out.append(Import(module, sub, (), node.lineno, not in_func))
                    else:
                        rest.append(alias.name)
                if rest:
                    out.append(Import(module, base, tuple(rest), node.lineno, not in_func))
            else:
                for alias in node.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        out.append(Import(module, alias.name, (), node.lineno, not in_func))
    return out


def local_imports(root: Path = ROOT) -> list[tuple[str, int, str, bool]]:
    """(module, line, statement, commented) for every import inside a function, of any package."""
    out = []
    for module, path in module_files(root).items():
        text = path.read_text()
        lines = text.splitlines()
        for node, in_func in _walk(ast.parse(text, str(path))):
            if in_func:
                out.append((module, node.lineno, ast.unparse(node), _commented(lines, node)))
    return sorted(out)


def _commented(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the statement's lines, or on the line above it or above the block of imports it is in."""
    if any("#" in line for line in lines[node.lineno - 1:node.end_lineno]):
        return True
    i = node.lineno - 2
    while i >= 0:
        line = lines[i].strip()
        if "#" in line:
            return True
        if not (line.startswith(("import ", "from ")) or not line):
            return False
        i -= 1
    return False


def unit(module: str) -> str:
    """The package a module belongs to for the package graph: edgellm's subpackage, or the top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2])


def graph(edges: list[Import], of=lambda m: m) -> dict[str, set]:
    g: dict[str, set] = {}
    for e in edges:
        a, b = of(e.importer), of(e.target)
        g.setdefault(a, set())
        g.setdefault(b, set())
        if a != b:
            g[a].add(b)
    return g


def cycles(g: dict[str, set]) -> list[list[str]]:
    """The strongly connected components of more than one node, or with a self-edge (Tarjan's algorithm)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g.get(v, ()):
                found.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def private_reach(edges: list[Import]) -> list[Import]:
    """Imports of another package's _private names (a module's own package may share them)."""
    bad = []
    for e in edges:
        private = [n for n in e.names if n.startswith("_") and not n.startswith("__")]
        private_module = e.target.rsplit(".", 1)[-1].startswith("_") and not e.names
        if (private or private_module) and unit(e.importer) != unit(e.target):
            bad.append(e)
    return bad


def problems(root: Path = ROOT) -> list[str]:
    edges = imports(root)
    out = []
    for comp in cycles(graph([e for e in edges if e.top_level])):
        out.append("module cycle: " + " -> ".join(comp))
    for comp in cycles(graph(edges, unit)):
        out.append("package cycle (function-local imports included): " + " -> ".join(comp))
    for e in private_reach(edges):
        out.append(f"private name: {e.importer}:{e.line} takes {', '.join(e.names) or e.target} from {e.target}")
    for module, line, statement, commented in local_imports(root):
        if not commented:
            out.append(f"function-local import without a comment saying why: {module}:{line} ({statement})")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", action="store_true", help="the graph between modules, not packages")
    ap.add_argument("--check", action="store_true", help="exit 1 on a cycle, private reach-through or an "
                                                         "uncommented function-local import")
    args = ap.parse_args(argv)
    edges = imports()
    if args.check:
        found = problems()
        print("\n".join(found) or "no cycles, no private reach-through, every function-local import says why")
        return 1 if found else 0
    g = graph([e for e in edges if e.top_level], (lambda m: m) if args.modules else unit)
    local = graph([e for e in edges if not e.top_level], (lambda m: m) if args.modules else unit)
    for name in sorted(g):
        line = f"{name} -> {', '.join(sorted(g[name])) or '-'}"
        lazy = sorted(local.get(name, set()) - g[name])
        if lazy:
            line += f"  (when called: {', '.join(lazy)})"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Import structure: the similarity package imports no engine until one is chosen, the
package's module-level import graph has no cycle, and the engines stay below the entry
points (no import of ``consolidate.similarity.api`` or ``consolidate.store``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "consolidate"

#: import cycles (sorted module lists) known in files outside the similarity package, each
#: to be removed from here once fixed; any other cycle fails the test.
KNOWN_CYCLES: list[list[str]] = []


def _modules() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under ``consolidate/``."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt], module_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """Import statements of a body; with ``module_level``, only those that run when the
    module is imported (not inside functions, not under ``if TYPE_CHECKING:``)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if module_level and isinstance(node, ast.If) and _is_type_checking(node):
            found += _import_nodes(node.orelse, module_level)
            continue
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            sub = getattr(node, field, None)
            if isinstance(sub, list):
                found += _import_nodes([s for s in sub if isinstance(s, ast.AST)], module_level)
    return found


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """The innermost module of ``consolidate`` that ``name`` lies in (``None`` if outside)."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(name: str, path: Path, mods: dict[str, Path], module_level: bool) -> set[str]:
    """Modules of ``consolidate`` that module ``name`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _import_nodes(tree.body, module_level):
        if isinstance(node, ast.Import):
            bases = [a.name for a in node.names]
            for b in bases:
                if (m := _known(b, mods)) is not None:
                    out.add(m)
            continue
        if node.level:
            base_parts = package.split(".")
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            m = _known(f"{base}.{alias.name}", mods) if alias.name != "*" else None
            if m != f"{base}.{alias.name}":
                m = _known(base, mods)
            if m is not None:
                out.add(m)
    out.discard(name)
    return out


def _graph(module_level: bool) -> dict[str, set[str]]:
    mods = _modules()
    return {name: _targets(name, path, mods, module_level) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_importing_similarity_imports_no_engine():
    code = (
        "import sys\n"
        "import consolidate.similarity\n"
        "def loaded():\n"
        "    return sorted(m for m in sys.modules\n"
        "                  if m.startswith('consolidate.similarity.engines.')\n"
        "                  or m == 'consolidate.kernels' or m.startswith('consolidate.kernels.')\n"
        "                  or m.split('.')[0] in ('triton', 'faiss'))\n"
        "assert loaded() == [], loaded()\n"
        "import numpy as np\n"
        "from consolidate.similarity import threshold_pairs, topk_neighbours\n"
        "v = np.eye(4, dtype=np.float32)\n"
        "threshold_pairs(v, 0.5, device='cpu'); topk_neighbours(v, v, 2, device='cpu')\n"
        "assert loaded() == ['consolidate.similarity.engines.torch_engine'], loaded()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_graph_sees_the_package():
    graph = _graph(module_level=True)
    assert "consolidate.similarity.api" in graph["consolidate.similarity"]
    assert "consolidate.similarity.types" in graph["consolidate.similarity.engines.torch_engine"]
    lazy = _graph(module_level=False)["consolidate.similarity.engines.triton_engine"]
    assert "consolidate.kernels.triton_join" in lazy  # imported inside a function
    assert (
        "consolidate.kernels.triton_join"
        not in graph["consolidate.similarity.engines.triton_engine"]
    )


def test_cycle_finder_on_a_small_graph():
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},
        "d": set(),
        "e": {"a"},
        "f": {"g"},
        "g": {"f"},
    }
    assert _cycles(graph) == [["a", "b", "c"], ["f", "g"]]


def test_no_import_cycles():
    cycles = _cycles(_graph(module_level=True))
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in new)
    fixed = [c for c in KNOWN_CYCLES if c not in cycles]
    if fixed:
        pytest.fail(f"no longer cycles, remove from KNOWN_CYCLES: {fixed}")


def test_similarity_layers():
    """Every import, also inside functions: the engines never import the entry points (or
    the package, whose ``__init__`` imports them) nor the store; the similarity package
    never imports the store; the leaf modules import nothing from ``consolidate``."""
    bad = []
    for name, targets in _graph(module_level=False).items():
        if not _under(name, "consolidate.similarity"):
            continue
        for t in sorted(targets):
            if _under(t, "consolidate.store"):
                bad.append(f"{name} -> {t}")
            if _under(name, "consolidate.similarity.engines") and (
                t == "consolidate.similarity" or _under(t, "consolidate.similarity.api")
            ):
                bad.append(f"{name} -> {t}")
            if name in ("consolidate.similarity.types", "consolidate.similarity.tiling"):
                bad.append(f"{name} -> {t} (a leaf module)")
    assert not bad, "\n".join(bad)

"""The package's layers point one way: storage imports neither the model layer nor the
similarity engines; the engines and the model backends import nothing from storage. Every
import counts, also one inside a function."""

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

PKG = REPO / "consolidate"

#: layer -> (its files, the packages it must not import)
RULES = {
    "storage": (
        ["store"],
        [
            "consolidate.llm",
            "consolidate.similarity",
            "consolidate.kernels",
            "consolidate.embed",
            "consolidate.pipeline",
            "consolidate.sources",
            "consolidate.jobs",
            "consolidate.evaluation",
            "consolidate.fleet",
        ],
    ),
    "engines": (
        ["similarity", "kernels", "ops/cluster.py", "ops/scoring.py"],
        [
            "consolidate.store",
            "consolidate.llm",
            "consolidate.pipeline",
            "consolidate.sources",
            "consolidate.jobs",
        ],
    ),
    # the stages' algorithms and the text rules they share: no pass state, no storage, no
    # models; the pipeline imports them, never the other way
    "algorithms": (
        ["ops", "text.py", "lexicon.py", "workers.py"],
        [
            "consolidate.pipeline",
            "consolidate.store",
            "consolidate.sources",
            "consolidate.llm",
            "consolidate.embed",
            "consolidate.evaluation",
            "consolidate.jobs",
            "consolidate.fleet",
        ],
    ),
    "library": (
        [
            "factory.py",
            "consolidation.py",
            "evaluation",
            "pipeline",
            "sources",
            "bench",
            "fleet.py",
            "reembed.py",
            "ingest.py",
            "recall.py",
        ],
        ["consolidate.jobs"],
    ),
    "models": (
        ["llm", "embed.py"],
        [
            "consolidate.store",
            "consolidate.similarity",
            "consolidate.pipeline",
            "consolidate.sources",
            "consolidate.jobs",
        ],
    ),
}


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports resolved), at any depth."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    pkg = parts[:-1]
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            base = pkg[: len(pkg) - n.level + 1] if n.level else []
            mod = ".".join(base + ([n.module] if n.module else []))
            out.add(mod)
            if n.module is None:
                out |= {f"{mod}.{a.name}" for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
    return out


def files(entries):
    for e in entries:
        p = PKG / e
        yield from (sorted(p.rglob("*.py")) if p.is_dir() else [p])


@pytest.mark.parametrize("layer", sorted(RULES))
def test_layers_point_one_way(layer):
    entries, banned = RULES[layer]
    bad = [
        f"{p.relative_to(REPO)} imports {m}"
        for p in files(entries)
        for m in sorted(imported(p))
        if any(m == b or m.startswith(b + ".") for b in banned)
    ]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_lazy_relative_import(tmp_path):
    f = PKG / "store" / "locomo.py"
    assert "consolidate.turns" in imported(f) and "consolidate.config" in imported(f)
    assert "consolidate.store.schema" in imported(f)


#: every word list of :mod:`consolidate.lexicon`
_LEXICON = {
    name: frozenset(getattr(__import__("consolidate.lexicon").lexicon, name))
    for name in __import__("consolidate.lexicon").lexicon.__all__
}


def word_list_copies(path: Path) -> list[str]:
    """Literal sets, lists, tuples and dict keys in ``path`` of six or more strings, half or
    more of them words of one :mod:`consolidate.lexicon` list: a copy that can drift."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        elts = n.keys if isinstance(n, ast.Dict) else getattr(n, "elts", None)
        if not isinstance(n, (ast.Set, ast.List, ast.Tuple, ast.Dict)) or elts is None:
            continue
        words = {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        if len(words) < 6:
            continue
        # the list it shares most words with (the smaller one on a tie)
        name = max(_LEXICON, key=lambda k: (len(words & _LEXICON[k]), -len(_LEXICON[k])))
        if len(words & _LEXICON[name]) * 2 >= len(words):
            out.append(f"{path.relative_to(REPO)}:{n.lineno} copies lexicon.{name}")
    return out


def test_word_lists_live_in_the_lexicon():
    bad = [
        c for p in sorted(PKG.rglob("*.py")) if p.name != "lexicon.py" for c in word_list_copies(p)
    ]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_copied_word_list(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    f = tmp_path / "m.py"
    f.write_text('_STOP = {"a", "an", "the", "of", "to", "in", "zebra", "quark"}\nX = ["a", "b"]\n')
    assert word_list_copies(f) == ["m.py:1 copies lexicon.STOP_WORDS"]
    f.write_text('_W = {"monday": 0, "tuesday": 1, "friday": 4, "x": 9, "y": 8, "z": 7}\n')
    assert word_list_copies(f) == ["m.py:1 copies lexicon.WEEKDAYS"]


#: calls that read the machine a result was measured on (consolidate/environment.py)
_ENV_CALLS = {
    ("os", "cpu_count"),
    ("os", "sched_getaffinity"),
    ("platform", "python_version"),
    ("platform", "processor"),
    ("platform", "machine"),
}


def environment_reads(path: Path) -> list[str]:
    """Calls in ``path`` of :data:`_ENV_CALLS`: an environment capture of its own, which
    drifts from the others."""
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        f = n.func if isinstance(n, ast.Call) else None
        if (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and (f.value.id, f.attr) in _ENV_CALLS
        ):
            out.append(f"{where}:{n.lineno} calls {f.value.id}.{f.attr}")
    return out


def test_the_environment_is_read_in_one_module(tmp_path):
    bad = [
        c
        for p in sorted(PKG.rglob("*.py"))
        if p.name != "environment.py"
        for c in environment_reads(p)
    ]
    assert not bad, "\n".join(bad)
    copy = tmp_path / "copy.py"
    copy.write_text("import os\nres = {'cpus': os.cpu_count()}\n")
    assert environment_reads(copy) == [f"{copy}:2 calls os.cpu_count"]


def test_the_environment_module_reads_the_checkout():
    import subprocess

    import numpy as np

    from consolidate.environment import device_name, environment, git_commit, package_versions

    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    if head:  # a git checkout (not an unpacked wheel)
        assert git_commit() == head
        assert head.startswith(git_commit(short=True))
        assert git_commit(short=True, dirty=True).split("+")[0] == git_commit(short=True)
    assert package_versions(("numpy", "no-such-distribution")) == {"numpy": np.__version__}
    assert device_name("cpu").startswith("cpu: ")
    env = environment("cpu")
    assert set(env) == {"git_commit", "packages", "device", "python"} and env["device"] == "cpu"


#: the longest a function may be, in lines (signature and docstring included)
MAX_FUNCTION_LINES = 80

#: the functions allowed over the limit: the Triton launchers (a kernel's grid and
#: arguments in one place); no other may join them
LONG_FUNCTIONS = {
    ("kernels/triton_join.py", "threshold_candidates"),
    ("kernels/triton_join.py", "topk_candidates"),
}


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """``(name, lines)`` of each function in ``path`` longer than ``limit`` lines."""
    return [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > limit
    ]


def test_functions_stay_short(tmp_path):
    found = {
        (str(p.relative_to(PKG)), name): lines
        for p in sorted(PKG.rglob("*.py"))
        for name, lines in long_functions(p)
    }
    new = {k: v for k, v in found.items() if k not in LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines: {new}"
    assert set(found) >= LONG_FUNCTIONS, (
        f"split already, remove from LONG_FUNCTIONS: {sorted(LONG_FUNCTIONS - set(found))}"
    )
    f = tmp_path / "f.py"
    f.write_text("def f():\n" + "    x = 1\n" * 80)
    assert long_functions(f) == [("f", 81)]


def test_tests_mirror_the_package_and_compose_configs_one_way():
    # a folder of tests is named after the package folder it tests; a test composes a job's
    # config through the compose_cfg fixture (tests/helpers.py), never by hand
    tests = REPO / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert folders <= {p.name for p in PKG.iterdir() if p.is_dir()}, folders
    by_hand = [
        str(p.relative_to(REPO))
        for p in sorted(tests.rglob("*.py"))
        if p.name != "helpers.py" and "initialize_config_dir" in calls(p)
    ]
    assert not by_hand, by_hand


def calls(path: Path) -> set[str]:
    """The names of the functions ``path`` calls (``f(...)`` and ``x.f(...)``)."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return out

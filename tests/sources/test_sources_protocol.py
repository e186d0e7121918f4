"""Every registered external source gives the one :class:`~consolidate.sources.base.Source`
interface with the same signatures, so the nightly run and ``consolidate-undo`` call them
alike (no branch on the kind)."""

import ast
import importlib
import inspect

import pytest

from consolidate.sources.base import Source
from consolidate.sources.open import SOURCES
from tests.helpers import REPO

#: kind -> its class (the opener in sources/open.py builds one of these)
CLASSES = {
    "jsonl": "consolidate.sources.files:FileSource",
    "pgvector": "consolidate.sources.pgvector:PgVectorTable",
    "mem0": "consolidate.sources.mem0:Mem0Source",
    "lance": "consolidate.sources.lance_table:LanceTable",
}


def load(ref):
    mod, name = ref.split(":")
    return getattr(importlib.import_module(mod), name)


def test_every_registered_kind_has_a_class_here():
    assert sorted(CLASSES) == sorted(SOURCES.names())


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_the_class_gives_the_source_interface(kind):
    cls = load(CLASSES[kind])
    assert kind == cls.KIND
    for name in ("read", "records", "plan", "apply", "undo"):
        want = inspect.signature(getattr(Source, name))
        got = inspect.signature(getattr(cls, name))
        # the protocol's parameters, in order and of the same kind; a source may add
        # keyword parameters with defaults after them (the Lance table's retries)
        have = list(got.parameters.values())[: len(want.parameters)]
        assert [(p.name, p.kind) for p in have] == [
            (p.name, p.kind) for p in want.parameters.values()
        ], f"{cls.__name__}.{name}{got}"
        extra = list(got.parameters.values())[len(want.parameters) :]
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), (
            f"{cls.__name__}.{name}{got}"
        )
        defaults = [p.default for p in have]
        assert defaults == [p.default for p in want.parameters.values()], name


def test_the_nightly_run_never_branches_on_the_source_kind():
    tree = ast.parse((REPO / "consolidate" / "consolidation.py").read_text())
    kinds = set(CLASSES)
    bad = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Compare)
        and any(isinstance(c, ast.Constant) and c.value in kinds for c in n.comparators)
    ]
    assert not bad, f"consolidation.py compares with a source kind at lines {bad}"

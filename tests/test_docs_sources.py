"""The blocks of docs/sources.md run as written, as a new user would run them in an empty
folder: each builds a store with its own API (a memory file, a LanceDB table, a Mem0 store
on local Qdrant, a pgvector table on the real server), consolidates it, checks it with the
store's own API, undoes the pass and checks again."""

import pytest

from tests.helpers import run_readme_example

PORTO, PORTO2, SUNDAYS = (
    "Ben's sister lives in Porto.",
    "Ben's sister lives in Porto!",
    "Ben runs on Sundays.",
)
ALL = "live: " + " ".join(sorted([PORTO, PORTO2, SUNDAYS]))


def lives(out):
    return [ln for ln in out.splitlines() if ln.startswith("live:")]


def run(name, tmp_path, env=None):
    p = run_readme_example(name, tmp_path, env, doc="docs/sources.md")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def merged_then_all(out):
    """One merge of the two Porto notes applied, then undone: every note live again."""
    assert "applied          1 merge" in out
    first, second = lives(out)[:2]
    assert SUNDAYS in first and first.count("Porto") == 1, first
    assert second == ALL
    assert "undid 1 unit(s) of plan " in out and "restored 2 records" in out


def test_a_memory_file(tmp_path):
    out = run("files-undo", tmp_path)
    merged_then_all(out)
    assert "undone before, nothing done: 1 unit(s)" in out
    assert out.count("applied          nothing") == 1  # the pass after the undo
    assert lives(out)[2] == ALL


@pytest.mark.slow
def test_a_lancedb_table(tmp_path):
    pytest.importorskip("lancedb")
    merged_then_all(run("lance-undo", tmp_path))
    import lancedb

    df = lancedb.connect(str(tmp_path / "agents.lancedb")).open_table("memories").to_pandas()
    assert (df["tags"] == "agent").sum() >= 3  # the user's column kept on restored rows


@pytest.mark.slow
def test_a_mem0_store(tmp_path):
    pytest.importorskip("mem0")
    merged_then_all(run("mem0-undo", tmp_path))


@pytest.mark.slow
def test_a_pgvector_table(pg, tmp_path):
    merged_then_all(run("pgvector-undo", tmp_path, {"DATABASE_URL": pg}))

"""The store issue's attacks, replayed against the Lance store (the default format): a lost
marker, a full disk during a commit, a job on a folder without a marker (times in the
future: tests/store/test_hardening.py, for both formats)."""

import subprocess
import sys

import pytest

from consolidate.store.lance import LanceStore
from tests.helpers import REPO, make_records, tree_digest
from tests.store.test_hardening import GOOD

pytest.importorskip("lance")


@pytest.fixture
def store(tmp_path):
    s = LanceStore(tmp_path / "store")
    s.create(make_records([{**GOOD, "id": "a"}, {**GOOD, "id": "b", "text": "other"}]))
    return s


def test_create_refuses_a_folder_that_lost_its_marker(store):
    store.pointer_path.unlink()
    before = tree_digest(store.root)
    with pytest.raises(FileExistsError, match="not empty and holds no store"):
        LanceStore(store.root).create(make_records([{**GOOD, "id": "z"}]))
    assert tree_digest(store.root) == before


def test_create_refuses_existing_versions(store):
    """A marker that names another format, or none, never lets create write over the
    dataset's versions."""
    before = tree_digest(store.root)
    with pytest.raises(FileExistsError):
        LanceStore(store.root).create(make_records([{**GOOD, "id": "z"}]))
    assert tree_digest(store.root) == before


@pytest.mark.parametrize("where", ["changelog", "fragments"])
@pytest.mark.parametrize("shards", [False, True], ids=["commit", "commit_changes"])
def test_a_full_disk_during_a_commit_writes_nothing(store, monkeypatch, where, shards):
    """ENOSPC while the changelog or the new fragments are written: no new version, no
    orphan changelog, the deltas still pending, and the next commit works."""
    import lance

    import consolidate.store.lance.writing as ls

    store.mark_used(["a"], now=20.0)
    snap = store.load()
    records = snap.records.take(list(range(len(snap.records))))  # a copy
    records.meta.loc[records.meta["id"] == "b", "importance"] = 0.9
    before = tree_digest(store.root)

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    if where == "changelog":
        monkeypatch.setattr(ls, "_write_jsonl", full_disk)
    else:  # the new fragments of an upsert, or the table of a rewrite
        monkeypatch.setattr(lance.fragment, "write_fragments", full_disk)
        monkeypatch.setattr(lance, "write_dataset", full_disk)

    def commit():
        with store.lock():
            if shards:
                upsert, removed = store.changes(records, snap)
                return store.commit_changes(
                    upsert,
                    removed,
                    [],
                    base_version=snap.version,
                    folded=snap.deltas,
                    namespaces=None,
                )
            return store.commit(records, [], base=snap)

    with pytest.raises(OSError, match="No space left"):
        commit()
    assert tree_digest(store.root) == before
    assert store.head().version == snap.version
    monkeypatch.undo()
    info = commit()
    after = store.load()
    assert info["version"] == after.version > snap.version and after.deltas == ()
    m = after.records.meta.set_index("id")
    assert m.loc["b", "importance"] == 0.9 and m.loc["a", "strength"] == 2.0


def test_job_on_a_lance_folder_without_marker_does_not_reimport(tmp_path, store):
    store.pointer_path.unlink()
    before = tree_digest(store.root)
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "consolidate.jobs.consolidate",
            f"hydra.run.dir={tmp_path}/run",
            f"store.dir={store.root}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and "holds no store" in r.stderr
    assert tree_digest(store.root) == before


def test_a_damaged_index_file_slows_reads_but_loses_nothing_and_reindex_mends_it(tmp_path, caplog):
    """The scalar indexes are derived data: with their files garbled, reads that use them
    go on without them and warn; `consolidate-versions action=reindex` rebuilds them."""
    from omegaconf import OmegaConf

    from consolidate.jobs.versions import run_versions

    rows = [
        {**GOOD, "id": f"r{i}", "namespace": f"u{i % 3}", "text": f"fact {i}"} for i in range(30)
    ]
    s = LanceStore(tmp_path / "s")
    s.create(make_records(rows))
    want = s.read_rows(s.head().version, ["u1"]).sort_by("id")
    files = [p for p in (s.dataset_path / "_indices").rglob("*") if p.is_file()]
    assert len(files) >= 2  # the id and the namespace index
    for p in files:
        b = bytearray(p.read_bytes())
        b[: min(len(b), 64)] = b"\0" * min(len(b), 64)
        p.write_bytes(bytes(b))
    with caplog.at_level("WARNING", logger="consolidate"):
        assert s.read_rows(s.head().version, ["u1"]).sort_by("id").equals(want)
        assert sorted(s.load(namespaces=["u1"]).records.meta["id"]) == sorted(
            want.column("id").to_pylist()
        )
        s.mark_used(["r4"], now=20.0)
        assert s.append(make_records([{**GOOD, "id": "new"}])) == ["new"]
        with pytest.raises(Exception, match="duplicate"):  # the id check still works
            s.append(make_records([{**GOOD, "id": "r5"}]))
    assert "cannot be read" in caplog.text and "action=reindex" in caplog.text
    cfg = OmegaConf.create(
        {
            "store": {"name": "x", "dir": str(s.root), "init_from": None},
            "action": "reindex",
            "version": None,
            "other": None,
            "ids": [],
            "out": None,
            "dry_run": False,
        }
    )
    assert run_versions(cfg)["indexes"] == ["id", "namespace"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="consolidate"):
        recs = s.load().records
    assert "cannot be read" not in caplog.text
    assert len(recs) == 31 and recs.meta.set_index("id").loc["r4", "last_used"] == 20.0
    assert s.verify()["digest"] is True  # the version reindex left is recorded

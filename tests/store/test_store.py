"""Snapshots, atomic swap, deltas, recall bookkeeping, lock, concurrency, undo."""

import json
import math
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from consolidate.config import PassConfig
from consolidate.pipeline import run_pass, trigger, undo_merge
from consolidate.store import (
    ConcurrentCommitError,
    LockTimeoutError,
    MemoryBatch,
    Store,
    StoreNotFoundError,
)
from consolidate.store.schema import hours_now
from tests.helpers import REPO, make_records


def base_rows():
    return [
        {
            "id": "a",
            "namespace": "u",
            "text": "uses vim",
            "vector": [1.0, 0.0, 0.0],
            "importance": 0.6,
            "created_at": 100.0,
            "last_used": 100.0,
            "source_ids": ["D1:1"],
        },
        {
            "id": "b",
            "namespace": "u",
            "text": "Uses  VIM.",
            "vector": [1.0, 0.01, 0.0],
            "importance": 0.4,
            "created_at": 110.0,
            "last_used": 110.0,
            "source_ids": ["D1:2"],
        },
        {
            "id": "c",
            "namespace": "u",
            "text": "lunch was soup",
            "vector": [0.0, 1.0, 0.0],
            "importance": 0.9,
            "created_at": 120.0,
            "last_used": 120.0,
        },
        {
            "id": "d",
            "namespace": "v",
            "text": "uses vim",
            "vector": [1.0, 0.0, 0.0],
            "importance": 0.5,
            "created_at": 120.0,
            "last_used": 120.0,
            "pinned": True,
        },
    ]


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store", keep_snapshots=2)
    s.create(make_records(base_rows()))
    return s


def test_roundtrip_and_batch(store):
    snap = store.load()
    assert snap.version == 1 and snap.dim == 3 and len(snap.records) == 4
    m = snap.records.meta.set_index("id")
    assert m.loc["a", "source_ids"] == ["D1:1"] and m.loc["c", "source_ids"] == []
    assert m.loc["d", "pinned"] and m.loc["a", "last_used"] == 100.0
    assert m.loc["a", "text_hash"] == m.loc["b", "text_hash"]  # normalised text
    b = snap.batch("cpu")
    assert isinstance(b, MemoryBatch) and len(b) == 4
    assert b.vectors.dtype.is_floating_point and tuple(b.vectors.shape) == (4, 3)
    assert str(b.last_used.dtype) == "torch.float64"
    assert b.namespaces == ["u", "v"] and b.namespace.tolist() == [0, 0, 0, 1]
    np.testing.assert_allclose(b.vectors.norm(dim=1).numpy(), 1.0, atol=1e-6)


def test_missing_store(tmp_path):
    with pytest.raises(StoreNotFoundError, match="no store"):
        Store(tmp_path / "nope").load()
    with pytest.raises(FileExistsError):
        s = Store(tmp_path / "s")
        s.create(make_records(base_rows()))
        s.create(make_records(base_rows()))


def commit_pass(store, **kw):
    cfg = PassConfig(threshold=0.95, now="200", tau_hours=1e6, floor=0.0, **kw)
    with store.lock():
        snap = store.load()
        res = run_pass(snap.records, cfg=cfg, version=snap.version + 1, wall_h=300.0)
        info = store.commit(res.records, res.events, base=snap)
    return snap, res, info


def test_pass_commit_swaps_pointer_and_keeps_history(store):
    _, res, info = commit_pass(store)
    assert info["version"] == 2
    assert json.loads(store.pointer_path.read_text())["version"] == 2
    snap = store.load()
    live = snap.records.meta[snap.records.live_mask()]
    # a and b are exact duplicates (normalised text) in namespace u; d is pinned in v
    assert sorted(live["id"].str[:2]) == ["c", "d", "m-"]
    merged = live[live["id"].str.startswith("m-")].iloc[0]
    assert merged["source_ids"] == ["D1:1", "D1:2"] and merged["strength"] == 2.0
    assert res.stats["exact_merges"] == 1 and res.stats["model_calls"] == 0
    log = (store.root / "changelogs" / info["changelog"]).read_text().splitlines()
    assert json.loads(log[0])["op"] == "exact_merge"
    # a pass with nothing to change writes no new version
    _, _, same = commit_pass(store, force=True)
    assert same == {"version": 2, "snapshot": None, "changelog": None, "carried_records": 0,
                    "carried_touches": 0, "unchanged": True}  # fmt: skip
    assert store.snapshots() == [1, 2] and store.head().version == 2
    # retention: keep_snapshots=2 (each pass has a new memory to keep)
    for k in (3, 4):
        store.append([{**base_rows()[2], "id": f"new{k}", "text": f"fact {k}", "created_at": 250.0,
                       "last_used": 250.0}])  # fmt: skip
        assert commit_pass(store, force=True)[2]["version"] == k
    assert store.snapshots() == [3, 4]
    assert sorted(p.name for p in (store.root / "changelogs").iterdir()) == [
        "changelog-000003.jsonl",
        "changelog-000004.jsonl",
    ]


def test_dry_run_writes_only_the_changelog(store):
    before = store.pointer_path.read_bytes()
    with store.lock():
        snap = store.load()
        res = run_pass(snap.records, cfg=PassConfig(threshold=0.95, now="200"), version=2)
        info = store.commit(res.records, res.events, base=snap, dry_run=True)
    assert info["snapshot"] is None and info["changelog"].startswith("dry-run-000002")
    assert store.pointer_path.read_bytes() == before and store.snapshots() == [1]


def test_trigger_counts_only_unseen_memories(store):
    fire, imp = trigger(store.load().records, 2.4)
    assert fire and imp == pytest.approx(0.6 + 0.4 + 0.9 + 0.5)
    commit_pass(store)
    assert trigger(store.load().records, 0.1) == (False, 0.0)
    store.append(
        [
            {
                "id": "e",
                "namespace": "u",
                "text": "new fact",
                "vector": [0, 0, 1.0],
                "importance": 0.7,
                "last_used": 150.0,
            }
        ]
    )
    fire, imp = trigger(store.load().records, 0.5)
    assert fire and imp == pytest.approx(0.7)


def test_mark_used_with_strength_cap(store):
    store.mark_used(["a", "c"], now=500.0, strength_cap=2.0)
    store.mark_used(["a"], now=400.0, strength_cap=2.0)
    m = store.load().records.meta.set_index("id")
    assert m.loc["a", "strength"] == 2.0 and m.loc["a", "last_used"] == 500.0
    assert m.loc["c", "strength"] == 2.0 and m.loc["b", "strength"] == 1.0
    with pytest.raises(KeyError, match="zzz"):
        store.mark_used(["zzz"])


def test_writes_during_a_pass_are_carried(store):
    """Deterministic interleaving: a writer appends and recalls between the pass's read and
    its commit; every write is in the new snapshot."""
    store.append(
        [
            {
                "id": "early",
                "namespace": "u",
                "text": "early fact",
                "vector": [0, 0, 1.0],
                "importance": 0.3,
                "last_used": 130.0,
            }
        ]
    )
    with store.lock():
        snap = store.load()
        assert "early" in set(snap.records.meta["id"])
        res = run_pass(
            snap.records,
            cfg=PassConfig(threshold=0.95, now="200", floor=0),
            version=2,
            wall_h=300.0,
        )
        # --- a writer runs while the pass works (no lock needed for writers)
        late = [
            {
                "id": f"late{k}",
                "namespace": "u",
                "text": f"late fact {'xyz'[k]}",
                "vector": [0.1 * k, 1.0, 1.0],
                "importance": 0.5,
                "last_used": 140.0,
            }
            for k in range(3)
        ]
        store.append(late)
        store.mark_used(["a"], now=250.0)  # a is being merged by this pass
        # ---
        info = store.commit(res.records, res.events, base=snap)
    assert info["carried_records"] == 3 and info["carried_touches"] == 1
    after = store.load()
    assert after.deltas == ()  # all folded into snapshot 2
    m = after.records.meta.set_index("id")
    for k in range(3):
        assert m.loc[f"late{k}", "deleted_at"] != m.loc[f"late{k}", "deleted_at"]  # NaN: live
        assert math.isnan(m.loc[f"late{k}", "last_pass"])  # not consolidated yet
    merged_id = m.loc["a", "merged_into"]
    assert m.loc[merged_id, "last_used"] == 250.0 and m.loc[merged_id, "strength"] == 3.0
    assert not any((store.root / "deltas").iterdir())


def test_compare_and_swap(store):
    snap = store.load()
    commit_pass(store)
    with store.lock(), pytest.raises(ConcurrentCommitError, match="version 2"):
        store.commit(snap.records, [], base=snap)


def test_lock_is_exclusive_and_released_by_a_crash(store):
    with store.lock(), pytest.raises(LockTimeoutError, match="locked"), store.lock(timeout_s=0.3):
        pass
    code = (
        f"import os, signal; from consolidate.store import Store\n"
        f"s = Store({str(store.root)!r})\n"
        f"with s.lock():\n    print('held', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == -9 and "held" in p.stdout
    t = time.monotonic()
    with store.lock(timeout_s=5):
        assert time.monotonic() - t < 1


def test_undo_restores_members(store):
    _, res, _ = commit_pass(store)
    mid = next(e["id"] for e in res.events if e["op"] == "exact_merge")
    with store.lock():
        snap = store.load()
        recs = undo_merge(snap.records, mid, wall_h=400.0)
        store.commit(recs, [{"op": "undo", "id": mid}], base=snap)
    m = store.load().records.meta.set_index("id")
    assert math.isnan(m.loc["a", "deleted_at"]) and m.loc["a", "merged_into"] is None
    assert math.isnan(m.loc["b", "deleted_at"])
    assert m.loc[mid, "deleted_reason"] == "undone"
    with pytest.raises(ValueError, match="already undone"):
        undo_merge(store.load().records, mid)
    with pytest.raises(KeyError, match="no record with id"):
        undo_merge(store.load().records, "m-doesnotexist")


def test_an_undo_sticks_across_later_passes(store):
    _, res, _ = commit_pass(store)
    mid = next(e["id"] for e in res.events if e["op"] == "exact_merge")
    with store.lock():
        snap = store.load()
        store.commit(undo_merge(snap.records, mid, wall_h=400.0), [], base=snap)
    m = store.load().records.meta.set_index("id")
    assert m.loc["a", "keep_apart"] == ["b"] and m.loc["b", "keep_apart"] == ["a"]
    _, res, _ = commit_pass(store, force=True)
    assert not [
        e
        for e in res.events
        if e["op"] in ("merge", "exact_merge") and {"a", "b"} <= set(e["members"])
    ]
    live = store.load().records
    assert {"a", "b"} <= set(live.meta["id"][live.live_mask()])


def test_patch_deletes_updates_and_closes_validity(store):
    store.append(
        [
            {
                "id": "c2",
                "namespace": "u",
                "text": "lunch was pasta",
                "vector": [0.0, 0.9, 0.1],
                "importance": 0.5,
                "last_used": 130.0,
            }
        ]
    )
    t0 = hours_now()
    store.patch(
        [
            {"id": "c", "op": "delete", "into": "c2"},
            {"id": "a", "op": "close", "valid_to": 150.0},
            {"id": "b", "op": "delete"},
        ],
        now=160.0,
    )
    t1 = hours_now()
    m = store.load().records.meta.set_index("id")
    assert (m.loc["c", "deleted_reason"], m.loc["c", "merged_into"]) == ("updated", "c2")
    # deleted_at is when the store retired the row (wall clock), not the fact's time (160):
    # the tombstone retention window counts from it
    assert m.loc["b", "deleted_reason"] == "deleted" and t0 <= m.loc["b", "deleted_at"] <= t1
    assert m.loc["a", "valid_to"] == 150.0 and math.isnan(m.loc["a", "deleted_at"])
    with pytest.raises(ValueError, match="pinned"):
        store.patch([{"id": "d", "op": "delete"}])
    with pytest.raises(KeyError, match="zz"):
        store.patch([{"id": "zz", "op": "delete"}])
    # a pass folds the patch into the snapshot; the tombstones stay restorable
    commit_pass(store, force=True)
    m = store.load().records.meta.set_index("id")
    assert m.loc["b", "deleted_reason"] == "deleted" and not any((store.root / "deltas").iterdir())


def test_patch_written_during_a_pass_is_carried(store):
    with store.lock():
        snap = store.load()
        res = run_pass(
            snap.records,
            cfg=PassConfig(threshold=0.95, now="200", floor=0),
            version=2,
            wall_h=300.0,
        )
        store.patch([{"id": "c", "op": "close", "valid_to": 250.0}])
        info = store.commit(res.records, res.events, base=snap)
    assert info["carried_touches"] == 1
    assert store.load().records.meta.set_index("id").loc["c", "valid_to"] == 250.0


def test_patch_of_a_record_merged_meanwhile_follows_merged_into(tmp_path):
    s = Store(tmp_path / "s")
    s.create(
        make_records(
            [
                {"id": "A", "namespace": "u", "text": "Gina lives in Porto", "vector": [1.0, 0.0]},
                {"id": "B", "namespace": "u", "text": "gina lives in porto.", "vector": [1.0, 0.0]},
                {"id": "C", "namespace": "u", "text": "Gina likes tea", "vector": [0.0, 1.0]},
                {"id": "D", "namespace": "u", "text": "Gina likes tea!", "vector": [0.0, 1.0]},
            ]
        )
    )
    with s.lock():
        snap = s.load()
        res = run_pass(snap.records, cfg=PassConfig(now="0", decay=False), version=2, wall_h=20.0)
        # the write path closes A and deletes C while the pass runs
        s.patch(
            [{"id": "A", "op": "close", "valid_to": 18.0}, {"id": "C", "op": "delete"}], now=19.0
        )
        s.commit(res.records, res.events, base=snap)
    m = s.load().records.meta.set_index("id")
    porto, tea = m.loc["A", "merged_into"], m.loc["C", "merged_into"]
    assert m.loc[porto, "valid_to"] == 18.0  # the merged record holds A's fact: closed
    assert (
        m.loc[tea, "deleted_reason"] == "deleted" and m.loc[tea, "deleted_at"] > 19.0
    )  # retired now


def test_create_stores_unit_vectors_like_append(tmp_path):
    rows = [
        {
            "id": f"n{k}",
            "namespace": "u",
            "text": f"fact {w}",
            "vector": v,
            "importance": 0.5,
            "created_at": 1.0,
            "last_used": 1.0,
        }
        for k, (w, v) in enumerate(
            [("a", [3.0, 0.0, 0.0]), ("b", [0.0, 0.99, 0.0]), ("c", [0.0, 0.0, 0.1])]
        )
    ]
    from consolidate.store.schema import records_from_rows

    s = Store(tmp_path / "s")
    snap = s.create(records_from_rows(rows))  # not normalised by the caller
    np.testing.assert_allclose(snap.records.vectors, np.eye(3), atol=1e-7)
    s.append([{**rows[0], "id": "n9", "vector": [0.0, 2.0, 0.0]}])
    np.testing.assert_allclose(s.load().records.vectors[-1], [0.0, 1.0, 0.0], atol=1e-7)


@pytest.mark.parametrize("fmt", ["parquet", "lance"])
def test_append_leaves_the_callers_records_as_they_were(tmp_path, fmt):
    from consolidate.store import open_store_dir
    from consolidate.store.schema import records_from_rows

    s = open_store_dir(tmp_path / "s", format=fmt)
    s.create(make_records(base_rows()))
    new = records_from_rows(
        [
            {
                "id": "n1",
                "namespace": "u",
                "text": "fact",
                "importance": 0.5,
                "vector": [0.0, 3.0, 4.0],
                "created_at": 1.0,
                "last_used": 1.0,
                "last_pass": 2.0,
            }
        ]
    )
    s.append(new)
    # the same records appended to a second store give the same stored row
    np.testing.assert_array_equal(new.vectors, [[0.0, 3.0, 4.0]])
    assert new.meta["last_pass"].tolist() == [2.0]
    np.testing.assert_allclose(s.load().records.vectors[-1], [0.0, 0.6, 0.8], atol=1e-7)


@pytest.mark.parametrize("fmt", ["parquet", "lance"])
def test_create_leaves_the_callers_records_as_they_were(tmp_path, fmt):
    from consolidate.store import open_store_dir
    from consolidate.store.schema import records_from_rows

    rows = [
        {
            "id": "a",
            "namespace": "u",
            "text": "fact",
            "importance": 0.5,
            "vector": [0.0, 3.0, 4.0],
            "created_at": 1.0,
            "last_used": 1.0,
        }
    ]
    recs = records_from_rows(rows)
    before = recs.meta.copy()
    open_store_dir(tmp_path / "s", format=fmt).create(recs)
    # a second store created from the same records gets the same rows
    np.testing.assert_array_equal(recs.vectors, [[0.0, 3.0, 4.0]])
    pd.testing.assert_frame_equal(recs.meta, before)
    b = open_store_dir(tmp_path / "b", format=fmt)
    b.create(recs)
    np.testing.assert_array_equal(b.load().records.vectors, np.array([[0.0, 0.6, 0.8]], np.float32))


def test_mark_used_caps_strength_like_the_pass_by_default(tmp_path):
    from consolidate.config import PassConfig
    from consolidate.store.schema import DEFAULT_STRENGTH_CAP

    assert PassConfig().strength_cap == DEFAULT_STRENGTH_CAP == 20.0
    s = Store(tmp_path / "s")
    s.create(
        make_records([{**base_rows()[0], "strength": 19.5}, {**base_rows()[2], "strength": 3.0}])
    )
    s.mark_used(["a", "c"], now=200.0)
    s.mark_used(["a"], now=201.0)
    m = s.load().records.meta.set_index("id")
    assert m.loc["a", "strength"] == 20.0 and m.loc["c", "strength"] == 4.0
    s.mark_used(["a"], now=202.0, strength_cap=None)  # an explicit opt-out
    assert s.load().records.meta.set_index("id").loc["a", "strength"] == 21.0


def test_an_in_place_change_is_committed_and_a_no_change_is_not(store):
    """The Parquet commit compares with the stored snapshot, not with the records read: a
    change made in place on the snapshot's own records is a change."""
    v = store.head().version

    def pin(snap):
        r = snap.records
        r.meta.loc[0, "pinned"] = True  # in place
        return r, [{"op": "pin"}]

    info = store.transact(pin)
    assert info["version"] == v + 1 and not info.get("unchanged")
    assert bool(store.load().records.meta.loc[0, "pinned"]) is True
    same = store.transact(lambda snap: (snap.records, []))
    assert same["unchanged"] is True and store.head().version == v + 1


def test_the_store_loads_without_torch_until_a_batch_is_named():
    """A process that only reads a store (a fleet run's read tasks, ``consolidate-versions``)
    does not import torch; ``MemoryBatch`` and ``resolve_device`` still come from the
    package, loading it when named."""
    code = (
        "import sys\n"
        "import consolidate.store, consolidate.store.lance.shards\n"
        "import consolidate.jobs.versions\n"
        "print('torch' in sys.modules)\n"
        "from consolidate.store import MemoryBatch, resolve_device\n"
        "print('torch' in sys.modules, MemoryBatch.__module__, resolve_device.__module__)\n"
        "try:\n"
        "    consolidate.store.NoSuchThing\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == [
        "False",
        "True consolidate.store.batch consolidate.device",
        "module 'consolidate.store' has no attribute 'NoSuchThing'",
    ]

"""The Lance store: the Store interface on a Lance dataset, commits of only what changed,
writers during a pass, crashes at each commit step, concurrent writer processes, convert."""

import json
import math
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from consolidate.config import PassConfig
from consolidate.pipeline import run_pass, trigger, undo_merge
from consolidate.store import ConcurrentCommitError, InvalidRecordsError, Store
from consolidate.store.lance import LanceStore, convert, open_store_dir, store_format
from consolidate.store.lance.changes import _changes, _diff
from consolidate.store.schema import records_to_arrow
from tests.helpers import REPO, crash_pass_result, make_records, random_rows
from tests.store.test_store import base_rows, commit_pass

pytest.importorskip("lance")


@pytest.fixture(autouse=True)
def upsert_always(monkeypatch):
    """These stores are tiny: commit changes as upserts, never as a rewrite (the rewrite
    path has its own test)."""
    import consolidate.store.lance.writing as ls

    monkeypatch.setattr(ls, "REWRITE_FRACTION", 1.01)


@pytest.fixture
def store(tmp_path):
    s = LanceStore(tmp_path / "store", keep_snapshots=2)
    s.create(make_records(base_rows()))
    return s


def live_ids(snap):
    return set(snap.records.meta["id"][snap.records.live_mask()])


def test_roundtrip_matches_the_parquet_store(tmp_path, store):
    p = Store(tmp_path / "pq")
    p.create(make_records(base_rows()))
    a, b = store.load(), p.load()
    assert a.records.meta.drop(columns=[]).equals(b.records.meta)
    np.testing.assert_array_equal(a.records.vectors, b.records.vectors)
    assert store_format(store.root) == "lance" and store_format(p.root) == "parquet"
    assert store_format(tmp_path / "none") is None
    assert isinstance(open_store_dir(store.root), LanceStore)
    assert type(open_store_dir(p.root)) is Store
    assert isinstance(open_store_dir(tmp_path / "new"), LanceStore)
    assert type(open_store_dir(tmp_path / "new", format="parquet")) is Store
    with pytest.raises(ValueError, match="lance' or 'parquet"):
        open_store_dir(tmp_path / "new", format="csv")


def test_pass_commit_writes_only_changed_rows(store):
    _, res, info = commit_pass(store)
    # first pass: the 4 unseen rows get last_pass, a+b merge (2 tombstones) + 1 new row
    assert info["rows_written"] == 5 and info["rows_deleted"] == 0
    after = store.load()
    assert sorted(i[:2] for i in live_ids(after)) == ["c", "d", "m-"]
    log = (store.root / "changelogs" / info["changelog"]).read_text().splitlines()
    assert json.loads(log[0])["op"] == "exact_merge"
    # a second pass over unchanged records writes nothing, and no version
    _, _, info2 = commit_pass(store, force=True)
    assert info2["rows_written"] == 0 and info2["rows_deleted"] == 0 and info2["unchanged"]
    assert store.load().records.meta.equals(after.records.meta)
    v = store.versions()
    assert v[-1]["op"] == "pass" and v[-1]["version"] == info["version"] == info2["version"]
    assert v[-1]["changelog"] == info["changelog"]
    # time travel: the version before the first pass still reads as it was
    old = store._open(info["version"] - 1).to_table()
    assert old.num_rows == 4


def test_a_commit_that_changes_most_rows_rewrites(store, monkeypatch):
    import consolidate.store.lance.writing as ls

    monkeypatch.setattr(ls, "REWRITE_FRACTION", 0.25)
    before = store.load()
    _, _, info = commit_pass(store)  # 5 of 5 rows changed or new
    assert info["rewrite"] and info["rows_written"] == 5 and info["rows_deleted"] == 0
    _, _, info = commit_pass(store, force=True)  # nothing changed: an empty upsert
    assert not info["rewrite"] and info["rows_written"] == 0
    assert set(before.records.meta["id"]) < set(store.load().records.meta["id"])


def test_changes_compares_every_column_and_vector():
    recs = make_records(base_rows())
    stored = records_to_arrow(recs, with_vectors=False)
    vecs = recs.vectors.copy()
    meta = recs.meta.copy()
    meta.loc[1, "strength"] = 7.0  # a number
    meta.at[2, "source_ids"] = ["D9:9"]  # a list
    meta.loc[3, "deleted_reason"] = None  # None vs None: unchanged
    new_vecs = vecs.copy()
    new_vecs[0, 2] = np.nextafter(new_vecs[0, 2], 1)  # one ulp of one component
    from consolidate.store.schema import Records

    final = Records(meta, new_vecs)
    rows, gone, dead = _changes(
        records_to_arrow(final, with_vectors=False), new_vecs, stored, [vecs[:2], vecs[2:]]
    )
    assert rows.tolist() == [0, 1, 2] and gone == [] and dead.tolist() == [0, 1, 2]
    rows, gone, dead = _changes(
        records_to_arrow(recs.take([0, 2]), with_vectors=False), vecs[[0, 2]], stored, [vecs]
    )
    assert rows.tolist() == [] and gone == ["b", "d"] and dead.tolist() == [1, 3]
    # the in-memory comparison gives the same answers, with and without row origins
    frame, ids = recs.meta.copy(deep=False), stored.column("id")
    for origin in (None, np.arange(4)):
        final.origin = origin
        rows, dead, gone = _diff(final, [frame.iloc[:2], frame.iloc[2:]], [vecs[:2], vecs[2:]], ids)
        assert rows.tolist() == [0, 1, 2] and dead.tolist() == [0, 1, 2] and gone == []
    kept = recs.take([0, 2])
    assert _diff(kept, [frame], [vecs], ids) is None  # no origins, not in stored order
    kept.origin = np.array([0, 2])
    rows, dead, gone = _diff(kept, [frame], [vecs], ids)
    assert rows.tolist() == [] and dead.tolist() == [1, 3] and gone == ["b", "d"]


def test_diff_matches_the_arrow_comparison_on_random_passes():
    """_diff (in memory, by origin) and _changes (Arrow, hash join on ids) agree on random
    edits: purges, new rows, edited numbers, texts, lists, None/NaN, vectors, reordering;
    a wrong origin or a stored id reused by a new row makes _diff decline."""
    from consolidate.store.schema import Records

    rng = np.random.default_rng(7)
    n, d = 400, 8
    v = rng.normal(size=(n, d)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    recs = make_records(
        [
            {
                "id": f"r{k}",
                "namespace": f"u{k % 7}",
                "text": f"fact {k}",
                "vector": v[k].tolist(),
                "importance": 0.5,
                "source_ids": [f"D{k}"] if k % 3 else [],
            }
            for k in range(n)
        ]
    )
    stored = records_to_arrow(recs, with_vectors=False)
    frame = recs.meta.copy(deep=False)
    for trial in range(30):
        keep = np.sort(rng.choice(n, n - int(rng.integers(0, 20)), replace=False))
        if trial % 5 == 4:
            keep = rng.permutation(keep)  # a reordering pass
        out = recs.take(keep)
        out.origin = keep.copy()
        meta, vecs = out.meta.copy(), out.vectors.copy()
        for r in rng.choice(len(out), 10, replace=False):
            c = rng.integers(0, 5)
            if c == 0:
                meta.loc[r, "strength"] = float(meta.loc[r, "strength"]) + 1
            elif c == 1:
                meta.loc[r, "text"] = meta.loc[r, "text"] + " and more"
            elif c == 2:
                meta.at[r, "source_ids"] = ["X1", "X2"]
            elif c == 3:
                meta.loc[r, "merged_into"] = "r0"
            else:
                vecs[r, 0] = np.nextafter(vecs[r, 0], 2)
        new = make_records(
            [
                {
                    "id": f"new{trial}-{k}",
                    "namespace": "u1",
                    "text": "merged",
                    "vector": v[k].tolist(),
                }
                for k in range(int(rng.integers(0, 4)))
            ]
        )
        final = Records.concat([Records(meta, vecs, origin=out.origin), new], d)
        want = _changes(
            records_to_arrow(final, with_vectors=False), final.vectors, stored, [recs.vectors]
        )
        got = _diff(final, [frame], [recs.vectors], stored.column("id"))
        assert got is not None
        assert got[0].tolist() == want[0].tolist()
        assert got[1].tolist() == want[2].tolist()
        assert sorted(got[2]) == sorted(want[1])
    # an origin that points at the wrong row, or a new row that reuses a stored id
    bad = recs.take([0, 1])
    bad.origin = np.array([1, 0])
    assert _diff(bad, [frame], [recs.vectors], stored.column("id")) is None
    reuse = Records.concat(
        [
            recs.take([1]),
            make_records(
                [{"id": "r0", "namespace": "u0", "text": "again", "vector": v[0].tolist()}]
            ),
        ],
        d,
    )
    reuse.origin = np.array([1, -1])
    assert _diff(reuse, [frame], [recs.vectors], stored.column("id")) is None


def test_a_pass_with_nothing_to_change_writes_no_version(store):
    with store.lock():
        snap = store.load()
        res = run_pass(snap.records, cfg=PassConfig(threshold=0.95, now="200"), version=2)
        first = store.commit(res.records, res.events, base=snap)
    v = store.head().version
    assert first["version"] == v and not first.get("unchanged")
    with store.lock():
        snap = store.load()
        res = run_pass(snap.records, cfg=PassConfig(threshold=0.95, now="200"), version=v + 1)
        again = store.commit(res.records, res.events, base=snap)
    assert again["unchanged"] is True and again["version"] == v and again["rows_written"] == 0
    assert again["changelog"] is None and store.head().version == v
    # one changed importance is a change
    with store.lock():
        snap = store.load()
        recs = snap.records.take(np.arange(len(snap.records)))
        recs.meta.loc[0, "importance"] = 0.123
        changed = store.commit(recs, [], base=snap)
    assert changed["version"] == v + 1 and changed["rows_written"] == 1


def test_dry_run_commits_nothing(store):
    v = store.head().version
    with store.lock():
        snap = store.load()
        res = run_pass(snap.records, cfg=PassConfig(threshold=0.95, now="200"), version=2)
        info = store.commit(res.records, res.events, base=snap, dry_run=True)
    assert info["snapshot"] is None and info["changelog"].startswith("dry-run-")
    assert store.head().version == v


def test_trigger_and_append(store):
    commit_pass(store)
    assert trigger(store.load().records, 0.1) == (False, 0.0)
    store.append(
        [
            {
                "id": "e",
                "namespace": "u",
                "text": "new fact",
                "vector": [0, 0, 2.0],
                "importance": 0.7,
                "last_used": 150.0,
            }
        ]
    )
    fire, imp = trigger(store.load().records, 0.5)
    assert fire and imp == pytest.approx(0.7)
    np.testing.assert_allclose(store.load().records.vectors[-1], [0, 0, 1.0])
    with pytest.raises(InvalidRecordsError, match="e"):
        store.append([{"id": "e", "namespace": "u", "text": "again", "vector": [1, 0, 0]}])
    with pytest.raises(InvalidRecordsError):
        store.append(
            [
                {"id": "m'q", "namespace": "u", "text": "x", "vector": [1, 0, 0]},
                {"id": "m'q", "namespace": "u", "text": "y", "vector": [1, 0, 0]},
            ]
        )
    assert store.append(
        [{"id": "it's", "namespace": "u", "text": "a quote in an id", "vector": [0, 1, 0]}]
    ) == ["it's"]
    store.mark_used(["it's"], now=160.0)
    assert store.load().records.meta.set_index("id").loc["it's", "strength"] == 2.0


def test_writes_during_a_pass_are_carried(store):
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
        res = run_pass(
            snap.records,
            cfg=PassConfig(threshold=0.95, now="200", floor=0),
            version=snap.version + 1,
            wall_h=300.0,
        )
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
        store.mark_used(["a", "late1"], now=250.0)  # a is being merged by this pass
        info = store.commit(res.records, res.events, base=snap)
    assert info["carried_records"] == 3 and info["carried_touches"] == 1
    after = store.load()
    assert after.deltas == ()
    m = after.records.meta.set_index("id")
    for k in range(3):
        assert math.isnan(m.loc[f"late{k}", "deleted_at"])
        assert math.isnan(m.loc[f"late{k}", "last_pass"])
    assert m.loc["late1", "strength"] == 2.0 and m.loc["late1", "last_used"] == 250.0
    merged_id = m.loc["a", "merged_into"]
    assert m.loc[merged_id, "last_used"] == 250.0 and m.loc[merged_id, "strength"] == 3.0
    assert not any((store.root / "deltas").iterdir())
    assert len(after.records) == 9  # 5 + 3 late + 1 merged; nothing duplicated
    assert after.records.meta["id"].is_unique


def test_compare_and_swap(store):
    snap = store.load()
    commit_pass(store)
    store.append([{"id": "z", "namespace": "u", "text": "z", "vector": [0, 0, 1.0]}])
    with store.lock(), pytest.raises(ConcurrentCommitError, match="another pass"):
        store.commit(snap.records, [], base=snap)
    # appends alone do not conflict
    with store.lock():
        snap = store.load()
        store.append([{"id": "y", "namespace": "u", "text": "y", "vector": [0, 1.0, 1.0]}])
        store.commit(snap.records, [], base=snap)
    assert {"y", "z"} <= live_ids(store.load())


def test_undo_and_patch(store):
    _, res, _ = commit_pass(store)
    mid = next(e["id"] for e in res.events if e["op"] == "exact_merge")
    with store.lock():
        snap = store.load()
        info = store.commit(
            undo_merge(snap.records, mid, wall_h=400.0),
            [{"op": "undo", "id": mid}],
            base=snap,
            op="undo",
        )
    assert info["rows_written"] == 3  # a, b restored; the merged row tombstoned
    m = store.load().records.meta.set_index("id")
    assert math.isnan(m.loc["a", "deleted_at"]) and m.loc[mid, "deleted_reason"] == "undone"
    store.patch(
        [{"id": "c", "op": "close", "valid_to": 150.0}, {"id": "b", "op": "delete"}], now=160.0
    )
    with pytest.raises(ValueError, match="pinned"):
        store.patch([{"id": "d", "op": "delete"}])
    with pytest.raises(KeyError, match="zz"):
        store.patch([{"id": "zz", "op": "delete"}])
    commit_pass(store, force=True)
    m = store.load().records.meta.set_index("id")
    assert m.loc["b", "deleted_reason"] == "deleted" and m.loc["c", "valid_to"] == 150.0
    assert not any((store.root / "deltas").iterdir())


def test_vector_dtype_change_rewrites_and_keeps_history(store):
    commit_pass(store)
    v = store.head().version
    s8 = LanceStore(store.root, vector_dtype="int8")
    with s8.lock():
        snap = s8.load()
        info = s8.commit(snap.records, [], base=snap)
    assert s8.head().vector_dtype == "int8" and info["rows_written"] == 5
    np.testing.assert_allclose(np.linalg.norm(s8.load().records.vectors, axis=1), 1, atol=1e-6)
    assert s8._open(v).schema.field("vector").type.value_type.bit_width == 32


def test_cleanup_keeps_the_newest_versions(store, monkeypatch):
    import consolidate.store.lance.store as ls

    monkeypatch.setattr(ls, "COMPACT_AFTER", 3)
    for k in range(4):
        store.append(
            [{"id": f"n{k}", "namespace": "u", "text": f"n {k}", "vector": [0, 1.0, 0.1 * k]}]
        )
    store.retention_h = 0.0
    with store.lock():
        out = store.cleanup()
    assert out["compacted_fragments"] >= 4 and len(store._open().get_fragments()) == 2
    vs = store.snapshots()
    assert len(vs) == 2 and vs[-1] == store.head().version  # keep_snapshots=2
    assert {"n0", "n3", "a"} <= live_ids(store.load())
    assert store.versions()[-1]["op"] == "compact"


def test_convert_from_parquet(tmp_path):
    p = Store(tmp_path / "pq")
    p.create(make_records(base_rows()))
    p.mark_used(["a"], now=300.0)
    out = convert(p, LanceStore(tmp_path / "lance"))
    assert out == {"records": 4, "version": 3, "source_version": 1}  # create, 2 indexes
    a, b = LanceStore(tmp_path / "lance").load().records, p.load().records
    assert a.meta.equals(b.meta)
    with pytest.raises(FileExistsError):
        convert(p, LanceStore(tmp_path / "lance"))


# the commit of a pass's result (tests.helpers.crash_pass_result: the test runs the pass)
CHILD = """
import pickle
import sys
from consolidate.store.lance import LanceStore
import consolidate.store.lance.writing as ls
ls.REWRITE_FRACTION = float(sys.argv[2])
version, deltas, records, events = pickle.loads(open(sys.argv[3], "rb").read())
s = LanceStore(sys.argv[1])
with s.lock():
    snap = s.load()
    assert (snap.version, snap.deltas) == (version, deltas), "a result of another snapshot"
    if ls.REWRITE_FRACTION < 0:  # a fleet run's commit: the changes of one shard
        upsert, removed = s.changes(records, snap)
        s.commit_changes(upsert, removed, events, base_version=snap.version,
                         folded=snap.deltas, namespaces=None, pass_time_h=2000.0)
    else:
        s.commit(records, events, base=snap)
print("committed", flush=True)
"""

POINTS = [
    "changelog:before_rename",
    "lance:after_changelog",
    "lance:before_commit",
    "lance:after_fragments",
    "lance:after_commit",
    "lance:during_delta_cleanup",
]
# (point, REWRITE_FRACTION): 0 rewrites the table, 1.01 upserts, -1 commits shard changes
CASES = [(p, 0.0) for p in POINTS if p != "lance:after_fragments"] + [
    (p, f) for p in POINTS for f in (1.01, -1.0)
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "fraction"),
    CASES,
    ids=[f"{p}-{ {0.0: 'rewrite', 1.01: 'upsert', -1.0: 'shards'}[f] }" for p, f in CASES],
)
def test_sigkill_during_commit(tmp_path, point, fraction):
    root = tmp_path / "s"
    store = LanceStore(root)
    store.create(make_records(random_rows(300, 16, seed=2, namespaces=2, dup_frac=0.4)))
    store.append(
        [
            {
                "id": "pending",
                "namespace": "ns0",
                "text": "written before the pass",
                "vector": [1.0] + [0.0] * 15,
                "last_used": 999.0,
            }
        ]
    )
    store.mark_used(["pending"], now=999.5)
    store.mark_used(["pending"], now=999.6)  # two deltas: a cleanup can stop between them
    before = store.load()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "CONSOLIDATE_CRASH_AT": point}
    result = crash_pass_result(store, tmp_path / "pass.pkl")
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(fraction), str(result)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == -9, p.stderr
    after = store.load()
    if point in ("lance:after_commit", "lance:during_delta_cleanup"):
        # committed; the folded deltas are not applied twice
        assert after.version > before.version
        m = after.records.meta.set_index("id")
        assert m.loc["pending", "strength"] == 3.0
    else:
        assert after.version == before.version
        assert after.records.meta.equals(before.records.meta)
        assert after.deltas == before.deltas
    assert set(before.records.meta["id"]) <= set(after.records.meta["id"])
    env.pop("CONSOLIDATE_CRASH_AT")
    result = crash_pass_result(store, tmp_path / "pass.pkl")
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(fraction), str(result)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and "committed" in p.stdout, p.stderr
    final = store.load()
    assert final.records.meta.set_index("id").loc["pending", "strength"] == 3.0
    assert final.records.meta["id"].is_unique and final.deltas == ()


WRITER = """
import sys
from consolidate.store.lance import LanceStore
s = LanceStore(sys.argv[1])
w, n = sys.argv[2], int(sys.argv[3])
for k in range(n):
    i = f"{w}-{k}"
    s.append([{"id": i, "namespace": f"ns{k % 2}", "text": f"writer {w} fact {k}",
               "vector": [1.0, float(k), 0.5] + [0.0] * 13, "last_used": 999.0}])
    s.mark_used([i], now=999.5)
print("done", flush=True)
"""


@pytest.mark.slow
def test_writer_processes_during_passes_lose_and_duplicate_nothing(tmp_path):
    root = tmp_path / "s"
    store = LanceStore(root)
    store.create(make_records(random_rows(200, 16, seed=3, namespaces=2, dup_frac=0.3)))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    n = 15
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), w, str(n)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for w in ("w1", "w2")
    ]
    passes = 0
    while any(w.poll() is None for w in writers) or passes < 2:
        with store.lock(timeout_s=60):
            snap = store.load()
            res = run_pass(
                snap.records,
                cfg=PassConfig(threshold=0.9, now="1000", floor=0.0, max_drop_fraction=1.0),
                version=snap.version + 1,
                wall_h=2000.0,
            )
            store.commit(res.records, res.events, base=snap)
        passes += 1
    for w in writers:
        assert w.wait(timeout=120) == 0 and "done" in w.stdout.read()
    final = store.load()
    m = final.records.meta
    assert m["id"].is_unique
    for w in ("w1", "w2"):
        for k in range(n):
            i = f"{w}-{k}"
            assert i in set(m["id"]), i
    # every touch counted once: strength 2 on the row or on the row it was merged into
    s = m.set_index("id")
    for w in ("w1", "w2"):
        for k in range(n):
            i = f"{w}-{k}"
            tgt = i
            while isinstance(s.loc[tgt, "merged_into"], str):
                tgt = s.loc[tgt, "merged_into"]
            assert s.loc[tgt, "strength"] >= 2.0
    total_touch = sum(1 for w in ("w1", "w2") for k in range(n))
    live_new = s[s.index.str.match(r"w\d-")]
    assert len(live_new) == total_touch


def test_convert_job(tmp_path):
    from omegaconf import OmegaConf

    from consolidate.jobs.convert import run_convert
    from consolidate.store import StoreNotFoundError

    p = Store(tmp_path / "pq")
    p.create(make_records(base_rows()))
    cfg = OmegaConf.create({"src": str(p.root), "dst": str(tmp_path / "l"), "vector_dtype": "int8"})
    out = run_convert(cfg)
    assert out["records"] == 4 and LanceStore(tmp_path / "l").head().vector_dtype == "int8"
    cfg.src = str(tmp_path / "missing")
    with pytest.raises(StoreNotFoundError):
        run_convert(cfg)


def test_diff_rollback_restore_and_export(tmp_path, store):
    v1 = store.head().version
    _, res, info = commit_pass(store)  # a+b merged into m-..., nothing dropped
    mid = next(e["id"] for e in res.events if e["op"] == "exact_merge")
    store.append(
        [
            {
                "id": "new1",
                "namespace": "v",
                "text": "appended after the pass",
                "vector": [0, 0, 1.0],
                "importance": 0.5,
                "last_used": 150.0,
            }
        ]
    )
    d = store.diff(v1)
    assert d.loc["u", "merged"] == 2 and d.loc["u", "added"] == 1
    assert d.loc["v", "added"] == 1 and d.loc["(all)", "added"] == 2
    assert d.loc["(all)"].sum() == 4
    vs = store.versions()
    assert vs[-2]["op"] == "pass" and vs[-2]["summary"]["exact_merge"] == 1
    assert vs[-1]["op"] == "append"
    # restore one member of the merge: live again, kept apart from the merged record
    store.restore(["a"])
    m = store.load().records.meta.set_index("id")
    assert math.isnan(m.loc["a", "deleted_at"]) and m.loc["a", "merged_into"] is None
    assert m.loc["a", "keep_apart"] == [mid] and m.loc["b", "merged_into"] == mid
    with pytest.raises(ValueError, match="live already"):
        store.restore(["a"])
    with pytest.raises(KeyError, match="nope"):
        store.restore(["nope"])
    # roll back to before the pass: a, b live, the merged row gone, new1 kept
    info = store.rollback(v1)
    after = store.load()
    assert live_ids(after) == {"a", "b", "c", "d", "new1"}
    assert mid not in set(after.records.meta["id"])
    assert info["diff"]["(all)"]["purged"] == 1 and info["diff"]["u"]["restored"] == 1
    assert store.versions()[-1]["op"] == "rollback"
    # history is kept: the pass's version still reads as it was
    assert mid in set(store.read_version(info["version"] - 1).meta["id"])
    # export any version, Parquet and JSONL, and read them back
    import pandas as pd
    import pyarrow.parquet as pq

    out = store.export(tmp_path / "v.parquet", version=v1)
    assert out["records"] == 4 and pq.read_table(tmp_path / "v.parquet").num_rows == 4
    store.export(tmp_path / "now.jsonl")
    j = pd.read_json(tmp_path / "now.jsonl", lines=True)
    assert len(j) == 5 and len(j.loc[0, "vector"]) == 3
    assert set(j["id"]) == {"a", "b", "c", "d", "new1"}
    with pytest.raises(ValueError, match=r"\.parquet, \.jsonl or \.csv"):
        store.export(tmp_path / "x.txt")


def test_versions_job(tmp_path, store):
    from omegaconf import OmegaConf

    from consolidate.jobs.versions import run_versions

    commit_pass(store)
    base = {
        "store": {"name": "x", "dir": str(store.root), "init_from": None},
        "version": None,
        "other": None,
        "ids": [],
        "out": None,
        "dry_run": False,
    }
    cfg = OmegaConf.create({**base, "action": "list"})
    assert [v["op"] for v in run_versions(cfg)["versions"]][-1] == "pass"
    cfg = OmegaConf.create({**base, "action": "diff", "version": 1})
    assert run_versions(cfg)["diff"].loc["(all)", "merged"] == 2
    cfg = OmegaConf.create({**base, "action": "export", "out": str(tmp_path / "o.jsonl")})
    assert run_versions(cfg)["records"] == 5
    for bad in ({"action": "diff"}, {"action": "restore"}, {"action": "zap"}):
        with pytest.raises(ValueError):
            run_versions(OmegaConf.create({**base, **bad}))


def test_incremental_pass_reads_only_the_namespaces_that_fired(tmp_path):
    rows = [
        {
            "id": f"{ns}-{k}",
            "namespace": ns,
            "text": f"{ns} fact {k}",
            "vector": [1.0, float(k), float(j)],
            "importance": 0.5,
            "last_used": 100.0,
        }
        for j, ns in enumerate(["n1", "n2", "n3"])
        for k in range(4)
    ]
    s = LanceStore(tmp_path / "s")
    s.create(make_records(rows))
    commit_pass(s, force=True)  # every row seen once
    assert s.trigger(0.1) == ([], {})
    s.append(
        [
            {
                "id": "n2-new",
                "namespace": "n2",
                "text": "n2 fact 0!",
                "vector": [1.0, 0.0, 1.0],
                "importance": 0.9,
                "last_used": 150.0,
            },
            {
                "id": "n3-new",
                "namespace": "n3",
                "text": "something else",
                "vector": [0.0, 0.0, 1.0],
                "importance": 0.2,
                "last_used": 150.0,
            },
        ]
    )
    fired, per = s.trigger(0.5)
    assert fired == ["n2"] and per == pytest.approx({"n2": 0.9, "n3": 0.2})
    s.mark_used(["n1-0"], now=160.0)  # outside the namespaces read
    s.mark_used(["n2-1"], now=160.0)  # inside
    before = s.load().records.meta.set_index("id")
    with s.lock():
        snap = s.load(namespaces=fired)
        assert set(snap.records.meta["namespace"]) == {"n2"} and len(snap.records) == 5
        assert len(snap.deltas) == 1  # only the touch of n2-1
        res = run_pass(
            snap.records,
            cfg=PassConfig(threshold=0.95, now="200", floor=0),
            version=snap.version + 1,
            wall_h=300.0,
        )
        info = s.commit(res.records, res.events, base=snap)
        bad = make_records([{**rows[0], "id": "zz"}])
        with pytest.raises(ValueError, match="namespaces the snapshot did not read"):
            s.commit(bad, [], base=snap)
    assert info["carried_touches"] == 0
    after = s.load()
    m = after.records.meta.set_index("id")
    # n2-new is an exact duplicate of n2-0 (normalised text): merged
    assert m.loc["n2-new", "deleted_reason"] == "merged"
    assert m.loc["n2-1", "strength"] == 2.0 and m.loc["n1-0", "strength"] == 2.0
    assert after.deltas != ()  # n1's touch still pending, applied once

    def others(t):
        return t[t.index.str.startswith(("n1", "n3"))].drop(columns=["strength", "last_used"])

    assert others(m).equals(others(before))
    commit_pass(s, force=True)  # a full pass folds the rest
    m = s.load().records.meta.set_index("id")
    assert m.loc["n1-0", "strength"] == 2.0 and s.load().deltas == ()


def test_the_parquet_class_refuses_a_lance_store_clearly(store):
    from consolidate.store import CorruptStoreError

    with pytest.raises(CorruptStoreError, match="this is a Lance store"):
        Store(store.root).load()
    assert store.load(namespaces=[]).records.meta.empty


WRITE = """
import sys
import consolidate.store.lance.store as ls
from tests.helpers import make_records, random_rows
s = ls.LanceStore(sys.argv[1])
op = sys.argv[2]
if op == "create":
    s.create(make_records(random_rows(50, 16, seed=5, namespaces=2)))
elif op == "append":
    s.append([{"id": "late", "namespace": "ns0", "text": "appended", "vector": [1.0] * 16}])
elif op == "touch":
    s.mark_used(["pending"], now=999.7)
elif op == "patch":
    s.patch([{"id": "pending", "op": "close", "valid_to": 999.8}], now=999.9)
elif op == "compact":
    ls.COMPACT_AFTER = 1
    s.retention_h = 0.0
    with s.lock():
        s.cleanup()
print("done", flush=True)
"""

WRITE_POINTS = [
    ("create", "lance:after_create"),
    ("create", "lance:after_index"),
    ("create", "marker:before_rename"),
    ("create", "create:before_rename"),
    ("append", "lance:before_append"),
    ("append", "lance:after_append"),
    ("append", "checksums:before_rename"),
    ("touch", "touch:before_rename"),
    ("patch", "patch:before_rename"),
    ("compact", "lance:after_compact"),
    ("compact", "lance:after_restate"),
    ("compact", "lance:before_version_cleanup"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("op", "point"), WRITE_POINTS)
def test_sigkill_during_writes(tmp_path, op, point):
    """A writer killed at each step of create, append, mark_used, patch and compaction
    leaves the store as it was before (or with the write complete), never half-written."""
    root = tmp_path / "s"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "CONSOLIDATE_CRASH_AT": point}

    def child(what, crash=True):
        e = env if crash else {k: v for k, v in env.items() if k != "CONSOLIDATE_CRASH_AT"}
        return subprocess.run(
            [sys.executable, "-c", WRITE, str(root), what],
            cwd=REPO,
            env=e,
            capture_output=True,
            text=True,
            timeout=300,
        )

    if op == "create":
        assert child("create").returncode == -9
        store = LanceStore(root)
        assert not store.exists() and not root.exists()  # built aside, never renamed in
        p = child("create", crash=False)  # the retry builds the store
        assert p.returncode == 0 and "done" in p.stdout, p.stderr
        assert len(store.load().records) > 0
        return
    store = LanceStore(root)
    store.create(make_records(random_rows(40, 16, seed=2, namespaces=2)))
    for k in range(3):
        store.append(
            [
                {
                    "id": f"small{k}",
                    "namespace": "ns1",
                    "text": f"small {k}",
                    "vector": [0.0, 1.0] + [float(k)] * 14,
                }
            ]
        )
    store.append(
        [
            {
                "id": "pending",
                "namespace": "ns0",
                "text": "written before",
                "vector": [0.5] * 16,
                "last_used": 999.0,
            }
        ]
    )
    before = store.load()
    p = child(op)
    assert p.returncode == -9, p.stderr
    after = store.load()
    m = after.records.meta.set_index("id")
    if point in ("lance:after_append", "checksums:before_rename"):
        # the append committed; a file whose checksum was not recorded is not checked
        assert "late" in m.index and len(after.records) == len(before.records) + 1
    else:
        assert after.records.meta.equals(before.records.meta), point
    assert after.records.meta["id"].is_unique
    p = child(op, crash=False)  # the retry succeeds (an append of the same id is refused)
    if point in ("lance:after_append", "checksums:before_rename"):
        assert p.returncode != 0 and "duplicate" in p.stderr.lower() + p.stdout.lower()
    else:
        assert p.returncode == 0 and "done" in p.stdout, p.stderr
    final = store.load().records.meta.set_index("id")
    assert set(before.records.meta["id"]) <= set(final.index)
    if op == "touch":
        assert final.loc["pending", "strength"] == 2.0
    if op == "patch":
        assert final.loc["pending", "valid_to"] == 999.8


def test_a_flipped_bit_in_a_data_file_is_an_error_naming_it(store):
    from consolidate.store import CorruptStoreError

    commit_pass(store)
    out = store.verify()
    assert out["files"] >= 1 and out["checked"] == out["files"]
    data = sorted((store.dataset_path / "data").iterdir(), key=lambda p: p.stat().st_size)[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptStoreError, match=data.name):
        store.load()
    with pytest.raises(CorruptStoreError, match="CRC32"):
        store.verify()
    # a checksum file with a path out of the store is refused, not followed
    (store.root / "CHECKSUMS.json").write_text(json.dumps({"../../etc/passwd": 1}))
    with pytest.raises(CorruptStoreError, match="map of file names"):
        store.load()


def test_crafted_folded_names_are_refused(store, tmp_path):
    import lance

    from consolidate.store import CorruptStoreError

    victim = tmp_path / "victim.touch.json"
    victim.write_text("{}")
    ds = lance.dataset(str(store.dataset_path))
    b = ds.merge_insert("id").when_matched_update_all()
    txn, _ = b.execute_uncommitted(ds.to_table(limit=0))
    txn.transaction_properties = {
        "consolidate.op": "pass",
        "consolidate.changelog": "",
        "consolidate.folded": json.dumps(["../../victim.touch.json"]),
    }
    lance.LanceDataset.commit(str(store.dataset_path), txn, read_version=ds.version)
    with pytest.raises(CorruptStoreError, match="delta file names"):
        store.load()
    with pytest.raises(CorruptStoreError):
        commit_pass(store)
    assert victim.exists()


def test_a_delta_removed_by_a_concurrent_pass_is_read_again(store, monkeypatch):
    store.mark_used(["a"], now=300.0)
    listed = store._listed()
    calls = []

    def racing():  # the first read lists a delta that a pass folds and removes meanwhile
        calls.append(1)
        return listed + (["99999999999999999999-1-gone.touch.json"] if len(calls) == 1 else [])

    monkeypatch.setattr(store, "_listed", racing)
    snap = store.load()
    assert len(calls) == 2 and snap.deltas == tuple(listed)
    assert snap.records.meta.set_index("id").loc["a", "strength"] == 2.0


def test_patch_into_must_name_another_stored_record(store):
    with pytest.raises(KeyError, match="another stored record"):
        store.patch([{"id": "a", "op": "delete", "into": "no-such-id"}])
    with pytest.raises(KeyError, match="another stored record"):
        store.patch([{"id": "a", "op": "delete", "into": "a"}])
    with pytest.raises(TypeError, match="list of dicts"):
        store.patch({"id": "a", "op": "delete"})
    assert store.load().deltas == ()  # nothing written
    store.patch([{"id": "a", "op": "delete", "into": "c"}], now=150.0)
    store.mark_used(["a"], now=160.0)  # follows into: c is touched
    m = store.load().records.meta.set_index("id")
    assert m.loc["c", "strength"] == 2.0 and m.loc["a", "deleted_reason"] == "updated"


def test_nothing_is_written_on_a_store_missing_a_data_file(store, tmp_path):
    from consolidate.store import CorruptStoreError

    commit_pass(store)
    v = store.head().version
    victim = store.dataset_path / next(
        p for p in store._files(store._open()) if p.startswith("data/")
    )
    victim.rename(tmp_path / victim.name)
    row = [{"id": "z", "namespace": "u", "text": "z", "vector": [0, 0, 1.0]}]
    with pytest.raises(CorruptStoreError, match="missing"):
        store.append(row)
    assert store._open().version == v
    (tmp_path / victim.name).rename(victim)
    assert store.append(row) == ["z"]
    assert store.verify()["unrecorded"] == 0  # the restored file kept its checksum
    with store.lock():
        store.retention_h = 0.0
        store.keep_snapshots = 1
        store.cleanup(compact=False)
    with pytest.raises(CorruptStoreError, match="not retained"):
        store.diff(1)


def test_transact_is_lock_load_change_commit(store):
    cfg = PassConfig(threshold=0.95, now="200")
    v = store.head().version
    info = store.transact(lambda snap: run_pass(snap.records, cfg=cfg, version=snap.version + 1))
    assert info["version"] == v + 1 and info["rows_written"] > 0
    again = store.transact(lambda snap: run_pass(snap.records, cfg=cfg, version=snap.version + 1))
    assert again["unchanged"] is True and store.head().version == v + 1

    def broken(snap):
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        store.transact(broken)
    assert store.head().version == v + 1
    with store.lock():  # released after the failed change
        pass
    # a (records, events) pair works too
    info = store.transact(lambda snap: (snap.records.take(np.arange(1, len(snap.records))), []))
    assert info["version"] == v + 2 and info["rows_deleted"] == 1


def _foreign_rewrite(tmp_path, damage):
    """A Lance store of four records whose dataset another tool rewrote: ``damage`` is
    ``"width"`` (record r2's vector has 3 components, in a list column) or ``"utf8"``
    (record r1's text holds the byte 0xff)."""
    import lance

    s = LanceStore(tmp_path / "s")
    rows = [
        {
            "id": f"r{k}",
            "namespace": "n" if k < 3 else "m",
            "text": f"text {k}",
            "vector": np.eye(4, dtype=np.float32)[k],
            "last_used": 1.0,
        }
        for k in range(4)
    ]
    s.create(make_records(rows))
    t = lance.dataset(str(s.dataset_path)).to_table()
    if damage == "width":
        vec = t.column("vector").to_pylist()
        vec[2] = vec[2][:3]
        col, arr = "vector", pa.array(vec, pa.list_(pa.float32()))
    else:
        txt = [x.encode() for x in t.column("text").to_pylist()]
        txt[1] = b"bad \xff text"
        col, arr = "text", pa.array(txt, pa.binary()).view(pa.string())
    t = t.set_column(t.schema.get_field_index(col), col, arr)
    lance.write_dataset(t, str(s.dataset_path), mode="overwrite")
    return s


@pytest.mark.parametrize(
    "damage,bad,why",
    [
        ("width", "r2", "a vector of 3 components, the store's dim is 4"),
        ("utf8", "r1", "text is not valid UTF-8"),
    ],
)
def test_a_bad_row_is_named_and_quarantine_loads_past_it(tmp_path, damage, bad, why):
    s = _foreign_rewrite(tmp_path, damage)
    with pytest.raises(InvalidRecordsError) as e:
        LanceStore(s.root).load()
    msg = str(e.value)
    assert "memories.lance (version" in msg and f"{why}: 1 record(s): '{bad}'" in msg
    assert msg.count("record(s)") == 1  # the one problem, nothing derived from it
    q = LanceStore(s.root, quarantine=True)
    snap = q.load()
    good = sorted({"r0", "r1", "r2", "r3"} - {bad})
    assert sorted(snap.records.meta["id"]) == good
    # a load of some namespaces names the row too, and skips the other namespace
    assert sorted(q.load(namespaces=["n"]).records.meta["id"]) == [g for g in good if g != "r3"]
    qt = pa.concat_tables(pq.read_table(p) for p in sorted((s.root / "quarantine").glob("*")))
    assert set(qt.column("id").to_pylist()) == {bad}
    assert all(why in r for r in qt.column("quarantine_reason").to_pylist())
    # the next commit removes the row from the dataset: a strict load reads the rest
    q.commit(snap.records, [], base=snap)
    assert sorted(LanceStore(s.root).load().records.meta["id"]) == good

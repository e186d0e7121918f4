"""The Lance store's commit path: the in-memory comparison against the rows as loaded
(row origins carried through the pass), deletions by the row addresses read at load, the
two-scan load, and the fallbacks each of them has (Arrow comparison, lookup by id)."""

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import consolidate.store.lance.dataset as ls
import consolidate.store.lance.store as lstore
import consolidate.store.lance.writing as lw
from consolidate.config import PassConfig
from consolidate.pipeline import run_pass
from consolidate.store.lance import LanceStore
from consolidate.store.lance.scan import _scan
from consolidate.store.schema import Records
from consolidate.store.store import CorruptStoreError
from tests.helpers import make_records, random_rows

D = 16


def _store(root, n=120, seed=3):
    s = LanceStore(root, keep_snapshots=3)
    s.create(make_records(random_rows(n, D, seed=seed, namespaces=4, dup_frac=0.3)))
    return s


def _pass(store, wall_h, late=None, **kw):
    """One pass under the lock; ``late(store)`` runs between the load and the commit."""
    cfg = PassConfig(
        threshold=0.9,
        now=str(wall_h),
        tau_hours=1000.0,
        floor=0.25,
        max_drop_fraction=1.0,
        max_namespace_drop_fraction=1.0,
        **kw,
    )
    with store.lock():
        snap = store.load()
        res = run_pass(snap.records, cfg=cfg, version=snap.version + 1, wall_h=wall_h)
        if late is not None:
            late(store)
        return res, store.commit(res.records, res.events, base=snap)


def _rows(store):
    r = store.load().records
    meta = r.meta.sort_values("id")
    return meta.reset_index(drop=True), r.vectors[meta.index.to_numpy()]


def _same(a, b):
    pd.testing.assert_frame_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def _late(store):
    store.append(
        [
            {
                "id": f"late{k}",
                "namespace": "ns1",
                "text": f"late fact {'xyz'[k]}",
                "vector": np.eye(D)[k].tolist(),
                "importance": 0.5,
                "last_used": 990.0,
            }
            for k in range(3)
        ]
    )
    store.mark_used(["r00001", "late2"], now=995.0)


@pytest.mark.parametrize("late", [None, _late])
def test_passes_commit_through_the_in_memory_comparison(tmp_path, monkeypatch, late):
    """Three passes (merges and drops, then purges of the tombstones) with rows appended and
    touched during them: committed through _diff (the Arrow comparison is made to fail) they
    give row for row what the Arrow comparison gives, and write exactly the changed rows."""
    fast, slow = _store(tmp_path / "fast"), _store(tmp_path / "slow")
    infos = {}
    for name, store in (("fast", fast), ("slow", slow)):
        with monkeypatch.context() as m:
            if name == "fast":
                m.setattr(lw, "_changes", lambda *a, **k: pytest.fail("Arrow path taken"))
            else:
                m.setattr(lw, "_diff", lambda *a, **k: None)
            out = []
            for k, wall in enumerate((1000.0, 1200.0, 1500.0)):
                res, info = _pass(
                    store, wall, late if k == 1 else None, tombstone_retention_hours=100.0
                )
                out.append(info)
            infos[name] = out
    _same(_rows(fast), _rows(slow))
    for a, b in zip(infos["fast"], infos["slow"], strict=True):
        assert (a["rows_written"], a["rows_deleted"]) == (b["rows_written"], b["rows_deleted"])
    # the third pass purged tombstones, so its records did not line up with the stored rows
    assert infos["fast"][2]["rows_deleted"] > 0
    # a pass over unchanged records writes nothing
    _, info = _pass(fast, 1500.0, tombstone_retention_hours=100.0)
    assert info["rows_written"] == 0 and info["rows_deleted"] == 0


def test_records_without_origins_or_reordered_take_the_arrow_path(tmp_path, monkeypatch):
    """Records that lost their origins (built anew) and are reordered: _diff declines and
    the Arrow comparison commits the same result."""
    a, b = _store(tmp_path / "a"), _store(tmp_path / "b")
    for store, scramble in ((a, False), (b, True)):
        with store.lock():
            snap = store.load()
            res = run_pass(
                snap.records, cfg=PassConfig(threshold=0.9, now="1000"), version=2, wall_h=1000.0
            )
            recs = res.records
            if scramble:
                order = np.random.default_rng(0).permutation(len(recs))
                recs = recs.take(order)
                recs = Records(recs.meta.copy(), recs.vectors.copy())
                assert (
                    recs.origin is None
                    and lw._diff(recs, [snap.stored.frame], [snap.stored.vectors], snap.stored.ids)
                    is None
                )
            store.commit(recs, res.events, base=snap)
    _same(_rows(a), _rows(b))


def test_origins_survive_take_concat_and_the_pass(tmp_path):
    store = _store(tmp_path / "s")
    snap = store.load()
    recs = snap.records
    assert recs.origin.tolist() == list(range(len(recs)))
    part = recs.take([5, 2, 9])
    assert part.origin.tolist() == [5, 2, 9]
    new = make_records([{"id": "n", "namespace": "ns0", "text": "t", "vector": [1.0] * D}])
    assert Records.concat([part, new], D).origin.tolist() == [5, 2, 9, -1]
    assert Records.concat([new, new], D).origin is None
    res = run_pass(recs, cfg=PassConfig(threshold=0.9, now="1000"), version=2, wall_h=1000.0)
    o = res.records.origin
    ids = res.records.meta["id"].to_numpy(object)
    stored = snap.stored.frame["id"].to_numpy(object)
    assert (o >= 0).sum() == len(recs) and (o < 0).sum() == res.stats.merges > 0
    assert (ids[o >= 0] == stored[o[o >= 0]]).all()


def test_a_compaction_between_load_and_commit_falls_back_to_ids(tmp_path, monkeypatch):
    """Row addresses read at load name fragments a compaction removed: the commit finds the
    rows by id instead, and the result equals that of a store that was not compacted."""
    monkeypatch.setattr(lstore, "COMPACT_AFTER", 0)
    a, b = _store(tmp_path / "a", n=40), _store(tmp_path / "b", n=40)
    for k in range(4):  # small fragments for the compaction to merge
        rows = random_rows(10, D, seed=10 + k, namespaces=4)
        for r in rows:
            r["id"] = f"x{k}-{r['id']}"
        a.append(rows)
        b.append(rows)

    def compact(store):
        out = store.cleanup()
        assert out["compacted_fragments"] > 0

    _pass(a, 1000.0, compact)
    _pass(b, 1000.0)
    _same(_rows(a), _rows(b))


class _Reversed:
    """A Lance dataset whose batches come back in reverse order (a scan order the reader
    must not rely on)."""

    def __init__(self, ds):
        self._ds = ds

    def __getattr__(self, name):
        return getattr(self._ds, name)

    def to_batches(self, **kw):
        return reversed(list(self._ds.to_batches(**kw)))


def test_scan_aligns_vectors_by_row_address(tmp_path):
    store = _store(tmp_path / "s", n=50)
    ds = store._open()
    want = ds.to_table()
    for d in (ds, _Reversed(ds)):
        meta, vecs, addr = _scan(d, None, D)
        assert meta.column("id").to_pylist() == want.column("id").to_pylist()
        np.testing.assert_array_equal(
            vecs, np.stack(want.column("vector").to_numpy(zero_copy_only=False))
        )
        assert len(set(addr.tolist())) == 50
    flt = pc.field("namespace").isin(pa.array(["ns1"]))
    meta, vecs, _ = _scan(_Reversed(ds), flt, D)
    sel = want.filter(flt)
    assert meta.column("id").to_pylist() == sel.column("id").to_pylist()
    np.testing.assert_array_equal(
        vecs, np.stack(sel.column("vector").to_numpy(zero_copy_only=False))
    )
    with pytest.raises(ValueError, match="not 8 wide"):
        _scan(ds, None, 8)


def test_quarantined_rows_are_deleted_by_the_next_commit(tmp_path):
    """A stored row that fails validation at load (quarantine mode) is left out of the
    snapshot; the next commit deletes it from the dataset, by its row address."""
    store = _store(tmp_path / "s", n=30)
    shutil.rmtree(tmp_path / "s" / "quarantine", ignore_errors=True)
    ds = store._open()
    # a stored row with a vector that is not finite, written the way a bug would
    bad = ds.to_table(filter=pc.field("id") == "r00003")
    v = np.full((1, D), np.nan, np.float32)
    bad = bad.set_column(
        bad.schema.get_field_index("vector"),
        "vector",
        pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), D),
    )
    ds.delete("id = 'r00003'")
    ls._lance().write_dataset(bad, ds, mode="append")
    store._record_checksums(store._open())
    q = LanceStore(tmp_path / "s", quarantine=True, keep_snapshots=3)
    with q.lock():
        snap = q.load()
        assert "r00003" not in set(snap.records.meta["id"])
        info = q.commit(snap.records, [], base=snap)
    assert info["rows_deleted"] == 1 and info["rows_written"] == 0
    assert q._open().count_rows(filter="id = 'r00003'") == 0


def _checksums(store):
    return json.loads((store.root / "CHECKSUMS.json").read_text())


def test_every_version_written_records_its_content_digest(tmp_path):
    """create (and its index), append and a pass each record the digest of the version
    they leave; a load checks it; a version Lance wrote alone is not assigned one."""
    store = _store(tmp_path / "s", n=30)
    v1 = store._open().version
    store.append([{"id": "n1", "namespace": "ns0", "text": "new", "vector": [1.0] * D}])
    _pass(store, 1000.0)
    d = _checksums(store)
    head = store._open()
    assert set(d) == {"files", "versions"}
    assert set(d["versions"]) == {str(v1), str(v1 + 1), str(head.version)}
    files = store._files(head)
    assert d["versions"][str(head.version)] == ls._digest(files, d["files"])
    out = store.verify()
    assert out["digest"] and out["checked"] == len(files) == out["files"]


def test_a_version_that_lost_a_file_or_its_newest_versions_does_not_load(tmp_path):
    store = _store(tmp_path / "s", n=30)
    store.append([{"id": "n1", "namespace": "ns0", "text": "new", "vector": [1.0] * D}])
    d = _checksums(store)
    head = store._open()
    # the version as recorded held one more data file than its manifest now lists
    d["versions"][str(head.version)] = ls._digest(
        [*store._files(head), "data/lost.lance"], d["files"]
    )
    (store.root / "CHECKSUMS.json").write_text(json.dumps(d))
    with pytest.raises(CorruptStoreError, match="does not hold the files"):
        store.load()
    # an older copy of the dataset put in place: the newest version it recorded is gone
    d["versions"][str(head.version + 5)] = d["versions"].pop(str(head.version))
    (store.root / "CHECKSUMS.json").write_text(json.dumps(d))
    with pytest.raises(CorruptStoreError, match=f"version {head.version + 5} was written"):
        store.load()


def test_a_store_of_the_first_checksum_layout_still_loads(tmp_path):
    """A CHECKSUMS.json that maps files only (no digests) is read; the next write adds
    the digest."""
    store = _store(tmp_path / "s", n=30)
    d = _checksums(store)
    (store.root / "CHECKSUMS.json").write_text(json.dumps(d["files"]))
    assert len(store.load().records) == 30
    out = store.verify()
    assert not out["digest"] and out["checked"] == out["files"]
    store.append([{"id": "n1", "namespace": "ns0", "text": "new", "vector": [1.0] * D}])
    assert store.verify()["digest"]


def test_a_partial_load_reads_back_only_the_fragments_it_reads(tmp_path):
    """A load of some namespaces checks the CRC32 of the fragments holding their rows
    (and the digest of the whole version); a flipped bit in another fragment is found by
    a whole load."""
    store = _store(tmp_path / "s", n=40)
    store.append(
        [
            {
                "id": f"n{k}",
                "namespace": "solo",
                "text": f"new fact {'abc'[k]}",
                "vector": np.eye(D)[k].tolist(),
            }
            for k in range(3)
        ]
    )
    ds = store._open()
    solo = [f.fragment_id for f in ds.get_fragments() if f.count_rows(filter="namespace = 'solo'")]
    assert len(solo) == 1 and len(ds.get_fragments()) == 2
    out = store.verify(fragments=solo)
    assert out["digest"] and out["files"] == 1 == out["checked"]
    other = [f for f in ds.get_fragments() if f.fragment_id not in solo][0]
    path = store.dataset_path / "data" / other.data_files()[0].path
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    path.write_bytes(bytes(raw))
    assert len(store.load(namespaces=["solo"]).records) == 3
    with pytest.raises(CorruptStoreError, match="CRC32"):
        store.load()


def test_permuted_origins_compare_each_row_with_its_own_stored_row(tmp_path):
    """Rows handed over in another order (origins 1, 0, 2, ...), one of them changed to
    equal another stored row in every column but the id: it is written."""
    store = _store(tmp_path / "s", n=6)
    with store.lock():
        snap = store.load()
        out = snap.records.take([1, 0, 2, 3, 4, 5])
        meta = out.meta.copy()
        for c in meta.columns:
            if c != "id":
                meta[c] = meta[c].astype(object) if meta[c].dtype == object else meta[c]
                meta.at[0, c] = snap.records.meta.at[0, c]  # r00001 now says what r00000 says
        recs = Records(meta, out.vectors, origin=out.origin)
        info = store.commit(recs, [], base=snap)
    assert info["rows_written"] == 1
    got = store.load().records.meta.set_index("id")
    want = meta.set_index("id")
    for c in ("namespace", "text", "importance", "created_at", "last_used", "source_ids"):
        assert got.loc["r00001", c] == want.loc["r00001", c], c


def test_a_duplicated_id_moved_by_a_compaction_refuses_the_commit(tmp_path, monkeypatch):
    """An id stored twice (one copy quarantined at load) whose rows a compaction moved
    before the commit: found by id, the copies cannot be told apart, so the commit refuses
    and writes nothing (without the compaction, the row addresses tell them apart)."""
    from consolidate.store import ConcurrentCommitError

    for compact in (False, True):
        store = _store(tmp_path / f"s{compact}", n=10)
        ds = store._open()
        row = ds.to_table(filter=pc.field("id") == "r00003")
        row = row.set_column(
            row.schema.get_field_index("strength"), "strength", pa.array([0.5])
        )  # invalid: strength < 1
        ls._lance().write_dataset(
            row, ds, mode="append", transaction_properties=ls._txn_props(ds, ds.version)
        )
        store._record_checksums(store._open())
        q = LanceStore(store.root, quarantine=True, keep_snapshots=3)
        with q.lock():
            snap = q.load()
            meta = snap.records.meta.copy()
            meta.loc[0, "last_used"] = 999.5
            recs = Records(meta, snap.records.vectors, origin=snap.records.origin)
            if not compact:
                info = q.commit(recs, [], base=snap)
                # the quarantined copy is deleted by its row address, the other one kept
                assert info["rows_deleted"] == 1 and info["rows_written"] == 1
                rows = q._open().to_table(filter=pc.field("id") == "r00003")
                assert rows.num_rows == 1 and rows.column("strength")[0].as_py() >= 1
                continue
            monkeypatch.setattr(lstore, "COMPACT_AFTER", 0)
            q.append(
                [
                    {
                        "id": f"pad{k}",
                        "namespace": "ns0",
                        "text": f"pad {'abc'[k]}",
                        "vector": np.eye(D)[k].tolist(),
                    }
                    for k in range(3)
                ]
            )
            assert q.cleanup()["compacted_fragments"] > 0
            before = q._open().version
            with pytest.raises(ConcurrentCommitError, match="stored more than once"):
                q.commit(recs, [], base=snap)
            assert q._open().version == before
            assert q._open().count_rows(filter="id = 'r00003'") == 2


def test_loaded_list_cells_refuse_changes_in_place(tmp_path):
    """A list cell read from the store is shared with the snapshot its commit compares
    against: changing it in place raises instead of going unseen; a new list is written."""
    from consolidate.store.schema import FrozenList

    store = _store(tmp_path / "s", n=5)
    with store.lock():
        snap = store.load()
        cell = snap.records.meta["source_ids"].iat[0]
        assert isinstance(cell, FrozenList) and cell == ["D0"]
        for change in (
            lambda c: c.append("X"),
            lambda c: c.__setitem__(0, "X"),
            lambda c: c.extend(["X"]),
            lambda c: c.pop(),
        ):
            with pytest.raises(TypeError, match="assign a new list"):
                change(cell)
        meta = snap.records.meta.copy()
        meta.at[0, "source_ids"] = [*cell, "X"]
        info = store.commit(
            Records(meta, snap.records.vectors, origin=snap.records.origin), [], base=snap
        )
    assert info["rows_written"] == 1
    assert store.load().records.meta.set_index("id").loc["r00000", "source_ids"] == ["D0", "X"]


def test_cleanup_forgets_the_digests_of_removed_versions(tmp_path):
    """Every write adds its version's digest; only the version cleanup, which removes
    versions, drops theirs (an append does not list the versions)."""
    store = LanceStore(tmp_path / "s", keep_snapshots=1, retention_h=0)
    store.create(make_records(random_rows(20, D, seed=5)))
    for k in range(2):
        store.append(
            [
                {
                    "id": f"n{k}",
                    "namespace": "ns0",
                    "text": f"new {'ab'[k]}",
                    "vector": np.eye(D)[k].tolist(),
                }
            ]
        )
    before = set(_checksums(store)["versions"])
    assert len(before) == 3  # the create's index versions (last one), then two appends
    with store.lock():
        out = store.cleanup(compact=False)
    assert out["removed_versions"] > 0
    after = set(_checksums(store)["versions"])
    head = str(store._open().version)
    assert after == {head} and head in before
    assert store.verify()["digest"]

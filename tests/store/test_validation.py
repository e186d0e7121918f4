"""Every bad-input kind: a clear error naming the record and the file; no byte changes."""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from consolidate.store import InvalidRecordsError, Store
from consolidate.store.schema import hours_now, records_to_arrow
from tests.helpers import make_records, rewrite_snapshot, tree_digest

GOOD = {
    "id": "ok",
    "namespace": "u",
    "text": "fine",
    "vector": [1.0, 0.0, 0.0],
    "importance": 0.5,
    "last_used": 10.0,
}


def bad(**kw):
    r = {**GOOD, "id": "bad-1", **kw}
    return r


CASES = {
    "NaN or inf in vector": [
        bad(vector=[math.nan, 1.0, 0.0]),
        bad(id="bad-2", vector=[math.inf, 0, 0]),
    ],
    "zero vector": [bad(vector=[0.0, 0.0, 0.0])],
    "wrong vector dimension": [bad(vector=[1.0, 0.0])],
    "empty or whitespace-only text": [bad(text=""), bad(id="bad-2", text=" \t\n")],
    "duplicate id": [bad(id="a"), bad(id="bad-1"), bad(id="bad-1")],
    "importance outside [0, 1]": [bad(importance=1.5), bad(id="bad-2", importance=-0.1)],
    "strength < 1": [bad(strength=0.5)],
    "last_used in the future": [bad(last_used=hours_now() + 24)],
    "text is not valid UTF-8": [bad(text="caf\udce9")],
}


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store")
    s.create(make_records([{**GOOD, "id": "a"}, {**GOOD, "id": "b", "text": "other"}]))
    return s


@pytest.mark.parametrize("kind", sorted(CASES))
def test_append_rejects_and_writes_nothing(store, kind):
    before = tree_digest(store.root)
    rows = [GOOD] + CASES[kind]
    with pytest.raises(InvalidRecordsError) as ei:
        store.append(rows)
    msg = str(ei.value)
    assert kind in msg and str(store.root) in msg
    bad_ids = {r["id"] for r in CASES[kind]} - ({"bad-1"} if kind == "duplicate id" else set())
    for i in bad_ids | ({"bad-1"} if kind == "duplicate id" else set()):
        assert repr(i) in msg
    assert "'ok'" not in msg
    assert tree_digest(store.root) == before


def test_create_rejects_and_writes_nothing(tmp_path):
    root = tmp_path / "new"
    with pytest.raises(InvalidRecordsError, match="'bad-1'"):
        Store(root).create(make_records([GOOD, bad(importance=2.0)]))
    assert not root.exists()


def test_error_lists_first_ids_and_count(store):
    rows = [bad(id=f"bad-{k}", importance=3.0) for k in range(8)]
    with pytest.raises(InvalidRecordsError, match=r"8 record\(s\).*'bad-4' \(and 3 more\)"):
        store.append(rows)


def corrupt_snapshot(store, **fields):
    """Rewrite snapshot 1 with one bad row, bypassing validation."""
    recs = store.load().records
    for k, v in fields.items():
        if k == "vector":
            recs.vectors[0] = v
        else:
            recs.meta.loc[0, k] = v
    path = store.root / "snapshots" / "snapshot-000001.parquet"
    rewrite_snapshot(store, records_to_arrow(recs))
    return path


@pytest.mark.parametrize(
    "fields,kind",
    [
        ({"vector": [math.nan, 0, 0]}, "NaN or inf in vector"),
        ({"vector": [0, 0, 0]}, "zero vector"),
        ({"text": "   "}, "empty or whitespace-only text"),
        ({"importance": 7.0}, "importance outside [0, 1]"),
        ({"strength": 0.0}, "strength < 1"),
        ({"id": "b"}, "duplicate id"),
    ],
)
def test_load_names_record_and_file(store, fields, kind):
    path = corrupt_snapshot(store, **fields)
    before = tree_digest(store.root)
    with pytest.raises(InvalidRecordsError) as ei:
        store.load()
    assert kind in str(ei.value) and str(path) in str(ei.value)
    assert "'a'" in str(ei.value) or "'b'" in str(ei.value)
    assert tree_digest(store.root) == before


def test_load_rejects_invalid_utf8_and_wrong_dim_in_file(store):
    path = store.root / "snapshots" / "snapshot-000001.parquet"
    t = pq.read_table(path)
    texts = pa.array([b"caf\xe9", b"other"], pa.binary())
    vec = pa.array([[1.0, 0.0, 0.0], [1.0, 0.0]], pa.list_(pa.float32()))
    t = t.set_column(t.schema.get_field_index("text"), "text", texts)
    t = t.set_column(t.schema.get_field_index("vector"), "vector", vec)
    rewrite_snapshot(store, t)
    before = tree_digest(store.root)
    with pytest.raises(InvalidRecordsError) as ei:
        store.load()
    msg = str(ei.value)
    assert "text is not valid UTF-8: 1 record(s): 'a'" in msg
    assert "wrong vector dimension (expected 3): 1 record(s): 'b'" in msg
    assert str(path) in msg
    assert tree_digest(store.root) == before


def test_quarantine_moves_bad_rows_aside(tmp_path):
    s = Store(tmp_path / "q", quarantine=True)
    s.create(make_records([{**GOOD, "id": "a"}]))
    written = s.append(
        [
            {**GOOD, "id": "g2", "text": "good two"},
            bad(importance=9.0),
            bad(id="bad-2", text="caf\udce9"),
        ]
    )
    assert written == ["g2"]
    assert set(s.load().records.meta["id"]) == {"a", "g2"}
    qfiles = list((s.root / "quarantine").glob("*.parquet"))
    assert len(qfiles) == 1
    q = pq.read_table(qfiles[0]).to_pydict()
    assert q["id"] == ["bad-1", "bad-2"]
    assert q["quarantine_reason"] == ["importance outside [0, 1]", "text is not valid UTF-8"]
    assert q["text"][1] is None  # invalid UTF-8 is not copied into the side file

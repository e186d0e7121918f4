"""Regression tests for inputs that once slipped through (found by adversarial testing)."""

import json
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from consolidate.config import PassConfig
from consolidate.pipeline import MassDropError, run_pass
from consolidate.store import CorruptStoreError, InvalidRecordsError, Records, Store
from consolidate.store.locomo import read_locomo_observations
from tests.helpers import REPO, make_records, rewrite_snapshot, run_job, tree_digest

GOOD = {
    "id": "ok",
    "namespace": "u",
    "text": "fine",
    "vector": [1.0, 0.0, 0.0],
    "importance": 0.5,
    "last_used": 10.0,
}


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store")
    s.create(make_records([{**GOOD, "id": "a"}, {**GOOD, "id": "b", "text": "other"}]))
    return s


@pytest.mark.parametrize(
    "field,value,kind",
    [
        ("strength", math.inf, "strength above"),
        ("strength", 1e200, "strength above"),
        ("last_used", pd.NaT, "last_used missing"),
        ("created_at", 1e13, "created_at out of range"),
        ("last_used", -math.inf, "last_used out of range"),
        ("last_used", True, "last_used is not a time"),
        ("last_used", "not a date", "last_used is not a time"),
        ("source_ids", "D1:3", "source_ids is not a list of strings"),
        ("source_ids", [1, 2], "source_ids is not a list of strings"),
        ("pinned", "False", "pinned is not a boolean"),
        ("vector", [[1.0, 0.0], [0.0, 1.0]], "vector is not a flat list"),
        ("vector", "0.1,0.2,0.3", "vector is not a flat list"),
        ("importance", "0.7", "importance is not a number"),
        ("id", 5, "id is not a string"),
        ("namespace", "  ", "namespace is missing or empty"),
        ("deleted_at", 5.0, "not a live record"),
        ("merged_into", "m-x", "not a live record"),
        ("id", "caf\udce9", "not valid UTF-8"),
    ],
)
def test_bad_field_is_refused_by_name(store, field, value, kind):
    before = tree_digest(store.root)
    row = {**GOOD, "id": "bad-1", field: value}
    with pytest.raises(InvalidRecordsError) as ei:
        store.append([GOOD, row])
    assert kind in str(ei.value)
    assert tree_digest(store.root) == before


def test_append_of_one_dict_is_a_clear_error(store):
    with pytest.raises(TypeError, match="list of records"):
        store.append(GOOD)


@pytest.mark.slow
def test_concurrent_appends_of_one_id_cannot_both_succeed(store):
    code = (
        "import sys; from consolidate.store import Store\n"
        "s = Store(sys.argv[1])\n"
        "try:\n"
        "    s.append([{'id': 'dup', 'namespace': 'u', 'text': 'x' + sys.argv[2],"
        " 'vector': [1.0, 0.0, 0.0], 'last_used': 1.0}]); print('ok')\n"
        "except Exception as e:\n    print('refused', type(e).__name__)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(store.root), str(k)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in range(4)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs.count("ok") == 1, outs
    assert list(store.load().records.meta["id"]).count("dup") == 1


def test_mark_used_refuses_seconds_and_inf(store):
    import time

    for bad in (time.time(), math.inf, math.nan):
        with pytest.raises(ValueError, match="hours since the epoch"):
            store.mark_used(["a"], now=bad)
    assert not any((store.root / "deltas").iterdir())


def test_exact_dedup_keeps_signs_and_symbols_apart():
    texts = [
        "-5 degrees outside",
        "5 degrees outside",
        ":)",
        ":(",
        "$100 budget",
        "\u20ac100 budget",
    ]
    g = np.random.default_rng(0)
    rows = [
        {"id": f"t{k}", "namespace": "u", "text": t, "vector": g.normal(size=8), "last_used": 1.0}
        for k, t in enumerate(texts)
    ]
    rows.append(
        {
            "id": "t9",
            "namespace": "u",
            "text": "  5 Degrees outside. ",
            "vector": g.normal(size=8),
            "last_used": 1.0,
        }
    )
    res = run_pass(make_records(rows), cfg=PassConfig(now="1", near_dedup=False), wall_h=2.0)
    merges = [e["members"] for e in res.events if e["op"] == "exact_merge"]
    assert merges == [["t1", "t9"]]


def test_signed_numbers_conflict():
    from consolidate.ops.guard import conflict_reason

    assert conflict_reason("-5 degrees outside", "5 degrees outside") == "number"


def test_records_with_a_shuffled_index_tombstone_the_right_rows():
    recs = make_records(
        [
            {**GOOD, "id": "r0", "importance": 0.9},
            {**GOOD, "id": "r1", "text": "other", "vector": [0, 1.0, 0], "importance": 0.1},
        ]
    )
    shuffled = Records(recs.meta.iloc[[1, 0]], recs.vectors[[1, 0]])
    res = run_pass(shuffled, cfg=PassConfig(cap=1, now="10"), wall_h=11.0)
    m = res.records.meta.set_index("id")
    assert m.loc["r1", "deleted_reason"] == "cap" and math.isnan(m.loc["r0", "deleted_at"])
    assert [e["id"] for e in res.events if e["op"] == "drop"] == ["r1"]


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"floor": math.nan}, "floor"),
        ({"floor": 2.0}, "floor"),
        ({"now": "nan"}, "now"),
        ({"now": "inf"}, "now"),
        ({"cap": 2.5}, "cap"),
        ({"tau_hours": math.inf}, "tau"),
        ({"threshold": math.nan}, "threshold"),
        ({"strength_cap": 0.5}, "strength_cap"),
    ],
)
def test_bad_pass_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        run_pass(make_records([GOOD]), cfg=PassConfig(**kw), wall_h=20.0)


def test_mass_drop_safety_stop():
    rows = [
        {
            **GOOD,
            "id": f"r{k}",
            "text": f"fact {'abcd'[k]}",
            "last_used": 10.0,
            "vector": np.eye(4)[k],
        }
        for k in range(4)
    ]
    with pytest.raises(MassDropError, match=r"drop 4 of 4"):
        run_pass(make_records(rows), cfg=PassConfig(now="100000", floor=0.01), wall_h=1e5)
    res = run_pass(
        make_records(rows),
        cfg=PassConfig(now="100000", floor=0.01, max_drop_fraction=1.0),
        wall_h=1e5,
    )
    assert res.stats["dropped_floor"] == 4


def test_recall_during_a_pass_revives_a_dropped_memory(store):
    with store.lock():
        snap = store.load()
        res = run_pass(
            snap.records,
            cfg=PassConfig(now="10", cap=1, max_drop_fraction=1.0, near_dedup=False),
            version=2,
            wall_h=20.0,
        )
        dropped = next(e["id"] for e in res.events if e["op"] == "drop")
        store.mark_used([dropped], now=15.0)
        store.commit(res.records, res.events, base=snap)
    m = store.load().records.meta.set_index("id")
    assert math.isnan(m.loc[dropped, "deleted_at"]) and m.loc[dropped, "last_used"] == 15.0


@pytest.mark.parametrize(
    "content", ["{not json", "[]", "null", '{"version": "1", "snapshot": 3, "dim": "4"}']
)
def test_corrupt_pointer_names_the_file(store, content):
    store.pointer_path.write_text(content)
    with pytest.raises(CorruptStoreError, match="CURRENT is not a valid pointer"):
        store.load()


def test_corrupt_touch_delta_is_quarantined_and_named(store, caplog):
    name = "00000000000000000001-1-x.touch.json"
    (store.root / "deltas" / name).write_text("{oops")
    before = store.head()
    snap = store.load()  # the rest of the store loads
    assert snap.version == before.version and len(snap.records) == 2
    assert (store.root / "quarantine" / name).read_text() == "{oops"
    assert not (store.root / "deltas" / name).exists()
    assert len(store.refused_deltas) == 1 and name in store.refused_deltas[0]
    assert "not JSON" in store.refused_deltas[0] and name in caplog.text


def test_create_with_no_records(tmp_path):
    with pytest.raises(ValueError, match="no records"):
        Store(tmp_path / "s").create(Records.empty(4))


def test_quarantine_on_load_writes_one_file(tmp_path):
    s = Store(tmp_path / "q")
    s.create(make_records([{**GOOD, "id": "a"}, {**GOOD, "id": "b", "text": "t"}]))
    from consolidate.store.schema import records_to_arrow

    recs = s.load().records
    recs.meta.loc[0, "importance"] = 9.0
    rewrite_snapshot(s, records_to_arrow(recs))
    q = Store(s.root, quarantine=True)
    for _ in range(3):
        assert list(q.load().records.meta["id"]) == ["b"]
    assert len(list((s.root / "quarantine").glob("*.parquet"))) == 1


def locomo_file(tmp_path, conv):
    p = tmp_path / "locomo.json"
    p.write_text(json.dumps([conv]))
    return p


def test_locomo_bad_first_session_time_takes_the_nearest(tmp_path):
    conv = {
        "sample_id": "c1",
        "conversation": {
            "session_1_date_time": "garbage",
            "session_2_date_time": "1:56 pm on 8 May, 2023",
        },
        "observation": {
            "session_1_observation": {"A": [["fact one", "D1:1"]]},
            "session_2_observation": {"A": [["fact two", "D2:1"]]},
        },
    }
    obs, rep = read_locomo_observations(locomo_file(tmp_path, conv))
    assert obs[0].time_h == obs[1].time_h > 400000
    assert rep.bad_times == [{"conversation": "c1", "session": 1, "value": "garbage"}]


def test_locomo_malformed_items_are_reported_not_invented(tmp_path):
    conv = {
        "sample_id": "c1",
        "conversation": {"session_1_date_time": "1:56 pm on 8 May, 2023"},
        "observation": {
            "session_1_observation": {"A": [[None, "D1:1"], [], "text", ["good one", "D1:2"]]}
        },
    }
    obs, rep = read_locomo_observations(locomo_file(tmp_path, conv))
    assert [o.text for o in obs] == ["good one"]
    assert [m["id"] for m in rep.malformed_items] == ["c1/A/s1/0", "c1/A/s1/1", "c1/A/s1/2"]


@pytest.mark.parametrize(
    "conv,match",
    [
        ({"sample_id": "c1", "conversation": [], "observation": {}}, "conversation #0"),
        (
            {"sample_id": "c1", "conversation": {}, "observation": {"session_1_observation": {}}},
            "no session has a parseable date",
        ),
        (
            {
                "sample_id": "c1",
                "conversation": {"session_1_date_time": "1:56 pm on 8 May, 2023"},
                "observation": {"session_1_observation": {"A": "not a list"}},
            },
            "not a list",
        ),
    ],
)
def test_locomo_structural_errors_name_the_conversation(tmp_path, conv, match):
    with pytest.raises(ValueError, match=match):
        read_locomo_observations(locomo_file(tmp_path, conv))


def test_locomo_invalid_json_names_the_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_bytes(b"\xff\xfe not json")
    with pytest.raises(ValueError, match="x.json"):
        read_locomo_observations(p)


# ---------------------------------------------------------------- store attacks (issue 11)
@pytest.mark.parametrize(
    "field,value",
    [
        ("snapshot", "../../outside.parquet"),
        ("snapshot", "/etc/passwd"),
        ("changelog", "../x.jsonl"),
        ("folded", ["../../victim.parquet"]),
        ("folded", ["sub/dir.parquet"]),
        ("folded", [".."]),
        ("folded", "abc"),
    ],
)
def test_pointer_names_never_leave_the_store(store, tmp_path, field, value):
    victim = tmp_path / "victim.parquet"
    victim.write_text("keep me")
    ptr = json.loads(store.pointer_path.read_text())
    store.pointer_path.write_text(json.dumps({**ptr, field: value}))
    with pytest.raises(CorruptStoreError, match=field):
        store.load()
    with pytest.raises(CorruptStoreError, match=field):
        store.append([{**GOOD, "id": "new"}])
    assert victim.read_text() == "keep me"


def test_create_refuses_a_folder_that_lost_its_pointer(store):
    before = tree_digest(store.root)
    store.pointer_path.unlink()
    with pytest.raises(FileExistsError, match="not empty and holds no store"):
        Store(store.root).create(make_records([{**GOOD, "id": "z"}]))
    after = tree_digest(store.root)
    assert {k: v for k, v in before.items() if k != "CURRENT"} == after


def test_create_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError):
        Store(tmp_path / "f").create(make_records([{**GOOD, "id": "z"}]))
    assert (tmp_path / "f").read_text() == "x"


@pytest.mark.parametrize("fmt", ["parquet", "lance"])
@pytest.mark.parametrize("col", ["created_at", "last_used", "deleted_at"])
def test_future_times_are_refused_at_write_and_at_load(tmp_path, col, fmt):
    from consolidate.store import open_store_dir
    from consolidate.store.schema import hours_from_datetime

    year_2100 = hours_from_datetime("2100-01-01T00:00:00Z")
    row = {**GOOD, "id": "late", "text": "from the future", col: year_2100}
    s = open_store_dir(tmp_path / "s", format=fmt)
    with pytest.raises(InvalidRecordsError, match=f"{col} in the future.*'late'"):
        s.create(make_records([{**GOOD, "id": "a"}, row]))
    s.create(make_records([{**GOOD, "id": "a"}]))
    with pytest.raises(InvalidRecordsError, match=f"{col} in the future.*'late'"):
        s.append([row])
    # written behind the store's back (another tool, a restored backup): refused at load
    snap = s.load()
    bad = make_records([row])
    with s.lock():
        forged = Records.concat([snap.records, bad], 3)
        s.future_tolerance_h = math.inf  # let the forged version through the commit check
        s.commit(forged, [], base=snap)
    with pytest.raises(InvalidRecordsError, match=f"{col} in the future.*'late'"):
        open_store_dir(tmp_path / "s").load()


def test_a_flipped_bit_in_a_snapshot_is_caught(store):
    path = store.root / "snapshots" / store.head().snapshot
    data = bytearray(path.read_bytes())
    # flip one bit in every 64th byte of the data pages (the footer is at the end)
    for k in range(8, len(data) // 2, 64):
        data[k] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match="does not match the sha256 recorded"):
        store.load()
    # a store from before the sha256 in CURRENT: the page checksums still catch data pages
    ptr = json.loads(store.pointer_path.read_text())
    del ptr["snapshot_sha256"], ptr["rows"]
    store.pointer_path.write_text(json.dumps(ptr))
    with pytest.raises(CorruptStoreError, match="cannot read snapshot"):
        store.load()


def test_a_flipped_bit_anywhere_in_a_snapshot_is_caught(store):
    """Every bit of a small snapshot, footer and page headers included (a footer flip once
    dropped records or changed list values silently): the sha256 in CURRENT catches all."""
    path = store.root / "snapshots" / store.head().snapshot
    good = path.read_bytes()
    for k in range(0, len(good), max(1, len(good) // 400)):
        bad = bytearray(good)
        bad[k] ^= 1 << (k % 8)
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptStoreError):
            store.load()
    path.write_bytes(good)
    assert len(store.load().records) == 2


def test_pointer_counts_rows(store):
    ptr = json.loads(store.pointer_path.read_text())
    assert ptr["rows"] == 2 and len(ptr["snapshot_sha256"]) == 64
    store.pointer_path.write_text(json.dumps({**ptr, "rows": 3}))
    with pytest.raises(CorruptStoreError, match="has 2 rows"):
        store.load()
    for field, value in (
        ("dim", True),
        ("rows", -1),
        ("snapshot_sha256", "x"),
        ("last_pass_at", "x"),
        ("last_pass_at", 1e300),
    ):
        store.pointer_path.write_text(json.dumps({**ptr, field: value}))
        with pytest.raises(CorruptStoreError, match=field):
            store.load()


def test_a_failed_commit_leaves_no_orphan(store, monkeypatch):
    import consolidate.store.store as st_mod

    snap = store.load()
    before = tree_digest(store.root)

    def full_disk(path, events):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st_mod, "_write_jsonl", full_disk)
    changed = snap.records.take(np.arange(len(snap.records)))
    changed.meta.loc[0, "importance"] = 0.25  # a change, so the commit writes
    with store.lock(), pytest.raises(OSError, match="No space left"):
        store.commit(changed, [], base=snap)
    assert tree_digest(store.root) == before  # no snapshot-000002, no temp file
    assert store.load().version == 1


def _job(tmp_path, *args):
    return run_job(tmp_path, *args)


def test_store_name_cannot_leave_the_store_root(tmp_path):
    r = _job(tmp_path, "store.name=../../elsewhere")
    assert r.returncode == 2 and "store.name must be a plain folder name" in r.stderr
    assert not (tmp_path.parent / "elsewhere").exists()


def test_job_on_a_folder_without_pointer_does_not_reimport(tmp_path, store):
    store.pointer_path.unlink()
    before = tree_digest(store.root)
    r = _job(tmp_path, f"store.dir={store.root}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and "holds no store" in r.stderr
    assert tree_digest(store.root) == before


def test_quarantine_keeps_the_vector_as_given(tmp_path):
    import pyarrow.parquet as pq

    s = Store(tmp_path / "q", quarantine=True)
    s.create(make_records([{**GOOD, "id": "a"}]))
    s.append([{**GOOD, "id": "nan", "vector": [math.nan, 0.5, math.inf]}, {**GOOD, "id": "fine"}])
    (q,) = (s.root / "quarantine").glob("*.parquet")
    t = pq.read_table(q)
    assert t.column("id").to_pylist() == ["nan"]
    v = t.column("vector").to_pylist()[0]
    assert math.isnan(v[0]) and v[1] == 0.5 and v[2] == math.inf
    assert "NaN or inf in vector" in t.column("quarantine_reason").to_pylist()[0]
    assert sorted(s.load().records.meta["id"]) == ["a", "fine"]


def test_list_columns_must_hold_strings_and_a_failed_create_leaves_nothing(tmp_path):
    from consolidate.store.schema import records_from_rows, validate

    recs = records_from_rows([{**GOOD, "id": f"r{k}", "text": f"t {k}"} for k in range(4)])
    recs.meta.at[0, "source_ids"] = [1, None]
    recs.meta.at[1, "keep_apart"] = [2.5]
    recs.meta.at[2, "derived_from"] = "D1:3"  # a bare string, not a list
    (p,) = validate(recs, dim=3)
    assert p.kind == "source_ids, keep_apart or derived_from is not a list of strings"
    assert p.ids == ["r0", "r1", "r2"]
    root = tmp_path / "new"
    with pytest.raises(InvalidRecordsError, match="not a list of strings"):
        Store(root).create(recs)
    assert not root.exists()


def test_a_create_that_fails_while_writing_can_be_retried(tmp_path, monkeypatch):
    import consolidate.store.store as st_mod

    real = st_mod._write_parquet

    def full_disk(table, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st_mod, "_write_parquet", full_disk)
    empty = tmp_path / "empty"
    empty.mkdir()
    for root in (tmp_path / "new", empty):
        with pytest.raises(OSError, match="No space left"):
            Store(root).create(make_records([{**GOOD, "id": "a"}]))
    assert not (tmp_path / "new").exists() and list(empty.iterdir()) == []
    monkeypatch.setattr(st_mod, "_write_parquet", real)
    assert len(Store(empty).create(make_records([{**GOOD, "id": "a"}])).records) == 1


def test_two_skewed_clocks_do_not_lose_a_memory(tmp_path, monkeypatch):
    import consolidate.store.schema as schema

    s = Store(tmp_path / "s", quarantine=True)
    s.create(make_records([{**GOOD, "id": "a"}]))
    fast = schema.hours_now() + 4 / 60  # the writer's clock runs 4 minutes ahead: accepted
    s.append([{**GOOD, "id": "fresh", "created_at": fast, "last_used": fast}])
    # read by a host whose clock is 3 minutes behind: 7 minutes "in the future", within 2x
    real = schema.hours_now
    monkeypatch.setattr(schema, "hours_now", lambda: real() - 3 / 60)
    assert sorted(s.load().records.meta["id"]) == ["a", "fresh"]
    assert not (s.root / "quarantine").exists()
    # 11 minutes behind: beyond both allowances, refused (here: quarantined) by name
    monkeypatch.setattr(schema, "hours_now", lambda: real() - 11 / 60)
    assert sorted(s.load().records.meta["id"]) == ["a"]
    assert len(list((s.root / "quarantine").glob("*.parquet"))) == 1


def test_namespace_safety_stop():
    # 100 fresh memories in "big", 25 a year old in "victim" and 10 in "small": the floor
    # would drop 35 of 135 (26%, under the store-wide 50%) but all of "victim"
    rows = []
    for ns, n, t in (("big", 100, 9000.0), ("victim", 25, 100.0), ("small", 10, 100.0)):
        rows += [
            {
                **GOOD,
                "id": f"{ns}{k}",
                "namespace": ns,
                "text": f"{ns} fact {k}",
                "last_used": t,
                "created_at": t,
                "vector": np.random.default_rng(len(rows) + k).normal(size=3),
            }
            for k in range(n)
        ]
    recs = make_records(rows)
    cfg = dict(now="9000", floor=0.01, near_dedup=False, cap=None)
    with pytest.raises(
        MassDropError,
        match=r"more than 90% .* 1 namespace\(s\) \(victim: "
        r"25 of 25\)",
    ):
        run_pass(recs, cfg=PassConfig(**cfg), wall_h=9000.0)
    res = run_pass(recs, cfg=PassConfig(**cfg, max_namespace_drop_fraction=1.0), wall_h=9000.0)
    assert res.stats.dropped_floor == 35  # "small" is under namespace_stop_min_live
    res = run_pass(recs, cfg=PassConfig(**cfg, namespace_stop_min_live=26), wall_h=9000.0)
    assert res.stats.dropped_floor == 35
    with pytest.raises(ValueError, match="max_namespace_drop_fraction"):
        run_pass(recs, cfg=PassConfig(**cfg, max_namespace_drop_fraction=1.5), wall_h=9000.0)

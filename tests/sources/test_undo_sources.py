"""One undo for every external source (files, LanceDB tables, PostgreSQL + pgvector here;
Mem0 on local Qdrant and on pgvector in test_mem0.py), against the real engines: a merge undone by a prefix of its merged
id, then the rest of its plan by a prefix of the plan id; the members live again with their
own texts and the merged rows retired; a second undo restores nothing; the next pass never
merges the undone members again; an id that names nothing, or several things, is one clear
error."""

import numpy as np
import pyarrow as pa
import pytest

from consolidate.config import PassConfig, SimilarityConfig
from consolidate.pipeline import run_pass
from consolidate.sources.journal import UndoTargetError, match_target
from tests.helpers import make_records, random_rows

WALL = 2000.0
DIM = 16


def rows(n=60, seed=7):
    """Planted near-duplicates in 2 namespaces; every 9th row long unused (a floor drop)."""
    out = random_rows(n, DIM, namespaces=2, dup_frac=0.3, noise=0.01, seed=seed, t0=WALL - 1)
    for k, r in enumerate(out):
        if k % 9 == 0:
            r["created_at"] = r["last_used"] = WALL - 30000.0
    return out


def memory_file(tmp_path, suffix=".jsonl"):
    """``rows()`` exported by a store to ``tmp_path/mem<suffix>``; returns the path."""
    from consolidate.store.lance import LanceStore

    s = LanceStore(tmp_path / "src")
    s.create(make_records(rows()))
    path = tmp_path / f"mem{suffix}"
    s.export(path)
    return path


def live(src):
    """id -> text of the source's live records."""
    recs = src.read().records
    m = recs.meta[recs.live_mask()] if hasattr(recs, "live_mask") else recs.meta
    return dict(zip(m["id"], m["text"], strict=True))


def one_pass(src, apply=True):
    snap = src.read()
    recs = src.records(snap)
    res = run_pass(
        recs,
        cfg=PassConfig(force=True, max_drop_fraction=0.5),
        sim_cfg=SimilarityConfig(device="cpu"),
        version=1,
        wall_h=WALL,
    )
    plan = src.plan(snap, res.records)
    rep = src.apply(plan, dry_run=False) if apply else None
    return snap, res, plan, rep


def check_undo(src, before, plan, member_ids=None, drops=True):
    """The shared promise: undo one merge by a prefix of its id, then the plan by a prefix
    of its id, then again; the next pass keeps the members apart."""
    merges = [u for u in plan.units if u["kind"] == "merge"]
    assert len(merges) >= 3 and any(u["kind"] == "drop" for u in plan.units) == drops
    keys = [u["key"] for u in plan.units if u["kind"] in ("merge", "drop")]
    members = {u["key"]: member_ids(u) if member_ids else u["ids"] for u in merges}
    first = merges[0]["key"]
    rep = src.undo(first[:12])
    assert rep.undone == [first] and rep.plan_id == plan.plan_id
    assert sorted(rep.restored) == sorted(members[first])
    now = live(src)
    assert all(now[i] == before[i] for i in members[first])  # their own texts
    assert first not in now
    rep = src.undo(plan.plan_id[:8])
    assert rep.already == [first] and sorted(rep.undone) == sorted(set(keys) - {first})
    assert not rep.skipped
    now = live(src)
    everyone = sorted(i for ids in members.values() for i in ids)
    assert sorted(rep.restored + members[first]) == sorted(
        everyone + [u["ids"][0] for u in plan.units if u["kind"] == "drop"]
    )
    assert {i: now[i] for i in before} == before  # every record back, as it was
    assert not set(members) & set(now)  # no merged row live
    again = src.undo(plan.plan_id[:8])
    assert again.undone == [] and again.restored == [] and sorted(again.already) == sorted(keys)
    # the next pass: the undone members are kept apart (not one of them merged again)
    got = {i: set(a) for i, a in zip(*_apart(src), strict=True)}
    for ids in members.values():
        for i in ids:
            assert set(ids) - {i} <= got[i]
    _, res, _, _ = one_pass(src, apply=False)
    for e in res.events:
        if e["op"] == "merge":
            for ids in members.values():
                assert len(set(e["members"]) & set(ids)) <= 1, (e["members"], ids)
    with pytest.raises(UndoTargetError, match="no applied plan, merge or drop"):
        src.undo("zzzzzzzz")


def _apart(src):
    m = src.read().records.meta
    return m["id"].tolist(), m["keep_apart"].tolist()


def test_match_target_by_whole_id_and_unique_prefix():
    plans = [
        {"plan_id": "abcd1111", "units": [{"key": "m-aaa1"}, {"key": "m-aab2"}]},
        {"plan_id": "abcd2222", "units": [{"key": "x"}]},
    ]
    assert match_target("abcd1", plans) == ("abcd1111", plans[0]["units"])
    assert match_target("m-aab", plans) == ("abcd1111", [{"key": "m-aab2"}])
    assert match_target("x", plans) == ("abcd2222", [{"key": "x"}])  # whole id: any length
    with pytest.raises(UndoTargetError, match="too short"):
        match_target("ab", plans)
    # short, and no id starts with it: says there is no such id, not "too short"
    with pytest.raises(UndoTargetError, match="no applied plan, merge or drop .* 'n9'"):
        match_target("n9", plans)
    with pytest.raises(UndoTargetError, match="matches 2 plans"):
        match_target("abcd", plans)
    with pytest.raises(UndoTargetError, match="matches 2 plans"):
        match_target("m-aa", plans)
    with pytest.raises(UndoTargetError, match="no applied plan"):
        match_target("m-ab", plans)
    assert match_target("last", plans) == ("abcd2222", [{"key": "x"}])
    with pytest.raises(UndoTargetError, match="no applied plan"):
        match_target("last", [])


def test_a_memory_file_undo(tmp_path):
    from consolidate.sources import FileSource

    path = memory_file(tmp_path)
    src = FileSource(path)
    before = live(src)
    _, _, plan, rep = one_pass(src)
    assert rep.applied["merge"] >= 3
    assert (tmp_path / "mem.jsonl.consolidate" / "applied.jsonl").exists()
    check_undo(src, before, plan)


@pytest.mark.parametrize("soft", [True, False], ids=["soft-deletes", "hard-deletes"])
def test_a_lancedb_table_undo(tmp_path, soft):
    pytest.importorskip("lancedb")
    from consolidate.sources.lance_table import LanceTable
    from tests.sources.test_lance_table import SCHEMA, SOFT, table

    if soft:
        schema, cols = SCHEMA, SOFT
    else:
        import dataclasses

        schema = pa.schema([f for f in SCHEMA if f.name not in ("deleted_at", "merged_into")])
        cols = dataclasses.replace(SOFT, deleted_at=None, merged_into=None)
    t, path = table(tmp_path, rows(), schema=schema)
    src = LanceTable(path, cols)
    before = live(src)
    _, _, plan, rep = one_pass(src)
    assert rep.applied["merge"] >= 3
    v_applied = rep.version
    check_undo(src, before, plan)
    import lance

    ds = lance.dataset(path)
    assert ds.version > v_applied  # undo is new versions: the apply's version is kept
    assert ds.to_table(filter="tags LIKE 'from-agent%'").num_rows >= len(before)


def test_a_pgvector_table_undo(pg):
    import psycopg

    from consolidate.sources.pgvector import PgVectorTable
    from tests.sources.test_pgvector import COLS, fill

    fill(pg, "mem_undo", rows())
    src = PgVectorTable(pg, "mem_undo", COLS)
    before = live(src)
    with psycopg.connect(pg, autocommit=True) as c:  # a column of the user's own
        c.execute("ALTER TABLE mem_undo ADD COLUMN tags text")
        c.execute("UPDATE mem_undo SET tags = 'tag-' || id")
    snap, res, plan, _ = one_pass(src, apply=False)
    dry = src.plan(snap, res.records)
    assert dry.plan_id == plan.plan_id  # no wall clock in a plan id
    rep = src.apply(plan, dry_run=False)
    assert rep.applied["merge"] >= 3
    with psycopg.connect(pg) as c:
        tags = dict(c.execute("SELECT id, tags FROM mem_undo").fetchall())
    born = snap.records.meta.set_index("id")["created_at"]
    for u in plan.units:
        if u["kind"] == "merge":  # the merged row takes the oldest member's
            assert tags[u["key"]] == "tag-" + min(u["ids"], key=lambda i: (born[i], i))
    with psycopg.connect(pg) as c:  # an agent edits a retired member meanwhile
        edited = plan.units[0]["ids"][0]
        c.execute("UPDATE mem_undo SET memory = 'edited by the agent' WHERE id = %s", (edited,))
    before[edited] = "edited by the agent"  # undo keeps the agent's edit
    check_undo(src, before, plan)
    with psycopg.connect(pg) as c:
        n = c.execute(
            "SELECT count(*) FROM consolidate_history WHERE tab = 'mem_undo' AND change "
            "LIKE 'undo:%%'"
        ).fetchone()[0]
    undone_rows = sum(len(u["ids"]) + 1 for u in plan.units if u["kind"] == "merge")
    undone_rows += sum(1 for u in plan.units if u["kind"] == "drop")
    assert n == undone_rows  # every row the undo changed, as it was, in the history


def test_the_undo_job_on_a_memory_file(tmp_path, capsys, compose_cfg):
    """``consolidate-undo source=jsonl source.path=F id=PREFIX``: the job's lines."""

    from consolidate.jobs.undo import format_undo, run_undo
    from consolidate.sources import FileSource

    path = memory_file(tmp_path, ".parquet")
    _, _, plan, _ = one_pass(FileSource(path))

    def undo(target):
        cfg = compose_cfg(
            "undo",
            # quoted: Hydra reads a hex prefix such as 123456 or 12e456 as a number
            overrides=["source=jsonl", f"source.path={path}", f"id='{target}'"],
        )
        return format_undo(run_undo(cfg))

    n = len([u for u in plan.units if u["kind"] in ("merge", "drop")])
    restored = sum(len(u["ids"]) for u in plan.units)
    out = undo(plan.plan_id[:6])
    assert out.startswith(f"undid {n} unit(s) of plan {plan.plan_id} on file {path}: ")
    assert f"restored {restored} records" in out
    assert (
        undo(plan.plan_id)
        == f"undone before, nothing done: {n} unit(s) ("
        + ", ".join([u["key"] for u in plan.units][:5])
        + ")"
    )


def test_undo_pass_undoes_every_merge_and_drop_of_a_pass_as_arrays():
    """Hand-made records of one pass: merged m1 (a, b), m2 (c, d), e dropped by the floor,
    m3 (f, g) merged again into m4 by a later pass. Undoing the pass's events: m1 and m2
    tombstones ("undone"), a-d live and kept apart in pairs, e live and pinned, m3 skipped
    (merged again), a merge undone before reported, an unknown id reported gone."""
    from consolidate.pipeline.undo import undo_pass

    nan = float("nan")
    rows = []
    for i, into, why in [
        ("a", "m1", "merged"), ("b", "m1", "merged"), ("m1", None, None),
        ("c", "m2", "merged"), ("d", "m2", "merged"), ("m2", None, None),
        ("e", None, "floor"), ("f", "m3", "merged"), ("g", "m3", "merged"),
        ("m3", "m4", "merged"), ("m4", None, None), ("m5", None, "undone"), ("h", None, None),
    ]:  # fmt: skip
        rows.append(
            {
                "id": i,
                "text": f"memory {i}",
                "vector": [1.0, 0.0] if i != "h" else [0.0, 1.0],
                "deleted_at": 50.0 if why else nan,
                "deleted_reason": why,
                "merged_into": into,
                "last_used": 10.0,
                "created_at": 10.0,
            }
        )
    recs = make_records(rows)
    events = [
        {"op": "merge", "id": "m1", "members": ["a", "b"]},
        {"op": "exact_merge", "id": "m2", "members": ["c", "d"]},
        {"op": "merge", "id": "m3", "members": ["f", "g"]},
        {"op": "merge", "id": "m5", "members": []},
        {"op": "merge", "id": "zz", "members": []},
        {"op": "drop", "id": "e", "reason": "floor"},
        {"op": "review", "id": "h"},
    ]
    out, rep = undo_pass(recs, events, wall_h=99.0)
    m = out.meta.set_index("id")
    assert sorted(rep["undone"]) == ["e", "m1", "m2"]
    assert sorted(rep["restored"]) == ["a", "b", "c", "d", "e"]
    assert rep["already"] == ["m5"]
    assert [s["key"] for s in rep["skipped"]] == ["m3", "zz"]
    assert "merged again into m4" in rep["skipped"][0]["why"]
    for i in "abcde":
        assert np.isnan(m.at[i, "deleted_at"]) and m.at[i, "deleted_reason"] is None
        assert m.at[i, "merged_into"] is None
    assert list(m.at["a", "keep_apart"]) == ["b"] and list(m.at["d", "keep_apart"]) == ["c"]
    assert m.at["e", "pinned"] and not m.at["a", "pinned"]
    for i in ("m1", "m2"):
        assert m.at[i, "deleted_at"] == 99.0 and m.at[i, "deleted_reason"] == "undone"
    assert m.at["f", "merged_into"] == "m3" and m.at["m3", "merged_into"] == "m4"


def test_the_undo_job_undoes_a_whole_pass_on_the_store(tmp_path, compose_cfg):
    """``consolidate-undo id=last`` (or ``v<N>``) on the store: every merge of the newest
    pass undone in one new version, its members live and apart; the next pass keeps them
    apart; a second undo does nothing; an unknown version names the changelogs."""

    from consolidate.config import PassConfig, SimilarityConfig
    from consolidate.jobs.undo import format_undo, run_undo
    from consolidate.pipeline import run_pass
    from consolidate.sources.journal import UndoTargetError
    from consolidate.store.lance import LanceStore

    s = LanceStore(tmp_path / "s")
    s.create(make_records(random_rows(60, 16, namespaces=2, dup_frac=0.3, noise=0.01, seed=7)))
    pc = PassConfig(force=True, floor=0.0)
    with s.lock():
        snap = s.load()
        res = run_pass(snap.records, cfg=pc, sim_cfg=SimilarityConfig(device="cpu"), version=2)
        info = s.commit(res.records, res.events, base=snap)
    merges = {e["id"]: e["members"] for e in res.events if e["op"] in ("merge", "exact_merge")}
    assert len(merges) >= 3

    def undo(target):
        cfg = compose_cfg("undo", overrides=[f"store.dir={s.root}", f"id={target}"])
        return run_undo(cfg)

    out = undo("last")
    log = info["changelog"].removesuffix(".jsonl")
    assert out["plan_id"] == log and sorted(out["undone"]) == sorted(merges)
    assert sorted(out["restored"]) == sorted(i for v in merges.values() for i in v)
    assert format_undo(out).startswith(f"undid {len(merges)} unit(s) of plan {log} on store")
    m = s.load().records.meta.set_index("id")
    for mid, members in merges.items():
        assert m.at[mid, "deleted_reason"] == "undone"
        for i in members:
            assert np.isnan(m.at[i, "deleted_at"])
            assert set(m.at[i, "keep_apart"]) >= set(members) - {i}
    again = undo(f"v{info['version']}")
    assert again["undone"] == [] and sorted(again["already"]) == sorted(merges)
    with s.lock():
        snap = s.load()
        res2 = run_pass(snap.records, cfg=pc, sim_cfg=SimilarityConfig(device="cpu"), version=9)
    assert not [e for e in res2.events if e["op"] == "merge"]
    with pytest.raises(UndoTargetError, match="no changelog-000077.jsonl in"):
        undo("changelog-77")
    with pytest.raises(UndoTargetError, match="no pass wrote version 1 or one before"):
        undo("v1")
    with pytest.raises(UndoTargetError, match="has no version 99 "):
        undo("v99")

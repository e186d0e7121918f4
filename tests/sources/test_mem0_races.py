"""A Mem0 apply racing its agents (consolidate.sources.mem0_late), against real Mem0 stores
(Qdrant on a local path and pgvector): an agent's edit that lands while a unit runs, or
after it, is never lost: the unit compares and sets each delete, checks Mem0's history of
the kept member after its update, and a later check undoes a unit whose deleted member
an agent wrote; a run killed inside a unit is rolled back by the next one."""

import pytest

from consolidate.sources import mem0_late
from tests.helpers import requires
from tests.sources.test_mem0 import memory, run, source  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slow, requires("mem0")]


def _plan(src):
    snap = src.read()
    plan = src.plan(snap, run(snap).records)
    merges = [u for u in plan.units if u["kind"] == "merge" and u["delete"]]
    assert len(merges) >= 2
    return plan, merges


def _texts(m):
    return {r["id"]: r["memory"] for r in m.get_all(filters={"user_id": "alice"})["results"]} | {
        r["id"]: r["memory"] for r in m.get_all(filters={"user_id": "bob"})["results"]
    }


def test_an_edit_of_a_member_before_its_delete_keeps_the_unit_unmerged(memory, monkeypatch):  # noqa: F811
    """The agent edits a member between the unit's check and its delete: the conditional
    delete refuses, the members deleted so far come back, the edit stays, the unit is
    reported skipped and recorded undone (not kept apart); the other units apply."""
    src = source(memory)
    plan, merges = _plan(src)
    victim = merges[0]["delete"][0]
    real = mem0_late.cas_delete
    hit = []

    def racing(s, i, payload):
        if i == victim and not hit:
            hit.append(i)
            memory.update(i, text="Edited by the agent while the unit ran.")
        return real(s, i, payload)

    monkeypatch.setattr(mem0_late, "cas_delete", racing)
    before = _texts(memory)
    rep = src.apply(plan, dry_run=False)
    assert hit == [victim]
    assert [s["why"] for s in rep.skipped] == [f"changed during the apply: {victim}"]
    assert rep.applied["merge"] == len([u for u in plan.units if u["kind"] == "merge"]) - 1
    now = _texts(memory)
    assert now[victim] == "Edited by the agent while the unit ran."
    assert all(now[i] == before[i] for i in merges[0]["ids"] if i != victim)
    undone = src.journal.undone()
    assert undone[(plan.plan_id, merges[0]["key"])]["why"] == "changed during the apply"
    assert src.journal.keep_apart() == {}


def test_an_edit_of_the_kept_member_during_its_update_is_kept(memory, monkeypatch):  # noqa: F811
    """The agent updates the kept member just before the unit's own update (which would
    overwrite it): Mem0's history shows the agent's UPDATE first, so the unit is rolled
    back with the agent's text on the kept member and every deleted member put back."""
    src = source(memory)
    plan, merges = _plan(src)
    u = merges[0]
    real = memory.update
    hit = []

    def racing(i, text=None, **kw):
        if i == u["keep"] and text == u["text"] and not hit:
            hit.append(i)
            real(i, text="The agent's own words.")
        return real(i, text=text, **kw)

    monkeypatch.setattr(memory, "update", racing)
    rep = src.apply(plan, dry_run=False)
    assert hit
    assert any(s["why"].startswith(f"changed during the apply: {u['keep']}") for s in rep.skipped)
    now = _texts(memory)
    assert now[u["keep"]] == "The agent's own words."
    assert all(i in now for i in u["ids"])


def test_an_update_after_the_unit_undoes_it_with_the_agents_text(memory):  # noqa: F811
    """An agent's update of a deleted member after the apply (Qdrant: an upsert revives it;
    pgvector: it lands nowhere, only in Mem0's history) is found by the next check: the
    unit is undone, that member live with the agent's text, the kept member back to its
    own text; a second check finds nothing."""
    src = source(memory)
    plan, merges = _plan(src)
    u = merges[0]
    victim = u["delete"][0]
    snap_text = {i: plan.read[i][0]["data"] for i in u["ids"]}
    rep = src.apply(plan, dry_run=False)
    assert rep.late == [] and not rep.skipped
    # the agent had read the member before the apply: Mem0's update of it now
    existing = plan.read[victim][0]
    vs = memory.vector_store
    payload = dict(
        existing, data="Alice moved to Hamburg in 2024.", hash="x", updated_at=mem0_late._now()
    )
    vs.update(vector_id=victim, vector=plan.read[victim][1].tolist(), payload=payload)
    memory.db.add_history(
        victim, existing["data"], payload["data"], "UPDATE", updated_at=payload["updated_at"]
    )
    vs.delete(vector_id=victim) if memory.config.vector_store.provider == "pgvector" else None
    dry = src.reconcile(dry_run=True)
    assert [(x["unit"], x["action"], x["rows"]) for x in dry] == [
        (u["key"], "would undo", [victim])
    ]
    got = src.reconcile()
    assert [(x["unit"], x["action"]) for x in got] == [(u["key"], "undone")]
    now = _texts(memory)
    assert now[victim] == "Alice moved to Hamburg in 2024."
    assert now[u["keep"]] == snap_text[u["keep"]]
    assert all(i in now for i in u["ids"])
    assert src.reconcile() == []


def test_a_run_killed_inside_a_unit_is_rolled_back_by_the_next(memory, monkeypatch):  # noqa: F811
    """Killed after a unit's delete and before its update (pending.json left): the next
    run rolls the unit back first (the deleted member back as read, recorded undone as
    interrupted), so the store is as before the apply."""
    src = source(memory)
    plan, merges = _plan(src)

    def killed(*a, **k):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(memory, "update", killed)
    before = _texts(memory)
    with pytest.raises(KeyboardInterrupt):
        src.apply(plan, dry_run=False)
    pending = src.journal.pending()
    assert pending is not None
    first = pending["unit"]
    assert len(first["ids"]) >= 2
    assert len(_texts(memory)) == len(before) - (len(first["ids"]) - 1)
    monkeypatch.undo()
    assert src.reconcile() == []
    assert src.journal.pending() is None
    assert _texts(memory) == before
    assert src.journal.undone()[(plan.plan_id, first["key"])]["why"] == "interrupted"

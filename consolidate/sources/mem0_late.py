"""A Mem0 apply that races its agents safely: each unit compares and sets, is checked
against Mem0's own history after it runs, and a write that lands anyway is settled
(:mod:`consolidate.sources.late`).

Mem0 has no transactions, so a unit (delete the merge's other members, then write the
merged text on the kept member) is made safe step by step:

1. ``pending.json`` and the unit's journal line (every member, payload and vector, as read)
   are written before Mem0 is touched;
2. each member is deleted only if it is still as read: a conditional delete in the vector
   store itself (Qdrant: a filter on the id, ``hash`` and ``updated_at``; pgvector: a
   ``DELETE ... WHERE`` on the same), so an agent's edit that lands first keeps its
   member, and the unit is rolled back (the members deleted so far put back as read);
   the DELETE goes into Mem0's history as ``Memory.delete`` writes it;
3. the kept member gets the merged text through ``Memory.update``; then Mem0's history of
   the kept member is read: an agent's UPDATE between the unit's start and ours was
   overwritten, so the unit is rolled back with the agent's text on the kept member;
4. a later check (every apply, before and after its units; :meth:`Mem0Source.reconcile`)
   reads Mem0's history of every applied unit's deleted members: an agent's UPDATE after
   the unit (it revives the member on Qdrant, where an update is an upsert; it lands
   nowhere on pgvector) undoes the unit with the agent's text on that member.

A rolled-back or undone unit is recorded in ``undone.jsonl`` with ``why`` (nothing kept
apart, nothing pinned), so a user's undo reports it undone already. A run killed inside a
unit leaves ``pending.json``: the next apply, reconcile or undo rolls that unit back first.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np

from .late import LateWrite

if TYPE_CHECKING:
    from .mem0 import Mem0Plan, Mem0Source


def _history_add(memory: Any, i: str, payload: dict[str, Any]) -> None:
    from .mem0 import _history_add as add

    add(memory, i, payload)


__all__ = ["apply_unit", "reconcile", "recover"]


def _now() -> str:
    """The wall clock as Mem0 writes it in its history (ISO 8601, UTC)."""
    return datetime.now(timezone.utc).isoformat()


def _md5(text: str | None) -> str | None:
    return None if text is None else hashlib.md5(text.encode()).hexdigest()


def cas_delete(src: Mem0Source, i: str, payload: dict[str, Any]) -> bool:
    """Delete memory ``i`` only if its ``hash`` and ``updated_at`` are still those of
    ``payload`` (one conditional delete in the vector store); ``True`` when it is gone.
    The DELETE is written into Mem0's history as ``Memory.delete`` writes it."""
    vs = src.m.vector_store
    provider = src.m.config.vector_store.provider
    h, ua = payload.get("hash"), payload.get("updated_at")
    if provider == "qdrant":
        from qdrant_client import models

        def cond(key: str, value: Any) -> Any:
            if value is None:
                return models.IsEmptyCondition(is_empty=models.PayloadField(key=key))
            return models.FieldCondition(key=key, match=models.MatchValue(value=value))

        vs.client.delete(
            collection_name=vs.collection_name,
            points_selector=models.FilterSelector(
                filter=models.Filter(
                    must=[
                        models.HasIdCondition(has_id=[i]),
                        cond("hash", h),
                        cond("updated_at", ua),
                    ]
                )
            ),
        )
        gone = vs.get(vector_id=i) is None
    else:  # pgvector (read() refuses the others)
        from psycopg import sql

        with vs._get_cursor(commit=True) as cur:
            cur.execute(
                sql.SQL(
                    "DELETE FROM {} WHERE id::text = %s AND payload->>'hash' IS NOT DISTINCT "
                    "FROM %s AND payload->>'updated_at' IS NOT DISTINCT FROM %s"
                ).format(vs._col()),
                (i, h, ua),
            )
            gone = cur.rowcount == 1 or vs.get(vector_id=i) is None
    if gone:
        src.m.db.add_history(
            i,
            payload.get("data", ""),
            None,
            "DELETE",
            created_at=payload.get("created_at"),
            updated_at=_now(),
            actor_id=payload.get("actor_id"),
            role=payload.get("role"),
            is_deleted=1,
        )
        forget = getattr(src.m, "_remove_memory_from_entity_store", None)
        if forget is not None:
            scope = {k: payload[k] for k in ("user_id", "agent_id", "run_id") if payload.get(k)}
            forget(i, scope)
    return gone


def history_since(src: Mem0Source, ids: list[str], since: str) -> dict[str, list[dict[str, Any]]]:
    """Mem0's history events of ``ids`` written after ``since`` (ISO), oldest first:
    ``{id: [{"event", "old_memory", "new_memory", "updated_at"}]}``."""
    want = set(ids)
    out: dict[str, list[dict[str, Any]]] = {}
    if not want:
        return out
    db = src.m.db
    with db._lock:
        rows = db.connection.execute(
            "SELECT memory_id, event, old_memory, new_memory, updated_at FROM history WHERE "
            "updated_at > ? ORDER BY DATETIME(updated_at) ASC, updated_at ASC",
            (since,),
        ).fetchall()
    for mid, event, old, new, at in rows:
        if mid in want:
            out.setdefault(mid, []).append(
                {"event": event, "old_memory": old, "new_memory": new, "updated_at": at}
            )
    return out


def _foreign_on_kept(events: list[dict[str, Any]], merged: str | None) -> dict[str, Any] | None:
    """An agent's UPDATE of the kept member before ours (ours: the first UPDATE to the
    merged text), which ours overwrote; ``None`` when there is none."""
    for e in events:
        if e["event"] == "UPDATE" and e["new_memory"] == merged:
            return None
        if e["event"] == "UPDATE":
            return e
    return None


def _late_on_deleted(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest agent UPDATE of a deleted member after our DELETE (or an UPDATE before
    it that a crash let through); ``None`` when there is none."""
    ups = [e for e in events if e["event"] == "UPDATE"]
    return ups[-1] if ups else None


def roll_back(
    src: Mem0Source,
    plan_id: str,
    unit: dict[str, Any],
    why: str,
    texts: dict[str, str] | None = None,
) -> list[str]:
    """Put unit ``unit`` (a journal unit) back: each deleted member inserted again as read
    (with the agent's text from ``texts``, embedded by Mem0's embedder, where an agent
    wrote it), the kept member's text back (the agent's from ``texts``, else the read one)
    unless someone wrote it after the merge; then record it undone with ``why`` (nothing
    kept apart). Returns the ids put back. A member present already is left as it is."""
    vs = src.m.vector_store
    texts = texts or {}
    back = []
    for r in unit["members"]:
        i, payload = r["id"], dict(r["payload"])
        now = vs.get(vector_id=i)
        if i == unit["keep"]:
            cur = None if now is None else (now.payload or {}).get("hash")
            want = texts.get(i, payload.get("data"))
            if now is not None and cur == _md5(unit.get("merged_text")):
                src.m.update(i, text=want)
                if i not in texts:
                    vs.update(vector_id=i, vector=r["vector"], payload=payload)
                back.append(i)
            continue
        if now is not None:
            continue  # live already (an agent's update revived it, or put back before)
        vec = r["vector"]
        if i in texts:
            payload.update(data=texts[i], hash=_md5(texts[i]), updated_at=_now())
            vec = src.m.embedding_model.embed(texts[i], "update")
        vs.insert(vectors=[vec], payloads=[payload], ids=[i])
        _history_add(src.m, i, payload)
        back.append(i)
    src.journal.record_undone(plan_id, unit, back, why=why)
    return back


def apply_unit(src: Mem0Source, plan: Mem0Plan, n: int, u: dict[str, Any], rep: Any) -> None:
    """Apply unit ``u`` (number ``n`` of ``plan``) as the module docstring says; records it
    in ``rep`` (applied, or skipped with why)."""
    j = src.journal
    assert j is not None
    t0 = _now()
    unit = j.unit(
        u,
        keep=u["keep"],
        merged_text=u["text"],
        at=t0,
        members=[
            {"id": i, "payload": plan.read[i][0], "vector": np.asarray(plan.read[i][1]).tolist()}
            for i in u["ids"]
        ],
    )
    with j.locked():
        j.begin({"op": "unit", "plan_id": plan.plan_id, "unit": unit})
        j.record_apply(plan.plan_id, [unit])
    deleted: list[str] = []
    for i in u["delete"]:
        if not cas_delete(src, i, plan.read[i][0]):
            with j.locked():
                roll_back(src, plan.plan_id, unit, "changed during the apply")
                j.done()
            rep.skipped.append(
                {"unit": n, "namespace": u["namespace"], "why": f"changed during the apply: {i}"}
            )
            return
        deleted.append(i)
    if u["keep"] is not None:
        src.m.update(u["keep"], text=u["text"])
        hit = _foreign_on_kept(history_since(src, [u["keep"]], t0).get(u["keep"], []), u["text"])
        if hit is not None:
            with j.locked():
                roll_back(
                    src,
                    plan.plan_id,
                    unit,
                    "changed during the apply",
                    {u["keep"]: hit["new_memory"]},
                )
                j.done()
            rep.skipped.append(
                {
                    "unit": n,
                    "namespace": u["namespace"],
                    "why": f"changed during the apply: {u['keep']} (the agent's text kept)",
                }
            )
            return
    with j.locked():
        j.done()
    rep.applied[u["kind"]] = rep.applied.get(u["kind"], 0) + 1


def recover(src: Mem0Source) -> None:
    """Roll back the unit a killed run left in flight (``pending.json``), under the
    caller's journal lock; the next pass plans it again."""
    j = src.journal
    if j is None:
        return
    p = j.pending()
    if p is None:
        return
    done = j.undone()
    if p.get("op") == "unit" and (p["plan_id"], p["unit"]["key"]) not in done:
        roll_back(src, p["plan_id"], p["unit"], "interrupted")
    j.done()


def reconcile(src: Mem0Source, dry_run: bool) -> list[dict[str, Any]]:
    """Find the applied units an agent wrote into after they ran (see the module
    docstring) and undo them with the agent's text, under the caller's journal lock;
    returns :meth:`LateWrite.as_dict` per unit."""
    j = src.journal
    if j is None:
        return []
    undone = j.undone()
    units = [
        (p["plan_id"], u)
        for p in j.plans()
        for u in p["units"]
        if (p["plan_id"], u["key"]) not in undone and u.get("at") and u.get("members")
    ]
    if not units:
        return []
    since = min(u["at"] for _, u in units)
    hist = history_since(src, [r["id"] for _, u in units for r in u["members"]], since)
    out = []
    for plan_id, u in units:
        texts = {}
        for r in u["members"]:
            evs = [e for e in hist.get(r["id"], []) if e["updated_at"] > u["at"]]
            e = (
                _foreign_on_kept(evs, u.get("merged_text"))
                if r["id"] == u["keep"]
                else _late_on_deleted(evs)
            )
            if e is not None:
                texts[r["id"]] = e["new_memory"]
        if not texts:
            continue
        lw = LateWrite(plan_id, u["key"], u["kind"], sorted(texts), ["text"], why="text changed")
        if dry_run:
            lw.action = "would undo"
        else:
            roll_back(src, plan_id, u, "late write", texts)
            lw.action = "undone"
        out.append(lw.as_dict())
    return out

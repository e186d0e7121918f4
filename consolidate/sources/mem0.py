"""A Mem0 store (the open-source ``mem0ai`` package) as the pass's source and sink.

Mem0's own write path adds memories (and drops exact repeats) but never merges near
duplicates; this adapter runs our pass over a Mem0 store and applies its merges through
Mem0's API, so Mem0's ``history`` table records them and a Mem0 user sees the result in
``get_all`` and ``search``:

1. :meth:`Mem0Source.read` scans the store's vector store with vectors and payloads
   (Qdrant: ``scroll``; pgvector: one ``SELECT``), one namespace per ``user_id`` (or
   ``agent_id``/``run_id``: ``namespace_key``). Mem0 keeps no importance, strength or last
   use: importance 0.5, strength 1, ``last_used`` = ``updated_at`` (else ``created_at``);
   provenance is the metadata key ``source_ids`` when a writer set it (``add(...,
   metadata={"source_ids": [...]})``), else none;
2. the pass runs on the records;
3. :meth:`Mem0Source.plan` keeps each merge's oldest member (its id stays, with the merged
   text) and deletes the others; floor and cap drops are planned only with
   ``drops=True`` (a Mem0 delete is final);
4. :meth:`Mem0Source.apply` (a dry run unless ``dry_run=False``) checks each unit's
   members against the snapshot (same ``hash`` and ``updated_at``: an agent's edit since
   the read skips the unit), writes every member as it was (payload and vector) to the
   undo journal (:class:`~consolidate.sources.journal.Journal`, ``<qdrant path>.consolidate``
   beside a local Qdrant folder, else ``state_dir``), then deletes the other members, each
   only if it is still as read (a conditional delete in the vector store; a DELETE in
   Mem0's history), and calls ``Memory.update(kept, text=merged)`` (Mem0 embeds the text
   with its own embedder and records an UPDATE); an agent's write that lands while the
   unit runs, or on a deleted member after it, rolls the unit back with the agent's text
   (:mod:`consolidate.sources.mem0_late`). :meth:`Mem0Source.undo` puts a merge's members
   back, or a whole plan's, by id or unique prefix; undone members are kept apart by every
   later read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..store.schema import Records, hours_from_datetime, records_from_rows
from .common import ApplyReport, Plan, UndoReport, as_stored, undo_by_journal, with_keep_apart

__all__ = ["Mem0Source", "Mem0Snapshot", "Mem0Plan", "Mem0ApplyReport"]

_KEYS = ("user_id", "agent_id", "run_id")


@dataclass
class Mem0Snapshot:
    """What :meth:`Mem0Source.read` read.

    Attributes:
        records: the memories as the pass's records (unit ``float32`` vectors).
        payloads: id -> Mem0 payload as read (``data``, ``hash``, ``user_id``, times...).
        vectors: id -> the stored vector (``float32``), for the undo file.
    """

    records: Records
    payloads: dict[str, dict[str, Any]]
    vectors: dict[str, np.ndarray]


@dataclass
class Mem0Plan(Plan):
    """A :class:`~consolidate.sources.common.Plan` of a Mem0 store. Units: ``{"kind":
    merge|drop, "namespace", "keep": id or None, "text": merged text or None, "delete":
    [ids], "ids": every id the unit touches}``.

    Attributes:
        read: id -> ``(payload, vector)`` as read, for every id a unit touches: what the
            apply compares the store against and journals for undo.
    """

    read: dict[str, tuple[dict[str, Any], np.ndarray]] = field(default_factory=dict)


@dataclass
class Mem0ApplyReport(ApplyReport):
    """An :class:`~consolidate.sources.common.ApplyReport` of a Mem0 store.

    Attributes:
        undo_file: the undo journal's ``applied.jsonl``, which holds every member as it was
            (``None`` in a dry run).
    """

    undo_file: str | None = None


def _hours(ts: Any) -> float | None:
    """A Mem0 ISO time in hours since the epoch (``None`` when absent)."""
    return None if ts is None or ts == "" else hours_from_datetime(ts)


def _history_add(memory: Any, i: str, payload: dict[str, Any]) -> None:
    """An ADD in Mem0's history for a memory put back with its id (Mem0's API cannot add
    with a given id, so the vector store is written directly and its history told here)."""
    from datetime import datetime, timezone

    memory.db.add_history(
        i,
        None,
        payload.get("data"),
        "ADD",
        created_at=payload.get("created_at"),
        updated_at=datetime.now(timezone.utc).isoformat(),
        actor_id=payload.get("actor_id"),
        role=payload.get("role"),
    )


class Mem0Source:
    """A Mem0 ``Memory`` the pass reads from and applies merges to.

    Args:
        memory: a ``mem0.Memory`` (e.g. ``Memory.from_config({...})``).
        namespace_key: the payload key that names a namespace (``user_id``, ``agent_id`` or
            ``run_id``); memories without it are left out.
        importance_key, pinned_key: the metadata keys (``Memory.add(..., metadata=...)``,
            kept in the payload) that hold a memory's importance (a number in [0, 1];
            absent: 0.5) and its pin (a boolean, or ``"true"``/``"false"``; absent: not
            pinned); ``None``: not read.
        state_dir: the undo journal's folder (default: ``<path>.consolidate`` beside a
            local Qdrant folder; required for an apply to a server vector store).
        drops: also plan the pass's floor and cap drops (a Mem0 delete is final; undo
            brings a dropped memory back from the journal).

    Raises:
        ValueError: another ``namespace_key``, or a vector store other than Qdrant and
            pgvector (from :meth:`read`).
    """

    KIND = "mem0"

    def __init__(
        self,
        memory: Any,
        namespace_key: str = "user_id",
        importance_key: str | None = "importance",
        pinned_key: str | None = "pinned",
        state_dir: str | Path | None = None,
        drops: bool = False,
    ) -> None:
        from .journal import Journal, default_state_dir

        if namespace_key not in _KEYS:
            raise ValueError(f"namespace_key must be one of {_KEYS}, got {namespace_key!r}")
        self.m = memory
        self.key = namespace_key
        self.importance_key = importance_key
        self.pinned_key = pinned_key
        self.drops = drops
        if state_dir is None:
            vcfg = memory.config.vector_store
            local = getattr(vcfg.config, "path", None) if vcfg.provider == "qdrant" else None
            if local and not getattr(vcfg.config, "url", None):
                state_dir = default_state_dir(local)
        self.journal = None if state_dir is None else Journal(state_dir, "mem0 store")

    # ------------------------------------------------------------ read
    def _scan(self) -> list[tuple[str, Any, dict[str, Any]]]:
        """``(id, vector, payload)`` of every memory in the vector store."""
        vs = self.m.vector_store
        provider = self.m.config.vector_store.provider
        if provider == "qdrant":
            out, offset = [], None
            while True:
                points, offset = vs.client.scroll(
                    collection_name=vs.collection_name,
                    limit=1024,
                    offset=offset,
                    with_payload=True,
                    with_vectors=True,
                )
                out += [(str(p.id), p.vector, dict(p.payload or {})) for p in points]
                if offset is None:
                    return out
        if provider == "pgvector":
            from psycopg import sql

            with vs._get_cursor() as cur:  # Mem0's own connection and table name
                cur.execute(
                    sql.SQL("SELECT id::text, vector::text, payload FROM {}").format(vs._col())
                )
                return [(r[0], json.loads(r[1]), dict(r[2] or {})) for r in cur.fetchall()]
        raise ValueError(
            f"the Mem0 source reads Qdrant and pgvector vector stores, not {provider!r}"
        )

    def read(self, namespaces: Sequence[str] | None = None) -> Mem0Snapshot:
        """Every memory of ``namespaces`` (all when ``None``).

        Raises:
            InvalidRecordsError: a memory breaks the store's rules (named by id).
            ValueError: the store holds memories but none has ``namespace_key``.
        """
        want = None if namespaces is None else set(namespaces)
        rows, payloads, vectors = [], {}, {}
        scanned = sorted(self._scan(), key=lambda x: x[0])
        for i, vec, p in scanned:
            ns = p.get(self.key)
            if ns is None or (want is not None and ns not in want):
                continue
            created = _hours(p.get("created_at"))
            used = _hours(p.get("updated_at")) or created
            v = np.asarray(vec, np.float32)
            row = {
                "id": i,
                "namespace": str(ns),
                "text": p.get("data"),
                "vector": v,
                "created_at": created,
                "last_used": used,
                "source_ids": p.get("source_ids") or [],
            }
            row.update(self._metadata(i, p))
            rows.append(row)
            payloads[i], vectors[i] = p, v
        if scanned and not any(p.get(self.key) is not None for _, _, p in scanned):
            have = sorted({k for k in _KEYS for _, _, p in scanned if p.get(k) is not None})
            raise ValueError(
                f"none of the {len(scanned)} memories of the Mem0 store has the namespace key "
                f"{self.key!r} (source.namespace_key); they have "
                f"{have or 'none of ' + str(list(_KEYS))}"
            )
        recs = records_from_rows(rows) if rows else Records.empty(0)
        if len(recs):
            recs = as_stored(recs, "the Mem0 store")
            if self.journal is not None:
                recs = with_keep_apart(recs, self.journal.keep_apart(), self.journal.kept())
        return Mem0Snapshot(recs, payloads, vectors)

    def _metadata(self, i: str, p: dict[str, Any]) -> dict[str, Any]:
        """Importance and pin of memory ``i`` from its payload ``p`` (see the class).

        Raises:
            ValueError: a value of the wrong type, named by memory id and key."""
        out: dict[str, Any] = {}
        k = self.importance_key
        if k and p.get(k) is not None:
            x = p[k]
            if isinstance(x, str):
                try:
                    x = float(x)
                except ValueError:
                    x = None
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ValueError(f"Mem0 memory {i}: metadata {k!r} is {p[k]!r}, not a number")
            out["importance"] = float(x)  # the range is checked with the other rules
        k = self.pinned_key
        if k and p.get(k) is not None:
            x = p[k]
            if isinstance(x, str) and x.strip().lower() in ("true", "false"):
                x = x.strip().lower() == "true"
            if not isinstance(x, bool):
                raise ValueError(f"Mem0 memory {i}: metadata {k!r} is {p[k]!r}, not true/false")
            out["pinned"] = x
        return out

    # ------------------------------------------------------------ plan
    def records(self, snap: Mem0Snapshot) -> Records:
        """The pass's input: every memory read."""
        return snap.records

    def plan(self, snap: Mem0Snapshot, result: Records) -> Mem0Plan:
        """Units from the pass's ``result`` over ``snap`` (merges; floor and cap drops too
        when the source was made with ``drops``)."""
        res = result.meta
        ids = res["id"].to_numpy(object)
        known = set(snap.payloads)
        live = res["deleted_at"].isna().to_numpy()
        into = res["merged_into"].to_numpy(object)
        reason = res["deleted_reason"].to_numpy(object)
        members: dict[str, list[str]] = {}
        for k in np.flatnonzero(~live):
            if ids[k] in known and reason[k] == "merged" and isinstance(into[k], str):
                members.setdefault(into[k], []).append(ids[k])
        created = dict(zip(snap.records.meta["id"], snap.records.meta["created_at"], strict=True))
        units = []
        for k in np.flatnonzero(live):
            mem = members.get(ids[k])
            if not mem or ids[k] in known:
                continue
            mem = sorted(mem, key=lambda i: (created[i], i))
            units.append(
                {
                    "kind": "merge",
                    "namespace": res.at[k, "namespace"],
                    "keep": mem[0],
                    "text": res.at[k, "text"],
                    "delete": mem[1:],
                    "ids": sorted(mem),
                    "key": ids[k],
                }
            )
        if self.drops:
            for k in np.flatnonzero(~live):
                if ids[k] in known and reason[k] in ("floor", "cap"):
                    units.append(
                        {
                            "kind": "drop",
                            "namespace": res.at[k, "namespace"],
                            "keep": None,
                            "text": None,
                            "delete": [ids[k]],
                            "ids": [ids[k]],
                            "key": ids[k],
                        }
                    )
        units.sort(key=lambda u: (u["namespace"], u["kind"], u["ids"]))
        blob = json.dumps(
            {
                "units": units,
                "hashes": {i: snap.payloads[i].get("hash") for u in units for i in u["ids"]},
            },
            sort_keys=True,
            default=str,
        )
        read = {i: (snap.payloads[i], snap.vectors[i]) for u in units for i in u["ids"]}
        return Mem0Plan(hashlib.sha256(blob.encode()).hexdigest()[:32], units, read)

    # ------------------------------------------------------------ apply
    def apply(
        self, plan: Mem0Plan, *, dry_run: bool = True, out_dir: str | Path | None = None
    ) -> Mem0ApplyReport:
        """Apply ``plan`` unit by unit through Mem0's API (see the module docstring); each
        unit's members, as they were read, go to the undo journal before Mem0 is called
        (``out_dir`` is not used: a dry run writes nothing).

        Raises:
            ValueError: a real apply without a journal folder (a server vector store and no
                ``state_dir``).
        """
        rep = Mem0ApplyReport(dry_run=dry_run)
        if not dry_run and self.journal is None:
            raise ValueError(
                "an apply to a Mem0 store on a server vector store needs source.state_dir="
                "DIR: the folder of its undo journal (a local Qdrant folder gets "
                "<path>.consolidate beside it)"
            )
        if not dry_run:
            assert self.journal is not None
            rep.undo_file = str(self.journal.dir / "applied.jsonl")
        from .mem0_late import apply_unit, reconcile, recover

        vs = self.m.vector_store
        if not dry_run:
            assert self.journal is not None
            with self.journal.locked():
                recover(self)
                rep.late += reconcile(self, False)
        elif self.journal is not None:
            rep.late += reconcile(self, True)
        for n, u in enumerate(plan.units):
            changed = []
            for i in u["ids"]:
                now = vs.get(vector_id=i)
                p = plan.read[i][0]
                if (
                    now is None
                    or (now.payload or {}).get("hash") != p.get("hash")
                    or (now.payload or {}).get("updated_at") != p.get("updated_at")
                ):
                    changed.append(i)
            if changed:
                rep.skipped.append(
                    {
                        "unit": n,
                        "namespace": u["namespace"],
                        "why": f"changed since the read: {changed[:5]}",
                    }
                )
                continue
            if dry_run:
                rep.applied[u["kind"]] = rep.applied.get(u["kind"], 0) + 1
            else:
                apply_unit(self, plan, n, u, rep)
        if not dry_run:
            assert self.journal is not None
            with self.journal.locked():
                rep.late += reconcile(self, False)
        return rep

    def reconcile(self, *, dry_run: bool = False) -> list[dict[str, Any]]:
        """Find the applied units an agent wrote into after (or while) they ran and undo
        them with the agent's text (:mod:`consolidate.sources.mem0_late`); :meth:`apply`
        does this before and after its units; this runs it alone (a dry run: only say what
        it would do). A unit a killed run left half done is rolled back first.

        Returns:
            :meth:`consolidate.sources.late.LateWrite.as_dict` per unit undone.
        """
        from .mem0_late import reconcile, recover

        if self.journal is None:
            return []
        with self.journal.locked():
            if not dry_run:
                recover(self)
            return reconcile(self, dry_run)

    # ------------------------------------------------------------ undo
    def undo(self, target: str) -> UndoReport:
        """Undo a merge or a drop, or every unit of a plan, that :meth:`apply` made:
        ``target`` is the pass's merged id (``events.jsonl``), a dropped id or a plan id
        (or a unique prefix, see :func:`~consolidate.sources.journal.match_target`).

        A kept member whose text is still the merged text gets its old text back through
        ``Memory.update`` (an UPDATE in Mem0's history), then its old payload and vector
        exactly; one an agent changed since the apply keeps the agent's text (reported).
        A deleted member is inserted again with its id, payload and vector (Mem0's API
        cannot add with a given id: the vector store is written directly and an ADD put in
        Mem0's history); one that exists already is left as it is. An undone unit is recorded:
        undoing it again does nothing.

        Raises:
            UndoTargetError: ``target`` names no applied plan, merge or drop, or several.
            ValueError: no journal folder (see the class).
        """
        if self.journal is None:
            raise ValueError(
                "undo on a Mem0 store on a server vector store needs source.state_dir=DIR "
                "(the folder the apply's journal went to)"
            )
        from .mem0_late import recover

        vs = self.m.vector_store
        with self.journal.locked():
            recover(self)

        def restore(plan_id: str, units: list[dict[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for u in units:
                back, notes = [], []
                for r in u["members"]:
                    now = vs.get(vector_id=r["id"])
                    if r["id"] == u["keep"]:
                        merged = u.get("merged_text")
                        cur = None if now is None else (now.payload or {}).get("hash")
                        want = None if merged is None else hashlib.md5(merged.encode()).hexdigest()
                        if now is None or cur != want:
                            if now is not None and cur == r["payload"].get("hash"):
                                back.append(r["id"])  # as before the merge already (a crash)
                                continue
                            notes.append(
                                {
                                    "id": r["id"],
                                    "why": "changed or deleted since the apply: the agent's "
                                    "version kept",
                                }
                            )
                            continue
                        self.m.update(r["id"], text=r["payload"].get("data"))
                        vs.update(vector_id=r["id"], vector=r["vector"], payload=r["payload"])
                    elif now is not None:
                        back.append(r["id"])  # exists already: restored before (a crash)
                        continue
                    else:
                        vs.insert(vectors=[r["vector"]], payloads=[r["payload"]], ids=[r["id"]])
                        _history_add(self.m, r["id"], r["payload"])
                    back.append(r["id"])
                out[u["key"]] = {"restored": back, "notes": notes}
            return out

        return undo_by_journal(self.journal, target, restore)

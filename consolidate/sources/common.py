"""What the external sources share: their plans and apply reports, and the step that turns
what a source read into records as a store holds them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..store.schema import (
    InvalidRecordsError,
    Problem,
    Records,
    normalise_vectors,
    records_from_arrow,
    records_to_arrow,
    validate,
)

__all__ = [
    "Plan",
    "ApplyReport",
    "UndoReport",
    "as_stored",
    "without_clock",
    "retired_units",
    "with_keep_apart",
    "undo_by_journal",
]


@dataclass
class Plan:
    """The changes of one pass over an external source, in units applied whole or not at
    all.

    Attributes:
        plan_id: a hash of what was read and the units (a plan applies once).
        units: one dict per unit, with at least ``kind`` (``merge``, ``drop``, ``update``),
            ``namespace`` and ``ids`` (the stored rows it touches).
    """

    plan_id: str
    units: list[dict[str, Any]]

    def counts(self) -> dict[str, int]:
        """Units per kind."""
        out: dict[str, int] = {}
        for u in self.units:
            out[u["kind"]] = out.get(u["kind"], 0) + 1
        return out


@dataclass
class ApplyReport:
    """What an apply did (in a dry run: would do).

    Attributes:
        dry_run: nothing was written.
        applied: units applied, per kind.
        skipped: ``{"unit", "namespace", "why"}`` for each unit not applied.
        late: units of earlier applies whose retired rows an agent wrote since, and what
            was done (:meth:`consolidate.sources.late.LateWrite.as_dict`: carried into the
            merged row, undone, or left for the next apply).
    """

    dry_run: bool
    applied: dict[str, int] = field(default_factory=dict)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    late: list[dict[str, Any]] = field(default_factory=list)


def retired_units(
    snapshot_ids: pd.Index,
    result: pd.DataFrame,
    merged_row: Callable[[int], dict[str, Any]],
    new_id: Callable[[str], str] = str,
    update_field: bool = False,
) -> tuple[list[dict[str, Any]], np.ndarray]:
    """The ``merge`` and ``drop`` units of a pass's records over a snapshot of a source.

    A new row of ``result`` that stored rows were merged into is a ``merge`` unit: its row
    (``merged_row(k)``, its id as the source writes it) inserted, its members retired. Every
    other stored row ``result`` retires is a ``drop`` unit. A new row nothing was merged
    into (a reflection) is not written back.

    Args:
        snapshot_ids: the ids the snapshot read.
        result: the pass's records' table (positional index).
        merged_row: the row to insert for new row ``k`` of ``result``.
        new_id: a merged record's id as the source writes it (``merged_into`` of its members).
        update_field: give every unit an empty ``update`` (sources whose plans also
            update kept rows' columns).

    Returns:
        ``(units, stored)``: the units, and ``bool [len(result)]``: the rows the snapshot
        had.

    Raises:
        ValueError: ``result`` lacks a row the snapshot had (a pass never loses one).
    """
    ids = result["id"].to_numpy(object)
    missing = sorted(set(snapshot_ids) - set(ids))
    if missing:
        raise ValueError(
            f"the pass's records lack {len(missing)} snapshot rows, e.g. {missing[:3]}"
        )
    stored = np.asarray(snapshot_ids.get_indexer(ids) >= 0)
    retired, members, retire = _retirements(result, stored, new_id)
    created = result["created_at"].to_numpy(np.float64)
    units: list[dict[str, Any]] = []
    done: set[int] = set()
    for k in np.flatnonzero(~stored).tolist():
        mem = members.get(ids[k], [])
        if not mem:
            continue  # a reflection: not written back to a user's table
        done.update(mem)
        row = merged_row(k)
        units.append(
            {
                "kind": "merge",
                "namespace": result.at[k, "namespace"],
                "insert": row,
                "retire": [retire[j] for j in mem],
                "ids": sorted(ids[j] for j in mem),
                "key": row["id"],
                # the oldest member: the merged row takes its unmapped columns
                "kept": min((float(created[j]), ids[j]) for j in mem)[1],
                **({"update": {}} if update_field else {}),
            }
        )
    units += [
        {
            "kind": "drop",
            "namespace": result.at[k, "namespace"],
            "insert": None,
            "retire": [retire[k]],
            "ids": [ids[k]],
            "key": ids[k],
            **({"update": {}} if update_field else {}),
        }
        for k in retired
        if k not in done
    ]
    return units, stored


def _retirements(
    result: pd.DataFrame, stored: np.ndarray, new_id: Callable[[str], str]
) -> tuple[list[int], dict[str, list[int]], dict[int, dict[str, Any]]]:
    """For :func:`retired_units`: the positions of the stored rows ``result`` retires, the
    members of each merged id among them, and each one's ``retire`` entry (id, reason,
    ``merged_into`` as the source writes it, ``deleted_at``)."""
    ids = result["id"].to_numpy(object)
    into = result["merged_into"].to_numpy(object)
    reason = result["deleted_reason"].to_numpy(object)
    deleted = result["deleted_at"].to_numpy(np.float64)
    retired = np.flatnonzero(stored & ~np.isnan(deleted)).tolist()
    members: dict[str, list[int]] = {}  # merged id -> its members' positions
    for k in retired:
        if isinstance(into[k], str) and reason[k] == "merged":
            members.setdefault(into[k], []).append(k)
    retire = {
        k: {
            "id": ids[k],
            "reason": reason[k],
            "merged_into": new_id(into[k]) if isinstance(into[k], str) else None,
            "deleted_at": float(deleted[k]),
        }
        for k in retired
    }
    return retired, members, retire


def without_clock(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``units`` without the pass's wall-clock times (``deleted_at`` of retired and
    inserted rows), for a plan id that a dry run and the apply after it share."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "deleted_at"}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return [strip(u) for u in units]


@dataclass
class UndoReport:
    """What an undo did.

    Attributes:
        target: the id or prefix asked for.
        plan_id: the plan it named.
        undone: the units undone now (their keys: merged ids, dropped ids).
        restored: the ids live again.
        already: units undone before (nothing done for them).
        skipped: ``{"key", "why"}`` for each unit that could not be undone (e.g. merged
            again by a later pass: undo that one first).
    """

    target: str
    plan_id: str
    undone: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)


def with_keep_apart(
    recs: Records, apart: dict[str, set[str]], kept: set[str] | frozenset[str] = frozenset()
) -> Records:
    """``recs`` with each id of ``apart`` given those ids as ``keep_apart`` too (joined to
    what it had), and each id of ``kept`` (a drop undone) ``pinned``, so that no later
    floor or cap drops it again; the loop runs over the undone merges' members, not the
    records."""
    if not (apart or kept) or not len(recs):
        return recs
    ids = recs.meta["id"].to_numpy(object)
    idx = {i: k for k, i in enumerate(ids)} if len(apart) * 8 > len(ids) else None
    col = recs.meta["keep_apart"].tolist()
    changed = False
    for i, others in apart.items():
        if idx is not None:
            k = idx.get(i)
            ks = [] if k is None else [k]
        else:
            ks = np.flatnonzero(ids == i).tolist()
        for k in ks:
            col[k] = sorted(set(col[k] or []) | others)
            changed = True
    pin = recs.meta["id"].astype(str).isin(kept).to_numpy() if kept else None
    if pin is not None and pin.any() and not recs.meta["pinned"].to_numpy(bool)[pin].all():
        changed = True
    if not changed:
        return recs
    meta = recs.meta.copy()
    meta["keep_apart"] = col
    if pin is not None:
        meta["pinned"] = meta["pinned"].to_numpy(bool) | pin
    return Records(meta, recs.vectors, origin=recs.origin)


def undo_by_journal(
    journal: Any,
    target: str,
    restore: Any,
) -> UndoReport:
    """Undo what ``target`` names in a source's :class:`~consolidate.sources.journal.
    Journal`, under its lock: units undone before are reported ``already``; the rest go to
    ``restore(plan_id, units)``, which puts them back in the source and returns
    ``{key: restored ids}`` for those it undid (or ``{key: {"restored": ids, "notes":
    [{"id", "why"}]}}`` with notes on members left as they are, reported in ``skipped``)
    and ``{key: "why"}`` (a string) for those it could not; each undone unit is then
    recorded (its members kept apart from then on).

    Raises:
        UndoTargetError: ``target`` matches no plan or merge, or several.
    """
    from .journal import match_target

    with journal.locked():
        journal.keep_apart()  # every journal file reads before anything is undone
        done = journal.undone()
        plan_id, units = match_target(target, journal.plans(), undone=done.keys())
        rep = UndoReport(str(target), plan_id)
        todo = []
        for u in units:
            if (plan_id, u["key"]) in done:
                rep.already.append(u["key"])
            else:
                todo.append(u)
        got = restore(plan_id, todo) if todo else {}
        for u in todo:
            r = got.get(u["key"], "not undone")
            if isinstance(r, str):
                rep.skipped.append({"key": u["key"], "why": r})
                continue
            if isinstance(r, dict):
                rep.skipped += [{"key": u["key"], **x} for x in r.get("notes", [])]
                r = r["restored"]
            journal.record_undone(plan_id, u, list(r))
            rep.undone.append(u["key"])
            rep.restored += list(r)
    return rep


def as_stored(
    recs: Records,
    source: str,
    *,
    now_h: float | None = None,
    first_line: int | None = None,
    lines: list[int] | None = None,
    unit: str = "line",
    known_ids: Any = (),
) -> Records:
    """``recs`` checked and shaped as a store holds them: validated
    (:func:`~consolidate.store.schema.validate`, and every ``merged_into`` names a record of
    ``recs``), vectors at unit length, times in whole
    microseconds (through the store's Arrow schema).

    Args:
        source: named in the error (a file, a table).
        now_h: the clock for times in the future (hours since the epoch; default now).
        first_line: the number of the first record's line (or row: ``unit``) in its file,
            to name records by line as well as id; ``None``: by id only.
        lines: ``[n]`` each record's line in its file (overrides ``first_line``; a CSV
            record with a quoted line break spans several lines).
        unit: ``"line"`` or ``"row"``, the word for ``first_line``.
        known_ids: ids outside ``recs`` that a ``merged_into`` may name too (a file's
            live rows, for its tombstone sidecar).

    Raises:
        InvalidRecordsError: any problem (nothing is returned).
    """
    problems = validate(recs, dim=recs.dim, now_h=now_h)
    into = recs.meta["merged_into"]
    named = into.isin(recs.meta["id"]) | (into.isin(list(known_ids)) if len(known_ids) else False)
    ghost = np.flatnonzero((into.notna() & ~named).to_numpy(bool))
    if len(ghost):
        ids = recs.meta["id"].tolist()
        problems.append(
            Problem(
                "merged_into names no record of the same input",
                ghost.tolist(),
                [ids[k] for k in ghost],
            )
        )
    if problems:
        if first_line is not None:
            ids = recs.meta["id"].tolist()

            def at(k: int) -> int:
                return k + first_line if lines is None else lines[k]

            first: dict[Any, int] = {}
            if any(p.kind == "duplicate id" for p in problems):
                for k in range(len(ids) - 1, -1, -1):  # one pass: each id's first row
                    first[ids[k]] = k

            def name(kind: str, k: int) -> str:
                if kind == "duplicate id" and first.get(ids[k], k) < k:
                    # both places: the first record with the id and this one
                    return f"{ids[k]} ({unit}s {at(first[ids[k]])} and {at(k)})"
                return f"{ids[k]} ({unit} {at(k)})"

            problems = [
                Problem(p.kind, p.rows, [name(p.kind, k) for k in p.rows]) for p in problems
            ]
        raise InvalidRecordsError(source, problems)
    normalise_vectors(recs)
    return records_from_arrow(records_to_arrow(recs))

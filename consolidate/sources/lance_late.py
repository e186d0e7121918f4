"""Late writes on a Lance dataset or LanceDB table (:mod:`consolidate.sources.late`), and
the record of a write a killed run left in flight.

An apply keeps, per unit in the undo journal, the digest of every row it wrote (a retired
member as rewritten with ``deleted_at``, the merged row) and the version it wrote. A later
check reads those rows at the newest version: a retired member whose digest moved (an
agent's ``table.update`` without a ``deleted_at IS NULL`` filter rewrites the tombstone) or
that is live again (made live, or appended again with its id) is a late write. All the
units found are settled in ONE new version (carried into their merged rows, or undone),
under the journal's lock, with ``pending.json`` written first so that a run killed after
the commit still records what it did (:func:`recover`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .late import (
    CARRY,
    LateWrite,
    backoff,
    carried_values,
    changed_columns,
    row_digest,
    settle,
)

if TYPE_CHECKING:
    from .lance_table import LanceTable

__all__ = ["digests_at", "reconcile", "recover"]


def _skip(t: LanceTable) -> list[str]:
    m = t._mapped()
    return [m[k] for k in ("deleted_at", "merged_into") if k in m]


def _rows(t: LanceTable, ds: Any, ids: list[str], addr: bool = False) -> dict[str, list[dict]]:
    """id -> its rows in ``ds`` (every column; ``_rowaddr`` too with ``addr``)."""
    idc = t._mapped()["id"]
    tab = ds.to_table(
        filter=pc.field(idc).isin(pa.array(sorted(set(ids)), pa.string())),
        with_row_address=addr,
    )
    out: dict[str, list[dict]] = {}
    for r in tab.to_pylist():
        out.setdefault(r[idc], []).append(r)
    return out


def _live(t: LanceTable, r: dict[str, Any]) -> bool:
    dc = t._mapped().get("deleted_at")
    return dc is None or r.get(dc) is None


def _plain(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "_rowaddr"}


def digests_at(t: LanceTable, ds: Any, units: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """unit key -> row id -> digest, for the rows ``units`` wrote as they are in ``ds``: each
    member's retired row (soft deletes only: a hard-deleted row has none) and the merged
    row."""
    rows = _rows(t, ds, [i for u in units for i in [*u["ids"], u["key"]]])
    skip = _skip(t)
    out: dict[str, dict[str, str]] = {}
    for u in units:
        d = out.setdefault(u["key"], {})
        for i in u["ids"]:
            dead = [r for r in rows.get(i, []) if not _live(t, r)]
            if dead:
                d[i] = row_digest(dead[-1], skip)
        if u["kind"] == "merge":
            live = [r for r in rows.get(u["key"], []) if _live(t, r)]
            if live:
                d[u["key"]] = row_digest(live[-1], skip)
    return out


def recover(t: LanceTable) -> None:
    """Finish the record of a write a killed run left in flight (``pending.json``), under
    the caller's journal lock: when a version after the one it read carries its write id,
    its journal lines are written now (an apply's units with their digests; a late-write
    commit's carries and undos); else the write never happened. Then ``pending.json`` goes.
    """
    j = t.journal
    p = j.pending()
    if p is None:
        return
    ds = t._open()
    hit = None
    for v in range(int(p["read_version"]) + 1, ds.version + 1):
        try:
            props = ds.read_transaction(v).transaction_properties or {}
        except (OSError, RuntimeError, ValueError, AttributeError):
            continue
        if props.get("consolidate.write") == p["id"]:
            hit = v
            break
    if hit is not None:
        at = t._open(hit)
        if p["op"] == "apply":
            # recorded already when the run was killed between its line and the end
            have = {
                u["key"]
                for q in j.plans()
                if q["plan_id"] == p["plan_id"]
                for u in q["units"]
                if u.get("version") == hit
            }
            todo = [u for u in p["units"] if u["key"] not in have]
            dig = digests_at(t, at, todo)
            j.record_apply(
                p["plan_id"],
                [u | {"version": hit, "digests": dig.get(u["key"], {})} for u in todo],
            )
        else:
            _record_late(t, at, p["carried"], p["undone"])
    j.done()


def _record_late(
    t: LanceTable, ds: Any, carried: list[dict[str, Any]], undone: list[dict[str, Any]]
) -> None:
    """Journal lines of a late-write commit ``ds``: each carried unit's new baseline (its
    late members' digests as the carry read them, ``digests``; its merged row's as ``ds``
    holds it; the version read, ``read_version``), the undone units (``why``: a late
    write). The members' digests are not taken from ``ds``: an agent's write that landed
    on a member after the read, in another fragment than the carry's, is in ``ds`` and
    must still count as late."""
    dig = digests_at(t, ds, [c["unit"] for c in carried])
    for c in carried:
        key = c["unit"]["key"]
        merged = {key: dig[key][key]} if key in dig.get(key, {}) else {}
        t.journal.record_late(c["plan_id"], key, c["digests"] | merged, c["read_version"])
    for x in undone:
        t.journal.record_undone(x["plan_id"], x["unit"], list(x["restored"]), why="late write")


def _candidates(t: LanceTable) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``(plan_id, unit, baseline)`` of every applied merge or drop not undone that has
    digests (applied by a version that keeps them)."""
    base = t.journal.digests()
    undone = t.journal.undone()
    return [
        (p["plan_id"], u, base[(p["plan_id"], u["key"])])
        for p in t.journal.plans()
        for u in p["units"]
        if u.get("kind") in ("merge", "drop")
        and (p["plan_id"], u["key"]) not in undone
        and (p["plan_id"], u["key"]) in base
    ]


@dataclass
class _Unit:
    """One unit with late writes: its plan, its journal unit, its baseline (digests and
    the version that wrote them), the late rows (id -> ``(row now, live)``), the merged
    row's rows now; then what :func:`_decide` made of it."""

    plan_id: str
    unit: dict[str, Any]
    base: dict[str, Any]
    late: dict[str, tuple[dict[str, Any], bool]]
    merged_rows: list[dict[str, Any]]
    report: LateWrite | None = None
    action: str = ""
    before: dict[str, dict[str, Any]] = field(default_factory=dict)
    merged: dict[str, Any] | None = None
    written: bool = False


def _find(
    t: LanceTable, ds: Any, cands: list[tuple[str, dict[str, Any], dict[str, Any]]]
) -> list[_Unit]:
    """The candidates with late writes in ``ds``."""
    rows = _rows(t, ds, [i for _, u, _ in cands for i in [*u["ids"], u["key"]]], addr=True)
    skip, soft = _skip(t), "deleted_at" in t._mapped()
    out = []
    for plan_id, u, b in cands:
        late: dict[str, tuple[dict[str, Any], bool]] = {}
        for i in u["ids"]:
            rs = rows.get(i, [])
            live = [r for r in rs if _live(t, r)]
            if live:
                late[i] = (live[-1], True)
            elif (
                soft
                and rs
                and i in b["digests"]
                and row_digest(_plain(rs[-1]), skip) != b["digests"][i]
            ):
                late[i] = (rs[-1], False)
        if late:
            out.append(_Unit(plan_id, u, b, late, rows.get(u["key"], [])))
    return out


def _befores(t: LanceTable, found: list[_Unit]) -> dict[int, dict[str, list[dict]]]:
    """version -> id -> rows, at each baseline version of ``found`` (a version cleaned up
    since: none, and every column of its rows counts as changed)."""
    ids = [i for f in found for i in f.late]
    out: dict[int, dict[str, list[dict]]] = {}
    for v in {int(f.base["version"]) for f in found if f.base.get("version") is not None}:
        try:
            out[v] = _rows(t, t._open(v), ids)
        except Exception:  # noqa: BLE001 (a version cleaned up: compared as unknown)
            out[v] = {}
    return out


def _decide(t: LanceTable, found: list[_Unit]) -> None:
    """Fill each unit's report, action (``carry`` | ``undo``), rows before the late writes,
    merged row now and whether an agent wrote it since (:func:`settle`)."""
    m = t._mapped()
    skip = _skip(t)
    carry_map = {f: m[f] for f in CARRY if f in m}
    old_at = _befores(t, found)
    for f in found:
        v = f.base.get("version")
        old = old_at.get(int(v), {}) if v is not None else {}
        cols: set[str] = set()
        for i, (now, live) in f.late.items():
            prev = old.get(i, [])
            f.before[i] = _plain(prev[-1]) if prev else {}
            c = changed_columns(f.before[i], _plain(now), skip) if prev else ["unknown"]
            cols.update(c or ([] if live else ["vector"]))
            if live:
                cols.add("live")
        mlive = [r for r in f.merged_rows if _live(t, r)]
        f.merged = mlive[-1] if mlive else None
        f.written = f.merged is not None and row_digest(_plain(f.merged), skip) != f.base[
            "digests"
        ].get(f.unit["key"])
        f.action, why = settle(f.unit["kind"], sorted(cols), carry_map, f.merged is not None)
        f.report = LateWrite(
            f.plan_id, f.unit["key"], f.unit["kind"], sorted(f.late), sorted(cols), why=why
        )


def _carried(t: LanceTable, f: _Unit) -> dict[str, Any]:
    """Unit ``f``'s merged row with every late member's bookkeeping carried into it."""
    m = t._mapped()
    carry_map = {k: m[k] for k in CARRY if k in m}
    assert f.merged is not None
    row = _plain(f.merged)
    for i, (now, _) in sorted(f.late.items()):
        for col, v in carried_values(row, f.before.get(i, {}), _plain(now), carry_map).items():
            old = row.get(col)
            row[col] = int(round(v)) if isinstance(old, int) and not isinstance(old, bool) else v
    return row


def _changes(
    t: LanceTable, ds: Any, found: list[_Unit]
) -> tuple[dict[str, Any], pa.Table, np.ndarray, list[dict], list[dict]]:
    """What settling ``found`` writes on ``ds``: ``(undo outcomes by key, rows to write,
    addresses to retire, the carried units' journal entries, the undone ones')``.

    Raises:
        LanceSourceError: a carried row does not fit the dataset's schema.
    """
    from .lance_table import LanceSourceError

    carry = [f for f in found if f.action == "carry"]
    undo = [f for f in found if f.action == "undo"]
    try:
        add = pa.Table.from_pylist([_carried(t, f) for f in carry], schema=ds.schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
        raise LanceSourceError(
            f"{t.path}: a carried row does not fit the schema ({e}); nothing written"
        ) from None
    outs, table, gone = t._undo_changes(
        ds, [f.unit for f in undo], keep={f.unit["key"] for f in undo if f.written}
    )
    gone = np.concatenate(
        [gone, np.asarray([int(f.merged["_rowaddr"]) for f in carry if f.merged], np.uint64)]
    )
    skip = _skip(t)
    done_carry = [
        {
            "plan_id": f.plan_id,
            "unit": f.unit,
            "digests": {i: row_digest(_plain(r), skip) for i, (r, _) in f.late.items()},
            "read_version": ds.version,
        }
        for f in carry
    ]
    done_undo = [
        {"plan_id": f.plan_id, "unit": f.unit, "restored": outs[f.unit["key"]]}
        for f in undo
        if not isinstance(outs.get(f.unit["key"]), str)
    ]
    return outs, pa.concat_tables([table, add]), gone, done_carry, done_undo


def _report(found: list[_Unit], outs: dict[str, Any]) -> list[dict[str, Any]]:
    """Each unit's :class:`LateWrite` as done: carried, undone, or left (why)."""
    for f in found:
        assert f.report is not None
        got = outs.get(f.unit["key"]) if f.action == "undo" else None
        if isinstance(got, str):
            f.report.action, f.report.why = "left", got
        elif f.action == "carry":
            f.report.action = "carried"
        else:
            f.report.action = "undone"
            if f.written:
                f.report.why += "; the merged row was written since too: it stays live"
    return [f.report.as_dict() for f in found if f.report is not None]


def reconcile(t: LanceTable, dry_run: bool, retries: int = 10) -> list[dict[str, Any]]:
    """Find and settle the dataset's late writes, under the caller's journal lock (see the
    module docstring): one new version, ``pending.json`` written before its commit; a
    commit that loses a race with another writer is tried again from the newest version.
    Returns :meth:`LateWrite.as_dict` per unit (a dry run: what it would do).

    Raises:
        LanceSourceError: the dataset cannot be read, or the commit failed.
    """
    from ..store.lance import commit_update
    from .lance_table import LanceSourceError

    cands = _candidates(t)
    if not cands:
        return []
    for attempt in range(retries + 1):
        ds = t._open()
        t._check_columns(ds)
        found = _find(t, ds, cands)
        _decide(t, found)
        if dry_run or not found:
            for f in found:
                assert f.report is not None
                f.report.action = f"would {f.action}"
            return [f.report.as_dict() for f in found if f.report is not None]
        outs, table, gone, done_carry, done_undo = _changes(t, ds, found)
        wid = uuid.uuid4().hex
        t.journal.begin(
            {
                "op": "late",
                "id": wid,
                "read_version": ds.version,
                "carried": done_carry,
                "undone": done_undo,
            }
        )
        try:
            new = commit_update(
                str(t.path),
                ds,
                table,
                gone,
                {"consolidate.write": wid, "consolidate.late": str(len(found))},
            )
        except (OSError, RuntimeError, ValueError) as e:
            t.journal.done()
            why = re.sub(r",\s*/\S+\.rs:\d+:\d+", "", str(e).splitlines()[0])
            if "conflict" in why.lower() and attempt < retries:
                backoff(attempt)
                continue
            raise LanceSourceError(f"{t.path}: the late-write commit failed ({why})") from None
        _record_late(t, new, done_carry, done_undo)
        t.journal.done()
        return _report(found, outs)
    raise AssertionError("unreachable")

"""Late writes on a pgvector table (:mod:`consolidate.sources.late`): an agent's write that
landed on a row an apply retired, found by the digest ``consolidate_history`` holds of every
row as the apply wrote it, and settled: carried into the merged row, or the unit undone.

Used by :meth:`consolidate.sources.pgvector.PgVectorTable.apply` (before and after the plan's
namespaces) and :meth:`~consolidate.sources.pgvector.PgVectorTable.reconcile`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .late import CARRY, LateWrite, changed_columns, settle

if TYPE_CHECKING:
    from .pgvector import PgVectorTable

__all__ = ["find_late", "reconcile"]

_HISTORY = "consolidate_history"
_UNDONE = "consolidate_undone"


@dataclass
class _Found:
    """One unit's late-written rows: row id -> ``(before, now, live, differs)``: the row as
    the apply (or the last carry) left it, as it is now (JSON without its vector), whether
    it is live, whether its digest differs."""

    kind: str
    rows: dict[str, tuple[dict[str, Any], dict[str, Any], bool, bool]] = field(default_factory=dict)


def _skip(t: PgVectorTable) -> list[str]:
    m = t._mapped()
    return [m[k] for k in ("deleted_at", "updated_at", "merged_into") if k in m]


def find_late(
    t: PgVectorTable, conn: Any, rows: list[str] | None = None
) -> dict[tuple[str, str], _Found]:
    """The units whose retired rows were written since the apply retired them (or since a
    carry last settled them): ``(plan_id, unit key) -> _Found``.

    A row counts when our newest write of it (by ``seq``, among the history rows with a
    digest) is a retirement or a carry of a unit not undone, and the row now has another
    digest or is live again. ``rows``: look at these row ids only.
    """
    from psycopg import sql

    m = t._mapped()
    only = sql.SQL(" AND h.row_id = ANY(%s)") if rows is not None else sql.SQL("")
    q = sql.SQL(
        "WITH r AS (SELECT DISTINCT ON (h.row_id) h.plan_id, h.unit, h.unit_kind, h.row_id, "
        "h.digest, h.before, h.change FROM {hist} h WHERE h.tab = %s AND h.digest IS NOT NULL"
        "{only} ORDER BY h.row_id, h.seq DESC) "
        "SELECT r.plan_id, r.unit, r.unit_kind, r.row_id, r.before, to_jsonb(t) - {vec}, "
        "t.{dc} IS NULL, {dig} IS DISTINCT FROM r.digest FROM r JOIN {tab} t ON t.{id}::text "
        "= r.row_id WHERE (r.change LIKE 'retire:%%' OR r.change = 'late:carry') AND NOT "
        "EXISTS (SELECT 1 FROM {undone} u WHERE u.tab = %s AND u.plan_id = r.plan_id AND "
        "u.unit = r.unit) AND ({dig} IS DISTINCT FROM r.digest OR t.{dc} IS NULL)"
    ).format(
        hist=t._tab(_HISTORY),
        only=only,
        vec=sql.Literal(m["vector"]),
        dc=t._ident(m["deleted_at"]),
        dig=t._digest_sql("t"),
        tab=t._tab(),
        id=t._ident(m["id"]),
        undone=t._tab(_UNDONE),
    )
    args: list[Any] = [t.table] + ([rows] if rows is not None else []) + [t.table]
    out: dict[tuple[str, str], _Found] = {}
    for plan_id, unit, kind, row_id, before, now, live, differs in conn.execute(q, args):
        f = out.setdefault((plan_id, unit), _Found(kind))
        f.rows[row_id] = (dict(before or {}), dict(now or {}), bool(live), bool(differs))
    return out


def _members(t: PgVectorTable, conn: Any, plan_id: str, key: str) -> list[str]:
    """The rows unit ``key`` of ``plan_id`` retired."""
    from psycopg import sql

    return sorted(
        r[0]
        for r in conn.execute(
            sql.SQL(
                "SELECT DISTINCT row_id FROM {} WHERE tab = %s AND plan_id = %s AND unit = %s "
                "AND change LIKE 'retire:%%'"
            ).format(t._tab(_HISTORY)),
            (t.table, plan_id, key),
        )
    )


def _merged_state(t: PgVectorTable, conn: Any, key: str) -> tuple[bool, bool]:
    """``(live, written)`` of a merge's merged row: it exists and is live; its digest is
    not the one our newest write of it left (an agent wrote it since)."""
    from psycopg import sql

    m = t._mapped()
    row = conn.execute(
        sql.SQL(
            "SELECT t.{dc} IS NULL, {dig} IS DISTINCT FROM (SELECT h.digest FROM {hist} h WHERE "
            "h.tab = %s AND h.row_id = %s AND h.digest IS NOT NULL ORDER BY h.seq DESC LIMIT 1) "
            "FROM {tab} t WHERE t.{id}::text = %s"
        ).format(
            dc=t._ident(m["deleted_at"]),
            dig=t._digest_sql("t"),
            hist=t._tab(_HISTORY),
            tab=t._tab(),
            id=t._ident(m["id"]),
        ),
        (t.table, key, key),
    ).fetchone()
    return (False, False) if row is None else (bool(row[0]), bool(row[1]))


def _changed(t: PgVectorTable, f: _Found) -> dict[str, list[str]]:
    """Row id -> the columns its late write changed (``live``: made live again;
    ``vector``: only the vector, which the history's JSON leaves out)."""
    out = {}
    for rid, (before, now, live, differs) in f.rows.items():
        cols = changed_columns(before, now, skip=_skip(t))
        if live:
            cols.append("live")
        if differs and not cols:
            cols.append("vector")
        out[rid] = cols
    return out


def _carry(
    t: PgVectorTable,
    conn: Any,
    plan_id: str,
    key: str,
    rid: str,
    cols: list[str],
    before: dict[str, Any],
) -> None:
    """Carry row ``rid``'s late write of bookkeeping columns ``cols`` into the merged row
    ``key`` (later ``last_used``, larger ``importance``, a pin, the strength added), then
    record the member's state as the new baseline (``late:carry``)."""
    from psycopg import sql

    m = t._mapped()
    sets, vals = [], []
    for f in CARRY:
        c = m.get(f)
        if c is None or c not in cols:
            continue
        ident = t._ident(c)
        if f in ("last_used", "importance"):
            sets.append(sql.SQL("{c} = GREATEST(t.{c}, s.{c})").format(c=ident))
        elif f == "pinned":
            sets.append(
                sql.SQL("{c} = (COALESCE(t.{c}, false) OR COALESCE(s.{c}, false))").format(c=ident)
            )
        else:
            base = before.get(c)
            sets.append(
                sql.SQL("{c} = COALESCE(t.{c}, 0) + GREATEST(0, COALESCE(s.{c}, 0) - %s)").format(
                    c=ident
                )
            )
            vals.append(float(base) if base is not None else 0.0)
    sets.append(sql.SQL("{} = now()").format(t._ident(m["updated_at"])))
    u = {"kind": "merge", "key": key}
    t._change_row(conn, plan_id, u, key, "late:merged", sets, vals, source=rid)
    conn.execute(
        sql.SQL(
            "INSERT INTO {hist} (plan_id, unit_kind, row_id, change, before, tab, unit, digest) "
            "SELECT %s, 'merge', %s, 'late:carry', to_jsonb(t) - {vec}, %s, %s, {dig} FROM {tab} "
            "t WHERE t.{id}::text = %s"
        ).format(
            hist=t._tab(_HISTORY),
            vec=sql.Literal(m["vector"]),
            dig=t._digest_sql("t"),
            tab=t._tab(),
            id=t._ident(m["id"]),
        ),
        (plan_id, rid, t.table, key, rid),
    )


def _settle_unit(
    t: PgVectorTable, conn: Any, plan_id: str, key: str, kind: str, dry_run: bool
) -> LateWrite | None:
    """Settle one unit's late writes inside the caller's transaction (a dry run: say what
    would be done); ``None`` when none are left (settled by another job meanwhile).

    Raises:
        PgSourceError: another job holds the unit's namespace (nothing written).
    """
    from .common import UndoReport

    m = t._mapped()
    members = _members(t, conn, plan_id, key)
    state = {} if dry_run else t._lock_for_undo(conn, sorted({*members, key}))
    found = find_late(t, conn, rows=members).get((plan_id, key))
    if found is None:
        return None
    changed = _changed(t, found)
    cols = sorted({c for v in changed.values() for c in v})
    live, written = _merged_state(t, conn, key) if kind == "merge" else (False, False)
    carry_map = {f: m[f] for f in CARRY if f in m}
    action, why = settle(kind, cols, carry_map, live)
    lw = LateWrite(plan_id, key, kind, sorted(found.rows), cols, why=why)
    if dry_run:
        lw.action = f"would {action}"
        return lw
    if action == "carry":
        for rid in sorted(found.rows):
            _carry(t, conn, plan_id, key, rid, changed[rid], found.rows[rid][0])
        lw.action = "carried"
        return lw
    u = {"key": key, "kind": kind, "ids": members}
    urep = UndoReport(key, plan_id)
    t._undo_unit(conn, plan_id, u, state, urep, why="late write", retire_merged=not written)
    if urep.skipped:
        lw.action, lw.why = "left", urep.skipped[0]["why"]
    else:
        lw.action = "undone"
        if written:
            lw.why += "; the merged row was written since too: it stays live"
    return lw


def reconcile(t: PgVectorTable, conn: Any, dry_run: bool) -> list[dict[str, Any]]:
    """Find and settle the table's late writes (see :mod:`consolidate.sources.late`), one
    transaction per unit; returns :meth:`LateWrite.as_dict` per unit. A unit whose
    namespace another job holds is ``left`` (the next apply tries again).

    Raises:
        PgSourceError: the connection is lost.
    """
    from .pgvector import PgSourceError

    if not t._columns(conn, _HISTORY, "digest", "seq") or not t._exists(conn, _UNDONE):
        return []
    units = sorted((k, f.kind) for k, f in find_late(t, conn).items())
    conn.commit()
    out = []
    for (plan_id, key), kind in units:
        try:
            with conn.transaction():
                lw = _settle_unit(t, conn, plan_id, key, kind, dry_run)
        except PgSourceError as e:
            lw = LateWrite(plan_id, key, kind, [], action="left", why=str(e))
        if lw is not None:
            out.append(lw.as_dict())
    return out

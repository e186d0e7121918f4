"""A PostgreSQL + pgvector table as the pass's source and sink: a consistent snapshot in,
a plan computed with no transaction open, then the plan applied in short transactions, one
per namespace.

The pass itself does not change (:func:`~consolidate.pipeline.run_pass` on the snapshot's
records); this module translates. A nightly job against a live database must not hold a
transaction open while models run, and must not undo what the agents wrote meanwhile, so:

1. :meth:`PgVectorTable.read` reads the live rows (``deleted_at IS NULL``) of some or all
   namespaces in one ``REPEATABLE READ``, read-only transaction, with each row's
   ``updated_at`` (the version every writer bumps);
2. the pass runs on the records, outside any transaction;
3. :meth:`PgVectorTable.plan` turns its result into units: a merge (insert the merged row,
   soft-delete its members: ``deleted_at`` set, ``merged_into`` where the table has it), a
   drop (soft-delete one row), an update of a kept row's mapped columns. The plan id is a
   hash of the snapshot and the units, so a plan is applied once;
4. :meth:`PgVectorTable.apply` (a dry run unless ``dry_run=False``), per namespace in its
   own transaction: first ``pg_try_advisory_xact_lock(hashtextextended(
   'consolidate|<table>|<namespace>', 0))`` (held by another job: the namespace is skipped
   and reported; an agent's writer may take the same lock to keep the pass out), then
   ``SELECT ... FOR UPDATE`` of every row the namespace's units touch. A unit whose rows
   changed since the snapshot (another ``updated_at``, deleted, gone) is skipped and
   reported, never half-applied. Every row a unit changes is written, as it was, into
   ``consolidate_history`` (JSONB), and the namespace into ``consolidate_applied`` (plan
   id, namespace), so applying the same plan again changes nothing. Nothing is ever
   hard-deleted.

Columns are mapped by :class:`PgColumns`; columns the table lacks get the documented
defaults on read (importance 0.5, strength 1, not pinned) and are not written back.
Needs ``psycopg`` 3 and ``pgvector`` (``pip install "consolidate[pgvector]"``).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..store.schema import Records, records_from_rows
from .common import (
    ApplyReport,
    Plan,
    UndoReport,
    as_stored,
    retired_units,
    with_keep_apart,
    without_clock,
)

__all__ = [
    "PgColumns",
    "PgSnapshot",
    "PgPlan",
    "PgApplyReport",
    "PgVectorTable",
    "PgSourceError",
    "timestamp",
]

#: our tables beside the user's: each changed row's previous state, the (plan,
#: namespace) pairs applied, the units undone and the pairs an undo keeps apart
_HISTORY = "consolidate_history"
_APPLIED = "consolidate_applied"
_UNDONE = "consolidate_undone"
_APART = "consolidate_keep_apart"


class PgSourceError(ValueError):
    """The database cannot be reached, or the table or a mapped column does not exist
    (the message names the table and what PostgreSQL said)."""


@dataclass(frozen=True)
class PgColumns:
    """Column names of a user's table (``None``: the table has no such column).

    Attributes:
        id: primary key (text or uuid; compared as text).
        namespace: the user or agent a row belongs to.
        text, vector: the memory and its ``vector(d)`` embedding.
        created_at, last_used: ``timestamptz`` (``last_used`` ``None``: ``created_at``).
        updated_at: ``timestamptz`` every writer sets on change: the apply's check that a
            row is as the snapshot read it (required).
        deleted_at: nullable ``timestamptz``; set by the apply (soft delete; required).
        importance, strength, pinned, merged_into: optional.
        source_ids: optional provenance (``text[]`` or a ``jsonb`` array of strings: the
            turns a memory came from); a merged row gets the union of its members'. The
            evaluation job matches it against a task's evidence.
    """

    id: str = "id"
    namespace: str = "namespace"
    text: str = "text"
    vector: str = "embedding"
    created_at: str = "created_at"
    last_used: str | None = "last_used"
    updated_at: str = "updated_at"
    deleted_at: str = "deleted_at"
    importance: str | None = None
    strength: str | None = None
    pinned: str | None = None
    merged_into: str | None = None
    source_ids: str | None = None


@dataclass
class PgSnapshot:
    """What :meth:`PgVectorTable.read` read.

    Attributes:
        records: the live rows as the pass's records (``float32 [n, d]`` unit vectors).
        versions: id -> ``updated_at`` (ISO string) as read.
        read_at: the transaction's ``now()`` (ISO string).
        namespaces: the namespaces asked for (``None``: all).
        uuid_ids: the id column is a ``uuid`` (merged rows then get a UUID made from
            their merged id's hash, e.g. Mem0's pgvector table).
        no_vector: live rows left out because their vector is NULL (a writer has not
            embedded them yet): their count and up to 20 ids.
    """

    records: Records
    versions: dict[str, str]
    read_at: str
    namespaces: list[str] | None
    uuid_ids: bool = False
    no_vector: int = 0
    no_vector_ids: list[str] = field(default_factory=list)


@dataclass
class PgPlan(Plan):
    """A :class:`~consolidate.sources.common.Plan` of a table. Units: ``{"kind":
    merge|drop|update, "namespace", "insert": row or None, "retire": [{"id", "reason",
    "merged_into", "deleted_at"}], "update": {id: {column: value}}, "ids"}``.

    Attributes:
        versions: id -> ``updated_at`` as the snapshot read it.
    """

    versions: dict[str, str] = field(default_factory=dict)


@dataclass
class PgApplyReport(ApplyReport):
    """An :class:`~consolidate.sources.common.ApplyReport` (skipped units: rows changed
    since the plan, another job holds the namespace, already applied).

    Attributes:
        namespaces: namespaces whose transaction committed.
    """

    namespaces: list[str] = field(default_factory=list)


def _psycopg() -> Any:
    try:
        import psycopg
        from pgvector.psycopg import register_vector  # noqa: F401
    except ImportError as e:
        raise ImportError(
            'the pgvector source needs psycopg 3 and pgvector: pip install "consolidate[pgvector]"'
        ) from e
    return psycopg


def _iso(ts: Any) -> str:
    return pd.Timestamp(ts).isoformat()


def timestamp(hours: float) -> datetime:
    """Hours since the epoch as a UTC ``datetime``, rounded to the microsecond as the
    store rounds its times (``timestamptz`` holds microseconds)."""
    return pd.Timestamp(round(float(hours) * 3.6e9), unit="us", tz="UTC").to_pydatetime()


def _record_rows(
    want: list[str], rows: list[tuple[Any, ...]]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The rows read (columns ``want``, then ``now()``) as record dicts, unmapped
    bookkeeping filled in (``last_used`` = ``created_at``, importance 0.5, strength 1, not
    pinned, no source ids), and each row's ``updated_at`` (ISO) by id."""
    out, versions = [], {}
    for r in rows:
        d = dict(zip(want, r[:-1], strict=True))
        versions[d["id"]] = _iso(d.pop("updated_at"))
        v = d["vector"]
        d["vector"] = (
            None
            if v is None
            else np.asarray(v.to_numpy() if hasattr(v, "to_numpy") else v, np.float32)
        )
        if "last_used" not in d or d["last_used"] is None:
            d["last_used"] = d["created_at"]
        for k, default in (("importance", 0.5), ("strength", 1.0)):
            if d.get(k) is None:
                d[k] = default
        d["pinned"] = bool(d.get("pinned") or False)
        d["source_ids"] = [] if d.get("source_ids") is None else d["source_ids"]
        out.append(d)
    return out, versions


def _stale(
    u: dict[str, Any], now_state: dict[str, tuple[str, Any]], versions: dict[str, str]
) -> str:
    """Why unit ``u`` no longer applies (its merged row's id is taken, or a row it touches
    changed, was deleted or is gone since the plan read it), or ``""``. ``now_state``: id ->
    (updated_at, deleted_at) as locked now; ``versions``: id -> updated_at as planned."""
    if u["insert"] and u["insert"]["id"] in now_state:
        return f"the merged row's id {u['insert']['id']} is taken already"
    changed = [
        i
        for i in u["ids"]
        if i not in now_state or now_state[i][0] != versions.get(i) or now_state[i][1] is not None
    ]
    return f"rows changed since the plan: {changed[:5]}" if changed else ""


def _update_units(
    before: pd.DataFrame, res: pd.DataFrame, kept: np.ndarray, cols: list[str]
) -> list[dict[str, Any]]:
    """An ``update`` unit per kept row (positions ``kept`` of ``res``) whose columns
    ``cols`` (mapped bookkeeping: strength, last_used, importance, pinned) differ from the
    snapshot's (``before``, indexed by id): ``{"update": {id: {column: value}}}``."""
    if not cols or not len(kept):
        return []
    ids = res["id"].to_numpy(object)
    b = before.loc[ids[kept]]
    upd: dict[str, dict[str, Any]] = {}  # id -> its update unit
    for c in cols:
        old = b[c].to_numpy()
        new = res[c].to_numpy()[kept]
        diff = ~((old == new) | (pd.isna(old) & pd.isna(new)))
        for j in np.flatnonzero(diff):
            i = ids[kept[j]]
            u = upd.get(i)
            if u is None:
                u = upd[i] = {
                    "kind": "update",
                    "namespace": res.at[kept[j], "namespace"],
                    "insert": None,
                    "retire": [],
                    "update": {i: {}},
                    "ids": [i],
                    "key": i,
                }
            v = new[j]
            u["update"][i][c] = bool(v) if c == "pinned" else float(v)
    return list(upd.values())


class PgVectorTable:
    """A pgvector table the pass reads from and applies its plan to.

    Args:
        dsn: a libpq connection string or URI.
        table: ``name`` or ``schema.name``.
        columns: :class:`PgColumns`.

    Raises:
        ImportError: psycopg or pgvector is missing.
    """

    KIND = "pgvector"

    def __init__(self, dsn: str, table: str, columns: PgColumns | None = None) -> None:
        self.psycopg = _psycopg()
        self.dsn = dsn
        parts = table.split(".")
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise ValueError(f"table must be name or schema.name, got {table!r}")
        self.table = table
        self.schema = parts[0] if len(parts) == 2 else None
        self.cols = columns or PgColumns()

    # ------------------------------------------------------------ SQL helpers
    def _connect(self) -> Any:
        """A connection with the pgvector type registered.

        Raises:
            PgSourceError: the server cannot be reached or refuses the login, or the
                database has no ``vector`` type."""
        from pgvector.psycopg import register_vector

        try:
            conn = self.psycopg.connect(self.dsn)
        except self.psycopg.OperationalError as e:
            raise PgSourceError(
                f"cannot connect to the database of table {self.table}: "
                f"{str(e).strip().splitlines()[0]}"
            ) from None
        try:
            register_vector(conn)
        except self.psycopg.ProgrammingError as e:
            conn.close()
            raise PgSourceError(
                f"the database of table {self.table} has no pgvector extension ({e})"
            ) from None
        # one rendering of times for every session of ours: the row digests of late-write
        # checks (consolidate.sources.late) are taken over to_jsonb text
        conn.execute("SET TIME ZONE 'UTC'")
        conn.commit()
        return conn

    def _ident(self, *names: str) -> Any:
        from psycopg import sql

        return sql.Identifier(*names)

    def _tab(self, name: str | None = None) -> Any:
        """The user's table, or our ``name`` table beside it."""
        from psycopg import sql

        if name is None:
            return sql.Identifier(*self.table.split("."))
        return sql.Identifier(self.schema, name) if self.schema else sql.Identifier(name)

    def _mapped(self) -> dict[str, str]:
        """pass column -> table column, for the columns the table has."""
        return {k: v for k, v in asdict(self.cols).items() if v is not None}

    # ------------------------------------------------------------ read
    def records(self, snap: PgSnapshot) -> Records:
        """The pass's input: the rows read."""
        return snap.records

    def read(self, namespaces: Sequence[str] | None = None) -> PgSnapshot:
        """The live rows of ``namespaces`` (all when ``None``), in one ``REPEATABLE READ``
        read-only transaction. Rows whose vector is NULL (not embedded yet) are left out of
        the pass and untouched; :attr:`PgSnapshot.no_vector` counts them.

        Raises:
            InvalidRecordsError: a row breaks the store's rules (names its id and the
                table); nothing is planned.
            PgSourceError: no connection, or the table or a mapped column does not exist.
        """
        from psycopg import IsolationLevel, sql

        m = self._mapped()
        want = ["id", "namespace", "text", "vector", "created_at", "updated_at"] + [
            k for k in ("last_used", "importance", "strength", "pinned", "source_ids") if k in m
        ]
        cols = sql.SQL(", ").join(
            sql.SQL("{}::text").format(self._ident(m[k])) if k == "id" else self._ident(m[k])
            for k in want
        )
        live = sql.SQL("{} IS NULL").format(self._ident(m["deleted_at"]))
        args: list[Any] = []
        if namespaces is not None:
            live += sql.SQL(" AND {} = ANY(%s)").format(self._ident(m["namespace"]))
            args.append(list(namespaces))
        q = sql.SQL("SELECT {}, now() FROM {} WHERE {} AND {} IS NOT NULL").format(
            cols, self._tab(), live, self._ident(m["vector"])
        )
        q_null = sql.SQL("SELECT {}::text FROM {} WHERE {} AND {} IS NULL ORDER BY 1").format(
            self._ident(m["id"]), self._tab(), live, self._ident(m["vector"])
        )
        q += sql.SQL(" ORDER BY {}, {}").format(self._ident(m["namespace"]), self._ident(m["id"]))
        with self._connect() as conn:
            conn.isolation_level = IsolationLevel.REPEATABLE_READ
            conn.read_only = True
            try:
                # every mapped column, also those only the apply writes (merged_into)
                conn.execute(
                    sql.SQL("SELECT {} FROM {} LIMIT 0").format(
                        sql.SQL(", ").join(self._ident(c) for c in m.values()), self._tab()
                    )
                )
                rows = conn.execute(q, args).fetchall()
                no_vec = [r[0] for r in conn.execute(q_null, args).fetchall()]
            except (self.psycopg.errors.UndefinedTable, self.psycopg.errors.UndefinedColumn) as e:
                raise PgSourceError(
                    f"table {self.table}: {str(e).splitlines()[0]} (map "
                    f"the table's columns with source.columns.*)"
                ) from None
            read_at = conn.execute("SELECT now()").fetchone()[0]
            apart, kept = self._keep_apart(conn), self._kept(conn)
            id_type = conn.execute(
                sql.SQL("SELECT pg_typeof({}) FROM {} LIMIT 1").format(
                    self._ident(m["id"]), self._tab()
                )
            ).fetchone()
        out, versions = _record_rows(want, rows)
        recs = records_from_rows(out) if out else Records.empty(0)
        if len(recs):
            recs = with_keep_apart(as_stored(recs, f"table {self.table}"), apart, kept)
        return PgSnapshot(
            recs,
            versions,
            _iso(read_at),
            None if namespaces is None else sorted(namespaces),
            uuid_ids=bool(id_type) and str(id_type[0]) == "uuid",
            no_vector=len(no_vec),
            no_vector_ids=no_vec[:20],
        )

    # ------------------------------------------------------------ plan
    def plan(self, snap: PgSnapshot, result: Records) -> PgPlan:
        """Units of change from the snapshot to ``result`` (a pass's records over it).

        Raises:
            ValueError: ``result`` lacks a row the snapshot had (the pass never loses one).
        """
        m = self._mapped()
        before = snap.records.meta.set_index("id")
        res = result.meta.reset_index(drop=True)

        def new_id(i: str) -> str:  # a merged record's id as the table's id type
            return (
                str(uuid.UUID(hashlib.sha256(i.encode()).hexdigest()[:32])) if snap.uuid_ids else i
            )

        def merged_row(k: int) -> dict[str, Any]:
            # a merged row the same pass dropped (floor, cap) is inserted soft-deleted: its
            # members' merged_into names a row of the table
            row = self._row(res.iloc[k], result.vectors[k])
            row["id"] = new_id(row["id"])
            return row

        units, stored = retired_units(
            pd.Index(before.index), res, merged_row, new_id, update_field=True
        )
        upd_cols = [c for c in ("strength", "last_used", "importance", "pinned") if c in m]
        kept = np.flatnonzero(stored & res["deleted_at"].isna().to_numpy())
        units += _update_units(before, res, kept, upd_cols)
        units.sort(key=lambda u: (u["namespace"], u["kind"], u["ids"]))
        blob = json.dumps(
            {  # no wall clock: a dry run and the apply after it share the plan id
                "table": self.table,
                "versions": {i: snap.versions[i] for u in units for i in u["ids"]},
                "units": without_clock(units),
            },
            sort_keys=True,
            default=str,
        )
        return PgPlan(
            hashlib.sha256(blob.encode()).hexdigest()[:32], units, versions=dict(snap.versions)
        )

    def _row(self, r: pd.Series, vec: np.ndarray) -> dict[str, Any]:
        """A merged record as the table's columns (mapped ones only)."""
        m = self._mapped()
        out = {
            "id": r["id"],
            "namespace": r["namespace"],
            "text": r["text"],
            "vector": np.asarray(vec, np.float32).tolist(),
            "created_at": float(r["created_at"]),
        }
        for c in ("last_used", "importance", "strength", "pinned"):
            if c in m:
                out[c] = bool(r[c]) if c == "pinned" else float(r[c])
        if "source_ids" in m:
            out["source_ids"] = [str(x) for x in r["source_ids"]]
        if pd.notna(r["deleted_at"]):
            out["deleted_at"] = float(r["deleted_at"])
        return out

    # ------------------------------------------------------------ apply
    def _ensure_tables(self, conn: Any) -> None:
        """Our tables beside the user's (see ``_HISTORY`` and the others), made if missing;
        ``consolidate_history`` gets the table (``tab``) and unit (``unit``) of each change,
        which undo reads, the digest of the row as written (``digest``) and the order of
        the changes (``seq``), which the late-write check reads; ``consolidate_undone`` gets
        why a unit was undone (``why``: NULL for a user's undo). Nothing is altered (no
        exclusive lock taken) when the columns exist."""
        from psycopg import sql

        if self._columns(conn, _HISTORY, "digest", "seq") and self._columns(conn, _UNDONE, "why"):
            return
        for name, ddl in (
            (_APPLIED, "CREATE TABLE IF NOT EXISTS {} (plan_id text, namespace text, "
             "applied_at timestamptz DEFAULT now(), PRIMARY KEY (plan_id, namespace))"),
            (_HISTORY, "CREATE TABLE IF NOT EXISTS {} (plan_id text, unit_kind text, row_id "
             "text, change text, before jsonb, at timestamptz DEFAULT now())"),
            (_HISTORY, "ALTER TABLE {} ADD COLUMN IF NOT EXISTS tab text, "
             "ADD COLUMN IF NOT EXISTS unit text"),
            (_UNDONE, "CREATE TABLE IF NOT EXISTS {} (tab text, plan_id text, unit text, at "
             "timestamptz DEFAULT now(), restored jsonb, PRIMARY KEY (tab, plan_id, unit))"),
            (_APART, "CREATE TABLE IF NOT EXISTS {} (tab text, id text, other text, plan_id "
             "text, unit text, PRIMARY KEY (tab, id, other))"),
            # the row's digest after our write (late writes), the order of the writes, and
            # why a unit was undone
            (_HISTORY, "ALTER TABLE {} ADD COLUMN IF NOT EXISTS digest text, "
             "ADD COLUMN IF NOT EXISTS seq bigserial"),
            (_UNDONE, "ALTER TABLE {} ADD COLUMN IF NOT EXISTS why text"),
            (_HISTORY, "CREATE INDEX IF NOT EXISTS consolidate_history_row ON {} "
             "(tab, row_id, seq)"),
        ):  # fmt: skip
            conn.execute(sql.SQL(ddl).format(self._tab(name)))

    def _history(
        self, conn: Any, plan_id: str, u: dict[str, Any], row_id: str, change: str
    ) -> None:
        """Row ``row_id`` as it is now (without its vector) into ``consolidate_history``,
        as ``change`` of unit ``u`` of ``plan_id``."""
        from psycopg import sql

        m = self._mapped()
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (plan_id, unit_kind, row_id, change, before, tab, unit) "
                "SELECT %s, %s, %s, %s, to_jsonb(t) - {}, %s, %s FROM {} t "
                "WHERE {}::text = %s"
            ).format(
                self._tab(_HISTORY), sql.Literal(m["vector"]), self._tab(), self._ident(m["id"])
            ),
            (plan_id, u["kind"], row_id, change, self.table, u["key"], row_id),
        )

    def _digest_sql(self, alias: str = "t") -> Any:
        """SQL for the digest of row ``alias`` (:mod:`consolidate.sources.late`): md5 of its
        JSONB text without the columns a retirement sets (``deleted_at``, ``updated_at``,
        ``merged_into``); the vector is part of it."""
        from psycopg import sql

        m = self._mapped()
        skip = [m[k] for k in ("deleted_at", "updated_at", "merged_into") if k in m]
        return sql.SQL("md5((to_jsonb({}) - ARRAY[{}]::text[])::text)").format(
            sql.Identifier(alias), sql.SQL(", ").join(sql.Literal(c) for c in skip)
        )

    def _change_row(
        self,
        conn: Any,
        plan_id: str,
        u: dict[str, Any],
        row_id: str,
        change: str,
        sets: list[Any],
        vals: list[Any],
        source: str | None = None,
    ) -> int:
        """``UPDATE`` row ``row_id`` (``sets``: SQL ``col = ...`` fragments over alias ``t``,
        and ``s`` for row ``source`` when given; ``vals``: their parameters) and record it in
        ``consolidate_history`` as ``change`` of unit ``u`` of ``plan_id``, in one statement:
        the row as it was (without its vector) and the digest of the row as written (late
        writes are found against it). Returns the rows changed (0 or 1)."""
        from psycopg import sql

        m = self._mapped()
        idc = self._ident(m["id"])
        frm: Any = sql.SQL("")
        cond: Any = sql.SQL("")
        args: list[Any] = []
        if source is not None:
            frm = sql.SQL(" FROM {} AS s").format(self._tab())
            cond, args = sql.SQL(" AND s.{}::text = %s").format(idc), [source]
        q = sql.SQL(
            "WITH old AS (SELECT to_jsonb(o) - {vec} AS b FROM {tab} o WHERE o.{id}::text = %s), "
            "new AS (UPDATE {tab} AS t SET {sets}{frm} WHERE t.{id}::text = %s{cond} "
            "RETURNING {dig} AS d) "
            "INSERT INTO {hist} (plan_id, unit_kind, row_id, change, before, tab, unit, digest) "
            "SELECT %s, %s, %s, %s, old.b, %s, %s, new.d FROM old, new"
        ).format(
            vec=sql.Literal(m["vector"]),
            tab=self._tab(),
            id=idc,
            sets=sql.SQL(", ").join(sets),
            frm=frm,
            cond=cond,
            dig=self._digest_sql("t"),
            hist=self._tab(_HISTORY),
        )
        cur = conn.execute(
            q,
            [
                row_id,
                *vals,
                row_id,
                *args,
                plan_id,
                u["kind"],
                row_id,
                change,
                self.table,
                u["key"],
            ],
        )
        return int(cur.rowcount)

    def _columns(self, conn: Any, name: str, *cols: str) -> bool:
        """Does our table ``name`` exist with every column of ``cols``?"""
        q = f"{self.schema}.{name}" if self.schema else name
        n = conn.execute(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass(%s) AND "
            "attname = ANY(%s) AND NOT attisdropped",
            (q, list(cols)),
        ).fetchone()[0]
        return bool(n == len(cols))

    def _exists(self, conn: Any, name: str) -> bool:
        """Does our table ``name`` exist beside the user's?"""
        q = f"{self.schema}.{name}" if self.schema else name
        return conn.execute("SELECT to_regclass(%s)", (q,)).fetchone()[0] is not None

    def _keep_apart(self, conn: Any) -> dict[str, set[str]]:
        """id -> the ids an undo keeps it apart from (``consolidate_keep_apart``, one group
        per undone merge, a merge of a merge expanded to its members:
        :func:`~consolidate.sources.journal.expand_apart`)."""
        from psycopg import sql

        from .journal import expand_apart

        if not self._exists(conn, _APART):
            return {}
        groups: dict[tuple[str, str], set[str]] = {}
        for i, other, plan_id, unit in conn.execute(
            sql.SQL("SELECT id, other, plan_id, unit FROM {} WHERE tab = %s").format(
                self._tab(_APART)
            ),
            (self.table,),
        ).fetchall():
            groups.setdefault((plan_id, unit), set()).update((i, other))
        return expand_apart([(k[1], sorted(v)) for k, v in groups.items()])

    def _kept(self, conn: Any) -> set[str]:
        """The ids whose drop was undone (read as ``pinned``: no floor or cap drops them
        again)."""
        from psycopg import sql

        if not (self._exists(conn, _UNDONE) and self._exists(conn, _HISTORY)):
            return set()
        # undone by a user, not by a late write (a table from before ``why``: all were)
        users = sql.SQL(" AND u.why IS NULL" if self._columns(conn, _UNDONE, "why") else "")
        return {
            r[0]
            for r in conn.execute(
                sql.SQL(
                    "SELECT DISTINCT u.unit FROM {} u JOIN {} h ON h.tab = u.tab AND "
                    "h.plan_id = u.plan_id AND h.unit = u.unit WHERE u.tab = %s AND "
                    "h.unit_kind = 'drop'{}"
                ).format(self._tab(_UNDONE), self._tab(_HISTORY), users),
                (self.table,),
            ).fetchall()
        }

    def apply(
        self, plan: PgPlan, *, dry_run: bool = True, out_dir: str | Path | None = None
    ) -> PgApplyReport:
        """Apply ``plan`` namespace by namespace (see the module docstring); with
        ``dry_run`` (the default) only check which units would apply, writing nothing
        (``out_dir`` is not used).

        Returns:
            :class:`PgApplyReport`.

        A statement that fails (a constraint of the table, say) rolls its namespace's
        transaction back: that namespace's units are reported skipped with the error, and
        the other namespaces go on.

        Raises:
            PgSourceError: the database cannot be reached, or the connection is lost
                during the apply (the message says which namespaces are applied).
        """
        from psycopg import sql

        m = self._mapped()
        rep = PgApplyReport(dry_run=dry_run)
        by_ns: dict[str, list[int]] = {}
        for k, u in enumerate(plan.units):
            by_ns.setdefault(u["namespace"], []).append(k)
        with self._connect() as conn:
            if not dry_run:
                with conn.transaction():
                    self._ensure_tables(conn)
            # late writes on rows earlier applies retired, settled before this plan's
            # units (which then see the rows as they are) and again after them
            rep.late += self._reconcile(conn, dry_run)
            for ns, ks in sorted(by_ns.items()):
                done = (len(rep.skipped), dict(rep.applied), len(rep.namespaces))
                try:
                    with conn.transaction():
                        self._apply_namespace(conn, plan, ns, ks, rep, dry_run, m, sql)
                except self.psycopg.Error as e:
                    if conn.broken:
                        applied = sorted(rep.namespaces[: done[2]])
                        raise PgSourceError(
                            f"table {self.table}: the connection was lost while namespace "
                            f"{ns!r} was applied ({str(e).strip().splitlines()[0]}); that "
                            f"namespace committed whole or not at all, those before it "
                            f"({len(applied)}: {applied[:5]}) are applied, the rest are not; "
                            f"applying the same plan again applies only what is missing "
                            f"(consolidate_applied records each namespace)"
                        ) from None
                    # the namespace's transaction rolled back: none of its units applied
                    del rep.skipped[done[0] :], rep.namespaces[done[2] :]
                    rep.applied = done[1]
                    why = f"rolled back: {str(e).strip().splitlines()[0]}"
                    rep.skipped += [{"unit": k, "namespace": ns, "why": why} for k in ks]
            if not dry_run:
                rep.late += self._reconcile(conn, dry_run)
        return rep

    def reconcile(self, *, dry_run: bool = False) -> list[dict[str, Any]]:
        """Find the late writes on rows earlier applies retired (an agent's write that
        landed after the unit: :mod:`consolidate.sources.late`) and settle them: carried
        into the merged row (bookkeeping columns only) or the unit undone (the members live
        again with the write; not kept apart). :meth:`apply` does this before and after its
        units; this runs it alone (a dry run: only say what it would do).

        Returns:
            :meth:`consolidate.sources.late.LateWrite.as_dict` per unit with late writes.

        Raises:
            PgSourceError: no connection.
        """
        with self._connect() as conn:
            if not dry_run and self._exists(conn, _HISTORY):
                with conn.transaction():
                    self._ensure_tables(conn)
            return self._reconcile(conn, dry_run)

    def _reconcile(self, conn: Any, dry_run: bool) -> list[dict[str, Any]]:
        from .pg_late import reconcile

        return reconcile(self, conn, dry_run)

    def _apply_namespace(
        self,
        conn: Any,
        plan: PgPlan,
        ns: str,
        ks: list[int],
        rep: PgApplyReport,
        dry_run: bool,
        m: dict[str, str],
        sql: Any,
    ) -> None:
        """One namespace's units, in the caller's transaction."""
        why = self._namespace_busy(conn, plan, ns, dry_run, sql)
        if why:
            rep.skipped += [{"unit": k, "namespace": ns, "why": why} for k in ks]
            return
        new_ids = {plan.units[k]["insert"]["id"] for k in ks if plan.units[k]["insert"]}
        ids = sorted({i for k in ks for i in plan.units[k]["ids"]} | new_ids)
        rows = conn.execute(
            sql.SQL("SELECT {}::text, {}, {} FROM {} WHERE {}::text = ANY(%s) FOR UPDATE").format(
                self._ident(m["id"]),
                self._ident(m["updated_at"]),
                self._ident(m["deleted_at"]),
                self._tab(),
                self._ident(m["id"]),
            ),
            (ids,),
        ).fetchall()
        now_state = {r[0]: (_iso(r[1]), r[2]) for r in rows}
        for k in ks:
            u = plan.units[k]
            why = _stale(u, now_state, plan.versions)
            if why:
                rep.skipped.append({"unit": k, "namespace": ns, "kind": u["kind"], "why": why})
                continue
            if not dry_run:
                self._write_unit(conn, plan.plan_id, u, m, sql)
            rep.applied[u["kind"]] = rep.applied.get(u["kind"], 0) + 1
        if not dry_run:
            conn.execute(
                sql.SQL("INSERT INTO {} (plan_id, namespace) VALUES (%s, %s)").format(
                    self._tab(_APPLIED)
                ),
                (plan.plan_id, ns),
            )
        rep.namespaces.append(ns)

    def _namespace_busy(self, conn: Any, plan: PgPlan, ns: str, dry_run: bool, sql: Any) -> str:
        """Why the units of namespace ``ns`` cannot be applied now (another job holds its
        advisory lock, or the plan was applied to it already), or ``""``."""
        key = f"consolidate|{self.table}|{ns}"
        got = conn.execute(
            "SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0))", (key,)
        ).fetchone()[0]
        if not got:
            return "another job holds the namespace"
        if not dry_run:
            done = conn.execute(
                sql.SQL("SELECT 1 FROM {} WHERE plan_id = %s AND namespace = %s").format(
                    self._tab(_APPLIED)
                ),
                (plan.plan_id, ns),
            ).fetchone()
            if done:
                return "plan already applied"
        return ""

    def _write_unit(
        self, conn: Any, plan_id: str, u: dict[str, Any], m: dict[str, str], sql: Any
    ) -> None:
        """The statements of one unit, each changed row's previous state into history."""
        tab, idc = self._tab(), self._ident(m["id"])
        if u["insert"] is not None:
            r = u["insert"]
            names = [
                k
                for k in (
                    "id",
                    "namespace",
                    "text",
                    "vector",
                    "created_at",
                    "last_used",
                    "importance",
                    "strength",
                    "pinned",
                    "source_ids",
                    "deleted_at",
                )
                if k in r and k in m
            ]
            vals = [self._value(k, r[k]) for k in names]
            if "source_ids" in names and self._json_column(conn, m["source_ids"]):
                from psycopg.types.json import Jsonb

                vals[names.index("source_ids")] = Jsonb(r["source_ids"])
            names.append("updated_at")
            extra = self._extra_columns(conn)
            # the user's other columns (tags, ...) from the oldest member's row
            digest = conn.execute(
                sql.SQL(
                    "INSERT INTO {} AS t ({}) SELECT {}, now(){} FROM {} WHERE {}::text = %s "
                    "RETURNING {}"
                ).format(
                    tab,
                    sql.SQL(", ").join(
                        [self._ident(m[k]) for k in names] + [self._ident(c) for c in extra]
                    ),
                    sql.SQL(", ").join(sql.Placeholder() for _ in vals),
                    sql.SQL("").join(sql.SQL(", {}").format(self._ident(c)) for c in extra),
                    tab,
                    idc,
                    self._digest_sql("t"),
                ),
                [*vals, u.get("kept", u["ids"][0])],
            ).fetchone()
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (plan_id, unit_kind, row_id, change, tab, unit, digest) "
                    "VALUES (%s, %s, %s, 'insert', %s, %s, %s)"
                ).format(self._tab(_HISTORY)),
                (plan_id, u["kind"], r["id"], self.table, u["key"], digest and digest[0]),
            )
        for x in u["retire"]:
            sets = [
                sql.SQL("{} = %s").format(self._ident(m["deleted_at"])),
                sql.SQL("{} = now()").format(self._ident(m["updated_at"])),
            ]
            vals: list[Any] = [timestamp(x["deleted_at"])]
            if "merged_into" in m and x["merged_into"] is not None:
                sets.append(sql.SQL("{} = %s").format(self._ident(m["merged_into"])))
                vals.append(x["merged_into"])
            self._change_row(conn, plan_id, u, x["id"], f"retire:{x['reason']}", sets, vals)
        for i, changes in u["update"].items():
            sets = [sql.SQL("{} = %s").format(self._ident(m[c])) for c in changes]
            sets.append(sql.SQL("{} = now()").format(self._ident(m["updated_at"])))
            self._change_row(
                conn,
                plan_id,
                u,
                i,
                "update:" + ",".join(sorted(changes)),
                sets,
                [self._value(c, v) for c, v in changes.items()],
            )

    # ------------------------------------------------------------ undo
    def undo(self, target: str) -> UndoReport:
        """Undo a merge, a drop or an update, or every unit of a plan, that :meth:`apply`
        wrote: ``target`` is the merged row's id, a dropped row's id or a plan id (or a
        unique prefix, see :func:`~consolidate.sources.journal.match_target`), found in
        ``consolidate_history``.

        One transaction, after ``pg_advisory_xact_lock`` on the table's undo key and
        ``pg_try_advisory_xact_lock`` on each namespace the apply uses: the members get
        ``deleted_at`` (and ``merged_into``) NULL, the merged row ``deleted_at`` now; both
        bump ``updated_at``, and their previous state goes to ``consolidate_history``. An
        agent's edit of a member since the apply stays (only those columns change). The
        unit goes into ``consolidate_undone`` (undoing it again does nothing) and its
        members' pairs into ``consolidate_keep_apart``, which every later :meth:`read`
        gives the pass as ``keep_apart``. An update unit (importance, strength, last use or
        pin the pass changed on a kept row) gets the row's previous values back, unless the
        row was written after the apply (its ``updated_at`` moved): that write wins and the
        unit is reported skipped.

        Raises:
            UndoTargetError: ``target`` names no applied plan, merge or drop, or several.
            PgSourceError: no connection, or an apply holds a namespace (nothing written).
        """
        from .journal import UndoTargetError, match_target

        with self._connect() as conn, conn.transaction():
            if not self._exists(conn, _HISTORY):
                raise UndoTargetError(f"table {self.table}: no plan was ever applied to it")
            self._ensure_tables(conn)
            conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                (f"consolidate-undo|{self.table}",),
            )
            undone = self._undone_units(conn)
            plan_id, units = match_target(target, self._applied_units(conn), undone=undone)
            rep = UndoReport(str(target), plan_id)
            done = {unit for p, unit in undone if p == plan_id}
            rep.already = [u["key"] for u in units if u["key"] in done]
            todo = [u for u in units if u["key"] not in done]
            if not todo:
                return rep
            ids = sorted({i for u in todo for i in u["ids"]} | {u["key"] for u in todo})
            state = self._lock_for_undo(conn, ids)
            for u in todo:
                self._undo_unit(conn, plan_id, u, state, rep)
        return rep

    def _applied_units(self, conn: Any) -> list[dict[str, Any]]:
        """Every applied plan's merge, drop and update units, from ``consolidate_history``:
        ``[{"plan_id", "units": [{"key", "kind", "ids": the rows it retired or updated}]}]``;
        an update unit also holds ``columns`` (the pass's column names it set), ``before``
        (the row as it was, JSON) and ``at`` (when the apply wrote it)."""
        from psycopg import sql

        plans: dict[str, dict[str, Any]] = {}
        for plan_id, unit, kind, row_id, change, before, at in conn.execute(
            sql.SQL(
                "SELECT plan_id, unit, unit_kind, row_id, change, before, at FROM {} WHERE "
                "tab = %s AND unit IS NOT NULL AND unit_kind IN ('merge', 'drop', 'update') "
                "AND change NOT LIKE 'undo:%%' ORDER BY at, plan_id"
            ).format(self._tab(_HISTORY)),
            (self.table,),
        ).fetchall():
            p = plans.setdefault(plan_id, {"plan_id": plan_id, "units": {}})
            u = p["units"].setdefault(unit, {"key": unit, "kind": kind, "ids": []})
            if change.startswith("retire:"):
                u["ids"].append(row_id)
            elif kind == "update" and change.startswith("update:"):
                u["ids"].append(row_id)
                u.update(columns=change[len("update:") :].split(","), before=before, at=at)
        return [{"plan_id": k, "units": list(p["units"].values())} for k, p in plans.items()]

    def _undone_units(self, conn: Any) -> set[tuple[str, str]]:
        """``(plan_id, unit key)`` of every unit undone, from ``consolidate_undone``."""
        from psycopg import sql

        return {
            (r[0], r[1])
            for r in conn.execute(
                sql.SQL("SELECT plan_id, unit FROM {} WHERE tab = %s").format(self._tab(_UNDONE)),
                (self.table,),
            ).fetchall()
        }

    def _lock_for_undo(self, conn: Any, ids: list[str]) -> dict[str, tuple[Any, ...]]:
        """Lock the rows ``ids`` (``FOR UPDATE``) and each of their namespaces (the advisory
        lock an apply holds); returns id -> ``(deleted_at, namespace[, merged_into])``.

        Raises:
            PgSourceError: an apply holds one of the namespaces.
        """
        from psycopg import sql

        m = self._mapped()
        idc = self._ident(m["id"])
        state = {
            r[0]: r[1:]
            for r in conn.execute(
                sql.SQL("SELECT {}::text, {}, {}{} FROM {} WHERE {}::text = ANY(%s)").format(
                    idc,
                    self._ident(m["deleted_at"]),
                    self._ident(m["namespace"]),
                    sql.SQL(", {}").format(self._ident(m["merged_into"]))
                    if "merged_into" in m
                    else sql.SQL(""),
                    self._tab(),
                    idc,
                )
                + sql.SQL(" FOR UPDATE"),
                (ids,),
            ).fetchall()
        }
        for ns in sorted({v[1] for v in state.values()}):
            got = conn.execute(
                "SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0))",
                (f"consolidate|{self.table}|{ns}",),
            ).fetchone()[0]
            if not got:
                raise PgSourceError(
                    f"table {self.table}: another job holds namespace {ns!r} (an apply "
                    f"in progress); nothing undone: try again when it is done"
                )
        return state

    def _undo_unit(
        self,
        conn: Any,
        plan_id: str,
        u: dict[str, Any],
        state: dict[str, tuple[Any, ...]],
        rep: UndoReport,
        *,
        why: str | None = None,
        retire_merged: bool = True,
    ) -> None:
        """Undo one merge, drop or update unit ``u`` of ``plan_id`` inside the caller's transaction
        (see :meth:`undo`), given the locked rows' ``state``; records it in ``rep``.

        Args:
            why: ``None`` for a user's undo (an undone merge's members are kept apart from
                then on, an undone drop is read as pinned); a reason for an undo the apply
                made itself (a late write, :mod:`consolidate.sources.late`): neither.
            retire_merged: retire a merge's merged row (``False``: it stays live, when an
                agent wrote it since the apply).
        """
        from psycopg import sql
        from psycopg.types.json import Jsonb

        m = self._mapped()
        tab, idc = self._tab(), self._ident(m["id"])
        key = u["key"]
        back: list[str] = []
        if u["kind"] == "update":
            if not self._restore_update(conn, plan_id, u, rep):
                return
        elif (
            u["kind"] == "merge"
            and retire_merged
            and not self._retire_merged(conn, plan_id, u, state, rep)
        ):
            return
        else:
            back = [i for i in u["ids"] if i in state and state[i][0] is not None]
        for i in back:
            self._history(conn, plan_id, u, i, "undo:restore")
        sets = [
            sql.SQL("{} = NULL").format(self._ident(m["deleted_at"])),
            sql.SQL("{} = now()").format(self._ident(m["updated_at"])),
        ]
        if "merged_into" in m:
            sets.append(sql.SQL("{} = NULL").format(self._ident(m["merged_into"])))
        if back:
            conn.execute(
                sql.SQL("UPDATE {} SET {} WHERE {}::text = ANY(%s)").format(
                    tab, sql.SQL(", ").join(sets), idc
                ),
                (back,),
            )
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (tab, plan_id, unit, restored, why) VALUES (%s, %s, %s, %s, %s)"
            ).format(self._tab(_UNDONE)),
            (self.table, plan_id, key, Jsonb(back), why),
        )
        if u["kind"] == "merge" and why is None:
            pairs = [(a, b) for a in u["ids"] for b in u["ids"] if a != b]
            if pairs:
                with conn.cursor() as cur:
                    cur.executemany(
                        sql.SQL(
                            "INSERT INTO {} (tab, id, other, plan_id, unit) VALUES "
                            "(%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
                        ).format(self._tab(_APART)),
                        [(self.table, a, b, plan_id, key) for a, b in pairs],
                    )
        rep.undone.append(key)
        rep.restored += back

    def _restore_update(self, conn: Any, plan_id: str, u: dict[str, Any], rep: UndoReport) -> bool:
        """Give update unit ``u``'s row back the values its columns had before the apply,
        when nothing has written the row since (its ``updated_at`` is still the apply's);
        ``False`` (and the reason in ``rep.skipped``) otherwise: a later write wins."""
        from psycopg import sql
        from psycopg.types.json import Jsonb

        m = self._mapped()
        (i,) = u["ids"]
        tab, idc, upd = self._tab(), self._ident(m["id"]), self._ident(m["updated_at"])
        row = conn.execute(
            sql.SQL("SELECT {} = %s FROM {} WHERE {}::text = %s").format(upd, tab, idc),
            (u["at"], i),
        ).fetchone()
        if row is None or not row[0]:
            rep.skipped.append(
                {
                    "key": u["key"],
                    "why": f"row {i} is gone"
                    if row is None
                    else f"row {i} was written after the apply (updated_at): it keeps that write",
                }
            )
            return False
        self._history(conn, plan_id, u, i, "undo:update")
        cols = [self._ident(m[c]) for c in u["columns"]]
        conn.execute(
            sql.SQL(
                "UPDATE {} SET {}, {} = now() FROM jsonb_populate_record(NULL::{}, %s) AS r "
                "WHERE {}.{}::text = %s"
            ).format(
                tab,
                sql.SQL(", ").join(sql.SQL("{} = r.{}").format(c, c) for c in cols),
                upd,
                tab,
                tab,
                idc,
            ),
            (Jsonb(u["before"]), i),
        )
        return True

    def _retire_merged(
        self,
        conn: Any,
        plan_id: str,
        u: dict[str, Any],
        state: dict[str, tuple[Any, ...]],
        rep: UndoReport,
    ) -> bool:
        """Retire merge unit ``u``'s merged row (``deleted_at`` now) unless it is gone or
        retired already; ``False`` (and the reason in ``rep.skipped``) when the unit cannot
        be undone: its merged row was merged again, or retired with members still retired."""
        from psycopg import sql

        m = self._mapped()
        key = u["key"]
        live_members = all(i in state and state[i][0] is None for i in u["ids"])
        merged = state.get(key)
        if merged is None:
            return True  # the merged row was deleted from the table: members come back
        if merged[0] is not None:
            if live_members:
                return True  # undone already, not yet recorded
            again = merged[2] if len(merged) > 2 else None
            rep.skipped.append(
                {
                    "key": key,
                    "why": f"{key} was merged again into {again}: undo that first"
                    if again
                    else f"the merged row {key} is no longer live",
                }
            )
            return False
        self._history(conn, plan_id, u, key, "undo:retire")
        conn.execute(
            sql.SQL("UPDATE {} SET {} = now(), {} = now() WHERE {}::text = %s").format(
                self._tab(),
                self._ident(m["deleted_at"]),
                self._ident(m["updated_at"]),
                self._ident(m["id"]),
            ),
            (key,),
        )
        return True

    def _extra_columns(self, conn: Any) -> list[str]:
        """The table's columns the pass does not map (a user's ``tags``), without generated
        and identity columns, which PostgreSQL fills."""
        if not hasattr(self, "_extra"):
            mapped = set(self._mapped().values())
            rows = conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                "AND NOT attisdropped AND attgenerated = '' AND attidentity = '' ORDER BY attnum",
                (self.table,),
            ).fetchall()
            self._extra = [r[0] for r in rows if r[0] not in mapped]
        return list(self._extra)

    def _json_column(self, conn: Any, column: str) -> bool:
        """Is ``column`` of the table ``json``/``jsonb`` (else an array)?"""
        from psycopg import sql

        t = conn.execute(
            sql.SQL("SELECT pg_typeof({}) FROM {} LIMIT 1").format(self._ident(column), self._tab())
        ).fetchone()
        if t is None:  # an empty table: the catalogue says
            t = conn.execute(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                "WHERE attrelid = %s::regclass AND attname = %s",
                (self.table, column),
            ).fetchone()
        return t is not None and str(t[0]) in ("json", "jsonb")

    @staticmethod
    def _value(col: str, v: Any) -> Any:
        """A pass value as the table's type (times: ``timestamptz``; vectors: pgvector)."""
        if col in ("created_at", "last_used", "deleted_at"):
            return timestamp(v)
        if col == "vector":
            return np.asarray(v, np.float32)
        return v

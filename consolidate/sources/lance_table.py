"""A Lance dataset of the user's own schema (a LanceDB table is one: ``<db>/<name>.lance``)
as the pass's source and sink: ``consolidate source=lance source.path=DB/memories.lance``.

1. :meth:`LanceTable.read` reads the live rows of one version (rows whose ``deleted_at`` is
   null when the table has that column), the mapped columns only (:class:`LanceColumns`);
   columns the table lacks get the store's defaults (importance 0.5, strength 1, not
   pinned, ``last_used`` = ``created_at``, no provenance). Times are ``timestamp`` columns
   or ISO 8601 text.
2. the pass runs on the records;
3. :meth:`LanceTable.plan` turns the result into units: a merge (insert the merged row,
   retire the members) or a drop (retire one row);
4. :meth:`LanceTable.apply` (a dry run unless ``dry_run=False``) writes every unit in ONE
   new version of the dataset, a Lance ``Update`` transaction: the retired rows are
   rewritten with ``deleted_at`` (and ``merged_into``) set when the table has those columns
   (a soft delete), else deleted; merged rows are appended. If another writer committed
   since the read, each unit's rows are compared with the version read and a unit whose
   rows changed (or went) is skipped and reported, never half-applied. The version read
   stays in the dataset's history: ``lance.dataset(path).restore()`` after
   ``checkout_version(v)`` (or LanceDB's ``table.restore(v)``) returns to it.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..store.schema import Records, records_from_rows
from ..times import TimeColumnError, hours_from_values, iso_style, values_from_hours
from .common import (
    ApplyReport,
    Plan,
    UndoReport,
    as_stored,
    retired_units,
    undo_by_journal,
    with_keep_apart,
    without_clock,
)
from .late import backoff

__all__ = [
    "LanceColumns",
    "LanceTable",
    "LanceSnapshot",
    "LancePlan",
    "LanceApplyReport",
    "LanceSourceError",
]


class LanceSourceError(ValueError):
    """The dataset cannot be read or written as mapped (names the dataset and column)."""


@dataclass(frozen=True)
class LanceColumns:
    """Column names of a user's Lance dataset (``None``: the dataset has no such column).

    Attributes:
        id: a unique string id.
        namespace: the user or agent a row belongs to.
        text, vector: the memory and its embedding (``fixed_size_list<float>``).
        created_at, last_used: ``timestamp`` or ISO 8601 text (``last_used`` ``None``:
            ``created_at``).
        importance, strength, pinned: optional.
        source_ids: optional provenance (``list<string>``).
        deleted_at: optional nullable ``timestamp``: the soft delete (without it, retired
            rows are deleted; earlier versions keep them).
        merged_into: optional string: the merged row of a retired member.
        time_unit: the unit of time columns that hold epoch numbers (``s``, ``ms``, ``us``,
            ``ns``, ``h``); ``None``: numbers are refused. Timestamps and ISO 8601 text need
            none (:func:`consolidate.times.hours_from_values`).
    """

    id: str = "id"
    namespace: str = "namespace"
    text: str = "text"
    vector: str = "vector"
    created_at: str = "created_at"
    last_used: str | None = None
    importance: str | None = None
    strength: str | None = None
    pinned: str | None = None
    source_ids: str | None = None
    deleted_at: str | None = None
    merged_into: str | None = None
    time_unit: str | None = None


@dataclass
class LanceSnapshot:
    """What :meth:`LanceTable.read` read.

    Attributes:
        records: the live rows as the pass's records (unit ``float32`` vectors).
        version: the dataset version read.
        namespaces: the namespaces asked for (``None``: all).
        no_vector: live rows left out because their vector is null (a writer has not
            embedded them yet): their count and up to 20 ids.
    """

    records: Records
    version: int
    namespaces: list[str] | None = None
    no_vector: int = 0
    no_vector_ids: list[str] = field(default_factory=list)


@dataclass
class LancePlan(Plan):
    """A :class:`~consolidate.sources.common.Plan` of a Lance dataset. Units: ``{"kind":
    merge|drop, "namespace", "insert": merged record (pass columns) or None, "retire":
    [{"id", "reason", "merged_into", "deleted_at"}], "ids": every stored id it touches}``.

    Attributes:
        version: the dataset version the plan is based on.
    """

    version: int = 0


@dataclass
class LanceApplyReport(ApplyReport):
    """An :class:`~consolidate.sources.common.ApplyReport` of a Lance dataset.

    Attributes:
        version: the version written (``None``: a dry run, or nothing to write).
        previous: the version the dataset had before (restore it to undo).
    """

    version: int | None = None
    previous: int | None = None
    skipped_rows: list[str] = field(default_factory=list)


def _hours(col: pa.ChunkedArray, name: str, where: str, unit: str | None = None) -> np.ndarray:
    """A time column as hours since the epoch (``float64``, NaN for nulls), by
    :func:`consolidate.times.hours_from_values`."""
    try:
        return hours_from_values(col, what=f"{where}: column {name!r}", unit=unit)
    except TimeColumnError as e:
        raise LanceSourceError(str(e)) from None


def _canon(row: dict[str, Any]) -> str:
    """A row as comparable text (NaN equals NaN; times and vectors exactly)."""
    return json.dumps(row, sort_keys=True, default=str)


def _rows_by_id(
    ds: Any, idc: str, want: list[str]
) -> tuple[list[dict[str, Any]], np.ndarray, dict[str, list[int]]]:
    """The rows of ``ds`` whose id column ``idc`` holds one of ``want``: ``(rows, row
    addresses, {id: positions in rows})``."""
    t = ds.to_table(filter=pc.field(idc).isin(pa.array(want, pa.string())), with_row_address=True)
    addr = t.column("_rowaddr").to_numpy()
    rows = t.drop_columns(["_rowaddr"]).to_pylist()
    by_id: dict[str, list[int]] = {}
    for k, r in enumerate(rows):
        by_id.setdefault(r[idc], []).append(k)
    return rows, addr, by_id


def _not_undoable(key: str, merged_again: list[str]) -> str:
    """Why the merge ``key`` cannot be undone: its row was merged again, or is gone."""
    if merged_again:
        return f"{key} was merged again into {merged_again[0]}: undo that first"
    return f"the merged row {key} is gone or no longer live"


class LanceTable:
    """A user's Lance dataset the pass reads from and applies its plan to.

    Args:
        path: the dataset folder (LanceDB: ``<db>/<table>.lance``).
        columns: the column mapping.
        state_dir: the undo journal's folder
            (:class:`~consolidate.sources.journal.Journal`; default
            ``<path>.consolidate`` beside the dataset).

    Raises:
        LanceSourceError: the folder is a consolidate store (use ``store.dir``), or (from
            :meth:`read`) not a Lance dataset or a mapped column is missing.
    """

    KIND = "lance"

    def __init__(
        self,
        path: str | Path,
        columns: LanceColumns | None = None,
        state_dir: str | Path | None = None,
    ) -> None:
        from .journal import Journal, default_state_dir

        self.path = Path(path)
        self.cols = columns or LanceColumns()
        self.journal = Journal(
            state_dir or default_state_dir(self.path), f"Lance dataset {self.path}"
        )
        real = self.path.resolve()
        for anc in (real, *real.parents):
            if (anc / "CURRENT").is_file():
                raise LanceSourceError(
                    f"{self.path} is in the consolidate store {anc}: run "
                    f"the pass on it with store.dir={anc} (source=store)"
                )

    def _mapped(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self.cols).items() if v is not None and k != "time_unit"}

    def _open(self, version: int | None = None) -> Any:
        import lance

        try:
            ds = lance.dataset(str(self.path))
            return ds if version is None else ds.checkout_version(int(version))
        except (OSError, ValueError, RuntimeError) as e:
            why = re.sub(r",\s*/\S+\.rs:\d+:\d+", "", str(e).splitlines()[0])
            raise LanceSourceError(
                f"{self.path} is not a readable Lance dataset"
                f"{'' if version is None else f' at version {version}'}: "
                f"{why}"
            ) from None

    def _check_columns(self, ds: Any) -> None:
        """Every mapped column exists with a usable type, and no ``deleted_at`` column is
        left unmapped (its deleted rows would be read as live).

        Raises:
            LanceSourceError: naming the dataset and the column.
        """
        m = self._mapped()
        names = set(ds.schema.names)
        missing = {k: v for k, v in m.items() if v not in names}
        if missing:
            raise LanceSourceError(
                f"{self.path}: no column {sorted(missing.values())} "
                f"(mapped as {sorted(missing)}; columns: "
                f"{sorted(names)}); map them with source.columns.*"
            )
        if "deleted_at" not in m and "deleted_at" in names:
            raise LanceSourceError(
                f"{self.path} has a column 'deleted_at' that is not mapped:"
                f" the rows deleted there would be read as live; map it "
                f"(source.columns.deleted_at=deleted_at)"
            )
        kinds = {
            "importance": (pa.types.is_floating, pa.types.is_integer),
            "strength": (pa.types.is_floating, pa.types.is_integer),
            "pinned": (pa.types.is_boolean,),
        }
        for k, tests in kinds.items():
            if k in m and not any(t(ds.schema.field(m[k]).type) for t in tests):
                raise LanceSourceError(
                    f"{self.path}: column {m[k]!r} ({k}) is "
                    f"{ds.schema.field(m[k]).type}, not "
                    f"{'a boolean' if k == 'pinned' else 'a number'}"
                )

    def _filter(self, namespaces: Sequence[str] | None) -> Any:
        m = self._mapped()
        flt = None
        if "deleted_at" in m:
            flt = pc.field(m["deleted_at"]).is_null()
        if namespaces is not None:
            f2 = pc.field(m["namespace"]).isin(pa.array(list(namespaces), pa.string()))
            flt = f2 if flt is None else flt & f2
        return flt

    # ------------------------------------------------------------ read
    def records(self, snap: LanceSnapshot) -> Records:
        """The pass's input: the rows read."""
        return snap.records

    def read(self, namespaces: Sequence[str] | None = None) -> LanceSnapshot:
        """The live rows of ``namespaces`` (all when ``None``) at the newest version. Rows
        whose vector is null (not embedded yet) are left out of the pass and untouched;
        :attr:`LanceSnapshot.no_vector` counts them.

        Raises:
            LanceSourceError: not a dataset, a mapped column missing, a time column of
                another type.
            InvalidRecordsError: a row breaks the store's rules (named by id and the
                dataset).
        """
        ds = self._open()
        self._check_columns(ds)
        m = self._mapped()
        t = ds.to_table(columns=list(dict.fromkeys(m.values())), filter=self._filter(namespaces))
        where = f"{self.path} (version {ds.version})"
        meta = self._columns(t, m, where)
        vec = t.column(m["vector"])
        if not pa.types.is_fixed_size_list(vec.type):
            raise LanceSourceError(
                f"{where}: column {m['vector']!r} is {vec.type}, not a fixed-size list of floats"
            )
        d = vec.type.list_size
        has = pc.is_valid(vec).to_numpy(zero_copy_only=False)
        no_vec = [meta["id"][k] for k in np.flatnonzero(~has)]
        if len(no_vec):  # not embedded yet: left out of the pass, untouched
            keep = np.flatnonzero(has)
            meta = {
                k: ([v[j] for j in keep] if isinstance(v, list) else v[keep])
                for k, v in meta.items()
            }
            vec = vec.filter(pa.array(has))
        n = int(has.sum())
        flat = pc.list_flatten(vec.combine_chunks())
        vectors = flat.to_numpy(zero_copy_only=False).astype(np.float32).reshape(n, d)
        rows = pd.DataFrame(meta).to_dict("records")
        for r, v in zip(rows, vectors, strict=True):
            r["vector"] = v
        recs = records_from_rows(rows, dim=d) if rows else Records.empty(d)
        if len(recs):
            recs = with_keep_apart(
                as_stored(recs, where), self.journal.keep_apart(), self.journal.kept()
            )
        return LanceSnapshot(
            recs,
            ds.version,
            None if namespaces is None else sorted(namespaces),
            no_vector=len(no_vec),
            no_vector_ids=sorted(no_vec)[:20],
        )

    def _columns(self, t: pa.Table, m: dict[str, str], where: str) -> dict[str, Any]:
        """The record columns of the rows read (``t``, the mapped columns ``m``) but the
        vector: times as hours, unmapped bookkeeping filled in (``last_used`` =
        ``created_at``, importance 0.5, strength 1, not pinned, no source ids).

        Raises:
            LanceSourceError: a time column of another type.
        """
        n = t.num_rows
        meta: dict[str, Any] = {
            "id": t.column(m["id"]).to_pylist(),
            "namespace": t.column(m["namespace"]).to_pylist(),
            "text": t.column(m["text"]).to_pylist(),
        }
        tu = self.cols.time_unit
        meta["created_at"] = _hours(t.column(m["created_at"]), m["created_at"], where, tu)
        meta["last_used"] = (
            _hours(t.column(m["last_used"]), m["last_used"], where, tu)
            if "last_used" in m
            else meta["created_at"]
        )
        meta["last_used"] = np.where(
            np.isnan(meta["last_used"]), meta["created_at"], meta["last_used"]
        )
        for k, default in (("importance", 0.5), ("strength", 1.0)):
            meta[k] = (
                pd.Series(t.column(m[k]).to_pylist(), dtype=float).fillna(default).to_numpy()
                if k in m
                else np.full(n, default)
            )
        meta["pinned"] = (
            pd.Series(t.column(m["pinned"]).to_pylist(), dtype=object)
            .fillna(False)
            .astype(bool)
            .to_numpy()
            if "pinned" in m
            else np.zeros(n, bool)
        )
        meta["source_ids"] = (
            [[] if x is None else x for x in t.column(m["source_ids"]).to_pylist()]
            if "source_ids" in m
            else [[] for _ in range(n)]
        )
        return meta

    # ------------------------------------------------------------ plan
    def plan(self, snap: LanceSnapshot, result: Records) -> LancePlan:
        """Units from the pass's ``result`` over ``snap``.

        Raises:
            ValueError: ``result`` lacks a row the snapshot had (the pass never loses one).
        """
        res = result.meta.reset_index(drop=True)
        columns = (
            "id",
            "namespace",
            "text",
            "created_at",
            "last_used",
            "importance",
            "strength",
            "pinned",
            "deleted_at",
        )

        def merged_row(k: int) -> dict[str, Any]:
            r = res.iloc[k]
            row = {c: r[c] for c in columns}
            row["source_ids"] = [str(x) for x in r["source_ids"]]
            row["vector"] = result.vectors[k].astype(np.float32).tolist()
            return row

        units, _ = retired_units(pd.Index(snap.records.meta["id"]), res, merged_row)
        units.sort(key=lambda u: (u["namespace"], u["kind"], u["ids"]))
        if any(u["insert"] is not None for u in units):
            mapped = set(self._mapped().values())
            schema = self._open(snap.version).schema
            unfillable = [f.name for f in schema if not f.nullable and f.name not in mapped]
            if unfillable:
                raise LanceSourceError(
                    f"{self.path}: merged rows cannot fill the non-nullable column(s) "
                    f"{unfillable}, which the pass does not know; make them nullable, or run "
                    f"with sleep.near_dedup=false sleep.exact_dedup=false (drops only)"
                )
        blob = json.dumps(
            {
                "path": str(self.path.resolve()),
                "version": snap.version,
                "units": without_clock(units),
            },
            sort_keys=True,
            default=str,
        )
        return LancePlan(
            hashlib.sha256(blob.encode()).hexdigest()[:32], units, version=snap.version
        )

    # ------------------------------------------------------------ apply
    def apply(
        self,
        plan: LancePlan,
        *,
        dry_run: bool = True,
        out_dir: str | Path | None = None,
        retries: int = 10,
    ) -> LanceApplyReport:
        """Write ``plan`` as one new version (see the module docstring). A unit is skipped
        (and reported) when its rows changed since the version read, are no longer live,
        are stored twice, or its merged row's id is taken. A commit that loses a race with
        another writer is tried again from the newest version (``retries`` times).
        ``out_dir`` is not used (a dry run writes nothing).

        Raises:
            LanceSourceError: a mapped column is gone, the new rows do not fit the
                dataset's schema, or the commit failed (nothing written).
        """
        from .lance_late import reconcile

        if dry_run:
            ds = self._open()
            self._check_columns(ds)
            rep, _ = self._units_now(ds, plan, True)
            with self.journal.locked():
                rep.late = reconcile(self, True)
            return rep
        with self.journal.locked():
            self._recover()
            # late writes on rows earlier applies retired: settled before this plan's units
            # (which then see the rows as they are) and again after them
            late = reconcile(self, False)
            rep = self._apply_locked(plan, retries)
            rep.late = late + reconcile(self, False)
        if rep.version is None and any(x["action"] in ("carried", "undone") for x in rep.late):
            rep.version = self._open().version  # only the late writes' version was written
        return rep

    def _apply_locked(self, plan: LancePlan, retries: int) -> LanceApplyReport:
        """The apply's commit, under the journal's lock: ``pending.json`` first (a run
        killed after the commit is recorded by the next :meth:`_recover`), then one
        ``Update`` version, then the units with the digests of the rows they wrote."""
        from ..store.lance import commit_update
        from .lance_late import digests_at

        for attempt in range(retries + 1):
            ds = self._open()
            self._check_columns(ds)
            rep, units = self._units_now(ds, plan, False)
            if not units:
                return rep
            table, gone = self._changes(ds, units)
            wid = uuid.uuid4().hex
            todo = [self.journal.unit(u, previous=rep.previous) for u in units]
            self.journal.begin(
                {
                    "op": "apply",
                    "id": wid,
                    "plan_id": plan.plan_id,
                    "read_version": ds.version,
                    "units": todo,
                }
            )
            try:
                new = commit_update(
                    str(self.path),
                    ds,
                    table,
                    gone,
                    {
                        "consolidate.plan_id": plan.plan_id,
                        "consolidate.based_on": str(plan.version),
                        "consolidate.write": wid,
                    },
                )
            except (OSError, RuntimeError, ValueError) as e:
                self.journal.done()
                why = re.sub(r",\s*/\S+\.rs:\d+:\d+", "", str(e).splitlines()[0])
                if "conflict" in why.lower() and attempt < retries:
                    backoff(attempt)
                    continue  # another writer committed first: check the units again
                raise LanceSourceError(
                    f"{self.path}: the commit failed ({why}); nothing written"
                ) from None
            rep.version = new.version
            dig = digests_at(self, new, todo)
            self.journal.record_apply(
                plan.plan_id,
                [u | {"version": new.version, "digests": dig.get(u["key"], {})} for u in todo],
            )
            self.journal.done()
            return rep
        raise AssertionError("unreachable")

    def _recover(self) -> None:
        """Record the write a killed run left in flight (:func:`~consolidate.sources.
        lance_late.recover`), under the caller's journal lock."""
        from .lance_late import recover

        recover(self)

    def reconcile(self, *, dry_run: bool = False) -> list[dict[str, Any]]:
        """Find the late writes on rows earlier applies retired (an agent's write that
        landed after the unit: :mod:`consolidate.sources.late`) and settle them in one new
        version: carried into the merged row (bookkeeping columns only) or the unit undone
        (the members live again with the write; not kept apart). :meth:`apply` does this
        before and after its units; this runs it alone (a dry run: only say what it would
        do).

        Returns:
            :meth:`consolidate.sources.late.LateWrite.as_dict` per unit with late writes.

        Raises:
            LanceSourceError: the dataset cannot be read, or the commit failed.
        """
        from .lance_late import reconcile

        with self.journal.locked():
            if not dry_run:
                self._recover()
            return reconcile(self, dry_run)

    # ------------------------------------------------------------ undo
    def undo(self, target: str, *, retries: int = 10) -> UndoReport:
        """Undo a merge or a drop, or every unit of a plan, that :meth:`apply` wrote:
        ``target`` is a merged id, a dropped id or a plan id (or a unique prefix, see
        :func:`~consolidate.sources.journal.match_target`). One new version: the members
        live again (with ``deleted_at`` and ``merged_into``: their retired rows, as they
        are now, with both cleared; without: their rows from the version before the apply,
        appended), the merged row retired (``deleted_at`` now, else deleted). A member live
        already is left as it is. The undo is recorded in the journal (undoing it again
        does nothing) and its members kept apart by every later read.

        Raises:
            UndoTargetError: ``target`` names no applied plan, merge or drop, or several.
            LanceSourceError: the dataset cannot be read or the commit failed.
        """
        from ..store.lance import commit_update

        with self.journal.locked():
            self._recover()

        def restore(plan_id: str, units: list[dict[str, Any]]) -> dict[str, Any]:
            for attempt in range(retries + 1):
                ds = self._open()
                self._check_columns(ds)
                out, table, gone = self._undo_changes(ds, units)
                if not len(gone) and not table.num_rows:
                    return out
                try:
                    commit_update(str(self.path), ds, table, gone, {"consolidate.undo": plan_id})
                except (OSError, RuntimeError, ValueError) as e:
                    why = re.sub(r",\s*/\S+\.rs:\d+:\d+", "", str(e).splitlines()[0])
                    if "conflict" in why.lower() and attempt < retries:
                        backoff(attempt)
                        continue
                    raise LanceSourceError(
                        f"{self.path}: the undo's commit failed ({why}); nothing written"
                    ) from None
                return out
            raise AssertionError("unreachable")

        return undo_by_journal(self.journal, target, restore)

    def _undo_changes(
        self, ds: Any, units: list[dict[str, Any]], keep: set[str] | frozenset[str] = frozenset()
    ) -> tuple[dict[str, Any], pa.Table, np.ndarray]:
        """``({key: restored ids | why}, rows to write, addresses to retire)`` that undo
        ``units`` on ``ds``; the merged rows of the merges in ``keep`` stay live (an agent
        wrote them since the apply)."""
        from ..store.schema import hours_now

        m = self._mapped()
        idc, soft = m["id"], "deleted_at" in m
        dc, mc = m.get("deleted_at"), m.get("merged_into")
        want = sorted({i for u in units for i in u["ids"]} | {u["key"] for u in units})
        rows, addr, by_id = _rows_by_id(ds, idc, want)

        def is_live(k: int) -> bool:
            return not soft or rows[k][dc] is None

        style = self._style(rows)
        now_h = hours_now()
        out: dict[str, Any] = {}
        gone: list[int] = []
        new_rows: list[dict[str, Any]] = []
        old: dict[int, dict[str, dict[str, Any]]] = {}  # previous version -> id -> row
        for u in units:
            key = u["key"]
            merged = [k for k in by_id.get(key, []) if is_live(k)] if u["kind"] == "merge" else []
            members_live = all(any(is_live(k) for k in by_id.get(i, [])) for i in u["ids"])
            if u["kind"] == "merge" and not merged:
                # undone already, not yet recorded (a crash); or the merged row is gone
                again = [rows[k][mc] for k in by_id.get(key, []) if mc and rows[k][mc]]
                out[key] = list(u["ids"]) if members_live else _not_undoable(key, again)
                continue
            back = []
            for i in u["ids"]:
                ks = by_id.get(i, [])
                if any(is_live(k) for k in ks):
                    continue
                if soft and ks:
                    r = dict(rows[ks[-1]])
                    r[dc] = None
                    if mc:
                        r[mc] = None
                    gone.append(int(addr[ks[-1]]))
                    new_rows.append(r)
                else:
                    v = int(u["previous"])
                    if v not in old:
                        prev = self._open(v).to_table(
                            filter=pc.field(idc).isin(pa.array(want, pa.string()))
                        )
                        old[v] = {r[idc]: r for r in prev.to_pylist()}
                    if i not in old[v]:
                        continue
                    new_rows.append(dict(old[v][i]))
                back.append(i)
            for k in [] if key in keep else merged:
                gone.append(int(addr[k]))
                if soft:
                    r = dict(rows[k])
                    r[dc] = self._time(now_h, "deleted_at", ds.schema, style)
                    new_rows.append(r)
            out[key] = back
        try:
            table = pa.Table.from_pylist(new_rows, schema=ds.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
            raise LanceSourceError(
                f"{self.path}: the restored rows do not fit the dataset's schema ({e}); "
                f"nothing written"
            ) from None
        return out, table, np.asarray(gone, np.uint64)

    def _units_now(
        self, ds: Any, plan: LancePlan, dry_run: bool
    ) -> tuple[LanceApplyReport, list[dict[str, Any]]]:
        """The report and the units of ``plan`` that still apply to ``ds``."""
        m = self._mapped()
        rep = LanceApplyReport(dry_run=dry_run, previous=ds.version)
        idc = m["id"]
        touched = sorted({i for u in plan.units for i in u["ids"]})
        new_ids = sorted({u["insert"]["id"] for u in plan.units if u["insert"]})
        taken = (
            set(
                ds.to_table(
                    columns=[idc], filter=pc.field(idc).isin(pa.array(new_ids, pa.string()))
                )
                .column(idc)
                .to_pylist()
            )
            if new_ids
            else set()
        )
        now = self._live_rows(ds, touched)
        ids_now = now.column(idc).to_pylist() if now.num_rows else []
        twice = {i for i, n in pd.Series(ids_now, dtype=object).value_counts().items() if n > 1}
        after = {r[idc]: _canon(r) for r in now.drop_columns(["_rowaddr"]).to_pylist()}
        before = after
        if ds.version != plan.version:
            # another writer since the read: a unit applies only if its rows are as read
            was = self._live_rows(self._open(plan.version), touched)
            before = {r[idc]: _canon(r) for r in was.drop_columns(["_rowaddr"]).to_pylist()}
        units = []
        for u in plan.units:
            changed = [
                i for i in u["ids"] if i not in after or i in twice or before.get(i) != after[i]
            ]
            if u["insert"] and u["insert"]["id"] in taken:
                why = f"the merged row's id {u['insert']['id']} is taken already"
            elif changed:
                why = f"rows changed since version {plan.version} was read: {changed[:3]}"
                rep.skipped_rows += changed
            else:
                units.append(u)
                rep.applied[u["kind"]] = rep.applied.get(u["kind"], 0) + 1
                continue
            rep.skipped.append({"unit": u["kind"], "namespace": u["namespace"], "why": why})
        return rep, units

    def _live_rows(self, ds: Any, ids: list[str]) -> pa.Table:
        """The live rows of ``ds`` with these ids (every column, and ``_rowaddr``)."""
        m = self._mapped()
        flt = pc.field(m["id"]).isin(pa.array(ids, pa.string()))
        if "deleted_at" in m:
            flt = flt & pc.field(m["deleted_at"]).is_null()
        return ds.to_table(filter=flt, with_row_address=True)

    def _changes(self, ds: Any, units: list[dict[str, Any]]) -> tuple[pa.Table, np.ndarray]:
        """The rows to write and the addresses of the rows to retire, for ``units``."""
        m = self._mapped()
        touched = sorted({i for u in units for i in u["ids"]})
        now = self._live_rows(ds, touched)
        pos = {i: k for k, i in enumerate(now.column(m["id"]).to_pylist())}
        addr = now.column("_rowaddr").to_numpy()
        old_rows = now.drop_columns(["_rowaddr"]).to_pylist()
        gone: list[int] = []
        new_rows: list[dict[str, Any]] = []
        soft = "deleted_at" in m
        style = self._style(old_rows)
        for u in units:
            for x in u["retire"]:
                k = pos[x["id"]]
                gone.append(int(addr[k]))
                if soft:
                    r = dict(old_rows[k])
                    r[m["deleted_at"]] = self._time(x["deleted_at"], "deleted_at", ds.schema, style)
                    if "merged_into" in m:
                        r[m["merged_into"]] = x["merged_into"]
                    new_rows.append(r)
            ins = u["insert"]
            if ins is not None and (soft or pd.isna(ins.get("deleted_at"))):
                # without soft deletes, a merged row the pass dropped is not written
                kept = pos.get(u.get("kept", ""))
                new_rows.append(
                    self._row(ins, ds.schema, style, None if kept is None else old_rows[kept])
                )
        try:
            table = pa.Table.from_pylist(new_rows, schema=ds.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
            raise LanceSourceError(
                f"{self.path}: the new rows do not fit the dataset's schema ({e}); nothing written"
            ) from None
        return table, np.asarray(gone, np.uint64)

    def _style(self, rows: list[dict[str, Any]]) -> str:
        """The ISO style (:func:`consolidate.times.iso_style`) of the text time columns'
        existing values in ``rows`` (the first one found), for writes in the same style."""
        for k in ("created_at", "last_used", "deleted_at"):
            col = self._mapped().get(k)
            for r in rows:
                v = r.get(col) if col else None
                if isinstance(v, str) and v.strip():
                    return iso_style(v)
        return "offset"

    def _time(self, h: Any, key: str, schema: pa.Schema, style: str) -> Any:
        """Hours ``h`` as a value of the dataset's ``key`` time column, in its own type,
        unit and text style (:func:`consolidate.times.values_from_hours`); ``None`` for NaN."""
        if h is None or (isinstance(h, float) and np.isnan(h)):
            return None
        t = schema.field(self._mapped()[key]).type
        try:
            return values_from_hours([float(h)], t, unit=self.cols.time_unit, style=style)[0]
        except TimeColumnError as e:
            raise LanceSourceError(f"{self.path}: column {self._mapped()[key]!r}: {e}") from None

    def _row(
        self,
        r: dict[str, Any],
        schema: pa.Schema,
        style: str = "offset",
        base: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A merged record as the dataset's columns; the columns the pass does not know
        (a user's ``tags``) from ``base``, the oldest member's row (else null)."""
        m = self._mapped()
        out: dict[str, Any] = {name: (base or {}).get(name) for name in schema.names}
        if "merged_into" in m:
            out[m["merged_into"]] = None
        for k, col in m.items():
            if k in ("merged_into",):
                continue
            v = r.get(k)
            if k in ("created_at", "last_used", "deleted_at"):
                v = self._time(v, k, schema, style)
            elif k in ("importance", "strength"):
                v = float(v)
            elif k == "pinned":
                v = bool(v)
            out[col] = v
        return out

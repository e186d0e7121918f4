"""Writing a Lance store: create, append, and a pass's or an undo's commit as one Lance
transaction of only what changed."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...text import text_hashes
from ..schema import (
    Problem,
    Records,
    hours_now,
    normalise_vectors,
    records_from_arrow,
    records_to_arrow,
    validate,
)
from ..store import (
    READ_SKEW,
    ConcurrentCommitError,
    InvalidRecordsError,
    Snapshot,
    _crashpoint,
    _fsync_dir,
    _write_atomic,
    _write_jsonl,
    dry_run_stamp,
    remove_stale_tmp,
)
from .changes import _changes, _diff
from .dataset import (
    _P,
    DATASET,
    FORMAT,
    ROWS_PER_FRAGMENT,
    _index,
    _lance,
    _reindex_if_lost,
)
from .reading import _Reading
from .scan import _read_table, _scan, _Stored

#: a commit that changes more than this fraction of the rows rewrites the table instead
#: (an ``Overwrite``: cheaper than an upsert of most rows, and history is kept)
REWRITE_FRACTION = 0.25


@dataclass
class _Late:
    """Writes made since a pass read its snapshot (see :meth:`_Writing._late_writes`):
    the rows appended since (``table``, their ``vectors`` and row ``addresses``, and as
    ``rows``), the pass's records with them carried and the late deltas folded in
    (``final``), the deltas folded by earlier versions and the late deltas folded now."""

    table: pa.Table
    vectors: np.ndarray
    addresses: np.ndarray
    rows: Records
    final: Records
    folded: set[str]
    deltas: list[str]


class _Writing(_Reading):
    """Create, append and commit (see :class:`~consolidate.store.lance.LanceStore`)."""

    # ------------------------------------------------------------ create
    def _create_here(self, records: Records, source: str) -> None:
        """Write version 1 of checked ``records`` at ``root`` (a new folder; see
        :meth:`StoreBase.create`): the dataset, its ``id`` index, then ``CURRENT``."""
        records.meta["text_hash"] = text_hashes(records.meta["text"].tolist())
        self._dirs()
        with self.lock():
            log = self._changelog([{"op": "create", "source": source, "records": len(records)}], 1)
            table = records_to_arrow(records, self.vector_dtype or "fp32")
            ds = _lance().write_dataset(
                table,
                str(self.dataset_path),
                mode="create",
                max_rows_per_file=ROWS_PER_FRAGMENT,
                transaction_properties=self._new_props("create", (), log, None),
            )
            _crashpoint("lance:after_create")
            _index(ds)
            _crashpoint("lance:after_index")
            self._record_checksums(self._open())
            marker = {
                "format": FORMAT,
                "dataset": DATASET,
                "dim": records.dim,
                "created_at": hours_now(),
                "checksums": True,
            }
            _write_atomic(
                self.pointer_path, lambda p: p.write_text(json.dumps(marker)), crash_tag="marker"
            )

    def _dirs(self) -> None:
        super()._dirs()
        with contextlib.suppress(OSError):  # an empty one left by older versions of this code
            (self.root / "snapshots").rmdir()

    def _changelog(self, events: list[dict[str, Any]], version: int, dry_run: bool = False) -> str:
        """Write the changelog of the commit expected to become ``version`` (writes are
        serialised, so it does; the version's properties name the file either way)."""
        name = (
            f"dry-run-{version:06d}-{dry_run_stamp()}.jsonl"
            if dry_run
            else f"changelog-{version:06d}.jsonl"
        )
        (self.root / "changelogs").mkdir(exist_ok=True)
        _write_atomic(
            self.root / "changelogs" / name,
            lambda p: _write_jsonl(p, events),
            crash_tag="changelog",
        )
        return name

    @staticmethod
    def _new_props(
        op: str, folded: Iterable[str], changelog: str | None, last_pass_at: float | None
    ) -> dict[str, str]:
        return {
            _P + "op": op,
            _P + "folded": json.dumps(list(folded)),
            _P + "changelog": changelog or "",
            _P + "last_pass_at": "" if last_pass_at is None else repr(float(last_pass_at)),
        }

    # ------------------------------------------------------------ write
    def append(self, records: Records | Iterable[Mapping[str, Any]]) -> list[str]:
        """Add new records as one Lance ``Append`` commit; safe while a pass runs, never
        reads the whole store (ids are checked with a filtered read of ``id``).

        Returns:
            The ids written (empty if every row went to quarantine).

        Raises:
            InvalidRecordsError: a record is invalid (also a duplicate of a stored id);
                nothing is written (unless quarantine mode).
        """
        records = self._new_rows(records, self._marker()["dim"])
        m = records.meta
        with self._writers_lock():
            dim = self._marker()["dim"]  # under the lock: a re-embed may have switched it
            ds = self._open()
            self._check_present(ds)
            clash = set(self._stored(list(m["id"]))["id"]) if len(m) else set()
            records = self._checked(
                records, dim=dim, source=f"append() to {self.root}", existing=clash
            )
            if not len(records):
                return []
            normalise_vectors(records)
            records.meta["text_hash"] = text_hashes(records.meta["text"].tolist())
            props = self._props(ds)
            props[_P + "op"] = "append"
            table = records_to_arrow(records, self._vector_dtype(ds.schema))
            _crashpoint("lance:before_append")
            new = _lance().write_dataset(table, ds, mode="append", transaction_properties=props)
            _crashpoint("lance:after_append")
            self._record_checksums(new)
        return list(records.meta["id"])

    # ------------------------------------------------------------ commit
    def commit(
        self,
        records: Records,
        events: list[dict[str, Any]],
        *,
        base: Snapshot,
        dry_run: bool = False,
        pass_time_h: float | None = None,
        op: str = "pass",
    ) -> dict[str, Any]:
        """Commit a pass's records as one new version holding only what changed.

        Must be called while holding :meth:`lock`. Rows appended since ``base`` was read stay
        as they are (they are listed as ``carried``); pending deltas are folded into the rows
        they touch. Changed rows (any column, vectors included, differs from the stored row)
        and new rows are upserted and rows absent from ``records`` (purged) deleted, in one
        Lance ``Update`` transaction on ``id`` (see :meth:`_upsert`); if
        ``store.vector_dtype`` asks for another vector dtype, or more than
        :data:`REWRITE_FRACTION` of the rows changed, the whole table is rewritten instead
        (a Lance ``Overwrite``; history kept).

        Args:
            records: the full new record set, as the pass returned it.
            events: changelog events (JSON-serialisable dicts).
            base: the snapshot the pass read (from :meth:`load` of this store).
            dry_run: write only the changelog (``changelogs/dry-run-<N>-<time>.jsonl``).
            pass_time_h: wall time of the pass (hours since the epoch).
            op: ``"pass"``, ``"undo"``, ``"rollback"`` or ``"restore"`` (recorded in the
                version).

        Returns:
            ``{"version", "snapshot", "changelog", "carried_records", "carried_touches",
            "rows_written", "rows_deleted", "rewrite"}`` (``rows_deleted``: purged ids).

        Raises:
            ConcurrentCommitError: another pass committed since ``base`` was read.
            InvalidRecordsError: the new records are invalid (nothing written).
        """
        stored = base.stored
        if stored is None or not isinstance(stored, _Stored):
            raise ValueError("commit(): base must be a snapshot loaded from this Lance store")
        dim = self._marker()["dim"]
        part = base.namespaces
        if part is not None and not records.meta["namespace"].isin(part).all():
            raise ValueError("commit(): the records hold namespaces the snapshot did not read")
        with self._writers_lock():
            ds = self._open()
            self._check_present(ds)
            props = self._unchanged_since(ds, base.version)
            late = self._late_writes(ds, base, stored, records, props, dim)
            if late.deltas or len(late.rows):
                events = events + [
                    {
                        "op": "carried",
                        "deltas": late.deltas,
                        "record_ids": late.rows.meta["id"].tolist(),
                    }
                ]
            if dry_run:
                log = self._changelog(events, ds.version + 1, dry_run=True)
                return {
                    "version": ds.version,
                    "snapshot": None,
                    "changelog": log,
                    "carried_records": len(late.rows),
                    "carried_touches": len(late.deltas),
                }
            out, folded = self._commit_changes(ds, base, stored, late, events, op, pass_time_h)
        if folded is not None:
            self._cleanup_deltas(folded)
        return out

    def _commit_changes(
        self,
        ds: Any,
        base: Snapshot,
        stored: _Stored,
        late: _Late,
        events: list[dict[str, Any]],
        op: str,
        pass_time_h: float | None,
    ) -> tuple[dict[str, Any], tuple[str, ...] | None]:
        """:meth:`commit`'s writing part, under the writers' lock: the changed rows, their
        validation, the changelog and the new version. Returns ``commit``'s answer and the
        deltas the version folded (``None`` when nothing changed: no version)."""
        dim, part, final = self._marker()["dim"], base.namespaces, late.final
        dtype = self.vector_dtype or self._vector_dtype(ds.schema)
        upsert: np.ndarray | None = None
        removed: list[str] = []
        dead: np.ndarray | None = None
        unique = False
        if dtype == self._vector_dtype(ds.schema):
            upsert, removed, dead, unique = self._changed_rows(stored, late, dtype, dim)
        if (op == "pass" and upsert is not None and not len(upsert) and not len(removed)
                and not late.deltas and not len(late.rows) and not base.deltas):  # fmt: skip
            # nothing to change: no new version (the pass's events are in its summary)
            return {
                "version": ds.version,
                "snapshot": None,
                "changelog": None,
                "carried_records": 0,
                "carried_touches": 0,
                "rows_written": 0,
                "rows_deleted": 0,
                "rewrite": False,
                "unchanged": True,
            }, None
        # rows equal to a stored row were validated when they were read: validate the
        # rest, and the ids of all (unless the comparison proved them unique)
        self._check_new(
            final if upsert is None else final.take(upsert), final, dim, ids_checked=unique
        )
        if upsert is None and part is not None:
            raise ValueError(
                "a vector dtype conversion rewrites the whole store: run it "
                "over every namespace (sleep.force=true)"
            )
        folded, log, new_props = self._new_version(
            ds, late.folded, tuple(base.deltas) + tuple(late.deltas), events, op, pass_time_h
        )
        rewrite = upsert is None or (
            part is None and len(upsert) + len(removed) > REWRITE_FRACTION * max(len(final), 1)
        )
        addresses = None
        if not rewrite and stored.rowaddr is not None:
            addresses = np.concatenate([stored.rowaddr, late.addresses])[dead]
        _crashpoint("lance:before_commit")
        try:
            new, written, deleted = self._write_version(
                ds, final, dtype, upsert, removed, new_props, rewrite, addresses
            )
        except BaseException:
            self._drop_changelog(log, ds)
            raise
        if rewrite:
            _index(new)
        else:
            _reindex_if_lost(new)
        _crashpoint("lance:after_commit")
        self._record_checksums(self._open())
        return {
            "version": new.version,
            "snapshot": f"{DATASET}@{new.version}",
            "changelog": log,
            "carried_records": len(late.rows),
            "carried_touches": len(late.deltas),
            "rows_written": written,
            "rows_deleted": deleted,
            "rewrite": rewrite,
        }, folded

    def _late_writes(
        self,
        ds: Any,
        base: Snapshot,
        stored: _Stored,
        records: Records,
        props: dict[str, str],
        dim: int,
    ) -> _Late:
        """What agents wrote since ``base`` was read, carried into the commit: the rows
        appended since (kept as they are, after ``records``) and the pending deltas the pass
        did not read that touch its rows (folded in)."""
        table, vecs, addresses = self._appended_since(
            ds, base.version, stored, base.namespaces, dim
        )
        rows = Records.empty(dim)
        if table.num_rows:
            rows = records_from_arrow(table, dim=dim, vectors=vecs)
            rows.origin = len(stored.frame) + np.arange(len(rows))
        final = Records.concat([records, rows], dim) if len(rows) else records
        folded = set(self._folded(props))
        known = None if base.namespaces is None else set(final.meta["id"])
        seen = folded | set(base.deltas)
        into = self._into(final) if known is not None else {}
        deltas = [n for n in self._listed() if n not in seen and self._covers(known, n, into)]
        for name in deltas:
            final, _ = self._apply_delta(final, name, dim)
        return _Late(table, vecs, addresses, rows, final, folded, deltas)

    def _changed_rows(
        self, stored: _Stored, late: _Late, dtype: str, dim: int
    ) -> tuple[np.ndarray, list[str], np.ndarray, bool]:
        """``(upsert, removed, dead, unique)``: the positions in ``late.final`` of the rows to
        write (new, or any column or the vector differs from the stored row), the ids to
        delete, the stored positions those replace or delete, and whether the comparison
        proved the ids unique (:func:`_diff`, else :func:`_changes`)."""
        final, rows = late.final, late.rows
        stored_ids = pa.chunked_array(
            [*stored.ids.chunks, *late.table.column("id").chunks], pa.string()
        )
        frame = rows.meta.copy(deep=False)
        got = _diff(final, [stored.frame, frame], [stored.vectors, late.vectors], stored_ids)
        if got is not None:
            upsert, dead, removed = got
            return upsert, removed, dead, True
        upsert, removed, dead = _changes(
            records_to_arrow(final, dtype, with_vectors=False),
            final.vectors.reshape(len(final), dim),
            pa.concat_tables([stored.arrow(), records_to_arrow(rows, with_vectors=False)])
            if len(rows)
            else stored.arrow(),
            [stored.vectors.reshape(-1, dim), late.vectors],
        )
        return upsert, removed, dead, False

    def _write_version(
        self,
        ds: Any,
        final: Records,
        dtype: str,
        upsert: np.ndarray | None,
        removed: list[str],
        props: dict[str, str],
        rewrite: bool,
        addresses: np.ndarray | None,
    ) -> tuple[Any, int, int]:
        """Write the new version: the whole table (a Lance ``Overwrite``) when ``rewrite``,
        else the rows ``upsert`` and the deletions ``removed`` in one ``Update``
        (:meth:`_upsert`). Returns ``(dataset, rows written, rows deleted)``."""
        if rewrite:
            new = _lance().write_dataset(
                records_to_arrow(final, dtype),
                ds,
                mode="overwrite",
                max_rows_per_file=ROWS_PER_FRAGMENT,
                transaction_properties=props,
            )
            return new, len(final), len(removed or [])
        assert upsert is not None  # not a rewrite: the diff was computed
        new = self._upsert(
            ds, records_to_arrow(final.take(upsert), dtype), removed, props, addresses=addresses
        )
        return new, len(upsert), len(removed)

    def _drop_changelog(self, log: str, ds: Any) -> None:
        """A commit failed (a full disk, a read-only file system): remove the changelog it
        wrote, unless the version landed after all."""
        with contextlib.suppress(Exception):
            if self._open().version == ds.version:
                (self.root / "changelogs" / log).unlink(missing_ok=True)

    def _unchanged_since(self, ds: Any, base_version: int) -> dict[str, str]:
        """The properties of ``ds`` (the newest version), after checking that no pass,
        undo, rollback or restore committed since ``base_version``.

        Raises:
            ConcurrentCommitError: one did."""
        props = self._props(ds)
        if props.get(_P + "changelog") != self._props(self._open(base_version)).get(
            _P + "changelog"
        ):
            raise ConcurrentCommitError(
                f"{self.root}: another pass or undo committed since version "
                f"{base_version} was read (now at {ds.version}); rerun the pass"
            )
        return props

    def _appended_since(
        self,
        ds: Any,
        base_version: int,
        stored: _Stored,
        namespaces: Sequence[str] | None,
        dim: int,
    ) -> tuple[pa.Table, np.ndarray, np.ndarray]:
        """The rows appended to ``ds`` (the newest version) since ``base_version`` was read
        into ``stored``, in ``namespaces`` (all when ``None``), as :func:`_scan` returns
        them. Only fragments that ``base_version`` does not hold are read (appends add
        fragments; rows a compaction moved into new fragments are recognised by id)."""
        empty = (
            records_to_arrow(Records.empty(dim), with_vectors=False),
            np.zeros((0, dim), np.float32),
            np.zeros(0, np.uint64),
        )
        try:
            had = {f.fragment_id for f in self._open(base_version).get_fragments()}
        except Exception:  # noqa: BLE001 - a version no longer kept: read every fragment
            had = set()
        newer = [f for f in ds.get_fragments() if f.fragment_id not in had]
        if not newer:
            return empty
        scope = (
            None
            if namespaces is None
            else pc.field("namespace").isin(pa.array(namespaces, pa.string()))
        )
        ids = _read_table(ds, columns=["id"], filter=scope, fragments=newer)[0].column("id")
        if not len(ids):
            return empty
        sid = stored.ids
        moved = sid.filter(pc.is_in(sid, value_set=ids))  # probes m ids in a set of few
        appended = ids.filter(pc.invert(pc.is_in(ids, value_set=moved)))
        if not len(appended):
            return empty
        return _scan(ds, pc.field("id").isin(appended), dim)

    def _check_new(
        self, changed: Records, every: Records, dim: int, *, ids_checked: bool = False
    ) -> None:
        """Validate the rows a commit writes (``changed``) and the uniqueness of the ids of
        ``every`` row it leaves (unless ``ids_checked``: the caller proved them unique).

        Raises:
            InvalidRecordsError: nothing is written."""
        problems = validate(
            changed, dim=dim, future_tolerance_h=READ_SKEW * self.future_tolerance_h
        )
        dup = [] if ids_checked else every.meta["id"][every.meta["id"].duplicated()].tolist()
        if dup:
            problems.append(Problem("duplicate id", [], dup[:20]))
        if problems:
            raise InvalidRecordsError(f"the new version of {self.root} (nothing written)", problems)

    def _new_version(
        self,
        ds: Any,
        already: set[str],
        folded: tuple[str, ...],
        events: list[dict[str, Any]],
        op: str,
        pass_time_h: float | None,
    ) -> tuple[tuple[str, ...], str, dict[str, str]]:
        """Write the changelog of the version after ``ds`` and return ``(folded, changelog
        name, transaction properties)``; ``folded`` adds the deltas an earlier commit folded
        whose removal did not finish (so they are never applied twice)."""
        leftover = tuple(n for n in already if (self.root / "deltas" / n).exists())
        folded = leftover + folded
        log = self._changelog(events, ds.version + 1)
        _crashpoint("lance:after_changelog")
        last = pass_time_h if pass_time_h is not None else hours_now()
        props = self._new_props(op, folded, log, last)
        props[_P + "summary"] = json.dumps(
            dict(Counter(str(e.get("op")) for e in events)), sort_keys=True
        )
        return folded, log, props

    def _upsert(
        self,
        ds: Any,
        table: pa.Table,
        removed: Sequence[str],
        props: dict[str, str],
        *,
        addresses: np.ndarray | None = None,
    ) -> Any:
        """Commit ``table`` (rows upserted on ``id``) and the deletion of the ids
        ``removed`` as one Lance version on top of ``ds`` carrying ``props``.

        One ``Update`` transaction: the stored rows of those ids are marked deleted in the
        fragments that hold them (deletion files) and the new rows written as new
        fragments. Its cost follows the rows changed, not the table, and it needs no join
        in memory (Lance's ``merge_insert`` builds a hash table of its whole input, which
        exceeds Lance's memory pool at about 10^5 rows of 384-d vectors).

        Args:
            addresses: ``uint64``: the row addresses of exactly the stored rows to mark
                deleted (those of ``table``'s stored ids and of ``removed``), as read at
                load; used when every fragment they name is still in ``ds`` (fragment ids
                are never reused), else the rows are found through the ``id`` index.

        Raises:
            ConcurrentCommitError: found by id, the rows are not one per id (an id stored
                twice) or not as many as ``addresses`` named; nothing is written.
        """
        expected = None if addresses is None else len(addresses)
        if addresses is not None and len(addresses):
            present = {f.fragment_id for f in ds.get_fragments()}
            if not set(np.unique(addresses >> np.uint64(32)).tolist()) <= present:
                addresses = None
        if addresses is None:
            ids = table.column("id")
            if removed:
                ids = pa.concat_arrays(
                    [
                        ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids,
                        pa.array(list(removed), pa.string()),
                    ]
                )
            addresses = np.zeros(0, np.uint64)
            if len(ids):
                hit, _ = _read_table(
                    ds, columns=["id"], filter=pc.field("id").isin(ids), with_row_address=True
                )
                if hit.num_rows != pc.count_distinct(hit.column("id")).as_py() or (
                    expected is not None and hit.num_rows != expected
                ):
                    # an id stored twice (a copy quarantined at load): by id alone the
                    # commit cannot tell the copy it keeps from the one it drops
                    raise ConcurrentCommitError(
                        f"{self.root}: the rows this commit replaces were moved since they "
                        f"were read (a compaction) and an id among them is stored more than "
                        f"once; nothing written: rerun the pass"
                    )
                addresses = hit.column("_rowaddr").to_numpy()
        return commit_update(str(self.dataset_path), ds, table, addresses, props)

    def _cleanup_deltas(self, folded: Iterable[str]) -> None:
        d = self.root / "deltas"
        for k, name in enumerate(folded):
            with contextlib.suppress(FileNotFoundError):
                (d / name).unlink()
            if k == 0:
                _crashpoint("lance:during_delta_cleanup")
        remove_stale_tmp(d)
        _fsync_dir(d)


def commit_update(
    uri: str, ds: Any, table: pa.Table, addresses: np.ndarray, props: dict[str, str] | None = None
) -> Any:
    """One Lance ``Update`` transaction on top of ``ds`` (the version read): the rows at
    ``addresses`` marked deleted in the fragments that hold them (deletion files) and the
    rows of ``table`` written as new fragments. Its cost follows the rows changed; one step
    per fragment that holds a deleted row, never per row.

    Args:
        uri: the dataset.
        ds: the dataset at the version the change is based on.
        table: new rows, in ``ds``'s schema (may be empty).
        addresses: ``uint64`` row addresses (fragment id << 32 | offset) in ``ds``.
        props: transaction properties recorded with the version.

    Returns:
        The dataset at the new version.

    Raises:
        OSError, RuntimeError: Lance's commit failed (e.g. a conflicting concurrent commit);
            the version is not written.
    """
    lance = _lance()
    updated, gone = [], []
    if len(addresses):
        addresses = np.sort(np.asarray(addresses).astype(np.uint64))
        frag_of = addresses >> np.uint64(32)
        offsets = addresses & np.uint64(0xFFFFFFFF)
        frags, starts = np.unique(frag_of, return_index=True)
        ends = np.r_[starts[1:], len(addresses)]
        for f, a, b in zip(frags.tolist(), starts.tolist(), ends.tolist(), strict=True):
            meta = ds.get_fragment(int(f)).delete_rows(offsets[a:b].tolist())
            (gone.append(int(f)) if meta is None else updated.append(meta))
    new = (
        lance.fragment.write_fragments(table, ds, max_rows_per_file=ROWS_PER_FRAGMENT)
        if table.num_rows
        else []
    )
    _crashpoint("lance:after_fragments")  # files written, not yet in any version
    op = lance.LanceOperation.Update(
        removed_fragment_ids=gone, updated_fragments=updated, new_fragments=new
    )
    txn = lance.Transaction(
        read_version=ds.version, operation=op, transaction_properties=props or {}
    )
    return lance.LanceDataset.commit(uri, txn, read_version=ds.version)

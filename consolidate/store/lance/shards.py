"""Fleet runs over a Lance store: the pending deltas, the rows of a shard of namespaces at
one version, and the commit of many shards' changes as one version."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..schema import (
    Records,
    records_from_arrow,
    records_to_arrow,
)
from ..store import (
    CorruptStoreError,
    Snapshot,
    _crashpoint,
    _plain_name,
)
from .changes import _changes, _diff
from .dataset import DATASET
from .scan import _read_table, _Stored
from .writing import _Writing


class _Shards(_Writing):
    """Shards of namespaces for :mod:`consolidate.fleet` (see
    :class:`~consolidate.store.lance.LanceStore`)."""

    def pending(self) -> tuple[int, list[str]]:
        """The newest version and the delta files not folded into it (sorted).

        The delta files are listed before the version is opened (see the module
        docstring), so a delta a pass folds in between is not listed as pending."""
        listed = self._listed()
        ds = self._open()
        folded = set(self._folded(self._props(ds)))
        return ds.version, [n for n in listed if n not in folded]

    def read_rows(
        self,
        version: int,
        namespaces: Sequence[str] | None = None,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """The stored rows of ``version`` (all columns unless ``columns``), of the
        ``namespaces`` given or of all; pending deltas are not applied.

        Raises:
            CorruptStoreError: the version is not retained or a file cannot be read."""
        ds = self._open(version)
        flt = (
            None
            if namespaces is None
            else pc.field("namespace").isin(pa.array(sorted(namespaces), pa.string()))
        )
        try:
            return _read_table(ds, columns=None if columns is None else list(columns), filter=flt)[
                0
            ]
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
            self._check_present(ds)
            raise CorruptStoreError(
                f"cannot read {self.dataset_path} (version {version}): {e}"
            ) from e

    def shard_snapshot(
        self,
        table: pa.Table,
        *,
        version: int,
        namespaces: Sequence[str],
        deltas: Sequence[str],
        validate_records: bool = True,
    ) -> Snapshot:
        """A snapshot of one shard of namespaces from rows :meth:`read_rows` returned:
        the rows decoded and validated, with the given pending deltas applied (the plan
        puts every namespace a delta's replay reads into its shard; ids it names that are
        not stored are ignored, as by a load of the whole store).

        Args:
            table: every stored row of ``namespaces`` at ``version`` (all columns).
            version: the version the rows were read from.
            namespaces: the shard's namespaces.
            deltas: pending delta files to apply (:meth:`pending`).

        Returns:
            A snapshot whose ``deltas`` lists the delta files applied; its records, run
            through a pass, go to :meth:`changes`.
        """
        marker = self._marker()
        props = self._props(self._open(version))
        names = sorted({str(n) for n in namespaces})
        source = (
            f"{self.dataset_path} (version {version}), namespaces "
            f"{names[:3]}{'...' if len(names) > 3 else ''}"
        )
        return self._rows_snapshot(
            [(table, None, None)],
            version=version,
            dim=marker["dim"],
            props=props,
            deltas=list(deltas),
            validate_records=validate_records,
            source=source,
            namespaces=names,
            apply_all=True,
        )

    def changes(self, records: Records, base: Snapshot) -> tuple[pa.Table, list[str]]:
        """What a commit of ``records`` over ``base`` would write: the rows (all columns, in
        the store's vector dtype) that are new or differ from the stored row in any column
        or vector component, and the stored ids absent from ``records`` (purged).

        Raises:
            ValueError: ``base`` was not loaded from a Lance store."""
        stored = base.stored
        if not isinstance(stored, _Stored):
            raise ValueError("changes(): base must be a snapshot loaded from this Lance store")
        dim = self._marker()["dim"]
        dtype = self._vector_dtype(self._open(base.version).schema)
        got = _diff(records, [stored.frame], [stored.vectors], stored.ids)
        if got is not None:
            rows, _, removed = got
        else:
            rows, removed, _ = _changes(
                records_to_arrow(records, dtype, with_vectors=False),
                records.vectors.reshape(len(records), dim),
                stored.arrow(),
                [stored.vectors.reshape(-1, dim)],
            )
        return records_to_arrow(records.take(rows), dtype), removed

    def commit_changes(
        self,
        upsert: pa.Table,
        removed: Sequence[str],
        events: list[dict[str, Any]],
        *,
        base_version: int,
        folded: Sequence[str],
        namespaces: Sequence[str] | None,
        pass_time_h: float | None = None,
        op: str = "pass",
    ) -> dict[str, Any]:
        """Commit the changes of a pass run in shards (:meth:`changes` of each) as one new
        version: ``upsert`` rows upserted on ``id`` and ``removed`` ids deleted, in one
        Lance ``Update`` transaction (:meth:`_upsert`). Must be called while holding
        :meth:`lock`.

        Rows appended since ``base_version`` stay as they are, and deltas not in ``folded``
        stay pending (the next load applies them).

        Args:
            upsert: the changed and new rows (the store's schema), ids unique.
            removed: stored ids to delete (purged tombstones).
            events: the changelog events.
            base_version: the version the shards read.
            folded: the delta files the shards applied.
            namespaces: the namespaces the shards covered (``None``: all); every upserted
                row must be in one of them.
            pass_time_h: wall time of the pass (hours since the epoch).

        Returns:
            ``{"version", "snapshot", "changelog", "carried_records", "carried_touches",
            "rows_written", "rows_deleted", "rewrite"}`` as :meth:`commit`.

        Raises:
            ConcurrentCommitError: another pass committed since ``base_version``.
            InvalidRecordsError: an upserted row is invalid or ids repeat (nothing written).
            ValueError: a row outside ``namespaces``.
        """
        dim = self._marker()["dim"]
        for name in folded:
            if not (_plain_name(name) and name.endswith((".touch.json", ".patch.json"))):
                raise ValueError(f"commit_changes(): {name!r} is not a delta file name")
        with self._writers_lock():
            ds = self._open()
            self._check_present(ds)
            props = self._unchanged_since(ds, base_version)
            recs = records_from_arrow(upsert, dim=dim)
            if namespaces is not None and not recs.meta["namespace"].isin(list(namespaces)).all():
                raise ValueError("commit_changes(): rows outside the namespaces read")
            self._check_new(recs, recs, dim)
            all_folded, log, new_props = self._new_version(
                ds, set(self._folded(props)), tuple(folded), events, op, pass_time_h
            )
            _crashpoint("lance:before_commit")
            try:
                new = self._upsert(
                    ds,
                    records_to_arrow(recs, self._vector_dtype(ds.schema)),
                    list(removed),
                    new_props,
                )
            except BaseException:
                self._drop_changelog(log, ds)
                raise
            _crashpoint("lance:after_commit")
            self._record_checksums(self._open())
        self._cleanup_deltas(all_folded)
        return {
            "version": new.version,
            "snapshot": f"{DATASET}@{new.version}",
            "changelog": log,
            "carried_records": 0,
            "carried_touches": 0,
            "rows_written": len(recs),
            "rows_deleted": len(removed),
            "rewrite": False,
        }


def read_shard(
    root: str, version: int, k: int, namespaces: list[str], packed: bool = False
) -> list[pa.Table]:
    """One Ray Data read task: the stored rows of one shard, with a ``_shard`` column; or,
    ``packed``, one row holding the shard's rows as an Arrow IPC stream (``_shard``,
    ``_rows``, ``_ipc``), so that batches of one row are whole shards (GPU actors must be
    given a batch size). Imports nothing beyond the store (no torch): a read task's worker
    process stays small."""
    from .store import LanceStore

    t = LanceStore(root).read_rows(version, namespaces)
    if not packed:
        return [t.append_column("_shard", pa.array(np.full(t.num_rows, k, np.int32)))]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return [
        pa.table(
            {
                "_shard": pa.array([k], pa.int32()),
                "_rows": [t.num_rows],
                "_ipc": pa.array([sink.getvalue().to_pybytes()], pa.large_binary()),
            }
        )
    ]

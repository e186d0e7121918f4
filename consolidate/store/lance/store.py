"""The Lance store: :class:`LanceStore` composed of its parts (dataset and checksums,
reading, writing, history, fleet shards) with its maintenance, and the functions that
open a store folder of either format and convert between them."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, ClassVar

from ...registry import did_you_mean
from ..base import FORMATS
from ..store import (
    POINTER,
    CorruptStoreError,
    StoreBase,
    _crashpoint,
)
from .dataset import _P, FORMAT, ROWS_PER_FRAGMENT, _lance, _txn_props
from .history import _History
from .shards import _Shards

#: compaction runs when more fragments than this are smaller than ROWS_PER_FRAGMENT
COMPACT_AFTER = 16


class LanceStore(_History, _Shards):
    """A memory store backed by a Lance dataset (see the module docstring for the layout and
    the writers' protocol). The same interface as the Parquet store
    (:class:`~consolidate.store.base.MemoryStore`), beside it, not derived from it;
    ``keep_snapshots`` is the number of versions kept by :meth:`cleanup` (at least; Lance
    also keeps every version newer than ``retention_h``).

    Args:
        retention_h: :meth:`cleanup` removes versions older than this many hours.
        **kwargs: see :class:`~consolidate.store.store.StoreBase`.
    """

    FORMAT: ClassVar[str] = FORMAT
    PARTIAL_LOADS: ClassVar[bool] = True
    TIME_TRAVEL: ClassVar[bool] = True

    def maintain(self) -> dict[str, Any] | None:
        """:meth:`cleanup` (compaction, old versions), under :meth:`lock`."""
        return self.cleanup()

    # ------------------------------------------------------------ maintenance
    def _restate(self, ds: Any, props: dict[str, str]) -> Any:
        """If the newest version is Lance's own (compaction, an index), commit consolidate's
        properties on top of it (an empty ``merge_insert``), so the newest version names
        them even after older versions are removed. Hold ``WRITERS.LOCK``."""
        if _P + "folded" in _txn_props(ds, ds.version):
            return ds
        b = ds.merge_insert("id").when_matched_update_all()
        txn, _ = b.execute_uncommitted(ds.to_table(limit=0))
        txn.transaction_properties = {**props, _P + "op": "compact"}
        return _lance().LanceDataset.commit(str(self.dataset_path), txn, read_version=ds.version)

    def cleanup(self, *, compact: bool = True) -> dict[str, Any]:
        """Compact small fragments (when more than :data:`COMPACT_AFTER` are below
        :data:`ROWS_PER_FRAGMENT` rows) and remove versions older than ``retention_h`` that are
        not among the newest ``keep_snapshots`` (Lance's ``compact_files`` and
        ``cleanup_old_versions``). Hold :meth:`lock` while calling it.

        Returns:
            ``{"compacted_fragments", "removed_versions", "bytes_removed"}``.
        """
        import datetime as dt

        out = {"compacted_fragments": 0, "removed_versions": 0, "bytes_removed": 0}
        with self._writers_lock():
            ds = self._open()
            small = sum(f.count_rows() < ROWS_PER_FRAGMENT for f in ds.get_fragments())
            if compact and small > COMPACT_AFTER:
                props = self._props(ds)
                m = ds.optimize.compact_files(target_rows_per_fragment=ROWS_PER_FRAGMENT)
                out["compacted_fragments"] = int(getattr(m, "fragments_removed", 0))
                _crashpoint("lance:after_compact")
                ds = self._restate(self._open(), props)
                _crashpoint("lance:after_restate")
                with contextlib.suppress(Exception):  # an index left as it was still works
                    ds.optimize.optimize_indices()
                ds = self._restate(self._open(), props)
            self._record_checksums(ds)
            _crashpoint("lance:before_version_cleanup")
            keep_from = ds.version - self.keep_snapshots + 1
            old = [v["version"] for v in ds.versions() if v["version"] < keep_from]
            if old:
                age = dt.timedelta(hours=self.retention_h)
                stats = ds.cleanup_old_versions(older_than=age, retain_versions=self.keep_snapshots)
                out["removed_versions"] = int(getattr(stats, "old_versions", 0))
                out["bytes_removed"] = int(getattr(stats, "bytes_removed", 0))
                self._record_checksums(ds, prune=True)  # forgets the removed files
        return out

    def reindex(self) -> dict[str, Any]:
        """Rebuild the scalar indexes (``id`` and ``namespace``, :func:`_index`) over every
        row, replacing the old ones: the way out when an index file under ``_indices`` is
        damaged (reads then go on without it, slower, and warn). The rows are not touched;
        each index is a Lance version of its own, with the store's properties restated on
        top. Hold :meth:`lock` while calling it.

        Returns:
            ``{"version": the newest version after, "indexes": ["id", "namespace"]}``.
        """
        with self._writers_lock():
            ds = self._open()
            props = self._props(ds)
            ds.create_scalar_index("id", "BTREE", replace=True)
            ds.create_scalar_index("namespace", "BTREE", replace=True)
            ds = self._restate(self._open(), props)
            self._record_checksums(ds)
        return {"version": ds.version, "indexes": ["id", "namespace"]}


def store_format(root: str | os.PathLike) -> str | None:
    """``"lance"`` or ``"parquet"`` for the store at ``root``; ``None`` if none is there.

    Raises:
        CorruptStoreError: ``CURRENT`` is not a JSON object.
    """
    p = Path(root) / POINTER
    try:
        d = json.loads(p.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        raise CorruptStoreError(f"{p} is not a valid pointer ({e})") from None
    if not isinstance(d, dict):
        raise CorruptStoreError(f"{p} is not a valid pointer (not a JSON object)")
    return FORMAT if d.get("format") == FORMAT else "parquet"


def open_store_dir(
    root: str | os.PathLike,
    *,
    format: str = "lance",
    retention_h: float | None = None,
    **kwargs: Any,
) -> StoreBase:
    """The store at ``root`` in its own format, or a new (not yet created) one in ``format``.

    Args:
        root: the store directory.
        format: ``"lance"`` or ``"parquet"``; used only when ``root`` holds no store.
        retention_h: a Lance store's version retention (hours; ``None``: its default); a
            Parquet store keeps ``keep_snapshots`` snapshot files and takes no retention.
        **kwargs: passed to the store class (``keep_snapshots``, ``quarantine``, ...).

    Raises:
        ValueError: an unknown ``format``.
        CorruptStoreError: ``CURRENT`` is unreadable.
    """
    if format not in FORMATS:
        raise ValueError(
            f"store.format must be {' or '.join(map(repr, FORMATS))}, got {format!r}"
            f"{did_you_mean(str(format), FORMATS.names())}"
        )
    found = store_format(root) or format
    cls = FORMATS.load(found)
    if retention_h is not None and cls.TIME_TRAVEL:  # a store that keeps versions
        kwargs["retention_h"] = retention_h
    store: StoreBase = cls(root, **kwargs)
    return store


def convert(src: StoreBase, dst: LanceStore) -> dict[str, Any]:
    """Copy the store ``src`` (its newest snapshot with pending deltas applied) into a new
    Lance store ``dst`` (an empty or new directory). ``src`` is not changed.

    Returns:
        ``{"records", "version", "source_version"}``.

    Raises:
        FileExistsError: ``dst`` is not empty. See also :meth:`ParquetStore.load`.
    """
    with src.lock():
        snap = src.load()
        if not len(snap.records):
            raise ValueError(f"{src.root} holds no records to convert")
        dst.vector_dtype = dst.vector_dtype or src.head().vector_dtype
        out = dst.create(snap.records, source=f"convert from {src.root} (version {snap.version})")
    return {"records": len(out.records), "version": out.version, "source_version": snap.version}

"""A memory store whose records live in one Lance dataset (versioned, appendable, columnar).

Layout of a store directory::

    CURRENT                  marker (JSON): {"format": "lance", "dataset": "memories.lance",
                             "dim": d, "created_at": hours}; written once, at create
    memories.lance/          the Lance dataset: one row per record (live and tombstones),
                             schema :func:`consolidate.store.schema.arrow_schema`; every
                             write is a Lance version (time travel, crash-safe commits)
    changelogs/changelog-NNNNNN.jsonl   the changelog of version N (create, pass, undo),
                             also named in that version's properties
    deltas/<time_ns>-<pid>-<rand>.touch.json   recall bookkeeping not yet folded
    deltas/<time_ns>-<pid>-<rand>.patch.json   write-path tombstones not yet folded
    LOCK, WRITERS.LOCK, quarantine/            as in :class:`~consolidate.store.store.ParquetStore`

Writes and what they cost (see ``eval/store_bench/``):

* :meth:`LanceStore.append` checks the new ids against the stored ones with a filtered
  read of the ``id`` column (a BTREE index), then commits the rows as a Lance ``Append``:
  it never reads the whole store.
* :meth:`~consolidate.store.store.StoreBase.mark_used` and :meth:`~consolidate.store.store.StoreBase.patch`
  look their ids up the same way and write a small delta file, replayed by every load
  (their semantics, e.g. a touch following ``merged_into``, stay in
  :func:`~consolidate.store.store.apply_touch` / :func:`~consolidate.store.store.apply_patch`).
* :meth:`LanceStore.load` of some namespaces reads their rows through a BTREE index on
  ``namespace`` (an incremental nightly run reads what fired, not the store).
* :meth:`LanceStore.commit` (a pass, an undo) compares the pass's records with the stored
  rows as the load decoded them, column by column as arrays, each row matched to its
  stored row by :attr:`~consolidate.store.Records.origin` (checked against the ids), and
  commits only the difference as one Lance ``Update`` transaction (the stored rows of
  changed and purged ids marked deleted in their fragments by the row addresses read at
  load, changed and new rows written as new fragments), with the pending deltas folded
  into the rows they touch.

Integrity: ``CHECKSUMS.json`` holds the CRC32 of every data and deletion file written
through this store and the content digest of every version (SHA-256 over its files and
their CRC32s), both recorded right after each write; a load checks the digest of the
version it reads and reads back the files of the fragments it reads.

Every version carries ``transaction_properties``: ``consolidate.op``, the delta files folded
so far (``consolidate.folded``), the changelog's name, the last pass time. Appends copy them
forward, so the newest version names them; a version written by Lance alone (compaction,
an index) is skipped by looking one version back.

The protocol for concurrent writers: every write to the dataset (append, a pass's commit)
happens under ``WRITERS.LOCK`` (``fcntl.flock``), so Lance never sees two writers at once
and no commit needs a conflict retry; a pass holds ``LOCK`` for its whole run and
``WRITERS.LOCK`` only while it commits (writers wait that long). Rows appended while a pass
ran are already in the dataset and stay untouched by its commit; deltas written while it ran
are folded into its commit if they exist when it commits, or stay pending otherwise. A
load lists the delta files before it opens the newest version, so a delta folded (and
removed) in between is in the version it reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import threading
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..registry import did_you_mean
from ..text import text_hashes
from .base import FORMATS
from .schema import (
    COLUMNS,
    Problem,
    Records,
    hours_now,
    normalise_vectors,
    records_from_arrow,
    records_to_arrow,
    validate,
)
from .store import (
    POINTER,
    READ_SKEW,
    ConcurrentCommitError,
    CorruptStoreError,
    DeltaError,
    InvalidRecordsError,
    Pointer,
    Snapshot,
    StoreBase,
    StoreNotFoundError,
    _crashpoint,
    _fsync_dir,
    _plain_name,
    _write_atomic,
    _write_jsonl,
    dry_run_stamp,
    remove_stale_tmp,
)
from .vectors import SCALE_COLUMN, decode_vectors, empty_vectors

__all__ = ["LanceStore", "DATASET", "store_format", "open_store_dir", "convert"]

log = logging.getLogger("consolidate")

DATASET = "memories.lance"
FORMAT = "lance"
_P = "consolidate."
#: rows per data file written by create and a full rewrite, and the size compaction aims
#: at: a fragment this large is never rewritten by compaction (unless a tenth of its rows
#: are deleted), so a nightly compaction costs what was written since, not the store
ROWS_PER_FRAGMENT = 1 << 18
#: a commit that changes more than this fraction of the rows rewrites the table instead
#: (an ``Overwrite``: cheaper than an upsert of most rows, and history is kept)
REWRITE_FRACTION = 0.25
#: compaction runs when more fragments than this are smaller than ROWS_PER_FRAGMENT
COMPACT_AFTER = 16
#: ``{path under memories.lance: CRC32}`` of every data and deletion file written through
#: this store; checked when a version is read
CHECKSUMS = "CHECKSUMS.json"
#: the ops whose versions have a changelog
_LOGGED = ("create", "pass", "undo", "rollback", "restore", "convert")
#: versions looked back through for the newest one that carries consolidate's properties
_MAX_LOOKBACK = 64
#: ``merged_into`` links followed from a record a delta names (a merge of merges)
_MAX_CHAIN = 64
#: rows per batch when a load streams the dataset (the vectors of one batch are the only
#: copy a load holds besides its output: 64 Ki rows x 384 x 4 B = 96 MiB)
SCAN_BATCH = 1 << 16


@dataclass
class _Stored:
    """The rows of a snapshot as stored, before its pending deltas: what a commit of the
    snapshot compares the pass's records against.

    Attributes:
        ids: the ``m`` stored ids as read (Arrow strings).
        frame: the rows decoded (:func:`records_from_arrow`'s columns; a copy-on-write
            view of the loaded records' table, so later changes to the records never show
            here).
        vectors: ``float32 [m, d]``, read-only.
        rowaddr: ``uint64 [m]`` Lance row addresses (fragment id << 32 | offset) in the
            version read, or ``None`` when unknown.
    """

    ids: pa.ChunkedArray
    frame: pd.DataFrame
    vectors: np.ndarray
    rowaddr: np.ndarray | None = None

    def arrow(self) -> pa.Table:
        """The rows' non-vector columns as Arrow (:func:`records_to_arrow`)."""
        return records_to_arrow(Records(self.frame, self.vectors), with_vectors=False)


def _read_table(ds: Any, **kw: Any) -> tuple[pa.Table, bool]:
    """``(ds.scanner(**kw).to_table(), whether the scalar indexes served it)``. A filtered read that
    fails while one that ignores the indexes succeeds means an index file is damaged: the
    indexes are derived data (the rows are intact), so the read goes on without them, with
    a warning naming the way to rebuild them (:meth:`LanceStore.reindex`).

    Raises:
        the first read's error when the read without indexes fails too.
    """
    try:
        return ds.scanner(**kw).to_table(), True
    except Exception as e:
        if kw.get("filter") is None:
            raise
        try:
            out = ds.scanner(**kw, use_scalar_index=False).to_table()
        except Exception:
            raise e from None
        log.warning(
            "%s: a scalar index (under _indices) cannot be read (%s); reading "
            "without it, slower. The rows are intact; `consolidate-versions "
            "action=reindex` rebuilds the indexes",
            ds.uri,
            e,
        )
        return out, False


def _variable_width(vtype: pa.DataType) -> bool:
    """A vector column written by another tool as a list of floats of any length."""
    return (pa.types.is_list(vtype) or pa.types.is_large_list(vtype)) and pa.types.is_floating(
        vtype.value_type
    )


def _decode_variable(column: Any, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``(float32 [n, dim] vectors, int64 [n] widths)`` of a list-of-floats column: rows
    of another width than ``dim`` (or null) get the first unit vector and their width (-1
    for null) is reported, so the caller refuses them by record."""
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(col)
    widths = pc.fill_null(pc.list_value_length(col), -1).to_numpy(zero_copy_only=False)
    widths = widths.astype(np.int64)
    out = np.zeros((n, dim), np.float32)
    out[:, 0] = 1.0
    ok = widths == dim
    if ok.any():
        good = col.filter(pa.array(ok))
        out[ok] = (
            pc.list_flatten(good).to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, dim)
        )
    return out, widths


def _scan(
    ds: Any,
    flt: Any,
    dim: int,
    found: Callable[[np.ndarray], None] | None = None,
    widths_out: dict[int, int] | None = None,
) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """Read the rows of the Lance dataset ``ds`` that match ``flt`` (all when ``None``):
    first every column but the vectors, then the vectors batch by batch (:data:`SCAN_BATCH`
    rows) decoded into one ``float32`` array allocated up front. Two scans, because the
    other columns of a batch Lance returns share buffers with its vectors: kept, they
    would keep every batch's vectors alive. Peak memory: the output plus one batch.

    Args:
        found: called with the ``uint64`` row addresses once the first scan has them
            (before the vectors are read), or ``None``.
        widths_out: for a vector column of variable width (a list of floats, as another
            writer may leave it; with ``widths_out`` given, else refused), filled with
            ``{position: width}`` of each row that is not ``dim`` wide (-1: null); those
            rows get a placeholder vector, for the caller to refuse by record.

    Returns:
        ``(meta, vectors, rowaddr)``: the non-vector columns (Arrow, in scan order), the
        ``float32 [n, dim]`` vectors and the ``uint64 [n]`` row addresses, row-aligned.

    Raises:
        ValueError: the vector column is not ``dim`` wide, or the two scans disagree on the
            rows.
        OSError, pyarrow.ArrowException: Lance could not read a file.
    """
    vcols = [c for c in ("vector", SCALE_COLUMN) if c in ds.schema.names]
    vtype = ds.schema.field("vector").type
    variable = widths_out is not None and _variable_width(vtype) and SCALE_COLUMN not in vcols
    if not variable and (not pa.types.is_fixed_size_list(vtype) or vtype.list_size != dim):
        raise ValueError(f"the vector column is {vtype}, not {dim} wide")
    meta, indexed = _read_table(
        ds,
        columns=[c for c in ds.schema.names if c not in vcols],
        filter=flt,
        with_row_address=True,
    )
    addr = meta.column("_rowaddr").to_numpy()
    meta = meta.drop_columns(["_rowaddr"])
    n = len(addr)
    if found is not None:
        found(addr)
    vecs = empty_vectors(n, dim)
    order = None  # stored positions by address, built only if the scans' orders differ
    at = 0
    # Lance's default read-ahead holds about 1.3 GB of pages over a 10^6 x 384 fp32 scan;
    # one fragment at a time with 32 MiB of I/O buffer holds about half that, as fast
    for b in ds.to_batches(
        columns=vcols,
        filter=flt,
        with_row_address=True,
        batch_size=SCAN_BATCH,
        fragment_readahead=1,
        io_buffer_size=32 << 20,
        use_scalar_index=indexed,
    ):
        k = b.num_rows
        got = b.column("_rowaddr").to_numpy()
        if variable:
            block, widths = _decode_variable(b.column("vector"), dim)
        else:
            block = decode_vectors(
                b.column("vector"), b.column(SCALE_COLUMN) if SCALE_COLUMN in vcols else None
            )
        if at + k <= n and np.array_equal(got, addr[at : at + k]):
            vecs[at : at + k] = block
            pos = np.arange(at, at + k)
        else:
            if order is None:
                order = np.argsort(addr, kind="stable")
            j = np.searchsorted(addr, got, sorter=order)
            if at + k > n or np.any(j >= n) or np.any(addr[order[np.minimum(j, n - 1)]] != got):
                raise ValueError(
                    f"the vector scan returned rows the first scan of {n} rows did not"
                )
            vecs[order[j]] = block
            pos = order[j]
        if variable:
            assert widths_out is not None
            wrong = np.flatnonzero(widths != dim)
            widths_out.update(zip(pos[wrong].tolist(), widths[wrong].tolist(), strict=True))
        at += k
    if at != n:
        raise ValueError(f"the vector scan returned {at} rows, the first {n}")
    return meta, vecs, addr


def _is_utf8_error(e: BaseException) -> bool:
    m = str(e).lower()
    return "utf-8" in m or "utf8" in m


def _string_field(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or ((pa.types.is_list(t) or pa.types.is_large_list(t)) and _string_field(t.value_type))
    )


#: rows read per ``take`` while looking for the rows whose strings Lance cannot decode
_UTF8_CHUNK = 8192


def _scan_past_bad_strings(
    ds: Any, flt: Any, dim: int, widths_out: dict[int, int]
) -> tuple[pa.Table, np.ndarray, np.ndarray, dict[int, list[str]]]:
    """:func:`_scan` for a dataset with strings Lance refuses to decode (invalid UTF-8
    written by another tool): each string column that fails is read in chunks by position,
    and a chunk that fails is halved down to the single rows that hold the bad bytes.

    Returns:
        ``(meta, vectors, rowaddr, bad)`` as :func:`_scan`, filtered by ``flt`` after the
        read, and ``bad``: ``{position: [columns]}`` of the rows whose strings could not be
        decoded (their cells hold a placeholder: ``""``, or for ``id`` the row's position,
        so the caller refuses them by record).

    Raises:
        OSError, pyarrow.ArrowException: a read fails for another reason than the strings.
    """
    names = ds.schema.names
    strings = [f.name for f in ds.schema if _string_field(f.type)]
    base = ds.to_table(columns=[c for c in names if c not in strings], with_row_address=True)
    n = base.num_rows
    bad: dict[int, list[str]] = {}
    cols: dict[str, pa.Array | pa.ChunkedArray] = {}
    for c in strings:
        try:
            cols[c] = ds.to_table(columns=[c]).column(c)
            continue
        except Exception as e:  # noqa: BLE001 - only UTF-8 failures are looked into
            if not _is_utf8_error(e):
                raise
        ftype = ds.schema.field(c).type
        values: list[Any] = [None] * n
        todo = [(lo, min(lo + _UTF8_CHUNK, n)) for lo in range(0, n, _UTF8_CHUNK)]
        while todo:
            lo, hi = todo.pop()
            try:
                values[lo:hi] = ds.take(list(range(lo, hi)), columns=[c]).column(c).to_pylist()
            except Exception as e:  # noqa: BLE001
                if not _is_utf8_error(e):
                    raise
                if hi - lo == 1:
                    bad.setdefault(lo, []).append(c)
                    values[lo] = (
                        f"<row {lo}: not UTF-8>"
                        if c == "id"
                        else (
                            []
                            if pa.types.is_list(ftype) or pa.types.is_large_list(ftype)
                            else "\ufffd"
                        )
                    )
                else:
                    mid = (lo + hi) // 2
                    todo += [(lo, mid), (mid, hi)]
        cols[c] = pa.array(values, ftype)
    addr = base.column("_rowaddr").to_numpy()
    vtype = ds.schema.field("vector").type
    if _variable_width(vtype) and SCALE_COLUMN not in names:
        vecs, widths = _decode_variable(base.column("vector"), dim)
        wrong = np.flatnonzero(widths != dim)
        widths_out.update(zip(wrong.tolist(), widths[wrong].tolist(), strict=True))
    elif pa.types.is_fixed_size_list(vtype) and vtype.list_size == dim:
        vecs = decode_vectors(
            base.column("vector"), base.column(SCALE_COLUMN) if SCALE_COLUMN in names else None
        )
    else:
        raise ValueError(f"the vector column is {vtype}, not {dim} wide")
    vcols = {"vector", SCALE_COLUMN, "_rowaddr"}
    meta = pa.table({c: cols[c] if c in cols else base.column(c) for c in names if c not in vcols})
    if flt is not None:
        where = pa.table({"_pos": pa.array(np.arange(n)), "namespace": meta.column("namespace")})
        mask = np.asarray(where.filter(flt).column("_pos").to_numpy(), np.int64)
        remap = {int(p): k for k, p in enumerate(mask)}
        bad = {remap[p]: c for p, c in bad.items() if p in remap}
        moved = {remap[p]: w for p, w in widths_out.items() if p in remap}
        widths_out.clear()
        widths_out.update(moved)
        meta, vecs, addr = meta.take(pa.array(mask)), vecs[mask], addr[mask]
    return meta, vecs, addr, bad


def _row_problems(
    meta: pa.Table, widths: Mapping[int, int], bad: Mapping[int, list[str]], dim: int
) -> list[Problem]:
    """One :class:`Problem` per wrong vector width and per column of undecodable strings,
    naming the rows (positions in ``meta``) and their ids."""
    if not widths and not bad:
        return []
    ids = meta.column("id").to_pylist()
    groups: dict[str, list[int]] = {}
    for pos, w in sorted(widths.items()):
        what = "a null vector" if w < 0 else f"a vector of {w} components"
        groups.setdefault(f"{what}, the store's dim is {dim}", []).append(pos)
    for pos, cs in sorted(bad.items()):
        for c in cs:
            groups.setdefault(f"{c} is not valid UTF-8", []).append(pos)
    return [Problem(k, rows, [str(ids[r]) for r in rows]) for k, rows in groups.items()]


def _lance() -> Any:
    try:
        import lance
    except ImportError as e:  # pragma: no cover - pylance is a dependency
        raise ImportError("the Lance store needs pylance (pip install pylance)") from e
    return lance


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


class LanceStore(StoreBase):
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

    def __init__(
        self, root: str | os.PathLike, *, retention_h: float = 7 * 24, **kwargs: Any
    ) -> None:
        super().__init__(root, **kwargs)
        if not retention_h >= 0:
            raise ValueError(f"retention_h must be >= 0, got {retention_h!r}")
        self.retention_h = float(retention_h)

    def options(self) -> dict[str, Any]:
        """The constructor settings of this handle (with ``retention_h``)."""
        return {**super().options(), "retention_h": self.retention_h}

    def namespaces(self) -> set[str]:
        """Every namespace of the store, live or not: one column of the newest version."""
        t = self._open().to_table(columns=["namespace"])
        return set(t.column("namespace").unique().to_pylist())

    def maintain(self) -> dict[str, Any] | None:
        """:meth:`cleanup` (compaction, old versions), under :meth:`lock`."""
        return self.cleanup()

    # ------------------------------------------------------------ marker and dataset
    @property
    def dataset_path(self) -> Path:
        return self.root / DATASET

    def _marker(self) -> dict[str, Any]:
        try:
            text = self.pointer_path.read_text()
        except FileNotFoundError:
            raise StoreNotFoundError(f"no store at {self.root} (missing {POINTER})") from None
        except NotADirectoryError:
            raise StoreNotFoundError(f"{self.root} is not a directory") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CorruptStoreError(f"{self.pointer_path} cannot be read: {e}") from None
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.get("format") != FORMAT:
                raise ValueError("not a Lance store marker")
            if d.get("dataset") != DATASET:
                raise ValueError(f"dataset {d.get('dataset')!r} is not {DATASET!r}")
            dim = d.get("dim")
            if not (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 1):
                raise ValueError(f"dim {dim!r} is not a positive integer")
            return d
        except ValueError as e:
            raise CorruptStoreError(
                f"{self.pointer_path} is not a valid Lance store marker "
                f"({e}); the dataset {self.dataset_path} is untouched"
            ) from None

    def _open(self, version: int | None = None) -> Any:
        """The dataset at ``version`` (default: the newest), after its manifest was checked
        against the CRC32 recorded for it (:meth:`_check_manifest`).

        Raises:
            CorruptStoreError: the manifest differs from its CRC32, the version is not
                retained, or Lance cannot open it (a panic inside Lance included); the
                message names the dataset and the version."""
        lance = _lance()
        newest = self._check_manifest(version)
        try:
            with _lance_errors(self.dataset_path, version):
                ds = lance.dataset(str(self.dataset_path))
                if version is None and newest is not None and ds.version < newest:
                    # Lance found its newest version by a hint file or a listing that
                    # disagrees with the manifests on disk: never read an older version
                    raise CorruptStoreError(
                        f"{self.dataset_path}: Lance opened version {ds.version}, but the "
                        f"newest manifest on disk is of version {newest} "
                        f"(_versions/latest_version_hint.json damaged?); nothing read"
                    )
                return ds if version is None else ds.checkout_version(int(version))
        except (OSError, ValueError, RuntimeError) as e:
            if version is not None and "not found" in str(e).lower():
                raise CorruptStoreError(
                    f"version {version} of {self.dataset_path} is not retained (removed by "
                    f"cleanup after store.retention_h, or never written); "
                    f"`consolidate-versions` lists the versions kept"
                ) from e
            raise CorruptStoreError(
                f"cannot open the Lance dataset {self.dataset_path}"
                f"{'' if version is None else f' at version {version}'}: "
                f"{e}"
            ) from e

    def _manifests(self) -> dict[int, str]:
        """``{version: manifest path under the dataset folder}`` of the manifests on disk
        (Lance's names: ``_versions/<2^64-1-version>.manifest``, or ``<version>.manifest``
        in its first naming scheme); read without opening the dataset."""
        out: dict[int, str] = {}
        d = self.dataset_path / "_versions"
        for p in d.glob("*.manifest") if d.is_dir() else ():
            if p.stem.isdigit():
                n = int(p.stem)
                out[(1 << 64) - 1 - n if n >= 1 << 63 else n] = f"_versions/{p.name}"
        return out

    def _check_manifest(
        self, version: int | None, known: Mapping[str, int] | None = None
    ) -> int | None:
        """Check the manifest Lance will read for ``version`` (default: the newest on disk)
        and that version's transaction files against the CRC32s recorded for them (files
        written before they were recorded, or by another tool, are not checked). Returns
        the newest version that has a manifest on disk (``None``: none).

        ``known``: the recorded CRC32s (:meth:`_checksums`), if read already.

        Raises:
            CorruptStoreError: a file differs from its CRC32 (names it and the version)."""
        if known is None:
            known, _ = self._checksums()
        manifests = self._manifests()
        if not known or not manifests:
            return max(manifests, default=None)
        v = max(manifests) if version is None else int(version)
        paths = [manifests[v]] if v in manifests else []
        paths += [
            f"_transactions/{p.name}"
            for p in (self.dataset_path / "_transactions").glob(f"{v - 1}-*.txn")
        ]
        for rel in paths:
            if rel in known and _crc32(self.dataset_path / rel) != known[rel]:
                kind = "manifest" if rel.endswith(".manifest") else "transaction file"
                raise CorruptStoreError(
                    f"{self.dataset_path / rel} ({kind} of version {v}) does not match the "
                    f"CRC32 recorded when it was written "
                    f"(a flipped bit, a partial copy): nothing read; restore it from a backup"
                )
        return max(manifests)

    def _props(self, ds: Any) -> dict[str, str]:
        """consolidate's properties of ``ds``'s version, or of the newest older version that
        has them (Lance's own commits, such as compaction, carry none).

        Raises:
            CorruptStoreError: none within :data:`_MAX_LOOKBACK` versions.
        """
        v = ds.version
        known: Mapping[str, int] | None = None
        for _ in range(_MAX_LOOKBACK):
            if v < 1:
                break
            if v != ds.version:  # the older version's transaction file
                if known is None:
                    known, _ = self._checksums()
                self._check_manifest(v, known)
            props = _txn_props(ds, v)
            if _P + "folded" in props:
                return props
            v -= 1
        raise CorruptStoreError(
            f"{self.dataset_path}: no version at or before {ds.version} carries consolidate's "
            f"properties (within {_MAX_LOOKBACK} versions); the dataset was written by "
            f"another tool"
        )

    @staticmethod
    def _folded(props: Mapping[str, str]) -> tuple[str, ...]:
        try:
            names = json.loads(props.get(_P + "folded", "[]"))
            if not (
                isinstance(names, list)
                and all(
                    _plain_name(n) and n.endswith((".touch.json", ".patch.json")) for n in names
                )
            ):
                raise ValueError
        except ValueError:
            # a crafted name must not make a commit delete a file outside deltas/
            raise CorruptStoreError(
                "consolidate.folded is not a JSON list of delta file names"
            ) from None
        return tuple(names)

    @staticmethod
    def _vector_dtype(schema: pa.Schema) -> str:
        t = schema.field("vector").type
        if "vector_scale" in schema.names:
            return "int8"
        v = t.value_type
        return {pa.float32(): "fp32", pa.float16(): "fp16", pa.uint16(): "bf16"}[v]

    # ------------------------------------------------------------ checksums
    def _tracked(self, ds: Any, kinds: Sequence[str], since: int | None = None) -> list[str]:
        """The files of the ``kinds`` Lance tracks (``"data file"``, ``"deletion file"``,
        ``"manifest"``, ``"transaction file"``, ``"index file"``) for ``ds``'s version (with
        ``since``: for every version from ``since`` to it), as sorted paths under the
        dataset folder.

        Raises:
            CorruptStoreError: a path that leaves the dataset folder.
        """
        lo = ds.version if since is None else since
        t = ds.tracked_files(min_version=lo).read_all().to_pandas()
        t = t[t["version"].between(lo, ds.version) & t["type"].astype(str).isin(list(kinds))]
        root = self.dataset_path.resolve()
        out = []
        for p in sorted(set(t["path"].astype(str))):
            full = (root / p).resolve()
            if root not in full.parents:
                raise CorruptStoreError(
                    f"{self.dataset_path} (version {ds.version}) names "
                    f"a file outside its folder: {p!r}"
                )
            out.append(p)
        return out

    def _files(self, ds: Any) -> list[str]:
        """Data and deletion files of ``ds``'s version, as paths under the dataset folder.

        Raises:
            CorruptStoreError: a path that leaves the dataset folder.
        """
        return self._tracked(ds, ("data file", "deletion file"))

    def _checksums(self) -> tuple[dict[str, int], dict[str, str]]:
        """``(files, versions)`` from :data:`CHECKSUMS`: the CRC32 of each data and
        deletion file (path under the dataset folder) and the content digest of each
        version (:func:`_digest`). A file of the first layout (a map of files only) reads
        with no digests.

        Raises:
            CorruptStoreError: the file cannot be read or is not of that form."""
        path = self.root / CHECKSUMS
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            if self._keeps_checksums():
                raise CorruptStoreError(
                    f"{path} is missing, and {self.pointer_path} records that this store keeps "
                    f"checksums: nothing read (without it no file could be checked); restore "
                    f"it from the same backup as {DATASET}"
                ) from None
            return {}, {}
        except (OSError, ValueError) as e:
            raise CorruptStoreError(
                f"{path} cannot be read ({e}); move it aside to load "
                f"without checking the data files"
            ) from None
        files, versions = d, {}
        if isinstance(d, dict) and set(d) == {"files", "versions"}:
            files, versions = d["files"], d["versions"]
        if not (
            isinstance(files, dict)
            and all(
                isinstance(k, str)
                and not k.startswith("/")
                and ".." not in k.split("/")
                and isinstance(v, int)
                and not isinstance(v, bool)
                for k, v in files.items()
            )
            and isinstance(versions, dict)
            and all(
                isinstance(k, str) and k.isdigit() and isinstance(v, str)
                for k, v in versions.items()
            )
        ):
            raise CorruptStoreError(
                f"{path} is not a map of file names (under "
                f"{DATASET}) to CRC32 values and of versions to "
                f"digests; move it aside to load without checking the "
                f"data files"
            )
        return files, versions

    def _keeps_checksums(self) -> bool:
        """Whether ``CURRENT`` records that :data:`CHECKSUMS` exists (every store created
        or committed to since the marker recorded it); ``False`` while the store is being
        created."""
        try:
            d = json.loads(self.pointer_path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(d, dict) and d.get("checksums") is True

    def _check_present(self, ds: Any) -> list[str]:
        """The data and deletion files of ``ds``'s version, all present on disk.

        Raises:
            CorruptStoreError: one is missing (nothing is written on a damaged store).
        """
        files = self._files(ds)
        missing = [p for p in files if not (self.dataset_path / p).is_file()]
        if missing:
            raise CorruptStoreError(
                f"{self.dataset_path} (version {ds.version}) is missing {missing[:3]}: "
                f"nothing written; restore the files from a backup or roll back to a version "
                f"without them"
            )
        return files

    def _record_checksums(self, ds: Any, *, prune: bool = False) -> None:
        """Checksum the files of ``ds``'s version not yet recorded, record the version's
        content digest, and forget files that are neither in it nor on disk; with
        ``prune`` (after versions were removed), also the digests of versions no longer
        kept (listing the versions reads every manifest: not at every append). Hold
        ``WRITERS.LOCK`` (or the store is being created).

        Raises:
            CorruptStoreError: a file of the version is missing.
        """
        for tmp in self.root.glob(f".{CHECKSUMS}.tmp-*"):  # left by a killed write; we
            tmp.unlink(missing_ok=True)  # hold WRITERS.LOCK, so none is being written now
        known, versions = self._checksums()
        files = self._check_present(ds)
        since = max((int(v) for v in versions), default=0) + 1
        meta_files = self._meta_files(ds, since=min(since, ds.version))
        known.update(
            {p: _crc32(self.dataset_path / p) for p in files + meta_files if p not in known}
        )
        current = set(files) | set(meta_files)
        for p in [p for p in known if p not in current and not (self.dataset_path / p).exists()]:
            del known[p]
        versions[str(ds.version)] = _digest(files, known)
        if prune:
            kept = {str(v["version"]) for v in ds.versions()}
            versions = {k: v for k, v in versions.items() if k in kept}
        _write_atomic(
            self.root / CHECKSUMS,
            lambda f: f.write_text(json.dumps({"files": known, "versions": versions})),
            crash_tag="checksums",
        )
        if self.pointer_path.exists() and not self._keeps_checksums():
            marker = {**self._marker(), "checksums": True}  # a store of an older layout
            _write_atomic(self.pointer_path, lambda p: p.write_text(json.dumps(marker)))

    def _meta_files(self, ds: Any, since: int | None = None) -> list[str]:
        """The manifest, transaction and index files of ``ds``'s version (with ``since``:
        of every version from ``since`` to it, such as the index versions a create writes
        after its data) that are on disk, as paths under the dataset folder (Lance reads
        them beside the data files).

        Raises:
            CorruptStoreError: a path that leaves the dataset folder."""
        kinds = ("manifest", "transaction file", "index file")
        return [p for p in self._tracked(ds, kinds, since) if (self.dataset_path / p).is_file()]

    def verify(
        self,
        version: int | None = None,
        *,
        fragments: Iterable[int] | None = None,
        meta: bool = False,
    ) -> dict[str, Any]:
        """Check a version (default: the newest) against what was recorded when it was
        written: its list of data and deletion files and their CRC32s against the
        version's content digest (so a fragment dropped from or added to the version is
        found), then the CRC32 of each file read back.

        Args:
            fragments: read back only the files of these fragment ids (a load of some
                namespaces checks the fragments that hold its rows); the digest still
                covers every file of the version.
            meta: with ``fragments=None``, the version's manifest, transaction and index
                files too (the manifest and transaction files of the version a load reads
                are checked when it is opened, :meth:`_check_manifest`).

        Returns:
            ``{"files", "checked", "unrecorded", "digest"}``: files read back and matched,
            files with no recorded checksum (written by another tool, or by a write that
            crashed before it recorded them: not checked), and whether the version's
            digest was recorded and matched (``False``: none recorded).

        Raises:
            CorruptStoreError: the files differ from the digest, or a file from its
                checksum, or is missing (names the file and the version).
        """
        ds = self._open(version)
        known, versions = self._checksums()
        files = self._files(ds)
        newest = max((int(v) for v in versions), default=0)
        on_disk = max(self._manifests(), default=0)
        if newest > on_disk:  # digests are recorded after their commit
            raise CorruptStoreError(
                f"{self.dataset_path}: version {newest} was written, but the dataset's newest "
                f"version is {on_disk} (its newest versions were lost or an "
                f"older copy of the dataset was put in place): restore the dataset folder "
                f"from the same backup as {CHECKSUMS}"
            )
        want = versions.get(str(ds.version))
        if want is not None and _digest(files, known) != want:
            raise CorruptStoreError(
                f"{self.dataset_path} (version {ds.version}) does not hold the files it held "
                f"when it was written (a data or deletion file added, dropped or replaced): "
                f"roll back to an earlier version, or restore the dataset from a backup"
            )
        read = files
        if fragments is not None:
            sel = set(fragments)
            mine: set[str] = set()
            for f in ds.get_fragments():  # one step per fragment
                if f.fragment_id in sel:
                    mine.update("data/" + d.path for d in f.data_files())
                    if f.deletion_file():
                        mine.add(f.deletion_file())
            read = [p for p in files if p in mine]
        elif meta:  # the version's manifest, transaction and index files too
            read = files + self._meta_files(ds)
        checked = 0
        for p in read:
            if p not in known:
                continue
            try:
                got = _crc32(self.dataset_path / p)
            except FileNotFoundError:
                raise CorruptStoreError(
                    f"{self.dataset_path / p} of version {ds.version} is missing"
                ) from None
            if got != known[p]:
                raise CorruptStoreError(
                    f"{self.dataset_path / p} of version {ds.version} does not match the "
                    f"CRC32 recorded when it was written (a flipped bit, a partial copy): "
                    + (
                        "an index (derived data): `consolidate-versions action=reindex` rebuilds it"
                        if p.startswith("_indices/")
                        else "restore it from a backup, or roll back to a version without it"
                    )
                )
            checked += 1
        return {
            "files": len(read),
            "checked": checked,
            "unrecorded": sum(p not in known for p in read),
            "digest": want is not None,
        }

    def verify_all(self) -> list[dict[str, Any]]:
        """:meth:`verify` every retained version, oldest first: every data, deletion,
        manifest, transaction and index file each one lists.

        Returns:
            One ``{"version", "files", "checked", "unrecorded", "digest"}`` or ``{"version",
            "error"}`` (the one-line message of the damage found) per version.

        Raises:
            CorruptStoreError: the dataset cannot be opened at all, or
                :data:`CHECKSUMS` cannot be read."""
        self._checksums()
        out: list[dict[str, Any]] = []
        for v in sorted(int(x["version"]) for x in self._open().versions()):
            try:
                out.append({"version": v, **self.verify(v, meta=True)})
            except CorruptStoreError as e:
                out.append({"version": v, "error": str(e)})
        return out

    def verify_in_thread(
        self, version: int, fragments: Iterable[int] | None = None
    ) -> tuple[threading.Thread, dict[str, Any]]:
        """Start :meth:`verify` of ``version`` (of ``fragments``) in a thread (CRC32
        releases the GIL, so it runs while Lance reads the same files). Returns ``(thread,
        result)``: after ``thread.join()``, ``result["error"]`` holds the exception it
        raised, if any."""
        check: dict[str, Any] = {}
        fragments = None if fragments is None else list(fragments)

        def run() -> None:
            try:
                check["out"] = self.verify(version, fragments=fragments)
            except BaseException as e:  # noqa: BLE001 - the caller re-raises it
                check["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread, check

    def head(self) -> Pointer:
        """The newest version as a :class:`~consolidate.store.store.Pointer` (``snapshot`` is
        the dataset's name, ``rows`` its row count)."""
        d = self._marker()
        ds = self._open()
        props = self._props(ds)
        lp = props.get(_P + "last_pass_at")
        return Pointer(
            ds.version,
            DATASET,
            props.get(_P + "changelog"),
            d["dim"],
            self._folded(props),
            float(d.get("created_at", 0.0)),
            float(lp) if lp else None,
            self._vector_dtype(ds.schema),
            None,
            ds.count_rows(),
        )

    def snapshots(self) -> list[int]:
        """Lance versions present (retained history), ascending."""
        return sorted(int(v["version"]) for v in self._open().versions())

    def versions(self) -> list[dict[str, Any]]:
        """Every retained version: ``version``, ``timestamp`` (UTC), ``op`` (create, append,
        pass, undo, convert; ``None`` for Lance's own commits such as compaction), ``rows``
        and ``changelog`` (the file under ``changelogs/`` for a pass or an undo)."""
        ds = self._open()
        out = []
        for v in ds.versions():
            props = _txn_props(ds, v["version"])
            out.append(
                {
                    "version": int(v["version"]),
                    "timestamp": v["timestamp"],
                    "op": props.get(_P + "op"),
                    "rows": int(v.get("metadata", {}).get("total_rows", -1)),
                    "changelog": props.get(_P + "changelog")
                    if props.get(_P + "op") in _LOGGED
                    else None,
                    "summary": json.loads(props.get(_P + "summary") or "{}")
                    if props.get(_P + "op") in _LOGGED
                    else {},
                }
            )
        return out

    # ------------------------------------------------------------ history
    def read_version(self, version: int) -> Records:
        """The records as stored at ``version`` (no pending deltas), validated.

        Raises:
            CorruptStoreError: the version is not retained or cannot be read.
            InvalidRecordsError: a stored record is invalid.
        """
        marker = self._marker()
        ds = self._open(version)
        self.verify(version)
        recs = records_from_arrow(ds.to_table(), dim=marker["dim"])
        return self._checked(
            recs,
            dim=marker["dim"],
            source=f"{self.dataset_path} (version {version})",
            existing=None,
            reading=True,
        )

    def diff(self, a: int, b: int | None = None) -> pd.DataFrame:
        """What changed from version ``a`` to ``b`` (default: the newest), per namespace.

        Returns:
            One row per namespace (plus ``"(all)"``) and one count column per kind:
            ``added`` (new ids: appended, merged or reflection rows), ``purged`` (ids
            gone), ``merged``, ``dropped`` (floor or cap), ``deleted``, ``updated``,
            ``superseded``, ``undone`` (live at ``a``, a tombstone with that reason at ``b``),
            ``restored`` (a tombstone at ``a``, live at ``b``), ``closed`` (validity ended),
            ``touched`` (only ``last_used``/``strength`` changed).

        Raises:
            CorruptStoreError: a version is not retained.
        """
        cols = [
            "id",
            "namespace",
            "deleted_at",
            "deleted_reason",
            "valid_to",
            "last_used",
            "strength",
        ]
        ta = self._open(a).to_table(columns=cols).to_pandas()
        tb = self._open(b).to_table(columns=cols).to_pandas()
        j = ta.merge(tb, on="id", how="outer", suffixes=("_a", "_b"), indicator=True)
        ns = j["namespace_b"].where(j["namespace_b"].notna(), j["namespace_a"])
        live_a = j["deleted_at_a"].isna() & (j["_merge"] != "right_only")
        live_b = j["deleted_at_b"].isna() & (j["_merge"] != "left_only")
        both = j["_merge"] == "both"
        kind = pd.Series(np.full(len(j), None, dtype=object), index=j.index)
        kind[j["_merge"] == "right_only"] = "added"
        kind[j["_merge"] == "left_only"] = "purged"
        gone = both & live_a & ~live_b
        for why in ("merged", "deleted", "updated", "superseded", "undone"):
            kind[gone & (j["deleted_reason_b"] == why)] = why
        kind[gone & j["deleted_reason_b"].isin(["floor", "cap"])] = "dropped"
        kind[both & ~live_a & live_b] = "restored"
        closed = both & j["valid_to_a"].isna() & j["valid_to_b"].notna()
        kind[kind.isna() & closed] = "closed"
        touched = both & (
            (j["last_used_a"] != j["last_used_b"]) | (j["strength_a"] != j["strength_b"])
        )
        kind[kind.isna() & touched] = "touched"
        kinds = [
            "added",
            "purged",
            "merged",
            "dropped",
            "deleted",
            "updated",
            "superseded",
            "undone",
            "restored",
            "closed",
            "touched",
        ]
        t = pd.crosstab(ns[kind.notna()], kind[kind.notna()]).reindex(columns=kinds, fill_value=0)
        t.loc["(all)"] = t.sum()
        t.index.name = "namespace"
        return t.astype(int)

    def _created_by_passes(self, after: int) -> set[str]:
        """Ids of the rows that passes (merges, exact merges, reflections) committed in
        versions newer than ``after``, read from their changelogs.

        Raises:
            CorruptStoreError: a pass version's changelog is missing.
        """
        made: set[str] = set()
        for v in self.versions():
            if v["version"] <= after or v["op"] not in ("pass", "undo", "rollback"):
                continue
            name = v["changelog"]
            if not _plain_name(name):
                raise CorruptStoreError(
                    f"version {v['version']} names the changelog "
                    f"{name!r}, not a file name in changelogs/"
                )
            path = self.root / "changelogs" / name
            if not path.is_file():
                raise CorruptStoreError(
                    f"the changelog of version {v['version']} "
                    f"({path}) is missing: cannot tell its rows apart"
                )
            for line in path.read_text().splitlines():
                e = json.loads(line)
                if e.get("op") in ("merge", "exact_merge", "reflect") and isinstance(
                    e.get("id"), str
                ):
                    made.add(e["id"])
        return made

    def rollback(
        self, version: int, *, dry_run: bool = False, lock_timeout_s: float = 0.0
    ) -> dict[str, Any]:
        """Make version ``version``'s records current again, as a new version (history is
        kept). Records appended since then are kept (revived if a later pass merged or
        dropped them); rows that later passes made (merges, reflections) are left out;
        pending deltas are applied again. Recall bookkeeping and write-path patches folded
        after ``version`` into its rows are not replayed.

        Returns:
            the commit info (see :meth:`commit`) plus ``"diff"``: :meth:`diff` from the
            newest version to the result, as ``{namespace: {kind: count}}`` (with
            ``dry_run`` nothing is written).

        Raises:
            CorruptStoreError: ``version`` is not retained, or a later pass's changelog is
                missing.
            LockTimeoutError: another pass holds the store.
        """
        with self.lock(timeout_s=lock_timeout_s):
            snap = self.load()
            if not 1 <= int(version) <= snap.version:
                raise ValueError(f"rollback: version {version} is not in 1..{snap.version}")
            old = self.read_version(version)
            made = self._created_by_passes(version)
            cur = snap.records
            old_ids = set(old.meta["id"])
            keep = ~cur.meta["id"].isin(old_ids) & ~cur.meta["id"].isin(made)
            app = cur.mask(keep.to_numpy())
            m = app.meta.copy()
            revive = m["deleted_reason"].isin(["merged", "floor", "cap"]).to_numpy()
            m.loc[revive, "deleted_at"] = np.nan
            m.loc[revive, "deleted_reason"] = None
            m.loc[revive, "merged_into"] = None
            out = Records.concat([old, Records(m, app.vectors)], snap.dim)
            for name in snap.deltas:
                out, _ = self._apply_delta(out, name, snap.dim)
            events = [
                {
                    "op": "rollback",
                    "to_version": int(version),
                    "kept_appended": m["id"].tolist(),
                    "revived": m["id"][revive].tolist(),
                }
            ]
            info = self.commit(out, events, base=snap, dry_run=dry_run, op="rollback")
        if not dry_run:
            info["diff"] = self.diff(snap.version, info["version"]).to_dict(orient="index")
        return info

    def restore(self, ids: Sequence[str], *, lock_timeout_s: float = 0.0) -> dict[str, Any]:
        """Make tombstones live again, as a new version: each id's ``deleted_at``,
        ``deleted_reason`` and ``merged_into`` are cleared. A restored member of a merge
        stays apart from the merged record (``keep_apart``), which is kept.

        Raises:
            KeyError: an unknown id (nothing written).
            ValueError: an id is live already (nothing written).
        """
        if isinstance(ids, str):
            raise TypeError("restore() takes a list of ids, not one string")
        with self.lock(timeout_s=lock_timeout_s):
            snap = self.load()
            m = snap.records.meta.copy()
            pos = pd.Index(m["id"]).get_indexer(list(ids))
            if (pos < 0).any():
                raise KeyError(
                    f"restore: unknown id(s) in {self.root}: "
                    f"{[i for i, p in zip(ids, pos, strict=True) if p < 0][:5]}"
                )
            live = m["deleted_at"].isna().to_numpy()[pos]
            if live.any():
                raise ValueError(
                    f"restore: {[ids[int(k)] for k in np.flatnonzero(live)][:5]} are live already"
                )
            into = m["merged_into"].to_numpy(object)[pos]
            ka = m["keep_apart"].copy()
            for k, p in enumerate(pos):
                if isinstance(into[k], str):
                    ka.iat[p] = sorted(set(ka.iat[p]) | {into[k]})
            m["keep_apart"] = ka
            m.loc[pos, "deleted_at"] = np.nan
            m.loc[pos, "deleted_reason"] = None
            m.loc[pos, "merged_into"] = None
            events = [
                {
                    "op": "restore",
                    "ids": list(ids),
                    "were_merged_into": [x if isinstance(x, str) else None for x in into],
                }
            ]
            return self.commit(Records(m, snap.records.vectors), events, base=snap, op="restore")

    def export(self, path: str | os.PathLike, version: int | None = None) -> dict[str, Any]:
        """Write one version's records (default: the newest, pending deltas included) to
        ``path``: ``.parquet`` (the store's Arrow schema, vectors in the stored dtype),
        ``.jsonl`` (one JSON object a line; times ISO 8601 UTC, vectors as float lists) or
        ``.csv`` (as JSONL, with vectors and lists of ids as JSON arrays in their cells).
        Written to a temporary file and renamed. ``consolidate-import file=PATH`` reads
        each back as it was (:mod:`consolidate.sources.files`).

        Raises:
            ValueError: another suffix. CorruptStoreError: the version is not retained.
        """
        path = Path(path)
        if path.suffix not in (".parquet", ".jsonl", ".csv"):
            raise ValueError(f"export: {path} must end in .parquet, .jsonl or .csv")
        if version is None:
            snap = self.load()
            recs, version = snap.records, snap.version
        else:
            recs = self.read_version(version)
        write_records_file(recs, path, self._vector_dtype(self._open(version).schema))
        return {"path": str(path), "version": int(version), "records": len(recs)}

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

    # ------------------------------------------------------------ read
    def load(
        self, *, validate_records: bool = True, namespaces: Sequence[str] | None = None
    ) -> Snapshot:
        """Read the newest version and replay the pending deltas.

        Args:
            validate_records: validate the stored records and the deltas.
            namespaces: read only these namespaces (a filtered scan; an incremental pass
                reads what fired). A delta that names an id outside them is neither applied
                nor folded by a commit of this snapshot: it stays pending for the next load.

        Raises:
            StoreNotFoundError: no store here.
            CorruptStoreError: the dataset or its properties cannot be read.
            InvalidRecordsError: a stored record or a delta is invalid (names the dataset
                version or the delta file and the record ids); in quarantine mode the bad
                rows are moved to ``quarantine/`` instead.

        A read that lists a delta file which a pass then folds and removes is repeated (up
        to 5 times).
        """
        for attempt in range(5):
            try:
                return self._load(validate_records=validate_records, namespaces=namespaces)
            except CorruptStoreError as e:
                if not isinstance(e.__cause__, FileNotFoundError) or attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def _load(
        self, *, validate_records: bool = True, namespaces: Sequence[str] | None = None
    ) -> Snapshot:
        """The body of :meth:`load` (one attempt)."""
        marker = self._marker()
        listed = self._listed()  # before the version is opened: see the module docstring
        ds = self._open()
        props = self._props(ds)
        source = f"{self.dataset_path} (version {ds.version})"
        # the data files' checksums are checked before Lance decodes them (a damaged data
        # file can make Lance abort the process, which no handler catches): all files for
        # a whole load, first; for some namespaces, the files of the fragments that hold
        # their rows, once the first scan (of the other columns, through the namespace
        # index) found them, before the vectors are read
        if validate_records and namespaces is None:
            self.verify(ds.version)

        def found(addr: np.ndarray) -> None:
            if validate_records and namespaces is not None:
                self.verify(ds.version, fragments=np.unique(addr >> np.uint64(32)).tolist())

        flt = None
        if namespaces is not None:
            namespaces = sorted({str(n) for n in namespaces})
            flt = pc.field("namespace").isin(pa.array(namespaces, pa.string()))
            source += f", namespaces {namespaces[:3]}{'...' if len(namespaces) > 3 else ''}"
        widths: dict[int, int] = {}  # rows of a variable-width vector column not dim wide
        bad_strings: dict[int, list[str]] = {}
        try:
            with _lance_errors(self.dataset_path, ds.version):
                try:
                    scanned: list[tuple[pa.Table, np.ndarray | None, np.ndarray | None]] = [
                        _scan(ds, flt, marker["dim"], found, widths)
                    ]
                except (OSError, ValueError, pa.ArrowException) as e:
                    if not _is_utf8_error(e):
                        raise
                    # strings Lance cannot decode: found row by row, refused by record
                    if validate_records and namespaces is not None:
                        self.verify(ds.version)
                    widths.clear()
                    meta, vecs, addr, bad_strings = _scan_past_bad_strings(
                        ds, flt, marker["dim"], widths
                    )
                    scanned = [(meta, vecs, addr)]
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
            raise CorruptStoreError(f"cannot read {source}: {e}") from e
        extra = _row_problems(scanned[0][0], widths, bad_strings, marker["dim"])
        if extra and not validate_records:
            raise CorruptStoreError(
                f"cannot read {source}: " + "; ".join(p.describe() for p in extra)
            )
        return self._rows_snapshot(
            scanned,
            version=ds.version,
            dim=marker["dim"],
            props=props,
            deltas=listed,
            validate_records=validate_records,
            source=source,
            namespaces=namespaces,
            extra=extra,
        )

    def _rows_snapshot(
        self,
        scanned: list[tuple[pa.Table, np.ndarray | None, np.ndarray | None]],
        *,
        version: int,
        dim: int,
        props: Mapping[str, str],
        deltas: Sequence[str],
        validate_records: bool,
        source: str,
        namespaces: Sequence[str] | None,
        apply_all: bool = False,
        extra: Sequence[Problem] = (),
    ) -> Snapshot:
        """A :class:`Snapshot` of stored rows read from version ``version``: decoded,
        validated, with those of ``deltas`` applied that are not folded as of that version
        and (``namespaces`` not ``None``, unless ``apply_all``) whose replay reads only rows
        read (:meth:`_covers`).

        ``scanned`` is a one-item list ``[(table, vectors, rowaddr)]``: the stored rows
        (all columns; or, with ``vectors`` and ``rowaddr`` given, the other columns as
        :func:`_scan` returns them); it is emptied, so the Arrow table is freed as soon as
        it is decoded."""
        table, vectors, rowaddr = scanned.pop()
        try:
            # text_hash as written by this store (create and append compute it from the
            # text, nothing else writes the dataset): not recomputed at every load
            recs = records_from_arrow(table, dim=dim, stored_hashes=True, vectors=vectors)
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
            raise CorruptStoreError(f"cannot read {source}: {e}") from e
        # the stored rows as read, compared by commit: the ids (Arrow), the decoded table
        # (a copy-on-write view), the vectors (read-only)
        recs.vectors.setflags(write=False)
        recs.origin = np.arange(len(recs), dtype=np.int64)
        stored = _Stored(table.column("id"), recs.meta.copy(deep=False), recs.vectors, rowaddr)
        del table
        if validate_records:
            # rows moved to quarantine stay in ``stored``: the next commit deletes them
            recs = self._checked(
                recs, dim=dim, source=source, existing=None, reading=True, extra=extra
            )
        folded = set(self._folded(props))
        applied = []
        known = None if namespaces is None or apply_all else set(recs.meta["id"])
        into = self._into(recs) if known is not None else {}
        for name in deltas:
            if name in folded or not self._covers(known, name, into):
                continue
            recs, _ = self._apply_delta(recs, name, dim, validate_records)
            applied.append(name)
        lp = props.get(_P + "last_pass_at")
        return Snapshot(
            version,
            recs,
            dim,
            tuple(applied),
            [],
            self.dataset_path,
            float(lp) if lp else None,
            stored=stored,
            namespaces=None if namespaces is None else list(namespaces),
        )

    @staticmethod
    def _into(recs: Records) -> dict[str, str]:
        """``{id: merged_into}`` of the rows of ``recs`` merged into another."""
        mi = recs.meta["merged_into"]
        sel = mi.notna().to_numpy()
        return dict(
            zip(
                recs.meta["id"].to_numpy(object)[sel].tolist(),
                mi.to_numpy(object)[sel].tolist(),
                strict=True,
            )
        )

    def _covers(self, known: set[str] | None, name: str, into: Mapping[str, str]) -> bool:
        """Every record a delta's replay reads is in ``known`` (``None``: the whole store is
        loaded): the ids it names and the records their ``merged_into`` chains (``into``,
        from :meth:`_into`) lead to (a touch of a merged record counts for the record it
        was merged into)."""
        if known is None:
            return True
        for first in self.delta_ids(name):
            i: str | None = first
            for _ in range(_MAX_CHAIN):
                if i not in known:
                    return False
                i = into.get(i)
                if not isinstance(i, str):
                    break
        return True

    def trigger(self, threshold: float) -> tuple[list[str], dict[str, float]]:
        """Which namespaces should a nightly pass process? Reads four columns (never the
        vectors or texts) and sums, per namespace, the importance of live records no pass
        has kept yet (``last_pass`` null).

        Returns:
            ``(fired, new_importance)``: the namespaces whose sum reaches ``threshold``
            (sorted), and every namespace's sum (namespaces with new records only).
        """
        t = self._open().to_table(
            columns=["namespace", "importance", "last_pass", "deleted_at"],
            filter=pc.field("last_pass").is_null() & pc.field("deleted_at").is_null(),
        )
        per = t.group_by("namespace").aggregate([("importance", "sum")]).to_pandas()
        sums = dict(zip(per["namespace"], per["importance_sum"].astype(float), strict=True))
        return sorted(n for n, v in sums.items() if v >= threshold), sums

    def _listed(self) -> list[str]:
        d = self.root / "deltas"
        if not d.exists():
            return []
        return sorted(
            p.name
            for p in d.iterdir()
            if not p.name.startswith(".") and p.name.endswith((".touch.json", ".patch.json"))
        )

    def _stored(self, ids: Sequence[Any]) -> pd.DataFrame:
        wanted = sorted({i for i in ids if isinstance(i, str)})
        if not wanted:
            return pd.DataFrame(
                {"id": pd.Series([], dtype=object), "pinned": pd.Series([], dtype=bool)}
            )
        ds = self._open()
        try:
            t, _ = _read_table(ds, columns=["id", "pinned"], filter=pc.field("id").isin(wanted))
        except (OSError, pa.ArrowException) as e:
            self._check_present(ds)  # names a missing file
            raise CorruptStoreError(
                f"cannot read the ids of {self.dataset_path} (version {ds.version}): {e}"
            ) from e
        return t.to_pandas()

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
    def commit(  # noqa: C901
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
        if stored is None:
            raise ValueError("commit(): base must be a snapshot loaded from this Lance store")
        marker = self._marker()
        dim = marker["dim"]
        if not isinstance(stored, _Stored):
            raise ValueError("commit(): base must be a snapshot loaded from this Lance store")
        part = base.namespaces
        if part is not None and not records.meta["namespace"].isin(part).all():
            raise ValueError("commit(): the records hold namespaces the snapshot did not read")
        with self._writers_lock():
            ds = self._open()
            self._check_present(ds)
            props = self._unchanged_since(ds, base.version)
            late_table, late_vecs, late_addr = self._appended_since(
                ds, base.version, stored, part, dim
            )
            late_rows = Records.empty(dim)
            if late_table.num_rows:
                late_rows = records_from_arrow(late_table, dim=dim, vectors=late_vecs)
                late_rows.origin = len(stored.frame) + np.arange(len(late_rows))
            late_frame = late_rows.meta.copy(deep=False)
            final = Records.concat([records, late_rows], dim) if len(late_rows) else records
            already = set(self._folded(props))
            known = None if part is None else set(final.meta["id"])
            seen = already | set(base.deltas)
            into = self._into(final) if known is not None else {}
            late = [n for n in self._listed() if n not in seen and self._covers(known, n, into)]
            n_touch = 0
            for name in late:
                final, _ = self._apply_delta(final, name, dim)
                n_touch += 1
            if late or len(late_rows):
                events = events + [
                    {"op": "carried", "deltas": late, "record_ids": late_rows.meta["id"].tolist()}
                ]
            if dry_run:
                log = self._changelog(events, ds.version + 1, dry_run=True)
                return {
                    "version": ds.version,
                    "snapshot": None,
                    "changelog": log,
                    "carried_records": len(late_rows),
                    "carried_touches": n_touch,
                }
            dtype = self.vector_dtype or self._vector_dtype(ds.schema)
            lance = _lance()
            upsert: np.ndarray | None = None
            removed: list[str] = []
            dead = None
            unique = False
            if dtype == self._vector_dtype(ds.schema):
                stored_ids = pa.chunked_array(
                    [*stored.ids.chunks, *late_table.column("id").chunks], pa.string()
                )
                got = _diff(
                    final, [stored.frame, late_frame], [stored.vectors, late_vecs], stored_ids
                )
                if got is not None:
                    (upsert, dead, removed), unique = got, True
                else:
                    upsert, removed, dead = _changes(
                        records_to_arrow(final, dtype, with_vectors=False),
                        final.vectors.reshape(len(final), dim),
                        pa.concat_tables(
                            [stored.arrow(), records_to_arrow(late_rows, with_vectors=False)]
                        )
                        if len(late_rows)
                        else stored.arrow(),
                        [stored.vectors.reshape(-1, dim), late_vecs],
                    )
            if (op == "pass" and upsert is not None and not len(upsert) and not len(removed)
                    and not late and not len(late_rows) and not base.deltas):  # fmt: skip
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
                }
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
                ds, already, tuple(base.deltas) + tuple(late), events, op, pass_time_h
            )
            rewrite = upsert is None or (
                part is None and len(upsert) + len(removed) > REWRITE_FRACTION * max(len(final), 1)
            )
            addresses = None
            if not rewrite and stored.rowaddr is not None:
                addresses = np.concatenate([stored.rowaddr, late_addr])[dead]
            _crashpoint("lance:before_commit")
            try:
                if rewrite:
                    table = records_to_arrow(final, dtype)
                    written, deleted = len(final), len(removed or [])
                    new = lance.write_dataset(
                        table,
                        ds,
                        mode="overwrite",
                        max_rows_per_file=ROWS_PER_FRAGMENT,
                        transaction_properties=new_props,
                    )
                else:
                    assert upsert is not None  # not a rewrite: the diff was computed
                    new = self._upsert(
                        ds,
                        records_to_arrow(final.take(upsert), dtype),
                        removed,
                        new_props,
                        addresses=addresses,
                    )
                    written, deleted = len(upsert), len(removed)
            except BaseException:
                self._drop_changelog(log, ds)
                raise
            if rewrite:
                _index(new)
            else:
                _reindex_if_lost(new)
            _crashpoint("lance:after_commit")
            self._record_checksums(self._open())
        self._cleanup_deltas(folded)
        return {
            "version": new.version,
            "snapshot": f"{DATASET}@{new.version}",
            "changelog": log,
            "carried_records": len(late_rows),
            "carried_touches": n_touch,
            "rows_written": written,
            "rows_deleted": deleted,
            "rewrite": rewrite,
        }

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

    # ------------------------------------------------------------ shards (fleet runs)
    def pending(self) -> tuple[int, list[str]]:
        """The newest version and the delta files not folded into it (sorted).

        The delta files are listed before the version is opened (see the module
        docstring), so a delta a pass folds in between is not listed as pending."""
        listed = self._listed()
        ds = self._open()
        folded = set(self._folded(self._props(ds)))
        return ds.version, [n for n in listed if n not in folded]

    def delta_ids(self, name: str) -> list[str]:
        """The record ids a pending delta file names (a touch's ids; a patch's ids and the
        ids its ``into`` fields name).

        A delta that fails :func:`~consolidate.store.store.read_json_delta` is moved to
        ``quarantine/`` (one warning line) and names no ids.

        Raises:
            CorruptStoreError: the file cannot be read or its name is not a delta's."""
        path = self.root / "deltas" / name
        if not (_plain_name(name) and name.endswith((".touch.json", ".patch.json"))):
            raise CorruptStoreError(f"{name!r} is not a delta file name of {self.root}")
        try:
            d = self._json_delta(path)
        except DeltaError as e:
            self._quarantine_delta(path, str(e))
            return []
        except OSError as e:
            raise CorruptStoreError(
                f"cannot read delta {path}: {e}; move it out of the folder to go on without it"
            ) from e
        if "ids" in d:
            return list(d["ids"])
        ids = [p["id"] for p in d["patches"]]
        return ids + [p["into"] for p in d["patches"] if p.get("into") is not None]

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

    def _cleanup_deltas(self, folded: Iterable[str]) -> None:
        d = self.root / "deltas"
        for k, name in enumerate(folded):
            with contextlib.suppress(FileNotFoundError):
                (d / name).unlink()
            if k == 0:
                _crashpoint("lance:during_delta_cleanup")
        remove_stale_tmp(d)
        _fsync_dir(d)

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


def write_records_file(
    recs: Records,
    path: str | os.PathLike,
    dtype: str = "fp32",
    *,
    extra: pd.DataFrame | None = None,
    suffix: str | None = None,
) -> None:
    """Write ``recs`` (every record, tombstones included) to ``path``: ``.parquet`` (the
    store's Arrow schema, vectors in ``dtype``), ``.jsonl`` (one JSON object a line; times
    ISO 8601 UTC, vectors as float lists, each float written exactly) or ``.csv`` (as JSONL,
    with vectors and lists of ids as JSON arrays in their cells; every cell quoted). Written
    to a temporary file and renamed; :func:`consolidate.sources.files.read_memories` reads
    each back as it was.

    Args:
        extra: more columns, indexed by record id (a file's columns outside the schema);
            records it lacks get nulls.
        suffix: the format, when ``path``'s own suffix is not it (a temporary file).

    Raises:
        ValueError: another suffix.
    """
    import csv

    import pyarrow.parquet as pq

    path = Path(path)
    suffix = suffix or path.suffix
    if suffix not in (".parquet", ".jsonl", ".csv"):
        raise ValueError(f"{path} must end in .parquet, .jsonl or .csv")
    aligned = (
        None
        if extra is None or not len(extra.columns)
        else extra.reindex(recs.meta["id"].to_numpy())
    )
    if suffix == ".parquet":
        table = records_to_arrow(recs, dtype)
        for c in [] if aligned is None else list(aligned.columns):
            assert aligned is not None
            if c not in table.column_names:
                table = table.append_column(str(c), pa.array(aligned[c].tolist(), from_pandas=True))
        _write_atomic(path, lambda p: pq.write_table(table, p))
        return
    df = records_to_arrow(recs, dtype, with_vectors=False).to_pandas()
    df.insert(3, "vector", list(recs.vectors.astype(np.float64)))
    for c in [] if aligned is None else list(aligned.columns):
        assert aligned is not None
        if c not in df.columns:
            df[c] = aligned[c].to_numpy(object)
    for c in df.columns:  # times as ISO 8601 UTC (microseconds, as stored)
        if str(df[c].dtype).startswith("datetime64"):
            df[c] = df[c].map(lambda t: None if pd.isna(t) else t.isoformat())
    if suffix == ".jsonl":
        # Python's json writes the shortest repr of each float: it reads back to the same
        # float64 (pandas' to_json keeps 15 digits at most)
        _write_atomic(path, lambda p: _write_table_jsonl(df, p))
        return
    for c in ("vector", "source_ids", "keep_apart", "derived_from"):
        df[c] = [json.dumps([float(x) for x in v] if c == "vector" else list(v)) for v in df[c]]
    # every cell quoted: a text with a bare carriage return reads back whole
    _write_atomic(path, lambda p: df.to_csv(p, index=False, quoting=csv.QUOTE_ALL))


def _write_table_jsonl(df: pd.DataFrame, path: Path) -> None:
    """``df`` as JSON lines: NaN and None as null, arrays as lists, floats exact."""

    def plain(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, (np.bool_, np.integer)):
            return v.item()
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, list):
            return list(v)
        return v

    cols = list(df.columns)
    with open(path, "w", encoding="utf-8") as f:
        for row in df.itertuples(index=False, name=None):
            f.write(
                json.dumps(
                    {c: plain(v) for c, v in zip(cols, row, strict=True)}, ensure_ascii=False
                )
                + "\n"
            )


def _index(ds: Any) -> None:
    """Build the scalar indexes of a dataset just written whole (each one a Lance version):
    a BTREE on ``id`` (appends, touches and patches look their ids up) and one on
    ``namespace`` (a load of some namespaces reads only their rows; BTREE, not BITMAP, as a
    fleet may hold millions of namespaces). Rows appended later are scanned until
    :meth:`LanceStore.cleanup` folds them into the indexes."""
    ds.create_scalar_index("id", "BTREE")
    ds.create_scalar_index("namespace", "BTREE")


def _reindex_if_lost(ds: Any) -> None:
    """Rebuild the ``id`` and ``namespace`` indexes of :func:`_index` when the newest version
    lacks one (a process killed between a rewrite and its index build), with a warning."""
    have = {f for ix in ds.describe_indices() for f in ix.field_names}
    for col in ("id", "namespace"):
        if col not in have:
            log.warning(
                "%s (version %s) had no index on %r (a write was interrupted before it was "
                "built): rebuilt",
                ds.uri,
                ds.version,
                col,
            )
            ds.create_scalar_index(col, "BTREE")


def _digest(files: Sequence[str], crc: Mapping[str, int]) -> str:
    """The content digest of a version: SHA-256 over its data and deletion files' paths and
    CRC32s, sorted (``"-"`` where a file has no recorded CRC32). Data files are immutable
    and every version lists its files, so the digest changes exactly when the version's
    rows could: a fragment or deletion file added, dropped or rewritten. CRC32 detects
    accidental damage, not a forgery."""
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(f"{p}\t{crc.get(p, '-')}\n".encode())
    return h.hexdigest()


@contextlib.contextmanager
def _lance_errors(dataset: Path, version: int | None) -> Iterator[None]:
    """Turn a panic inside Lance (pyo3's ``PanicException``, a ``BaseException``) into a
    :class:`CorruptStoreError` naming the dataset and the version."""
    try:
        yield
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        first = (str(e).strip().splitlines() or ["?"])[0][:300]
        raise CorruptStoreError(
            f"Lance cannot read {dataset}"
            f"{'' if version is None else f' at version {version}'} (it panicked: {first}); "
            f"a file of the dataset is damaged: `consolidate-versions action=verify` names it"
        ) from None


def _crc32(path: Path, block: int = 8 << 20) -> int:
    """CRC32 of a file, read in 8 MiB blocks."""
    c = 0
    with open(path, "rb") as f:
        while b := f.read(block):
            c = zlib.crc32(b, c)
    return c


def _txn_props(ds: Any, version: int) -> dict[str, str]:
    """The transaction properties of one version; ``{}`` where there are none or Lance
    cannot read that version's transaction (it raises on some of its own index commits)."""
    try:
        txn = ds.read_transaction(version)
    except Exception:  # noqa: BLE001 - any failure means "no properties of ours"
        return {}
    return dict(getattr(txn, "transaction_properties", None) or {})


def _same(a: pa.Array, b: pa.Array) -> pa.Array:
    """Row-wise equality of two Arrow columns of one type; two nulls (or two NaN) are equal;
    list columns compare by length and by their items joined."""
    if pa.types.is_list(a.type):
        la, lb = pc.list_value_length(a), pc.list_value_length(b)
        same_len = pc.fill_null(pc.equal(la, lb), False)
        ja = pc.binary_join(a, "\x1f")
        jb = pc.binary_join(b, "\x1f")
        return pc.and_(pc.or_(same_len, pc.and_(pc.is_null(a), pc.is_null(b))), _same(ja, jb))
    eq = pc.fill_null(pc.equal(a, b), False)
    both = pc.and_(pc.is_null(a), pc.is_null(b))
    if pa.types.is_floating(a.type):
        both = pc.or_(both, pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False))
    return pc.or_(eq, both)


def _vector_diff(
    final_vecs: np.ndarray,
    have: np.ndarray,
    sp: np.ndarray,
    parts: Sequence[np.ndarray],
    chunk: int = 65536,
) -> np.ndarray:
    """``bool [len(have)]``: whether row ``have[i]`` of ``final_vecs`` differs in any
    component from stored row ``sp[i]``, the stored vectors given in ``parts`` (``(m_k, d)``
    float32 each, stored rows in order).

    Rows that line up in runs (consecutive in both, within one part: what a pass that
    keeps its rows in order and purges some leaves) are compared as two slices per run of at
    most ``chunk`` rows, with no gather, and a run whose two slices are the same memory is
    not compared at all; the loop is per run, and where runs average fewer than 64 rows the
    rows are gathered in blocks of ``chunk`` instead."""
    diff = np.zeros(len(have), bool)
    if not len(have):
        return diff
    bounds = np.cumsum([0] + [len(v) for v in parts])
    part = np.searchsorted(bounds, sp, side="right") - 1
    brk = np.flatnonzero((np.diff(have) != 1) | (np.diff(sp) != 1) | (np.diff(part) != 0)) + 1
    starts = np.r_[0, brk]
    ends = np.r_[brk, len(have)]
    if len(starts) <= max(1, len(have) // 64):
        for s0, e0 in zip(starts.tolist(), ends.tolist(), strict=True):
            q = int(part[s0])
            for s in range(s0, e0, chunk):
                k = min(chunk, e0 - s)
                r0, a0 = int(have[s]), int(sp[s]) - int(bounds[q])
                f, v = final_vecs[r0 : r0 + k], parts[q][a0 : a0 + k]
                if (
                    f.__array_interface__["data"][0] != v.__array_interface__["data"][0]
                    or f.strides != v.strides
                ):  # the very same memory needs no compare
                    diff[s : s + k] = np.any(f != v, axis=1)
        return diff
    for s in range(0, len(have), chunk):
        rows, at, pt = have[s : s + chunk], sp[s : s + chunk], part[s : s + chunk]
        for q, vecs in enumerate(parts):
            sel = np.flatnonzero(pt == q)
            if len(sel):
                diff[s + sel] = np.any(final_vecs[rows[sel]] != vecs[at[sel] - bounds[q]], axis=1)
    return diff


def _column_equal(a: np.ndarray, b: np.ndarray, kind: str) -> np.ndarray:
    """Row-wise equality of one decoded column (``kind``: its :data:`COLUMNS` dtype); two
    missing values (None, NaN) are equal.

    Raises:
        TypeError, ValueError: the values do not compare as arrays (e.g. an item that is
            itself an array)."""
    if kind == "float64":
        a, b = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
        return (a == b) | (np.isnan(a) & np.isnan(b))
    if kind == "bool" and a.dtype == bool and b.dtype == bool:
        return a == b
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns, not raises, on some failed compares
        eq = np.asarray(a == b)
    if eq.dtype != bool or eq.shape != a.shape:
        raise TypeError("values that do not compare one to one")
    miss = np.flatnonzero(~eq)
    if len(miss):  # None == None is True already; NaN != NaN
        eq[miss] = pd.isna(a[miss]) & pd.isna(b[miss])
    return eq


def _diff(
    final: Records,
    frames: Sequence[pd.DataFrame],
    vectors: Sequence[np.ndarray],
    stored_ids: pa.ChunkedArray,
) -> tuple[np.ndarray, np.ndarray, list[str]] | None:
    """Which rows of the new records differ from the stored rows, compared as decoded
    (the columns the load produced, kept in ``frames``), with row matching taken from
    ``final.origin`` (or, without it, from new records that begin with the stored rows in
    order); ``None`` where that does not hold or a column does not compare as arrays (the
    caller then compares as Arrow, :func:`_changes`).

    Every match is checked: the matched ids are equal, the stored positions distinct, and
    no id of an unmatched row is stored; then the result equals :func:`_changes`'s, without
    a hash join over all ids (``O(n)`` array operations).

    Args:
        final: the new records (``n`` rows, ``origin`` indexing the stored rows).
        frames: the stored rows' decoded columns in parts (``m_k`` rows each), in order.
        vectors: the stored rows' ``float32 (m_k, d)`` vectors, the same parts.
        stored_ids: the ``m`` stored ids (Arrow strings), in order.

    Returns:
        ``(upsert, dead, removed)``: ascending positions in ``final`` to write (new, or any
        column or vector component different), ascending stored positions whose rows are
        replaced or removed, and the removed (absent) stored ids.
    """
    m, n = sum(len(f) for f in frames), len(final)

    def col(c: str) -> np.ndarray:
        return (
            frames[0][c].to_numpy()
            if len(frames) == 1 or not len(frames[1])
            else np.concatenate([f[c].to_numpy() for f in frames])
        )

    f_ids, s_ids = final.meta["id"].to_numpy(object), col("id")
    o = final.origin
    if o is None:
        if n < m or not (f_ids[:m] == s_ids).all():
            return None
        o = np.r_[np.arange(m), np.full(n - m, -1)]
    ok = o >= 0
    have = np.flatnonzero(ok)
    sp = o[have]
    increasing = bool(np.all(np.diff(sp) > 0))
    if len(sp):
        if sp.min() < 0 or sp.max() >= m:
            return None
        if not increasing and np.bincount(sp, minlength=m).max() > 1:
            return None
        if not np.all(f_ids[have] == s_ids[sp]):
            return None
    new = np.flatnonzero(~ok)
    if len(new):
        new_ids = f_ids[new]
        try:
            nid = pa.array(new_ids, pa.string())
        except (pa.ArrowException, TypeError, ValueError):
            return None
        if (
            nid.null_count
            or pd.Series(new_ids).duplicated().any()
            or pc.any(pc.is_in(stored_ids, value_set=nid)).as_py()
        ):
            return None  # a repeated, missing or stored id: the Arrow path decides
    k = len(have)
    # both exactly 0..k-1 (have is increasing by construction; sp must be too)
    straight = (
        k > 0 and increasing and int(have[-1]) == k - 1 and int(sp[0]) == 0 and int(sp[-1]) == k - 1
    )
    same = np.ones(k, bool)
    try:
        for c, kind in COLUMNS.items():
            if c == "id":
                continue
            a, b = final.meta[c].to_numpy(), col(c)
            same &= (
                _column_equal(a[:k], b[:k], kind)
                if straight
                else _column_equal(a[have], b[sp], kind)
            )
    except (TypeError, ValueError, KeyError, Warning):
        return None
    diff = ~same
    d = final.dim
    diff |= _vector_diff(
        final.vectors.reshape(n, d), have, sp, [v.reshape(len(v), d) for v in vectors]
    )
    kept = np.zeros(m, bool)
    kept[sp] = True
    gone = np.flatnonzero(~kept)
    upsert = np.sort(np.concatenate([new, have[diff]]))
    dead = np.sort(np.concatenate([sp[diff], gone]))
    return upsert, dead, s_ids[gone].tolist()


def _changes(
    final_meta: pa.Table,
    final_vecs: np.ndarray,
    stored_meta: pa.Table,
    stored_vecs: Sequence[np.ndarray],
    chunk: int = 65536,
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Which rows of the new records differ from the stored rows, and which stored ids are
    gone, compared as Arrow columns (a hash join over the ids where the rows do not line
    up); every comparison is an array operation (Arrow kernels, NumPy blocks).

    Args:
        final_meta: the new records' non-vector columns, ``n`` rows
            (:func:`~consolidate.store.schema.records_to_arrow` with ``with_vectors=False``).
        final_vecs: ``(n, d)`` float32, their vectors.
        stored_meta: the stored rows' non-vector columns (``m`` rows, unique ids), same
            schema.
        stored_vecs: the stored rows' decoded ``(m_i, d)`` float32 vectors in parts whose
            lengths sum to ``m``, in the order of ``stored_meta``.
        chunk: rows compared per block of vectors.

    Returns:
        ``(rows, removed, dead)``: ascending positions in the new records to upsert (a new
        id, or any column or vector component different), the stored ids absent from them,
        and the ascending stored positions whose rows are replaced or removed.
    """
    m = stored_meta.num_rows
    f_id, s_id = final_meta.column("id"), stored_meta.column("id")
    if final_meta.num_rows >= m and f_id.slice(0, m).equals(s_id):
        # the usual case: the stored rows first, in stored order, then new rows (no join)
        have = sp = np.arange(m)
        pos = np.concatenate([sp, np.full(final_meta.num_rows - m, -1)])
        aligned = True
    else:
        sid = s_id.to_numpy(zero_copy_only=False)
        pos = pd.Index(sid, dtype=object).get_indexer(f_id.to_numpy(zero_copy_only=False))
        have = np.flatnonzero(pos >= 0)
        sp = pos[have]
        aligned = False
    same = pa.array(np.ones(len(have), bool))
    if final_meta.schema.names != stored_meta.schema.names:
        same = pa.array(np.zeros(len(have), bool))
    else:
        fa, sa = pa.array(have), pa.array(sp)
        for c in final_meta.schema.names:
            if aligned:
                a, b = final_meta.column(c).slice(0, m), stored_meta.column(c)
            else:
                a = final_meta.column(c).take(fa)
                b = stored_meta.column(c).take(sa)
            if a.type != b.type:
                b = b.cast(a.type)
            same = pc.and_(same, _same(a.combine_chunks(), b.combine_chunks()))
    diff = ~same.to_numpy(zero_copy_only=False)
    if len(have):
        diff |= _vector_diff(final_vecs, have, sp, stored_vecs, chunk)
    upsert = np.sort(np.concatenate([np.flatnonzero(pos < 0), have[diff]]))
    if aligned:
        return upsert, [], np.sort(sp[diff])
    gone = np.ones(m, dtype=bool)
    gone[sp] = False
    return upsert, sid[gone].tolist(), np.sort(np.concatenate([sp[diff], np.flatnonzero(gone)]))


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

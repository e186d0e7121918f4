"""A memory store on disk: Parquet snapshots, a pointer swapped atomically, write deltas.

Layout of a store directory::

    CURRENT                      pointer (JSON): version, snapshot and changelog file names,
                                 dim, vector storage dtype (fp32|fp16|bf16|int8, see
                                 :mod:`consolidate.store.vectors`), deltas already folded
    LOCK                         flock()ed by the one pass (or undo) allowed at a time
    snapshots/snapshot-000007.parquet
    changelogs/changelog-000007.jsonl
    deltas/<time_ns>-<pid>-<rand>.parquet     records appended since the snapshot
    deltas/<time_ns>-<pid>-<rand>.touch.json  recall bookkeeping since the snapshot
    deltas/<time_ns>-<pid>-<rand>.patch.json  tombstones / closed validity from the write path
    quarantine/<time_ns>-<source>.parquet     rows refused in quarantine mode

Writers never rewrite a snapshot: :meth:`Store.append` and :meth:`Store.mark_used` add a delta
file (temp file, fsync, rename), so they need no lock and never wait for a pass. Readers see
``snapshot + deltas not yet folded``. A pass holds ``LOCK``, reads version N, and commits with
:meth:`Store.commit`: snapshot N+1 and its changelog go to temp files, are fsynced and renamed,
then ``CURRENT`` is replaced with ``os.replace`` (the commit point). Deltas that arrived while
the pass ran are carried into N+1, so no write is lost. The lock is ``fcntl.flock``: the kernel
drops it when its process dies, so a crashed pass cannot leave it held.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..text import utf8_ok
from .schema import (
    DEFAULT_STRENGTH_CAP,
    MAX_ABS_HOURS,
    MERGED_ID_FORM,
    InvalidRecordsError,
    Problem,
    Records,
    datetime_from_hours,
    hours_now,
    normalise_vectors,
    records_from_arrow,
    records_from_rows,
    records_to_arrow,
    validate,
)
from .vectors import SCALE_COLUMN, check_vector_dtype, decode_vectors, empty_vectors

__all__ = [
    "Store",
    "Snapshot",
    "StoreNotFoundError",
    "CorruptStoreError",
    "ConcurrentCommitError",
    "LockTimeoutError",
]

POINTER = "CURRENT"
_SNAP = re.compile(r"snapshot-(\d{6,})\.parquet$")


#: reads (load, commit) allow this many times the write-time clock skew
READ_SKEW = 2.0
_CHANGELOG = re.compile(r"changelog-(\d{6,})\.jsonl$")
_DELTA_EXT = (".parquet", ".touch.json", ".patch.json")


_log = logging.getLogger("consolidate")


def _is_hours(t: object) -> bool:
    """``t`` is a time in hours since the epoch: a real number (not a bool), finite, within
    :data:`~consolidate.store.schema.MAX_ABS_HOURS`."""
    return (
        isinstance(t, (int, float))
        and not isinstance(t, bool)
        and math.isfinite(t)
        and abs(t) <= MAX_ABS_HOURS
    )


def _plain_name(name: object) -> bool:
    """A file name that stays in its folder: a non-empty ``str`` with no path separator,
    not ``.`` or ``..``, no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def _check_pointer_values(ptr: Pointer) -> None:
    """The pointer's non-name fields have their types: ``dim``/``version``/``rows`` integers
    (not booleans), times finite hours or null, ``snapshot_sha256`` 64 hex characters.

    Raises:
        ValueError: naming the field and the value.
    """
    for key in ("version", "dim"):
        if isinstance(getattr(ptr, key), bool):
            raise ValueError(f"{key} {getattr(ptr, key)!r} is not an integer")
    if ptr.rows is not None and not (
        isinstance(ptr.rows, int) and not isinstance(ptr.rows, bool) and ptr.rows >= 0
    ):
        raise ValueError(f"rows {ptr.rows!r} is not a count")
    for key in ("created_at", "last_pass_at"):
        t = getattr(ptr, key)
        if key == "last_pass_at" and t is None:
            continue
        if not (
            isinstance(t, (int, float))
            and not isinstance(t, bool)
            and math.isfinite(t)
            and abs(t) <= MAX_ABS_HOURS
        ):
            raise ValueError(f"{key} {t!r} is not hours since the epoch")
    sha = ptr.snapshot_sha256
    if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        raise ValueError(f"snapshot_sha256 {sha!r} is not a sha256 hex digest")


def _file_sha256(path: Path) -> str:
    """sha256 hex digest of a file (read in 8 MiB blocks)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check_pointer_names(ptr: Pointer) -> None:
    """Every file name in a pointer names a file of this store: ``snapshot`` and
    ``changelog`` by their patterns, ``folded`` entries as plain delta file names.

    Raises:
        ValueError: naming the field and the value (a crafted ``CURRENT`` must not make a
            load read, or a commit delete, a file outside the store).
    """
    if not (_plain_name(ptr.snapshot) and _SNAP.fullmatch(ptr.snapshot)):
        raise ValueError(f"snapshot {ptr.snapshot!r} is not a snapshot file name")
    if ptr.changelog is not None and not (
        _plain_name(ptr.changelog) and _CHANGELOG.fullmatch(ptr.changelog)
    ):
        raise ValueError(f"changelog {ptr.changelog!r} is not a changelog file name")
    for name in ptr.folded:
        if not (_plain_name(name) and name.endswith(_DELTA_EXT)):
            raise ValueError(f"folded entry {name!r} is not a delta file name")


class StoreNotFoundError(FileNotFoundError):
    """The directory holds no store (no ``CURRENT`` pointer)."""


class CorruptStoreError(RuntimeError):
    """The pointer or a snapshot cannot be read."""


class ConcurrentCommitError(RuntimeError):
    """The pointer moved since the snapshot was read (compare-and-swap failed)."""


class LockTimeoutError(TimeoutError):
    """Another pass holds the store lock."""


def _crashpoint(name: str) -> None:
    """Test hook: ``CONSOLIDATE_CRASH_AT=name`` kills this process with SIGKILL here."""
    if os.environ.get("CONSOLIDATE_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _flock(
    path: Path, timeout_s: float, poll_s: float, message: Any, stamp: bool = False
) -> Iterator[None]:
    """Exclusive ``fcntl.flock`` on ``path`` (created if missing), polling until
    ``timeout_s``; the kernel releases it if the process dies. ``stamp`` writes the holder's
    pid and host into the file for the error message of the next waiter.

    A lock won on a file that is no longer at ``path`` (its folder was exchanged or
    moved meanwhile, e.g. by a re-embed) is let go and taken again on the file now there.

    Raises:
        LockTimeoutError: with ``message(holder)`` after ``timeout_s`` seconds.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                    raise LockTimeoutError(message(holder)) from None
                time.sleep(poll_s)
                continue
            if _same_file(fd, path):
                break
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if stamp:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Is the open file ``fd`` the file at ``path`` now?"""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: a temp file in ``deltas/`` older than this is left by a killed writer, not one at work
STALE_TMP_S = 3600.0


def remove_stale_tmp(folder: Path, min_age_s: float = STALE_TMP_S) -> int:
    """Remove the temp files (``.<name>.tmp-<rand>``, :func:`_write_atomic`) in ``folder``
    last modified more than ``min_age_s`` seconds ago: a writer that holds no lock may be
    writing a younger one. Returns how many were removed."""
    cutoff, n = time.time() - min_age_s, 0
    for p in folder.glob(".*.tmp-*") if folder.is_dir() else ():
        with contextlib.suppress(FileNotFoundError):
            if p.stat().st_mtime < cutoff:
                p.unlink()
                n += 1
    return n


def _write_atomic(path: Path, write: Any, crash_tag: str = "") -> None:
    """Write ``path`` via ``path.tmp-<rand>``: write(tmp), fsync, rename, fsync dir."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if crash_tag:
            _crashpoint(f"{crash_tag}:before_rename")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


@dataclass(frozen=True)
class Pointer:
    """The Parquet store's ``CURRENT`` pointer: the version, its snapshot and changelog
    files, the vector dimension and dtype, the delta files folded into it, its times and
    the snapshot's checksum."""

    version: int
    snapshot: str
    changelog: str | None
    dim: int
    folded: tuple[str, ...] = ()
    created_at: float = 0.0
    last_pass_at: float | None = None
    vector_dtype: str = "fp32"
    snapshot_sha256: str | None = None
    rows: int | None = None

    def to_json(self) -> str:
        d = self.__dict__.copy()
        d["folded"] = list(self.folded)
        # human-readable copies of the times (hours since the epoch in the fields above)
        for k in ("created_at", "last_pass_at"):
            if d[k] is not None:
                d[k + "_utc"] = datetime_from_hours(d[k]).isoformat()
        return json.dumps(d, indent=1)

    @staticmethod
    def from_json(text: str) -> Pointer:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        if d.get("format") == "lance":
            raise ValueError(
                "this is a Lance store: open it with "
                "consolidate.store.lance.open_store_dir or LanceStore"
            )
        names = {f.name for f in dataclasses.fields(Pointer)}
        d = {k: v for k, v in d.items() if k in names}
        d["folded"] = tuple(d.get("folded", ()))
        return Pointer(**d)


@dataclass
class Snapshot:
    """One consistent view of a store.

    Attributes:
        version: snapshot version N read from ``CURRENT``.
        records: all records (live and tombstones) after applying the pending deltas.
        dim: vector dimension.
        deltas: names of the delta files applied on top of the snapshot.
        new_ids: ids of records added by those deltas (written since the snapshot).
        path: the snapshot file.
        last_pass_at: wall time (hours since epoch) of the last pass, ``None`` if none yet.
        stored: Lance store only: the rows as stored before the deltas (the store's own
            record of them), which its commit compares against; ``None`` for the Parquet
            store.
        namespaces: the namespaces read (sorted), ``None`` for the whole store.
    """

    version: int
    records: Records
    dim: int
    deltas: tuple[str, ...]
    new_ids: list[str] = field(default_factory=list)
    path: Path | None = None
    last_pass_at: float | None = None
    stored: Any = None
    namespaces: list[str] | None = None

    def batch(self, device: str = "cpu", live_only: bool = True) -> Any:
        """Tensors on ``device`` plus a table view; see :class:`consolidate.store.MemoryBatch`."""
        from .batch import MemoryBatch

        recs = self.records.mask(self.records.live_mask()) if live_only else self.records
        return MemoryBatch.from_records(recs, device=device)


class StoreBase(abc.ABC):
    """What the Lance store and the Parquet store share: the constructor's settings, the
    delta files (appends, recall bookkeeping, patches) and their checks, quarantine, the
    pass lock and the writers' lock, :meth:`create`, :meth:`mark_used`, :meth:`patch` and
    :meth:`transact`. A subclass is one on-disk format (:class:`ParquetStore`,
    :class:`~consolidate.store.lance.LanceStore`); the interface both give is
    :class:`~consolidate.store.base.MemoryStore`.

    Args:
        root: the store directory.
        keep_snapshots: how many versions (with changelogs) to keep after a commit (>= 1).
        quarantine: if ``True``, invalid rows met by :meth:`append` or :meth:`load` are moved
            to ``quarantine/`` and the rest goes on; if ``False`` (default), they raise
            :class:`InvalidRecordsError` and nothing is written.
        future_tolerance_h: allowed clock skew, hours: a ``created_at``, ``last_used`` or
            ``deleted_at`` later than now by more is refused at write, and by more than
            :data:`READ_SKEW` times it at load and commit (writer and reader clocks may each
            be off).
        vector_dtype: how versions written through this handle store vectors (``fp32``,
            ``fp16``, ``bf16``, ``int8``; see :mod:`consolidate.store.vectors`); ``None``
            keeps the store's own (``fp32`` for a new store). Deltas written by
            :meth:`append` use the dtype of the current version. Converting to a smaller
            dtype is lossy and one-way.

    Raises:
        ValueError: ``keep_snapshots < 1`` or an unknown ``vector_dtype``.
    """

    #: the on-disk format, ``"parquet"`` or ``"lance"`` (``store.format``)
    FORMAT: ClassVar[str] = ""
    #: :meth:`load` can read some namespaces only, and :meth:`trigger` fires per namespace
    #: (what the nightly trigger and a fleet run need)
    PARTIAL_LOADS: ClassVar[bool] = False
    #: every commit is a version that can be read back later (``consolidate-versions``)
    TIME_TRAVEL: ClassVar[bool] = False

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_snapshots: int = 5,
        quarantine: bool = False,
        future_tolerance_h: float = 5 / 60,
        vector_dtype: str | None = None,
    ) -> None:
        if keep_snapshots < 1:
            raise ValueError("keep_snapshots must be >= 1")
        self.vector_dtype = None if vector_dtype is None else check_vector_dtype(vector_dtype)
        self.root = Path(root)
        self.keep_snapshots = keep_snapshots
        self.quarantine = quarantine
        self.future_tolerance_h = future_tolerance_h
        self.refused_deltas: list[str] = []  # one line per delta file moved to quarantine/

    # ------------------------------------------------------------ paths
    @property
    def pointer_path(self) -> Path:
        return self.root / POINTER

    def _dirs(self) -> None:
        for d in ("changelogs", "deltas"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        for lock in ("LOCK", "WRITERS.LOCK"):
            (self.root / lock).touch()

    def exists(self) -> bool:
        return self.pointer_path.exists()

    # ------------------------------------------------------------ create
    def create(self, records: Records, *, source: str = "records") -> Snapshot:
        """Write the store's first version from ``records`` into a new or empty directory.
        Vectors are rescaled to unit length, as by :meth:`append`.

        The store is built in a hidden folder beside ``root`` (``.<name>.creating-...``)
        and renamed into place when complete, so a crash (even SIGKILL) leaves ``root`` as
        it was and a retry works; a crash leaves only that hidden folder.

        Raises:
            FileExistsError: a store already exists at ``root``, ``root`` is a file or a
                non-empty directory without a store (e.g. one whose ``CURRENT`` was lost),
                or another process created a store there meanwhile.
            InvalidRecordsError: a record is invalid (not in quarantine mode); nothing written.
        """
        records = self._create_checked(records, source)
        tmp = self.root.with_name(
            f".{self.root.name}.creating-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        other = copy.copy(self)
        other.root = tmp
        try:
            other._create_here(records, source)
            _fsync_dir(tmp)
            _crashpoint("create:before_rename")
            try:
                os.rename(tmp, self.root)  # over a new name or an empty folder: atomic
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                    raise FileExistsError(
                        f"{self.root} was filled by another process while "
                        f"this store was being created; nothing written"
                    ) from None
                raise
            _fsync_dir(self.root.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return self.load()

    def _create_checked(self, records: Records, source: str) -> Records:
        """The checks every :meth:`create` makes before it writes: no store and an empty
        or new folder, at least one record, valid records (rescaled to unit length, the
        same rule as :meth:`append`)."""
        if self.exists():
            raise FileExistsError(f"a store already exists at {self.root}")
        if self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir())):
            raise FileExistsError(
                f"{self.root} is not empty and holds no store ({POINTER} is missing): a "
                f"store is created only in a new or empty directory; if it held a store, "
                f"restore its {POINTER} or move the folder aside"
            )
        if not len(records) or records.dim < 1:
            raise ValueError(f"create(): no records (or no vector dimension) for {self.root}")
        # the caller's records stay as they were (create rescales, stamps columns)
        records = dataclasses.replace(
            records,
            meta=records.meta.copy(),
            input_problems={k: list(v) for k, v in records.input_problems.items()},
        )
        records = self._checked(records, dim=records.dim, source=source, existing=None)
        normalise_vectors(records)
        return records

    @staticmethod
    def _new_rows(records: Records | Iterable[Mapping[str, Any]], dim: int) -> Records:
        """What :meth:`append` was given, as :class:`Records` of new memories: rows that
        are not live (``deleted_at`` or ``merged_into`` set) are flagged as input problems,
        and ``last_pass`` is cleared (no pass has seen them)."""
        if isinstance(records, Mapping):
            raise TypeError("append() takes a list of records, not one dict")
        if not isinstance(records, Records):
            records = records_from_rows(records, dim=dim)
        else:  # the caller's records stay as they were (append rescales, stamps columns)
            records = dataclasses.replace(
                records,
                meta=records.meta.copy(),
                input_problems={k: list(v) for k, v in records.input_problems.items()},
            )
        m = records.meta
        not_live = np.flatnonzero(
            ~np.isnan(m["deleted_at"].to_numpy(np.float64))
            | m["merged_into"].map(lambda x: isinstance(x, str)).to_numpy(bool)
        )
        if len(not_live):
            records.input_problems.setdefault(
                "not a live record (append takes new memories; deleted_at/merged_into set)", []
            ).extend(not_live.tolist())
        reserved = np.flatnonzero(
            m["id"].astype(object).str.fullmatch(MERGED_ID_FORM).eq(True).to_numpy(bool)
        )
        if len(reserved):
            records.input_problems.setdefault(
                "id of the reserved merged form (m-/rf- and 24 hex digits: the ids passes "
                "give the rows they write)",
                [],
            ).extend(reserved.tolist())
        records.meta["last_pass"] = np.nan
        return records

    def _pending(self, ptr: Pointer) -> list[str]:
        d = self.root / "deltas"
        if not d.exists():
            return []
        folded = set(ptr.folded)
        names = [
            p.name
            for p in d.iterdir()
            if not p.name.startswith(".")
            and p.name not in folded
            and p.name.endswith((".parquet", ".touch.json", ".patch.json"))
        ]
        return sorted(names)

    def _apply_delta(
        self, recs: Records, name: str, dim: int, validate_records: bool = True
    ) -> tuple[Records, list[str]]:
        path = self.root / "deltas" / name
        if name.endswith((".touch.json", ".patch.json")):
            try:
                d = self._json_delta(path)
                if name.endswith(".touch.json"):
                    return apply_touch(recs, d["ids"], d["now"], d.get("strength_cap")), []
                return apply_patch(recs, d["patches"], d["written"]), []
            except DeltaError as e:
                self._quarantine_delta(path, str(e))
                return recs, []
            except OSError as e:
                raise CorruptStoreError(
                    f"cannot read delta {path}: {e}; move it out of {path.parent} to go on "
                    f"without it"
                ) from e
        try:
            table = _read_parquet(path)
            new = records_from_arrow(table, dim=dim)
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
            raise CorruptStoreError(
                f"cannot read delta {path}: {e}; move it out of {path.parent} to go on without it"
            ) from e
        if validate_records:
            new = self._checked(
                new, dim=dim, source=str(path), reading=True, existing=set(recs.meta["id"])
            )
        return Records.concat([recs, new], dim), list(new.meta["id"])

    def _json_delta(self, path: Path) -> dict[str, Any]:
        """:func:`read_json_delta` with this store's read skew."""
        return read_json_delta(path, skew_h=READ_SKEW * self.future_tolerance_h)

    def _quarantine_delta(self, path: Path, why: str) -> None:
        """Move a refused delta file to ``quarantine/`` (the rest of the store still loads)
        and say so in one line (logged as a warning, and kept in ``refused_deltas``)."""
        qdir = self.root / "quarantine"
        qdir.mkdir(parents=True, exist_ok=True)
        dest = qdir / path.name
        with contextlib.suppress(FileNotFoundError):  # another reader moved it first
            os.replace(path, dest)
            _fsync_dir(path.parent)
        msg = f"{why}; moved to {dest} (the rest of the store loads without it)"
        if not msg.startswith("delta "):
            msg = f"delta {path}: {msg}"
        self.refused_deltas.append(msg)
        _log.warning("refused %s", msg)

    @contextlib.contextmanager
    def _writers_lock(self, timeout_s: float = 60.0) -> Iterator[None]:
        with _flock(
            self.root / "WRITERS.LOCK",
            timeout_s,
            0.01,
            lambda _: f"{self.root}: another writer holds WRITERS.LOCK for over {timeout_s} s",
        ):
            yield

    def mark_used(
        self,
        ids: Sequence[str],
        *,
        now: float | None = None,
        strength_cap: float | None = DEFAULT_STRENGTH_CAP,
    ) -> None:
        """Recall bookkeeping: each id's ``last_used = now`` and ``strength += 1`` (capped).

        Written as a delta file, so it is safe while a pass runs; a touched record merged by
        that pass passes its touch on to the merged record (``merged_into``).

        Args:
            ids: memory ids that were retrieved and used.
            now: hours since the epoch (default: wall clock).
            strength_cap: strength never exceeds this (default
                :data:`~consolidate.store.schema.DEFAULT_STRENGTH_CAP`, 20, the pass's
                default; ``None`` = no cap).

        Raises:
            KeyError: an id is not in the store (names the first few); nothing is written.
        """
        wall = hours_now()
        now = wall if now is None else now
        self._check_time("mark_used: now", now, wall)
        if strength_cap is not None and not strength_cap >= 1:
            raise ValueError(f"mark_used: strength_cap must be >= 1, got {strength_cap!r}")
        if isinstance(ids, str):
            raise TypeError("mark_used() takes a list of ids, not one string")
        known = set(self._stored(ids)["id"])
        missing = [i for i in ids if i not in known]
        if missing:
            raise KeyError(f"mark_used: {len(missing)} unknown id(s) in {self.root}: {missing[:5]}")
        now = float(now)
        payload = _delta_payload({"ids": list(ids), "now": now, "strength_cap": strength_cap}, wall)
        _write_atomic(
            self.root / "deltas" / self._delta_name("touch.json"),
            lambda p: p.write_text(payload),
            crash_tag="touch",
        )

    def patch(self, patches: Sequence[Mapping[str, Any]], *, now: float | None = None) -> None:
        """Write-path changes to stored records, as one delta (safe while a pass runs).

        Each patch is ``{"id": ..., "op": "delete" | "close", "into": id | None,
        "reason": str | None, "at": hours | None, "valid_to": hours | None}`` (``at``: when
        the change happened, default ``now``): ``delete`` makes the record a
        tombstone (``deleted_reason`` = ``reason``, default ``"deleted"``, or ``"updated"``
        when ``into`` names the newer record that replaces it, ``merged_into`` = ``into``;
        ``"superseded"`` for a contradicted fact); ``close`` ends its validity at ``valid_to`` (a
        contradicted temporal fact). Nothing is removed: an update or delete can be undone
        from the tombstone.

        Raises:
            TypeError: ``patches`` is not a list of dicts.
            KeyError: an unknown id, or an ``into`` that is not another stored record
                (nothing written).
            ValueError: a pinned record would be deleted, an unknown op or reason, or a
                bad time (``now``/``at`` not finite hours since the epoch, or in the future
                beyond the clock-skew allowance); nothing is written.
        """
        wall = hours_now()
        now = wall if now is None else now
        self._check_time("patch: now", now, wall)
        if isinstance(patches, Mapping) or not all(isinstance(p, Mapping) for p in patches):
            raise TypeError("patch() takes a list of dicts ({'id': ..., 'op': ...})")
        m = self._stored([x for p in patches for x in (p.get("id"), p.get("into"))]).set_index("id")
        out = []
        for p in patches:
            i, op = p.get("id"), p.get("op")
            if i not in m.index:
                raise KeyError(f"patch: unknown id {i!r} in {self.root}")
            into = p.get("into")
            if into is not None and (into == i or into not in m.index):
                # a touch of ``i`` follows ``into``: it must name another stored record
                raise KeyError(
                    f"patch: 'into' of {i!r} must name another stored record, got {into!r}"
                )
            at = p.get("at", now)
            self._check_time(f"patch: at for {i!r}", at, wall)
            if op == "delete":
                if bool(m.loc[i, "pinned"]):
                    raise ValueError(f"patch: {i!r} is pinned and is never deleted")
                why = p.get("reason")
                if why not in (None, "deleted", "updated", "superseded"):
                    raise ValueError(
                        f"patch: reason for {i!r} must be deleted, updated or "
                        f"superseded, got {why!r}"
                    )
                out.append(
                    {
                        "id": i,
                        "op": op,
                        "into": p.get("into"),
                        "at": float(at),
                        **({"reason": why} if why else {}),
                    }
                )
            elif op == "close":
                vt = p.get("valid_to", now)
                if not _is_hours(vt):
                    raise ValueError(
                        f"patch: valid_to={vt!r} for {i!r} is not hours since the epoch"
                    )
                out.append({"id": i, "op": op, "valid_to": float(vt)})
            else:
                raise ValueError(f"patch: op must be 'delete' or 'close', got {op!r}")
        payload = _delta_payload({"patches": out}, wall)
        _write_atomic(
            self.root / "deltas" / self._delta_name("patch.json"),
            lambda p: p.write_text(payload),
            crash_tag="patch",
        )

    def _check_time(self, what: str, t: object, wall: float) -> None:
        """Refuse a write time that is not finite hours since the epoch or lies in the
        future beyond ``future_tolerance_h`` (it would stamp a tombstone that every later
        commit refuses)."""
        if not (_is_hours(t) and t <= wall + self.future_tolerance_h):  # type: ignore[operator]
            raise ValueError(
                f"{what}={t!r} must be hours since the epoch, finite and not in "
                f"the future (wall clock {wall:.1f} h); seconds divided by 3600 "
                f"give hours"
            )

    def _delta_name(self, ext: str) -> str:
        return f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.{ext}"

    # ------------------------------------------------------------ validation
    def _checked(
        self,
        recs: Records,
        *,
        dim: int,
        source: str,
        existing: set[str] | None,
        reading: bool = False,
        extra: Sequence[Problem] = (),
    ) -> Records:
        # what was written under one clock is read under another: both may be off by the
        # allowance, so reading allows twice the skew writing does
        skew = self.future_tolerance_h * (READ_SKEW if reading else 1.0)
        problems = [
            *extra,
            *validate(recs, dim=dim, existing_ids=existing, future_tolerance_h=skew),
        ]
        if not problems:
            return recs
        if not self.quarantine:
            raise InvalidRecordsError(source, problems)
        bad = sorted({r for p in problems for r in p.rows})
        keep = np.ones(len(recs), dtype=bool)
        keep[bad] = False
        self._quarantine(recs, bad, problems, source)
        return recs.mask(keep)

    def _quarantine(
        self, recs: Records, rows: list[int], problems: list[Problem], source: str
    ) -> None:
        qdir = self.root / "quarantine"
        qdir.mkdir(parents=True, exist_ok=True)
        bad = recs.take(rows)
        reasons: dict[int, list[str]] = {}
        for p in problems:
            for r in p.rows:
                reasons.setdefault(r, []).append(p.kind)
        table = records_to_arrow(
            Records(
                bad.meta.assign(
                    text=[
                        t if isinstance(t, str) and utf8_ok(t) else None for t in bad.meta["text"]
                    ]
                ),
                bad.vectors,
            ),  # as given: NaN and inf stay (fp32 keeps them)
            "fp32",
        )
        table = table.append_column(
            "quarantine_reason", pa.array(["; ".join(reasons[r]) for r in rows])
        )
        table = table.append_column("quarantine_source", pa.array([source] * len(rows)))
        # one file per (source, bad ids): loading the same bad snapshot twice adds nothing
        key = hashlib.sha256((source + "\n" + "\n".join(map(str, bad.meta["id"]))).encode())
        path = qdir / f"{key.hexdigest()[:16]}.parquet"
        if not path.exists():
            _write_atomic(path, lambda p: _write_parquet(table, p))

    # ------------------------------------------------------------ commit (under lock)
    @contextlib.contextmanager
    def lock(self, timeout_s: float = 0.0, poll_s: float = 0.2) -> Iterator[None]:
        """Hold the store's exclusive lock (one pass or undo at a time).

        Uses ``fcntl.flock`` on ``LOCK``: the kernel releases it when the process exits,
        so a crashed pass never leaves the store locked.

        Args:
            timeout_s: seconds to wait for the lock (0 = fail at once).

        Raises:
            LockTimeoutError: still held by another process after ``timeout_s``; the message
                names its pid and host.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        with _flock(
            self.root / "LOCK",
            timeout_s,
            poll_s,
            lambda holder: f"store {self.root} is locked by another pass ({holder or '?'})",
            stamp=True,
        ):
            yield

    def transact(
        self,
        change: Callable[[Snapshot], Any],
        *,
        timeout_s: float = 0.0,
        dry_run: bool = False,
        pass_time_h: float | None = None,
    ) -> dict[str, Any]:
        """One transaction: take :meth:`lock`, :meth:`load`, apply ``change``, :meth:`commit`.

        Args:
            change: called with the snapshot read; returns the new records and their
                changelog events, as ``(records, events)`` or an object with ``.records``
                and ``.events`` (a :class:`~consolidate.pipeline.PassResult`), e.g.
                ``lambda snap: run_pass(snap.records, cfg=cfg, version=snap.version + 1)``.
            timeout_s: seconds to wait for the lock.
            dry_run, pass_time_h: as for :meth:`commit`.

        Returns:
            What :meth:`commit` returns (``unchanged: True`` and no new version when the
            change left every record as it was).

        Raises:
            LockTimeoutError, ConcurrentCommitError, InvalidRecordsError: as :meth:`lock`
                and :meth:`commit`; ``change``'s own errors leave the store as it was.
        """
        with self.lock(timeout_s=timeout_s):
            snap = self.load()
            out = change(snap)
            records, events = (out.records, out.events) if hasattr(out, "events") else out
            return self.commit(
                records, list(events), base=snap, dry_run=dry_run, pass_time_h=pass_time_h
            )

    # ------------------------------------------------------------ the format's own
    @abc.abstractmethod
    def head(self) -> Any:
        """The current version's marker; :class:`StoreNotFoundError` if there is none."""

    @abc.abstractmethod
    def _create_here(self, records: Records, source: str) -> None:
        """Write the first version of checked ``records`` into the (locked) directory."""

    @abc.abstractmethod
    def load(self, *, validate_records: bool = True) -> Snapshot:
        """The current version with the deltas not yet folded (see the subclass)."""

    @abc.abstractmethod
    def append(self, records: Records | Iterable[Mapping[str, Any]]) -> list[str]:
        """Add new memories without the pass lock; returns their ids."""

    @abc.abstractmethod
    def _stored(self, ids: Sequence[Any]) -> pd.DataFrame:
        """The stored rows of ``ids`` (id, namespace, pinned, deleted_at, ...)."""

    @abc.abstractmethod
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
        """Commit a pass's (or an undo's) records as the next version, under :meth:`lock`."""

    @abc.abstractmethod
    def snapshots(self) -> list[int]:
        """The versions retained, ascending."""

    def options(self) -> dict[str, Any]:
        """The constructor settings of this handle, for a new store like it."""
        return {
            "keep_snapshots": self.keep_snapshots,
            "quarantine": self.quarantine,
            "future_tolerance_h": self.future_tolerance_h,
            "vector_dtype": self.vector_dtype,
        }

    def namespaces(self) -> set[str]:
        """Every namespace of the store, live or not (read from the current version)."""
        return set(self.load().records.meta["namespace"].unique())

    def maintain(self) -> dict[str, Any] | None:
        """Housekeeping after a commit that wrote a version (the Lance store compacts and
        removes old versions); ``None`` where a commit already did it (Parquet)."""
        return None


class ParquetStore(StoreBase):
    """The Parquet store: a snapshot file per version and a pointer swapped atomically (see
    the module docstring for the layout). Every commit rewrites the snapshot. Constructor:
    :class:`StoreBase`."""

    FORMAT: ClassVar[str] = "parquet"

    def _dirs(self) -> None:
        super()._dirs()
        (self.root / "snapshots").mkdir(parents=True, exist_ok=True)

    def head(self) -> Pointer:
        """The current pointer. Raises :class:`StoreNotFoundError` if there is none."""
        try:
            text = self.pointer_path.read_text()
        except FileNotFoundError:
            raise StoreNotFoundError(f"no store at {self.root} (missing {POINTER})") from None
        except NotADirectoryError:
            raise StoreNotFoundError(f"{self.root} is not a directory") from None
        except IsADirectoryError:
            raise CorruptStoreError(
                f"{self.pointer_path} is a folder, not a pointer file"
            ) from None
        except UnicodeDecodeError as e:
            raise CorruptStoreError(
                f"{self.pointer_path} is not a valid pointer (not UTF-8: {e})"
            ) from None
        try:
            ptr = Pointer.from_json(text)
            if not (
                isinstance(ptr.version, int)
                and isinstance(ptr.dim, int)
                and isinstance(ptr.snapshot, str)
                and ptr.version >= 1
                and ptr.dim >= 1
            ):
                raise ValueError("version, dim or snapshot has the wrong type")
            check_vector_dtype(ptr.vector_dtype)
            _check_pointer_names(ptr)
            _check_pointer_values(ptr)
            return ptr
        except (ValueError, TypeError, AttributeError, KeyError) as e:  # incl. not UTF-8
            raise CorruptStoreError(
                f"{self.pointer_path} is not a valid pointer ({e}); the "
                f"snapshots in {self.root / 'snapshots'} are untouched"
            ) from e

    def _create_here(self, records: Records, source: str) -> None:
        """Write version 1 of checked ``records`` at ``root`` (a new folder)."""
        self._dirs()
        with self.lock():
            ev = [{"op": "create", "source": source, "records": len(records)}]
            self._write_version(
                1,
                records,
                events=ev,
                folded=(),
                last_pass_at=None,
                vector_dtype=self.vector_dtype or "fp32",
            )

    # ------------------------------------------------------------ read
    def load(self, *, validate_records: bool = True) -> Snapshot:
        """Read the current snapshot and apply pending deltas.

        Raises:
            StoreNotFoundError: no store here.
            InvalidRecordsError: a record in the snapshot or a delta is invalid; the message
                names the file and the record ids. In quarantine mode the bad rows are moved
                to ``quarantine/`` instead (the snapshot file itself is not changed).
        """
        ptr = self.head()
        path = self.root / "snapshots" / ptr.snapshot
        try:
            if validate_records and ptr.snapshot_sha256 is not None:
                got = _file_sha256(path)
                if got != ptr.snapshot_sha256:
                    raise CorruptStoreError(
                        f"snapshot {path} does not match the sha256 recorded in "
                        f"{self.pointer_path} (the file changed after it was written: a "
                        f"flipped bit, a partial copy); restore it from a backup or point "
                        f"CURRENT at an older snapshot"
                    )
            table, vectors = _read_snapshot(path, ptr.dim)
            if ptr.rows is not None and table.num_rows != ptr.rows:
                raise CorruptStoreError(
                    f"snapshot {path} has {table.num_rows} rows, "
                    f"{self.pointer_path} records {ptr.rows}"
                )
            recs = records_from_arrow(table, dim=ptr.dim, vectors=vectors)
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
            raise CorruptStoreError(
                f"cannot read snapshot {path} named by {self.pointer_path}: {e}"
            ) from e
        del table  # its columns are decoded: do not hold both through validation
        if validate_records:
            recs = self._checked(recs, dim=ptr.dim, source=str(path), existing=None, reading=True)
        applied, new_ids = [], []
        for name in self._pending(ptr):
            recs, added = self._apply_delta(recs, name, ptr.dim, validate_records)
            applied.append(name)
            new_ids += added
        return Snapshot(ptr.version, recs, ptr.dim, tuple(applied), new_ids, path, ptr.last_pass_at)

    # ------------------------------------------------------------ write (no lock)
    def append(self, records: Records | Iterable[Mapping[str, Any]]) -> list[str]:
        """Add new records through a delta file; safe while a pass runs.

        Vectors are rescaled to unit length. ``text_hash`` is recomputed.

        Args:
            records: :class:`Records` or dicts (see :func:`records_from_rows`).

        Returns:
            The ids written (empty if every row went to quarantine).

        Raises:
            InvalidRecordsError: a record is invalid (also a duplicate of a stored id); the
                message names the record ids; nothing is written (unless quarantine mode).
        """
        ptr = self.head()
        records = self._new_rows(records, ptr.dim)
        # the check against stored ids and the write happen under a writers' lock, so two
        # concurrent appends of one id cannot both pass (passes do not take this lock)
        with self._writers_lock():
            view = self.load(validate_records=False)
            if view.dim != ptr.dim:  # re-embedded meanwhile: checked against the new store
                ptr = self.head()
            records = self._checked(
                records,
                dim=view.dim,
                source=f"append() to {self.root}",
                existing=set(view.records.meta["id"]),
            )
            if not len(records):
                return []
            normalise_vectors(records)
            name = self._delta_name("parquet")
            _write_atomic(
                self.root / "deltas" / name,
                lambda p: _write_parquet(records_to_arrow(records, ptr.vector_dtype), p),
            )
        return list(records.meta["id"])

    def _stored(self, ids: Sequence[Any]) -> pd.DataFrame:
        """``id`` and ``pinned`` of the stored records among ``ids`` (pending deltas
        included); one row per known id."""
        meta = self.load(validate_records=False).records.meta
        wanted = {i for i in ids if isinstance(i, str)}
        return meta.loc[meta["id"].isin(wanted), ["id", "pinned"]]

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
        """Write ``records`` as snapshot ``base.version + 1`` with its changelog and swap.

        Must be called while holding :meth:`lock`. Deltas written after ``base`` was read are
        carried into the new snapshot (added records appended unchanged, touches applied,
        following ``merged_into`` for records the pass merged); they are listed in the
        changelog as ``carried``.

        Args:
            records: the full new record set (live and tombstones), as the pass returned it.
            events: changelog events (JSON-serialisable dicts).
            base: the snapshot the pass read.
            dry_run: write only the changelog (``changelogs/dry-run-<N+1>-<time>.jsonl``).
            pass_time_h: wall time of the pass (hours since epoch) stored in the pointer.
            op: what wrote the version (``"pass"``, ``"undo"``); the changelog's events say
                it here, a Lance version also in its properties.

        Returns:
            ``{"version", "snapshot", "changelog", "carried_records", "carried_touches"}``.

        Raises:
            ConcurrentCommitError: ``CURRENT`` no longer points at ``base.version``.
        """
        ptr = self.head()
        self._check_commit(ptr, base, records)
        late = [n for n in self._pending(ptr) if n not in set(base.deltas)]
        records, carried_ids, n_touch = self._carry(records, late, ptr.dim)
        if late:
            events = events + [{"op": "carried", "deltas": late, "record_ids": carried_ids}]
        version = ptr.version + 1
        leftover = tuple(n for n in ptr.folded if (self.root / "deltas" / n).exists())
        if (not dry_run and not late and not base.deltas and not leftover
                and self._unchanged(ptr, records, base.records)):  # fmt: skip
            # nothing to change: no new version (the pass's events are in its summary)
            return {
                "version": ptr.version,
                "snapshot": None,
                "changelog": None,
                "carried_records": 0,
                "carried_touches": 0,
                "unchanged": True,
            }
        if dry_run:
            name = f"dry-run-{version:06d}-{dry_run_stamp()}.jsonl"
            _write_atomic(self.root / "changelogs" / name, lambda p: _write_jsonl(p, events))
            carried = {"carried_records": len(carried_ids), "carried_touches": n_touch}
            return {"version": ptr.version, "snapshot": None, "changelog": name, **carried}
        # deltas folded by the previous commit whose cleanup did not finish (crash) stay
        # listed (``leftover``), so they are never applied twice
        folded = leftover + tuple(base.deltas) + tuple(late)
        snap, log = self._write_version(
            version,
            records,
            events,
            folded,
            pass_time_h if pass_time_h is not None else hours_now(),
            self.vector_dtype or ptr.vector_dtype,
        )
        self._cleanup(folded)
        return {
            "version": version,
            "snapshot": snap,
            "changelog": log,
            "carried_records": len(carried_ids),
            "carried_touches": n_touch,
        }

    def _check_commit(self, ptr: Pointer, base: Snapshot, records: Records) -> None:
        """Refuse a commit over a version other than the one the pass read, or of invalid
        records (nothing is written).

        Raises:
            ConcurrentCommitError: ``CURRENT`` no longer points at ``base.version``.
            InvalidRecordsError: the records are invalid (:func:`validate`).
        """
        if ptr.version != base.version:
            raise ConcurrentCommitError(
                f"{self.root}: pointer is at version {ptr.version}, the pass read "
                f"{base.version}; rerun the pass"
            )
        problems = validate(
            records, dim=ptr.dim, future_tolerance_h=READ_SKEW * self.future_tolerance_h
        )
        if problems:
            raise InvalidRecordsError(
                f"the new snapshot for {self.root} (nothing written)", problems
            )

    def _carry(self, records: Records, late: list[str], dim: int) -> tuple[Records, list[str], int]:
        """``records`` with the delta files ``late`` (written after the pass read its
        snapshot) applied in order; returns them, the ids of the records the deltas added
        and the number of touch and patch files."""
        carried_ids: list[str] = []
        n_touch = 0
        for name in late:
            records, added = self._apply_delta(records, name, dim)
            carried_ids += added
            n_touch += name.endswith((".touch.json", ".patch.json"))
        return records, carried_ids, n_touch

    def _unchanged(self, ptr: Pointer, records: Records, base: Records) -> bool:
        """Whether ``records`` are the stored snapshot's rows as they are (nothing to
        commit): a quick check against the loaded ``base``, then the rows as they would be
        written against the stored file (:meth:`_same_as_stored`)."""
        if not _maybe_same(records, base):
            return False
        table = records_to_arrow(records, self.vector_dtype or ptr.vector_dtype)
        return self._same_as_stored(ptr, table)

    def _same_as_stored(self, ptr: Pointer, table: pa.Table) -> bool:
        """Whether ``table`` (records as :meth:`commit` would write them) equals the snapshot
        ``ptr`` names, row for row: compared with the file, not with the records the pass
        read (a change made in place, or a row quarantined at load, is a change)."""
        if ptr.rows is not None and table.num_rows != ptr.rows:
            return False
        try:
            stored = pq.ParquetFile(
                self.root / "snapshots" / ptr.snapshot,
                page_checksum_verification=True,
                pre_buffer=False,
            )
            if not stored.schema_arrow.equals(table.schema):
                return False
            at = 0
            # a row group at a time: the file is never held whole beside ``table``
            for batch in stored.iter_batches(batch_size=ROW_GROUP_ROWS):
                k = batch.num_rows
                if at + k > table.num_rows or not pa.Table.from_batches([batch]).equals(
                    table.slice(at, k)
                ):
                    return False
                at += k
        except (OSError, ValueError, pa.ArrowException):
            return False
        return at == table.num_rows

    def _write_version(
        self,
        version: int,
        records: Records,
        events: list[dict[str, Any]],
        folded: tuple[str, ...],
        last_pass_at: float | None,
        vector_dtype: str,
    ) -> tuple[str, str]:
        snap = f"snapshot-{version:06d}.parquet"
        log = f"changelog-{version:06d}.jsonl"
        table = records_to_arrow(records, vector_dtype)
        digest: dict[str, str] = {}

        def write_snapshot(p: Path) -> None:
            _write_parquet(table, p)
            digest["sha256"] = _file_sha256(p)  # of the bytes written, checked at load

        try:
            _write_atomic(self.root / "snapshots" / snap, write_snapshot, crash_tag="snapshot")
            _crashpoint("after_snapshot")
            _write_atomic(
                self.root / "changelogs" / log,
                lambda p: _write_jsonl(p, events),
                crash_tag="changelog",
            )
            _crashpoint("after_changelog")
            ptr = Pointer(
                version,
                snap,
                log,
                records.dim,
                folded,
                hours_now(),
                last_pass_at,
                vector_dtype,
                digest["sha256"],
                table.num_rows,
            )
            _write_atomic(
                self.pointer_path, lambda p: p.write_text(ptr.to_json()), crash_tag="pointer"
            )
        except Exception:
            # e.g. a full disk: leave no snapshot or changelog that CURRENT does not name
            with contextlib.suppress(Exception):
                if not self.exists() or self.head().snapshot != snap:
                    for f in (self.root / "snapshots" / snap, self.root / "changelogs" / log):
                        f.unlink(missing_ok=True)
            raise
        _crashpoint("after_pointer")
        return snap, log

    def _cleanup(self, folded: tuple[str, ...]) -> None:
        """Remove folded deltas, stale temp files and snapshots beyond retention."""
        for name in folded:
            with contextlib.suppress(FileNotFoundError):
                (self.root / "deltas" / name).unlink()
        keep_from = self.head().version - self.keep_snapshots + 1
        for sub, pat in (("snapshots", _SNAP), ("changelogs", re.compile(r"changelog-(\d+)"))):
            for p in (self.root / sub).iterdir():
                m = pat.match(p.name)
                old = m is not None and int(m.group(1)) < keep_from
                stale_tmp = p.name.startswith(".") and ".tmp-" in p.name
                if old or stale_tmp:
                    p.unlink()
        for p in self.root.glob(f".{POINTER}.tmp-*"):
            p.unlink()
        remove_stale_tmp(self.root / "deltas")

    def snapshots(self) -> list[int]:
        """Versions of the snapshot files present (retained history), ascending."""
        d = self.root / "snapshots"
        return sorted(int(m.group(1)) for p in d.iterdir() if (m := _SNAP.match(p.name)))


#: the Parquet store's first name (``from consolidate.store import Store``)
Store = ParquetStore


#: rows per row group of a Parquet file this store writes: a load decodes a snapshot's
#: vectors one group at a time (:func:`_read_snapshot`)
ROW_GROUP_ROWS = 65_536


def _write_parquet(table: pa.Table, path: Path) -> None:
    """Write a snapshot or delta with a CRC32 checksum per data page (checked on read), in
    row groups of :data:`ROW_GROUP_ROWS` rows."""
    pq.write_table(table, path, write_page_checksum=True, row_group_size=ROW_GROUP_ROWS)


def _read_parquet(path: Path) -> pa.Table:
    """Read a snapshot or delta, verifying the page checksums written by
    :func:`_write_parquet` (a flipped bit raises instead of loading silently)."""
    return pq.read_table(path, page_checksum_verification=True)


def _read_snapshot(path: Path, dim: int | None) -> tuple[pa.Table, np.ndarray | None]:
    """Read a snapshot as ``(table, vectors)``, verifying page checksums
    (:func:`_read_parquet`).

    A fixed-size vector column ``dim`` wide (any stored dtype) is read row group by row
    group: each group's vectors are decoded into one ``float32 [n, d]`` array allocated up
    front (:func:`~consolidate.store.vectors.empty_vectors`) and its other columns kept as
    ``table``'s chunks. The peak is the output plus one row group, not the whole encoded
    column beside its decoded copy (a snapshot of 10^6 x 384 fp32 written in one row group
    peaked at 5.3 GB to read). Every column of a row is read from the same group, so a
    footer that miscounts a group cannot shift the vectors against the ids. Any other
    vector column (a variable-length list another writer left) is read with the table,
    ``vectors`` ``None``, for :func:`~consolidate.store.schema.records_from_arrow` to
    decode and check row by row.

    Raises:
        OSError, pyarrow.ArrowException: the file cannot be read, or a checksum fails.
        ValueError: the row groups hold another number of rows than the footer's total.
    """
    # pre_buffer off: on, the reader keeps every row group's encoded column chunks it has
    # read (1.5 GB more for 10^6 x 384 fp32, and twice the time)
    pf = pq.ParquetFile(path, page_checksum_verification=True, pre_buffer=False)
    schema = pf.schema_arrow
    vtype = schema.field("vector").type if "vector" in schema.names else None
    if (
        vtype is None
        or not pa.types.is_fixed_size_list(vtype)
        or (dim is not None and vtype.list_size != dim)
    ):
        return pf.read(), None
    vcols = ["vector", *([SCALE_COLUMN] if SCALE_COLUMN in schema.names else [])]
    n = pf.metadata.num_rows
    vectors = empty_vectors(n, vtype.list_size)
    parts = []
    at = 0
    for g in range(pf.num_row_groups):
        group = pf.read_row_group(g)
        k = group.num_rows
        if at + k > n:
            raise ValueError(f"the row groups of {path} hold more rows than its footer's {n}")
        scale = group.column(SCALE_COLUMN) if SCALE_COLUMN in vcols else None
        vectors[at : at + k] = decode_vectors(group.column("vector"), scale)
        parts.append(group.drop_columns(vcols))
        at += k
        del group  # its vectors are decoded: the next group reuses their memory
    if at != n:
        raise ValueError(f"the row groups of {path} hold {at} rows, its footer says {n}")
    table = pa.concat_tables(parts) if parts else schema.empty_table().drop_columns(vcols)
    return table, vectors


def dry_run_stamp() -> str:
    """The UTC time of a dry run for its changelog's name (``20261202T045712.123456Z``;
    microseconds keep two dry runs in one second apart)."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{time.time_ns() // 1000 % 10**6:06d}Z"


def _maybe_same(new: Records, read: Records) -> bool:
    """A cheap first test of a commit that may change nothing: ``False`` when ``new``
    differs from the records the pass read (then the commit writes); ``True`` sends the
    commit on to the exact comparison with the stored snapshot (the records read may have
    been changed in place)."""
    if len(new) != len(read):
        return False
    if new is read or new.meta is read.meta:
        return True
    a, b = new.meta, read.meta
    return (
        list(a.columns) == list(b.columns)
        and a.equals(b)
        and np.array_equal(new.vectors, read.vectors)
    )


def _write_jsonl(path: Path, events: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for e in events:
            f.write(json.dumps(e, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class DeltaError(ValueError):
    """A recall-bookkeeping or patch delta file that fails its checksum or the rules of the
    API that writes it (the message names the file and the entry)."""


_PATCH_REASONS = (None, "deleted", "updated", "superseded")


def _json_digest(body: Mapping[str, Any]) -> str:
    """sha256 hex digest of ``body`` as canonical JSON (sorted keys, no spaces; floats
    written by ``repr`` round-trip, so the digest of a parsed file is the digest written)."""
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    ).hexdigest()


def _delta_payload(body: Mapping[str, Any], written: float) -> str:
    """The text of a JSON delta: ``body`` plus ``written`` (the writer's wall clock, hours
    since the epoch) and ``sha256`` (:func:`_json_digest` of the rest)."""
    out = {**body, "written": float(written)}
    out["sha256"] = _json_digest(out)
    return json.dumps(out)


def _name_hours(name: str) -> float | None:
    """The wall clock a delta file name starts with (``<time_ns>-...``), hours; ``None`` if
    the name has no such prefix."""
    head = name.split("-", 1)[0]
    return int(head) / 3.6e12 if head.isdigit() and len(head) == 20 else None


def read_json_delta(path: Path, *, skew_h: float, wall: float | None = None) -> dict[str, Any]:
    """Read and check a recall-bookkeeping (``*.touch.json``) or patch (``*.patch.json``)
    delta with the rules :meth:`Store.mark_used` and :meth:`Store.patch` apply when they write
    one.

    Checked: the ``sha256`` of the file's content (files written before deltas carried one
    have neither ``sha256`` nor ``written`` and are checked by the rules alone); every time
    finite hours since the epoch and not later than ``wall + skew_h``; a touch's ids strings
    and its ``strength_cap`` null or >= 1; a patch's ops ``delete`` or ``close`` only, its
    reasons those :meth:`Store.patch` takes, ``into`` null or another id. Pinned records are
    checked when the patch is applied (:func:`apply_patch`).

    Args:
        path: the delta file.
        skew_h: allowed clock skew, hours.
        wall: the reader's wall clock, hours since the epoch (default: now).

    Returns:
        The parsed delta, with ``written`` (hours) set: the file's own, else the time its
        name starts with, else ``None``.

    Raises:
        OSError: the file cannot be read.
        DeltaError: it is not valid JSON of that form, its checksum does not match, or an
            entry breaks a rule (names the file and the entry).
    """
    rules = _DeltaRules(path, hours_now() if wall is None else wall, skew_h)
    d = rules.load()
    if path.name.endswith(".touch.json"):
        rules.check_touch(d)
    elif path.name.endswith(".patch.json"):
        rules.check_patches(d)
    else:
        raise rules.bad("not a recall-bookkeeping or patch delta name")
    return d


class _DeltaRules:
    """The checks of :func:`read_json_delta` for one file, at wall clock ``wall`` (hours)
    with ``skew_h`` hours of clock skew allowed."""

    def __init__(self, path: Path, wall: float, skew_h: float) -> None:
        self.path, self.wall, self.late = path, wall, wall + skew_h

    def bad(self, why: str) -> DeltaError:
        return DeltaError(f"delta {self.path}: {why}")

    def when(self, what: str, t: object) -> float:
        """``t`` as hours, if finite and not after the wall clock (plus skew)."""
        if not _is_hours(t) or t > self.late:  # type: ignore[operator]
            raise self.bad(
                f"{what}={t!r} is not finite hours since the epoch before now "
                f"(wall clock {self.wall:.1f} h)"
            )
        return float(t)  # type: ignore[arg-type]

    def load(self) -> dict[str, Any]:
        """The file as a JSON object, its ``sha256`` checked and removed, ``written`` set."""
        try:
            d = json.loads(self.path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise self.bad(f"not JSON ({e})") from None
        if not isinstance(d, dict):
            raise self.bad("not a JSON object")
        if "sha256" in d or "written" in d:
            sha = d.pop("sha256", None)
            if not isinstance(sha, str) or _json_digest(d) != sha:
                raise self.bad("content does not match its sha256 (changed after it was written)")
            w = d.get("written")
            if not (_is_hours(w) and w <= self.late):  # type: ignore[operator]
                raise self.bad(f"written={w!r} is not a time before now")
        else:
            d["written"] = _name_hours(self.path.name)
        return d

    def check_touch(self, d: dict[str, Any]) -> None:
        """A recall-bookkeeping delta: ids strings, ``now`` a time, ``strength_cap`` null or
        >= 1 (``now`` made a float)."""
        if set(d) - {"ids", "now", "strength_cap", "written"} or "ids" not in d:
            raise self.bad(f"keys {sorted(d)} are not those of a recall-bookkeeping delta")
        ids = d["ids"]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise self.bad("ids is not a list of strings")
        d["now"] = self.when("now", d.get("now"))
        cap = d.get("strength_cap")
        if cap is not None and not (_is_hours(cap) and cap >= 1):
            raise self.bad(f"strength_cap={cap!r} is not null or a number >= 1")

    def check_patches(self, d: dict[str, Any]) -> None:
        """A patch delta: ``delete`` ops (a time, a known reason, ``into`` another id) and
        ``close`` ops (``valid_to`` hours) only."""
        if set(d) - {"patches", "written"} or not isinstance(d.get("patches"), list):
            raise self.bad(f"keys {sorted(d)} are not those of a patch delta")
        for k, p in enumerate(d["patches"]):
            if not isinstance(p, dict) or not isinstance(p.get("id"), str):
                raise self.bad(f"patch {k} has no string id")
            i, op = p["id"], p.get("op")
            if op == "delete":
                if set(p) - {"id", "op", "into", "at", "reason"}:
                    raise self.bad(f"patch {k} ({i!r}) has unknown keys {sorted(set(p))}")
                p["at"] = self.when(f"at of patch {k} ({i!r})", p.get("at"))
                into = p.get("into")
                if into is not None and (not isinstance(into, str) or into == i):
                    raise self.bad(f"patch {k} ({i!r}): into={into!r} is not another record's id")
                if p.get("reason") not in _PATCH_REASONS:
                    raise self.bad(f"patch {k} ({i!r}): unknown reason {p.get('reason')!r}")
            elif op == "close":
                if set(p) - {"id", "op", "valid_to"}:
                    raise self.bad(f"patch {k} ({i!r}) has unknown keys {sorted(set(p))}")
                if not _is_hours(p.get("valid_to")):
                    raise self.bad(
                        f"patch {k} ({i!r}): valid_to={p.get('valid_to')!r} is not hours"
                    )
            else:
                raise self.bad(f"patch {k} ({i!r}): unknown op {op!r} (delete or close)")


def apply_patch(
    recs: Records, patches: Sequence[Mapping[str, Any]], retired: float | None = None
) -> Records:
    """Apply :meth:`Store.patch` entries (unknown ids are skipped: they may be purged).

    A patch aimed at a record that a pass has merged since (``deleted_reason="merged"``)
    follows ``merged_into`` to the record that now holds its fact, as recalls do: a fact the
    write path deleted or closed while a pass ran must not stay current inside the merge.

    Args:
        recs: the records.
        patches: entries as :meth:`Store.patch` writes them.
        retired: wall clock (hours since the epoch) at which the patch was written: a
            deleted record's ``deleted_at``, from which the tombstone retention window
            counts. ``None`` (a delta written before deltas recorded it): each entry's
            ``at``.

    Raises:
        DeltaError: a delete names a pinned record (pinned records are never deleted).
    """
    meta = recs.meta.copy()
    pos = {i: k for k, i in enumerate(meta["id"])}
    deleted = meta["deleted_at"].to_numpy(np.float64).copy()
    reason = meta["deleted_reason"].tolist()
    into = meta["merged_into"].tolist()
    vto = meta["valid_to"].to_numpy(np.float64).copy()
    pinned = meta["pinned"].to_numpy(bool)
    for p in patches:
        k = pos.get(p["id"])
        if k is not None and p["op"] == "delete" and pinned[k]:
            raise DeltaError(f"patch deletes {p['id']!r}, which is pinned (never deleted)")
        seen: set[int] = set()
        while (
            k is not None and k not in seen and reason[k] == "merged" and isinstance(into[k], str)
        ):
            seen.add(k)
            k = pos.get(into[k])
        if k is None:
            continue
        if p["op"] == "delete" and np.isnan(deleted[k]) and not pinned[k]:
            deleted[k] = p["at"] if retired is None else max(retired, p["at"])
            reason[k] = p.get("reason") or ("updated" if p.get("into") else "deleted")
            into[k] = p.get("into")
        elif p["op"] == "close":
            vto[k] = p["valid_to"] if np.isnan(vto[k]) else min(vto[k], p["valid_to"])
    meta["deleted_at"] = deleted
    meta["deleted_reason"] = pd.Series(reason, dtype=object)
    meta["merged_into"] = pd.Series(into, dtype=object)
    meta["valid_to"] = vto
    return Records(meta, recs.vectors, origin=recs.origin)


def apply_touch(
    recs: Records, ids: Sequence[str], now: float, strength_cap: float | None
) -> Records:
    """Apply recall bookkeeping to ``recs`` (returns a new ``Records``).

    For each id, in order: follow ``merged_into`` to the record it was merged into, then
    ``last_used = max(last_used, now)`` and ``strength = min(strength + 1, cap)`` (a
    strength already above the cap is left as it is). A record dropped by decay or the cap
    (``deleted_reason`` floor/cap) is revived: it was just used. Undone merges are skipped.
    Unknown ids are ignored (the record may have been purged by then).
    """
    meta = recs.meta.copy()
    pos = {i: k for k, i in enumerate(meta["id"])}
    merged = meta["merged_into"].tolist()
    reason = meta["deleted_reason"].tolist()
    deleted = meta["deleted_at"].to_numpy(np.float64).copy()
    lu = meta["last_used"].to_numpy(np.float64).copy()
    st = meta["strength"].to_numpy(np.float64).copy()
    cap = math.inf if strength_cap is None else float(strength_cap)
    for i in ids:
        k = pos.get(i)
        hops = 0
        while k is not None and isinstance(merged[k], str) and hops < 64:
            k = pos.get(merged[k])
            hops += 1
        if k is None or reason[k] == "undone":
            continue
        if reason[k] in ("floor", "cap"):
            # recalled after (or while) the pass dropped it: the memory is in use, revive it
            deleted[k] = np.nan
            reason[k] = None
        lu[k] = max(lu[k], now)
        st[k] = max(st[k], min(st[k] + 1.0, cap))  # never lowers a strength above the cap
    meta["last_used"] = lu
    meta["strength"] = st
    meta["deleted_at"] = deleted
    meta["deleted_reason"] = pd.Series(reason, dtype=object)
    return Records(meta, recs.vectors, origin=recs.origin)

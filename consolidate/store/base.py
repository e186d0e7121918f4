"""The interface every store of record gives: :class:`MemoryStore`.

Two implementations sit side by side, neither inheriting the other:
:class:`~consolidate.store.lance.LanceStore` (one Lance dataset, the default) and
:class:`~consolidate.store.store.ParquetStore` (a snapshot file per version). What they
share in code (deltas, quarantine, locks, :meth:`MemoryStore.create`, ``mark_used``,
``patch``, ``transact``) is :class:`~consolidate.store.store.StoreBase`; what differs between
formats is said by three class attributes, so callers ask the store instead of testing its
class:

* ``FORMAT``: ``"lance"`` or ``"parquet"``;
* ``PARTIAL_LOADS``: ``load(namespaces=[...])`` reads only those namespaces and
  ``trigger(importance)`` fires per namespace (the nightly run's incremental load, fleet runs);
* ``TIME_TRAVEL``: every commit stays readable as a version (``consolidate-versions``).

Open a store with :func:`~consolidate.store.lance.open_store_dir`, which picks the class
from the folder's ``CURRENT`` marker through :data:`FORMATS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .schema import Records
    from .store import Snapshot

from ..registry import Registry

__all__ = ["MemoryStore", "FORMATS"]

#: ``store.format`` -> the class of that format
FORMATS = Registry(
    "store format",
    {
        "lance": "consolidate.store.lance:LanceStore",
        "parquet": "consolidate.store.store:ParquetStore",
    },
)


@runtime_checkable
class MemoryStore(Protocol):
    """A memory store directory that a pass reads and commits to.

    Attributes:
        root: the store directory.
        keep_snapshots, quarantine, future_tolerance_h, vector_dtype: the constructor's
            settings (see :class:`~consolidate.store.store.StoreBase`).
        refused_deltas: one line per delta file the last load moved to ``quarantine/``.

    Every method raises :class:`~consolidate.store.store.StoreNotFoundError` where the
    folder holds no store and :class:`~consolidate.store.store.CorruptStoreError` where a
    file it reads fails its checks.
    """

    FORMAT: ClassVar[str]
    PARTIAL_LOADS: ClassVar[bool]
    TIME_TRAVEL: ClassVar[bool]

    root: Path
    keep_snapshots: int
    quarantine: bool
    future_tolerance_h: float
    vector_dtype: str | None
    refused_deltas: list[str]

    def exists(self) -> bool:
        """Whether the folder holds a store (its ``CURRENT`` marker)."""
        ...

    def head(self) -> Any:
        """The current version's marker (version, dim, vector dtype, ...)."""
        ...

    def create(self, records: Records, *, source: str = "records") -> Snapshot:
        """Write the first version into a new or empty folder; ``FileExistsError`` where a
        store is there already."""
        ...

    def load(self, *, validate_records: bool = True) -> Snapshot:
        """The current version with the deltas not yet folded: every record, live and
        tombstones (a store with ``PARTIAL_LOADS`` also takes ``namespaces=[...]``)."""
        ...

    def append(self, records: Records | Iterable[Mapping[str, Any]]) -> list[str]:
        """Add new memories without the pass lock; returns their ids."""
        ...

    def mark_used(
        self,
        ids: Sequence[str],
        *,
        now: float | None = None,
        strength_cap: float | None = ...,
    ) -> None:
        """Recall bookkeeping: ``last_used`` to ``now`` (hours) and strength + 1."""
        ...

    def patch(self, patches: Sequence[Mapping[str, Any]], *, now: float | None = None) -> None:
        """Tombstones and closed validity from the write path."""
        ...

    def lock(self, timeout_s: float = 0.0, poll_s: float = 0.2) -> AbstractContextManager[None]:
        """The pass lock (one pass or undo at a time)."""
        ...

    def transact(
        self,
        change: Callable[[Snapshot], Any],
        *,
        timeout_s: float = 0.0,
        dry_run: bool = False,
        pass_time_h: float | None = None,
    ) -> dict[str, Any]:
        """Lock, load, ``change(snapshot)``, commit what it returns."""
        ...

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
        """Commit a pass's (or an undo's) records as the next version, under :meth:`lock`;
        returns what was written (``version``, ``changelog``, ``carried_records``, ...)."""
        ...

    def snapshots(self) -> list[int]:
        """The versions retained, ascending."""
        ...

    def options(self) -> dict[str, Any]:
        """The constructor settings of this handle, for a new store like it."""
        ...

    def namespaces(self) -> set[str]:
        """Every namespace of the store, live or not."""
        ...

    def maintain(self) -> dict[str, Any] | None:
        """Housekeeping after a commit that wrote a version; ``None`` where there is none."""
        ...

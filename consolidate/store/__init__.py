"""Memory store: one interface (:class:`MemoryStore`), two formats side by side (the Lance
store, the default, and the Parquet store), the record schema and validation, importers.

Importing it does not import torch: :class:`MemoryBatch` and :func:`resolve_device` (the
store's records as tensors) load it when first named, so a process that only reads or writes
a store (a fleet run's read tasks, ``consolidate-versions``) starts without it."""

from typing import Any

from .base import MemoryStore
from .lance import LanceStore, open_store_dir
from .schema import (
    InvalidRecordsError,
    Records,
    datetime_from_hours,
    hours_from_datetime,
    hours_now,
    records_from_rows,
    validate,
)
from .store import (
    ConcurrentCommitError,
    CorruptStoreError,
    LockTimeoutError,
    ParquetStore,
    Snapshot,
    Store,
    StoreBase,
    StoreNotFoundError,
    apply_touch,
)

__all__ = [
    "MemoryStore",
    "ParquetStore",
    "StoreBase",
    "MemoryBatch",
    "resolve_device",
    "InvalidRecordsError",
    "Records",
    "datetime_from_hours",
    "hours_from_datetime",
    "hours_now",
    "records_from_rows",
    "validate",
    "ConcurrentCommitError",
    "CorruptStoreError",
    "LockTimeoutError",
    "Snapshot",
    "Store",
    "StoreNotFoundError",
    "apply_touch",
    "LanceStore",
    "open_store_dir",
]


def __getattr__(name: str) -> Any:
    """:class:`MemoryBatch` and :func:`resolve_device`, imported (with torch) when named."""
    if name in ("MemoryBatch", "resolve_device"):
        from . import batch

        return getattr(batch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

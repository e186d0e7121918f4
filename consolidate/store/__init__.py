"""Memory store: one interface (:class:`MemoryStore`), two formats side by side (the Lance
store, the default, and the Parquet store), the record schema and validation, importers."""

from .base import MemoryStore
from .batch import MemoryBatch, resolve_device
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

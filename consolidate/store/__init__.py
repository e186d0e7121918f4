"""Memory store: schema, validation, the Lance store (default) and the Parquet store,
importers."""

from .batch import MemoryBatch, resolve_device
from .lance_store import LanceStore, open_store_dir
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
    Snapshot,
    Store,
    StoreNotFoundError,
    apply_touch,
)

__all__ = [
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

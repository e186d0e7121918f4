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

from .dataset import CHECKSUMS, DATASET, FORMAT, SCAN_BATCH
from .files import write_records_file
from .store import LanceStore, convert, open_store_dir, store_format
from .writing import commit_update

__all__ = [
    "CHECKSUMS",
    "DATASET",
    "FORMAT",
    "SCAN_BATCH",
    "LanceStore",
    "commit_update",
    "convert",
    "open_store_dir",
    "store_format",
    "write_records_file",
]

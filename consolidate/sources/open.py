"""The external source a ``source`` config names (``consolidate/conf/source/*.yaml``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

__all__ = ["open_source", "source_records", "SOURCE_KINDS"]

#: the external source kinds (``store``, the default, is the store of ``store.*``)
SOURCE_KINDS = ("pgvector", "mem0", "jsonl", "lance")


def open_source(src: Any, embedder: Callable[[], Any] | None = None) -> tuple[Any, str]:
    """The source of ``src`` (a :class:`~consolidate.config.SourceConfig`) and its name for
    reports.

    Args:
        src: ``kind`` ``pgvector`` (:class:`~consolidate.sources.pgvector.PgVectorTable`),
            ``mem0`` (:class:`~consolidate.sources.mem0.Mem0Source`) or ``jsonl``
            (:class:`~consolidate.sources.files.FileSource`: JSONL, Parquet or CSV) or
            ``lance`` (:class:`~consolidate.sources.lance_table.LanceTable`: a Lance dataset
            or LanceDB table of the user's schema).
        embedder: makes the embedder a memory file without vectors needs (called only
            then).

    Raises:
        ValueError: another kind, or a setting the kind needs is missing.
        ImportError: the kind's package is not installed (names the extra to install).
    """
    if src.kind == "jsonl":
        from .files import FileSource

        if not src.path:
            raise ValueError("source=jsonl needs source.path=FILE (.jsonl, .parquet or .csv)")
        return (
            FileSource(
                src.path, src.namespace, _Lazy(embedder) if embedder else None, src.state_dir
            ),
            f"file {src.path}",
        )
    if src.kind == "lance":
        from .lance_table import LanceColumns, LanceTable

        if not src.path:
            raise ValueError(
                "source=lance needs source.path=DATASET (a LanceDB table: <db>/<table>.lance)"
            )
        return (
            LanceTable(src.path, LanceColumns(**_columns(src, LanceColumns)), src.state_dir),
            f"Lance dataset {src.path}",
        )
    if src.kind == "mem0":
        os.environ.setdefault("MEM0_TELEMETRY", "False")
        from .mem0 import Mem0Source

        if not src.mem0:
            raise ValueError("source=mem0 needs source.mem0 (Memory.from_config's config)")
        try:
            from mem0 import Memory
        except ImportError as e:
            raise ImportError('source=mem0 needs mem0ai: pip install "consolidate[mem0]"') from e
        try:
            memory = Memory.from_config(dict(src.mem0))
        except Exception as e:  # noqa: BLE001 - Mem0 raises its providers' own errors
            if "api_key" not in str(e).lower() and "credentials" not in str(e).lower():
                raise
            raise ValueError(
                f"Mem0 could not build the LLM client of its config ({str(e).splitlines()[0]})"
                f": the pass never calls Mem0's LLM, but Mem0 builds one (OpenAI unless "
                f"source.mem0.llm says otherwise); give it its key (OPENAI_API_KEY) or "
                f"source.mem0.llm as your Mem0 uses it"
            ) from None
        return (
            Mem0Source(
                memory, src.namespace_key, src.importance_key, src.pinned_key, src.state_dir
            ),
            "mem0 store",
        )
    if src.kind != "pgvector":
        raise ValueError(f"source must be store, {', '.join(SOURCE_KINDS)}; got {src.kind!r}")
    from .pgvector import PgColumns, PgVectorTable

    if not src.dsn or not src.table:
        raise ValueError("source=pgvector needs source.dsn=... and source.table=...")
    return (
        PgVectorTable(src.dsn, src.table, PgColumns(**_columns(src, PgColumns))),
        f"pgvector table {src.table}",
    )


def _columns(src: Any, cls: type) -> dict[str, Any]:
    """``source.columns`` checked against the fields of ``cls``.

    Raises:
        ValueError: an unknown key (names the allowed ones)."""
    known = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(src.columns) - known)
    if extra:
        raise ValueError(f"unknown key(s) {extra} in 'source.columns' (allowed: {sorted(known)})")
    return dict(src.columns)


class _Lazy:
    """An embedder made on first use."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make

    def encode(self, texts: Any) -> Any:
        return self.make().encode(texts)


def source_records(source: Any, snap: Any) -> Any:
    """The records a source's snapshot holds for the pass (a file's: those of the
    namespaces read)."""
    return source.records(snap) if hasattr(source, "records") else snap.records

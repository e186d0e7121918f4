"""The external source a ``source`` config names (``consolidate/conf/source/*.yaml``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..registry import Registry, did_you_mean
from .base import Source

__all__ = ["open_source", "SOURCE_KINDS", "SOURCES"]

#: kind -> ``"module:function"`` that opens it: ``function(src, embedder) -> (source, name)``
#: (``store``, the default, is the store of ``store.*`` and not an external source)
SOURCES = Registry(
    "source",
    {
        "pgvector": "consolidate.sources.open:_open_pgvector",
        "mem0": "consolidate.sources.open:_open_mem0",
        "jsonl": "consolidate.sources.open:_open_jsonl",
        "lance": "consolidate.sources.open:_open_lance",
    },
)
#: the external source kinds registered with this package
SOURCE_KINDS = SOURCES.names()


def open_source(src: Any, embedder: Callable[[], Any] | None = None) -> tuple[Source, str]:
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
        ValueError: a kind not in :data:`SOURCES` (with the closest), or a setting the kind
            needs is missing, or (Mem0) its local Qdrant folder is open in another process.
        FileNotFoundError: (Mem0) no Qdrant folder at the configured path, unless
            ``source.allow_empty``.
        ImportError: the kind's package is not installed (names the extra to install).
    """
    if src.kind not in SOURCES:
        raise ValueError(
            f"source must be store, {', '.join(SOURCE_KINDS)}; got {src.kind!r}"
            f"{did_you_mean(str(src.kind), ('store', *SOURCE_KINDS))}"
        )
    opener: Callable[[Any, Callable[[], Any] | None], tuple[Source, str]] = SOURCES.load(src.kind)
    return opener(src, embedder)


def _open_jsonl(src: Any, embedder: Callable[[], Any] | None) -> tuple[Any, str]:
    """``source=jsonl``: a JSONL, Parquet or CSV memory file."""
    from .files import FileSource

    if not src.path:
        raise ValueError("source=jsonl needs source.path=FILE (.jsonl, .parquet or .csv)")
    return (
        FileSource(
            src.path,
            src.namespace,
            _Lazy(embedder) if embedder else None,
            src.state_dir,
            write=src.write,
        ),
        f"file {src.path}",
    )


def _open_lance(src: Any, embedder: Callable[[], Any] | None) -> tuple[Any, str]:
    """``source=lance``: a Lance dataset or LanceDB table of the user's schema."""
    from .lance_table import LanceColumns, LanceTable

    if not src.path:
        raise ValueError(
            "source=lance needs source.path=DATASET (a LanceDB table: <db>/<table>.lance)"
        )
    return (
        LanceTable(src.path, LanceColumns(**_columns(src, LanceColumns)), src.state_dir),
        f"Lance dataset {src.path}",
    )


def _open_mem0(src: Any, embedder: Callable[[], Any] | None) -> tuple[Any, str]:
    """``source=mem0``: a Mem0 ``Memory`` built from ``source.mem0``; a local Qdrant folder is
    checked (missing, locked) before Mem0 loads its embedding model."""
    os.environ.setdefault("MEM0_TELEMETRY", "False")
    import logging

    from .mem0 import Mem0Source

    # Mem0 logs each update at INFO and warns of optional extras the pass does not use
    # (BM25 search, spaCy): the job's output keeps to its own lines and Mem0's errors
    logging.getLogger("mem0").setLevel(logging.ERROR)

    if not src.mem0:
        raise ValueError("source=mem0 needs source.mem0 (Memory.from_config's config)")
    try:
        from mem0 import Memory
    except ImportError as e:
        raise ImportError('source=mem0 needs mem0ai: pip install "consolidate[mem0]"') from e
    local = _local_qdrant(src.mem0)
    if local is not None and not Path(local).exists() and not src.allow_empty:
        raise FileNotFoundError(
            f"source.mem0.vector_store.config.path: no Qdrant folder at {local} (Mem0 "
            f"would start a new, empty store there); source.allow_empty=true to start one"
        )
    if local is not None and Path(local).exists():
        _check_qdrant(local, src)  # before Mem0 loads its embedding model
    try:
        memory = Memory.from_config(_plain(src.mem0))
    except Exception as e:  # noqa: BLE001 - Mem0 raises its providers' own errors
        if "already accessed by another instance" in str(e):
            raise _locked(local) from None
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
            memory,
            src.namespace_key,
            src.importance_key,
            src.pinned_key,
            src.state_dir,
            drops=src.drops,
        ),
        f"mem0 store {local or _plain(src.mem0).get('vector_store', {}).get('provider', '')}".strip(),
    )


def _open_pgvector(src: Any, embedder: Callable[[], Any] | None) -> tuple[Any, str]:
    """``source=pgvector``: a PostgreSQL + pgvector table with the user's column names."""
    from .pgvector import PgColumns, PgVectorTable

    if not src.dsn or not src.table:
        raise ValueError("source=pgvector needs source.dsn=... and source.table=...")
    return (
        PgVectorTable(src.dsn, src.table, PgColumns(**_columns(src, PgColumns))),
        f"pgvector table {src.table}",
    )


def _plain(node: Any) -> dict[str, Any]:
    """A config node (or dict) as plain dicts and lists."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        return dict(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]
    return dict(node)


def _local_qdrant(mem0: Any) -> str | None:
    """The local folder of a Mem0 config's Qdrant vector store (``None``: another store, or
    a Qdrant server)."""
    vs = _plain(mem0).get("vector_store") or {}
    c = vs.get("config") or {}
    if vs.get("provider") != "qdrant" or c.get("url") or c.get("host"):
        return None
    return c.get("path")


def _locked(path: str | None) -> ValueError:
    return ValueError(
        f"the Qdrant folder {path} is open in another process (Qdrant's local mode allows "
        f"one client per folder): stop the agent's Memory, or run the pass on a copy of the "
        f"folder"
    )


def _check_qdrant(path: str, src: Any) -> None:
    """Open the local Qdrant folder of a Mem0 source once, by itself, before Mem0 builds
    its embedder: the folder is not held by another process, the collection exists, and
    (when it holds memories) some have ``source.namespace_key``.

    Raises:
        ValueError: the folder is open elsewhere, the collection is missing (unless
            ``source.allow_empty``), or no memory has the namespace key.
    """
    from qdrant_client import QdrantClient

    from .mem0 import _KEYS

    vs = _plain(src.mem0).get("vector_store") or {}
    name = (vs.get("config") or {}).get("collection_name") or "mem0"
    try:
        client = QdrantClient(path=path)
    except RuntimeError as e:
        if "already accessed by another instance" in str(e):
            raise _locked(path) from None
        raise
    try:
        have = [c.name for c in client.get_collections().collections]
        if name not in have:
            if src.allow_empty:
                return
            raise ValueError(
                f"source.mem0.vector_store.config.collection_name: the Qdrant folder {path} "
                f"has no collection {name!r} (it has {have}); source.allow_empty=true to "
                f"start an empty one"
            )
        n, keys, offset = 0, set(), None
        while True:
            points, offset = client.scroll(
                collection_name=name, limit=4096, offset=offset, with_payload=list(_KEYS)
            )
            n += len(points)
            for q in points:
                keys.update(k for k in _KEYS if (q.payload or {}).get(k) is not None)
            if src.namespace_key in keys or offset is None:
                break
        if n and src.namespace_key not in keys:
            raise ValueError(
                f"none of the {n} memories of the Mem0 store has the namespace key "
                f"{src.namespace_key!r} (source.namespace_key); they have "
                f"{sorted(keys) or 'none of ' + str(list(_KEYS))}"
            )
    finally:
        client.close()


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

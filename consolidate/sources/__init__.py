"""Memories from outside a store: plain files (:mod:`consolidate.sources.files`),
PostgreSQL + pgvector tables (:mod:`consolidate.sources.pgvector`), Mem0 stores
(:mod:`consolidate.sources.mem0`); :func:`~consolidate.sources.open.open_source` opens the
one a ``source`` config names."""

from .files import FILE_SUFFIXES, FileImport, FileSnapshot, FileSource, read_memories

__all__ = ["FILE_SUFFIXES", "FileImport", "FileSnapshot", "FileSource", "read_memories"]

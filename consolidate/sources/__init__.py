"""Memories from outside a store, behind one interface (:class:`~consolidate.sources.base.
Source`): plain files (:mod:`consolidate.sources.files`), PostgreSQL + pgvector tables
(:mod:`consolidate.sources.pgvector`), Mem0 stores (:mod:`consolidate.sources.mem0`) and
Lance datasets or LanceDB tables (:mod:`consolidate.sources.lance_table`);
:func:`~consolidate.sources.open.open_source` opens the one a ``source`` config names."""

from .base import Source
from .files import FILE_SUFFIXES, FileImport, FileSnapshot, FileSource, read_memories

__all__ = ["FILE_SUFFIXES", "FileImport", "FileSnapshot", "FileSource", "Source", "read_memories"]

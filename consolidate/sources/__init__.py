"""Memories from outside a store: plain files (:mod:`consolidate.sources.files`)."""

from .files import FILE_SUFFIXES, FileImport, read_memories

__all__ = ["FILE_SUFFIXES", "FileImport", "read_memories"]

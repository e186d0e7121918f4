"""The interface every external source gives: :class:`Source`.

A source is a store a user already has (a memory file, a pgvector table, a Mem0 store, a
LanceDB table). The nightly run treats them all alike: :meth:`Source.read` a consistent
snapshot, :meth:`Source.records` for the pass, :meth:`Source.plan` units from the pass's
result, :meth:`Source.apply` them (a dry run unless asked), and :meth:`Source.undo` a unit
or a plan later. The implementations are :class:`~consolidate.sources.files.FileSource`,
:class:`~consolidate.sources.pgvector.PgVectorTable`,
:class:`~consolidate.sources.mem0.Mem0Source` and
:class:`~consolidate.sources.lance_table.LanceTable`, registered by kind in
:data:`consolidate.sources.open.SOURCES`; ``tests/sources/test_sources_protocol.py`` checks that each
gives this interface with these signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from ..store.schema import Records
from .common import ApplyReport, Plan, UndoReport

__all__ = ["Source"]


@runtime_checkable
class Source(Protocol):
    """An external store the pass reads from and applies its units to.

    Attributes:
        KIND: the ``source.kind`` that opens it (``jsonl``, ``pgvector``, ``mem0``,
            ``lance``).
    """

    KIND: ClassVar[str]

    def read(self, namespaces: Sequence[str] | None = None) -> Any:
        """A consistent snapshot of the memories of ``namespaces`` (all when ``None``): an
        object with ``records`` (:class:`~consolidate.store.schema.Records`) and whatever
        the source's plan and apply need (ids as read, hashes, a file digest).

        Raises:
            ValueError: a row the source cannot read as a memory (named by id and source).
        """
        ...

    def records(self, snap: Any) -> Records:
        """The records of ``snap`` the pass runs on (its live rows and tombstones, with the
        keep-apart constraints of earlier undos)."""
        ...

    def plan(self, snap: Any, result: Records) -> Plan:
        """The units that turn ``snap`` into the pass's ``result`` (merges; drops where the
        source plans them); the plan id depends only on what was read and the units, not
        on the wall clock, so a dry run and the apply after it share it."""
        ...

    def apply(
        self, plan: Any, *, dry_run: bool = True, out_dir: str | Path | None = None
    ) -> ApplyReport:
        """Apply ``plan`` unit by unit, each whole or not at all (a unit whose rows changed
        since the read is skipped and reported); ``dry_run`` writes nothing to the source.
        ``out_dir``: a folder for what a dry run writes besides its report (the memory file
        writes the consolidated file there; the others write nothing)."""
        ...

    def undo(self, target: str) -> UndoReport:
        """Undo what ``target`` names: a merged id, a dropped id or a plan id, or a unique
        prefix of one; undoing again restores nothing.

        Raises:
            UndoTargetError (a ``ValueError``): ``target`` matches nothing, or several.
        """
        ...

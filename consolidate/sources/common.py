"""What the external sources share: their plans and apply reports, and the step that turns
what a source read into records as a store holds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..store.schema import (
    InvalidRecordsError,
    Problem,
    Records,
    normalise_vectors,
    records_from_arrow,
    records_to_arrow,
    validate,
)

__all__ = ["Plan", "ApplyReport", "as_stored"]


@dataclass
class Plan:
    """The changes of one pass over an external source, in units applied whole or not at
    all.

    Attributes:
        plan_id: a hash of what was read and the units (a plan applies once).
        units: one dict per unit, with at least ``kind`` (``merge``, ``drop``, ``update``),
            ``namespace`` and ``ids`` (the stored rows it touches).
    """

    plan_id: str
    units: list[dict[str, Any]]

    def counts(self) -> dict[str, int]:
        """Units per kind."""
        out: dict[str, int] = {}
        for u in self.units:
            out[u["kind"]] = out.get(u["kind"], 0) + 1
        return out


@dataclass
class ApplyReport:
    """What an apply did (in a dry run: would do).

    Attributes:
        dry_run: nothing was written.
        applied: units applied, per kind.
        skipped: ``{"unit", "namespace", "why"}`` for each unit not applied.
    """

    dry_run: bool
    applied: dict[str, int] = field(default_factory=dict)
    skipped: list[dict[str, Any]] = field(default_factory=list)


def as_stored(
    recs: Records,
    source: str,
    *,
    now_h: float | None = None,
    first_line: int | None = None,
    lines: list[int] | None = None,
    unit: str = "line",
) -> Records:
    """``recs`` checked and shaped as a store holds them: validated
    (:func:`~consolidate.store.schema.validate`, and every ``merged_into`` names a record of
    ``recs``), vectors at unit length, times in whole
    microseconds (through the store's Arrow schema).

    Args:
        source: named in the error (a file, a table).
        now_h: the clock for times in the future (hours since the epoch; default now).
        first_line: the number of the first record's line (or row: ``unit``) in its file,
            to name records by line as well as id; ``None``: by id only.
        lines: ``[n]`` each record's line in its file (overrides ``first_line``; a CSV
            record with a quoted line break spans several lines).
        unit: ``"line"`` or ``"row"``, the word for ``first_line``.

    Raises:
        InvalidRecordsError: any problem (nothing is returned).
    """
    problems = validate(recs, dim=recs.dim, now_h=now_h)
    into = recs.meta["merged_into"]
    ghost = np.flatnonzero((into.notna() & ~into.isin(recs.meta["id"])).to_numpy(bool))
    if len(ghost):
        ids = recs.meta["id"].tolist()
        problems.append(
            Problem(
                "merged_into names no record of the same input",
                ghost.tolist(),
                [ids[k] for k in ghost],
            )
        )
    if problems:
        if first_line is not None:
            ids = recs.meta["id"].tolist()

            def at(k: int) -> int:
                return k + first_line if lines is None else lines[k]

            first: dict[Any, int] = {}
            if any(p.kind == "duplicate id" for p in problems):
                for k in range(len(ids) - 1, -1, -1):  # one pass: each id's first row
                    first[ids[k]] = k

            def name(kind: str, k: int) -> str:
                if kind == "duplicate id" and first.get(ids[k], k) < k:
                    # both places: the first record with the id and this one
                    return f"{ids[k]} ({unit}s {at(first[ids[k]])} and {at(k)})"
                return f"{ids[k]} ({unit} {at(k)})"

            problems = [
                Problem(p.kind, p.rows, [name(p.kind, k) for k in p.rows]) for p in problems
            ]
        raise InvalidRecordsError(source, problems)
    normalise_vectors(recs)
    return records_from_arrow(records_to_arrow(recs))

"""Late writes: an agent's write that lands on a row an apply retired, after the unit that
retired it (an edit made with the row id it read before the apply, a recall bookkeeping
update, a revived row). The row is not lost from the source, but the agent's next read
no longer sees it and the merged row does not hold it, so every source that keeps
retired rows finds these writes and settles them, the same way:

- **carried**: the write changed only bookkeeping columns (``last_used``, ``strength``,
  ``importance``, ``pinned``) of a merge's member, and the merged row is live: the merged
  row takes them (the later ``last_used``, the larger ``importance``, a pin, the strength
  the write added);
- **undone**: any other write (the text, the vector, the namespace, the user's own
  columns, a row made live again), or a write on a dropped row: the unit is undone (its
  members live again with the agent's write, the merged row retired), without keeping
  the members apart: the next pass may merge them again, with the write. When the merged
  row was written too since the apply, it stays live beside the restored members
  (nothing is retired that an agent wrote);
- **left**: the unit cannot be settled now (its merged row was merged again by a later
  plan, or another job holds the namespace): reported, and tried again by the next apply.

Each source finds late writes by a digest of every retired row, taken when the apply
retired it, over the row's columns except the three the retirement sets (``deleted_at``,
``merged_into``, ``updated_at``). Used by :mod:`consolidate.sources.pgvector` and
:mod:`consolidate.sources.lance_table`; a Mem0 store deletes its retired members, so
nothing lands on them (an agent's update of a deleted memory fails in Mem0).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CARRY",
    "LateWrite",
    "backoff",
    "carried_values",
    "changed_columns",
    "row_digest",
    "settle",
]

#: the pass's bookkeeping fields a late write may change and still be carried
CARRY = ("last_used", "strength", "importance", "pinned")


@dataclass
class LateWrite:
    """One unit with late writes, and what was done about it.

    Attributes:
        plan_id: the plan that applied the unit.
        key: the unit's key (the merged row's id, or the dropped row's id).
        kind: ``merge`` or ``drop``.
        rows: the retired rows written since the apply.
        columns: the columns those writes changed (the table's names; ``vector`` when
            only the vector changed; ``live`` when a row was made live again).
        action: ``carried``, ``undone``, ``left`` (see the module docstring), or
            ``would carry`` / ``would undo`` in a dry run.
        why: for ``left``, the reason; for ``undone``, which column forced it.
    """

    plan_id: str
    key: str
    kind: str
    rows: list[str]
    columns: list[str] = field(default_factory=list)
    action: str = ""
    why: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The report's form (JSON-ready)."""
        return {
            "plan_id": self.plan_id,
            "unit": self.key,
            "kind": self.kind,
            "rows": list(self.rows),
            "columns": list(self.columns),
            "action": self.action,
            "why": self.why,
        }


def backoff(attempt: int) -> None:
    """Sleep before trying a commit again that lost a race with another writer: a random
    time up to 20 ms x 2^attempt (at most 1.28 s), so that writers that collided do not
    collide again."""
    time.sleep(random.uniform(0.0, 0.02 * 2 ** min(attempt, 6)))


def _canon(v: Any) -> Any:
    """A value in a form that hashes the same however the driver returned it."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "isoformat"):
        return v.isoformat()
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, (bytes, bytearray)):
        return v.hex()
    if isinstance(v, Mapping):
        return {str(k): _canon(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_canon(x) for x in v]
    return v


def row_digest(row: Mapping[str, Any], skip: tuple[str, ...] | list[str] = ()) -> str:
    """SHA-256 (hex, 32 digits) of ``row``'s columns except ``skip``, in a canonical JSON
    form (sorted keys; times as ISO text; arrays as lists; NaN as null).

    Args:
        row: column -> value, as a source read it.
        skip: the columns left out (those a retirement sets).
    """
    body = {str(k): _canon(v) for k, v in row.items() if k not in skip}
    blob = json.dumps(body, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _later(a: Any, b: Any) -> bool:
    """``a > b`` for two values of one column (datetimes, numbers, ISO text of one style)."""
    try:
        return bool(a > b)
    except TypeError:
        return bool(_canon(a) > _canon(b))


def changed_columns(
    before: Mapping[str, Any], now: Mapping[str, Any], skip: tuple[str, ...] | list[str] = ()
) -> list[str]:
    """The columns whose values differ between ``before`` and ``now`` (``skip`` left out),
    compared in the canonical form of :func:`row_digest`; sorted."""
    keys = (set(before) | set(now)) - set(skip)
    return sorted(k for k in keys if _canon(before.get(k)) != _canon(now.get(k)))


def settle(
    kind: str,
    changed: list[str],
    carry_columns: Mapping[str, str],
    merged_live: bool,
) -> tuple[str, str]:
    """What to do with a unit whose retired rows were written since the apply.

    Args:
        kind: the unit's kind (``merge`` or ``drop``).
        changed: the columns the late writes changed (the source's names), with ``live``
            when a row was made live again and ``vector`` for a vector-only write.
        carry_columns: pass field (:data:`CARRY`) -> the source's column, for the mapped
            ones.
        merged_live: the merge's merged row exists and is live.

    Returns:
        ``("carry" | "undo", why)``.
    """
    own = set(carry_columns.values())
    if kind != "merge":
        return "undo", "a dropped row was written"
    if not merged_live:
        return "undo", "the merged row is not live"
    other = [c for c in changed if c not in own]
    if other:
        return "undo", f"{', '.join(other)} changed"
    return "carry", ""


def carried_values(
    merged: Mapping[str, Any],
    before: Mapping[str, Any],
    now: Mapping[str, Any],
    carry_columns: Mapping[str, str],
) -> dict[str, Any]:
    """The merged row's new bookkeeping values after carrying one member's late write.

    Args:
        merged: the merged row's current values (source column -> value).
        before: the member as it was when retired (or last carried).
        now: the member as it is now.
        carry_columns: pass field -> the source's column (see :func:`settle`).

    Returns:
        source column -> new value, for the columns that change: ``last_used`` the later
        of the two, ``importance`` the larger, ``pinned`` either, ``strength`` the merged
        row's plus what the write added to the member's (a write that lowered it adds
        nothing).
    """
    out: dict[str, Any] = {}
    for f, col in carry_columns.items():
        b, n, g = before.get(col), now.get(col), merged.get(col)
        if _canon(b) == _canon(n) or n is None:
            continue
        if f in ("last_used", "importance"):
            v = n if g is None or _later(n, g) else g
        elif f == "pinned":
            v = bool(g) or bool(n)
        else:  # strength
            v = (g or 0) + max(0.0, float(n) - float(b or 0))
        if _canon(v) != _canon(g):
            out[col] = v
    return out

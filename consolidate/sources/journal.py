"""The undo journal of an external source kept in a folder beside it (files, Lance datasets,
Mem0): what each applied plan changed, which of its units were undone, and the members an
undo keeps apart.

Layout of the folder (``<source>.consolidate/`` by default; ``source.state_dir``):

- ``applied.jsonl``: one line per applied plan: ``{"plan_id", "at" (ISO 8601 UTC),
  "source", "units": [...]}``; each unit has ``kind`` (``merge`` | ``drop``), ``key`` (a
  merge: its merged id; a drop: the dropped id), ``namespace``, ``ids`` (the members) and
  what the source needs to put them back (e.g. Mem0's payloads and vectors);
- ``undone.jsonl``: one line per undone unit: ``{"plan_id", "key", "at", "restored"}``;
- ``keep_apart.jsonl``: one line per undone merge: ``{"plan_id", "key", "ids"}``; a read
  of the source gives each of these members the others as ``keep_apart``, so no later pass
  merges them again.

Every line is written whole and flushed to disk (``fsync``) before the change it records
is reported done; a reader skips a last line cut short by a crash (it was never reported).
Writers take ``.lock`` (``fcntl.flock``) for the whole undo, so two undos never restore the
same unit twice.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["Journal", "UndoTargetError", "default_state_dir", "match_target"]

#: the shortest prefix of a plan or merge id an undo accepts (as git: 4)
MIN_PREFIX = 4


class UndoTargetError(ValueError):
    """The id given to undo matches nothing, or more than one plan or merge (the message
    lists the candidates)."""


def default_state_dir(path: str | Path) -> Path:
    """The journal folder of a source at ``path``: ``<path>.consolidate`` beside it (a
    trailing ``/`` of a dataset folder ignored)."""
    p = Path(str(path).rstrip("/"))
    return p.with_name(p.name + ".consolidate")


def now_iso() -> str:
    """The wall clock as ISO 8601 UTC with microseconds."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def match_target(
    target: str, plans: list[dict[str, Any]], hint: str | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """The plan and units ``target`` names: a plan id or a unit's key (a merged id, a
    dropped id), whole or by a unique prefix (at least 4 characters unless whole), or
    ``last``: the newest plan applied.

    Args:
        target: the id or prefix the user gave.
        plans: ``{"plan_id", "units": [{"key", ...}]}`` per applied plan, oldest first.
        hint: where the user finds the ids (ends the no-match message).

    Returns:
        ``(plan_id, units)``: every unit of a plan, or the one unit of a key.

    Raises:
        UndoTargetError: no match, a prefix shorter than 4 characters, or several matches
            (names up to 5 of them).
    """
    t = str(target).strip()
    if not t:
        raise UndoTargetError("undo needs an id: a plan id or a merge id (or a unique prefix)")
    exact = [(p, None) for p in plans if p["plan_id"] == t] + [
        (p, u) for p in plans for u in p["units"] if u["key"] == t
    ]
    if t == "last" and not exact and plans and not plans[-1]["plan_id"].startswith("\0"):
        return plans[-1]["plan_id"], list(plans[-1]["units"])
    hits = exact
    if not hits:
        if len(t) < MIN_PREFIX:
            raise UndoTargetError(
                f"{t!r} is too short to undo by prefix: give at least {MIN_PREFIX} characters"
            )
        hits = [(p, None) for p in plans if p["plan_id"].startswith(t)] + [
            (p, u) for p in plans for u in p["units"] if str(u["key"]).startswith(t)
        ]
    if not hits:
        hint = hint or (
            f"{len(plans)} plan(s) applied to this source; the plan id is in the run's "
            f"plan.json, merge ids in its events.jsonl"
        )
        raise UndoTargetError(f"no applied plan or merge has an id starting with {t!r} ({hint})")
    names = {(p["plan_id"], None if u is None else u["key"]) for p, u in hits}
    if len(names) > 1:
        shown = sorted(f"plan {a}" if b is None else f"{b} (plan {a[:12]})" for a, b in names)
        raise UndoTargetError(
            f"{t!r} matches {len(names)} plans or merges, e.g. {shown[:5]}: give more characters"
        )
    p, u = hits[0]
    return p["plan_id"], (list(p["units"]) if u is None else [u])


class Journal:
    """The journal folder of one source (see the module docstring).

    Args:
        folder: the folder (made on the first write).
        source: the source's name for ``applied.jsonl`` (e.g. ``file memories.jsonl``).
    """

    def __init__(self, folder: str | Path, source: str = "") -> None:
        self.dir = Path(folder)
        self.source = source

    # ------------------------------------------------------------ files
    def _lines(self, name: str) -> Iterator[dict[str, Any]]:
        path = self.dir / name
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        lines = text.split("\n")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):  # a last line cut short by a crash: never reported done
                    return
                raise ValueError(f"{path} line {n}: not a JSON object") from None

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / name
        data = "".join(json.dumps(r, default=str, sort_keys=True) + "\n" for r in rows)
        with open(path, "a", encoding="utf-8") as f:
            if f.tell():  # a cut last line (a crash) is ended, so the new ones parse
                with open(path, "rb") as g:
                    g.seek(-1, os.SEEK_END)
                    if g.read(1) != b"\n":
                        f.write("\n")
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold ``.lock`` (exclusive, blocking) for an undo or an apply's record."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ------------------------------------------------------------ records
    @staticmethod
    def unit(u: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """A plan unit as ``applied.jsonl`` holds it: ``kind``, ``key``, ``namespace``,
        ``ids`` and what the source needs to undo it (``extra``)."""
        return {k: u[k] for k in ("kind", "key", "namespace", "ids")} | extra

    def record_apply(self, plan_id: str, units: list[dict[str, Any]]) -> None:
        """Record the units of ``plan_id`` that were applied (each with ``kind``, ``key``,
        ``namespace``, ``ids``)."""
        if units:
            self._append(
                "applied.jsonl",
                [{"plan_id": plan_id, "at": now_iso(), "source": self.source, "units": units}],
            )

    def plans(self) -> list[dict[str, Any]]:
        """Every applied plan, oldest first (a plan applied in several runs: its units
        joined)."""
        out: dict[str, dict[str, Any]] = {}
        for r in self._lines("applied.jsonl"):
            p = out.setdefault(r["plan_id"], {"plan_id": r["plan_id"], "at": r["at"], "units": []})
            p["units"] += r["units"]
        return list(out.values())

    def undone(self) -> dict[tuple[str, str], dict[str, Any]]:
        """``(plan_id, key)`` -> its ``undone.jsonl`` line."""
        return {(r["plan_id"], r["key"]): r for r in self._lines("undone.jsonl")}

    def record_undone(self, plan_id: str, unit: dict[str, Any], restored: list[str]) -> None:
        """Record that ``unit`` of ``plan_id`` is undone; an undone merge's members are kept
        apart from then on."""
        at = now_iso()
        if unit["kind"] == "merge" and len(unit["ids"]) > 1:
            self._append(
                "keep_apart.jsonl",
                [{"plan_id": plan_id, "key": unit["key"], "ids": sorted(unit["ids"])}],
            )
        self._append(
            "undone.jsonl",
            [{"plan_id": plan_id, "key": unit["key"], "at": at, "restored": restored}],
        )

    def keep_apart(self) -> dict[str, set[str]]:
        """id -> the ids an undone merge keeps it apart from."""
        out: dict[str, set[str]] = {}
        for r in self._lines("keep_apart.jsonl"):
            ids = [str(i) for i in r["ids"]]
            for i in ids:
                out.setdefault(i, set()).update(set(ids) - {i})
        return out

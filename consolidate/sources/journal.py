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
  merges them again. An undo the apply made itself for a late write
  (:mod:`consolidate.sources.late`: ``"why"`` in its ``undone.jsonl`` line) keeps nothing
  apart, and an undone drop is read as pinned only after a user's undo;
- ``late.jsonl``: one line per unit whose late writes were carried into its merged row:
  ``{"plan_id", "key", "digests", "at"}``, the rows' digests after the carry, which later
  checks compare against (the apply's own digests are in its ``applied.jsonl`` unit).

``pending.json`` holds the one write in flight (an apply's commit, a unit of Mem0 calls, a
late-write commit) from just before it starts until its lines are written: a run killed in
between leaves it, and the next apply, reconcile or undo finishes the record (or the
write) before anything else (:meth:`Journal.pending`).

Every line is written whole and flushed to disk (``fsync``) before the change it records
is reported done; a reader skips a last line cut short by a crash (it was never reported).
Writers take ``.lock`` (``fcntl.flock``) for the whole undo, so two undos never restore the
same unit twice.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

log = logging.getLogger("consolidate")

__all__ = [
    "Journal",
    "JournalError",
    "UndoTargetError",
    "expand_apart",
    "default_state_dir",
    "match_target",
]

#: the shortest prefix of a plan or merge id an undo accepts (as git: 4)
MIN_PREFIX = 4


class JournalError(ValueError):
    """A line of the undo journal that cannot be read (names the file and the line)."""


class UndoTargetError(ValueError):
    """The id given to undo matches nothing, or more than one plan or merge (the message
    lists the candidates)."""


def default_state_dir(path: str | Path) -> Path:
    """The journal folder of a source at ``path``: ``<real path>.consolidate`` beside the
    file or folder that ``path`` names after symbolic links (a trailing ``/`` of a dataset
    folder ignored), so every path to one source shares its journal, lock and keep-apart
    list. A journal folder beside the path as given (a link) that exists where none exists
    beside the real path is still used, with a warning to move it.
    """
    p = Path(str(path).rstrip("/"))
    real = p.resolve()
    own = real.with_name(real.name + ".consolidate")
    given = p.with_name(p.name + ".consolidate")
    if given.resolve() != own and given.is_dir() and not own.exists():
        log.warning(
            "the journal of %s is %s, beside the link; move it to %s so that every path to "
            "the source shares it (or set source.state_dir)",
            p,
            given,
            own,
        )
        return given
    return own


def now_iso() -> str:
    """The wall clock as ISO 8601 UTC with microseconds."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def match_target(
    target: str,
    plans: list[dict[str, Any]],
    hint: str | None = None,
    undone: Any = (),
) -> tuple[str, list[dict[str, Any]]]:
    """The plan and units ``target`` names: a plan id or a unit's key (a merged id, a
    dropped id), whole or by a unique prefix (at least 4 characters unless whole), or
    ``last``: the newest plan applied.

    Args:
        target: the id or prefix the user gave.
        plans: ``{"plan_id", "units": [{"key", ...}]}`` per applied plan, oldest first.
        hint: where the user finds the ids (ends the no-match message).
        undone: ``(plan_id, key)`` of the units undone: a whole key that several plans
            hold (a member dropped, restored and dropped again) names the newest of them
            not undone (the newest if all are).

    Returns:
        ``(plan_id, units)``: every unit of a plan, or the one unit of a key.

    Raises:
        UndoTargetError: no match, a prefix shorter than 4 characters that some id starts
            with, or several matches (names up to 5 of them).
    """
    t = str(target).strip()
    if not t:
        raise UndoTargetError("undo needs an id: a plan id or a merge id (or a unique prefix)")
    exact = [(p, None) for p in plans if p["plan_id"] == t] + [
        (p, u) for p in plans for u in p["units"] if u["key"] == t
    ]
    if t == "last" and not exact and plans and not plans[-1]["plan_id"].startswith("\0"):
        return plans[-1]["plan_id"], list(plans[-1]["units"])
    if len(exact) > 1 and all(u is not None for _, u in exact):
        # one key in several plans: the newest unit not undone yet (else the newest)
        done = set(undone)
        todo = [h for h in exact if (h[0]["plan_id"], h[1]["key"]) not in done]  # type: ignore[index]
        exact = [(todo or exact)[-1]]
    hits = exact
    if not hits:
        hits = [(p, None) for p in plans if p["plan_id"].startswith(t)] + [
            (p, u) for p in plans for u in p["units"] if str(u["key"]).startswith(t)
        ]
        if hits and len(t) < MIN_PREFIX:
            raise UndoTargetError(
                f"{t!r} is too short to undo by prefix: give at least {MIN_PREFIX} characters"
            )
    if not hits:
        hint = hint or (
            f"{len(plans)} plan(s) applied to this source; the plan id is in the run's "
            f"plan.json, merge ids in its events.jsonl"
        )
        raise UndoTargetError(
            f"no applied plan, merge or drop has an id starting with {t!r} ({hint})"
        )
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
    #: the keys every line of each file has
    _NEED = {
        "applied.jsonl": ("plan_id", "units"),
        "undone.jsonl": ("plan_id", "key"),
        "keep_apart.jsonl": ("ids",),
        "late.jsonl": ("plan_id", "key", "digests"),
    }

    def _lines(self, name: str) -> Iterator[dict[str, Any]]:
        """The lines of ``name`` as dicts, checked; a last line cut short by a crash is
        skipped (it was never reported done).

        Raises:
            JournalError: a line that is not a JSON object with the file's keys (names the
                file and the line).
        """
        path = self.dir / name
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except UnicodeDecodeError as e:
            raise JournalError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        lines = text.split("\n")
        need = self._NEED.get(name, ())
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):  # no newline after it: cut short by a crash
                    return
                raise JournalError(
                    f"{path} line {n}: not JSON ({line[:60]!r}); the undo journal was edited "
                    f"by hand or damaged: restore the line or remove it"
                ) from None
            if not isinstance(row, dict) or any(k not in row for k in need):
                missing = [k for k in need if not isinstance(row, dict) or k not in row]
                raise JournalError(
                    f"{path} line {n}: not a journal line (a JSON object with "
                    f"{', '.join(need)}; missing {', '.join(missing)}): {line[:60]!r}"
                )
            if name == "applied.jsonl" and not (
                isinstance(row["units"], list)
                and all(isinstance(u, dict) and "key" in u and "ids" in u for u in row["units"])
            ):
                raise JournalError(
                    f"{path} line {n}: units is not a list of objects with key and ids"
                )
            if name == "keep_apart.jsonl" and not (
                isinstance(row["ids"], list)
                and all(isinstance(i, (str, int)) and not isinstance(i, bool) for i in row["ids"])
            ):
                raise JournalError(f"{path} line {n}: ids is not a list of ids")
            yield row

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / name
        data = "".join(json.dumps(r, default=str, sort_keys=True) + "\n" for r in rows)
        with open(path, "a+b") as f:
            end = f.seek(0, os.SEEK_END)
            if end:
                # a last line cut short by a crash was never reported done: cut it off, so
                # that it does not become a damaged line in the middle
                f.seek(max(0, end - (1 << 16)))
                tail = f.read()
                if not tail.endswith(b"\n"):
                    nl = tail.rfind(b"\n")
                    keep = end - len(tail) + nl + 1 if nl >= 0 else 0
                    if nl < 0 and end > len(tail):
                        raise JournalError(f"{path}: its last line is longer than 64 KiB and cut")
                    f.truncate(keep)
            f.write(data.encode("utf-8"))
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
        joined). A unit recorded twice under one plan (applied again after a roll-back, or
        recorded again by a recovery after a crash between its line and the end of its
        write) is the newest record of it, in the place of the first; each unit carries
        ``applied_at``, the time of that record."""
        out: dict[str, dict[str, Any]] = {}
        for r in self._lines("applied.jsonl"):
            p = out.setdefault(r["plan_id"], {"plan_id": r["plan_id"], "at": r["at"], "units": {}})
            for u in r["units"]:
                p["units"][u["key"]] = {**u, "applied_at": r.get("at", "")}
        return [{**p, "units": list(p["units"].values())} for p in out.values()]

    def undone(self) -> dict[tuple[str, str], dict[str, Any]]:
        """``(plan_id, key)`` -> its ``undone.jsonl`` line, for the units whose newest
        application (see :meth:`plans`) was undone after it was recorded; a unit rolled back
        and applied again under the same plan id is not undone."""
        applied = {
            (p["plan_id"], u["key"]): u.get("applied_at", "")
            for p in self.plans()
            for u in p["units"]
        }
        out = {}
        for r in self._lines("undone.jsonl"):
            k = (r["plan_id"], r["key"])
            if str(r.get("at", "")) >= str(applied.get(k, "")):
                out[k] = r
            else:
                out.pop(k, None)
        return out

    def record_undone(
        self, plan_id: str, unit: dict[str, Any], restored: list[str], why: str | None = None
    ) -> None:
        """Record that ``unit`` of ``plan_id`` is undone; after a user's undo (``why``
        ``None``) an undone merge's members are kept apart from then on; an undo the apply
        made itself (``why``: a late write) keeps nothing apart."""
        at = now_iso()
        if why is None and unit["kind"] == "merge" and len(unit["ids"]) > 1:
            self._append(
                "keep_apart.jsonl",
                [{"plan_id": plan_id, "key": unit["key"], "ids": sorted(unit["ids"])}],
            )
        line = {"plan_id": plan_id, "key": unit["key"], "at": at, "restored": restored}
        self._append("undone.jsonl", [line | ({"why": why} if why else {})])

    def record_late(
        self, plan_id: str, key: str, digests: dict[str, str], version: int | None = None
    ) -> None:
        """Record the digests of unit ``key``'s rows after its late writes were carried
        (``late.jsonl``), and the version the carry wrote."""
        self._append(
            "late.jsonl",
            [
                {
                    "plan_id": plan_id,
                    "key": key,
                    "digests": digests,
                    "version": version,
                    "at": now_iso(),
                }
            ],
        )

    # ------------------------------------------------------------ the write in flight
    def begin(self, what: dict[str, Any]) -> None:
        """Record ``what`` (JSON-ready) as the write about to start: ``pending.json``,
        written whole (a temporary file, ``fsync``, rename, ``fsync`` of the folder)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / ".pending.json.tmp"
        with open(tmp, "wb") as f:
            f.write(json.dumps(what, default=str, sort_keys=True).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / "pending.json")
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def pending(self) -> dict[str, Any] | None:
        """The write in flight that a killed run left (``pending.json``), or ``None``.

        Raises:
            JournalError: the file is not a JSON object (names it).
        """
        path = self.dir / "pending.json"
        try:
            what = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise JournalError(
                f"{path}: not JSON ({e}); remove it after checking the source"
            ) from None
        if not isinstance(what, dict):
            raise JournalError(f"{path}: not a JSON object")
        return what

    def done(self) -> None:
        """The write in flight is recorded: remove ``pending.json``."""
        with suppress(FileNotFoundError):
            (self.dir / "pending.json").unlink()

    def digests(self) -> dict[tuple[str, str], dict[str, Any]]:
        """``(plan_id, key)`` -> ``{"digests": {row id: digest}, "version": v}``: the digest
        of each row of a unit as the apply (or the newest carry) left it, and the version
        that write made (:mod:`consolidate.sources.late`)."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        rows = [
            (p["plan_id"], u["key"], u.get("digests"), u.get("version"))
            for p in self.plans()
            for u in p["units"]
        ] + [
            (r["plan_id"], r["key"], r["digests"], r.get("version"))
            for r in self._lines("late.jsonl")
        ]
        for plan_id, key, dig, version in rows:
            if isinstance(dig, dict):
                got = out.setdefault((plan_id, key), {"digests": {}, "version": None})
                got["digests"].update(dig)
                got["version"] = version
        return out

    def keep_apart(self) -> dict[str, set[str]]:
        """id -> the ids an undone merge keeps it apart from; a member that was itself the
        merged record of a merge undone later stands for that merge's members too (undo a
        merge of a merge, then the inner merge: its members stay apart from the others)."""
        return expand_apart(
            [(r.get("key"), [str(i) for i in r["ids"]]) for r in self._lines("keep_apart.jsonl")]
        )

    def kept(self) -> set[str]:
        """The ids whose drop was undone (a later read gives them ``pinned``, so no floor or
        cap drops them again)."""
        done = {k for k, r in self.undone().items() if not r.get("why")}
        return {
            str(u["key"])
            for p in self.plans()
            for u in p["units"]
            if u.get("kind") == "drop" and (p["plan_id"], u["key"]) in done
        }


def expand_apart(groups: list[tuple[Any, list[str]]]) -> dict[str, set[str]]:
    """id -> the ids kept apart from it, from ``(merged id, member ids)`` per undone merge;
    a member that is the merged id of another undone merge is replaced by that merge's
    members (and so on), and both are kept apart.

    Args:
        groups: ``(key, ids)`` per undone merge (``key`` may be ``None``).
    """
    inner = {str(k): ids for k, ids in groups if k is not None}

    def members(i: str, seen: set[str]) -> set[str]:
        if i not in inner or i in seen:
            return {i}
        seen.add(i)
        out = {i}
        for j in inner[i]:
            out |= members(j, seen)
        return out

    out: dict[str, set[str]] = {}
    for key, ids in groups:
        # a merged record that kept a member's id stands for itself in its own group
        sets = [members(i, {str(key)} if key is not None else set()) for i in ids]
        for k, a in enumerate(sets):
            others = (
                set().union(*(b for j, b in enumerate(sets) if j != k)) if len(sets) > 1 else set()
            )
            for i in a:
                out.setdefault(i, set()).update(others - a)
    return out

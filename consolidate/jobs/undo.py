"""``consolidate-undo id=...``: undo a merge (or a drop), or every unit of a plan, on the
store or on an external source (Hydra job)."""

from __future__ import annotations

import logging
import sys
from typing import Any

from omegaconf import DictConfig

from ..config import SourceConfig, StoreConfig
from ..store import hours_now
from .cli import job
from .common import as_typed, open_store, typed, user_errors

log = logging.getLogger("consolidate")


def _target(cfg: DictConfig) -> str:
    """``id`` (or its old name ``merge_id``).

    Raises:
        ValueError: neither is set, or both differ."""
    a, b = cfg.get("id"), cfg.get("merge_id")
    if a is None and b is None:
        raise ValueError(
            "consolidate-undo needs id=...: a merge id (the changelog's or events.jsonl's "
            "merge lines), a plan id (plan.json of an external source's run), or a unique "
            "prefix of either; on the store also last or v<N> (every merge and drop of a pass)"
        )
    if a is not None and b is not None and str(a) != str(b):
        raise ValueError(f"id={a} and merge_id={b} differ: give one")
    key = "id" if a is not None else "merge_id"
    return as_typed(key, a if a is not None else b) or ""


def resolve_merge_id(target: str, merged: Any) -> str:
    """The merge id of the store that ``target`` names, whole or by a unique prefix (4
    characters at least).

    Args:
        target: the id or prefix.
        merged: the store's merge ids (the distinct ``merged_into`` values, and the
            merges undone).

    Raises:
        UndoTargetError: no match, too short, or several matches (names 5).
    """
    from ..sources.journal import match_target

    plans = [{"plan_id": f"\0{i}", "units": [{"key": i}]} for i in merged]
    eg = f", e.g. {min(map(str, merged))}" if len(plans) else ""
    hint = (
        f"the store has {len(plans)} merge ids, made or undone{eg}: the `merge` lines of "
        f"changelogs/changelog-*.jsonl list them (a dry-run-*.jsonl lists merges never made)"
    )
    return str(match_target(target, plans, hint)[1][0]["key"])


def run_undo(cfg: DictConfig) -> dict[str, Any]:
    """Undo what ``cfg.id`` names on ``cfg.source`` (default: the store of
    ``cfg.store.dir``); returns what was undone.

    On the store, ``id`` is a merge id (or a unique prefix): one new snapshot with the
    members live and kept apart; undoing it again does nothing. ``id=last``, ``id=v<N>``
    or ``id=changelog-<N>`` undoes every merge and drop of the pass that wrote version N
    (the newest that changed something) in one new version. On an external source it is
    a merge id, a dropped id or a plan id (or a unique prefix of one), through the source's
    own ``undo`` (:mod:`consolidate.sources`).

    Raises:
        UndoTargetError (a ``ValueError``): ``id`` matches nothing, or several things.
        ValueError / KeyError: see :func:`consolidate.pipeline.undo_merge`.
    """
    from ..pipeline import undo_merge  # with torch: not for --help

    target = _target(cfg)
    src: SourceConfig = typed(cfg, "source", SourceConfig)
    if src.kind != "store":
        from ..sources.open import open_source

        source, name = open_source(src)
        rep = source.undo(target)
        return {"source": name, **vars(rep)}
    scfg: StoreConfig = typed(cfg, "store", StoreConfig)
    from ..store import StoreNotFoundError

    try:
        store, _ = open_store(cfg, build=False)
    except StoreNotFoundError as e:
        raise StoreNotFoundError(
            f"{e}; to undo on an external source, give the run's source settings too "
            f"(source=jsonl|lance|mem0|pgvector source.path=... or source.dsn=...)"
        ) from None
    log_file = _pass_changelog(target, store)
    if log_file is not None:
        return _undo_pass(store, scfg, target, log_file)
    with store.lock(timeout_s=scfg.lock_timeout_s):
        snap = store.load()
        meta = snap.records.meta
        merged = set(meta["merged_into"].dropna().unique().tolist())
        merged |= set(meta["id"][meta["deleted_reason"].eq("undone").to_numpy()].tolist())
        merge_id = resolve_merge_id(target, sorted(merged))
        at = meta["id"].eq(merge_id).to_numpy()
        out: dict[str, Any] = {
            "source": f"store {scfg.dir}",
            "target": target,
            "plan_id": None,
            "undone": [],
            "restored": [],
            "already": [],
            "skipped": [],
        }
        if at.any() and meta["deleted_reason"][at].eq("undone").all():
            out["already"] = [merge_id]
            return out
        recs = undo_merge(snap.records, merge_id)
        restored = meta["id"][meta["merged_into"].eq(merge_id).to_numpy()].tolist()
        ev = [{"op": "undo", "id": merge_id, "restored": restored}]
        commit = store.commit(
            recs, ev, base=snap, pass_time_h=snap.last_pass_at or hours_now(), op="undo"
        )
    return {**out, "undone": [merge_id], "restored": restored, **commit}


def _pass_changelog(target: str, store: Any) -> Any:
    """The changelog of the pass that ``target`` names on the store: ``last`` (the newest
    pass that merged or dropped something), ``v<N>`` / ``version-<N>`` (the pass that wrote
    version N, or the newest pass before it when N is a version Lance made itself, such
    as an index build), or a changelog's name (``changelog-<N>``, ``.jsonl`` optional);
    ``None`` for anything else (a merge id).

    Raises:
        UndoTargetError: ``last`` on a store no pass changed; a version no pass wrote.
    """
    import re

    from ..sources.journal import UndoTargetError

    logs = store.root / "changelogs"
    t = target.strip()
    m = re.fullmatch(r"changelog-(\d+)(?:\.jsonl)?", t)
    if m:
        return logs / f"changelog-{int(m.group(1)):06d}.jsonl"
    m = re.fullmatch(r"(?:v|version-)(\d+)", t)
    if m:
        n = int(m.group(1))
        if not hasattr(store, "versions"):
            return logs / f"changelog-{n:06d}.jsonl"
        versions = store.versions()
        newest = max((v["version"] for v in versions), default=0)
        if n > newest:
            raise UndoTargetError(
                f"the store at {store.root} has no version {n} (newest: {newest})"
            )
        passes = [
            v
            for v in versions
            if v["version"] <= n and v.get("op") == "pass" and v.get("changelog")
        ]
        if not passes:
            raise UndoTargetError(f"no pass wrote version {n} or one before it in {store.root}")
        return logs / passes[-1]["changelog"]
    if t != "last":
        return None
    for path in sorted(logs.glob("changelog-*.jsonl"), reverse=True):
        if _pass_events(path):
            return path
    raise UndoTargetError(f"no pass has merged or dropped anything in the store at {store.root}")


def _pass_events(path: Any) -> list[dict[str, Any]]:
    """The merge and drop events of a changelog (``[]`` for a changelog of another
    operation: an undo, an import).

    Raises:
        ValueError: a line that is not JSON (names the file and the line).
    """
    import json

    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path} line {n}: not JSON; the changelog was damaged") from None
        if isinstance(e, dict) and e.get("op") in ("merge", "exact_merge", "drop"):
            out.append(e)
    return out


def _undo_pass(store: Any, scfg: StoreConfig, target: str, path: Any) -> dict[str, Any]:
    """Undo every merge and drop of the pass whose changelog is ``path``, as one new
    version (:func:`consolidate.pipeline.undo.undo_pass`); the plan id is the changelog's
    name.

    Raises:
        UndoTargetError: no such changelog, or one with nothing to undo.
    """
    from ..pipeline.undo import undo_pass
    from ..sources.journal import UndoTargetError

    if not path.is_file():
        have = sorted(p.stem for p in path.parent.glob("changelog-*.jsonl"))
        raise UndoTargetError(
            f"no {path.name} in {path.parent} (the store's newest changelogs: {have[-5:]})"
        )
    events = _pass_events(path)
    if not events:
        raise UndoTargetError(f"{path.name} holds no merge or drop: nothing to undo")
    with store.lock(timeout_s=scfg.lock_timeout_s):
        snap = store.load()
        recs, rep = undo_pass(snap.records, events)
        out: dict[str, Any] = {"source": f"store {scfg.dir}", "target": target}
        out.update(plan_id=path.stem, **rep)
        if not rep["undone"]:
            return out
        ev = [{"op": "undo", "id": i, "of": path.name} for i in rep["undone"]]
        commit = store.commit(
            recs, ev, base=snap, pass_time_h=snap.last_pass_at or hours_now(), op="undo"
        )
    return {**out, **commit}


def format_undo(out: dict[str, Any]) -> str:
    """The job's lines for :func:`run_undo`'s result."""
    lines = []
    what = f"plan {out['plan_id']}" if out.get("plan_id") else "merge"
    if out["undone"]:
        shown = ", ".join(out["restored"][:5]) + (" ..." if len(out["restored"]) > 5 else "")
        lines.append(
            f"undid {len(out['undone'])} unit(s) of {what} on {out['source']}: "
            f"{', '.join(out['undone'][:5])}{' ...' if len(out['undone']) > 5 else ''}; "
            f"restored {len(out['restored'])} records ({shown})"
            + (f"; now at snapshot {out['version']}" if "version" in out else "")
        )
    if out["already"]:
        lines.append(
            f"undone before, nothing done: {len(out['already'])} unit(s) "
            f"({', '.join(out['already'][:5])})"
        )
    for s in out["skipped"][:20]:
        who = f"{s['key']}" + (f" member {s['id']}" if "id" in s else "")
        lines.append(f"left as it is: {who}: {s['why']}")
    if not out["undone"] and not out["already"] and not out["skipped"]:
        lines.append("nothing to undo")
    return "\n".join(lines)


@job("undo")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-undo``: :func:`run_undo`, then what was
    undone; exits 1 when no unit could be undone."""
    with user_errors():
        out = run_undo(cfg)
    print(format_undo(out))
    if out["skipped"] and not out["undone"] and not out["already"]:
        sys.exit(1)  # nothing could be undone: every unit was left as it is


if __name__ == "__main__":
    main()

"""Undo of a merge (its members come back and stay apart), or of a whole pass."""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd

from ..store.schema import Records

__all__ = ["undo_merge", "undo_pass"]


def undo_merge(records: Records, merge_id: str, wall_h: float | None = None) -> Records:
    """Undo a merge: the merged record becomes a tombstone (``deleted_reason="undone"``) and
    its members are live again (``deleted_at``, ``merged_into`` cleared). Each member's
    ``keep_apart`` gets the other members' ids, so later passes keep them apart (listed as
    ``review`` pairs with reason ``"undone merge"``).

    Args:
        records: all records (with tombstones).
        merge_id: id of the merged record.
        wall_h: wall clock, hours since the epoch (default: now).

    Returns:
        New :class:`Records`.

    Raises:
        KeyError: ``merge_id`` is not in the records, or no record was merged into it (for
            example its members were purged after the tombstone retention).
        ValueError: the merged record is no longer live (merged again, dropped or undone):
            undo the later change first.
    """
    wall_h = time.time() / 3600 if wall_h is None else wall_h
    meta = records.meta.copy()
    pos = np.flatnonzero(meta["id"].to_numpy(object) == merge_id)
    if not len(pos):
        raise KeyError(f"no record with id {merge_id!r}")
    p = int(pos[0])
    if not np.isnan(meta["deleted_at"].iat[p]):
        into, why = meta["merged_into"].iat[p], meta["deleted_reason"].iat[p]
        if why == "undone":
            raise ValueError(f"{merge_id!r} was already undone")
        if isinstance(into, str):
            raise ValueError(f"{merge_id!r} was merged again into {into!r}; undo that first")
        raise ValueError(f"{merge_id!r} is not live (deleted: {why}); restore it first")
    members = np.flatnonzero(meta["merged_into"].to_numpy(object) == merge_id)
    if not len(members):
        raise KeyError(f"no record was merged into {merge_id!r}")
    meta.loc[members, "deleted_at"] = math.nan
    meta.loc[members, "deleted_reason"] = None
    meta.loc[members, "merged_into"] = None
    # the undo sticks: later passes never merge these members with each other again
    member_ids = meta["id"].to_numpy(object)[members].tolist()
    apart = meta["keep_apart"].tolist()
    for r in members:
        apart[r] = sorted(set(apart[r]) | (set(member_ids) - {meta["id"].iat[r]}))
    meta["keep_apart"] = pd.Series(apart, dtype=object)
    meta.loc[p, "deleted_at"] = wall_h
    meta.loc[p, "deleted_reason"] = "undone"
    return Records(meta, records.vectors, origin=records.origin)


def undo_pass(
    records: Records, events: list[dict], wall_h: float | None = None
) -> tuple[Records, dict[str, list]]:
    """Undo every merge and floor or cap drop one pass made (the ``merge``, ``exact_merge``
    and ``drop`` events of its changelog), as array operations: each merged record still
    live becomes a tombstone (``deleted_reason="undone"``) and its members live again,
    kept apart from each other (as :func:`undo_merge`); each dropped record still a
    tombstone of that drop is live again and ``pinned``, so no later floor or cap drops it
    again.

    Args:
        records: all records (with tombstones), ids unique.
        events: the pass's changelog events (other ops are ignored).
        wall_h: wall clock, hours since the epoch (default: now).

    Returns:
        ``(records, report)``: ``report`` has ``undone`` (the merged and dropped ids
        undone now), ``restored`` (the ids live again), ``already`` (undone or live
        before) and ``skipped`` (``{"key", "why"}``: merged again or dropped since, or
        purged: undo the later change first).
    """
    wall_h = time.time() / 3600 if wall_h is None else wall_h
    meta = records.meta.copy()
    ids = meta["id"].to_numpy(object)
    index = pd.Index(ids)
    dead = ~np.isnan(meta["deleted_at"].to_numpy(float))
    reason = meta["deleted_reason"].to_numpy(object)
    into = meta["merged_into"].to_numpy(object)
    rep: dict[str, list] = {"undone": [], "restored": [], "already": [], "skipped": []}
    mids = np.array([e["id"] for e in events if e.get("op") in ("merge", "exact_merge")], object)
    did = np.array([e["id"] for e in events if e.get("op") == "drop"], object)

    at = index.get_indexer(mids)
    gone = at < 0
    at_ok = np.where(gone, 0, at)
    undone = ~gone & dead[at_ok] & (reason[at_ok] == "undone")
    live = ~gone & ~dead[at_ok]
    rep["already"] += mids[undone].tolist()
    for k in np.flatnonzero(~gone & ~live & ~undone):
        j = at_ok[k]
        why = (
            f"{mids[k]} was merged again into {into[j]}: undo that first"
            if isinstance(into[j], str)
            else f"{mids[k]} is not live (deleted: {reason[j]}): restore it first"
        )
        rep["skipped"].append({"key": str(mids[k]), "why": why})
    rep["skipped"] += [{"key": str(m), "why": f"{m} is no longer in the store"} for m in mids[gone]]
    ok = mids[live]
    members = np.flatnonzero(pd.Series(into).isin(ok).to_numpy() & (reason == "merged") & dead)
    if len(members):
        groups = pd.Series(ids[members]).groupby(into[members]).agg(list).to_dict()
        apart = meta["keep_apart"].tolist()
        for r in members:
            apart[r] = sorted(set(apart[r]) | (set(groups[into[r]]) - {ids[r]}))
        meta["keep_apart"] = pd.Series(apart, dtype=object)
        meta.loc[members, "deleted_at"] = math.nan
        meta.loc[members, "deleted_reason"] = None
        meta.loc[members, "merged_into"] = None
    merged_rows = at[live]
    meta.loc[merged_rows, "deleted_at"] = wall_h
    meta.loc[merged_rows, "deleted_reason"] = "undone"
    rep["undone"] += ok.tolist()
    rep["restored"] += ids[members].tolist()

    dat = index.get_indexer(did)
    dok = np.where(dat < 0, 0, dat)
    dropped = (dat >= 0) & dead[dok] & pd.Series(reason[dok]).isin(["floor", "cap"]).to_numpy()
    back = ~dropped & (dat >= 0) & ~dead[dok]
    rep["already"] += did[back].tolist()
    rep["skipped"] += [
        {"key": str(d), "why": f"{d} is no longer a dropped memory"} for d in did[~dropped & ~back]
    ]
    rows = dat[dropped]
    meta.loc[rows, "deleted_at"] = math.nan
    meta.loc[rows, "deleted_reason"] = None
    meta.loc[rows, "pinned"] = True
    rep["undone"] += did[dropped].tolist()
    rep["restored"] += did[dropped].tolist()
    return Records(meta, records.vectors, origin=records.origin), rep

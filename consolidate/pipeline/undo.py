"""Undo of a merge: its members come back and stay apart."""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd

from ..store.schema import Records

__all__ = ["undo_merge"]


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

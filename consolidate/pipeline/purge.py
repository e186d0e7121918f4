"""Stage 1, purge: tombstones older than the retention window are removed for good (undo of
their merges becomes impossible)."""

from __future__ import annotations

import numpy as np

from ..config import PassConfig
from .state import PassState

__all__ = ["purge_stage"]


def purge_stage(st: PassState, cfg: PassConfig) -> PassState:
    """Mark tombstones deleted more than ``cfg.tombstone_retention_hours`` before the wall
    clock as ``gone`` (one ``purge`` event with their ids); they are left out when the next
    snapshot is assembled. ``None`` keeps tombstones forever."""
    deleted = st.col("deleted_at")
    st.stats.records_in = int(np.isnan(deleted).sum())
    st.stats.tombstones_in = int((~np.isnan(deleted)).sum())
    if cfg.tombstone_retention_hours is not None:
        purge = ~np.isnan(deleted) & (st.wall_h - deleted > cfg.tombstone_retention_hours)
        if purge.any():
            st.events.append({"op": "purge", "ids": st.meta["id"][purge].tolist()})
            st.gone = st.gone | purge
    st.stats.purged = int(st.gone.sum())
    return st

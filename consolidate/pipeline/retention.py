"""Stage 7, decay, floor and cap: the retention score of every live row, then the floor and
the per-namespace cap (pinned rows never dropped; rows of importance at least
``sleep.protect_importance`` never dropped by the floor)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..config import PassConfig
from ..ops.scoring import retention_score, select_survivors
from .state import PassState

__all__ = ["retention_stage", "MassDropError", "mass_drop_error"]


class MassDropError(RuntimeError):
    """The pass would drop more than ``sleep.max_drop_fraction`` of the live memories."""


def _namespace_stop(
    st: PassState, cfg: PassConfig, live: np.ndarray, floor_drop: np.ndarray
) -> None:
    """The per-namespace safety stop: a store-wide share can hide one namespace that the
    floor would empty (a wrong clock or ``now`` for that namespace). Cap drops do not count:
    a cap is a deliberate size."""
    if cfg.max_namespace_drop_fraction >= 1.0 or not len(floor_drop):
        return
    n_ns = len(st.ns_names)
    alive = np.bincount(st.ns[live], minlength=n_ns)
    dropped = np.bincount(st.ns[floor_drop], minlength=n_ns)
    bad = np.flatnonzero(
        (alive >= cfg.namespace_stop_min_live) & (dropped > cfg.max_namespace_drop_fraction * alive)
    )
    if not len(bad):
        return
    worst = bad[np.argsort(-dropped[bad] / alive[bad], kind="stable")][:3]
    which = ", ".join(f"{st.ns_names[k]!s}: {dropped[k]} of {alive[k]}" for k in worst)
    raise MassDropError(
        f"the floor would drop more than {cfg.max_namespace_drop_fraction:.0%} of the live "
        f"memories of {len(bad)} namespace(s) ({which}). Check sleep.now (now={cfg.now!r}) and "
        f"the times of those namespaces, tau_hours ({cfg.tau_hours}) and floor "
        f"({cfg.floor}), or set sleep.max_namespace_drop_fraction=1.0"
    )


def mass_drop_error(
    dropped: int, live: int, namespaces: Sequence[Any], cfg: PassConfig
) -> MassDropError:
    """The store-wide safety stop's error: ``dropped`` of ``live`` rows would go,
    ``namespaces`` holds the namespace of each dropped row (the three most named)."""
    worst = {str(k): int(v) for k, v in pd.Series(namespaces).value_counts().head(3).items()}
    return MassDropError(
        f"the pass would drop {dropped} of {live} live memories "
        f"({dropped / live:.0%} > sleep.max_drop_fraction={cfg.max_drop_fraction}); "
        f"most in {worst}. Check sleep.now (now={cfg.now!r}), tau_hours "
        f"({cfg.tau_hours}) and floor ({cfg.floor}), or set sleep.max_drop_fraction=1.0"
    )


def retention_stage(st: PassState, cfg: PassConfig, version: int) -> PassState:
    """Score live rows with :func:`~consolidate.ops.scoring.retention_score` (on the pass
    device; importance alone when ``cfg.decay`` is off), drop those below ``cfg.floor`` and
    those over ``cfg.cap`` per namespace (:func:`~consolidate.ops.scoring.select_survivors`):
    they become tombstones with ``deleted_reason`` ``floor`` or ``cap`` and a ``drop``
    event each. Kept rows that no pass had seen get ``last_pass = version`` (a row's
    ``last_pass`` is set once, so a pass rewrites only the rows it changes).

    Raises:
        MassDropError: more than ``cfg.max_drop_fraction`` of the live rows would be
            dropped, or the floor would drop more than
            ``cfg.max_namespace_drop_fraction`` of a namespace holding at least
            ``cfg.namespace_stop_min_live`` live rows (nothing is changed).
    """
    li = np.flatnonzero(st.live())
    imp = st.col("importance")[li]
    if cfg.decay:
        dev = st.vec.device
        score = (
            retention_score(
                torch.from_numpy(imp).to(dev),
                torch.from_numpy(st.col("last_used")[li]).to(dev),
                torch.from_numpy(st.col("strength")[li]).to(dev),
                torch.from_numpy(st.now[li]).to(dev),
                cfg.tau_hours,
            )
            .cpu()
            .numpy()
        )
        floor = cfg.floor
    else:
        score, floor = imp, -math.inf
    protected = None if cfg.protect_importance is None else imp >= cfg.protect_importance
    sel = select_survivors(
        score,
        st.col("pinned").astype(bool)[li],
        st.ns[li],
        st.id_rank[li],
        floor,
        cfg.cap,
        protected=protected,
    )
    drop = li[~sel.keep]
    _namespace_stop(st, cfg, li, li[sel.reason == "floor"])
    if len(li) and len(drop) / len(li) > cfg.max_drop_fraction:
        raise mass_drop_error(len(drop), len(li), st.ns_names[st.ns[drop]], cfg)
    why = sel.reason[~sel.keep]
    deleted_at = st.col("deleted_at").copy()
    deleted_at[drop] = st.wall_h
    reason = st.meta["deleted_reason"].to_numpy(object).copy()
    reason[drop] = why
    kept = li[sel.keep]
    last_pass = st.col("last_pass").copy()
    last_pass[kept[np.isnan(last_pass[kept])]] = float(version)
    st.meta["deleted_at"] = deleted_at
    st.meta["deleted_reason"] = pd.Series(reason, dtype=object)
    st.meta["last_pass"] = last_pass
    ids = st.meta["id"].to_numpy(object)[drop].tolist()
    names = st.ns_names[st.ns[drop]].tolist()
    st.events += [
        {"op": "drop", "id": i, "reason": w, "score": s, "namespace": n}
        for i, w, s, n in zip(ids, why.tolist(), score[~sel.keep].tolist(), names, strict=True)
    ]
    st.stats.dropped_floor = int((sel.reason == "floor").sum())
    st.stats.dropped_cap = int((sel.reason == "cap").sum())
    st.stats.records_out = len(kept)
    st.stats.score_min = float(score[sel.keep].min()) if sel.keep.any() else None
    return st

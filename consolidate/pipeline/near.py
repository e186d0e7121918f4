"""Stages 3 and 4, near-duplicates: the similarity join over the units' vectors, then
centroid-checked clusters with the conflict guard.

Only units that appear in a pair are looked at after the join: their texts get a conflict
signature (once per distinct text), their undo constraints are gathered, and the clustering
runs on them alone, so the Python work grows with the pairs, not with the store.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch

from ..cluster import ClusterResult, centroid_clusters
from ..config import PassConfig, SimilarityConfig
from ..device import resolve_device
from ..similarity import Pairs, threshold_pairs
from ..text import ConflictSignature, conflict_between, conflict_signature
from .state import PassState, list_lengths

__all__ = ["similar_pairs", "similarity_stage", "cluster_stage", "compact_clusters"]


def similar_pairs(
    vec: torch.Tensor, seg: np.ndarray, threshold: float, sim_cfg: SimilarityConfig
) -> Pairs:
    """Every pair ``i < j`` of rows of ``vec`` (``float32 [m, d]``) in one segment
    (``int64 [m]`` namespace codes) with cosine ``>= threshold``, with the engine settings of
    ``sim_cfg`` (the one similarity call of the pass; merges and reflections both use it)."""
    return threshold_pairs(
        vec,
        threshold,
        segments=torch.from_numpy(np.ascontiguousarray(seg, np.int64)),
        device=sim_cfg.device,
        dtype=sim_cfg.dtype,
        tile_rows=sim_cfg.tile_rows,
        tile_cols=sim_cfg.tile_cols,
        engine=sim_cfg.engine,
        budget_bytes=None if sim_cfg.budget_mb is None else int(sim_cfg.budget_mb * 2**20),
    )


def similarity_stage(st: PassState, cfg: PassConfig, sim_cfg: SimilarityConfig) -> PassState:
    """Pairs of units at or above ``cfg.threshold`` within each namespace (``st.pairs``,
    positions into ``st.units``); none when ``cfg.near_dedup`` is off or there are fewer
    than two units."""
    u = st.units
    assert u is not None, "the exact stage runs first"
    st.pairs = (
        similar_pairs(u.vec, u.ns, cfg.threshold, sim_cfg)
        if cfg.near_dedup and len(u) > 1
        else None
    )
    st.stats.pairs = 0 if st.pairs is None else len(st.pairs)
    st.stats.device = str(resolve_device(sim_cfg.device))
    st.stats.engine = sim_cfg.engine
    return st


def compact_clusters(
    pairs: Pairs,
    vec: torch.Tensor,
    weight: np.ndarray,
    keys: np.ndarray,
    threshold: float,
    conflicts: Callable[[np.ndarray], dict[str, Any]] | None = None,
) -> tuple[np.ndarray, ClusterResult]:
    """:func:`~consolidate.cluster.centroid_clusters` over only the items that appear in a
    pair.

    Args:
        pairs: pairs over ``m`` items.
        vec: ``float32 [m, d]`` item vectors (any device). weight: ``float64 [m]``.
        keys: ``object [m]`` item keys (record ids) for deterministic tie-breaking.
        threshold: cosine threshold.
        conflicts: ``conflicts(items) -> keyword arguments`` of ``centroid_clusters``
            (``conflict``, ``conflict_class``, ``allow_conflicts``, ``blocking``) for the
            paired items ``items`` (``int64``, sorted), in their compact positions.

    Returns:
        ``(items, result)``: the paired items and the clustering in compact positions
        (``items[x]`` is the item of position ``x``).
    """
    items = np.unique(np.concatenate([pairs.i, pairs.j]))
    ci, cj = np.searchsorted(items, pairs.i), np.searchsorted(items, pairs.j)
    sub = vec.index_select(0, torch.from_numpy(items).to(vec.device)).cpu().numpy()
    kw = conflicts(items) if conflicts is not None else {}
    cr = centroid_clusters(
        ci, cj, pairs.sim, sub, weight[items], keys[items].tolist(), threshold, **kw
    )
    return items, cr


def cluster_stage(st: PassState, cfg: PassConfig, handles_conflicts: bool) -> PassState:
    """Centroid-checked clusters of the paired units with the conflict guard.

    A pair conflicts if the texts' :class:`~consolidate.text.ConflictSignature` differ
    (negation, number, date) or an undo put one unit's members in the other's
    ``keep_apart`` ("undone merge", which blocks even a conflict-handling merger).

    Sets ``st.clusters`` (unit positions per cluster, clusters and members in id order of
    their first rows) and ``st.review`` (``(a, b, sim, reason)`` with ``a``'s id below
    ``b``'s, in id order).
    """
    st.clusters, st.review = [], []
    u, p = st.units, st.pairs
    if u is None or p is None or not len(p):
        st.stats.clusters = st.stats.review_pairs = 0
        return st
    keys = st.meta["id"].to_numpy(object)[u.first]
    conflicts = _conflict_rules(st, handles_conflicts)
    items, cr = compact_clusters(p, u.vec, u.weight, keys, cfg.threshold, conflicts)
    st.clusters = [[int(items[x]) for x in c] for c in cr.clusters]
    rank = st.id_rank[u.first]
    review = []
    for a, b, s, r in cr.review:
        a, b = int(items[a]), int(items[b])
        if rank[a] > rank[b]:
            a, b = b, a
        review.append((a, b, s, r))
    review.sort(key=lambda x: (rank[x[0]], rank[x[1]]))
    st.review = review
    _review_events(st, cfg, review)
    st.stats.clusters = len(st.clusters)
    st.stats.review_pairs = len(review)
    return st


def _conflict_rules(
    st: PassState, handles_conflicts: bool
) -> Callable[[np.ndarray], dict[str, Any]]:
    """``conflicts(items)`` for :func:`compact_clusters`: the conflict guard's keyword
    arguments of :func:`~consolidate.cluster.centroid_clusters` over the units ``items``.
    Units of one text share a conflict class, except a unit that an undo constraint names
    (``keep_apart``), which keeps one of its own."""
    u = st.units
    assert u is not None
    ids = st.meta["id"].to_numpy(object)
    apart_col = st.meta["keep_apart"].to_numpy(object)
    # every id named in a keep_apart of a candidate row (a unit that contains one must keep
    # a conflict class of its own)
    has_apart = np.flatnonzero(list_lengths(apart_col)[u.rows] > 0)  # read in row order
    named = {x for r in u.rows[has_apart].tolist() for x in apart_col[r]}

    def conflicts(items: np.ndarray) -> dict[str, Any]:
        texts = st.meta["text"].to_numpy(object)[u.first[items]].tolist()
        memo: dict[str, ConflictSignature] = {}
        sig = [memo[t] if t in memo else memo.setdefault(t, conflict_signature(t)) for t in texts]
        # undo constraints: only units holding a keep_apart, or holding a named id, need sets
        apart: dict[int, set[str]] = {}
        members: dict[int, set[str]] = {}
        if named:
            for x, k in enumerate(items.tolist()):
                rows = u.members(k).tolist()
                a = {y for r in rows for y in apart_col[r]}
                m = set(ids[rows].tolist())
                if a:
                    apart[x] = a
                if a or m & named:
                    members[x] = m
        cls: list[Hashable] = [(sig[x], x if x in members else -1) for x in range(len(items))]
        empty: set[str] = set()

        def conflict(a: int, b: int) -> str | None:
            return conflict_between(sig[a], sig[b]) or (
                "undone merge"
                if (apart.get(a, empty) & members.get(b, empty))
                or (apart.get(b, empty) & members.get(a, empty))
                else None
            )

        return {
            "conflict": conflict,
            "conflict_class": cls,
            "allow_conflicts": handles_conflicts,
            "blocking": lambda reason: reason == "undone merge",
        }

    return conflicts


def _review_events(
    st: PassState, cfg: PassConfig, review: list[tuple[int, int, float, str]]
) -> None:
    """A ``review`` event per reviewed pair of units, the first ``cfg.max_review_events``,
    then one ``review_truncated`` event if there were more."""
    u = st.units
    assert u is not None
    first = u.first
    ids = st.meta["id"].to_numpy(object)
    texts = st.meta["text"].to_numpy(object)
    for a, b, s, reason in review[: cfg.max_review_events]:
        st.events.append(
            {
                "op": "review",
                "reason": reason,
                "similarity": None if math.isnan(s) else round(s, 6),
                "ids": [ids[first[a]], ids[first[b]]],
                "texts": [texts[first[a]], texts[first[b]]],
                "namespace": st.ns_names[u.ns[a]],
            }
        )
    if len(review) > cfg.max_review_events:
        st.events.append(
            {"op": "review_truncated", "listed": cfg.max_review_events, "total": len(review)}
        )

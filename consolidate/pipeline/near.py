"""Stages 3 and 4, near-duplicates: the similarity join over the units' vectors, then
centroid-checked clusters with the conflict guard.

Only units that appear in a pair are looked at after the join: their texts get a conflict
signature (once per distinct text), their undo constraints are gathered, and the clustering
runs on them alone, so the Python work grows with the pairs, not with the store.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ..config import PassConfig, SimilarityConfig
from ..device import resolve_device
from ..ops.cluster import ClusterResult, RowsOf, centroid_clusters, split_list
from ..ops.guard import ConflictSignature, conflict_between, conflict_signature
from ..similarity import Pairs, threshold_pairs
from ..workers import fork_map, split_evenly, work_parts
from .exact import _ranges
from .state import PassState, Units, arrow_strings, list_lengths

__all__ = [
    "similar_pairs",
    "similarity_stage",
    "cluster_stage",
    "compact_clusters",
    "guard_pairs",
    "namespace_parts",
]


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
    conflicts: Callable[[np.ndarray, np.ndarray, np.ndarray], dict[str, Any]] | None = None,
) -> tuple[np.ndarray, ClusterResult]:
    """:func:`~consolidate.ops.cluster.centroid_clusters` over only the items that appear in a
    pair.

    Args:
        pairs: pairs over ``m`` items.
        vec: ``float32 [m, d]`` item vectors (any device). weight: ``float64 [m]``.
        keys: ``[m]`` item keys for deterministic tie-breaking: distinct strings (record
            ids, ``object``) or distinct integers (their ranks, ``int64``).
        threshold: cosine threshold.
        conflicts: ``conflicts(items, ci, cj) -> keyword arguments`` of
            ``centroid_clusters`` (``conflict``, ``conflict_class``, ``allow_conflicts``,
            ``blocking``) for the paired items ``items`` (``int64``, sorted), in their
            compact positions, with the pairs ``(ci[e], cj[e])`` in those positions.

    Returns:
        ``(items, result)``: the paired items and the clustering in compact positions
        (``items[x]`` is the item of position ``x``).
    """
    items = np.unique(np.concatenate([pairs.i, pairs.j]))
    ci, cj = np.searchsorted(items, pairs.i), np.searchsorted(items, pairs.j)
    sub = RowsOf(vec, items)  # read by the centroid check, cluster by cluster
    kw = conflicts(items, ci, cj) if conflicts is not None else {}
    cr = centroid_clusters(ci, cj, pairs.sim, sub, weight[items], keys[items], threshold, **kw)
    return items, cr


#: candidate pairs from which the conflict guard runs in forked processes
#: (:func:`~consolidate.workers.fork_map`); fewer are answered inline
PARALLEL_MIN_PAIRS = 5_000


def guard_pairs(
    texts: list[str],
    ci: np.ndarray,
    cj: np.ndarray,
    parts: list[tuple[int, int]],
    workers: int,
    not_shared: Sequence[np.ndarray] = (),
    groups: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The conflict guard over candidate pairs, part by part, in up to ``workers``
    processes.

    Each part is a contiguous range of items ``[a, b)`` that holds whole groups (the
    pass's namespaces), so it holds both items of each of its pairs. In a group, the texts
    get their :class:`~consolidate.ops.guard.ConflictSignature` (once per distinct text),
    each item its class (the group's first item with an equal signature), and each pair of
    classes one :func:`~consolidate.ops.guard.conflict_between` answer (the guard is
    symmetric: the order of the two texts does not change the answer). A group's
    signatures are dropped when its pairs are answered, so memory grows with the largest
    group, not with the part. A forked worker reads its part's texts from an Arrow copy
    made before the fork, not from this process's string objects (reading those would
    copy every memory page that holds one into the worker).

    Args:
        texts: the ``m`` items' texts.
        ci, cj: ``int64 [p]`` item positions of the pairs (each pair inside one group).
        parts: ``(a, b)`` item ranges covering ``range(m)``.
        workers: processes in all (1 = inline).
        not_shared: large arrays the parts never read, kept out of forked children.
        groups: ``int64 [m]`` group code per item, each group one contiguous run of items
            inside one part; ``None``: each part is one group.

    Returns:
        ``(cls, keys, reasons)``: ``int64 [m]`` each item's class (an item position: equal
        classes have equal signatures); ``int64 [p]`` each pair's key ``low * m + high``
        (its item positions), ascending; ``object [p]`` the reason (``str``) or ``None`` of
        the pair with that key.

    Raises:
        ValueError: a pair crosses two parts or two groups.
    """
    m = len(texts)
    part_of = np.zeros(m, np.int64)
    for k, (a, b) in enumerate(parts):
        part_of[a:b] = k
    pair_part = part_of[ci]
    if not np.array_equal(pair_part, part_of[cj]):
        raise ValueError("a pair crosses two parts of the conflict guard")
    starts = np.array([a for a, _ in parts] + [m], np.int64)
    if groups is not None:
        groups = np.asarray(groups, np.int64)
        if not np.array_equal(groups[ci], groups[cj]):
            raise ValueError("a pair crosses two groups of the conflict guard")
        starts = np.union1d(starts, np.flatnonzero(np.diff(groups)) + 1)
    lo, hi = np.minimum(ci, cj), np.maximum(ci, cj)
    # the pairs by low item: each group's pairs are one run, the parts' runs in part order
    order = np.argsort(lo, kind="stable")
    lo_s, hi_s = lo[order], hi[order]
    pair_cut = np.searchsorted(lo_s, starts)
    packed: dict[int, pa.Array | None] = {}  # the parts forked workers answer (not the first)
    if workers > 1 and len(parts) > 1:
        packed = {k: arrow_strings(texts[a:b]) for k, (a, b) in enumerate(parts) if k}
        if any(v is None for v in packed.values()):
            packed = {}  # a text Arrow cannot hold (a lone surrogate): read as it is

    def part(k: int) -> tuple[list[int], list[str | None]]:
        a, b = parts[k]
        got = packed.get(k)
        own = got.to_pylist() if got is not None else texts[a:b]
        g0, g1 = np.searchsorted(starts, [a, b])
        return _guard_groups(own, a, starts[g0 : g1 + 1], lo_s, hi_s, pair_cut[g0 : g1 + 1])

    got = fork_map(part, list(range(len(parts))), workers, not_shared)
    cls = (
        np.concatenate([np.asarray(c, np.int64) for c, _ in got]) if got else np.zeros(0, np.int64)
    )
    keys, reasons = lo_s * m + hi_s, np.empty(len(lo_s), dtype=object)
    reasons[:] = [r for _, out in got for r in out]
    order = np.argsort(keys, kind="stable")
    return cls, keys[order], reasons[order]


def _guard_groups(
    texts: list[str],
    a: int,
    starts: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    pair_cut: np.ndarray,
) -> tuple[list[int], list[str | None]]:
    """:func:`guard_pairs` for one part: ``texts`` of items ``a..``, its groups' first
    items ``starts`` (and the part's end), the pairs ``(lo, hi)`` sorted by ``lo`` with
    group ``g``'s pairs at ``pair_cut[g]:pair_cut[g + 1]``. Returns each item's class and
    each pair's answer, in that order."""
    cls = list(range(a, a + len(texts)))
    out: list[str | None] = []
    for g in range(len(starts) - 1):
        s, e = int(starts[g]), int(starts[g + 1])
        memo: dict[str, ConflictSignature] = {}
        first: dict[ConflictSignature, int] = {}
        sigs = []
        for x in range(s, e):
            t = texts[x - a]
            sig = memo.get(t)
            if sig is None:
                sig = memo[t] = conflict_signature(t)
            sigs.append(sig)
            cls[x - a] = first.setdefault(sig, x)
        done: dict[tuple[int, int], str | None] = {}
        p0, p1 = int(pair_cut[g]), int(pair_cut[g + 1])
        for x, y in zip(lo[p0:p1].tolist(), hi[p0:p1].tolist(), strict=True):
            key = (cls[x - a], cls[y - a])
            if key not in done:
                done[key] = conflict_between(sigs[x - s], sigs[y - s])
            out.append(done[key])
    return cls, out


def namespace_parts(ns: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """At most ``parts`` contiguous ranges of ``ns`` (``int64 [m]``, sorted namespace codes)
    of about equal size, each cut at a change of namespace."""
    bounds = np.flatnonzero(np.diff(ns)) + 1  # where a namespace starts
    cuts = [0]
    for a, _ in split_evenly(len(ns), parts)[1:]:
        k = int(np.searchsorted(bounds, a))
        c = int(bounds[k]) if k < len(bounds) else len(ns)
        if cuts[-1] < c < len(ns):
            cuts.append(c)
    cuts.append(len(ns))
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


def cluster_stage(st: PassState, cfg: PassConfig, handles_conflicts: bool) -> PassState:
    """Centroid-checked clusters of the paired units with the conflict guard.

    A pair conflicts if the texts' :class:`~consolidate.ops.guard.ConflictSignature` differ
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
    # the units' first rows' id ranks: their order is their ids' order (a tie-break
    # on integers, not on strings)
    rank = st.id_rank[u.first]
    conflicts = _conflict_rules(st, handles_conflicts)
    items, cr = compact_clusters(p, u.vec, u.weight, rank, cfg.threshold, conflicts)
    st.clusters = split_list(items[_flat(cr.clusters)].tolist(), [len(c) for c in cr.clusters])
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


def _flat(groups: list[list[int]]) -> np.ndarray:
    """``int64``: the groups' items one after another."""
    return np.fromiter(itertools.chain.from_iterable(groups), np.int64, sum(map(len, groups)))


def _conflict_rules(
    st: PassState, handles_conflicts: bool
) -> Callable[[np.ndarray, np.ndarray, np.ndarray], dict[str, Any]]:
    """``conflicts(items, ci, cj)`` for :func:`compact_clusters`: the conflict guard's
    keyword arguments of :func:`~consolidate.ops.cluster.centroid_clusters` over the units
    ``items``, with the candidate pairs answered up front (:func:`guard_pairs`, in
    ``st.workers`` processes from :data:`PARALLEL_MIN_PAIRS` pairs). Units of one
    signature share a conflict class, except a unit that an undo constraint names
    (``keep_apart``), which keeps one of its own."""
    u = st.units
    assert u is not None
    ids = st.meta["id"].to_numpy(object)
    apart_col = st.meta["keep_apart"].to_numpy(object)
    # every id named in a keep_apart of a candidate row (a unit that contains one must keep
    # a conflict class of its own)
    has_apart = np.flatnonzero(st.nonempty("keep_apart")[u.rows])  # read in row order
    named = {x for r in u.rows[has_apart].tolist() for x in apart_col[r]}

    def conflicts(items: np.ndarray, ci: np.ndarray, cj: np.ndarray) -> dict[str, Any]:
        texts = st.meta["text"].to_numpy(object)[u.first[items]].tolist()
        workers = st.workers if len(ci) >= PARALLEL_MIN_PAIRS else 1
        parts = namespace_parts(u.ns[items], work_parts(workers))
        sig_cls, keys, reasons = guard_pairs(
            texts, ci, cj, parts, workers, st.vector_buffers(), groups=u.ns[items]
        )
        n_items = len(items)
        memo: dict[str, ConflictSignature] = {}

        def signature(x: int) -> ConflictSignature:
            t = texts[x]
            if t not in memo:
                memo[t] = conflict_signature(t)
            return memo[t]

        def guard_many(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return _guard_answers(keys, reasons, n_items, a, b, signature)

        apart, members = _undo_sets(u, items, ids, apart_col, named)
        cls = sig_cls
        if members:  # a unit an undo constraint names: a class of its own (codes >= n_items)
            own = np.sort(np.fromiter(members, np.int64, len(members)))
            cls = sig_cls.copy()
            cls[own] = n_items + np.arange(len(own))
        empty: set[str] = set()

        def undone(a: int, b: int) -> str | None:
            if (apart.get(a, empty) & members.get(b, empty)) or (
                apart.get(b, empty) & members.get(a, empty)
            ):
                return "undone merge"
            return None

        def conflict(a: int, b: int) -> str | None:
            return guard_many(np.array([a]), np.array([b]))[0] or undone(a, b)

        def conflict_many(a: np.ndarray, b: np.ndarray) -> list[str | None]:
            out = guard_many(a, b)
            if apart:  # only pairs with a unit that holds an undo constraint
                held = np.fromiter(apart, np.int64, len(apart))
                for x in np.flatnonzero(np.isin(a, held) | np.isin(b, held)).tolist():
                    out[x] = out[x] or undone(int(a[x]), int(b[x]))
            return out.tolist()

        return {
            "conflict": conflict,
            "conflict_many": conflict_many,
            "conflict_class": cls,
            "allow_conflicts": handles_conflicts,
            "blocking": lambda reason: reason == "undone merge",
        }

    return conflicts


def _undo_sets(
    u: Units, items: np.ndarray, ids: np.ndarray, apart_col: np.ndarray, named: set[str]
) -> tuple[dict[int, set[str]], dict[int, set[str]]]:
    """The undo constraints of the units ``items`` (compact positions): ``{x: ids its rows
    must stay apart from}`` for units holding a ``keep_apart``, and ``{x: its rows' ids}``
    for those and for units holding an id in ``named``; only those units get sets (none
    without ``named``). The units concerned are found on arrays; sets are built for them
    alone."""
    apart: dict[int, set[str]] = {}
    members: dict[int, set[str]] = {}
    if not named or not len(items):
        return apart, members
    size = u.size[items]
    rows = u.rows[_ranges(u.start[items], size)]  # every row of the item units, in turn
    held = (list_lengths(apart_col)[rows] > 0) | pd.Series(ids[rows], dtype=object).isin(
        named
    ).to_numpy(bool)
    for x in np.unique(np.repeat(np.arange(len(items)), size)[held]).tolist():
        rs = u.members(int(items[x])).tolist()
        a = {y for r in rs for y in apart_col[r]}
        m = set(ids[rs].tolist())
        if a:
            apart[x] = a
        if a or m & named:
            members[x] = m
    return apart, members


def _guard_answers(
    keys: np.ndarray,
    reasons: np.ndarray,
    m: int,
    a: np.ndarray,
    b: np.ndarray,
    signature: Callable[[int], ConflictSignature],
) -> np.ndarray:
    """The guard's answers (``object [q]``) for the item pairs ``(a[e], b[e])``: looked up
    in the candidate pairs' ``keys`` (ascending ``low * m + high``) and ``reasons``
    (:func:`guard_pairs`), else computed here from ``signature(item)`` (the clustering loop
    may ask two clusters' members that are no pair)."""
    want = np.minimum(a, b) * m + np.maximum(a, b)
    at = np.minimum(np.searchsorted(keys, want), max(len(keys) - 1, 0))
    found = keys[at] == want if len(keys) else np.zeros(len(want), bool)
    out = np.empty(len(want), dtype=object)
    out[found] = reasons[at[found]]
    for x in np.flatnonzero(~found).tolist():
        out[x] = conflict_between(signature(int(a[x])), signature(int(b[x])))
    return out


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

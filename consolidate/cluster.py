"""Centroid-checked clustering on the sparse pair graph (no single-link chaining).

Pairs are visited from the most to the least similar. Two clusters ``A`` and ``B`` joined by a
pair are merged only if

1. **complete link**: every cross pair ``(a, b)`` is itself a pair (cosine >= threshold);
2. **centroid**: every member of ``A u B`` has cosine >= threshold to the strength-weighted
   centroid of ``A u B`` (re-checked for all members each time the centroid moves);
3. **conflict guard**: no cross pair is a conflict (negation, changed number or date), unless
   the merger can resolve conflicts with a model.

Rule 2 alone admits chains: with unit vectors where A.B = B.C = 0.96 and A.C = 0.85, each of
A, B, C has cosine ~0.962 to the equal-weight centroid, so a centroid check at 0.95 would put A
and C in one cluster. Rule 1 excludes that; with rule 1 the centroid test always holds
mathematically (cos(x, c) >= (w_x + t (W - w_x)) / W >= t), and it is kept as an explicit
invariant of every merged cluster, asserted in float64.

Tie-breaking, so that results do not depend on row order: pairs are sorted by similarity
(rounded to 1e-12) descending, then by the sorted pair of the clusters' keys (the smallest
record id in each) ascending.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ClusterResult", "centroid_clusters"]


@dataclass
class ClusterResult:
    """Clusters over ``n`` items.

    Attributes:
        labels: ``int64 [n]``: cluster label per item; label = smallest member position.
        clusters: member positions of each cluster with >= 2 members, each sorted by key.
        review: conflicting pairs ``(i, j, sim, reason)`` that were kept apart.
        rejected: pairs not merged because of rule 1 or 2 (count).
    """

    labels: np.ndarray
    clusters: list[list[int]] = field(default_factory=list)
    review: list[tuple[int, int, float, str]] = field(default_factory=list)
    rejected: int = 0


def centroid_clusters(
    i: np.ndarray,
    j: np.ndarray,
    sim: np.ndarray,
    vectors: np.ndarray,
    weights: np.ndarray,
    keys: Sequence[str],
    threshold: float,
    conflict: Callable[[int, int], str | None] | None = None,
    allow_conflicts: bool = False,
) -> ClusterResult:
    """Cluster items joined by pairs; see the module docstring for the rules.

    Args:
        i, j: ``int [p]`` item positions of each pair (any orientation).
        sim: ``float64 [p]`` cosine of each pair (all ``>= threshold``).
        vectors: ``float [n, d]`` unit vectors of the items (used in float64).
        weights: ``float [n]`` positive weights (memory strength) for the centroid.
        keys: ``n`` strings (record ids) used for deterministic tie-breaking.
        threshold: cosine threshold.
        conflict: ``conflict(a, b) -> reason | None`` for items ``a``, ``b``.
        allow_conflicts: if ``True``, conflicts are reported in ``review`` but do not block
            merging (for mergers that send such clusters to a model).

    Returns:
        :class:`ClusterResult`.
    """
    n = len(keys)
    parent = np.arange(n)
    members: dict[int, list[int]] = {k: [k] for k in range(n)}
    v64 = np.asarray(vectors, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    wsum: dict[int, np.ndarray] = {}
    edge = {(min(a, b), max(a, b)) for a, b in zip(i.tolist(), j.tolist(), strict=True)}
    ckey = list(keys)  # cluster key = min member key, tracked at the root

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return int(x)

    order = sorted(
        range(len(i)),
        key=lambda e: (-round(float(sim[e]), 12), *sorted((keys[i[e]], keys[j[e]]))),
    )
    review: dict[tuple[int, int], tuple[int, int, float, str]] = {}
    conflict_cache: dict[tuple[int, int], str | None] = {}

    def conflict_of(a: int, b: int) -> str | None:
        if conflict is None:
            return None
        p = (min(a, b), max(a, b))
        if p not in conflict_cache:
            conflict_cache[p] = conflict(*p)
        return conflict_cache[p]

    sims = {}
    for e in range(len(i)):
        a, b = int(i[e]), int(j[e])
        sims[(min(a, b), max(a, b))] = float(sim[e])
    rejected = 0
    for e in order:
        a, b = int(i[e]), int(j[e])
        reason = conflict_of(a, b)
        if reason is not None:
            p = (min(a, b), max(a, b))
            review[p] = (p[0], p[1], float(sim[e]), reason)
            if not allow_conflicts:
                continue
        ra, rb = find(a), find(b)
        if ra == rb:
            continue
        ma, mb = members[ra], members[rb]
        ok = all((min(x, y), max(x, y)) in edge for x in ma for y in mb)
        if ok and not allow_conflicts:
            for x in ma:
                for y in mb:
                    r = conflict_of(x, y)
                    if r is not None:
                        p = (min(x, y), max(x, y))
                        review.setdefault(p, (p[0], p[1], sims.get(p, float("nan")), r))
                        ok = False
                        break
                if not ok:
                    break
        if ok:
            s = wsum.get(ra, w[ra] * v64[ra]) + wsum.get(rb, w[rb] * v64[rb])
            c = s / np.linalg.norm(s)
            mm = ma + mb
            ok = bool((v64[mm] @ c >= threshold - 1e-12).all())
        if not ok:
            rejected += 1
            continue
        root, other = (ra, rb) if ckey[ra] <= ckey[rb] else (rb, ra)
        parent[other] = root
        members[root] = sorted(mm, key=lambda x: keys[x])
        del members[other]
        wsum[root] = s
        wsum.pop(other, None)
        ckey[root] = min(ckey[ra], ckey[rb])
    labels = np.array([find(x) for x in range(n)], dtype=np.int64)
    clusters = sorted((m for m in members.values() if len(m) > 1), key=lambda m: keys[m[0]])
    # relabel: label = smallest position in the cluster
    for m in clusters:
        labels[m] = min(m)
    return ClusterResult(labels, clusters, sorted(review.values()), rejected)

"""Centroid-checked clustering on the sparse pair graph (no single-link chaining).

Pairs are visited from the most to the least similar. Two clusters ``A`` and ``B`` joined by a
pair are merged only if

1. **complete link**: every cross pair ``(a, b)`` is itself a pair (cosine >= threshold);
2. **centroid**: every member of ``A u B`` has cosine >= threshold to the strength-weighted
   centroid of ``A u B``;
3. **conflict guard**: no cross pair conflicts (negation, changed number or date, or an
   undone merge), unless the merger can resolve conflicts with a model.

Rule 2 alone admits chains: with unit vectors where A.B = B.C = 0.96 and A.C = 0.85, each of
A, B, C has cosine ~0.962 to the equal-weight centroid, so a centroid check at 0.95 would put A
and C in one cluster. Rule 1 excludes that. Under rule 1 the centroid condition holds at every
step: for a member x with weight w_x of a cluster with total weight W and centroid sum s,
``x.s >= w_x + t (W - w_x)`` and ``|s| <= W``, so ``cos(x, s) >= t + (1 - t) w_x / W >= t``.
It is therefore verified in float64 for every final cluster (an assertion, O(size * d)) rather
than recomputed after each merge, which would cost O(size * d) per merge.

Rule 1 is checked in O(1) per pair: the number of pairs between every two adjacent clusters
is kept up to date as clusters merge, and A, B are complete-linked iff that count equals
``|A| * |B|``. Conflicts are checked between conflict classes (items with equal signatures
behave alike), so dense clusters of similar texts cost O(pairs log pairs) overall.

Only items that appear in a pair are visited (an item in no pair is its own cluster). The
pair graph is then split into connected components in whole-array steps: a complete component
(every two of its items a pair) without a conflict is one cluster, whatever the order of its
pairs, so it needs no union-find work; only the other components go through the loop above,
each on its own pairs. The Python work grows with the pairs of incomplete or conflicting
components, not with n.

Tie-breaking, so that results do not depend on row order: pairs are sorted by similarity
(rounded to 1e-12) descending, then by the two keys (record ids) ascending.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["ClusterResult", "RowsOf", "centroid_clusters", "split_list"]


@dataclass
class ClusterResult:
    """Clusters over ``n`` items.

    Attributes:
        labels: ``int64 [n]``: cluster label per item; label = smallest member position.
        clusters: member positions of each cluster with >= 2 members, each sorted by key.
        review: conflicting pairs ``(i, j, sim, reason)`` kept apart (``sim`` is NaN for a
            cross pair that was not itself above the threshold).
        rejected: pairs whose clusters were not merged (incomplete link or conflict).
    """

    labels: np.ndarray
    clusters: list[list[int]] = field(default_factory=list)
    review: list[tuple[int, int, float, str]] = field(default_factory=list)
    rejected: int = 0


def centroid_clusters(
    i: np.ndarray,
    j: np.ndarray,
    sim: np.ndarray,
    vectors: np.ndarray | RowsOf,
    weights: np.ndarray,
    keys: Sequence[str] | np.ndarray,
    threshold: float,
    conflict: Callable[[int, int], str | None] | None = None,
    allow_conflicts: bool = False,
    conflict_class: Sequence[Hashable] | None = None,
    blocking: Callable[[str], bool] | None = None,
    greedy_only: bool = False,
    conflict_many: Callable[[np.ndarray, np.ndarray], Sequence[str | None]] | None = None,
) -> ClusterResult:
    """Cluster items joined by pairs; see the module docstring for the rules.

    Args:
        i, j: ``int [p]`` item positions of each pair (any orientation, no duplicates).
        sim: ``float64 [p]`` cosine of each pair (all ``>= threshold``).
        vectors: ``float [n, d]`` unit vectors of the items (in float64), or a :class:`RowsOf`.
        weights: ``float [n]`` positive weights (memory strength) for the centroid.
        keys: ``n`` distinct record ids (or integers in their order) to break ties by.
        threshold: cosine threshold.
        conflict: ``conflict(a, b) -> reason | None`` for items ``a``, ``b``.
        allow_conflicts: if ``True``, conflicts are reported in ``review`` but do not block
            merging (for mergers that send such clusters to a model).
        conflict_class: hashable per item, or an ``int`` array of class codes; items of one
            class must give the same ``conflict`` answers (default: every item its own
            class).
        blocking: ``blocking(reason) -> bool``: conflicts that keep items apart even with
            ``allow_conflicts`` (e.g. an undone merge); default none.
        greedy_only: run every pair through the pair-by-pair loop, without the
            complete-component shortcut (:func:`_by_components`); the same result, slower
            (the reference the tests compare the shortcut with).
        conflict_many: ``conflict_many(a, b)``, ``a`` and ``b`` ``int64 [q]`` items: the
            ``conflict`` answers of the ``q`` pairs at once, in order (the same answers as
            ``conflict``); used where many pairs are asked together (default: ``conflict``
            pair by pair).

    Returns:
        :class:`ClusterResult`.

    Raises:
        AssertionError: a final cluster violates the centroid condition (a bug).
    """
    n = len(keys)
    i = np.asarray(i, dtype=np.int64)
    j = np.asarray(j, dtype=np.int64)
    sim = np.asarray(sim, dtype=np.float64)
    if len(i) and (min(int(i.min()), int(j.min())) < 0 or max(int(i.max()), int(j.max())) >= n):
        raise ValueError(
            f"pair positions must be in [0, {n}), got [{min(i.min(), j.min())}, "
            f"{max(i.max(), j.max())}]"
        )
    if not (len(i) == len(j) == len(sim)):
        raise ValueError(f"i, j and sim must have one length, got {len(i)}, {len(j)}, {len(sim)}")
    if isinstance(conflict_class, np.ndarray) and conflict_class.dtype.kind in "iu":
        if len(conflict_class) != n:
            raise ValueError(f"conflict_class has {len(conflict_class)} codes for {n} items")
        conflict_class = conflict_class.astype(np.int64, copy=False)
    elif conflict_class is not None:  # by position (a pandas Series would index by label)
        conflict_class = list(conflict_class)
    if conflict is None:
        conflict_many = None
    involved = np.unique(np.concatenate([i, j]))
    args = (conflict, allow_conflicts, conflict_class, blocking, greedy_only)
    if involved.size < n:
        return _on_paired_items(
            involved, i, j, sim, vectors, weights, keys, threshold, *args, conflict_many
        )
    if not greedy_only and len(i):
        return _by_components(
            i, j, sim, vectors, weights, keys, threshold, *args[:4], conflict_many
        )
    loop = _Greedy(i, j, keys, conflict, allow_conflicts, conflict_class, blocking)
    clusters = loop.run(sim)
    labels = np.arange(n, dtype=np.int64)
    _label_and_check(labels, clusters, vectors, weights, threshold)
    return ClusterResult(labels, clusters, sorted(loop.review.values()), loop.rejected)


class _Greedy:
    """The pair-by-pair loop of :func:`centroid_clusters` (module docstring): union-find
    over ``n`` items with, per cluster root, its members, one item per conflict class and
    the number of pairs to each adjacent cluster (a join is complete-linked when that number
    is the product of the two sizes)."""

    def __init__(
        self,
        i: np.ndarray,
        j: np.ndarray,
        keys: Sequence[str] | np.ndarray,
        conflict: Callable[[int, int], str | None] | None,
        allow_conflicts: bool,
        conflict_class: Sequence[Hashable] | None,
        blocking: Callable[[str], bool] | None,
    ) -> None:
        n = len(keys)
        self.i, self.j = i, j
        self.rank = key_ranks(keys)
        self.conflict, self.allow, self.blocking = conflict, allow_conflicts, blocking
        if conflict_class is None:
            self.cls = list(range(n))
        elif isinstance(conflict_class, np.ndarray):  # class codes already
            self.cls = conflict_class.tolist()
        else:  # hashable classes -> small ints (cheap cache keys)
            codes: dict[Hashable, int] = {}
            self.cls = [codes.setdefault(c, len(codes)) for c in conflict_class]
        self.parent = list(range(n))
        self.members: dict[int, list[int]] = {k: [k] for k in range(n)}
        self.classes: dict[int, dict[int, int]] = {k: {self.cls[k]: k} for k in range(n)}
        # pairs between adjacent clusters, keyed by root
        self.between: dict[int, dict[int, int]] = {}
        for a, b in zip(i.tolist(), j.tolist(), strict=True):
            self.between.setdefault(a, {})[b] = 1
            self.between.setdefault(b, {})[a] = 1
        self.cache: dict[tuple[int, int], str | None] = {}
        self.review: dict[tuple[int, int], tuple[int, int, float, str]] = {}
        self.rejected = 0

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def class_conflict(self, ca: int, cb: int, a: int, b: int) -> str | None:
        """The conflict of items ``a`` and ``b``, asked once per pair of their classes."""
        if self.conflict is None:
            return None
        key = (ca, cb) if ca <= cb else (cb, ca)
        if key not in self.cache:
            self.cache[key] = self.conflict(a, b)
        return self.cache[key]

    def blocks(self, reason: str) -> bool:
        return not self.allow or (self.blocking is not None and self.blocking(reason))

    def blocking_pair(self, ra: int, rb: int) -> tuple[int, int, str] | None:
        """A pair of the clusters ``ra`` and ``rb`` (one item per class each) whose conflict
        keeps them apart, as ``(low item, high item, reason)``, or ``None``."""
        for ca, xa in self.classes[ra].items():
            for cb, xb in self.classes[rb].items():
                r = self.class_conflict(ca, cb, xa, xb)
                if r is not None and self.blocks(r):
                    return min(xa, xb), max(xa, xb), r
        return None

    def run(self, sim: np.ndarray) -> list[list[int]]:
        """Take the pairs by descending ``sim`` (ties by key rank) and join where the rules
        allow; returns the clusters of two or more items (members in key order, clusters by
        their first member's key)."""
        i, j, rank, cls = self.i, self.j, self.rank, self.cls
        lo = np.minimum(rank[i], rank[j]) if len(i) else i
        hi = np.maximum(rank[i], rank[j]) if len(i) else j
        for e in np.lexsort((hi, lo, -np.round(sim, 12))).tolist():
            a, b = int(i[e]), int(j[e])
            if not self.allow and self.find(a) == self.find(b):
                continue  # already together, hence conflict-free
            reason = self.class_conflict(cls[a], cls[b], a, b)
            if reason is not None:
                p = (min(a, b), max(a, b))
                self.review[p] = (p[0], p[1], float(sim[e]), reason)
                if self.blocks(reason):
                    self.rejected += 1
                    continue
            ra, rb = self.find(a), self.find(b)
            if ra == rb:
                continue
            if self.between[ra].get(rb, 0) != len(self.members[ra]) * len(self.members[rb]):
                self.rejected += 1
                continue
            if self.conflict is not None and (not self.allow or self.blocking is not None):
                hit = self.blocking_pair(ra, rb)
                if hit:
                    self.review.setdefault(hit[:2], (hit[0], hit[1], float("nan"), hit[2]))
                    self.rejected += 1
                    continue
            self.join(*((ra, rb) if rank[ra] <= rank[rb] else (rb, ra)))
        return sorted(
            (sorted(m, key=lambda x: rank[x]) for m in self.members.values() if len(m) > 1),
            key=lambda m: rank[m[0]],
        )

    def join(self, root: int, other: int) -> None:
        """Join cluster ``other`` into cluster ``root``: members, classes and adjacency."""
        self.parent[other] = root
        self.members[root] += self.members.pop(other)
        for c, x in self.classes.pop(other).items():
            self.classes[root].setdefault(c, x)
        between = self.between
        nb_other = between.pop(other)
        nb_root = between[root]
        nb_root.pop(other, None)
        for c, cnt in nb_other.items():
            if c == root:
                continue
            nb_root[c] = nb_root.get(c, 0) + cnt
            nbc = between[c]
            nbc[root] = nbc.get(root, 0) + nbc.pop(other)


def split_list(flat: list[Any], sizes: Sequence[int]) -> list[list[Any]]:
    """``flat`` cut into consecutive lists of ``sizes`` (``sum(sizes) == len(flat)``); one
    slice per list, no NumPy array per group."""
    ends = list(itertools.accumulate(sizes))
    return [flat[e - k : e] for e, k in zip(ends, sizes, strict=True)]


def _keys_at(keys: Sequence[str] | np.ndarray, at: np.ndarray) -> Sequence[str] | np.ndarray:
    """The keys at positions ``at``: an integer array stays one, strings become a list."""
    if isinstance(keys, np.ndarray) and keys.dtype.kind in "iu":
        return keys[at]
    return np.asarray(keys, dtype=object)[at].tolist()


def key_ranks(keys: Sequence[str] | np.ndarray) -> np.ndarray:
    """``int64 [n]``: the position of each of ``keys`` in ascending order; ``keys``: distinct
    strings, or a NumPy integer array of distinct values (sorted as integers)."""
    rank = np.empty(len(keys), dtype=np.int64)
    ints = isinstance(keys, np.ndarray) and keys.dtype.kind in "iu"
    arr = keys if ints else np.asarray(keys, dtype=object)
    rank[np.argsort(arr, kind="stable")] = np.arange(len(keys))
    return rank


#: rows per chunk of the float64 centroid check: its temporaries (about 12 MB at d = 384)
#: stay in the allocator's heap and the cache instead of being mapped afresh per chunk
_CHECK_ROWS = 1 << 12


class RowsOf:
    """The rows ``rows`` of a ``[N, d]`` tensor, read only when asked: ``view[idx]`` is
    ``float32 [len(idx), d]`` (NumPy, on the host) of rows ``rows[idx]``. What
    :func:`centroid_clusters` takes as its ``vectors`` when the items are some rows of a
    larger table: its centroid check reads the rows of the clusters it checks, so no copy
    of every item's vector is made (161 MB for the 105,000 paired units of a 10^6 pass).

    Args:
        table: ``[N, d]`` tensor (any device and float dtype).
        rows: ``int64 [n]`` positions in ``table``.
    """

    def __init__(self, table: torch.Tensor, rows: np.ndarray) -> None:
        self.table = table
        self.rows = np.asarray(rows, dtype=np.int64)
        self.shape = (len(self.rows), int(table.shape[1]))

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        at = torch.from_numpy(np.ascontiguousarray(self.rows[idx])).to(self.table.device)
        return self.table.index_select(0, at).cpu().numpy()

    def subset(self, idx: np.ndarray) -> RowsOf:
        """The rows ``rows[idx]`` of the same table."""
        return RowsOf(self.table, self.rows[idx])


def _label_and_check(
    labels: np.ndarray,
    clusters: list[list[int]],
    vectors: np.ndarray | RowsOf,
    weights: np.ndarray,
    threshold: float,
) -> None:
    """Set ``labels`` of every cluster's members to its smallest member, and assert the
    centroid condition of all clusters at once in float64 (a bug, or pairs whose ``sim``
    disagrees with the vectors, if it fails)."""
    if not clusters:
        return
    sizes = np.fromiter((len(m) for m in clusters), np.int64, len(clusters))
    flat = np.fromiter((x for m in clusters for x in m), np.int64, int(sizes.sum()))
    _label_and_check_flat(labels, flat, sizes, vectors, weights, threshold)


def _label_and_check_flat(
    labels: np.ndarray,
    flat: np.ndarray,
    sizes: np.ndarray,
    vectors: np.ndarray | RowsOf,
    weights: np.ndarray,
    threshold: float,
) -> None:
    """:func:`_label_and_check` on clusters given as ``flat`` member positions
    (``int64``, cluster after cluster) and their ``sizes``. The check runs in chunks of whole
    clusters of about :data:`_CHECK_ROWS` rows, with ``torch.index_add_`` for the centroid
    sums."""
    if not len(sizes):
        return
    starts = np.cumsum(sizes) - sizes
    labels[flat] = np.repeat(np.minimum.reduceat(flat, starts), sizes)
    w = np.asarray(weights, dtype=np.float64)[flat]
    w = w / np.repeat(np.maximum.reduceat(w, starts), sizes)
    vecs = vectors if isinstance(vectors, RowsOf) else np.asarray(vectors)
    ends = np.cumsum(sizes)
    # one set of chunk buffers for every chunk (fresh ones map their pages in each time)
    most = max(_CHECK_ROWS, int(sizes.max()))
    d = int(vecs.shape[1])
    v64 = torch.empty((most, d), dtype=torch.float64)
    tmp = torch.empty((most, d), dtype=torch.float64)
    acc = torch.empty((most, d), dtype=torch.float64)
    c0, worst = 0, math.inf
    while c0 < len(sizes):
        # whole clusters up to about _CHECK_ROWS rows (at least one)
        c1 = max(c0 + 1, int(np.searchsorted(ends, starts[c0] + _CHECK_ROWS, side="right")))
        r0, r1 = int(starts[c0]), int(ends[c1 - 1])
        seg = torch.from_numpy(np.repeat(np.arange(c1 - c0), sizes[c0:c1]))
        v, t = v64[: r1 - r0], tmp[: r1 - r0]
        v.copy_(torch.from_numpy(np.asarray(vecs[flat[r0:r1]])))
        torch.mul(v, torch.from_numpy(w[r0:r1])[:, None], out=t)
        s = acc[: c1 - c0].zero_()
        s.index_add_(0, seg, t)
        s /= torch.linalg.vector_norm(s, dim=1, keepdim=True)
        torch.index_select(s, 0, seg, out=t)
        worst = min(worst, float(t.mul_(v).sum(1).min()))
        c0 = c1
    assert worst >= threshold - 1e-9, f"centroid condition violated: {worst}"


def components(i: np.ndarray, j: np.ndarray, n: int) -> np.ndarray:
    """``int64 [n]``: the connected component of each of ``n`` items under the edges
    ``(i[e], j[e])``, labelled by its smallest item.

    Hooking and pointer jumping (Shiloach and Vishkin, "An O(log n) parallel connectivity
    algorithm", J. Algorithms 3(1), 1982), in whole-array steps: every edge hooks the larger
    of its two labels onto the smaller, then every label jumps to its label's label until
    none moves; repeated until no edge joins two labels.
    """
    lab = np.arange(n, dtype=np.int64)
    while True:
        li, lj = lab[i], lab[j]
        diff = li != lj
        if not diff.any():
            return lab
        lo, hi = np.minimum(li[diff], lj[diff]), np.maximum(li[diff], lj[diff])
        np.minimum.at(lab, hi, lo)
        while True:
            nxt = lab[lab]
            if np.array_equal(nxt, lab):
                break
            lab = nxt


def _on_paired_items(
    involved: np.ndarray,
    i: np.ndarray,
    j: np.ndarray,
    sim: np.ndarray,
    vectors: np.ndarray | RowsOf,
    weights: np.ndarray,
    keys: Sequence[str] | np.ndarray,
    threshold: float,
    conflict: Callable[[int, int], str | None] | None,
    allow_conflicts: bool,
    conflict_class: Sequence[Hashable] | None,
    blocking: Callable[[str], bool] | None,
    greedy_only: bool,
    conflict_many: Callable[[np.ndarray, np.ndarray], Sequence[str | None]] | None,
) -> ClusterResult:
    """:func:`centroid_clusters` over only the items that appear in a pair (``involved``,
    sorted positions), mapped back: an item in no pair is its own cluster, so the Python
    work is O(paired items), not O(n). The map is monotone and the key order among paired
    items is unchanged, so labels, cluster order and tie-breaking are the same as over all
    items."""
    n = len(keys)
    ci, cj = np.searchsorted(involved, i), np.searchsorted(involved, j)
    sub_conflict = (
        None if conflict is None else (lambda a, b: conflict(int(involved[a]), int(involved[b])))
    )
    sub_many = (
        None if conflict_many is None else (lambda a, b: conflict_many(involved[a], involved[b]))
    )
    if conflict_class is None:
        sub_class = None
    elif isinstance(conflict_class, np.ndarray):
        sub_class = conflict_class[involved]
    else:
        sub_class = [conflict_class[x] for x in involved.tolist()]
    sub = centroid_clusters(
        ci,
        cj,
        sim,
        vectors.subset(involved) if isinstance(vectors, RowsOf) else np.asarray(vectors)[involved],
        np.asarray(weights)[involved],
        _keys_at(keys, involved),
        threshold,
        conflict=sub_conflict,
        allow_conflicts=allow_conflicts,
        conflict_class=sub_class,
        blocking=blocking,
        greedy_only=greedy_only,
        conflict_many=sub_many,
    )
    labels = np.arange(n, dtype=np.int64)
    labels[involved] = involved[sub.labels]
    return ClusterResult(
        labels,
        [involved[m].tolist() for m in sub.clusters],
        [(int(involved[a]), int(involved[b]), s_, r) for a, b, s_, r in sub.review],
        sub.rejected,
    )


def _class_codes(conflict_class: Sequence[Hashable] | None, n: int) -> np.ndarray:
    """``int64 [n]``: the conflict class of each item as a small integer (each item its own
    class when ``conflict_class`` is ``None``)."""
    if conflict_class is None:
        return np.arange(n, dtype=np.int64)
    if isinstance(conflict_class, np.ndarray):  # any integers: made dense, in [0, n)
        return np.unique(conflict_class, return_inverse=True)[1].astype(np.int64).reshape(-1)
    ids: dict[Hashable, int] = {}
    return np.fromiter((ids.setdefault(c, len(ids)) for c in conflict_class), np.int64, n)


def _asked_conflicts(
    i: np.ndarray,
    j: np.ndarray,
    ask: np.ndarray,
    n: int,
    conflict: Callable[[int, int], str | None] | None,
    conflict_class: Sequence[Hashable] | None,
    conflict_many: Callable[[np.ndarray, np.ndarray], Sequence[str | None]] | None = None,
) -> tuple[list[str | None], np.ndarray, np.ndarray]:
    """The conflicts of the pairs ``(i[e], j[e])`` where ``ask[e]`` (``bool [p]``), asked
    once per pair of conflict classes.

    Returns:
        ``(asked, which, flagged)``: the answers; ``int64 [p]``, pair ``e``'s answer is
        ``asked[which[e]]`` (``-1`` where not asked); ``bool [p]``, the pairs with a
        conflict.
    """
    asked: list[str | None] = []
    which = np.full(len(i), -1, np.int64)
    flagged = np.zeros(len(i), bool)
    if conflict is None or not ask.any():
        return asked, which, flagged
    cls = _class_codes(conflict_class, n)
    ca, cb = cls[i], cls[j]
    ckey = np.minimum(ca, cb) * n + np.maximum(ca, cb)
    e_ask = np.flatnonzero(ask)
    _, first, inv = np.unique(ckey[e_ask], return_index=True, return_inverse=True)
    rep = e_ask[first]
    if conflict_many is not None:
        asked = list(conflict_many(i[rep], j[rep]))
        if len(asked) != len(rep):
            raise ValueError(f"conflict_many gave {len(asked)} answers for {len(rep)} pairs")
    else:
        asked = [conflict(a, b) for a, b in zip(i[rep].tolist(), j[rep].tolist(), strict=True)]
    which[e_ask] = inv
    hit = np.fromiter((r is not None for r in asked), bool, len(asked))
    flagged[e_ask] = hit[inv]
    return asked, which, flagged


def _isolated_pairs(
    i: np.ndarray,
    j: np.ndarray,
    sim: np.ndarray,
    conflicting: np.ndarray,
    asked: list[str | None],
    which: np.ndarray,
    allow_conflicts: bool,
    blocking: Callable[[str], bool] | None,
) -> tuple[list[tuple[int, int, float, str]], np.ndarray]:
    """Isolated pairs with a conflict (``conflicting``, ``bool [p]``; answers ``asked`` at
    ``which``): each reported as ``(low item, high item, sim, reason)``, and joined unless
    the conflict blocks. Returns the reports and ``bool [p]``: the pairs kept apart."""
    review: list[tuple[int, int, float, str]] = []
    blocked = np.zeros(len(i), bool)
    for e in np.flatnonzero(conflicting).tolist():
        a, b, r = int(i[e]), int(j[e]), asked[int(which[e])]
        assert r is not None
        review.append((min(a, b), max(a, b), float(sim[e]), r))
        blocked[e] = not allow_conflicts or (blocking is not None and blocking(r))
    return review, blocked


def _by_components(
    i: np.ndarray,
    j: np.ndarray,
    sim: np.ndarray,
    vectors: np.ndarray | RowsOf,
    weights: np.ndarray,
    keys: Sequence[str] | np.ndarray,
    threshold: float,
    conflict: Callable[[int, int], str | None] | None,
    allow_conflicts: bool,
    conflict_class: Sequence[Hashable] | None,
    blocking: Callable[[str], bool] | None,
    conflict_many: Callable[[np.ndarray, np.ndarray], Sequence[str | None]] | None = None,
) -> ClusterResult:
    """:func:`centroid_clusters` where every item is in a pair, by connected components of
    the pair graph (:func:`components`), with the same result as the pair-by-pair loop:

    * a **complete** component (every two of its items a pair) whose pairs have no conflict
      is one cluster: every join in the loop is complete-linked and conflict-free, so the
      loop joins it whatever the order, and rejects none of its pairs;
    * a complete component of two (an isolated pair) with a conflict is reported in
      ``review`` and is a cluster only if the conflict does not block;
    * every other component (incomplete, or complete with a conflicting pair) goes through
      the loop, on its own pairs: components share no pair, so the loop's choices in one
      never depend on another.

    The conflict of each pair of a complete component is asked once per pair of conflict
    classes. Only the loop's components cost Python work per pair beyond that.
    """
    n = len(keys)
    comp = components(i, j, n)
    size = np.bincount(comp, minlength=n)
    pc = comp[i]
    complete = np.bincount(pc, minlength=n) == size * (size - 1) // 2
    in_complete = complete[pc]
    asked, which, flagged = _asked_conflicts(
        i, j, in_complete, n, conflict, conflict_class, conflict_many
    )
    pair2 = in_complete & (size[pc] == 2)
    review, two_blocked = _isolated_pairs(
        i, j, sim, pair2 & flagged, asked, which, allow_conflicts, blocking
    )
    rejected = int(two_blocked.sum())
    # complete components with a conflict among three or more: the loop decides
    loop_comp = ~complete
    loop_comp[pc[in_complete & flagged & ~pair2]] = True
    in_loop = loop_comp[pc]
    rank = key_ranks(keys)
    clusters: list[list[int]] = []
    labels = np.arange(n, dtype=np.int64)
    if in_loop.any():
        sub = centroid_clusters(
            i[in_loop],
            j[in_loop],
            sim[in_loop],
            vectors,
            weights,
            keys,
            threshold,
            conflict=conflict,
            allow_conflicts=allow_conflicts,
            conflict_class=conflict_class,
            blocking=blocking,
            greedy_only=True,
        )
        clusters, labels = list(sub.clusters), sub.labels.copy()
        review += sub.review
        rejected += sub.rejected
    # the shortcut's clusters: whole components, members in key order
    whole = complete & ~loop_comp & (size >= 2)
    whole[pc[two_blocked]] = False
    members = np.flatnonzero(whole[comp])
    if len(members):
        members = members[np.lexsort((rank[members], comp[members]))]
        cuts = np.flatnonzero(np.diff(comp[members])) + 1
        sizes = np.diff(np.r_[0, cuts, len(members)])
        _label_and_check_flat(labels, members, sizes, vectors, weights, threshold)
        clusters += split_list(members.tolist(), sizes.tolist())
    clusters.sort(key=lambda m: rank[m[0]])
    return ClusterResult(labels, clusters, sorted(review), rejected)

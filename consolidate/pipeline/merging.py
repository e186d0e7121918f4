"""Stage 5, merge: one request per cluster to the merger (one batch call), supersedes for
conflict-handling mergers, then one new record per merge and per exact-only group."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..config import PassConfig
from ..ops.fidelity import lost_members
from ..ops.merge import (
    MergeMember,
    Merger,
    MergeRequest,
    MergeResponse,
    fact_time,
    newer_fact_times,
)
from ..text import text_hashes
from ..workers import fork_map, split_evenly, work_parts
from .exact import _ranges
from .rows import new_records
from .state import PassState, arrow_strings, claim_ids, merged_id

__all__ = [
    "merge_stage",
    "members",
    "latency_stats",
    "answer_requests",
    "checked_merge",
    "superseding",
    "PAIRWISE_SIMILARITIES_MAX",
]

#: clusters up to this size list every pair's cosine in their request and changelog event;
#: bigger ones list each member's cosine to the centroid (pairs grow quadratically)
PAIRWISE_SIMILARITIES_MAX = 16


def source_texts(st: PassState, ids: list[str]) -> dict[str, tuple[str, ...]]:
    """For each of ``ids`` that earlier merges produced: the texts of the tombstones it was
    merged from, followed down ``merged_into`` to the records that are no merge themselves,
    in id order. Ids without stored members are absent. One vectorised lookup per merge
    generation."""
    mi = st.meta["merged_into"].to_numpy(object)
    has = (st.meta["deleted_reason"].to_numpy(object) == "merged") & pd.notna(mi) & ~st.gone
    if not has.any() or not ids:
        return {}
    rows = np.flatnonzero(has)
    parent = pd.Series(mi[rows], dtype=object)
    ids_all = st.meta["id"].to_numpy(object)
    texts = st.meta["text"].to_numpy(object)
    out: dict[str, tuple[str, ...]] = {}
    # frontier: the ids to expand next, per asked id; every row found, per asked id
    frontier = {i: [i] for i in ids}
    leaves: dict[str, list[int]] = {}
    for _ in range(64):  # merge generations; a cycle would be a corrupt store
        want = {x for xs in frontier.values() for x in xs}
        hit = rows[parent.isin(want).to_numpy()]
        if not len(hit):
            break
        kids: dict[str, list[int]] = {}
        for r in hit.tolist():
            kids.setdefault(mi[r], []).append(r)
        nxt: dict[str, list[str]] = {}
        for top, xs in frontier.items():
            for x in xs:
                for r in kids.get(x, ()):
                    nxt.setdefault(top, []).append(ids_all[r])
                    leaves.setdefault(top, []).append(r)
        # a child that has children of its own is replaced by them in the next round
        frontier = nxt
    merged_ids = set(parent.tolist())
    for top, rs in leaves.items():
        keep = sorted((ids_all[r], texts[r]) for r in rs if ids_all[r] not in merged_ids)
        if keep:
            out[top] = tuple(str(t) for _, t in keep)
    return out


def _own_strings(values: np.ndarray) -> list[Any]:
    """``values`` (``object [k]``) as a list of new string objects (through an Arrow copy,
    :func:`~consolidate.pipeline.state.arrow_strings`), or as they are where Arrow cannot
    hold them (a lone surrogate, a value that is no string)."""
    arr = arrow_strings(values)
    return values.tolist() if arr is None else arr.to_pylist()


#: the :class:`~consolidate.ops.merge.MergeMember` fields :func:`member_columns` reads, in
#: the order of its lists
_MEMBER_FIELDS = (
    "id",
    "text",
    "importance",
    "last_used",
    "strength",
    "created_at",
    "source_ids",
    "valid_from",
    "sources",
)


def member_columns(st: PassState, groups: list[np.ndarray]) -> list[list[Any]]:
    """The values of each :data:`_MEMBER_FIELDS` field at the groups' rows (group after
    group), one list per field, read once for all groups; ``sources`` from
    :func:`source_texts`. Every value is a new object next to the others in memory (ids
    and texts through an Arrow copy, lists as tuples): a forked worker that reads them,
    rather than the row table's own objects, copies few pages (reading the row table's
    strings copied 115 MiB of pages into each worker at 10^6 rows)."""
    rows = np.concatenate(groups).astype(np.int64) if groups else np.zeros(0, np.int64)

    def col(c: str, dtype: Any) -> np.ndarray:  # the rows of one column (no table copy)
        return st.meta[c].to_numpy(dtype)[rows]

    ids = [str(i) for i in _own_strings(col("id", object))]
    src = source_texts(st, ids)
    return [
        ids,
        [str(t) for t in _own_strings(col("text", object))],
        *(col(c, np.float64).tolist() for c in ("importance", "last_used", "strength")),
        col("created_at", np.float64).tolist(),
        [tuple(x) for x in col("source_ids", object).tolist()],
        col("valid_from", np.float64).tolist(),
        [src.get(i, ()) for i in ids] if src else [()] * len(ids),
    ]


def members_of(
    cols: list[list[Any]], offsets: Sequence[int], lo: int = 0, hi: int | None = None
) -> list[tuple[MergeMember, ...]]:
    """The :class:`~consolidate.ops.merge.MergeMember` of each row of groups ``lo..hi``
    (default all), from :func:`member_columns`; group ``g``'s rows are at
    ``offsets[g]:offsets[g + 1]`` of its lists."""
    hi = len(offsets) - 1 if hi is None else hi
    a = offsets[lo]
    flat = [MergeMember(*vals) for vals in zip(*(c[a : offsets[hi]] for c in cols), strict=True)]
    return [tuple(flat[offsets[g] - a : offsets[g + 1] - a]) for g in range(lo, hi)]


def members(st: PassState, groups: list[np.ndarray]) -> list[tuple[MergeMember, ...]]:
    """The :class:`~consolidate.ops.merge.MergeMember` of each row of each group (rows in the
    given order): :func:`members_of` :func:`member_columns`."""
    if not groups:
        return []
    return members_of(member_columns(st, groups), _offsets(groups))


def _offsets(groups: list[np.ndarray]) -> list[int]:
    """``[0, len(g0), len(g0) + len(g1), ...]``: where each group starts in the
    concatenation of ``groups`` (and where the last ends)."""
    return np.cumsum([0] + [len(g) for g in groups]).tolist()


def _canonical_texts(st: PassState, groups: list[np.ndarray]) -> list[str]:
    """The text of each group's first member in :func:`~consolidate.ops.merge.canonical_order`
    (importance desc, last_used desc, strength desc, id asc), chosen with one sort."""
    if not groups:
        return []
    rows = np.concatenate(groups)
    gid = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    order = np.lexsort(
        (
            st.id_rank[rows],
            -st.col("strength")[rows],
            -st.col("last_used")[rows],
            -st.col("importance")[rows],
            gid,
        )
    )
    first = order[np.r_[0, np.flatnonzero(np.diff(gid[order])) + 1]]
    return [str(t) for t in st.meta["text"].to_numpy(object)[rows[first]]]


def latency_stats(responses: list[MergeResponse]) -> tuple[float, float] | None:
    """``(p50, p95)`` of the responses' ``latency_s`` (seconds), or ``None``."""
    return _p50_p95([r.extra["latency_s"] for r in responses if "latency_s" in r.extra])


def _p50_p95(latencies: list[float]) -> tuple[float, float] | None:
    """``(p50, p95)`` of ``latencies`` (seconds), or ``None`` when there are none."""
    if not latencies:
        return None
    return float(np.percentile(latencies, 50)), float(np.percentile(latencies, 95))


def in_id_order(rank: np.ndarray, rows: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """Groups of rows, each in id order, with one sort for all groups.

    Args:
        rank: ``int64 [n]`` id rank of every row (``PassState.id_rank``).
        rows: ``int64 [m]`` row positions, group after group.
        sizes: ``int64 [g]`` rows per group (summing to ``m``).

    Returns:
        ``g`` ``int64`` arrays: each group's rows sorted by id.
    """
    gid = np.repeat(np.arange(len(sizes)), sizes)
    rows = rows[np.lexsort((rank[rows], gid))]
    return np.split(rows, np.cumsum(sizes)[:-1])


def clustered_units(clusters: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(units, sizes)``: ``int64`` every cluster's unit positions, cluster after cluster,
    and ``int64 [len(clusters)]`` the units per cluster."""
    sizes = np.fromiter(map(len, clusters), np.int64, len(clusters))
    units = np.fromiter((k for c in clusters for k in c), np.int64, int(sizes.sum()))
    return units, sizes


def cluster_rows(st: PassState, units: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """The rows of each cluster's units (``int64``, in id order), for all clusters at once;
    ``units, sizes``: :func:`clustered_units` of ``st.clusters``."""
    u = st.units
    if not st.clusters or u is None:
        return []
    per_unit = u.size[units]
    rows = u.rows[_ranges(u.start[units], per_unit)]
    per_cluster = np.add.reduceat(per_unit, np.cumsum(sizes) - sizes)
    return in_id_order(st.id_rank, rows, per_cluster)


def _centroid_similarities(st: PassState) -> dict[int, tuple[tuple[str, str, float], ...]]:
    """``(id, "centroid", cosine)`` of each member of each cluster bigger than
    :data:`PAIRWISE_SIMILARITIES_MAX`, by cluster position (read from the units' vectors
    here: a forked worker never reads vectors)."""
    u = st.units
    assert u is not None
    ids = st.meta["id"].to_numpy(object)
    sizes = np.fromiter(map(len, st.clusters), np.int64, len(st.clusters))
    out = {}
    for x in np.flatnonzero(sizes > PAIRWISE_SIMILARITIES_MAX).tolist():
        c = st.clusters[x]
        keys = ids[u.first[c]].tolist()  # only these clusters' units (rare)
        uv = u.vec[c].cpu().numpy().astype(np.float64)
        cen = (u.weight[c, None] * uv).sum(0)
        cen /= np.linalg.norm(cen)
        out[x] = tuple(
            (k, "centroid", round(float(v @ cen), 6)) for k, v in zip(keys, uv, strict=True)
        )
    return out


@dataclass
class _RequestInputs:
    """What the requests of any run of clusters read, made before a fork (so that a forked
    worker reads new objects next to each other, never the row table's, and no vector):
    the members' columns (:func:`member_columns`), the rows per cluster, each cluster's
    namespace, the key (first id) of each clustered unit at ``unit_at[unit]``, the pairs'
    keys ``i * units + j``, the conflicting id pairs per cluster and the similarities of
    clusters too big to list every pair (:func:`_centroid_similarities`)."""

    cols: list[list[Any]]
    offsets: list[int]
    namespaces: list[str]
    unit_keys: np.ndarray
    unit_at: np.ndarray
    pair_key: np.ndarray
    conflicts: dict[int, list[tuple[str, str, str]]]
    big: dict[int, tuple[tuple[str, str, float], ...]]

    @classmethod
    def of(
        cls, st: PassState, groups: list[np.ndarray], units: np.ndarray, sizes: np.ndarray
    ) -> _RequestInputs:
        """The inputs of the requests of ``st.clusters``, whose rows are ``groups``;
        ``units, sizes``: :func:`clustered_units` of ``st.clusters``."""
        u, p = st.units, st.pairs
        assert u is not None
        ids = st.meta["id"].to_numpy(object)
        unit_at = np.full(len(u), -1, np.int64)
        unit_at[units] = np.arange(len(units))
        first = units[np.cumsum(sizes) - sizes]
        # conflicting pairs inside each cluster (only a conflict-handling merger gets any),
        # as record-id pairs: every row of one unit against every row of the other
        confl_of: dict[int, list[tuple[str, str, str]]] = {}
        if st.review:
            cluster_of = np.full(len(u), -1, np.int64)
            cluster_of[units] = np.repeat(np.arange(len(sizes)), sizes)
            for a, b, _, r in st.review:
                x = int(cluster_of[a])
                if x >= 0 and cluster_of[b] == x:
                    confl_of.setdefault(x, []).extend(
                        (str(ids[ra]), str(ids[rb]), r)
                        for ra in u.members(a)
                        for rb in u.members(b)
                    )
        return cls(
            cols=member_columns(st, groups),
            offsets=_offsets(groups),
            namespaces=[str(x) for x in _own_strings(st.ns_names[u.ns[first]])],
            unit_keys=np.array(_own_strings(ids[u.first[units]]), dtype=object),
            unit_at=unit_at,
            pair_key=(p.i * len(u) + p.j) if p is not None else np.zeros(0, np.int64),
            conflicts=confl_of,
            big=_centroid_similarities(st),
        )


def _requests(
    st: PassState, version: int, got: _RequestInputs, lo: int, hi: int
) -> list[MergeRequest]:
    """One :class:`MergeRequest` per cluster ``lo..hi`` of ``st.clusters`` (members in id
    order), from the clusters' :class:`_RequestInputs` ``got``."""
    u, p = st.units, st.pairs
    assert u is not None
    clusters = st.clusters[lo:hi]
    pair_key = got.pair_key
    # cosine of every member pair of the small clusters, looked up at once in the
    # (i, j)-sorted pairs (no dict of every pair: millions in a dense namespace)
    small = [c for c in clusters if len(c) <= PAIRWISE_SIMILARITIES_MAX]
    combos = [(a, b) for c in small for y, a in enumerate(c) for b in c[y + 1 :]]
    ca = np.array([a for a, _ in combos], np.int64)
    cb = np.array([b for _, b in combos], np.int64)
    want = np.minimum(ca, cb) * len(u) + np.maximum(ca, cb)
    at = np.clip(np.searchsorted(pair_key, want), 0, max(len(pair_key) - 1, 0))
    found = pair_key[at] == want if len(pair_key) else np.zeros(len(want), bool)
    sim_of = np.where(found, p.sim[at] if p is not None and len(pair_key) else 0.0, np.nan)
    # every combination's (key, key, cosine) at once; a cluster takes its slice (without
    # the pairs the join did not return, where it has any)
    keys = got.unit_keys
    flat = list(
        zip(
            keys[got.unit_at[ca]].tolist(),
            keys[got.unit_at[cb]].tolist(),
            [round(sv, 6) for sv in sim_of.tolist()],
            strict=True,
        )
    )
    missing = np.r_[0, np.cumsum(~found)]
    next_combo = 0

    out = []
    mems = members_of(got.cols, got.offsets, lo, hi)
    for x, (c, mem) in enumerate(zip(clusters, mems, strict=True)):
        if len(c) <= PAIRWISE_SIMILARITIES_MAX:
            a, b = next_combo, next_combo + len(c) * (len(c) - 1) // 2
            sims = tuple(
                flat[a:b] if missing[b] == missing[a] else (t for t in flat[a:b] if t[2] == t[2])
            )
            next_combo = b
        else:
            sims = got.big[lo + x]
        out.append(
            MergeRequest(
                cluster_id=merged_id(version, [m.id for m in mem]),
                namespace=got.namespaces[lo + x],
                members=mem,
                similarities=sims,
                conflicts=tuple(got.conflicts.get(lo + x, ())),
            )
        )
    return out


#: requests per call of the merger's ``merge_batch``: each chunk's merges are checked before
#: the next chunk is merged
MERGE_CHUNK = 8192

#: requests per ``merge_batch`` call of a model-free merger (``pure``): small enough that a
#: chunk's member clauses, read by the merger, are still in the fidelity checker's cache
#: (:func:`~consolidate.ops.fidelity.clauses_of`, 8,192 texts) when the check reads them
PURE_MERGE_CHUNK = 256

#: clusters from which a model-free merger (``pure``) and the fidelity check run in forked
#: processes (:func:`~consolidate.workers.fork_map`); fewer are answered inline
PARALLEL_MIN_CLUSTERS = 1_000


def superseding(
    req: MergeRequest, resp: MergeResponse
) -> tuple[dict[str, float], list[str], list[str]]:
    """``(allowed, bad, sup)`` of a response: the member ids :func:`newer_fact_times`
    allows to be superseded (with their closing times), the ids the merger superseded
    without that (the response is then not applied), and the ids superseded (sorted;
    empty when ``bad``)."""
    allowed = newer_fact_times(req) if resp.superseded else {}
    bad = sorted(set(resp.superseded) - set(allowed))
    sup = [] if bad else sorted(set(resp.superseded))
    return allowed, bad, sup


def checked_merge(req: MergeRequest, resp: MergeResponse, threshold: float) -> dict[str, list[str]]:
    """The fidelity check of a response's merged text: the members (those it does not
    supersede) whose content the text loses (:func:`~consolidate.ops.fidelity.lost_members`,
    against each member's :attr:`~consolidate.ops.merge.MergeMember.merge_texts`); empty when
    nothing is lost or nothing is merged (no text, a ``bad`` supersede, fewer than two
    members left)."""
    text = resp.text.strip() if resp.text is not None else ""
    _, bad, sup = superseding(req, resp)
    rest = [m for m in req.members if m.id not in sup]
    if not text or bad or len(rest) < 2:
        return {}
    return lost_members(text, ((m.id, m.merge_texts) for m in rest), threshold)


def answer_requests(
    merger: Merger, requests: list[MergeRequest], threshold: float
) -> list[tuple[MergeResponse, dict[str, list[str]]]]:
    """The merger's response to each request, :data:`MERGE_CHUNK` requests per
    ``merge_batch`` call (:data:`PURE_MERGE_CHUNK` for a model-free merger), each with its
    fidelity check (:func:`checked_merge`).

    Raises:
        ValueError: the merger returned the wrong number of responses for a chunk.
    """
    out = []
    chunk = PURE_MERGE_CHUNK if getattr(merger, "pure", False) else MERGE_CHUNK
    for k0 in range(0, len(requests), chunk):
        reqs = requests[k0 : k0 + chunk]
        got = merger.merge_batch(reqs)
        if len(got) != len(reqs):
            raise ValueError(
                f"merger {merger.name!r} returned {len(got)} responses for {len(reqs)} requests"
            )
        out += [(r, checked_merge(q, r, threshold)) for q, r in zip(reqs, got, strict=True)]
    return out


#: a merge to write: its rows, text, ``op`` (``merge`` or ``exact_merge``), the fields its
#: event adds, and its id when known already (the request's ``cluster_id``, when every row
#: of the cluster is merged), else ``None``
_Merge = tuple[np.ndarray, str, str, dict[str, Any], str | None]


@dataclass
class _Applied:
    """What the answers of a run of clusters did: the validity intervals closed (row ->
    new ``valid_to``), the events in order (supersedes, declined merges), the merges to
    write, the units of declined clusters (their exact groups fall back to exact merges),
    the ``text_hash`` of merged texts (when computed in a forked worker), and the counts
    for :class:`~consolidate.pipeline.state.PassStats` and the merger's accounting.
    Small: a forked worker sends it back whole."""

    closed_to: dict[int, float] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    merges: list[_Merge] = field(default_factory=list)
    declined_units: list[int] = field(default_factory=list)
    hashes: dict[str, str] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)  # merged text length / longest member's
    closed: int = 0
    refused: int = 0
    lost: int = 0
    lost_refused: int = 0
    # each response's model calls, prompt and completion tokens (summed once, in order)
    calls: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def add(self, other: _Applied) -> None:
        """Append ``other`` (the next run of clusters) to this one."""
        self.closed_to.update(other.closed_to)
        self.events += other.events
        self.merges += other.merges
        self.declined_units += other.declined_units
        self.hashes.update(other.hashes)
        self.ratios += other.ratios
        self.latencies += other.latencies
        self.calls += other.calls
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        for k in ("closed", "refused", "lost", "lost_refused"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


def _apply_answers(
    st: PassState,
    cfg: PassConfig,
    merger: Merger,
    groups: list[np.ndarray],
    longest: np.ndarray,
    requests: list[MergeRequest],
    answered: list[tuple[MergeResponse, dict[str, list[str]]]],
    lo: int,
) -> _Applied:
    """The answers to clusters ``lo, lo + 1, ...`` (``requests`` and ``answered`` in that
    order; ``groups`` and ``longest``: every cluster's rows and longest text,
    :func:`_longest_texts`): supersedes, then the merge or its refusal, per cluster. Reads
    the state, writes none of it (a forked worker may run it)."""
    done = _Applied()
    valid_to = st.col("valid_to")
    for x, (req, (resp, lost)) in enumerate(zip(requests, answered, strict=True)):
        allowed, bad, sup = superseding(req, resp)
        rest = groups[lo + x].tolist()
        width = int(longest[lo + x])
        if sup:  # the members are the rows, in the same order
            row_of = {m.id: r for m, r in zip(req.members, rest, strict=True)}
            gone = _supersede(req, resp, sup, allowed, row_of, valid_to, merger.name, done)
            rest = [r for r in rest if r not in gone]
            width = max((len(m.text) for m in req.members if row_of[m.id] not in gone), default=0)
        _merge_or_decline(cfg, req, resp, st.clusters[lo + x], rest, bad, sup, lost, done, width)
        done.calls.append(resp.calls)
        done.prompt_tokens.append(resp.prompt_tokens)
        done.completion_tokens.append(resp.completion_tokens)
        if "latency_s" in resp.extra:
            done.latencies.append(resp.extra["latency_s"])
    return done


def _answer_clusters(
    st: PassState,
    cfg: PassConfig,
    merger: Merger,
    version: int,
    units: np.ndarray,
    sizes: np.ndarray,
) -> _Applied:
    """Requests, answers (:func:`answer_requests`) and what they do
    (:func:`_apply_answers`) for every cluster, in order. In ``st.workers`` processes, each
    on a run of clusters, when the merger is ``pure`` (no model, no I/O:
    :class:`~consolidate.ops.merge.ExtractiveMerger`) and there are at least
    :data:`PARALLEL_MIN_CLUSTERS` clusters, else inline; a forked worker also gives the
    ``text_hash`` of its merged texts (inline, the merge stage computes those it needs).
    ``units, sizes``: :func:`clustered_units` of ``st.clusters``."""
    groups = cluster_rows(st, units, sizes)
    workers = st.workers
    if not getattr(merger, "pure", False) or len(groups) < PARALLEL_MIN_CLUSTERS:
        workers = 1
    # vectors and row table: read here, never in a worker
    inputs = _RequestInputs.of(st, groups, units, sizes)
    chunk = PURE_MERGE_CHUNK if getattr(merger, "pure", False) else MERGE_CHUNK
    longest = _longest_texts(st.meta["text"].to_numpy(object), groups)

    def part(ab: tuple[int, int]) -> _Applied:
        # a chunk's requests at a time: only those are held (in a worker: its own memory)
        done = _Applied()
        for a in range(ab[0], ab[1], chunk):
            reqs = _requests(st, version, inputs, a, min(a + chunk, ab[1]))
            got = answer_requests(merger, reqs, cfg.fidelity_threshold)
            done.add(_apply_answers(st, cfg, merger, groups, longest, reqs, got, a))
        if workers > 1:
            merged = [m[1] for m in done.merges]
            done.hashes = dict(zip(merged, text_hashes(merged), strict=True))
            # each merge's rows as a list: a worker's answer pickles thousands of them, and
            # a small NumPy array pickles and loads about ten times slower than a list
            done.merges = [(m[0].tolist(), *m[1:]) for m in done.merges]
        return done

    out = _Applied()
    cuts = split_evenly(len(groups), work_parts(workers))
    for done in fork_map(part, cuts, workers, st.vector_buffers()):
        out.add(done)
    if workers > 1:
        out.merges = [(np.asarray(m[0], np.int64), *m[1:]) for m in out.merges]
    return out


def merge_stage(st: PassState, cfg: PassConfig, merger: Merger, version: int) -> PassState:
    """Ask ``merger`` for the clusters (:data:`MERGE_CHUNK` at a time), apply its answers, write
    the merged records.

    For each cluster: superseded members (only ids that :func:`newer_fact_times` allows) get
    their ``valid_to`` closed and stay live (``supersede`` events); the rest is merged if the
    merger wrote a text and at least two remain. Every merged text, whichever merger wrote
    it, is checked by the fidelity checker (:func:`~consolidate.ops.fidelity.lost_members`,
    against each member's :attr:`~consolidate.ops.merge.MergeMember.merge_texts`): with
    ``cfg.fidelity="refuse"`` (the default) a merge that loses a member's content is not
    made; with ``"report"`` it is made and the lost members are listed in its event
    (``lost_members``) and counted (``members_lost``). A merge not made gets a
    ``merge_declined`` event (unless something was superseded; it lists ``lost_members``
    when the checker refused it) and its exact groups fall back to exact-only merges. Every
    exact group not inside a merged cluster becomes an ``exact_merge`` with its canonical
    text (:func:`~consolidate.ops.merge.canonical_order`). Merged rows become tombstones
    (``deleted_reason="merged"``, ``merged_into``); reflections that named a merged row
    follow it to its merged record.

    Raises:
        ValueError: the merger returned the wrong number of responses.
    """
    assert st.units is not None
    units, sizes = clustered_units(st.clusters)
    done = _answer_clusters(st, cfg, merger, version, units, sizes)
    valid_to = st.col("valid_to").copy()  # float64, whatever the caller's column held
    if done.closed_to:
        closed = np.fromiter(done.closed_to, np.int64, len(done.closed_to))
        valid_to[closed] = np.fromiter(done.closed_to.values(), np.float64, len(closed))
    st.meta["valid_to"] = valid_to
    st.events += done.events
    in_cluster = np.setdiff1d(units, np.asarray(done.declined_units, np.int64))
    closed_rows = np.fromiter(done.closed_to, np.int64, len(done.closed_to))
    done.merges += _exact_merges(st, in_cluster, closed_rows)
    _merge_stats(st, done)
    _write_merges(st, cfg, merger, version, done.merges, done.hashes)
    return st


def _supersede(
    req: MergeRequest,
    resp: MergeResponse,
    sup: list[str],
    allowed: dict[str, float],
    row_of: dict[str, int],
    valid_to: np.ndarray,
    merger: str,
    done: _Applied,
) -> set[int]:
    """Newer wins: close the validity interval of each superseded member ``sup`` at the
    time ``allowed`` gives it (the member stays live; ``valid_to``: the column before),
    with a ``supersede`` event unless it was closed there already (a fact that becomes
    true later). Returns the rows superseded."""
    ftime = {m.id: fact_time(m) for m in req.members}
    rows = set()
    for x in sup:
        r = row_of[x]
        old_vt = valid_to[r]
        new_vt = allowed[x] if np.isnan(old_vt) else min(old_vt, allowed[x])
        done.closed_to[r] = new_vt
        rows.add(r)
        if new_vt == old_vt:
            continue
        done.closed += 1
        done.events.append(
            {
                "op": "supersede",
                "id": x,
                "namespace": req.namespace,
                "valid_to": float(new_vt),
                "cluster_id": req.cluster_id,
                "by": sorted(
                    {
                        b if a == x else a
                        for a, b, _ in req.conflicts
                        if x in (a, b) and ftime[b if a == x else a] > ftime[x]
                    }
                ),
                "reasons": sorted({w for a, b, w in req.conflicts if x in (a, b)}),
                "merger": merger,
                "raw": resp.raw,
            }
        )
    return rows


def _merge_or_decline(
    cfg: PassConfig,
    req: MergeRequest,
    resp: MergeResponse,
    cluster: list[int],
    rest: list[int],
    bad: list[str],
    sup: list[str],
    lost: dict[str, list[str]],
    done: _Applied,
    longest: int,
) -> None:
    """The merge of the rows ``rest`` (the cluster's rows less the superseded ones, whose
    longest text has ``longest`` characters) with the merger's text, whose fidelity check
    found ``lost`` (:func:`checked_merge`); or, when the
    merger wrote no text, named a member it may not supersede (``bad``), left fewer than two
    rows or (with ``cfg.fidelity="refuse"``) lost a member's content: a ``merge_declined``
    event (none when something was superseded) and the cluster's exact groups fall back to
    exact merges."""
    text = resp.text.strip() if resp.text is not None else ""
    if not bad and text and len(rest) > 1 and not (lost and cfg.fidelity == "refuse"):
        ratio = len(text) / max(longest, 1)
        done.ratios.append(ratio)
        done.lost += len(lost)
        extra = {
            "similarities": [list(s) for s in req.similarities],
            "raw": resp.raw,
            "note": resp.note,
            "length_ratio": round(ratio, 4),
            **({"superseded": sup} if sup else {}),
            **({"lost_members": lost} if lost else {}),
        }
        # every row of the cluster merged: the merged record takes the request's id
        known = None if sup else req.cluster_id
        done.merges.append((np.array(rest, np.int64), text, "merge", extra, known))
        return
    note = (
        f"merger superseded {bad}, which no newer conflicting member contradicts"
        if bad
        else f"merged text loses the content of {len(lost)} member(s): "
        + "; ".join(f"{k}: {' / '.join(v)}" for k, v in sorted(lost.items()))
        if lost
        else resp.note
    )
    if lost:
        done.refused += 1
        done.lost_refused += len(lost)
    if not sup:
        done.events.append(
            {
                "op": "merge_declined",
                "cluster_id": req.cluster_id,
                "ids": [m.id for m in req.members],
                "note": note,
                "raw": resp.raw,
                **({"lost_members": lost} if lost else {}),
            }
        )
    done.declined_units += cluster  # its groups fall back to exact-only merges


def _longest_texts(texts: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """``int64 [len(groups)]``: the length (characters) of the longest of ``texts`` (``object
    [n]``) at each group's rows (0 for an empty group)."""
    if not groups:
        return np.zeros(0, np.int64)
    sizes = np.fromiter(map(len, groups), np.int64, len(groups))
    rows = texts[np.concatenate(groups)]
    lens = np.fromiter(map(len, map(str, rows)), np.int64, len(rows))  # as written (str)
    out = np.zeros(len(groups), np.int64)
    full = sizes > 0  # reduceat would give an empty group its next group's first length
    if full.any():
        out[full] = np.maximum.reduceat(lens, (np.cumsum(sizes) - sizes)[full])
    return out


def _exact_merges(st: PassState, in_cluster: np.ndarray, superseded: np.ndarray) -> list[_Merge]:
    """An ``exact_merge`` of each exact group of two or more rows (less the ``superseded``
    rows, ``int64``) that is not inside a merged cluster (its unit not among ``in_cluster``,
    ``int64`` unit numbers), with its canonical text. Selected on arrays: the groups' rows
    in one gather, the superseded rows and the groups left with one row dropped by mask."""
    u = st.units
    assert u is not None
    multi = np.flatnonzero(u.size > 1)
    multi = multi[~np.isin(multi, in_cluster)]
    sizes = u.size[multi]
    rows = u.rows[_ranges(u.start[multi], sizes)]
    seg = np.repeat(np.arange(len(multi)), sizes)
    if len(superseded):
        keep = ~np.isin(rows, superseded)
        rows, seg = rows[keep], seg[keep]
    left = np.bincount(seg, minlength=len(multi))
    two = left > 1
    rows = rows[two[seg]].astype(np.int64)
    exact = np.split(rows, np.cumsum(left[two])[:-1]) if len(rows) else []
    return [
        (g, text, "exact_merge", {}, None)
        for g, text in zip(exact, _canonical_texts(st, exact), strict=True)
    ]


def _merge_stats(st: PassState, done: _Applied) -> None:
    """The merge stage's counts and the merger's model accounting into ``st.stats``."""
    st.stats.superseded = done.closed
    st.stats.merges_losing_facts = done.refused
    st.stats.members_lost = done.lost
    st.stats.members_lost_refused = done.lost_refused
    if done.ratios:
        st.stats.merge_text_ratio_mean = float(np.mean(done.ratios))
        st.stats.merge_text_ratio_max = float(np.max(done.ratios))
    st.stats.model_calls = sum(done.calls)
    st.stats.prompt_tokens = sum(done.prompt_tokens)
    st.stats.completion_tokens = sum(done.completion_tokens)
    lat = _p50_p95(done.latencies)
    if lat:
        st.stats.merge_latency_p50_s, st.stats.merge_latency_p95_s = lat


def _write_merges(
    st: PassState,
    cfg: PassConfig,
    merger: Merger,
    version: int,
    merges: list[_Merge],
    hashes: dict[str, str],
) -> None:
    """New merged records (ordered by their lowest member id), tombstones, events.
    ``hashes``: ``text_hash`` of merged texts known already (:func:`_answer_clusters`); an
    exact merge's is its rows' (they share one, and its text is one of theirs)."""
    ids = st.meta["id"].to_numpy(object)
    rank = st.id_rank
    if merges:  # each merge's rows in id order (sorted only if some are not already)
        sizes = np.fromiter((len(m[0]) for m in merges), np.int64, len(merges))
        flat = np.concatenate([m[0] for m in merges]).astype(np.int64)
        step = np.diff(rank[flat])
        step[np.cumsum(sizes)[:-1] - 1] = 1  # a group's first row may rank below the last's
        if len(step) and step.min() <= 0:
            parts = in_id_order(rank, flat, sizes)
            merges = [(g, *m[1:]) for g, m in zip(parts, merges, strict=True)]
    merges.sort(key=lambda m: rank[m[0][0]])
    groups = [m[0] for m in merges]
    sizes = np.fromiter(map(len, groups), np.int64, len(groups))
    every = ids[np.concatenate(groups)].tolist() if groups else []
    cuts = np.r_[0, np.cumsum(sizes)].tolist()
    member_ids = [every[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    proposed = [m[4] or merged_id(version, g) for m, g in zip(merges, member_ids, strict=True)]
    mids = claim_ids(st, proposed, member_ids, version)
    stored = st.meta["text_hash"].to_numpy(object)
    meta, vec = new_records(
        st,
        groups,
        [m[1] for m in merges],
        mids,
        kind="merge",
        version=version,
        strength_cap=cfg.strength_cap,
        hashes=[
            (stored[m[0][0]] or None) if m[2] == "exact_merge" else hashes.get(m[1]) for m in merges
        ],
    )
    if groups:
        flat = np.concatenate(groups)
        into = np.repeat(np.array(mids, dtype=object), [len(g) for g in groups])
        deleted_at = st.col("deleted_at").copy()
        deleted_at[flat] = st.wall_h
        reason = st.meta["deleted_reason"].to_numpy(object).copy()
        reason[flat] = "merged"
        merged_into = st.meta["merged_into"].to_numpy(object).copy()
        merged_into[flat] = into
        st.meta["deleted_at"] = deleted_at
        st.meta["deleted_reason"] = pd.Series(reason, dtype=object)
        st.meta["merged_into"] = pd.Series(merged_into, dtype=object)
    st.append(meta, vec)
    ns = meta["namespace"].tolist()
    for (_, text, op, extra, _), mid, n, got in zip(merges, mids, ns, member_ids, strict=True):
        st.events.append(
            {
                "op": op,
                "id": mid,
                "namespace": n,
                "members": got,
                "text": text,
                "merger": merger.name if op == "merge" else None,
                **extra,
            }
        )
    _follow_merges(st)
    st.stats.merges = sum(1 for m in merges if m[2] == "merge")
    st.stats.exact_merges = sum(1 for m in merges if m[2] == "exact_merge")
    st.stats.merged_members = int(sum(len(m[0]) for m in merges))


def _follow_merges(st: PassState) -> None:
    """Reflections that name a merged row (this pass or earlier) name its merged record
    instead, so no link points to a tombstone that a later purge removes. Only rows with a
    ``derived_from`` are visited."""
    derived = st.meta["derived_from"].to_numpy(object)
    refl = np.flatnonzero(st.nonempty("derived_from") & ~st.gone)
    if not len(refl):
        return
    merged = (
        (st.meta["deleted_reason"].to_numpy(object) == "merged")
        & st.meta["merged_into"].notna().to_numpy()
        & ~st.gone
    )
    moved = pd.Series(
        st.meta["merged_into"].to_numpy(object)[merged],
        index=st.meta["id"].to_numpy(object)[merged],
    )
    if not len(moved):
        return
    out = derived.copy()
    for r in refl.tolist():
        d = derived[r]
        got = moved.reindex(list(d))
        out[r] = sorted({m if isinstance(m, str) else x for x, m in zip(d, got, strict=True)})
    st.meta["derived_from"] = pd.Series(out, dtype=object)
    st.forget("derived_from")

"""The pass's typed state: row columns, one vector tensor on the pass device, stats.

A :class:`PassState` is what flows from stage to stage (:mod:`consolidate.pipeline`). Rows
keep their snapshot positions for the whole pass: purged rows are only masked, and rows the
pass writes (merges, reflections) are appended to the table while their vectors are kept
apart, so the snapshot's vectors are never copied on the way (one copy at the end builds
the output).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ..similarity import Pairs
from ..store.schema import COLUMNS, Records
from ..text import utf8_ok
from ..workers import FirstTouch

__all__ = [
    "PassResult",
    "PassStats",
    "PassState",
    "Units",
    "merged_id",
    "claim_ids",
    "list_lengths",
    "id_ranks",
    "key_order",
    "group_sums",
    "segment_centroids",
    "arrow_strings",
]


def merged_id(version: int, member_ids: Sequence[str], salt: int = 0) -> str:
    """Deterministic id of a merged record: ``m-`` + 24 hex chars of
    sha256(version, sorted member ids), with ``#salt`` mixed in when ``salt`` > 0 (the next
    choice when the first is taken, see :func:`claim_ids`)."""
    h = hashlib.sha256(f"{version}\n".encode() + "\n".join(sorted(member_ids)).encode())
    if salt:
        h.update(f"\n#{salt}".encode())
    return "m-" + h.hexdigest()[:24]


def claim_ids(
    st: PassState,
    proposed: list[str],
    members: Sequence[Sequence[str]],
    version: int,
    prefix: str = "m-",
) -> list[str]:
    """The ids new merged (or reflection) rows take: each ``proposed`` id unless a row of
    ``st`` holds it already (a record written with that id by another tool, or an id
    appended before the reserved form was refused), then the next salted
    :func:`merged_id` that no row and no other proposal holds. Each id taken already is
    reported as a ``merged_id_taken`` event ``{"id", "given", "members"}``.

    Args:
        st: the pass state (its ids and their ranks).
        proposed: ``list[str] [k]`` the first-choice ids.
        members: ``[k]`` each new row's member ids (the hash input of a new choice).
        version: the version the pass writes.
        prefix: ``"m-"`` (merges) or ``"rf-"`` (reflections).

    Returns:
        ``list[str] [k]``: unique ids that no row of ``st`` holds.
    """
    if not proposed:
        return proposed
    taken = st.taken(np.asarray(proposed, dtype=object))
    if not taken.any():
        return proposed
    out, used = list(proposed), set(proposed)
    for k in np.flatnonzero(taken).tolist():  # only the ids taken already: rare
        salt = 1
        while True:
            new = prefix + merged_id(version, members[k], salt)[2:]
            if new not in used and not st.taken(np.asarray([new], dtype=object))[0]:
                break
            salt += 1
        used.add(new)
        st.events.append(
            {"op": "merged_id_taken", "id": out[k], "given": new, "members": list(members[k])}
        )
        out[k] = new
    return out


def list_lengths(col: pd.Series | np.ndarray) -> np.ndarray:
    """``int64 [n]``: the length of each list in an object column of lists (one C-level pass,
    no Python bytecode per row)."""
    return np.fromiter(map(len, col), np.int64, len(col))


def group_sums(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``float64 [g]``: the sum of each run of ``sizes[k]`` consecutive ``values``, added in
    the order ``np.sum`` adds them (left to right below 8 terms, pairwise above), so a merged
    record's strength is the same number as ``values[group].sum()``."""
    sizes = np.asarray(sizes, np.int64)
    gid = np.repeat(np.arange(len(sizes)), sizes)
    out = np.bincount(gid, weights=values, minlength=len(sizes)).astype(np.float64)
    starts = np.r_[0, np.cumsum(sizes)[:-1]].astype(np.int64)
    for k in np.flatnonzero(sizes >= 8).tolist():
        out[k] = values[starts[k] : starts[k] + sizes[k]].sum()
    return out


def key_order(*keys: np.ndarray) -> np.ndarray:
    """``int64 [n]``: the stable order of rows by ``keys`` (most significant first), equal to
    ``np.lexsort(keys[::-1])``. Non-negative integer keys whose ranges multiply below
    2**62 are combined into one ``int64`` and sorted once (one sort against ``len(keys)``
    stable passes: 0.10 s against 0.31 s for three keys over 10^6 rows); other keys go to
    ``np.lexsort``.

    Args:
        keys: ``[n]`` integer arrays of one length (at least one).
    """
    arrs = [np.asarray(k) for k in keys]
    if arrs and all(a.dtype.kind in "iu" for a in arrs) and len(arrs[0]):
        los, his = [int(a.min()) for a in arrs], [int(a.max()) for a in arrs]
        span = 1
        for h in his:
            span *= h + 1
        if min(los) >= 0 and span < 1 << 62:
            combined = np.zeros(len(arrs[0]), np.int64)
            for a, h in zip(arrs, his, strict=True):
                combined *= h + 1
                combined += a
            return np.argsort(combined, kind="stable")
    return np.lexsort(arrs[::-1])


def arrow_strings(values: Sequence[Any] | np.ndarray) -> pa.LargeStringArray | None:
    """``values`` copied into one Arrow ``large_string`` array (the characters of all of them
    in one buffer; ``None`` values become nulls), or ``None`` where Arrow cannot hold one of
    them (a lone surrogate, a value that is not a string).

    Its ``to_pylist()`` gives new string objects next to each other in memory: what a
    forked worker should read instead of the parent's own strings (reading a string writes
    its reference count, which copies the whole page that holds it into the worker)."""
    try:
        return pa.array(values, pa.large_string())
    except (UnicodeError, pa.ArrowException):
        return None


def id_ranks(ids: np.ndarray | pd.Series) -> np.ndarray:
    """``int64 [n]``: rank of each id in ascending code-point order (UTF-8 byte order equals
    code-point order), computed by Arrow's sort. Ids are unique, so ranks are too."""
    if not len(ids):
        return np.zeros(0, np.int64)
    try:
        arr = pa.array(np.asarray(ids, dtype=object), pa.string())
    except (UnicodeEncodeError, pa.ArrowException) as e:
        bad = [repr(x) for x in ids if not isinstance(x, str) or not utf8_ok(x)][:5]
        raise ValueError(
            f"record ids must be strings of valid UTF-8; these are not: {', '.join(bad)}"
        ) from e
    if len(arr) > 1 and pc.all(pc.less(arr.slice(0, len(arr) - 1), arr.slice(1))).as_py():
        return np.arange(len(arr), dtype=np.int64)  # already in id order (no sort)
    order = _byte_key_order(arr)
    if order is None:
        return (
            pc.rank(arr, sort_keys="ascending", tiebreaker="first").to_numpy().astype(np.int64) - 1
        )
    rank = np.empty(len(arr), np.int64)
    rank[order] = np.arange(len(arr), dtype=np.int64)
    return rank


def _byte_key_order(arr: pa.StringArray) -> np.ndarray | None:
    """The ascending order (``int64 [n]`` positions) of the strings ``arr`` (no nulls) by
    their UTF-8 bytes, from an integer sort: each string's 8 bytes after the prefix all
    share (zero-padded) form a big-endian ``uint64`` key; strings whose keys tie are then
    ordered by their whole text (Arrow's sort, on those alone). ``None`` when more than an
    eighth of the strings tie (Arrow's sort of all is then as fast). A zero pad sorts a
    string before the longer strings it starts, as byte order does; a string holding a NUL
    ties with the padding and goes to the whole-text sort."""
    n = len(arr)
    if arr.null_count or n < 2:
        return None
    lo, hi = pc.min_max(arr).values()
    a, b = lo.as_py().encode("utf-8"), hi.as_py().encode("utf-8")
    p = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    _, offs_buf, data_buf = arr.buffers()
    offs = np.frombuffer(offs_buf, np.int32, n + 1, arr.offset * 4).astype(np.int64)
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    data = np.concatenate([data[offs[0] : offs[-1]], np.zeros(8, np.uint8)])
    start, lens = offs[:-1] - offs[0] + p, np.diff(offs) - p
    window = np.lib.stride_tricks.sliding_window_view(data, 8)[start]  # uint8 [n, 8]
    window[np.arange(8) >= lens[:, None]] = 0  # the zero pad past each string's end
    key = window.view(">u8").ravel().astype(np.uint64)
    order = np.argsort(key)
    ks = key[order]
    tie = ks[1:] == ks[:-1]
    if not tie.any():
        return order
    slots = np.flatnonzero(np.r_[tie, False] | np.r_[False, tie])
    if len(slots) > n // 8:
        return None
    sub = np.sort(order[slots])  # equal strings keep their order (a stable sort below)
    tab = pa.table({"k": key[sub], "s": arr.take(pa.array(sub))})
    order[slots] = sub[pc.sort_indices(tab, [("k", "ascending"), ("s", "ascending")]).to_numpy()]
    return order


def _merge_ranks(
    rank: np.ndarray, ids: np.ndarray, n_old: int, old_sorted: np.ndarray | None = None
) -> np.ndarray:
    """Ranks of all ``ids`` given the ranks ``rank`` of the first ``n_old`` (unique ids): the
    new ids are placed by binary search among the old ones, so only the new rows are
    sorted. ``old_sorted``: the first ``n_old`` ids in ascending order, if known."""
    if old_sorted is None:
        old_sorted = np.empty(n_old, dtype=object)
        old_sorted[rank] = ids[:n_old]
    new = ids[n_old:]
    order = np.argsort(id_ranks(new))
    pos = np.searchsorted(old_sorted, new[order])  # old ids below each new id (sorted)
    out = np.empty(len(ids), np.int64)
    out[:n_old] = rank + np.searchsorted(pos, rank, side="right")
    out[n_old + order] = pos + np.arange(len(new))
    return out


def segment_centroids(
    vec: torch.Tensor,
    rows: np.ndarray,
    seg: np.ndarray,
    n_seg: int,
    weight: np.ndarray,
    chunk: int | None = None,
) -> torch.Tensor:
    """Strength-weighted mean of unit vectors per segment, renormalised, computed in float64 on
    ``vec``'s device.

    Args:
        vec: ``float32 [n, d]`` row vectors (cpu or cuda).
        rows: ``int64 [m]`` row positions, grouped by segment (each segment contiguous, rows
            in the order their float64 sum is taken).
        seg: ``int64 [m]`` segment of each entry of ``rows`` (non-decreasing, 0..n_seg-1,
            every segment non-empty).
        n_seg: number of segments.
        weight: ``float64 [m]`` positive weights (strength); scaled by each segment's maximum
            first so that large strengths cannot overflow.
        chunk: rows per float64 block (bounds the float64 temporaries to ``chunk x d``);
            default 2**16 on cuda, 4096 on cpu, where a block's float64 copy then stays in
            cache (30,000 segments of 2-5 rows: 243 ms against 735 ms with 2**16). Whole
            segments go in one block, so the result does not depend on it.

    Returns:
        ``float32 [n_seg, d]`` unit vectors on ``vec``'s device.
    """
    dev, d = vec.device, vec.shape[1]
    if chunk is None:
        chunk = 1 << 16 if dev.type == "cuda" else 4096
    out = torch.empty((n_seg, d), dtype=torch.float32, device=dev)
    if not n_seg:
        return out
    rows, seg = np.asarray(rows, np.int64), np.asarray(seg, np.int64)
    w = np.asarray(weight, np.float64)
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    w = w / np.repeat(np.maximum.reduceat(w, starts), np.diff(np.r_[starts, len(seg)]))
    # whole segments per block of about `chunk` entries
    cut = np.unique(
        np.r_[
            starts[np.searchsorted(starts, np.arange(0, len(seg), chunk), side="right") - 1],
            len(seg),
        ]
    )
    # one set of block buffers for every block: a fresh block each time maps its pages in
    # again (73,000 page faults for 145,000 rows in 50,000 segments, 40% of the time)
    lens = np.diff(cut)
    most = int(lens.max())
    most_seg = int((seg[cut[1:] - 1] - seg[cut[:-1]]).max()) + 1
    x32 = torch.empty((most, d), dtype=vec.dtype, device=dev)
    x64 = torch.empty((most, d), dtype=torch.float64, device=dev)
    acc64 = torch.empty((most_seg, d), dtype=torch.float64, device=dev)
    norm = torch.empty((most_seg, 1), dtype=torch.float64, device=dev)
    for a, b in zip(cut[:-1].tolist(), cut[1:].tolist(), strict=True):
        x = x64[: b - a]
        torch.index_select(vec, 0, torch.from_numpy(rows[a:b]).to(dev), out=x32[: b - a])
        x.copy_(x32[: b - a])
        x *= torch.from_numpy(w[a:b]).to(dev)[:, None]
        s_lo, s_hi = int(seg[a]), int(seg[b - 1]) + 1
        acc = acc64[: s_hi - s_lo].zero_()
        acc.index_add_(0, torch.from_numpy(seg[a:b] - s_lo).to(dev), x)
        nrm = norm[: s_hi - s_lo]
        torch.linalg.vector_norm(acc, dim=1, keepdim=True, out=nrm)
        acc /= nrm.clamp_min_(1e-300)
        out[s_lo:s_hi] = acc
    return out


@dataclass
class PassStats:
    """Counts, timings and model accounting of one pass (``summary.json``'s ``stats``).

    Reading ``stats["merges"]`` works like a mapping; :meth:`as_dict` drops the fields a pass
    did not produce (``None``: reflection and latency fields when those stages did not run).

    Attributes:
        merger: name of the merger. version: the snapshot version the pass writes.
        records_in, tombstones_in: live rows and tombstones read. purged: tombstones removed.
        closed_kept_apart: live rows whose validity ended (history, never merged).
        exact_groups, exact_duplicates: exact-duplicate groups and their extra rows.
        pairs: near-duplicate pairs at or above the threshold. device, engine: where the
            similarity ran.
        minhash_units, minhash_pairs, minhash_added: units with long texts, their MinHash
            candidates, and the pairs those added to the similarity join's (``None`` when
            ``sleep.minhash_min_chars`` is off); minhash_skipped_buckets: LSH band buckets
            too large to search (templated texts), left out.
        clusters: clusters found. review_pairs: conflicting pairs kept apart or flagged.
        superseded: older facts whose ``valid_to`` this pass closed.
        model_calls, prompt_tokens, completion_tokens: merge-stage model accounting.
        merges, exact_merges, merged_members: merged records written and their members.
        merge_text_ratio_mean, merge_text_ratio_max: length of a merge's text over its
            longest member's, mean and max over the merges (``None`` without merges).
        merges_losing_facts: merges the fidelity checker refused because their text lost a
            member's content (:func:`~consolidate.ops.fidelity.lost_members`).
        members_lost: members whose content a committed merge lost (0 unless
            ``sleep.fidelity=report``). members_lost_refused: members the refused merges
            would have lost.
        dropped_floor, dropped_cap: rows dropped by the floor and the cap.
        records_out: live rows written. score_min: lowest retention score kept.
        time_s: seconds per stage (``purge``, ``exact``, ``similarity``, ``minhash``,
            ``cluster``,
            ``merge``, ``reflect``, ``score``; the job adds ``load`` and ``commit``).
    """

    merger: str = ""
    version: int = 0
    records_in: int = 0
    tombstones_in: int = 0
    purged: int = 0
    closed_kept_apart: int = 0
    exact_groups: int = 0
    exact_duplicates: int = 0
    pairs: int = 0
    device: str = "cpu"
    engine: str = "auto"
    minhash_units: int | None = None
    minhash_pairs: int | None = None
    minhash_added: int | None = None
    minhash_skipped_buckets: int | None = None
    clusters: int = 0
    review_pairs: int = 0
    superseded: int = 0
    model_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    merge_latency_p50_s: float | None = None
    merge_latency_p95_s: float | None = None
    reflect_groups: int | None = None
    reflections: int | None = None
    reflect_calls: int | None = None
    reflect_prompt_tokens: int | None = None
    reflect_completion_tokens: int | None = None
    reflect_latency_p50_s: float | None = None
    reflect_latency_p95_s: float | None = None
    merges: int = 0
    exact_merges: int = 0
    merged_members: int = 0
    merge_text_ratio_mean: float | None = None
    merge_text_ratio_max: float | None = None
    merges_losing_facts: int = 0
    members_lost: int = 0
    members_lost_refused: int = 0
    dropped_floor: int = 0
    dropped_cap: int = 0
    records_out: int = 0
    score_min: float | None = None
    time_s: dict[str, float] = field(default_factory=dict)

    _ALWAYS = ("score_min",)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields that were set (``score_min`` always present)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) is not None or f.name in self._ALWAYS
        }

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in _STAT_FIELDS and (getattr(self, key) is not None or key in self._ALWAYS)

    def get(self, key: str, default: Any = None) -> Any:
        return self.as_dict().get(key, default)

    def items(self):  # noqa: ANN201 - dict view
        return self.as_dict().items()


_STAT_FIELDS = frozenset(f.name for f in fields(PassStats))


@dataclass
class PassResult:
    """Output of :func:`~consolidate.pipeline.run_pass`.

    Attributes:
        records: the full next record set (live and tombstones).
        events: changelog events (JSON-serialisable dicts), in order.
        stats: :class:`PassStats`.
    """

    records: Records
    events: list[dict[str, Any]] = field(default_factory=list)
    stats: PassStats = field(default_factory=PassStats)


@dataclass
class Units:
    """Merge candidates after the exact stage: each unit is one record or one group of exact
    duplicates, stored as CSR over row positions.

    Units are ordered by (namespace code, lowest member id), so each namespace is a contiguous
    run (the similarity engine then needs no reordering copy).

    Attributes:
        rows: ``int64 [m]`` row positions, grouped by unit; each unit's rows in id order.
        start: ``int64 [U + 1]`` offsets of each unit in ``rows``.
        ns: ``int64 [U]`` namespace code of each unit.
        vec: ``float32 [U, d]`` on the pass device: a one-record unit's stored vector, a
            group's strength-weighted centroid.
        weight: ``float64 [U]`` summed strength of each unit.
    """

    rows: np.ndarray
    start: np.ndarray
    ns: np.ndarray
    vec: torch.Tensor
    weight: np.ndarray

    def __len__(self) -> int:
        return len(self.start) - 1

    @property
    def first(self) -> np.ndarray:
        """``int64 [U]``: each unit's row with the lowest id."""
        return self.rows[self.start[:-1]]

    @property
    def size(self) -> np.ndarray:
        """``int64 [U]``: rows per unit."""
        return np.diff(self.start)

    def members(self, u: int) -> np.ndarray:
        """Row positions of unit ``u`` (id order)."""
        return self.rows[self.start[u] : self.start[u + 1]]


@dataclass
class PassState:
    """What flows through the stages.

    Attributes:
        meta: the row table (the store's columns, no vectors): the snapshot's rows at their
            positions, then the rows the pass wrote (:meth:`append`); stages update its
            columns in a copy made when the pass starts.
        vec: ``float32 [n0, d]`` the snapshot's vectors on the pass device (moved once);
            rows ``n0..`` (written by the pass) have theirs in ``new_vec``.
        ns: ``int64 [n]`` namespace code per row (codes sorted like the names).
        ns_names: namespace name per code.
        id_rank: ``int64 [n]`` rank of each row's id.
        wall_h: wall clock, hours since the epoch.
        now: ``float64 [n]`` the pass's "now" per row, hours since the epoch.
        gone: ``bool [n]`` rows purged (removed when the output is assembled).
        new_vec: vectors of the rows the pass wrote, in row order.
        units: exact-stage output (``None`` before it ran).
        pairs: similarity-stage output: pairs of units (``None``: the join did not run).
        clusters: cluster-stage output: unit positions per cluster.
        review: cluster-stage output: conflicting unit pairs ``(a, b, sim, reason)``.
        events: changelog events, in order.
        stats: :class:`PassStats`.
        origin: ``int64 [n0]`` the input records' :attr:`~consolidate.store.Records.origin`
            (``None`` when they had none), handed on to the output.
        spare: ``float32 [cap, d]`` on the cpu, or ``None``: the buffer whose first rows
            hold the units' vectors (:func:`~consolidate.pipeline.exact.exact_stage`); once
            the units are dropped, :meth:`records` writes the output vectors into it when
            they fit, instead of into fresh memory (the pages are already mapped: on a VM a
            first touch of fresh memory costs seconds per GB).
        first_touch: the :class:`~consolidate.workers.FirstTouch` mapping in the spare
            buffer's first rows from the purge stage on (joined by the exact stage before
            it writes them if the thread writes zeros; else left to run, and joined at the
            end of the pass), or ``None``.
        workers: processes the text rules may use (:func:`~consolidate.workers.fork_map`).
    """

    meta: pd.DataFrame
    vec: torch.Tensor
    ns: np.ndarray
    ns_names: np.ndarray
    id_rank: np.ndarray
    wall_h: float
    now: np.ndarray
    gone: np.ndarray
    new_vec: list[torch.Tensor] = field(default_factory=list)
    units: Units | None = None
    pairs: Pairs | None = None
    clusters: list[list[int]] = field(default_factory=list)
    review: list[tuple[int, int, float, str]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    stats: PassStats = field(default_factory=PassStats)
    origin: np.ndarray | None = None
    spare: torch.Tensor | None = field(default=None, repr=False, compare=False)
    first_touch: FirstTouch | None = field(default=None, repr=False, compare=False)
    workers: int = 1
    #: :meth:`sorted_ids`' cache (``None``: not built, or rows appended since)
    _sorted_ids: np.ndarray | None = field(default=None, repr=False, compare=False)
    #: :meth:`nonempty`'s cache: per list column, its first rows' answers
    _nonempty: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @property
    def n(self) -> int:
        """Rows in the table (snapshot rows plus rows written so far)."""
        return len(self.meta)

    def vector_buffers(self) -> list[np.ndarray]:
        """The pass's large vector arrays in host memory (the snapshot's, the units', the
        spare buffer), as views: what forked text workers never read
        (:func:`~consolidate.workers.fork_map`'s ``not_shared``)."""
        units = self.units.vec if self.units is not None else None
        return [
            t.detach().numpy()
            for t in (self.vec, units, self.spare)
            if t is not None and t.device.type == "cpu"
        ]

    def col(self, name: str) -> np.ndarray:
        """Column ``name`` as a numpy array (no copy for numeric columns)."""
        s = self.meta[name]
        return s.to_numpy(np.float64) if COLUMNS[name] == "float64" else s.to_numpy()

    def nonempty(self, name: str) -> np.ndarray:
        """``bool [n]``: the rows whose list in column ``name`` (``keep_apart``,
        ``derived_from``, ``source_ids``) is not empty. Read once per pass (a pass over 10^6
        rows takes 0.1 s to read a column's list lengths), then only for the rows written
        since; a stage that rewrites lists of the column calls :meth:`forget`."""
        got = self._nonempty.get(name)
        if got is None or len(got) > self.n:
            got = list_lengths(self.meta[name].to_numpy(object)) > 0
        elif len(got) < self.n:
            more = self.meta[name].to_numpy(object)[len(got) :]
            got = np.concatenate([got, list_lengths(more) > 0])
        self._nonempty[name] = got
        return got

    def forget(self, name: str) -> None:
        """Drop :meth:`nonempty`'s answers for column ``name`` (its lists were rewritten)."""
        self._nonempty.pop(name, None)

    def live(self) -> np.ndarray:
        """``bool [n]``: rows that are not tombstones."""
        return np.isnan(self.col("deleted_at"))

    def vectors(self, rows: np.ndarray) -> torch.Tensor:
        """``float32 [len(rows), d]`` vectors of rows ``rows`` (snapshot or written), on the
        pass device."""
        rows = np.asarray(rows, np.int64)
        dev, n0 = self.vec.device, self.vec.shape[0]
        old = rows < n0
        if old.all():
            return self.vec.index_select(0, torch.from_numpy(rows).to(dev))
        out = torch.empty((len(rows), self.vec.shape[1]), dtype=torch.float32, device=dev)
        m = torch.from_numpy(old).to(dev)
        out[m] = self.vec.index_select(0, torch.from_numpy(rows[old]).to(dev))
        out[~m] = torch.cat(self.new_vec).index_select(0, torch.from_numpy(rows[~old] - n0).to(dev))
        return out

    def sorted_ids(self) -> np.ndarray:
        """``object [n]``: every id of the table in ascending order (from ``id_rank``;
        cached until the next :meth:`append`)."""
        cache = self._sorted_ids
        if cache is None or len(cache) != len(self.id_rank):
            cache = np.empty(len(self.id_rank), dtype=object)
            cache[self.id_rank] = self.meta["id"].to_numpy(object)
            self._sorted_ids = cache
        return cache

    def taken(self, ids: np.ndarray) -> np.ndarray:
        """``bool [k]``: which of ``ids`` (``object [k]`` strings) a row of the table holds
        (binary search in :meth:`sorted_ids`, ``O(k log n)``)."""
        srt = self.sorted_ids()
        if not len(srt) or not len(ids):
            return np.zeros(len(ids), bool)
        pos = np.minimum(np.searchsorted(srt, ids), len(srt) - 1)
        return srt[pos] == ids

    def append(self, meta: pd.DataFrame, vec: torch.Tensor) -> None:
        """Add rows written by the pass (store columns, ``float32 [k, d]`` vectors on the
        pass device) at the end of the table; their namespaces must already be known."""
        if not len(meta):
            return
        old_sorted = self.sorted_ids()  # of the rows before these
        self.meta = pd.concat([self.meta, meta], ignore_index=True)
        self.new_vec.append(vec)
        self.ns = np.r_[self.ns, np.searchsorted(self.ns_names, meta["namespace"].to_numpy(object))]
        self.gone = np.r_[self.gone, np.zeros(len(meta), bool)]
        self.id_rank = _merge_ranks(
            self.id_rank,
            self.meta["id"].to_numpy(object),
            len(self.meta) - len(meta),
            old_sorted,
        )
        self._sorted_ids = None

    def records(self) -> Records:
        """The next snapshot: surviving rows in their order (snapshot rows, then the rows the
        pass wrote), with one copy of the vectors."""
        keep = np.flatnonzero(~self.gone)
        meta = (self.meta.iloc[keep] if len(keep) < self.n else self.meta).reset_index(drop=True)
        base, n0 = self.vec, self.vec.shape[0]
        kb = keep[keep < n0]
        origin = (
            None
            if self.origin is None
            else np.concatenate([self.origin[kb], np.full(len(keep) - len(kb), -1, np.int64)])
        )
        if base.device.type == "cpu" and len(kb) == n0 and not self.new_vec:
            return Records(meta, base.numpy(), origin=origin)  # nothing purged or written
        spare = self.spare
        if self.units is None and spare is not None and spare.shape[0] >= len(meta):
            out = spare.numpy()[: len(meta)]  # the units' rows, no longer needed
            self.spare = None
        else:
            out = np.empty((len(meta), base.shape[1]), np.float32)
        if base.device.type == "cpu" and len(kb) == n0:
            # nothing purged: one contiguous copy (torch's copy uses the intra-op threads)
            torch.from_numpy(out[:n0]).copy_(base)
        elif base.device.type == "cpu":
            torch.index_select(base, 0, torch.from_numpy(kb), out=torch.from_numpy(out[: len(kb)]))
        else:
            out[: len(kb)] = (
                base.index_select(0, torch.from_numpy(kb).to(base.device)).cpu().numpy()
            )
        if self.new_vec:
            # piece by piece: no concatenated copy of the written rows' vectors
            kn = keep[keep >= n0] - n0  # sorted positions among the written rows
            at, lo = len(kb), 0
            for piece in self.new_vec:
                hi = lo + piece.shape[0]
                a, b = np.searchsorted(kn, [lo, hi])
                if b > a:
                    v = piece.cpu().numpy()
                    out[at : at + b - a] = v if b - a == len(v) else v[kn[a:b] - lo]
                at, lo = at + b - a, hi
        return Records(meta, out, origin=origin)


def nan_reduce(values: np.ndarray, starts: np.ndarray, how: str) -> np.ndarray:
    """Per-segment ``nanmin``/``nanmax`` (NaN where a segment is all NaN); segments start at
    ``starts`` (``np.ufunc.reduceat`` semantics)."""
    fill = math.inf if how == "min" else -math.inf
    f = np.minimum if how == "min" else np.maximum
    r = f.reduceat(np.where(np.isnan(values), fill, values), starts)
    return np.where(np.isinf(r) & (r == fill), np.nan, r)

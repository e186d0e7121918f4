"""The offline "sleep" pass: a pure function from one snapshot to the next.

``run_pass(records, ...) -> PassResult(records, events, stats)`` reads nothing and writes
nothing: the job (:mod:`consolidate.jobs.consolidate`) loads the snapshot, calls it and commits
the result. It works on one or many namespaces and keeps no global state, so namespaces can be
sharded across processes or machines.

Stages, in order (each timed in ``stats["time_s"]``):

1. ``purge``: tombstones older than ``tombstone_retention_hours`` are removed for good.
2. ``exact``: live, unpinned, still-valid records with the same normalised-text hash in one
   namespace form a group (no model call). A record whose ``valid_to`` has passed is history
   and takes part in no merge.
3. ``similarity``: tiled cosine join (:func:`consolidate.similarity.threshold_pairs`) over the
   groups' strength-weighted centroids, within each namespace.
4. ``cluster``: centroid-checked, complete-link clustering with the conflict guard
   (:func:`consolidate.cluster.centroid_clusters`).
5. ``merge``: one :class:`~consolidate.merge.MergeRequest` per cluster, all in one
   :meth:`~consolidate.merge.Merger.merge_batch` call; exact-only groups need no call.
   A merged record gets the strength-weighted centroid (renormalised), importance = max,
   last_used = max, created_at = min, strength = sum (capped), source_ids = union, validity =
   the union interval; its members become tombstones with ``merged_into`` set. With a
   conflict-handling merger (``handles_conflicts``), clusters with flagged pairs are sent too:
   the newer fact wins, the older one's ``valid_to`` is closed (a ``supersede`` event) and it
   stays live as history; undone merges still keep their members apart.
6. ``reflect`` (``pass.reflect``): groups of related memories get one new memory each from
   the reflector, linked by ``derived_from``; the members are unchanged.
7. ``score``: retention score, floor, cap per namespace (pinned rows are never dropped);
   dropped rows become tombstones (``deleted_reason`` = ``floor`` or ``cap``).

Pinned records take part in nothing but scoring (and are never dropped): they are never merged
or rewritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from .cluster import centroid_clusters
from .config import PassConfig, SimilarityConfig
from .merge import (
    ExtractiveMerger,
    MergeMember,
    Merger,
    MergeRequest,
    canonical_order,
    fact_time,
    newer_fact_times,
)
from .scoring import retention_score, select_survivors
from .similarity import threshold_pairs
from .store.batch import resolve_device
from .store.schema import Records, hours_from_datetime
from .text import conflict_between, conflict_signature, text_hash

__all__ = ["PassResult", "MassDropError", "run_pass", "resolve_now", "trigger", "undo_merge",
           "merged_id"]


class MassDropError(RuntimeError):
    """The pass would drop more than ``pass.max_drop_fraction`` of the live memories."""


@dataclass
class PassResult:
    """Output of :func:`run_pass`.

    Attributes:
        records: the full next record set (live + tombstones).
        events: changelog events (JSON-serialisable dicts).
        stats: counts per stage, timings (seconds), model accounting.
    """

    records: Records
    events: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


def merged_id(version: int, member_ids: Sequence[str]) -> str:
    """Deterministic id of a merged record: ``m-`` + 24 hex chars of
    sha256(version, sorted member ids)."""
    h = hashlib.sha256(f"{version}\n".encode() + "\n".join(sorted(member_ids)).encode())
    return "m-" + h.hexdigest()[:24]


def resolve_now(spec: str | float, meta: pd.DataFrame, wall_h: float) -> np.ndarray:
    """Per-row "now" in hours since the epoch.

    Args:
        spec: ``"wall"`` (the wall clock ``wall_h``), ``"latest"`` (per namespace, the latest
            ``last_used``/``created_at`` among its live records: a simulated clock for
            historical stores such as LOCOMO), an ISO datetime string, or hours since the
            epoch (a float or a numeric string).
        meta: the records' table.
        wall_h: wall clock, hours since the epoch.

    Returns:
        ``float64 [n]``.

    Raises:
        ValueError: an unparseable ``spec``.
    """
    n = len(meta)
    if isinstance(spec, str):
        with contextlib.suppress(ValueError):
            spec = float(spec)
    if isinstance(spec, (int, float)):
        return np.full(n, float(spec))
    if spec == "wall":
        return np.full(n, wall_h)
    if spec == "latest":
        live = meta["deleted_at"].isna()
        t = np.fmax(meta["last_used"].to_numpy(np.float64), meta["created_at"].to_numpy(np.float64))
        s = pd.Series(np.where(live, t, np.nan)).groupby(meta["namespace"].to_numpy()).transform(
            "max"
        )
        return np.where(np.isnan(s.to_numpy()), wall_h, s.to_numpy())
    try:
        return np.full(n, hours_from_datetime(spec))
    except (ValueError, TypeError) as e:
        raise ValueError(f"pass.now must be 'wall', 'latest', hours or an ISO datetime; "
                         f"got {spec!r}") from e


def trigger(records: Records, threshold: float) -> tuple[bool, float]:
    """Should the nightly pass run? Sums the importance of live records that no pass has
    processed yet (``last_pass`` is null).

    Returns:
        ``(fire, new_importance)`` with ``fire = new_importance >= threshold``.
    """
    m = records.meta
    new = records.live_mask() & m["last_pass"].isna().to_numpy()
    total = float(m["importance"].to_numpy(np.float64)[new].sum())
    return total >= threshold, total


def _union_sources(lists: Sequence[Sequence[str]]) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for lst in lists:
        for s in lst:
            if s not in seen:
                seen.add(s)
                out.append(s)
    return sorted(out)


def run_pass(
    records: Records,
    *,
    cfg: PassConfig,
    sim_cfg: SimilarityConfig | None = None,
    merger: Merger | None = None,
    version: int = 1,
    wall_h: float | None = None,
    now_by_namespace: dict[str, float] | None = None,
    reflector: Any | None = None,
) -> PassResult:
    """Consolidate ``records`` (one snapshot, any number of namespaces).

    Args:
        records: all records of the snapshot (tombstones pass through untouched).
        cfg: pass settings (threshold, tau in hours, floor, cap, strength cap, now, stages).
        sim_cfg: similarity engine settings (device, dtype, tiles); default cpu/auto fp32.
        merger: the :class:`~consolidate.merge.Merger` (default: extractive).
        version: version of the snapshot this pass will write (stamped as ``last_pass`` and
            mixed into merged ids).
        wall_h: wall clock in hours since the epoch, used for tombstone times and as ``now``
            when ``cfg.now == "wall"`` (default: the current time).
        now_by_namespace: per-namespace "now" in hours since the epoch, overriding
            ``cfg.now`` for the namespaces it names (e.g. the date of a LOCOMO
            conversation's last session, when its questions are asked).
        reflector: writes reflections when ``cfg.reflect`` (an object with
            ``reflect_batch(list[MergeRequest]) -> list[MergeResponse]``, e.g.
            :class:`~consolidate.llm.reflect.LLMReflector`).

    Returns:
        :class:`PassResult`.

    Raises:
        ValueError: bad settings (threshold outside [-1, 1], tau <= 0, cap < 0), a merger
            or reflector that returned the wrong number of responses, or ``cfg.reflect``
            without a reflector.
        MassDropError: more than ``cfg.max_drop_fraction`` of the live memories would be
            dropped (nothing is returned, so nothing can be committed).
    """
    sim_cfg = sim_cfg or SimilarityConfig()
    merger = merger or ExtractiveMerger()
    wall_h = time.time() / 3600 if wall_h is None else float(wall_h)
    _check_settings(cfg)
    times: dict[str, float] = {}
    stats: dict[str, Any] = {"merger": merger.name, "version": version}
    events: list[dict[str, Any]] = []
    dim = records.dim

    # ---------------------------------------------------------------- purge
    t = time.perf_counter()
    meta = records.meta.copy()
    vec = records.vectors
    deleted = meta["deleted_at"].to_numpy(np.float64)
    stats["records_in"] = int(np.isnan(deleted).sum())
    stats["tombstones_in"] = int((~np.isnan(deleted)).sum())
    purge = np.zeros(len(meta), bool)
    if cfg.tombstone_retention_hours is not None:
        purge = ~np.isnan(deleted) & (wall_h - deleted > cfg.tombstone_retention_hours)
    if purge.any():
        events.append({"op": "purge", "ids": meta["id"][purge].tolist()})
        meta = meta[~purge].reset_index(drop=True)
        vec = vec[~purge]
    stats["purged"] = int(purge.sum())
    times["purge"] = time.perf_counter() - t

    def now_rows(m: pd.DataFrame) -> np.ndarray:
        now = resolve_now(cfg.now, m, wall_h)
        if now_by_namespace:
            over = m["namespace"].map(now_by_namespace).to_numpy(np.float64)
            now = np.where(np.isnan(over), now, over)
        return now

    ids = meta["id"].to_numpy(object)
    live = meta["deleted_at"].isna().to_numpy()
    pinned = meta["pinned"].to_numpy(bool)
    strength = meta["strength"].to_numpy(np.float64)
    open_facts, closed = _open_facts(meta, now_rows(meta))
    cand = np.flatnonzero(open_facts & ~pinned)
    stats["closed_kept_apart"] = int((live & closed).sum())

    # ---------------------------------------------------------------- exact duplicates
    t = time.perf_counter()
    if cfg.exact_dedup and len(cand):
        key = meta["namespace"].iloc[cand].astype(str) + "\x00" + meta["text_hash"].iloc[cand]
        grp = pd.Series(cand).groupby(key.to_numpy(), sort=True)
        keep_apart0 = meta["keep_apart"].tolist()
        units = [sub for _, g in grp
                 for sub in _split_apart(sorted(g.tolist(), key=lambda r: ids[r]), ids,
                                         keep_apart0)]
    else:
        units = [[int(r)] for r in cand]
    units.sort(key=lambda u: ids[u[0]])
    stats["exact_groups"] = sum(len(u) > 1 for u in units)
    stats["exact_duplicates"] = sum(len(u) - 1 for u in units if len(u) > 1)
    times["exact"] = time.perf_counter() - t

    # unit arrays
    u_vec = np.zeros((len(units), dim), np.float32)
    u_w = np.zeros(len(units))
    for k, u in enumerate(units):
        u_vec[k] = _centroid(vec[u], strength[u])
        u_w[k] = strength[u].sum()
    u_key = [ids[u[0]] for u in units]
    u_text = [meta["text"].iat[u[0]] for u in units]
    u_sig = [conflict_signature(t) for t in u_text] if cfg.near_dedup else []
    keep_apart = meta["keep_apart"].tolist()
    u_member_ids = [{ids[r] for r in u} for u in units]
    u_apart = [{x for r in u for x in keep_apart[r]} for u in units]
    named = {x for a in u_apart for x in a}
    # units alike in conflicts share a class: same signature and no undo constraint
    u_class = [(u_sig[k], k if (u_apart[k] or u_member_ids[k] & named) else -1)
               for k in range(len(units))] if cfg.near_dedup else None
    u_ns = meta["namespace"].to_numpy(object)[[u[0] for u in units]] if units else np.array([])
    ns_codes = pd.factorize(pd.Series(u_ns, dtype=object), sort=True)[0]

    # ---------------------------------------------------------------- similarity
    t = time.perf_counter()
    if cfg.near_dedup and len(units) > 1:
        pairs = threshold_pairs(
            torch.from_numpy(u_vec), cfg.threshold, segments=torch.from_numpy(ns_codes),
            device=sim_cfg.device, dtype=sim_cfg.dtype, tile_rows=sim_cfg.tile_rows,
            tile_cols=sim_cfg.tile_cols, engine=sim_cfg.engine,
            budget_bytes=None if sim_cfg.budget_mb is None else int(sim_cfg.budget_mb * 2**20),
        )
    else:
        pairs = None
    stats["pairs"] = 0 if pairs is None else len(pairs)
    stats["device"] = str(resolve_device(sim_cfg.device))
    stats["engine"] = sim_cfg.engine
    times["similarity"] = time.perf_counter() - t

    # ---------------------------------------------------------------- clustering
    t = time.perf_counter()
    if pairs is not None and len(pairs):
        cr = centroid_clusters(
            pairs.i, pairs.j, pairs.sim, u_vec, u_w, u_key, cfg.threshold,
            conflict=lambda a, b: conflict_between(u_sig[a], u_sig[b]) or (
                "undone merge" if (u_apart[a] & u_member_ids[b]) or (u_apart[b] & u_member_ids[a])
                else None),
            allow_conflicts=bool(getattr(merger, "handles_conflicts", False)),
            conflict_class=u_class,
            blocking=lambda reason: reason == "undone merge",
        )
        clusters, review = cr.clusters, cr.review
    else:
        clusters, review = [], []
    # similarity of a pair (a < b), looked up in the (i, j)-sorted pair arrays: no dict of
    # every pair (millions in a dense namespace)
    pair_key = (pairs.i * len(units) + pairs.j) if pairs is not None else np.zeros(0, np.int64)

    def pair_sim(a: int, b: int) -> float | None:
        key = min(a, b) * len(units) + max(a, b)
        k = int(np.searchsorted(pair_key, key))
        return float(pairs.sim[k]) if k < len(pair_key) and pair_key[k] == key else None
    for a, b, s, reason in review[: cfg.max_review_events]:
        events.append({
            "op": "review", "reason": reason,
            "similarity": None if math.isnan(s) else round(s, 6),
            "ids": [u_key[a], u_key[b]], "texts": [u_text[a], u_text[b]],
            "namespace": u_ns[a],
        })
    stats["clusters"] = len(clusters)
    stats["review_pairs"] = len(review)
    if len(review) > cfg.max_review_events:
        events.append({"op": "review_truncated", "listed": cfg.max_review_events,
                       "total": len(review)})
    times["cluster"] = time.perf_counter() - t

    # ---------------------------------------------------------------- merge
    t = time.perf_counter()
    in_cluster = {k for c in clusters for k in c}
    cluster_of = {k: x for x, c in enumerate(clusters) for k in c}
    # conflicting pairs inside each cluster (only a conflict-handling merger gets any), as
    # record-id pairs: every row of one unit against every row of the other
    confl_of: dict[int, list[tuple[str, str, str]]] = {}
    for a, b, _, r in review:
        x = cluster_of.get(a)
        if x is not None and cluster_of.get(b) == x:
            confl_of.setdefault(x, []).extend(
                (str(ids[ra]), str(ids[rb]), r) for ra in units[a] for rb in units[b])
    requests: list[MergeRequest] = []
    req_units: list[list[int]] = []
    for x, c in enumerate(clusters):
        rows = sorted((r for k in c for r in units[k]), key=lambda r: ids[r])
        # pairwise similarities for small clusters; the changelog of a big cluster would
        # grow quadratically, so it gets each member's cosine to the merged centroid instead
        if len(c) <= 16:
            sims = tuple(
                (u_key[a], u_key[b], round(sv, 6))
                for x, a in enumerate(c) for b in c[x + 1 :]
                if (sv := pair_sim(a, b)) is not None
            )
        else:
            cen = (u_w[c, None] * u_vec[c].astype(np.float64)).sum(0)
            cen /= np.linalg.norm(cen)
            sims = tuple((u_key[a], "centroid", round(float(u_vec[a] @ cen), 6)) for a in c)
        confl = tuple(confl_of.get(x, ()))
        requests.append(MergeRequest(
            cluster_id=merged_id(version, [ids[r] for r in rows]),
            namespace=str(u_ns[c[0]]),
            members=tuple(_member(meta, r) for r in rows),
            similarities=sims, conflicts=confl,
        ))
        req_units.append(c)
    responses = merger.merge_batch(requests) if requests else []
    if len(responses) != len(requests):
        raise ValueError(f"merger {merger.name!r} returned {len(responses)} responses for "
                         f"{len(requests)} requests")
    merges: list[tuple[list[int], str, str, dict[str, Any]]] = []  # rows, text, op, extra
    row_of = {str(ids[r]): r for c in req_units for k in c for r in units[k]}
    valid_to_new = meta["valid_to"].to_numpy(np.float64).copy()
    superseded_rows: set[int] = set()
    n_closed = 0  # rows whose valid_to this pass closed (or moved earlier)
    for req, resp, c in zip(requests, responses, req_units, strict=True):
        allowed = newer_fact_times(req) if resp.superseded else {}
        bad = sorted(set(resp.superseded) - set(allowed))
        sup = [] if bad else sorted(set(resp.superseded))
        ftime = {m.id: fact_time(m) for m in req.members}
        for x in sup:  # newer wins: close the older fact's validity interval, keep it
            r = row_of[x]
            old_vt = valid_to_new[r]
            valid_to_new[r] = allowed[x] if np.isnan(old_vt) else min(old_vt, allowed[x])
            superseded_rows.add(r)
            if valid_to_new[r] == old_vt:
                continue  # already closed there (a fact that becomes true later): no event
            n_closed += 1
            events.append({"op": "supersede", "id": x, "namespace": req.namespace,
                           "valid_to": float(valid_to_new[r]), "cluster_id": req.cluster_id,
                           "by": sorted({b if a == x else a for a, b, _ in req.conflicts
                                         if x in (a, b)
                                         and ftime[b if a == x else a] > ftime[x]}),
                           "reasons": sorted({w for a, b, w in req.conflicts
                                              if x in (a, b)}),
                           "merger": merger.name, "raw": resp.raw})
        rest = [r for k in c for r in units[k] if r not in superseded_rows]
        if not bad and resp.text is not None and resp.text.strip() and len(rest) > 1:
            merges.append((rest, resp.text.strip(), "merge",
                           {"similarities": [list(s) for s in req.similarities],
                            "raw": resp.raw, "note": resp.note,
                            **({"superseded": sup} if sup else {})}))
        else:
            note = (f"merger superseded {bad}, which no newer conflicting member contradicts"
                    if bad else resp.note)
            if not sup:
                events.append({"op": "merge_declined", "cluster_id": req.cluster_id,
                               "ids": [m.id for m in req.members], "note": note,
                               "raw": resp.raw})
            in_cluster -= set(c)  # fall back to exact-only merges of its groups
    for k, u in enumerate(units):
        u = [r for r in u if r not in superseded_rows]
        if len(u) > 1 and k not in in_cluster:
            text = canonical_order([_member(meta, r) for r in u])[0].text
            merges.append((u, text, "exact_merge", {}))
    stats["superseded"] = n_closed
    meta["valid_to"] = valid_to_new
    stats["model_calls"] = sum(r.calls for r in responses)
    stats["prompt_tokens"] = sum(r.prompt_tokens for r in responses)
    stats["completion_tokens"] = sum(r.completion_tokens for r in responses)
    lat = [r.extra["latency_s"] for r in responses if "latency_s" in r.extra]
    if lat:
        stats["merge_latency_p50_s"] = float(np.percentile(lat, 50))
        stats["merge_latency_p95_s"] = float(np.percentile(lat, 95))

    new_rows: list[dict[str, Any]] = []
    new_vecs: list[np.ndarray] = []
    del_at = meta["deleted_at"].to_numpy(np.float64).copy()
    del_reason = meta["deleted_reason"].to_numpy(object).copy()
    merged_into = meta["merged_into"].to_numpy(object).copy()
    for rows, text, op, extra in sorted(merges, key=lambda m: min(ids[r] for r in m[0])):
        rows = sorted(rows, key=lambda r: ids[r])
        mid = merged_id(version, [ids[r] for r in rows])
        w = strength[rows]
        v = _centroid(vec[rows], w)
        vf = meta["valid_from"].to_numpy(np.float64)[rows]
        vt = meta["valid_to"].to_numpy(np.float64)[rows]
        new_rows.append({
            "id": mid,
            "namespace": meta["namespace"].iat[rows[0]],
            "text": text,
            "importance": float(meta["importance"].to_numpy(np.float64)[rows].max()),
            "created_at": float(meta["created_at"].to_numpy(np.float64)[rows].min()),
            "last_used": float(meta["last_used"].to_numpy(np.float64)[rows].max()),
            "strength": float(min(w.sum(), max(cfg.strength_cap, w.max()))),
            "pinned": False,
            "source_ids": _union_sources([meta["source_ids"].iat[r] for r in rows]),
            "valid_from": float(np.nanmin(vf)) if not np.isnan(vf).all() else math.nan,
            "valid_to": math.nan if np.isnan(vt).any() else float(vt.max()),
            "deleted_at": math.nan,
            "deleted_reason": None,
            "merged_into": None,
            "text_hash": text_hash(text),
            "last_pass": float(version),
            "keep_apart": sorted({x for r in rows for x in meta["keep_apart"].iat[r]}),
            "derived_from": sorted({x for r in rows for x in meta["derived_from"].iat[r]}),
        })
        new_vecs.append(v)
        del_at[rows] = wall_h
        del_reason[rows] = "merged"
        merged_into[rows] = mid
        events.append({"op": op, "id": mid, "namespace": new_rows[-1]["namespace"],
                       "members": [ids[r] for r in rows], "text": text,
                       "merger": merger.name if op == "merge" else None, **extra})
    meta["deleted_at"] = del_at
    meta["deleted_reason"] = del_reason
    meta["merged_into"] = merged_into
    # reflections follow their members into the records they were merged into (no link to a
    # tombstone that a later purge removes)
    moved = {str(ids[r]): m for r, m in enumerate(merged_into[: len(ids)])
             if del_reason[r] == "merged" and isinstance(m, str)}
    if moved:
        meta["derived_from"] = [sorted({moved.get(x, x) for x in d}) if d else d
                                for d in meta["derived_from"]]
    stats["merges"] = sum(1 for m in merges if m[2] == "merge")
    stats["exact_merges"] = sum(1 for m in merges if m[2] == "exact_merge")
    stats["merged_members"] = sum(len(m[0]) for m in merges)
    if new_rows:
        add = pd.DataFrame(new_rows, columns=meta.columns)
        meta = pd.concat([meta, add], ignore_index=True)
        vec = np.concatenate([vec, np.stack(new_vecs)])
    times["merge"] = time.perf_counter() - t

    # ---------------------------------------------------------------- reflect
    t = time.perf_counter()
    if cfg.reflect:
        if reflector is None:
            raise ValueError("pass.reflect=true needs a reflector (config group `reflect`)")
        meta, vec = _reflect(meta, vec, cfg, sim_cfg, reflector, version, now_rows(meta),
                             events, stats)
    times["reflect"] = time.perf_counter() - t

    # ---------------------------------------------------------------- decay, floor, cap
    t = time.perf_counter()
    live = meta["deleted_at"].isna().to_numpy()
    li = np.flatnonzero(live)
    lm = meta.iloc[li]
    now = now_rows(meta)[li]
    if cfg.decay:
        score = retention_score(
            torch.tensor(lm["importance"].to_numpy(np.float64)),
            torch.tensor(lm["last_used"].to_numpy(np.float64)),
            torch.tensor(lm["strength"].to_numpy(np.float64)),
            torch.tensor(now), cfg.tau_hours,
        ).numpy()
        floor = cfg.floor
    else:
        score = lm["importance"].to_numpy(np.float64)
        floor = -math.inf
    sel = select_survivors(score, lm["pinned"].to_numpy(bool), lm["namespace"].to_numpy(object),
                           lm["id"].to_numpy(object), floor, cfg.cap)
    drop = li[~sel.keep]
    if len(li) and len(drop) / len(li) > cfg.max_drop_fraction:
        worst = {str(k): int(v) for k, v in pd.Series(
            meta["namespace"].to_numpy(object)[drop]).value_counts().head(3).items()}
        raise MassDropError(
            f"the pass would drop {len(drop)} of {len(li)} live memories "
            f"({len(drop) / len(li):.0%} > pass.max_drop_fraction={cfg.max_drop_fraction}); "
            f"most in {worst}. Check pass.now (now={cfg.now!r}), tau_hours "
            f"({cfg.tau_hours}) and floor ({cfg.floor}), or set pass.max_drop_fraction=1.0"
        )
    meta.loc[drop, "deleted_at"] = wall_h
    meta.loc[drop, "deleted_reason"] = sel.reason[~sel.keep]
    for r, sc, why in zip(drop, score[~sel.keep], sel.reason[~sel.keep], strict=True):
        events.append({"op": "drop", "id": meta["id"].iat[r], "reason": why,
                       "score": float(sc), "namespace": meta["namespace"].iat[r]})
    stats["dropped_floor"] = int((sel.reason == "floor").sum())
    stats["dropped_cap"] = int((sel.reason == "cap").sum())
    kept = li[sel.keep]
    meta.loc[kept, "last_pass"] = float(version)
    stats["records_out"] = int(len(kept))
    stats["score_min"] = float(score[sel.keep].min()) if sel.keep.any() else None
    times["score"] = time.perf_counter() - t

    stats["time_s"] = {k: round(v, 4) for k, v in times.items()}
    return PassResult(Records(meta.reset_index(drop=True), vec.astype(np.float32)), events,
                      stats)


def _centroid(v: np.ndarray, strength: np.ndarray) -> np.ndarray:
    """Strength-weighted mean of unit vectors ``v`` (``[m, d]``), renormalised: ``float32
    [d]``. Weights are scaled by their max first, so large strengths cannot overflow."""
    s = ((strength / strength.max())[:, None] * v.astype(np.float64)).sum(0)
    return (s / max(np.linalg.norm(s), 1e-300)).astype(np.float32)


def _is_reflection(meta: pd.DataFrame) -> np.ndarray:
    """``bool [n]``: rows written by the reflect stage (they have ``derived_from``)."""
    return np.array([len(x) > 0 for x in meta["derived_from"]], bool)


def _open_facts(meta: pd.DataFrame, now: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(open, closed)`` as ``bool [n]``: ``closed`` = the validity interval ended at or
    before ``now`` (hours, per row): history. ``open`` = live, not closed, not a reflection:
    the memories that may be merged or reflected on. Reflections stay out because their
    vector is their members' centroid, closer to each member than those are to each other."""
    vt = meta["valid_to"].to_numpy(np.float64)
    closed = np.isfinite(vt) & (vt <= now)
    return meta["deleted_at"].isna().to_numpy() & ~closed & ~_is_reflection(meta), closed


def _reflect(meta: pd.DataFrame, vec: np.ndarray, cfg: PassConfig, sim_cfg: SimilarityConfig,
             reflector: Any, version: int, now: np.ndarray, events: list[dict[str, Any]],
             stats: dict[str, Any]) -> tuple[pd.DataFrame, np.ndarray]:
    """The reflect stage (see :class:`~consolidate.config.PassConfig`): group live, open,
    non-reflection memories; skip groups an existing live reflection already covers; ask the
    reflector once for all groups; append one record per accepted answer."""
    open_facts, _ = _open_facts(meta, now)
    cand = np.flatnonzero(open_facts)
    is_refl = _is_reflection(meta)
    # a group counts as reflected while any reflection of it is still in the store (live, or
    # dropped by floor/cap: reflecting it again every night would only be dropped again)
    reason = meta["deleted_reason"].tolist()
    covered = [set(x) for x, r, ok in zip(meta["derived_from"], reason, is_refl, strict=True)
               if ok and (not isinstance(r, str) or r in ("floor", "cap"))]
    stats.update(reflect_groups=0, reflections=0, reflect_calls=0)
    if len(cand) < max(2, cfg.reflect_min_size):
        return meta, vec
    ns = pd.factorize(meta["namespace"].to_numpy(object)[cand], sort=True)[0]
    pairs = threshold_pairs(torch.from_numpy(vec[cand]), cfg.reflect_threshold,
                            segments=torch.from_numpy(ns), device=sim_cfg.device,
                            dtype=sim_cfg.dtype, tile_rows=sim_cfg.tile_rows,
                            tile_cols=sim_cfg.tile_cols, engine=sim_cfg.engine)
    if not len(pairs):
        return meta, vec
    ids = meta["id"].to_numpy(object)
    w = meta["strength"].to_numpy(np.float64)[cand]
    cr = centroid_clusters(pairs.i, pairs.j, pairs.sim, vec[cand], w,
                           [str(x) for x in ids[cand]], cfg.reflect_threshold)
    groups = [[int(cand[k]) for k in c] for c in cr.clusters
              if len(c) >= cfg.reflect_min_size]
    groups = [g for g in groups if not any({ids[r] for r in g} <= c for c in covered)]
    groups.sort(key=lambda g: (-len(g), ids[min(g, key=lambda r: ids[r])]))
    per_ns: dict[str, int] = {}
    chosen = []
    for g in groups:
        n = str(meta["namespace"].iat[g[0]])
        if per_ns.get(n, 0) < cfg.reflect_max_per_namespace:
            per_ns[n] = per_ns.get(n, 0) + 1
            chosen.append(sorted(g, key=lambda r: ids[r]))
    if not chosen:
        return meta, vec
    reqs = [MergeRequest(cluster_id="rf-" + merged_id(version, [ids[r] for r in g])[2:],
                         namespace=str(meta["namespace"].iat[g[0]]),
                         members=tuple(_member(meta, r) for r in g)) for g in chosen]
    resps = reflector.reflect_batch(reqs)
    if len(resps) != len(reqs):
        raise ValueError(f"reflector returned {len(resps)} responses for {len(reqs)} groups")
    rows, vecs = [], []
    strength = meta["strength"].to_numpy(np.float64)
    for g, req, resp in zip(chosen, reqs, resps, strict=True):
        if not (resp.text and resp.text.strip()):
            events.append({"op": "reflect_declined", "ids": [m.id for m in req.members],
                           "note": resp.note, "raw": resp.raw, "namespace": req.namespace})
            continue
        text = resp.text.strip()
        rows.append({
            "id": req.cluster_id, "namespace": req.namespace, "text": text,
            "importance": float(meta["importance"].to_numpy(np.float64)[g].max()),
            "created_at": float(meta["created_at"].to_numpy(np.float64)[g].max()),
            "last_used": float(meta["last_used"].to_numpy(np.float64)[g].max()),
            "strength": 1.0, "pinned": False,
            "source_ids": _union_sources([meta["source_ids"].iat[r] for r in g]),
            "valid_from": math.nan, "valid_to": math.nan, "deleted_at": math.nan,
            "deleted_reason": None, "merged_into": None, "text_hash": text_hash(text),
            "last_pass": float(version), "keep_apart": [],
            "derived_from": [m.id for m in req.members],
        })
        vecs.append(_centroid(vec[g], strength[g]))
        events.append({"op": "reflect", "id": req.cluster_id, "namespace": req.namespace,
                       "derived_from": [m.id for m in req.members], "text": text,
                       "reflector": getattr(reflector, "name", "?"), "raw": resp.raw,
                       "note": resp.note})
    stats.update(reflect_groups=len(reqs), reflections=len(rows),
                 reflect_calls=sum(r.calls for r in resps),
                 reflect_prompt_tokens=sum(r.prompt_tokens for r in resps),
                 reflect_completion_tokens=sum(r.completion_tokens for r in resps))
    lat = [r.extra["latency_s"] for r in resps if "latency_s" in r.extra]
    if lat:
        stats["reflect_latency_p50_s"] = float(np.percentile(lat, 50))
        stats["reflect_latency_p95_s"] = float(np.percentile(lat, 95))
    if rows:
        meta = pd.concat([meta, pd.DataFrame(rows, columns=meta.columns)], ignore_index=True)
        vec = np.concatenate([vec, np.stack(vecs)])
    return meta, vec


def _split_apart(rows: list[int], ids: np.ndarray, keep_apart: list[list[str]]
                 ) -> list[list[int]]:
    """Split an exact-duplicate group so that no subgroup holds two records that an undo
    marked ``keep_apart`` (first fit, in id order: deterministic)."""
    if not any(keep_apart[r] for r in rows):
        return [rows]
    groups: list[list[int]] = []
    for r in rows:
        for g in groups:
            if not any(ids[x] in keep_apart[r] or ids[r] in keep_apart[x] for x in g):
                g.append(r)
                break
        else:
            groups.append([r])
    return groups


def _check_settings(cfg: PassConfig) -> None:
    """Refuse settings that would silently do the wrong thing (NaN compares false)."""
    def real(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not (real(cfg.threshold) and -1.0 <= cfg.threshold <= 1.0):
        raise ValueError(f"pass.threshold must be in [-1, 1], got {cfg.threshold!r}")
    if not (real(cfg.tau_hours) and cfg.tau_hours > 0):
        raise ValueError(f"pass.tau_hours must be > 0 hours, got {cfg.tau_hours!r}")
    if not (real(cfg.floor) and 0.0 <= cfg.floor <= 1.0):
        raise ValueError(f"pass.floor must be in [0, 1], got {cfg.floor!r}")
    if cfg.cap is not None and not (isinstance(cfg.cap, int) and not isinstance(cfg.cap, bool)
                                    and cfg.cap >= 0):
        raise ValueError(f"pass.cap must be an integer >= 0 or null, got {cfg.cap!r}")
    if not (real(cfg.strength_cap) and cfg.strength_cap >= 1):
        raise ValueError(f"pass.strength_cap must be >= 1, got {cfg.strength_cap!r}")
    if not (real(cfg.max_drop_fraction) and 0.0 <= cfg.max_drop_fraction <= 1.0):
        raise ValueError(f"pass.max_drop_fraction must be in [0, 1], got "
                         f"{cfg.max_drop_fraction!r}")
    if not (real(cfg.reflect_threshold) and -1.0 <= cfg.reflect_threshold <= 1.0):
        raise ValueError(f"pass.reflect_threshold must be in [-1, 1], got "
                         f"{cfg.reflect_threshold!r}")
    for key in ("reflect_min_size", "reflect_max_per_namespace"):
        v = getattr(cfg, key)
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"pass.{key} must be an integer >= 1, got {v!r}")
    if isinstance(cfg.now, (int, float)) or cfg.now not in ("wall", "latest"):
        try:
            val = float(cfg.now)
        except (TypeError, ValueError):
            val = None
        if val is not None and not math.isfinite(val):
            raise ValueError(f"pass.now must be finite, got {cfg.now!r}")


def _member(meta: pd.DataFrame, r: int) -> MergeMember:
    return MergeMember(
        id=str(meta["id"].iat[r]),
        text=str(meta["text"].iat[r]),
        importance=float(meta["importance"].iat[r]),
        last_used=float(meta["last_used"].iat[r]),
        strength=float(meta["strength"].iat[r]),
        created_at=float(meta["created_at"].iat[r]),
        source_ids=tuple(meta["source_ids"].iat[r]),
        valid_from=float(meta["valid_from"].iat[r]),
    )


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
    return Records(meta, records.vectors)

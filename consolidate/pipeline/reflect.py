"""Stage 6 (``sleep.reflect``), reflection: groups of related live memories get one
higher-level memory each from the reflector, linked to its members by ``derived_from``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import PassConfig, SimilarityConfig
from ..ops.merge import MergeRequest
from .exact import open_facts
from .merging import latency_stats, members
from .near import compact_clusters, similar_pairs
from .rows import new_records
from .state import PassState, claim_ids, merged_id

__all__ = ["reflect_stage"]


def reflect_stage(
    st: PassState, cfg: PassConfig, sim_cfg: SimilarityConfig, reflector: Any, version: int
) -> PassState:
    """Group open, live, non-reflection memories (pairs at ``cfg.reflect_threshold``,
    centroid-checked clusters of at least ``cfg.reflect_min_size``), skip groups a
    reflection still in the store covers (live, or dropped by floor or cap: reflecting it
    again every night would only be dropped again), keep the largest
    ``cfg.reflect_max_per_namespace`` per namespace, ask ``reflector.reflect_batch`` once,
    and append one record per answer with a text (``reflect`` events; ``reflect_declined``
    for the others).

    Raises:
        ValueError: no reflector, or it returned the wrong number of responses.
    """
    if reflector is None:
        raise ValueError("sleep.reflect=true needs a reflector (config group `reflect`)")
    stats = st.stats
    stats.reflect_groups = stats.reflections = stats.reflect_calls = 0
    chosen = _reflect_groups(st, cfg, sim_cfg)
    if not chosen:
        return st
    ids = st.meta["id"].to_numpy(object)
    reqs = [
        MergeRequest(
            cluster_id="rf-" + merged_id(version, ids[g].tolist())[2:],
            namespace=str(st.ns_names[st.ns[g[0]]]),
            members=mem,
        )
        for g, mem in zip(chosen, members(st, chosen), strict=True)
    ]
    resps = reflector.reflect_batch(reqs)
    if len(resps) != len(reqs):
        raise ValueError(f"reflector returned {len(resps)} responses for {len(reqs)} groups")
    first_event = len(st.events)
    kept, texts = _reflect_answers(st, getattr(reflector, "name", "?"), chosen, reqs, resps)
    stats.reflect_groups, stats.reflections = len(reqs), len(kept)
    stats.reflect_calls = sum(r.calls for r in resps)
    stats.reflect_prompt_tokens = sum(r.prompt_tokens for r in resps)
    stats.reflect_completion_tokens = sum(r.completion_tokens for r in resps)
    lat = latency_stats(resps)
    if lat:
        stats.reflect_latency_p50_s, stats.reflect_latency_p95_s = lat
    rids = claim_ids(
        st,
        [r.cluster_id for _, r in kept],
        [[m.id for m in r.members] for _, r in kept],
        version,
        prefix="rf-",
    )
    moved = {r.cluster_id: i for (_, r), i in zip(kept, rids, strict=True) if r.cluster_id != i}
    for ev in st.events[first_event:]:  # the reflect events name the id the row takes
        if ev.get("op") == "reflect" and ev["id"] in moved:
            ev["id"] = moved[ev["id"]]
    meta, v = new_records(st, [g for g, _ in kept], texts, rids, kind="reflection", version=version)
    st.append(meta, v)
    return st


def _reflect_groups(st: PassState, cfg: PassConfig, sim_cfg: SimilarityConfig) -> list[np.ndarray]:
    """The groups to reflect on (rows in id order), largest first, at most
    ``cfg.reflect_max_per_namespace`` per namespace; groups a reflection still in the store
    covers are left out (see :func:`reflect_stage`)."""
    ok, _ = open_facts(st)
    cand = np.flatnonzero(ok)
    if len(cand) < max(2, cfg.reflect_min_size):
        return []
    ids = st.meta["id"].to_numpy(object)
    derived = st.meta["derived_from"].to_numpy(object)
    refl = np.flatnonzero(st.nonempty("derived_from") & ~st.gone)  # purged rows count for nothing
    reason = st.meta["deleted_reason"].to_numpy(object)[refl]
    covered = [
        set(derived[r])
        for r, why in zip(refl.tolist(), reason.tolist(), strict=True)
        if not isinstance(why, str) or why in ("floor", "cap")
    ]
    vec = st.vectors(cand)
    pairs = similar_pairs(vec, st.ns[cand], cfg.reflect_threshold, sim_cfg)
    if not len(pairs):
        return []
    items, cr = compact_clusters(
        pairs, vec, st.col("strength")[cand], ids[cand], cfg.reflect_threshold
    )
    groups = [cand[items[c]] for c in cr.clusters if len(c) >= cfg.reflect_min_size]
    groups = [g for g in groups if not any(set(ids[g].tolist()) <= c for c in covered)]
    rank = st.id_rank
    groups.sort(key=lambda g: (-len(g), rank[g].min()))
    per_ns: dict[int, int] = {}
    chosen = []
    for g in groups:
        n = int(st.ns[g[0]])
        if per_ns.get(n, 0) < cfg.reflect_max_per_namespace:
            per_ns[n] = per_ns.get(n, 0) + 1
            chosen.append(g[np.argsort(rank[g])])
    return chosen


def _reflect_answers(
    st: PassState,
    reflector: str,
    chosen: list[np.ndarray],
    reqs: list[MergeRequest],
    resps: list[Any],
) -> tuple[list[tuple[np.ndarray, MergeRequest]], list[str]]:
    """The reflector's answers as events: ``reflect`` for an answer with a text (returned
    with its group and request, and the text), ``reflect_declined`` for the others."""
    kept, texts = [], []
    for g, req, resp in zip(chosen, reqs, resps, strict=True):
        if not (resp.text and resp.text.strip()):
            st.events.append(
                {
                    "op": "reflect_declined",
                    "ids": [m.id for m in req.members],
                    "note": resp.note,
                    "raw": resp.raw,
                    "namespace": req.namespace,
                }
            )
            continue
        text = resp.text.strip()
        kept.append((g, req))
        texts.append(text)
        st.events.append(
            {
                "op": "reflect",
                "id": req.cluster_id,
                "namespace": req.namespace,
                "derived_from": [m.id for m in req.members],
                "text": text,
                "reflector": reflector,
                "raw": resp.raw,
                "note": resp.note,
            }
        )
    return kept, texts

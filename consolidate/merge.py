"""The ``Merger`` seam: one request per cluster, answered in batches.

The pass builds one :class:`MergeRequest` per cluster and calls
:meth:`Merger.merge_batch` once with all of them. A merger returns one :class:`MergeResponse`
per request; ``text=None`` means "leave these members unmerged". The pass itself computes the
merged vector, importance, strength, provenance and tombstones, so a merger only writes text.

Contradictions: a merger with ``handles_conflicts = True`` also receives clusters whose
members the conflict guard flagged (negation, number, date). It must not blend them: it names
the members a newer member contradicts in :attr:`MergeResponse.superseded` and writes its text
from the others. The pass then closes each superseded member's validity interval
(``valid_to`` = when the newer fact became true) and keeps it as history instead of
tombstoning it; see :func:`newer_fact_times` for which member counts as newer.

This module ships the no-model :class:`ExtractiveMerger`. Model-backed mergers (vLLM,
OpenAI-compatible servers, transformers) implement the same protocol and are chosen by config
(``merge._target_``); the pass does not change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .text import content_tokens, split_facts

__all__ = ["MergeMember", "MergeRequest", "MergeResponse", "Merger", "ExtractiveMerger",
           "fact_time", "newer_fact_times", "unordered_pair"]


@dataclass(frozen=True)
class MergeMember:
    """One record of a cluster (times in hours since the epoch; ``valid_from`` NaN when the
    fact has no stated start)."""

    id: str
    text: str
    importance: float
    last_used: float
    strength: float
    created_at: float
    source_ids: tuple[str, ...] = ()
    valid_from: float = math.nan


@dataclass(frozen=True)
class MergeRequest:
    """A cluster to merge.

    Attributes:
        cluster_id: id the merged record will get.
        namespace: the namespace of every member.
        members: the cluster's records (at least 2), in id order.
        similarities: ``(id_a, id_b, cosine)`` of the pairs that joined the cluster.
        conflicts: ``(id_a, id_b, reason)`` pairs the conflict guard flagged (only sent to
            mergers with ``handles_conflicts = True``).
    """

    cluster_id: str
    namespace: str
    members: tuple[MergeMember, ...]
    similarities: tuple[tuple[str, str, float], ...] = ()
    conflicts: tuple[tuple[str, str, str], ...] = ()


@dataclass
class MergeResponse:
    """Answer to one :class:`MergeRequest`.

    Attributes:
        text: merged text, or ``None`` to leave the members unmerged.
        raw: the raw model output (for the changelog), if any.
        calls: model calls spent on this request (0 for the extractive merger).
        prompt_tokens, completion_tokens: token accounting.
        note: free-form reason (e.g. why it declined).
        superseded: ids of members contradicted by a newer member (only from mergers with
            ``handles_conflicts``); ``text`` then merges the other members only. The pass
            accepts an id only if :func:`newer_fact_times` lists it.
    """

    text: str | None
    raw: str | None = None
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    note: str = ""
    extra: dict = field(default_factory=dict)
    superseded: tuple[str, ...] = ()


@runtime_checkable
class Merger(Protocol):
    """Batch merge interface. ``handles_conflicts``: may the pass send conflicting pairs?"""

    name: str
    handles_conflicts: bool

    def merge_batch(self, requests: Sequence[MergeRequest]) -> list[MergeResponse]:
        """Return one response per request, in order."""
        ...


def canonical_order(members: Sequence[MergeMember]) -> list[MergeMember]:
    """Members by importance desc, last_used desc, strength desc, id asc."""
    return sorted(members, key=lambda m: (-m.importance, -m.last_used, -m.strength, m.id))


def fact_time(m: MergeMember) -> float:
    """When a member's fact became true (hours since the epoch): ``valid_from`` if stated,
    else ``created_at``."""
    return m.valid_from if math.isfinite(m.valid_from) else m.created_at


def newer_fact_times(req: MergeRequest) -> dict[str, float]:
    """For each member that some conflicting partner supersedes: the earliest
    :func:`fact_time` among its strictly newer conflicting partners (the time its validity
    interval closes). Members in no conflict, or not older than any partner, are absent;
    equal or unknown (NaN) times supersede nothing (neither is newer)."""
    by_id = {m.id: m for m in req.members}
    out: dict[str, float] = {}
    for a, b, _ in req.conflicts:
        if a not in by_id or b not in by_id:
            continue
        ta, tb = fact_time(by_id[a]), fact_time(by_id[b])
        if not (math.isfinite(ta) and math.isfinite(tb)) or ta == tb:
            continue  # no known order: neither is newer
        old, new_t = (a, tb) if ta < tb else (b, ta)
        out[old] = min(out.get(old, math.inf), new_t)
    return out



def unordered_pair(req: MergeRequest, older: dict[str, float] | None = None) -> bool:
    """Has ``req`` a flagged pair where neither member is newer (equal or unknown times)?
    Such a pair can be neither closed nor blended. ``older``: :func:`newer_fact_times` of
    ``req`` if already computed."""
    older = newer_fact_times(req) if older is None else older
    return any(a not in older and b not in older for a, b, _ in req.conflicts)


class ExtractiveMerger:
    """No-model merger: keep the most important (then most recent) text and append the facts
    of the other members that it does not already state.

    A fact (sentence of another member) is appended only if some of its word tokens are not
    yet in the merged text; sentences are kept verbatim, never rewritten, so no number, date,
    name or negation is changed.

    By default it does not handle conflicts: the pass keeps conflicting pairs apart and lists
    them for review. With ``newer_wins=True`` it takes clusters with flagged pairs too and
    resolves each by time alone: the older member of a flagged pair is superseded (its
    validity interval closed by the pass), the rest are merged. That rule trusts the conflict
    guard, so it applies only to the reasons in ``supersede_on`` (number and date changes by
    default; negation flags are often false on real text, e.g. "keep pushing" / "do not give
    up"): a cluster with any other flagged pair, or with a flagged pair of equal times, is left
    unmerged for review. Two dated events ("went to Paris in 2019" / "in 2021") are still
    treated as one fact that changed; a model-backed merger can judge that instead.

    Args:
        separator: joins the base text and the appended facts.
        max_chars: stop appending facts past this length (``None`` = no limit).
        newer_wins: supersede the older member of each flagged pair (see above).
        supersede_on: conflict reasons the rule resolves (``number``, ``date``,
            ``negation``).
    """

    name = "extractive"
    handles_conflicts = False

    def __init__(self, separator: str = " ", max_chars: int | None = None,
                 newer_wins: bool = False,
                 supersede_on: Sequence[str] = ("number", "date")) -> None:
        self.separator = separator
        self.max_chars = max_chars
        self.supersede_on = tuple(supersede_on)
        self.handles_conflicts = bool(newer_wins)
        if newer_wins:
            self.name = "extractive:newer_wins"

    def merge_text(self, members: Sequence[MergeMember]) -> str:
        ordered = canonical_order(members)
        base = ordered[0].text.strip()
        parts = [base]
        seen = set(content_tokens(base))
        for m in ordered[1:]:
            for fact in split_facts(m.text):
                toks = set(content_tokens(fact))
                if not toks or toks <= seen:
                    continue
                if self.max_chars is not None and (
                    sum(len(p) + 1 for p in parts) + len(fact) > self.max_chars
                ):
                    return self.separator.join(parts)
                parts.append(fact if fact[-1] in ".!?" else fact + ".")
                seen |= toks
        if len(parts) > 1 and parts[0][-1] not in ".!?":
            parts[0] += "."
        return self.separator.join(parts)

    def merge_batch(self, requests: Sequence[MergeRequest]) -> list[MergeResponse]:
        out = []
        for r in requests:
            other = sorted({w for _, _, w in r.conflicts if w not in self.supersede_on})
            if other:  # flags the rule does not trust: never blend, never close
                out.append(MergeResponse(None, note=f"flagged {', '.join(other)}: left for "
                                         f"review"))
                continue
            old = newer_fact_times(r) if self.handles_conflicts else {}
            rest = [m for m in r.members if m.id not in old]
            if unordered_pair(r, old):
                # a flagged pair with equal or unknown times: no newer fact, never blend
                out.append(MergeResponse(None, note="flagged pair with equal times: left "
                                         "for review"))
                continue
            out.append(MergeResponse(self.merge_text(rest) if len(rest) > 1 else None,
                                     superseded=tuple(sorted(old)),
                                     note=f"newer wins over {len(old)}" if old else ""))
        return out

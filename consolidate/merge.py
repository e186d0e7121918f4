"""The ``Merger`` seam: one request per cluster, answered in batches.

The pass builds one :class:`MergeRequest` per cluster and calls
:meth:`Merger.merge_batch` once with all of them. A merger returns one :class:`MergeResponse`
per request; ``text=None`` means "leave these members unmerged". The pass itself computes the
merged vector, importance, strength, provenance and tombstones, so a merger only writes text.

This module ships the no-model :class:`ExtractiveMerger`. Model-backed mergers (vLLM,
OpenAI-compatible servers, transformers) implement the same protocol and are chosen by config
(``merge._target_``); the pass does not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .text import content_tokens, split_facts

__all__ = ["MergeMember", "MergeRequest", "MergeResponse", "Merger", "ExtractiveMerger"]


@dataclass(frozen=True)
class MergeMember:
    """One record of a cluster (times in hours since the epoch)."""

    id: str
    text: str
    importance: float
    last_used: float
    strength: float
    created_at: float
    source_ids: tuple[str, ...] = ()


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
    """

    text: str | None
    raw: str | None = None
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    note: str = ""
    extra: dict = field(default_factory=dict)


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


class ExtractiveMerger:
    """No-model merger: keep the most important (then most recent) text and append the facts
    of the other members that it does not already state.

    A fact (sentence of another member) is appended only if some of its word tokens are not
    yet in the merged text; sentences are kept verbatim, never rewritten, so no number, date,
    name or negation is changed. It does not handle conflicts: the pass keeps conflicting
    pairs apart and lists them for review.

    Args:
        separator: joins the base text and the appended facts.
        max_chars: stop appending facts past this length (``None`` = no limit).
    """

    name = "extractive"
    handles_conflicts = False

    def __init__(self, separator: str = " ", max_chars: int | None = None) -> None:
        self.separator = separator
        self.max_chars = max_chars

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
        return [MergeResponse(self.merge_text(r.members)) for r in requests]

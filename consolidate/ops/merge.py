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

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..lexicon import DATE_WORDS, NEGATIONS, NUMBER_WORDS, STOP_WORDS
from ..text import (
    _DIGIT,
    _date_terms,
    _numbers,
    content_tokens,
    split_sentences,
)

if TYPE_CHECKING:
    from .fidelity import Clause

__all__ = [
    "MergeMember",
    "MergeRequest",
    "MergeResponse",
    "Merger",
    "ExtractiveMerger",
    "fact_time",
    "newer_fact_times",
    "unordered_pair",
    "lost_facts",
    "Facts",
    "facts_of",
    "names_in",
]


@dataclass(frozen=True)
class MergeMember:
    """One record of a cluster (times in hours since the epoch; ``valid_from`` NaN when the
    fact has no stated start).

    ``sources``: for a record that an earlier pass merged, the texts of the original records
    it was made from (the leaves of its ``merged_into`` tree that are still stored as
    tombstones, in id order); empty otherwise. A merger that rewrites text merges these
    again rather than the merged text, so wording does not drift across nightly passes.
    """

    id: str
    text: str
    importance: float
    last_used: float
    strength: float
    created_at: float
    source_ids: tuple[str, ...] = ()
    valid_from: float = math.nan
    sources: tuple[str, ...] = ()

    @property
    def merge_texts(self) -> tuple[str, ...]:
        """The texts a merge of this member starts from: ``sources`` if any, else
        ``(text,)``."""
        return self.sources or (self.text,)


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
    """Batch merge interface. ``handles_conflicts``: may the pass send conflicting pairs?
    A merger with a true ``checks_facts`` attribute refuses, itself, every merge whose text
    loses a number, date term, name or negation of a member (:func:`lost_facts`); the merge
    stage checks the texts of mergers without it."""

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


_UWORD = re.compile(r"[^\W\d_]+(?:['\u2019][^\W\d_]+)*")


def _name_key(name: str) -> str:
    """A name as an item: lower case, without a possessive ("Maria's" -> "maria")."""
    k = _key(name)
    return k[:-2] if k.endswith("'s") else k


def _key(word: str) -> str:
    """How a written word is looked up among a text's lower-case words."""
    return word.casefold().replace("\u2019", "'")


def names_in(text: str) -> list[str]:
    """Capitalised words (any script; acronyms included, "O'Brien" whole) that do not start
    the text or a sentence (:func:`~consolidate.text.split_sentences`, so "Dr. Smith" keeps
    Smith a name): the names a merge must keep, as written."""
    out = []
    for sent in split_sentences(text.strip()):
        words = _UWORD.findall(sent)
        out += [w for w in words[1:] if w[0].isupper()]
    return out


@dataclass(frozen=True)
class Facts:
    """The facts a merge must keep from one text: what sentence embeddings do not tell
    apart (see :func:`~consolidate.ops.guard.conflict_reason`).

    Attributes:
        numbers: numbers as written in digits or as number words (``"2"``, ``"3.5"``).
        dates: month, weekday and relative-time words.
        names: capitalised words not at the start of the text or a sentence, as written.
        negated: the text has a negation marker.
        negated_scope: the content words among the four words after its first negation
            marker ("not vegan" -> vegan): what the negation denies.
        words: its lower-case word tokens, and those with an apostrophe also without what
            follows it ("gina's" -> "gina").
    """

    numbers: frozenset
    dates: frozenset
    names: frozenset
    negated: bool
    words: frozenset
    negated_scope: frozenset = frozenset()

    @property
    def items(self) -> frozenset:
        """``("number", x)``, ``("date", x)`` and ``("name", x)`` items."""
        return frozenset(
            {("number", x) for x in self.numbers}
            | {("date", x) for x in self.dates}
            | {("name", _name_key(x)) for x in self.names}
        )


@functools.lru_cache(maxsize=1 << 16)
def facts_of(text: str) -> Facts:
    """The :class:`Facts` of ``text`` (``str``); cached, as the sentences of a member that
    several clusters or passes share repeat (and :func:`lost_facts` reads its members'
    again)."""
    return facts_from_tokens(text, content_tokens(text))


@functools.lru_cache(maxsize=1 << 16)
def _fold(w: str) -> str:
    return w.casefold().replace("\u2019", "'")


def facts_from_tokens(text: str, toks: list[str]) -> Facts:
    """:func:`facts_of` given ``toks = content_tokens(text)`` (for callers that need the
    tokens too: one tokenisation)."""
    tokset = frozenset(toks)
    raw = _UWORD.findall(text)
    uwords = [_fold(w) for w in raw]
    if NEGATIONS.isdisjoint(tokset):
        neg_at = None
        scope: frozenset = frozenset()
    else:
        neg_at = next(k for k, t in enumerate(toks) if t in NEGATIONS)
        scope = frozenset(t for t in toks[neg_at + 1 : neg_at + 5] if t not in STOP_WORDS)
    # the multisets only where the text has one of their words (most texts have none)
    has_num = _DIGIT.search(text) is not None or not NUMBER_WORDS.keys().isdisjoint(tokset)
    words = tokset.union(uwords)
    if "'" in text or "\u2019" in text or "'" in "".join(toks):
        words |= {t.split("'")[0] for t in (*toks, *uwords) if "'" in t}
    return Facts(
        frozenset(_numbers(toks, text)) if has_num else frozenset(),
        frozenset(_date_terms(toks)) if not DATE_WORDS.isdisjoint(tokset) else frozenset(),
        _names(text, raw),
        neg_at is not None,  # a negation word among the tokens (what _negation_count counts)
        words,
        scope,
    )


def _names(text: str, words: list[str]) -> frozenset:
    """``frozenset(names_in(text))`` given ``words = _UWORD.findall(text)``: none in a text
    without an upper-case letter, and the later capitalised ``words`` when the text is one
    sentence (its words are then the sentence's)."""
    if text.islower():  # no character is upper or title case
        return frozenset()
    if len(split_sentences(text.strip())) == 1:
        return frozenset([w for w in words[1:] if w[0].isupper()])
    return frozenset(names_in(text))


def lost_facts(text: str, members: Sequence[str]) -> list[str]:
    """The facts of ``members`` that a merged ``text`` lacks: a number, a date term or a name
    (:class:`Facts`) not in its words, or a negation when ``text`` has none. Empty list =
    every member's facts are kept.

    Args:
        text: the merged text.
        members: the members' texts.

    Returns:
        Sorted ``"number 2"``, ``"date may"``, ``"name Paris"``, ``"a negation"`` entries.
    """
    have = facts_of(text)
    out: set[str] = set()
    for m in members:
        f = facts_of(m)
        out |= {f"number {n}" for n in f.numbers - have.numbers}
        out |= {f"date {d}" for d in f.dates - have.dates}
        out |= {f"name {w}" for w in f.names if _name_key(w) not in have.words}
        if f.negated and not have.negated:
            out.add("a negation")
    return sorted(out)


def _time_key(t: float) -> float:
    """Sort key of a fact time: unknown (NaN) times last."""
    return t if math.isfinite(t) else math.inf


def _member_order(m: MergeMember) -> tuple[float, str]:
    """The order in which the extractive merger reads members: fact time (unknown last),
    then id."""
    return (_time_key(fact_time(m)), m.id)


@functools.cache
def _fidelity() -> tuple[Callable[[str], tuple[Clause, ...]], Callable[..., bool]]:
    """``(clauses_of, clause_covers)`` of :mod:`consolidate.ops.fidelity` (which imports
    this module), imported once."""
    from .fidelity import clause_covers, clauses_of

    return clauses_of, clause_covers


def _sentence(x: str) -> str:
    """``x`` as a sentence: a lower-case first letter made upper case, ending in ``.``,
    ``!`` or ``?`` (a trailing ``;``, ``,`` or ``:`` becomes ``.``)."""
    x = x.strip()
    if x[:1].islower():
        x = x[0].upper() + x[1:]
    return x if x[-1:] in (".", "!", "?") else x.rstrip(";,:") + "."


class ExtractiveMerger:
    """No-model merger that deduplicates clauses, not members: every distinct clause of every
    member is kept, verbatim; only a clause that another kept clause already says is dropped.

    Clauses and "already says" are those of the fidelity checker
    (:func:`~consolidate.ops.fidelity.clause_covers`: same polarity, every number, date term and
    name, and at least ``threshold`` of the content terms), so the merged text passes the
    checker by construction. Members are read in the order their facts became true
    (:func:`fact_time`, then id), each from :attr:`MergeMember.merge_texts` (a record an
    earlier pass merged is merged again from its source texts, so wording does not drift
    across nightly passes). A clause that says more than a kept one (a superset of its terms
    and items) takes that clause's place; several kept clauses it covers are replaced by it
    once. Clauses with different dates or numbers are never one clause, so distinct dates stay
    apart. A clause cut at ``;`` gets a capital and a full stop.

    A merge longer than ``max_chars`` is declined (the members stay unmerged and the response's
    note says why): nothing is cut.

    By default it does not handle conflicts: the pass keeps conflicting pairs apart and lists
    them for review. With ``newer_wins=True`` it takes clusters with flagged pairs too and
    resolves each by time alone: the older member of a flagged pair is superseded (its
    validity interval closed by the pass), the rest are merged. That rule trusts the conflict
    guard, so it applies only to the reasons in ``supersede_on`` (number and date changes by
    default; negation flags are often false on real text, e.g. "keep pushing" / "do not give
    up"): a cluster with any other flagged pair, or with a flagged pair of equal times, is left
    unmerged for review.

    Args:
        separator: joins the kept clauses.
        max_chars: decline merges whose text would be longer (``None`` = no limit).
        newer_wins: supersede the older member of each flagged pair (see above).
        supersede_on: conflict reasons the rule resolves (``number``, ``date``,
            ``negation``, ``opposite``, ``value``, ``roles``).
        threshold: term coverage at which a kept clause says another
            (:data:`~consolidate.ops.fidelity.DEFAULT_THRESHOLD` when ``None``); in (0, 1].

    Raises:
        ValueError: ``max_chars`` below 1, or ``threshold`` outside (0, 1].
    """

    name = "extractive"
    handles_conflicts = False
    #: ``merge_batch`` is a pure function of its requests (no model, no I/O): the pass may
    #: run it in forked processes (:mod:`consolidate.workers`)
    pure = True

    def __init__(
        self,
        separator: str = " ",
        max_chars: int | None = None,
        newer_wins: bool = False,
        supersede_on: Sequence[str] = ("number", "date"),
        threshold: float | None = None,
    ) -> None:
        from .fidelity import DEFAULT_THRESHOLD

        if max_chars is not None and max_chars < 1:
            raise ValueError(f"max_chars must be >= 1 or None, got {max_chars}")
        self.threshold = DEFAULT_THRESHOLD if threshold is None else float(threshold)
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.separator = separator
        self.max_chars = max_chars
        self.supersede_on = tuple(supersede_on)
        self.handles_conflicts = bool(newer_wins)
        if newer_wins:
            self.name = "extractive:newer_wins"

    def merge_text(self, members: Sequence[MergeMember]) -> str:
        """The deduplicated text of ``members`` (see the class docstring)."""
        clauses_of, clause_covers = _fidelity()
        th = self.threshold
        kept: list[Clause] = []
        for m in sorted(members, key=_member_order):
            for t in m.merge_texts:
                for c in clauses_of(t):
                    if not kept:
                        kept.append(c)
                        continue
                    if any(clause_covers(k, c, th) for k in kept):
                        continue  # said already
                    under = [x for x, k in enumerate(kept) if clause_covers(c, k, th)]
                    if under:  # says more than kept clauses: takes the first one's place
                        kept[under[0]] = c
                        kept = [k for x, k in enumerate(kept) if x not in under[1:]]
                    else:
                        kept.append(c)
        if len(kept) == 1:
            return kept[0].text.strip()
        return self.separator.join(_sentence(k.text) for k in kept)

    def checked_text(self, members: Sequence[MergeMember]) -> tuple[str | None, str]:
        """``(text, "")``, or ``(None, why)`` when there are no words to merge or the text
        would exceed ``max_chars``."""
        text = self.merge_text(members)
        if not any(c.isalnum() for c in text):
            return None, "no words to merge: left unmerged"
        if self.max_chars is not None and len(text) > self.max_chars:
            return None, (
                f"merged text of {len(text)} characters > max_chars {self.max_chars}: left unmerged"
            )
        return text, ""

    def merge_batch(self, requests: Sequence[MergeRequest]) -> list[MergeResponse]:
        out = []
        for r in requests:
            other = sorted({w for _, _, w in r.conflicts if w not in self.supersede_on})
            if other:  # flags the rule does not trust: never blend, never close
                out.append(MergeResponse(None, note=f"flagged {', '.join(other)}: left for review"))
                continue
            old = newer_fact_times(r) if self.handles_conflicts else {}
            rest = [m for m in r.members if m.id not in old]
            if unordered_pair(r, old):
                # a flagged pair with equal or unknown times: no newer fact, never blend
                out.append(
                    MergeResponse(None, note="flagged pair with equal times: left for review")
                )
                continue
            text, why = self.checked_text(rest) if len(rest) > 1 else (None, "")
            notes = [f"newer wins over {len(old)}"] if old else []
            out.append(
                MergeResponse(
                    text,
                    superseded=tuple(sorted(old)),
                    note="; ".join(notes + ([why] if why else [])),
                )
            )
        return out

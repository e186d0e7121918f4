"""``LLMMerger``: the pass's :class:`~consolidate.ops.merge.Merger` backed by any LLM backend.

One request per cluster, all clusters in one batch call. The model writes one text from the
members' own texts (each member is shown verbatim; a member that an earlier pass merged is
shown as the texts it was merged from, so a re-merge starts from the source facts and its
wording does not drift from pass to pass). The prompt's contract is the extractive merger's:
keep every distinct statement of every note, drop only what is said twice. A merge is
accepted only if every member's content survives in it (the fidelity checker,
:func:`consolidate.ops.fidelity.lost_members`, which also covers numbers, date terms, negations and
names) and it adds no number, name or (beyond a quarter of its content words) vocabulary of
its own; otherwise the request is retried once with what was lost, and after that the
cluster is left unmerged (the conservative choice). The pass checks the text once more with
the same checker before committing it. Every raw response goes to the changelog.

With ``handles_conflicts=True`` the pass also sends clusters whose members the conflict guard
flagged. Those get a second prompt (``merge-conflict-v1``): the notes numbered in time order
with their dates and the flagged pairs, and the answer names the outdated notes (contradicted
by a newer one) besides the merged text of the others. An outdated note is accepted only if a
strictly newer flagged partner exists (:func:`~consolidate.ops.merge.newer_fact_times`), and the
text is checked against the notes that stay true only; anything else is retried once, then the
cluster is left unmerged and nothing is closed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from ..lexicon import CONTENT_STOP_WORDS
from ..ops.merge import (
    MergeRequest,
    MergeResponse,
    canonical_order,
    fact_time,
    facts_of,
    lost_facts,
    names_in,
    newer_fact_times,
    unordered_pair,
)
from ..text import _numbers, content_tokens
from .base import ChatRequest, json_request, parse_json_model, quote
from .cache import backend_from

__all__ = [
    "MERGE_PROMPT_VERSION",
    "CONFLICT_PROMPT_VERSION",
    "MergeOut",
    "ConflictOut",
    "merge_chat_request",
    "conflict_chat_request",
    "merge_prompt_version",
    "parse_merge",
    "missing_facts",
    "LLMMerger",
]

MERGE_PROMPT_VERSION = "merge-v4"
CONFLICT_PROMPT_VERSION = "merge-conflict-v2"
_SYSTEM = (
    "You merge notes about one person into a single note. Keep every distinct statement "
    "of every note, in the notes' words; drop only a statement another note already makes. "
    "Keep every number, date, name and negation exactly. Do not add facts. Reply with JSON "
    'only: {"text": "<the merged note>"}'
)


class MergeOut(BaseModel):
    """The merge answer's schema."""

    text: str


class ConflictOut(BaseModel):
    """The conflict-merge answer's schema: numbers of outdated notes, and the merged text of
    the notes that are still true (may be empty when only one remains)."""

    outdated: list[int]
    text: str


_CONFLICT_SYSTEM = (
    "You clean up notes about one person. Some notes may contradict each other; when they "
    "do, the newer note is true and the older one is outdated. Never blend contradicting "
    "notes. List the numbers of the outdated notes, then merge the notes that are still true "
    "into one note that keeps every number, date, name and negation exactly. Reply with JSON "
    'only: {"outdated": [<note numbers>], "text": "<merged note of the others>"}'
)


def merge_prompt_version(handles_conflicts: bool) -> str:
    """The prompt version mixed into the response cache's keys of an :class:`LLMMerger`."""
    return MERGE_PROMPT_VERSION + ("+" + CONFLICT_PROMPT_VERSION if handles_conflicts else "")


def _date(hours: float) -> str:
    if not math.isfinite(hours):
        return "date unknown"
    return datetime.fromtimestamp(hours * 3600, UTC).strftime("%Y-%m-%d")


def conflict_order(req: MergeRequest) -> list:
    """Members in the order the conflict prompt numbers them (1-based): by fact time, id."""
    return sorted(req.members, key=lambda m: (fact_time(m), m.id))


def conflict_chat_request(
    req: MergeRequest, max_tokens: int, retry_note: str = "", seed: int = 0
) -> ChatRequest:
    """The chat request for one cluster with flagged pairs (notes dated, oldest first)."""
    order = conflict_order(req)
    num = {m.id: k + 1 for k, m in enumerate(order)}
    notes = "\n".join(f"[{num[m.id]}] ({_date(fact_time(m))}) {quote(m.text)}" for m in order)
    flagged = sorted(
        {
            (min(num[a], num[b]), max(num[a], num[b]), why)
            for a, b, why in req.conflicts
            if a in num and b in num
        }
    )
    pairs = "\n".join(f"- [{a}] and [{b}] may contradict ({why})" for a, b, why in flagged)
    user = f"Notes, oldest first:\n{notes}\n\nFlagged:\n{pairs}\n\nAnswer as JSON:"
    return json_request(_CONFLICT_SYSTEM, user, ConflictOut, max_tokens, retry_note, seed)


def merge_chat_request(
    req: MergeRequest, max_tokens: int, retry_note: str = "", seed: int = 0
) -> ChatRequest:
    """The chat request for one cluster (members most important first; a member that an
    earlier pass merged is shown as its source texts, :attr:`MergeMember.merge_texts`)."""
    notes = "\n".join(f"- {quote(t)}" for m in canonical_order(req.members) for t in m.merge_texts)
    return json_request(
        _SYSTEM, f"Notes:\n{notes}\n\nMerged note as JSON:", MergeOut, max_tokens, retry_note, seed
    )


def parse_merge(raw: str) -> str | None:
    """The merged text from a model answer (first JSON object with a non-empty ``text``),
    or ``None`` if there is none."""
    out = parse_json_model(raw, MergeOut)
    if out is None:
        return None
    text = out.text.strip()
    return text or None


def invented(text: str, members: Sequence[str]) -> list[str]:
    """Numbers and capitalised names (not sentence-initial) in ``text`` found in no member;
    empty list = acceptable."""
    member_toks: set[str] = set()
    member_nums: set[str] = set()
    for m in members:
        f = facts_of(m)
        member_toks |= f.words
        member_nums |= f.numbers
    toks = content_tokens(text)
    out = [f"added number {n}" for n in _numbers(toks, text) if n not in member_nums]
    out += [
        f"added name {w}"
        for w in names_in(text)
        if w.casefold().replace("\u2019", "'") not in member_toks
    ]
    return sorted(set(out))


def missing_facts(text: str, members: Sequence[str], max_novel: float = 0.25) -> list[str]:
    """What is wrong with a merged ``text`` given its ``members``: a dropped number, date
    term, negation or capitalised name (:func:`~consolidate.ops.merge.lost_facts`); a member
    clause that does not survive (:func:`consolidate.ops.fidelity.lost_clauses`, as
    ``lost "<clause>"``); an added number or name (:func:`invented`); or more than
    ``max_novel`` of its content words found in no member (invented facts). Empty list =
    acceptable."""
    from ..ops.fidelity import lost_clauses

    missing = lost_facts(text, members)
    missing += [f'lost "{c}"' for m in members for c in lost_clauses(m, text)]
    missing += invented(text, members)
    member_toks: set[str] = set()
    for m in members:
        member_toks |= set(content_tokens(m))
    content = [t for t in content_tokens(text) if t not in CONTENT_STOP_WORDS]
    novel = [t for t in content if t not in member_toks]
    if content and len(novel) / len(content) > max_novel:
        missing.append(f"{len(novel)} of {len(content)} content words in no member")
    return sorted(set(missing))


class LLMMerger:
    """Merger through an LLM backend (see the module docstring).

    Args:
        backend: backend name (``transformers``, ``openai``, ``vllm``) or a backend object.
        backend_kwargs: passed to the backend.
        cache_path: SQLite response cache (``None`` = no cache).
        max_tokens: new tokens per merge.
        handles_conflicts: also take clusters with flagged pairs (newer fact wins).
    """

    name = "llm"
    checks_facts = True  # missing_facts before any merge is accepted

    def __init__(
        self,
        backend: str | Any = "transformers",
        backend_kwargs: dict | None = None,
        cache_path: str | None = ".cache/llm_cache.sqlite",
        max_tokens: int = 96,
        handles_conflicts: bool = False,
    ) -> None:
        self.prompt_version = merge_prompt_version(handles_conflicts)
        self.backend, be = backend_from(backend, backend_kwargs, cache_path, self.prompt_version)
        self.name = f"llm:{be.name}"
        self.max_tokens = max_tokens
        self.handles_conflicts = bool(handles_conflicts)

    def _request(self, req: MergeRequest, why: str = "", seed: int = 0) -> ChatRequest:
        if self.handles_conflicts and req.conflicts:
            return conflict_chat_request(req, self.max_tokens, why, seed)
        return merge_chat_request(req, self.max_tokens, why, seed)

    def _check(self, req: MergeRequest, raw: str) -> tuple[str | None, tuple[str, ...], str]:
        """(text, superseded ids, why rejected or "")."""
        if not (self.handles_conflicts and req.conflicts):
            text = parse_merge(raw)
            if text is None:
                return None, (), "no JSON with a text"
            return (
                text,
                (),
                ", ".join(missing_facts(text, [t for m in req.members for t in m.merge_texts])),
            )
        out = parse_json_model(raw, ConflictOut)
        if out is None:
            return None, (), "no JSON with outdated and text"
        order = conflict_order(req)
        if any(not 1 <= k <= len(order) for k in out.outdated):
            return None, (), f"outdated {out.outdated} names notes that do not exist"
        sup = tuple(sorted({order[k - 1].id for k in out.outdated}))
        allowed = newer_fact_times(req)
        wrong = [k for k in sorted(set(out.outdated)) if order[k - 1].id not in allowed]
        if wrong:
            return None, (), f"notes {wrong} are not contradicted by a newer flagged note"
        open_pair = [(a, b) for a, b, _ in req.conflicts if a not in sup and b not in sup]
        if open_pair:
            a, b = open_pair[0]
            num = {m.id: k + 1 for k, m in enumerate(order)}
            return (
                None,
                (),
                (
                    f"notes [{num[a]}] and [{num[b]}] were flagged and neither is "
                    f"marked outdated; never blend them"
                ),
            )
        rest = [m.text for m in req.members if m.id not in sup]
        if len(rest) < 2:
            return None, sup, ""  # nothing left to merge: only close the outdated ones
        text = out.text.strip()
        if not text:
            return None, (), "empty text"
        return text, sup, ", ".join(missing_facts(text, rest))

    def merge_batch(self, requests: Sequence[MergeRequest]) -> list[MergeResponse]:
        out: list[MergeResponse | None] = [None] * len(requests)
        ask = []
        for k, req in enumerate(requests):
            if self.handles_conflicts and req.conflicts and unordered_pair(req):
                # a flagged pair with no newer side can be neither closed nor blended
                out[k] = MergeResponse(
                    None, note="flagged pair with equal or unknown times: left for review (no call)"
                )
            else:
                ask.append(k)
        sent = self.backend.chat([self._request(requests[k]) for k in ask]) if ask else []
        first: dict[int, Any] = dict(zip(ask, sent, strict=True))
        retry: list[tuple[int, str]] = []
        for k, resp in first.items():
            req = requests[k]
            text, sup, why = self._check(req, resp.text)
            if not why:
                out[k] = MergeResponse(
                    text,
                    resp.text,
                    1,
                    resp.prompt_tokens,
                    resp.completion_tokens,
                    superseded=sup,
                    extra={"latency_s": resp.latency_s},
                )
            else:
                retry.append((k, why))
        if retry:
            second = self.backend.chat(
                [self._request(requests[k], why, seed=1) for k, why in retry]
            )
            for (k, why), resp in zip(retry, second, strict=True):
                text, sup, why2 = self._check(requests[k], resp.text)
                p0 = first[k]
                common = dict(
                    raw=json.dumps([p0.text, resp.text]),
                    calls=2,
                    prompt_tokens=p0.prompt_tokens + resp.prompt_tokens,
                    completion_tokens=p0.completion_tokens + resp.completion_tokens,
                    extra={"latency_s": p0.latency_s + resp.latency_s},
                )
                if why2:
                    out[k] = MergeResponse(
                        None, note=f"rejected twice: {why}; then {why2}", **common
                    )
                else:
                    out[k] = MergeResponse(
                        text, note=f"accepted on retry (first: {why})", superseded=sup, **common
                    )
        return [o for o in out if o is not None]

"""``LLMMerger``: the pass's :class:`~consolidate.merge.Merger` backed by any LLM backend.

One request per cluster, all clusters in one batch call. The model writes one text from the
members' own texts (each member is shown verbatim). A merge is accepted only if it keeps
every number, date term, negation and capitalised name of its members and adds no number,
name or (beyond a quarter of its content words) vocabulary of its own; otherwise the request
is retried once, and after that the cluster is left unmerged (the conservative choice). Every
raw response goes to the changelog.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from ..merge import MergeRequest, MergeResponse, canonical_order
from ..text import _date_terms, _negation_count, _numbers, content_tokens
from .base import ChatRequest, make_backend, parse_json_model
from .cache import CachedBackend

__all__ = ["MERGE_PROMPT_VERSION", "MergeOut", "merge_chat_request", "parse_merge",
           "missing_facts", "LLMMerger"]

MERGE_PROMPT_VERSION = "merge-v1"
_SYSTEM = ("You merge notes about one person into a single note. Keep every number, date, "
           "name and negation exactly. Do not add facts. Reply with JSON only: "
           '{"text": "<the merged note>"}')


class MergeOut(BaseModel):
    """The merge answer's schema."""

    text: str


def merge_chat_request(req: MergeRequest, max_tokens: int, retry_note: str = "",
                       seed: int = 0) -> ChatRequest:
    """The chat request for one cluster (members most important first)."""
    notes = "\n".join(f"- {m.text}" for m in canonical_order(req.members))
    user = f"Notes:\n{notes}\n\nMerged note as JSON:"
    if retry_note:
        user += f"\n(Your previous answer was rejected: {retry_note}.)"
    return ChatRequest(({"role": "system", "content": _SYSTEM},
                        {"role": "user", "content": user}),
                       max_tokens=max_tokens, temperature=0.0 if not retry_note else 0.7,
                       seed=seed)




def parse_merge(raw: str) -> str | None:
    """The merged text from a model answer (first JSON object with a non-empty ``text``),
    or ``None`` if there is none."""
    out = parse_json_model(raw, MergeOut)
    if out is None:
        return None
    text = out.text.strip()
    return text or None


_NAME = re.compile(r"(?<![.!?]\s)(?<!^)\b([A-Z][a-z]+)\b")


_STOP = {"a", "an", "the", "and", "or", "but", "of", "to", "in", "on", "at", "for", "with",
         "is", "was", "are", "were", "be", "been", "has", "had", "have", "her", "his", "she",
         "he", "they", "their", "it", "its", "that", "this", "as", "by", "from", "also",
         "who", "which", "about", "into", "very", "so", "both"}


def missing_facts(text: str, members: Sequence[str], max_novel: float = 0.25) -> list[str]:
    """What is wrong with a merged ``text`` given its ``members``: a dropped number, date
    term, negation or capitalised name (not sentence-initial); an added number or name; or
    more than ``max_novel`` of its content words found in no member (invented facts).
    Empty list = acceptable."""
    toks = content_tokens(text)
    have_num = _numbers(toks, text)
    have_dates = _date_terms(toks)
    low = set(toks)
    missing: list[str] = []
    member_toks: set[str] = set()
    member_nums: set[str] = set()
    for m in members:
        mt = content_tokens(m)
        member_toks |= set(mt)
        member_nums |= set(_numbers(mt, m))
        missing += [f"number {n}" for n in _numbers(mt, m) if n not in have_num]
        missing += [f"date {d}" for d in _date_terms(mt) if d not in have_dates]
        if _negation_count(mt) and not _negation_count(toks):
            missing.append("a negation")
        missing += [f"name {w}" for w in _NAME.findall(m.strip()) if w.lower() not in low]
    missing += [f"added number {n}" for n in have_num if n not in member_nums]
    missing += [f"added name {w}" for w in _NAME.findall(text.strip())
                if w.lower() not in member_toks]
    content = [t for t in toks if t not in _STOP]
    novel = [t for t in content if t not in member_toks]
    if content and len(novel) / len(content) > max_novel:
        missing.append(f"{len(novel)} of {len(content)} content words in no member")
    return sorted(set(missing))


class LLMMerger:
    """Merger through an LLM backend (see the module docstring).

    Args:
        backend: backend name (``transformers``, ``openai``) or a backend object.
        backend_kwargs: passed to the backend.
        cache_path: SQLite response cache (``None`` = no cache).
        max_tokens: new tokens per merge.
    """

    name = "llm"
    handles_conflicts = False

    def __init__(self, backend: str | Any = "transformers", backend_kwargs: dict | None = None,
                 cache_path: str | None = ".cache/llm_cache.sqlite",
                 max_tokens: int = 96) -> None:
        be = make_backend(backend, **dict(backend_kwargs or {})) if isinstance(backend, str) \
            else backend
        self.backend: Any = CachedBackend(be, cache_path, MERGE_PROMPT_VERSION) \
            if cache_path else be
        self.name = f"llm:{be.name}"
        self.max_tokens = max_tokens

    def merge_batch(self, requests: Sequence[MergeRequest]) -> list[MergeResponse]:
        first = self.backend.chat([merge_chat_request(r, self.max_tokens) for r in requests])
        out: list[MergeResponse | None] = [None] * len(requests)
        retry: list[tuple[int, str]] = []
        for k, (req, resp) in enumerate(zip(requests, first, strict=True)):
            text = parse_merge(resp.text)
            why = "no JSON with a text" if text is None else ", ".join(
                missing_facts(text, [m.text for m in req.members]))
            if not why:
                out[k] = MergeResponse(text, resp.text, 1, resp.prompt_tokens,
                                       resp.completion_tokens,
                                       extra={"latency_s": resp.latency_s})
            else:
                retry.append((k, why))
        if retry:
            second = self.backend.chat([
                merge_chat_request(requests[k], self.max_tokens, why, seed=1)
                for k, why in retry])
            for (k, why), resp in zip(retry, second, strict=True):
                text = parse_merge(resp.text)
                why2 = "no JSON with a text" if text is None else ", ".join(
                    missing_facts(text, [m.text for m in requests[k].members]))
                p0 = first[k]
                tokens = (p0.prompt_tokens + resp.prompt_tokens,
                          p0.completion_tokens + resp.completion_tokens)
                if why2:
                    out[k] = MergeResponse(None, json.dumps([p0.text, resp.text]), 2, *tokens,
                                           note=f"rejected twice: {why}; then {why2}",
                                           extra={"latency_s": p0.latency_s + resp.latency_s})
                else:
                    out[k] = MergeResponse(text, json.dumps([p0.text, resp.text]), 2, *tokens,
                                           note=f"accepted on retry (first: {why})",
                                           extra={"latency_s": p0.latency_s + resp.latency_s})
        return [o for o in out if o is not None]

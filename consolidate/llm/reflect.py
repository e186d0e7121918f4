"""Reflection: one higher-level fact per cluster of related memories, through any backend.

The pass groups related live memories (cosine at ``sleep.reflect_threshold``, looser than the
merge threshold) and sends each group here in one batch. The model answers one general
statement the notes support together ("Gina cares for animals" over notes about her cats,
her dog and her volunteering at a shelter). The pass stores it as a NEW memory linked to its
sources (``derived_from`` = the member ids; provenance = their ``source_ids``); the members
stay as they are. This is the reflection step of Generative Agents (Park et al., 2023,
"Generative Agents: Interactive Simulacra of Human Behavior", section 4.2), without their
importance-sum trigger: here reflection runs in the nightly pass, over clusters.

Checks: an answer must be valid JSON with a non-empty ``text`` that adds no number and no
name that is in no member (a reflection may generalise; it may not invent specifics); one
retry, then the group gets no reflection. Reflector answers use the same
:class:`~consolidate.ops.merge.MergeRequest` / :class:`~consolidate.ops.merge.MergeResponse` types
as merges.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from ..ops.merge import MergeRequest, MergeResponse, canonical_order
from .base import ChatRequest, json_request, parse_json_model, quote
from .cache import backend_from
from .merger import invented

__all__ = ["REFLECT_PROMPT_VERSION", "ReflectOut", "reflect_request", "invented", "LLMReflector"]

REFLECT_PROMPT_VERSION = "reflect-v2"
_SYSTEM = (
    "You read notes about one person and write ONE short, general insight that the "
    "notes support together (a trait, habit, goal or relationship), not a summary of "
    "each note. Use only names and numbers that appear in the notes. Reply with JSON "
    'only: {"text": "<the insight>"}'
)


class ReflectOut(BaseModel):
    """The reflect answer's schema."""

    text: str


def reflect_request(
    req: MergeRequest, max_tokens: int = 64, retry_note: str = "", seed: int = 0
) -> ChatRequest:
    """The chat request for one group (notes most important first)."""
    notes = "\n".join(f"- {quote(m.text)}" for m in canonical_order(req.members))
    return json_request(
        _SYSTEM, f"Notes:\n{notes}\n\nInsight as JSON:", ReflectOut, max_tokens, retry_note, seed
    )


class LLMReflector:
    """Writes reflections through an LLM backend (see the module docstring).

    Args:
        backend: backend name (``transformers``, ``openai``, ``vllm``) or a backend object.
        backend_kwargs: passed to the backend.
        cache_path: SQLite response cache (``None`` = no cache).
        max_tokens: new tokens per reflection.
    """

    def __init__(
        self,
        backend: str | Any = "transformers",
        backend_kwargs: dict | None = None,
        cache_path: str | None = ".cache/llm_cache.sqlite",
        max_tokens: int = 64,
    ) -> None:
        self.backend, be = backend_from(backend, backend_kwargs, cache_path, REFLECT_PROMPT_VERSION)
        self.name = f"llm:{be.name}"
        self.max_tokens = max_tokens

    def _check(self, req: MergeRequest, raw: str) -> tuple[str | None, str]:
        out = parse_json_model(raw, ReflectOut)
        text = out.text.strip() if out is not None else ""
        if not text:
            return None, "no JSON with a text"
        return text, ", ".join(invented(text, [m.text for m in req.members]))

    def reflect_batch(self, requests: Sequence[MergeRequest]) -> list[MergeResponse]:
        """One response per group, in order; ``text=None`` = no reflection for that group."""
        first = self.backend.chat([reflect_request(r, self.max_tokens) for r in requests])
        out: list[MergeResponse] = []
        retry: list[tuple[int, str]] = []
        for k, (req, resp) in enumerate(zip(requests, first, strict=True)):
            text, why = self._check(req, resp.text)
            out.append(
                MergeResponse(
                    text if not why else None,
                    resp.text,
                    1,
                    resp.prompt_tokens,
                    resp.completion_tokens,
                    extra={"latency_s": resp.latency_s},
                )
            )
            if why:
                retry.append((k, why))
        if retry:
            second = self.backend.chat(
                [reflect_request(requests[k], self.max_tokens, why, 1) for k, why in retry]
            )
            for (k, why), resp in zip(retry, second, strict=True):
                text, why2 = self._check(requests[k], resp.text)
                p0 = first[k]
                out[k] = MergeResponse(
                    None if why2 else text,
                    json.dumps([p0.text, resp.text]),
                    2,
                    p0.prompt_tokens + resp.prompt_tokens,
                    p0.completion_tokens + resp.completion_tokens,
                    note=f"rejected twice: {why}; then {why2}"
                    if why2
                    else f"accepted on retry (first: {why})",
                    extra={"latency_s": p0.latency_s + resp.latency_s},
                )
        return out

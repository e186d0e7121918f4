"""SQLite response cache: reruns and sweeps repeat no model call.

Key = sha256 of (backend name, model, prompt version, sampling parameters, messages). The
value is the response text and its token counts. Writes go through one connection per
process with WAL journaling; a crash loses at most the uncommitted batch.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .base import ChatRequest, ChatResponse, LLMBackend, make_backend

__all__ = ["CachedBackend", "ResponseCache", "request_key", "backend_from"]


def request_key(backend: str, model: str, prompt_version: str, r: ChatRequest) -> str:
    """Cache key of one request (hex sha256)."""
    fields = {
        "backend": backend,
        "model": model,
        "prompt": prompt_version,
        "max_tokens": r.max_tokens,
        "temperature": r.temperature,
        "seed": r.seed,
        "messages": list(r.messages),
    }
    if r.json_schema is not None:  # constrained decoding changes the answer
        fields["schema"] = r.json_schema
    payload = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


class ResponseCache:
    """The SQLite table of responses behind :class:`CachedBackend`, usable on its own (a
    fleet run's driver looks answers up and stores them for its actors).

    Args:
        path: SQLite file (created with its folder).
        backend, model, prompt_version: mixed into every key (:func:`request_key`).
    """

    def __init__(self, path: str | Path, backend: str, model: str, prompt_version: str) -> None:
        self.backend, self.model, self.prompt_version = backend, model, prompt_version
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, "
            "text TEXT, prompt_tokens INT, completion_tokens INT, created REAL)"
        )

    def key(self, r: ChatRequest) -> str:
        """The key of one request."""
        return request_key(self.backend, self.model, self.prompt_version, r)

    def get(self, keys: Iterable[str]) -> dict[str, ChatResponse]:
        """The stored responses of ``keys`` (those found; ``extra={"cached": True}``)."""
        found: dict[str, ChatResponse] = {}
        for k in set(keys):
            row = self.db.execute(
                "SELECT text, prompt_tokens, completion_tokens FROM responses WHERE key = ?", (k,)
            ).fetchone()
            if row:
                found[k] = ChatResponse(row[0], row[1], row[2], 0.0, {"cached": True})
        return found

    def put(self, items: Iterable[tuple[str, ChatResponse]]) -> None:
        """Store ``(key, response)`` pairs in one transaction."""
        with self.db:
            for k, resp in items:
                self.db.execute(
                    "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                    (k, resp.text, resp.prompt_tokens, resp.completion_tokens, time.time()),
                )


class CachedBackend:
    """Wraps an :class:`~consolidate.llm.base.LLMBackend`; only cache misses reach it.

    Args:
        backend: the real backend.
        path: SQLite file (created with its folder).
        prompt_version: mixed into every key (bump it when prompts change).

    Attributes:
        hits, misses: counters since construction.
    """

    def __init__(self, backend: LLMBackend, path: str | Path, prompt_version: str) -> None:
        self.inner = backend
        self.name = backend.name
        self.model = backend.model
        self.prompt_version = prompt_version
        self.cache = ResponseCache(path, self.name, self.model, prompt_version)
        self.hits = 0
        self.misses = 0

    def chat(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        keys = [self.cache.key(r) for r in requests]
        found = self.cache.get(keys)
        # one call per distinct missing key
        first: dict[str, int] = {}
        for n, k in enumerate(keys):
            if k not in found:
                first.setdefault(k, n)
        fresh = self.inner.chat([requests[n] for n in first.values()]) if first else []
        pairs = list(zip(first, fresh, strict=True))
        self.cache.put(pairs)
        found.update(pairs)
        self.hits += len(requests) - len(first)
        self.misses += len(first)
        return [found[k] for k in keys]


def backend_from(
    backend: str | Any, backend_kwargs: dict | None, cache_path: str | None, prompt_version: str
) -> tuple[Any, Any]:
    """``(backend to call, the model backend itself)``: ``backend`` is a name for
    :func:`~consolidate.llm.base.make_backend` (with ``backend_kwargs``), a config with a
    ``_target_`` (a class of your own with ``name``, ``model`` and ``chat``, built by
    ``hydra.utils.instantiate`` with the config's other keys and ``backend_kwargs``), or a
    backend object; with a ``cache_path`` the first is wrapped in a :class:`CachedBackend`."""
    if isinstance(backend, str):
        be = make_backend(backend, **dict(backend_kwargs or {}))
    elif isinstance(backend, Mapping) and "_target_" in backend:
        from hydra.utils import instantiate

        be = instantiate({**dict(backend), **dict(backend_kwargs or {})})
    else:
        be = backend
    return (CachedBackend(be, cache_path, prompt_version) if cache_path else be), be

"""Recall: the memories an agent injects into its next prompt, within a hard token cap.

One rule for the product and the evaluation: rank a namespace's live memories by cosine to
the query, keep at most ``k``, then the longest prefix of that ranking whose texts fit in
``max_tokens`` (:func:`fit_token_cap`; the evaluation's ``recall@<B>tok`` uses the same
function). Recalled memories get the recall bookkeeping (``last_used = now``, ``strength +
1`` up to the same cap the pass uses), so what the agent keeps using decays slower, and
no memory grows rich from recalls alone beyond that cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .similarity import topk_neighbours
from .store import MemoryStore
from .store.schema import DEFAULT_STRENGTH_CAP

__all__ = ["Recalled", "fit_token_cap", "recall"]


@dataclass
class Recalled:
    """The memories recalled for one query, best first.

    Attributes:
        query: the query text.
        ids, texts: the memories injected, best first.
        scores: their cosine to the query (float, the engine's tile precision).
        tokens: tokens of their texts, summed (the embedder's tokenizer).
        cut_by_tokens: ranked memories left out by the token cap (of the top ``k``).
    """

    query: str
    ids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    tokens: int = 0
    cut_by_tokens: int = 0


def fit_token_cap(ranked_tokens: np.ndarray, max_tokens: int) -> int:
    """How many of a ranking's first items fit in ``max_tokens``: the longest prefix whose
    token counts sum to at most ``max_tokens`` (an item that does not fit ends the prefix;
    nothing after it is taken, so the order of relevance is kept).

    Args:
        ranked_tokens: ``int [m]`` tokens of each ranked item, best first.
        max_tokens: the cap (``>= 0``).

    Raises:
        ValueError: ``max_tokens < 0``.
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens!r}")
    cum = np.cumsum(np.asarray(ranked_tokens, dtype=np.int64))
    return int(np.searchsorted(cum, max_tokens, side="right"))


def recall(
    store: MemoryStore,
    namespace: str,
    queries: Sequence[str],
    embedder: Any,
    *,
    k: int = 10,
    max_tokens: int = 500,
    mark_used: bool = True,
    strength_cap: float | None = DEFAULT_STRENGTH_CAP,
    now: float | None = None,
    device: str = "cpu",
) -> list[Recalled]:
    """Recall memories of ``namespace`` for each query.

    Args:
        store: the store to read (the current snapshot plus pending deltas).
        namespace: whose memories (never another namespace's).
        queries: query texts (one embedder batch).
        embedder: an object with ``encode(texts) -> float32 [n, d]`` unit vectors and
            ``count_tokens(texts) -> int [n]`` (e.g. :class:`~consolidate.embed.Embedder`).
        k: at most this many memories per query (``>= 1``).
        max_tokens: hard cap on the tokens of the memories injected per query.
        mark_used: apply the recall bookkeeping to every recalled memory
            (:meth:`MemoryStore.mark_used`: one delta for all queries).
        strength_cap: strength never exceeds this through recalls (the pass's default).
        now: hours since the epoch for ``last_used`` (default: the wall clock).
        device: similarity device.

    Returns:
        One :class:`Recalled` per query, in query order (empty when the namespace holds no
        live memory).

    Raises:
        ValueError: ``k < 1`` or ``max_tokens < 0``; the embedder's errors for empty or
            over-long queries.
        StoreNotFoundError, InvalidRecordsError, CorruptStoreError: from :meth:`MemoryStore.load`.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens!r}")
    queries = list(queries)
    recs = store.load().records
    mine = recs.live_mask() & (recs.meta["namespace"].to_numpy(object) == namespace)
    live = recs.mask(mine)
    out = [Recalled(q) for q in queries]
    if not len(live) or not queries:
        return out
    q_vec = embedder.encode(queries)
    top = topk_neighbours(q_vec, live.vectors, min(int(k), len(live)), device=device)
    texts = live.meta["text"].tolist()
    ids = live.meta["id"].tolist()
    tok = np.asarray(embedder.count_tokens(texts), dtype=np.int64)
    used: list[str] = []
    for r, idx, sc in zip(out, top.indices, top.scores, strict=True):
        ranked = idx[idx >= 0]
        n = fit_token_cap(tok[ranked], max_tokens)
        take = ranked[:n]
        r.ids = [ids[j] for j in take]
        r.texts = [texts[j] for j in take]
        r.scores = [float(s) for s in sc[:n]]
        r.tokens = int(tok[take].sum())
        r.cut_by_tokens = len(ranked) - n
        used += r.ids
    if mark_used and used:
        store.mark_used(sorted(set(used)), now=now, strength_cap=strength_cap)
    return out

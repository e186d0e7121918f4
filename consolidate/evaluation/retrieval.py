"""Retrieval quality of a memory store on LOCOMO-style questions (no model needed).

For each question, the live memories of its conversation (both speakers' namespaces) are
ranked by cosine to the question; from that ranking:

* ``recall@k``: evidence recall of the top k (k in ``ks``);
* ``recall@<B>tok``: evidence recall of the longest prefix of the ranking whose memory texts
  fit in B tokens, so that merging many facts into long memories cannot inflate recall@k
  (:func:`consolidate.recall.fit_token_cap`, the rule the product's ``recall`` applies);
* ``tokens@k``: tokens of the top k memories, i.e. the context a reader would inject;
* ``faithful_recall@k`` and ``faithful_recall@<B>tok``: the same rankings, but a retrieved
  memory is credited only with the provenance ids whose original text survives in the
  memory's text (:func:`faithful_source_ids`, the pass's fidelity checker
  :mod:`consolidate.ops.fidelity`). Provenance recall measures retrieval (did the ranking reach
  a memory descended from the evidence?); faithful recall also measures what consolidation
  kept (does the memory still say it?). A merge that drops a member's text keeps its
  provenance recall and loses its faithful recall.

Tokens are counted with the embedding model's tokenizer (WordPiece for MiniLM): an
approximation of an LLM's tokens that needs no extra model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from ..recall import fit_token_cap
from ..similarity import topk_neighbours
from ..store.schema import Records
from .metrics import category_label, evidence_recall

__all__ = [
    "conversation_of",
    "retrieval_table",
    "summarise",
    "latency_ms",
    "origin_texts",
    "faithful_source_ids",
]


def origin_texts(records: Records) -> dict[str, list[str]]:
    """Provenance id -> the distinct texts of the records (before any pass) that carry it:
    what a memory descended from that evidence must still say to be credited with it."""
    m = records.meta[["source_ids", "text"]].explode("source_ids").dropna()
    out: dict[str, list[str]] = {}
    for sid, t in zip(m["source_ids"].tolist(), m["text"].tolist(), strict=True):
        xs = out.setdefault(str(sid), [])
        if t not in xs:
            xs.append(str(t))
    return out


def faithful_source_ids(
    live: Records, origin: dict[str, list[str]], threshold: float | None = None
) -> list[list[str]]:
    """Per live record (row order): the provenance ids it is credited with under faithful
    recall, i.e. those of its ``source_ids`` for which some original text carrying the id
    (``origin``, from :func:`origin_texts`) survives in the record's text
    (:func:`consolidate.ops.fidelity.survives`). A record whose text is one of the id's
    original texts keeps the id without a check; an id with no original text is credited
    (nothing to compare).

    Args:
        live: the records retrieved from (after the pass).
        origin: provenance id -> original texts.
        threshold: the checker's term coverage (default
            :data:`consolidate.ops.fidelity.DEFAULT_THRESHOLD`).

    Returns:
        ``list[list[str]]``, one list per row of ``live``.
    """
    from ..ops.fidelity import DEFAULT_THRESHOLD, survives

    thr = DEFAULT_THRESHOLD if threshold is None else threshold
    out = []
    for sids, text in zip(
        live.meta["source_ids"].tolist(), live.meta["text"].tolist(), strict=True
    ):
        text = str(text)
        keep = []
        for s in sids:
            texts = origin.get(str(s))
            if not texts or text in texts or any(survives(t, text, thr) for t in texts):
                keep.append(s)
        out.append(keep)
    return out


def conversation_of(namespace: str) -> str:
    """LOCOMO namespaces are ``<sample_id>/<speaker>``: the conversation is the first part."""
    return str(namespace).split("/")[0]


def _segments(mem_conv: Sequence[str], q_conv: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    codes, _ = pd.factorize(pd.Series(list(mem_conv) + list(q_conv), dtype=object))
    return codes[: len(mem_conv)].astype(np.int64), codes[len(mem_conv) :].astype(np.int64)


def retrieval_table(
    live: Records,
    questions: pd.DataFrame,
    q_vectors: np.ndarray,
    token_counts: np.ndarray,
    *,
    memory_group: Callable[[str], str] = conversation_of,
    ks: Sequence[int] = (1, 5, 10, 20),
    budgets: Sequence[int] = (200, 500),
    tokens_at_k: int = 10,
    retrieve_k: int = 64,
    device: str = "cpu",
    faithful_sources: Sequence[Sequence[str]] | None = None,
) -> pd.DataFrame:
    """Per-question retrieval metrics.

    Args:
        live: the store's live records (no tombstones).
        questions: ``qid``, ``group``, ``category``, ``evidence`` (list of ids matched
            against the memories' ``source_ids``).
        q_vectors: ``float32 [q, d]`` question embeddings, row-aligned with ``questions``.
        token_counts: ``int [n]`` tokens of each live record's text.
        memory_group: namespace -> the question group that may retrieve it (LOCOMO: the
            conversation, so a question sees both speakers' memories).
        ks, budgets, tokens_at_k: see the module docstring.
        retrieve_k: ranking depth used for the token budgets (>= max(ks)).
        device: similarity device.
        faithful_sources: per live record, the provenance ids faithful recall credits it
            with (:func:`faithful_source_ids`); ``None``: no faithful columns.

    Returns:
        ``DataFrame`` with one row per question: ``qid``, ``category``, ``recall@k`` ...,
        ``recall@<B>tok`` ..., ``faithful_recall@k`` and ``faithful_recall@<B>tok`` (with
        ``faithful_sources``), ``tokens@<k>``, ``n_evidence``, ``pool`` (memories the
        question could retrieve: for ``k >= pool`` its recall@k is full context, not
        retrieval), ``top_ids`` (first 10 ids).
    """
    depth = max(retrieve_k, max(ks))
    mem_conv = [memory_group(n) for n in live.meta["namespace"]]
    mseg, qseg = _segments(mem_conv, questions["group"].tolist())
    top = topk_neighbours(
        q_vectors, live.vectors, depth, query_segments=qseg, key_segments=mseg, device=device
    )
    src = live.meta["source_ids"].tolist()
    ids = live.meta["id"].tolist()
    tok = np.asarray(token_counts, dtype=np.int64)
    pool = np.bincount(mseg, minlength=int(max(mseg.max(initial=-1), qseg.max(initial=-1))) + 1)
    rows = []
    for qi, q in enumerate(questions.itertuples(index=False)):
        ranked = [j for j in top.indices[qi] if j >= 0]
        r = {
            "qid": q.qid,
            "category": int(q.category),
            "n_evidence": len(q.evidence),
            "pool": int(pool[qseg[qi]]),
        }
        for k in ks:
            r[f"recall@{k}"] = evidence_recall(q.evidence, [src[j] for j in ranked[:k]])
        for b in budgets:  # the product's rule (consolidate.recall)
            n_fit = fit_token_cap(tok[ranked], b)
            r[f"recall@{b}tok"] = evidence_recall(q.evidence, [src[j] for j in ranked[:n_fit]])
            r[f"memories@{b}tok"] = n_fit
        if faithful_sources is not None:
            fs = faithful_sources
            for k in ks:
                r[f"faithful_recall@{k}"] = evidence_recall(q.evidence, [fs[j] for j in ranked[:k]])
            for b in budgets:
                n_fit = r[f"memories@{b}tok"]
                r[f"faithful_recall@{b}tok"] = evidence_recall(
                    q.evidence, [fs[j] for j in ranked[:n_fit]]
                )
        r[f"tokens@{tokens_at_k}"] = int(tok[ranked[:tokens_at_k]].sum()) if ranked else 0
        r["top_ids"] = [ids[j] for j in ranked[:10]]
        rows.append(r)
    return pd.DataFrame(rows)


def latency_ms(
    live: Records,
    questions: pd.DataFrame,
    q_vectors: np.ndarray,
    k: int,
    sample: int = 200,
    seed: int = 0,
    device: str = "cpu",
    memory_group: Callable[[str], str] = conversation_of,
) -> dict[str, float]:
    """p50/p95 of one-question retrieval (top-k over its conversation), milliseconds, on a
    fixed random sample of questions (``seed``); ``{}`` when ``sample`` is 0."""
    if sample <= 0 or not len(questions):
        return {}
    g = np.random.default_rng(seed)
    idx = g.choice(len(questions), size=min(sample, len(questions)), replace=False)
    mem_conv = np.array([memory_group(n) for n in live.meta["namespace"]], dtype=object)
    by_conv = {c: np.flatnonzero(mem_conv == c) for c in set(mem_conv)}
    times = []
    for qi in idx:
        rows = by_conv.get(questions["group"].iat[qi], np.zeros(0, np.int64))
        t = time.perf_counter()
        if len(rows):
            topk_neighbours(q_vectors[qi : qi + 1], live.vectors[rows], k, device=device)
        times.append((time.perf_counter() - t) * 1e3)
    return {"p50_ms": float(np.percentile(times, 50)), "p95_ms": float(np.percentile(times, 95))}


def summarise(
    table: pd.DataFrame, metric_cols: Sequence[str], label: Callable[[int], str] = category_label
) -> pd.DataFrame:
    """Mean of each metric over all questions and per category (labelled by ``label``; for
    LOCOMO both naming conventions).

    Returns:
        ``DataFrame`` with ``category`` (``"all"`` or the code), ``label``, ``n`` and the
        metric columns (NaN recalls, i.e. questions without evidence, are skipped).
    """
    out = [
        {
            "category": "all",
            "label": "all",
            "n": len(table),
            **{c: float(table[c].mean()) for c in metric_cols},
        }
    ]
    for cat, g in table.groupby("category"):
        out.append(
            {
                "category": int(cat),
                "label": label(int(cat)),
                "n": len(g),
                **{c: float(g[c].mean()) for c in metric_cols},
            }
        )
    return pd.DataFrame(out)

"""The write path: turns -> facts -> embeddings -> top-s neighbours -> decisions -> store.

1. Turns from tool output or web text are dropped unless allowed (poisoned-memory defence).
2. One extract request per turn, all in one batch; an unparseable answer is retried once,
   then the turn is skipped and logged.
3. All facts are embedded in one batch; their top-s stored neighbours (same namespace) come
   from :func:`consolidate.similarity.topk_neighbours`.
4. Cheap filters first (exact duplicate -> NOOP, nearest neighbour below ``add_below`` ->
   ADD); the remaining facts of a turn go to the model in ONE decide request with aliased
   neighbours (:mod:`consolidate.llm.decide`), retried once when the answer is not valid
   JSON or has a malformed action (each one is logged as ``malformed_action`` naming its
   fact and alias), else ADD.
5. Decisions are applied in turn order, then fact order. When two facts touch the same stored
   memory in one batch, the first wins and the later one is ADDed instead (deterministic).
   ADD appends a record; UPDATE appends the new text and tombstones the old record with
   ``merged_into`` pointing at it; DELETE is a contradiction: the new fact is appended and
   the old record becomes a tombstone ``deleted_reason="superseded"`` whose ``merged_into``
   points at it (the new fact is never lost). A model NOOP is accepted only if the fact does
   not conflict (negation, number, date) with its nearest stored memory; otherwise it is
   ADDed. A NOOP names the memory that holds the fact (the exact duplicate, else the
   nearest). An ADD that negates or opposes its nearest memory at ``supersede_above`` or
   more supersedes it (a correction the model missed). Relative dates in a fact's text are
   resolved against its turn (:func:`resolve_relative_dates`); vague ones are flagged. A temporal fact (one with a
   ``valid_from``) is history rather than an error once contradicted: UPDATE or DELETE of it
   closes its validity interval (``valid_to`` = when the new fact became true, else the turn's
   time) and keeps it live. Nothing is ever removed.

New records are written with :meth:`MemoryStore.append` before the tombstones
(:meth:`MemoryStore.patch`), so a crash in between leaves both versions, never neither.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .lexicon import NUMBER_WORDS, SMALL_CARDINALS, WEEKDAYS
from .llm.base import LLMBackend
from .llm.decide import Decision, Neighbour, decide_request, parse_answer, prefilter
from .llm.extract import Turn, extract_request, parse_facts, trusted, ungrounded
from .ops.guard import conflict_reason
from .similarity import topk_neighbours
from .store import (
    MemoryStore,
    Records,
    datetime_from_hours,
    hours_from_datetime,
    hours_now,
    records_from_rows,
)
from .store.schema import normalise_vectors
from .text import text_hash

__all__ = ["IngestConfig", "ingest", "resolve_relative_dates"]


@dataclass
class IngestConfig:
    """Write-path settings.

    Attributes:
        top_s: stored neighbours per fact shown to the decide step.
        add_below: a fact whose nearest neighbour's cosine is below this is ADDed without a
            model call.
        allow_untrusted: also extract from ``tool``/``web`` turns.
        require_grounding: refuse an extracted fact that states a number or a name its turn
            does not contain (:func:`~consolidate.llm.extract.ungrounded`; logged as
            ``ungrounded_fact`` with what it added, never stored).
        supersede_above: a fact the model ADDs (or NOOPs against a memory it conflicts
            with) whose nearest stored memory in its namespace has at least this cosine and
            is its negation or opposite (:func:`~consolidate.ops.guard.conflict_reason`
            ``"negation"`` / ``"opposite"``) supersedes that memory like a DELETE (decided
            ``by="guard"``); a pinned memory, one already changed in the batch, or one newer
            than the fact's turn stays live and the pair is logged as
            ``contradiction_kept``. ``None``: never supersede, only log.
        extract_max_tokens, decide_max_tokens: generation limits.
    """

    top_s: int = 5
    add_below: float = 0.5
    allow_untrusted: bool = False
    require_grounding: bool = True
    supersede_above: float | None = 0.8
    extract_max_tokens: int = 192
    decide_max_tokens: int = 256


#: the refused-facts log, beside the changelogs of the store
REFUSED_FACTS = "refused_facts.jsonl"


def refused_facts_path(store: MemoryStore) -> Path:
    """``<store>/changelogs/refused_facts.jsonl``: one JSON line per extracted fact (or
    turn) the write path did not store, ``{"turn", "namespace", "speaker", "time_h",
    "fact", "reason", "detail", "logged_at"}`` (``reason``: ``ungrounded`` with the names and
    numbers it added, ``untrusted_source``, ``extract_failed``; ``fact`` is ``None`` for a
    whole turn)."""
    return Path(store.root) / "changelogs" / REFUSED_FACTS


def _refusal(t: Turn, fact: str | None, reason: str, detail: str) -> dict[str, Any]:
    return {
        "turn": t.id,
        "namespace": t.namespace,
        "speaker": t.speaker,
        "time_h": t.time_h,
        "fact": fact,
        "reason": reason,
        "detail": detail,
    }


def write_refused_facts(store: MemoryStore, entries: list[dict[str, Any]]) -> None:
    """Append ``entries`` to :func:`refused_facts_path` as whole lines written together
    (``O_APPEND``: lines of concurrent writers do not interleave), stamped ``logged_at``
    (wall clock, hours since the epoch), then fsync."""
    path = refused_facts_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    now = hours_now()
    data = "".join(json.dumps({**e, "logged_at": now}) + "\n" for e in entries).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fact_id(turn_id: str, k: int, text: str, taken: set[str]) -> str:
    """The id of fact ``k`` of a turn: a hash of the turn, the position and the text, salted
    until no stored record (live or not) nor an earlier fact of the batch holds it, so a
    turn ingested again never collides with what its first ingest stored."""
    salt = 0
    while True:
        key = f"{turn_id}\n{k}\n{text}" + (f"\n{salt}" if salt else "")
        fid = "f-" + hashlib.sha256(key.encode()).hexdigest()[:24]
        if fid not in taken:
            taken.add(fid)
            return fid
        salt += 1


def ingest(
    store: MemoryStore,
    turns: Sequence[Turn],
    backend: LLMBackend,
    embedder: Any,
    cfg: IngestConfig | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run the write path over ``turns`` into ``store`` (created from the first ADDs if it
    does not exist yet), in four phases: extract (one request per trusted turn, one retry,
    grounding), neighbours (embed the facts, top-s stored memories per fact in its
    namespace, the exact-duplicate and add-below prefilter), decide (one request per turn
    for its undecided facts, a retry for an unusable or malformed answer) and apply (in
    order, the first decision touching a memory wins; writes the new rows, then the
    tombstones).

    Args:
        store: the target store.
        turns: in the order they happened.
        backend: any :class:`~consolidate.llm.base.LLMBackend`.
        embedder: object with ``encode(texts) -> float32 [n, d]``.
        cfg: :class:`IngestConfig`.
        device: similarity device.

    Returns:
        Summary: counts per stage, decisions by op and by who decided, model calls, tokens,
        latency p50/p95 per stage (seconds), and ``events`` (every decision with the raw
        model answer) for the changelog.
    """
    run = _IngestRun(store, backend, embedder, cfg or IngestConfig(), device)
    run.extract(turns)
    run.neighbours()
    run.decide()
    run.apply()
    return run.summary(turns)


class _IngestRun:
    """One :func:`ingest` call: its phases as methods, sharing the events, the refused-facts
    entries and the model-call accounting."""

    def __init__(
        self, store: MemoryStore, backend: LLMBackend, embedder: Any, cfg: IngestConfig, device: str
    ) -> None:
        self.store, self.backend, self.embedder = store, backend, embedder
        self.cfg, self.device = cfg, device
        self.events: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []  # the refused-facts log (refused_facts_path)
        self.lat: dict[str, list[float]] = {"extract": [], "decide": []}
        self.tokens: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def chat(self, stage: str, reqs: list) -> list:
        """The backend's answers to ``reqs``, counted under ``stage``."""
        out = self.backend.chat(reqs) if reqs else []
        self.calls[stage] += len(out)
        for r in out:
            self.lat[stage].append(r.latency_s)
            self.tokens["prompt"] += r.prompt_tokens
            self.tokens["completion"] += r.completion_tokens
        return out

    # ---- extract: one request per turn, one retry
    def extract(self, turns: Sequence[Turn]) -> None:
        """The facts of the trusted turns (``self.items``: ``(turn, k, fact)``); untrusted
        turns, answers unusable twice and ungrounded facts are refused and logged."""
        cfg, events, refused = self.cfg, self.events, self.refused
        ok_turns = [t for t in turns if trusted(t, cfg.allow_untrusted)]
        for t in turns:
            if not trusted(t, cfg.allow_untrusted):
                events.append({"op": "skip_untrusted", "turn": t.id, "source": t.source})
                refused.append(_refusal(t, None, "untrusted_source", t.source))
        when = [datetime_from_hours(t.time_h).strftime("%d %B %Y") for t in ok_turns]
        raw = self.chat(
            "extract",
            [
                extract_request(t, w, cfg.extract_max_tokens)
                for t, w in zip(ok_turns, when, strict=True)
            ],
        )
        facts = [parse_facts(r.text) for r in raw]
        bad = [k for k, f in enumerate(facts) if f is None]
        if bad:
            again = self.chat(
                "extract",
                [
                    extract_request(ok_turns[k], when[k], cfg.extract_max_tokens, retry=True)
                    for k in bad
                ],
            )
            for k, r in zip(bad, again, strict=True):
                facts[k] = parse_facts(r.text)
                if facts[k] is None:
                    events.append(
                        {
                            "op": "extract_failed",
                            "turn": ok_turns[k].id,
                            "raw": [raw[k].text, r.text],
                        }
                    )
                    refused.append(
                        _refusal(ok_turns[k], None, "extract_failed", "no valid answer, twice")
                    )
        self.ok_turns = ok_turns
        self.items: list[tuple[Turn, int, Any]] = []
        for t, w, fs in zip(ok_turns, when, facts, strict=True):
            for k, f in enumerate(fs or []):  # one step per extracted fact
                why = ungrounded(f.text, t, w) if cfg.require_grounding else []
                if why:
                    events.append(
                        {"op": "ungrounded_fact", "turn": t.id, "fact": f.text, "added": why}
                    )
                    refused.append(_refusal(t, f.text, "ungrounded", ", ".join(why)))
                else:
                    self.items.append((t, k, f))

    # ---- embed and find neighbours
    def neighbours(self) -> None:
        """Embed the facts (``self.vecs``), their top-s live neighbours in their namespace
        (``self.top``) and the prefilter's decisions (``self.pre``)."""
        store, items, cfg = self.store, self.items, self.cfg
        if store.exists():
            snap = store.load()
            live = snap.records.mask(snap.records.live_mask())
            self.taken = set(snap.records.meta["id"])  # every stored id, tombstones included
        else:  # a new store: created from the first ADDs
            live = Records.empty(int(self.embedder.dim))
            self.taken = set()
        self.live, self.lm = live, live.meta
        lm = live.meta
        self.vecs = (
            self.embedder.encode([f.text for _, _, f in items])
            if items
            else np.zeros((0, live.dim), np.float32)
        )
        ns_names = sorted({t.namespace for t, _, _ in items} | set(lm["namespace"]))
        code = {n: c for c, n in enumerate(ns_names)}
        self.top = top = topk_neighbours(
            self.vecs,
            live.vectors,
            cfg.top_s,
            query_segments=np.array([code[t.namespace] for t, _, _ in items], dtype=np.int64),
            key_segments=np.array([code[n] for n in lm["namespace"]], dtype=np.int64),
            device=self.device,
        )
        # closed history does not count: "lives in Porto" again after a move is a new fact
        still_open = ~np.isfinite(lm["valid_to"].to_numpy(np.float64))
        stored_hashes = {
            (n, h)
            for n, h, o in zip(lm["namespace"], lm["text_hash"], still_open, strict=True)
            if o
        }
        self.open_by_hash = {
            (n, h): i
            for n, h, i, o in zip(
                lm["namespace"], lm["text_hash"], lm["id"], still_open, strict=True
            )
            if o
        }
        self.pre = prefilter(
            [f"{t.namespace}\x00{text_hash(f.text)}" for t, _, f in items],
            {f"{n}\x00{h}" for n, h in stored_hashes},
            [float(s[0]) if np.isfinite(s[0]) else -1.0 for s in top.scores],
            cfg.add_below,
        )

    # ---- decide: one request per turn for its undecided facts
    def decide(self) -> None:
        """A decision per fact (``self.decisions``): the prefilter's, else the model's, else
        ADD (an answer unparseable twice)."""
        items, lm, top, cfg = self.items, self.lm, self.top, self.cfg
        decisions: list[Decision | None] = list(self.pre)
        by_turn: dict[str, list[int]] = {}
        for n, (t, _, _) in enumerate(items):
            if decisions[n] is None:
                by_turn.setdefault(t.id, []).append(n)
        asks = []
        for tid, idx in by_turn.items():
            seen: dict[int, Neighbour] = {}
            for n in idx:
                for j in top.indices[n]:
                    if j >= 0 and j not in seen:
                        seen[j] = Neighbour(
                            len(seen) + 1,
                            lm["id"].iat[j],
                            lm["text"].iat[j],
                            bool(lm["pinned"].iat[j]),
                        )
            asks.append((tid, idx, list(seen.values())))
        answers = self.chat(
            "decide",
            [
                decide_request([items[n][2].text for n in idx], nb, cfg.decide_max_tokens)
                for _, idx, nb in asks
            ],
        )
        first = [
            parse_answer(a.text, len(idx), nb)
            for a, (_, idx, nb) in zip(answers, asks, strict=True)
        ]
        self.asks, self.raw_of = asks, {k: [answers[k].text] for k in range(len(asks))}
        parsed = self._retry_decide(first)
        for k, (_, idx, _) in enumerate(asks):
            ds = parsed[k] or [
                Decision(i, "ADD", source="fallback", note="unparseable twice")
                for i in range(len(idx))
            ]
            for d, n in zip(ds, idx, strict=True):
                decisions[n] = Decision(n, d.op, d.target_id, d.text, d.source, d.note)
        self.decisions = decisions

    def _retry_decide(self, first: list[Any]) -> list[Any]:
        """Ask again where an answer is not valid JSON or has a malformed action; the retry
        counts when it is usable and clean, or when the first answer was not usable at all,
        else the valid actions of the first answer apply. Returns the decisions per ask."""
        asks, items, cfg = self.asks, self.items, self.cfg
        parsed = [p.decisions for p in first]
        malformed: dict[int, tuple[str, ...]] = {}  # ask -> malformed actions of the answer used
        self.redo = redo = [k for k, p in enumerate(first) if p.decisions is None or p.malformed]
        retry = self.chat(
            "decide",
            [
                decide_request(
                    [items[n][2].text for n in asks[k][1]],
                    asks[k][2],
                    cfg.decide_max_tokens,
                    retry=True,
                )
                for k in redo
            ],
        )
        for k, r in zip(redo, retry, strict=True):
            again = parse_answer(r.text, len(asks[k][1]), asks[k][2])
            self.raw_of[k].append(r.text)
            if again.decisions is not None and (not again.malformed or parsed[k] is None):
                parsed[k] = again.decisions
                if again.malformed:
                    malformed[k] = again.malformed
            elif first[k].malformed:
                malformed[k] = first[k].malformed
        for k, (tid, _, _) in enumerate(asks):
            for m in malformed.get(k, ()):
                self.events.append(
                    {"op": "malformed_action", "turn": tid, "action": m, "raw": self.raw_of[k]}
                )
        return parsed

    # ---- apply, in order; the first decision touching a memory wins
    def apply(self) -> None:
        """Settle each decision against the batch and the stored memories, build the new
        rows and the tombstone patches, embed rewritten texts, then write: the new rows
        first (:meth:`MemoryStore.create` for a new store, else ``append``), then the
        patches, so a crash in between leaves both versions, never neither."""
        self.touched: set[str] = set()
        self.row_of = {i: k for k, i in enumerate(self.lm["id"])}  # targets -> stored rows
        self.new_rows: list[dict[str, Any]] = []
        self.patches: list[dict[str, Any]] = []
        self.upd_texts: list[int] = []
        self.row_fact: list[str] = []  # per new row, the text its vector was embedded from
        for n, (t, k, f) in enumerate(self.items):
            d = self._settle(n, t, f)
            ev = {
                "op": d.op,
                "turn": t.id,
                "fact": f.text,
                "by": d.source,
                "note": d.note,
                "target": d.target_id,
            }
            if (
                d.source == "model"
                or d.note == "unparseable twice"
                or d.note.startswith("malformed")
            ):
                key = next(i for i, (_, idx, _) in enumerate(self.asks) if n in idx)
                ev["raw"] = self.raw_of[key]
            self.events.append(ev)
            self._record(d, n, t, k, f, ev)
        self._write()

    def _settle(self, n: int, t: Turn, f: Any) -> Decision:
        """Decision ``n`` as it applies: an UPDATE or DELETE of a memory this batch changed
        already becomes ADD; a model's NOOP that negates or changes a number or date of its
        nearest memory becomes ADD; an ADD that opposes its nearest memory goes through the
        supersede guard; a NOOP names the memory that holds the fact."""
        d = self.decisions[n]
        assert d is not None
        lm, top = self.lm, self.top
        if d.op in ("UPDATE", "DELETE") and d.target_id in self.touched:
            d = Decision(
                n,
                "ADD",
                source="fallback",
                note=f"{d.op} of {d.target_id} already changed in this batch",
            )
        j = int(top.indices[n][0])
        if d.op == "NOOP" and d.source == "model":
            # "already known" must not swallow a fact that negates or changes a number or
            # date of the memory it resembles most: that one is stored (the nightly pass's
            # conflict guard then lists the pair for review)
            why = conflict_reason(f.text, lm["text"].iat[j]) if j >= 0 else None
            if why:
                d = Decision(
                    n,
                    "ADD",
                    source="fallback",
                    note=f"NOOP rejected: {why} against {lm['id'].iat[j]}",
                )
        if d.op == "ADD" and j >= 0:
            d, kept = _supersede_guard(
                d,
                n,
                f.text,
                t.time_h,
                lm,
                j,
                float(top.scores[n][0]),
                self.touched,
                self.cfg.supersede_above,
            )
            if kept:
                self.events.append(_kept(t.id, f.text, lm["id"].iat[j], *kept))
        if d.op == "NOOP" and d.target_id is None:
            # NOOP names the memory that already holds the fact: the exact duplicate, else
            # the nearest stored memory
            same = self.open_by_hash.get((t.namespace, text_hash(f.text)))
            d = Decision(
                n, "NOOP", same or (lm["id"].iat[j] if j >= 0 else None), None, d.source, d.note
            )
        return d

    def _record(self, d: Decision, n: int, t: Turn, k: int, f: Any, ev: dict[str, Any]) -> None:
        """The new row and the patches of one settled decision (``ev``: its event, which
        gets what was closed, superseded and resolved)."""
        vf, why = _valid_from_hours(f.valid_from, t.time_h)
        if why:
            ev["valid_from_refused"] = why
        text, resolved, unresolved = resolve_relative_dates(f.text, t.time_h)
        if resolved:
            ev["dates_resolved"] = resolved
        if unresolved:
            ev["dates_unresolved"] = unresolved
        row = {
            "id": _fact_id(t.id, k, f.text, self.taken),
            "namespace": t.namespace,
            "text": text,
            "vector": self.vecs[n],
            "importance": f.importance / 10.0,
            "created_at": t.time_h,
            "last_used": t.time_h,
            "source_ids": [t.id],
            "valid_from": vf,
        }
        old = self.lm.iloc[self.row_of[d.target_id]] if d.op in ("UPDATE", "DELETE") else None
        old_vf = np.nan if old is None else float(old["valid_from"])
        if old is not None and not np.isfinite(vf):
            # a fact that replaces or contradicts a stored one became true by its turn
            row["valid_from"] = vf = t.time_h
        if np.isfinite(old_vf):  # a temporal fact: close it, keep it as history
            self.touched.add(d.target_id)
            ends = vf if np.isfinite(vf) and vf > old_vf else t.time_h
            self.patches.append(
                {"id": d.target_id, "op": "close", "valid_to": max(ends, old_vf), "at": t.time_h}
            )
            ev["closed"] = d.target_id
            if d.op == "UPDATE":
                row.update(text=resolve_relative_dates(d.text, t.time_h)[0])
                self.upd_texts.append(len(self.new_rows))
            self._add(row, f.text)  # the new fact (an UPDATE's text, or a DELETE's fact)
            ev["closed_by"] = row["id"]
        elif d.op == "ADD":
            self._add(row, f.text)
        elif d.op == "UPDATE":
            assert old is not None
            self.touched.add(d.target_id)
            row.update(
                text=resolve_relative_dates(d.text, t.time_h)[0],
                importance=max(row["importance"], float(old["importance"])),
                source_ids=sorted(set(old["source_ids"]) | {t.id}),
            )
            self.upd_texts.append(len(self.new_rows))
            self._add(row, f.text)
            self.patches.append(
                {"id": d.target_id, "op": "delete", "into": row["id"], "at": t.time_h}
            )
        elif d.op == "DELETE":  # a contradiction: the new fact supersedes the old one
            self.touched.add(d.target_id)
            self._add(row, f.text)
            self.patches.append(
                {
                    "id": d.target_id,
                    "op": "delete",
                    "into": row["id"],
                    "reason": "superseded",
                    "at": t.time_h,
                }
            )
            ev["superseded"] = d.target_id

    def _add(self, row: dict[str, Any], fact: str) -> None:
        self.new_rows.append(row)
        self.row_fact.append(fact)

    def _write(self) -> None:
        """Re-embed rows whose text is not the fact's (an UPDATE's text, resolved dates),
        write the rows, then the patches, then the refused-facts log."""
        store, new_rows = self.store, self.new_rows
        # a row's vector is the embedding of its own text
        upd = sorted(
            set(self.upd_texts)
            | {
                i
                for i, (r, e) in enumerate(zip(new_rows, self.row_fact, strict=True))
                if r["text"] != e
            }
        )
        if upd:
            v = self.embedder.encode([new_rows[i]["text"] for i in upd])
            for i, vec in zip(upd, v, strict=True):
                new_rows[i]["vector"] = vec
        if new_rows and not store.exists():
            recs = records_from_rows(new_rows, dim=self.live.dim)
            normalise_vectors(recs)
            store.create(recs, source="ingest")
            self.written = [r["id"] for r in new_rows]
        else:
            self.written = store.append(new_rows) if new_rows else []
        if self.patches:
            store.patch(self.patches)  # each patch carries the time of its own turn
        self.logged = bool(self.refused) and store.exists()  # only create makes the folder

    def _accounting(self) -> dict[str, Any]:
        """Every extracted fact is added, updated, superseding, a NOOP or refused (checked)."""
        applied = [e for e in self.events if e["op"] in ("ADD", "UPDATE", "DELETE", "NOOP")]
        refused = self.refused
        n_refused_facts = sum(r["fact"] is not None for r in refused)
        accounting = {
            "extracted": len(self.items) + n_refused_facts,
            "added": sum(e["op"] == "ADD" and "closed" not in e for e in applied),
            "updated": sum(e["op"] == "UPDATE" for e in applied),
            "superseding": sum(e["op"] == "DELETE" for e in applied)
            + sum(e["op"] == "ADD" and "closed" in e for e in applied),
            "noop": sum(e["op"] == "NOOP" for e in applied),
            "refused": n_refused_facts,
            "refused_by_reason": dict(
                Counter(r["reason"] for r in refused if r["fact"] is not None)
            ),
            "turns_refused": dict(Counter(r["reason"] for r in refused if r["fact"] is None)),
        }
        assert accounting["extracted"] == sum(
            accounting[k] for k in ("added", "updated", "superseding", "noop", "refused")
        ), accounting
        return accounting

    def summary(self, turns: Sequence[Turn]) -> dict[str, Any]:
        """The returned summary (see :func:`ingest`); writes the refused-facts log."""
        events, refused = self.events, self.refused
        accounting = self._accounting()
        if self.logged:
            write_refused_facts(self.store, refused)
        applied = [e for e in events if e["op"] in ("ADD", "UPDATE", "DELETE", "NOOP")]
        ops = Counter(e["op"] for e in applied)
        by = Counter(e["by"] for e in events if "by" in e)

        def pct(x: list[float], q: float) -> float | None:
            return float(np.percentile(x, q)) if x else None

        return {
            "turns": len(turns),
            "trusted_turns": len(self.ok_turns),
            "skipped_untrusted": len(turns) - len(self.ok_turns),
            "extract_failed": sum(e["op"] == "extract_failed" for e in events),
            "ungrounded_facts": sum(e["op"] == "ungrounded_fact" for e in events),
            "malformed_actions": sum(e["op"] == "malformed_action" for e in events),
            "decide_retries": len(self.redo),
            "refused_facts": len(refused),
            "refused_facts_log": str(refused_facts_path(self.store)) if self.logged else None,
            "refused": refused,
            "facts": len(self.items),
            "accounting": accounting,
            "contradictions_kept": sum(e["op"] == "contradiction_kept" for e in events),
            "valid_from_unresolved": sum("valid_from_refused" in e for e in applied),
            "dates_unresolved": sum(len(e.get("dates_unresolved", ())) for e in applied),
            "decisions": dict(ops),
            "decided_by": dict(by),
            "records_written": len(self.written),
            "tombstoned": len(self.patches),
            "model_calls": dict(self.calls),
            "prompt_tokens": self.tokens["prompt"],
            "completion_tokens": self.tokens["completion"],
            "latency_s": {s: {"p50": pct(v, 50), "p95": pct(v, 95)} for s, v in self.lat.items()},
            "events": events,
        }


def _kept(turn: str, fact: str, target: str, why: str, because: str) -> dict[str, Any]:
    return {
        "op": "contradiction_kept",
        "turn": turn,
        "fact_text": fact,
        "target": target,
        "reason": why,
        "because": because,
    }


def _supersede_guard(
    d: Decision,
    n: int,
    text: str,
    turn_h: float,
    lm: pd.DataFrame,
    j: int,
    score: float,
    touched: set[str],
    above: float | None,
) -> tuple[Decision, tuple[str, str] | None]:
    """The ADD ``d`` of fact ``n`` turned into a DELETE of stored row ``j`` (cosine
    ``score``) when ``text`` negates or opposes it at ``above`` or more (see
    :attr:`IngestConfig.supersede_above`). Returns the decision and, for a pair that stays
    apart although it conflicts, ``(reason, because)`` for a ``contradiction_kept`` event."""
    if above is not None and score < above:
        return d, None
    why = conflict_reason(text, lm["text"].iat[j])
    if why not in ("negation", "opposite"):
        return d, None
    tid = lm["id"].iat[j]
    because = (
        "supersede_above is null"
        if above is None
        else "the memory is pinned"
        if bool(lm["pinned"].iat[j])
        else "the memory was already changed in this batch"
        if tid in touched
        else "the memory is newer than the fact's turn"
        if float(lm["created_at"].iat[j]) > turn_h
        else None
    )
    if because:
        return d, (why, because)
    note = f"{d.source} ADD overridden: {why} of {tid} at cosine {score:.3f}, supersedes it"
    if d.note:
        note = f"{d.note}; {note}"
    return Decision(n, "DELETE", tid, None, source="guard", note=note), None


_DAY = "(?:" + "|".join(WEEKDAYS) + ")"
_SMALL_N = "|".join(SMALL_CARDINALS)
_N = r"(?<![\d.,])(?:\d{1,4}|a|an|" + _SMALL_N + ")"
_REL_IN_TEXT = re.compile(
    r"\b(the day before yesterday|today|tonight|this morning|this afternoon|this evening"
    r"|yesterday|last night|last (?:week|month|year|" + _DAY + r")"
    r"|" + _N + r" (?:hour|day|week|month|year)s? ago)\b(?!['\u2019]s\b)",
    re.IGNORECASE,
)
_REL_VAGUE = re.compile(
    r"\b(recently|the other (?:day|week)|a while ago|some time ago|soon|lately|tomorrow"
    r"|(?:a few|several|a couple of|some) (?:hours|days|weeks|months|years) ago"
    r"|earlier this (?:week|month|year)|next (?:week|month|year|weekend|" + _DAY + r")"
    r"|last weekend|this (?:week|month|year|weekend))\b",
    re.IGNORECASE,
)


def resolve_relative_dates(text: str, turn_h: float) -> tuple[str, list[str], list[str]]:
    """Relative dates in a fact's text resolved against its turn's time.

    ``"Went hiking yesterday"`` from a turn on 10 May 2023 becomes ``"Went hiking yesterday
    (9 May 2023)"``: a memory read months later still says when. Resolved (UTC): today,
    tonight, this morning/afternoon/evening, yesterday, last night, the day before
    yesterday, last <weekday> (the latest such day before the turn's day), ``N hours/days
    ago`` (named by date), last week and ``N weeks ago`` (by their Monday), last month and
    ``N months ago`` (by calendar month), last year and ``N years ago`` (by calendar year).
    Vague ones (recently, the other day, a few days ago, tomorrow, next week, this month...)
    and ones that fall outside the years 1-9999 cannot be resolved and are returned so the
    caller flags them.

    Args:
        text: the fact (``str``).
        turn_h: the turn's time, hours since the epoch (UTC); not finite: nothing is
            resolved and every relative phrase is returned as unresolved.

    Returns:
        ``(text with each resolved phrase followed by its date in brackets, the resolved
        phrases as "phrase -> date", the unresolved phrases)``. A phrase already followed by
        its own bracketed date is left as it is.
    """
    resolved: list[str] = []
    unresolved: list[str] = []

    def fill(m: re.Match) -> str:
        phrase = m.group(1)
        label = _date_label(phrase.lower(), turn_h)
        if label is None:
            unresolved.append(phrase)
            return phrase
        if text[m.end() :].startswith(f" ({label})"):
            return phrase
        resolved.append(f"{phrase} -> {label}")
        return f"{phrase} ({label})"

    out = _REL_IN_TEXT.sub(fill, text) if _REL_IN_TEXT.search(text) else text
    unresolved += [m.group(1) for m in _REL_VAGUE.finditer(text)]
    return out, resolved, unresolved


_WEEKDAY_NO = {d: k for k, d in enumerate(WEEKDAYS)}


def _date_label(phrase: str, turn_h: float) -> str | None:
    """The date ``phrase`` names, as written after it, or ``None`` when it cannot be told."""
    import datetime as dt

    if not math.isfinite(turn_h):
        return None
    try:
        now = dt.datetime(1970, 1, 1) + dt.timedelta(hours=turn_h)
    except OverflowError:
        return None
    day = now.date()
    words = phrase.split()
    n = 1
    if words[-1] == "ago":
        n = _WORD_N.get(words[0]) or int(words[0])
    unit = words[-2].rstrip("s") if words[-1] == "ago" else words[-1]
    try:
        if phrase in ("today", "tonight", "this morning", "this afternoon", "this evening"):
            return _day_label(day)
        if phrase in ("yesterday", "last night"):
            return _day_label(day - dt.timedelta(days=1))
        if phrase == "the day before yesterday":
            return _day_label(day - dt.timedelta(days=2))
        if words[0] == "last" and words[1] in _WEEKDAY_NO:
            back = (day.weekday() - _WEEKDAY_NO[words[1]]) % 7 or 7
            return _day_label(day - dt.timedelta(days=back))
        if unit == "hour":
            return _day_label((now - dt.timedelta(hours=n)).date())
        if unit == "day":
            return _day_label(day - dt.timedelta(days=n))
        if unit == "week":
            monday = day - dt.timedelta(days=7 * n + day.weekday())
            return f"week of {_day_label(monday)}"
        if unit == "month":
            k = day.year * 12 + day.month - 1 - n
            return dt.date(k // 12, k % 12 + 1, 1).strftime("%B %Y")
        if unit == "year":
            return str(dt.date(day.year - n, 1, 1).year)
    except (ValueError, OverflowError):  # before the year 1
        return None
    return None


def _day_label(d: Any) -> str:
    return f"{d.day} {d:%B %Y}"


def _valid_from_hours(text: str | None, turn_h: float) -> tuple[float, str | None]:
    """A fact's stated start in hours since the epoch, and why it was not used.

    Understood: year-first dates and times (``"2023-05"``, ``"2023-05-08"``,
    ``"2023-05-08T10:00"``, with seconds, fractions and a ``Z`` or ``+01:00`` offset; a time
    without an offset is UTC), and dates relative to the turn that states them (``"today"``,
    ``"yesterday"``, ``"N days/weeks/months/years ago"``, ``"last week/month/year"``,
    resolved against ``turn_h``). Returns ``(NaN, reason)`` when the text is absent
    (reason ``None``), not understood (``"05/08/2023"`` is ambiguous), outside the years
    1900-2200, or after the turn that states it: a bad date never fails the batch, the fact
    just has no start, and the caller records the reason in the event.
    """
    if not text or not text.strip():
        return float("nan"), None
    t = text.strip()
    rel = _relative_hours(t.lower(), turn_h)
    if rel is not None:
        return rel, None
    if not _ISO_START.match(t):
        return float("nan"), f"valid_from {text!r} not understood (year-first dates only)"
    try:
        ts = pd.Timestamp(t)
    except (ValueError, TypeError, OverflowError):
        return float("nan"), f"valid_from {text!r} not understood"
    if pd.isna(ts) or not 1900 <= ts.year <= 2200:
        return float("nan"), f"valid_from {text!r} outside the years 1900-2200"
    h = hours_from_datetime(ts)
    if not (np.isfinite(h) and h <= turn_h):
        return float("nan"), f"valid_from {text!r} is after the turn that states it"
    return h, None


_ISO_START = re.compile(
    r"^\d{4}(-\d{1,2}(-\d{1,2})?)?"
    r"([T ]\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?$"
)
_UNIT_H = {"day": 24.0, "week": 168.0, "month": 730.5, "year": 8766.0}
_AGO = re.compile(r"^(\d{1,4}|a|an|" + _SMALL_N + r") (day|week|month|year)s? ago$")
_WORD_N = {"a": 1, "an": 1} | {w: NUMBER_WORDS[w] for w in SMALL_CARDINALS}


def _relative_hours(t: str, turn_h: float) -> float | None:
    """``t`` (lower case) as a time relative to the turn (hours since the epoch), or
    ``None`` when it is not one of the relative forms :func:`_valid_from_hours` names. A day
    resolves to the start of its UTC day; months and years are their mean lengths."""
    day0 = math.floor(turn_h / 24.0) * 24.0
    if t == "today":
        return day0
    if t == "yesterday":
        return day0 - 24.0
    m = re.match(r"^last (week|month|year)$", t)
    if m:
        return day0 - _UNIT_H[m.group(1)]
    m = _AGO.match(t)
    if m:
        n = _WORD_N.get(m.group(1))
        return day0 - (int(m.group(1)) if n is None else n) * _UNIT_H[m.group(2)]
    return None

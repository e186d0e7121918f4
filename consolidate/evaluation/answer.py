"""Answering with retrieved memories and judging the answers (needs an LLM backend).

Scores per answered question: LOCOMO's official F1 (category rules), Mem0-style F1 and
BLEU-1 against the gold answer, and an LLM judge asked ``repeats`` times (sampled, seeds
0..repeats-1) whether the answer matches the gold one.

The judge answers JSON from a closed set, ``{"verdict": "CORRECT"}`` or ``{"verdict":
"WRONG"}`` (the request carries the schema, so backends that constrain decoding enforce it).
Any other answer is an invalid verdict: never counted as correct, never as wrong. A
question's judge score is the share of CORRECT among its valid verdicts; the judge score is
the mean over the questions with at least one valid verdict, with a bootstrap 95% interval
over those questions, and the invalid rate and the number of questions scored are reported
beside it.

Leniency control: for each answered question the judge also sees a deliberately wrong but
on-topic answer (the gold answer of another question of the same conversation, preferring
the same category); the share it accepts is reported next to the judge score. A judge that
accepts many wrong answers makes its own score meaningless.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel

from ..llm.base import ChatRequest, LLMBackend
from .metrics import bleu1, locomo_f1, mem0_f1

__all__ = [
    "PROMPT_VERSION",
    "Verdict",
    "answer_requests",
    "judge_requests",
    "parse_verdict",
    "bootstrap_ci",
    "wrong_answers",
    "AnswerScores",
    "score_answers",
]

PROMPT_VERSION = "answer-v1/judge-v2"
ABSTAIN = "No information available."

_ANSWER_SYSTEM = (
    "You answer questions about a user's past conversations using only the "
    "memories given. Answer with a short phrase. If the memories do not contain "
    f"the answer, reply exactly: {ABSTAIN}"
)
_JUDGE_SYSTEM = (
    'You grade answers. Reply with JSON only: {"verdict": "CORRECT"} if the '
    "answer means the same as the gold answer (wording may differ), otherwise "
    '{"verdict": "WRONG"}.'
)


class Verdict(BaseModel):
    """The judge's answer: a label from a closed set."""

    verdict: Literal["CORRECT", "WRONG"]


def answer_requests(
    questions: Sequence[str], contexts: Sequence[Sequence[str]], max_tokens: int = 32
) -> list[ChatRequest]:
    """One greedy request per question with its retrieved memories as a numbered list."""
    out = []
    for q, ctx in zip(questions, contexts, strict=True):
        mem = "\n".join(f"{k + 1}. {t}" for k, t in enumerate(ctx)) or "(none)"
        out.append(
            ChatRequest(
                (
                    {"role": "system", "content": _ANSWER_SYSTEM},
                    {"role": "user", "content": f"Memories:\n{mem}\n\nQuestion: {q}\nAnswer:"},
                ),
                max_tokens=max_tokens,
            )
        )
    return out


def judge_requests(
    question: str, gold: str, answer: str, repeats: int, temperature: float
) -> list[ChatRequest]:
    """``repeats`` judge requests (seeds 0..repeats-1) for one answer, each carrying the
    :class:`Verdict` JSON schema. The texts enter the prompt as JSON string literals."""
    msg = (
        f"Question: {json.dumps(question, ensure_ascii=False)}\n"
        f"Gold answer: {json.dumps(gold, ensure_ascii=False)}\n"
        f"Answer to grade: {json.dumps(answer, ensure_ascii=False)}\nVerdict as JSON:"
    )
    return [
        ChatRequest(
            ({"role": "system", "content": _JUDGE_SYSTEM}, {"role": "user", "content": msg}),
            max_tokens=16,
            temperature=temperature,
            seed=s,
            json_schema=Verdict.model_json_schema(),
        )
        for s in range(repeats)
    ]


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise ValueError(f"duplicate keys {keys}")
    return dict(pairs)


def parse_verdict(text: Any) -> int | None:
    """1 for ``{"verdict": "CORRECT"}``, 0 for ``{"verdict": "WRONG"}``, ``None`` (invalid)
    for anything else: the answer, stripped of surrounding whitespace and of one Markdown
    code fence (```` ``` ```` or ```` ```json ````), must be exactly one JSON object with the
    one key ``verdict`` (not repeated) and a label of the closed set (upper case). Bare words
    ("CORRECT", "not correct"), partial credit, extra or repeated keys, text around the
    object, and anything that is not a ``str`` are invalid.
    """
    if not isinstance(text, str):
        return None
    t = text.strip()
    if t.startswith("```") and t.endswith("```") and len(t) >= 6:
        t = t[3:-3]
        if t.startswith("json"):
            t = t[4:]
        t = t.strip()
    if not (t.startswith("{") and t.endswith("}")) or len(t) > 10_000:
        return None
    try:
        obj = json.loads(t, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or set(obj) != {"verdict"}:
        return None
    v = obj["verdict"]
    return 1 if v == "CORRECT" else 0 if v == "WRONG" else None


def bootstrap_ci(
    values: Sequence[float], n: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (resampling the values with replacement)."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0:
        return (float("nan"), float("nan"))
    g = np.random.default_rng(seed)
    means = v[g.integers(0, len(v), size=(n, len(v)))].mean(1)
    a = (1 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def _score_cat(row: pd.Series) -> int:
    """LOCOMO category code whose scoring rule applies (``score_category`` if present)."""
    return int(row["score_category"]) if "score_category" in row else int(row["category"])


def gold_of(row: pd.Series) -> str:
    """Gold text for scoring: LOCOMO category 5 (adversarial) expects an abstention."""
    return ABSTAIN if _score_cat(row) == 5 else str(row["answer"])


def wrong_answers(sample: pd.DataFrame, pool: pd.DataFrame, seed: int = 0) -> list[str]:
    """A wrong but on-topic answer per sampled question: the gold answer of another
    question in the same group (same category if possible; any group if the group has no
    other question), deterministic by ``seed``."""
    g = np.random.default_rng(seed)
    out = []
    for _, q in sample.iterrows():
        other = pool[
            (pool["qid"] != q["qid"])
            & (pool["answer"].astype(str) != str(q["answer"]))
            & (pool["answer"].astype(str).str.len() > 0)
        ]
        cand = other[other["group"] == q["group"]]
        if not len(cand):  # one question per group (LongMemEval): any other question's answer
            cand = other
        same = cand[cand["category"] == q["category"]]
        pick = same if len(same) else cand
        out.append(str(pick["answer"].iloc[int(g.integers(len(pick)))]) if len(pick) else "")
    return out


@dataclass
class AnswerScores:
    """Per-question table and the aggregate numbers."""

    table: pd.DataFrame
    summary: dict[str, float]


def _valid_mean(vs: list[int | None]) -> float:
    """Mean of the valid verdicts (``None`` left out); NaN when none is valid."""
    ok = [v for v in vs if v is not None]
    return float(np.mean(ok)) if ok else float("nan")


def score_answers(
    backend: LLMBackend,
    sample: pd.DataFrame,
    contexts: list[list[str]],
    pool: pd.DataFrame,
    *,
    repeats: int = 3,
    temperature: float = 0.7,
    max_tokens: int = 32,
    bootstrap: int = 1000,
    seed: int = 0,
    judge: LLMBackend | None = None,
) -> AnswerScores:
    """Answer every sampled question from its context with ``backend``, score, judge with
    ``judge`` (default: ``backend``), and run the leniency control.

    Returns:
        The per-question table (``judge`` NaN for a question without a valid verdict) and
        the summary: means, ``judge`` over the questions with a valid verdict
        (``judge_questions`` of them) with its bootstrap CI, ``judge_invalid_rate`` (share of
        all verdicts), the leniency control, tokens and latency.
    """
    judge = backend if judge is None else judge
    ans = backend.chat(answer_requests(sample["question"].tolist(), contexts, max_tokens))
    wrong = wrong_answers(sample, pool, seed)
    reqs: list[ChatRequest] = []
    for (_, q), a, w in zip(sample.iterrows(), ans, wrong, strict=True):
        reqs += judge_requests(q["question"], gold_of(q), a.text, repeats, temperature)
        reqs += judge_requests(q["question"], gold_of(q), w, repeats, temperature)
    verdicts = judge.chat(reqs)
    rows = []
    for n, ((_, q), a) in enumerate(zip(sample.iterrows(), ans, strict=True)):
        vs = verdicts[n * 2 * repeats : (n + 1) * 2 * repeats]
        real = [parse_verdict(v.text) for v in vs[:repeats]]
        ctrl = [parse_verdict(v.text) for v in vs[repeats:]]
        cat = _score_cat(q)
        gold = str(q["answer"])
        rows.append(
            {
                "qid": q["qid"],
                "category": int(q["category"]),
                "answer": a.text,
                "gold": gold_of(q),
                "locomo_f1": locomo_f1(a.text, gold, cat),
                "mem0_f1": mem0_f1(a.text, gold) if cat != 5 else np.nan,
                "bleu1": bleu1(a.text, gold) if cat != 5 else np.nan,
                "judge": _valid_mean(real),
                "judge_invalid": int(sum(v is None for v in real)),
                "judge_verdicts": [v.text for v in vs[:repeats]],
                "wrong_answer": wrong[n],
                "judge_accepts_wrong": _valid_mean(ctrl) if wrong[n] else np.nan,
                "control_invalid": int(sum(v is None for v in ctrl)) if wrong[n] else 0,
                "prompt_tokens": a.prompt_tokens,
                "completion_tokens": a.completion_tokens,
            }
        )
    t = pd.DataFrame(rows)
    scored = t["judge"].dropna()
    lo, hi = bootstrap_ci(scored, bootstrap, seed)
    calls = len(ans) + len(verdicts)
    summary = {
        "locomo_f1": float(t["locomo_f1"].mean()),
        "mem0_f1": float(t["mem0_f1"].mean()),
        "bleu1": float(t["bleu1"].mean()),
        "judge": float(scored.mean()) if len(scored) else float("nan"),
        "judge_ci_low": lo,
        "judge_ci_high": hi,
        "judge_questions": int(len(scored)),
        "judge_invalid_rate": float(t["judge_invalid"].sum() / max(len(t) * repeats, 1)),
        "judge_wrong_answer_acceptance": float(t["judge_accepts_wrong"].mean()),
        "model_calls": calls,
        "prompt_tokens": int(sum(x.prompt_tokens for x in ans + verdicts)),
        "completion_tokens": int(sum(x.completion_tokens for x in ans + verdicts)),
        "latency_p50_s": float(np.percentile([x.latency_s for x in ans], 50)),
        "latency_p95_s": float(np.percentile([x.latency_s for x in ans], 95)),
    }
    return AnswerScores(t, summary)

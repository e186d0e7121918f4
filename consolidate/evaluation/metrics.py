"""Answer and retrieval metrics.

* LOCOMO's official QA scoring (Maharana et al., ACL 2024; rules as in the benchmark's
  ``task_eval/evaluation.py``, re-implemented here): lower-case, drop commas and punctuation,
  drop the words ``a``, ``an``, ``the``, ``and``, Porter-stem, token F1. Per category:
  1 (multi-hop) splits prediction and gold on commas and averages, over the gold parts, the
  best F1 against any predicted part; 3 (open-domain) scores only the gold text before the
  first ``;``; 5 (adversarial) scores 1 if the prediction says "no information available" or
  "not mentioned", else 0; 2 and 4 use plain token F1.
* Mem0-style F1 and BLEU-1 (Chhikara et al., 2025, "Mem0: Building Production-Ready AI
  Agents with Scalable Long-Term Memory"): lower-cased word tokens without stemming.
* Evidence recall: the share of a question's evidence dia_ids covered by the ``source_ids``
  of the retrieved memories.
"""

from __future__ import annotations

import functools
import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

__all__ = [
    "LOCOMO_CATEGORY",
    "MEM0_CATEGORY",
    "category_label",
    "locomo_normalise",
    "token_f1",
    "locomo_f1",
    "mem0_f1",
    "bleu1",
    "evidence_recall",
]

#: LOCOMO's own category codes (its evaluation code and paper).
LOCOMO_CATEGORY = {
    1: "multi-hop",
    2: "temporal",
    3: "open-domain",
    4: "single-hop",
    5: "adversarial",
}
#: The names Mem0's paper and evaluation use for the same integer codes.
MEM0_CATEGORY = {1: "single-hop", 2: "temporal", 3: "multi-hop", 4: "open-domain", 5: "adversarial"}

_PUNCT = str.maketrans("", "", string.punctuation)
_DROP = re.compile(r"\b(a|an|the|and)\b")
_ABSTAIN = ("no information available", "not mentioned")


def category_label(cat: int) -> str:
    """``"<code> <LOCOMO name> / <Mem0 name>"``, e.g. ``"1 multi-hop / single-hop"``."""
    return f"{cat} {LOCOMO_CATEGORY.get(cat, '?')} / {MEM0_CATEGORY.get(cat, '?')}"


def locomo_normalise(s: str) -> str:
    """LOCOMO normalisation: no commas, lower case, no punctuation, no a/an/the/and."""
    s = str(s).replace(",", "").lower().translate(_PUNCT)
    return " ".join(_DROP.sub(" ", s).split())


def token_f1(pred: Sequence[str], gold: Sequence[str]) -> float:
    """Token-multiset F1 of two token lists (0 when either is empty or nothing overlaps)."""
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


@functools.cache
def _porter():  # noqa: ANN202 - nltk's PorterStemmer, imported on first use (a second)
    from nltk.stem import PorterStemmer

    return PorterStemmer()


def _stemmed(s: str) -> list[str]:
    stem = _porter().stem
    return [stem(w) for w in locomo_normalise(s).split()]


def locomo_f1(prediction: str, answer: str, category: int) -> float:
    """LOCOMO's official per-category score in [0, 1] (see the module docstring).

    Args:
        prediction: the model's answer.
        answer: the gold answer (ignored for category 5).
        category: 1..5 (LOCOMO codes).

    Raises:
        ValueError: unknown category.
    """
    prediction = str(prediction)
    if category == 5:
        low = prediction.lower()
        return 1.0 if any(a in low for a in _ABSTAIN) else 0.0
    answer = str(answer)
    if category == 3:
        answer = answer.split(";")[0].strip()
    if category in (2, 3, 4):
        return token_f1(_stemmed(prediction), _stemmed(answer))
    if category == 1:
        preds = [p.strip() for p in prediction.split(",")]
        golds = [g.strip() for g in answer.split(",")]
        return sum(max(token_f1(_stemmed(p), _stemmed(g)) for p in preds) for g in golds) / len(
            golds
        )
    raise ValueError(f"unknown LOCOMO category {category!r}")


_WORD = re.compile(r"\w+")


def _words(s: str) -> list[str]:
    return _WORD.findall(str(s).lower())


def mem0_f1(prediction: str, answer: str) -> float:
    """Mem0-style token F1: lower-cased word tokens, no stemming, no stop-word removal."""
    return token_f1(_words(prediction), _words(answer))


def bleu1(prediction: str, answer: str) -> float:
    """Sentence BLEU-1: clipped unigram precision times the brevity penalty
    (Papineni et al., 2002), on lower-cased word tokens; 0 for an empty prediction."""
    p, g = _words(prediction), _words(answer)
    if not p or not g:
        return 0.0
    clipped = sum((Counter(p) & Counter(g)).values())
    bp = 1.0 if len(p) > len(g) else math.exp(1 - len(g) / len(p))
    return bp * clipped / len(p)


def evidence_recall(evidence: Iterable[str], retrieved_sources: Iterable[Iterable[str]]) -> float:
    """Share of ``evidence`` dia_ids covered by the union of the retrieved memories'
    ``source_ids``; ``nan`` when the question has no evidence."""
    ev = set(evidence)
    if not ev:
        return float("nan")
    got: set[str] = set()
    for s in retrieved_sources:
        got.update(s)
    return len(ev & got) / len(ev)

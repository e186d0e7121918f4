"""Threshold calibration on labelled pairs: PR curve, AP, best-F1 threshold, threshold at a
target precision, all from one sorted pass (as MTEB's pair classification does).

Definitions (ties: pairs with equal score are admitted together, so each point of the curve
is a real threshold):

* at threshold t: TP(t) = positives with score >= t, FP(t) likewise; precision = TP / (TP+FP),
  recall = TP / P.
* average precision: sum over thresholds of (R_k - R_{k-1}) * P_k (step-wise, the
  definition scikit-learn's ``average_precision_score`` uses).
* best F1: max over thresholds of 2PR / (P + R); its threshold is the score at that point.
* threshold at precision p: the lowest threshold whose precision is >= p (most recall).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PRCurve", "pr_curve"]


@dataclass
class PRCurve:
    """Precision-recall curve over distinct thresholds, descending.

    Attributes:
        thresholds, precision, recall, f1: ``float64 [m]``.
        average_precision: step-wise AP.
        best_f1, best_f1_threshold: the best F1 and the threshold that gives it.
        positives, n: counts.
    """

    thresholds: np.ndarray
    precision: np.ndarray
    recall: np.ndarray
    f1: np.ndarray
    average_precision: float
    best_f1: float
    best_f1_threshold: float
    positives: int
    n: int

    def threshold_at_precision(self, target: float) -> float | None:
        """Lowest threshold with precision >= ``target`` (``None`` if never reached)."""
        ok = np.flatnonzero(self.precision >= target)
        return float(self.thresholds[ok[-1]]) if len(ok) else None

    def recall_at_threshold(self, t: float) -> float:
        k = np.searchsorted(-self.thresholds, -t, side="right") - 1
        return float(self.recall[k]) if k >= 0 else 0.0


def pr_curve(scores: np.ndarray, labels: np.ndarray) -> PRCurve:
    """One sorted pass over ``scores`` (``float [n]``) and binary ``labels`` (``[n]``).

    Raises:
        ValueError: no positive labels, or shapes differ.
    """
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels).astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"scores {s.shape} and labels {y.shape} differ")
    pos = int(y.sum())
    if pos == 0:
        raise ValueError("no positive pairs")
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    tp = np.cumsum(y)
    fp = np.cumsum(~y)
    last = np.r_[np.flatnonzero(np.diff(s) != 0), len(s) - 1]  # last index of each score
    tp, fp, th = tp[last].astype(np.float64), fp[last].astype(np.float64), s[last]
    precision = tp / (tp + fp)
    recall = tp / pos
    f1 = np.where(tp > 0, 2 * precision * recall / np.maximum(precision + recall, 1e-300), 0.0)
    ap = float(np.sum(np.diff(np.r_[0.0, recall]) * precision))
    b = int(np.argmax(f1))
    return PRCurve(th, precision, recall, f1, ap, float(f1[b]), float(th[b]), pos, len(s))


def load_calibration(path: str) -> dict:
    """Read ``calibration.json`` and return its recommendation:
    ``{"threshold", "dataset", "rule", "model", "dtype", "file"}``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file has no ``recommended.threshold`` in [-1, 1].
    """
    import json
    from pathlib import Path

    d = json.loads(Path(path).read_text())
    rec = d.get("recommended") or {}
    t = rec.get("threshold")
    if not isinstance(t, (int, float)) or not -1 <= t <= 1:
        raise ValueError(f"{path}: no recommended.threshold in [-1, 1] (got {t!r})")
    return {**rec, "threshold": float(t), "file": str(path)}

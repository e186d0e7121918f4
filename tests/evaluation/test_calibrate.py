"""PR curve, AP and thresholds against hand-computed values."""

import numpy as np
import pytest

from consolidate.evaluation.thresholds import pr_curve


def test_pr_curve_by_hand():
    scores = np.array([0.9, 0.8, 0.8, 0.7, 0.6, 0.5])
    labels = np.array([1, 1, 0, 1, 0, 0])
    c = pr_curve(scores, labels)
    np.testing.assert_allclose(c.thresholds, [0.9, 0.8, 0.7, 0.6, 0.5])
    np.testing.assert_allclose(c.precision, [1, 2 / 3, 3 / 4, 3 / 5, 3 / 6])
    np.testing.assert_allclose(c.recall, [1 / 3, 2 / 3, 1, 1, 1])
    # AP = 1/3*1 + 1/3*2/3 + 1/3*3/4
    assert c.average_precision == pytest.approx((1 + 2 / 3 + 3 / 4) / 3)
    # F1 at 0.7: P=.75, R=1 -> 6/7, the best
    assert c.best_f1 == pytest.approx(6 / 7) and c.best_f1_threshold == 0.7
    assert c.threshold_at_precision(0.7) == 0.7
    assert c.threshold_at_precision(1.0) == 0.9
    assert c.recall_at_threshold(0.75) == pytest.approx(2 / 3)
    assert c.positives == 3 and c.n == 6


def test_ap_matches_the_sklearn_definition_on_random_data():
    g = np.random.default_rng(0)
    y = g.integers(0, 2, 500)
    s = np.round(g.normal(size=500) + y, 1)  # many ties
    c = pr_curve(s, y)
    # reference: step-wise AP computed pair by pair over distinct thresholds
    ap = 0.0
    prev_r = 0.0
    for t in sorted(set(s), reverse=True):
        sel = s >= t
        p = (y[sel] == 1).mean()
        r = (y[sel] == 1).sum() / y.sum()
        ap += (r - prev_r) * p
        prev_r = r
    assert c.average_precision == pytest.approx(ap, rel=1e-12)


def test_no_positives():
    with pytest.raises(ValueError, match="no positive"):
        pr_curve(np.array([0.1, 0.2]), np.array([0, 0]))

"""Retention score, floor and cap, by hand."""

import math

import numpy as np
import pytest
import torch

from consolidate.scoring import retention_score, select_survivors


def test_retention_score_hand_computed():
    f64 = torch.float64
    s = retention_score(
        torch.tensor([0.5, 1.0, 0.2], dtype=f64),
        torch.tensor([100.0, 0.0, 250.0], dtype=f64),
        torch.tensor([1.0, 3.0, 2.0], dtype=f64),
        now=200.0,
        tau=50.0,
    )
    expected = [0.5 * math.exp(-100 / 50), 1.0 * math.exp(-200 / 150), 0.2]  # future -> age 0
    assert s.dtype == torch.float64
    np.testing.assert_allclose(s.numpy(), expected, rtol=1e-12)


def test_retention_score_per_row_now_and_bad_tau():
    s = retention_score(
        torch.tensor([1.0, 1.0]),
        torch.tensor([0.0, 0.0]),
        torch.tensor([1.0, 1.0]),
        now=torch.tensor([10.0, 20.0]),
        tau=10.0,
    )
    np.testing.assert_allclose(s.numpy(), [math.exp(-1), math.exp(-2)])
    with pytest.raises(ValueError, match="tau"):
        retention_score(torch.ones(1), torch.zeros(1), torch.ones(1), 1.0, 0.0)


def test_floor_cap_pinned_and_ties():
    score = np.array([0.9, 0.5, 0.5, 0.01, 0.3, 0.8, 0.7])
    pinned = np.array([False, False, False, True, False, False, False])
    ns = np.array(["a", "a", "a", "a", "a", "b", "b"])
    ids = np.array(["a1", "a3", "a2", "a4", "a5", "b1", "b2"])
    sel = select_survivors(score, pinned, ns, ids, floor=0.35, cap=3)
    # a: a4 pinned (kept despite the floor) takes a slot; a5 below floor; then a1, and one of
    # the tied a2/a3 (0.5): id order keeps a2; b: both kept
    assert sel.keep.tolist() == [True, False, True, True, False, True, True]
    assert sel.reason.tolist() == [None, "cap", None, None, "floor", None, None]


def test_cap_zero_keeps_only_pinned():
    sel = select_survivors(
        np.array([1.0, 0.9]),
        np.array([True, False]),
        np.array(["a", "a"]),
        np.array(["x", "y"]),
        floor=0.0,
        cap=0,
    )
    assert sel.keep.tolist() == [True, False]

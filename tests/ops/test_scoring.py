"""Retention score, floor and cap, by hand."""

import math

import numpy as np
import pytest
import torch

from consolidate.ops.scoring import retention_score, select_survivors


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


def test_importance_that_protects_is_exempt_from_the_floor_not_from_the_cap():
    """ "Bob is allergic to penicillin." (importance 0.95), unused for three years at tau 90
    days: 0.95 * exp(-26280 / 2160) = 4.94e-6, far below the floor 0.001; protected at
    importance >= 0.9 it stays, and the cap still ranks it by that score."""
    imp = np.array([0.95, 0.5, 0.6, 0.7])
    age = np.array([26280.0, 26280.0, 1.0, 2.0])
    score = retention_score(
        torch.from_numpy(imp), torch.from_numpy(-age), torch.ones(4, dtype=torch.float64), 0.0,
        2160.0,
    ).numpy()  # fmt: skip
    assert score[0] == pytest.approx(0.95 * math.exp(-26280 / 2160), rel=1e-12)
    assert score[0] == pytest.approx(4.9409e-6, rel=1e-4)
    pinned = np.zeros(4, bool)
    ns = np.array(["a"] * 4)
    ids = np.array(["pen", "old", "b", "c"])
    plain = select_survivors(score, pinned, ns, ids, floor=0.001, cap=None)
    assert plain.reason.tolist() == ["floor", "floor", None, None]
    prot = select_survivors(score, pinned, ns, ids, floor=0.001, cap=None, protected=imp >= 0.9)
    assert prot.keep.tolist() == [True, False, True, True]
    capped = select_survivors(score, pinned, ns, ids, floor=0.001, cap=2, protected=imp >= 0.9)
    assert capped.reason.tolist() == ["cap", "floor", None, None]  # lowest score of the three
    pin = select_survivors(score, imp >= 0.9, ns, ids, floor=0.001, cap=2)
    assert pin.reason.tolist() == [None, "floor", "cap", None]  # a pin takes its slot first


def test_the_pass_keeps_an_important_old_fact_and_drops_the_rest():
    from consolidate.config import PassConfig, SimilarityConfig
    from consolidate.pipeline import run_pass
    from tests.helpers import make_records

    g = np.random.default_rng(3)
    texts = ["Bob is allergic to penicillin.", "Bob bought a blue umbrella.", "Bob likes tea."]
    rows = [
        {
            "id": f"m{k}",
            "namespace": "bob",
            "text": t,
            "vector": g.normal(size=8).astype(np.float32),
            "importance": imp,
            "created_at": t0,
            "last_used": t0,
        }
        for k, (t, imp, t0) in enumerate(
            zip(texts, [0.95, 0.5, 0.4], [0.0, 0.0, 26280.0], strict=True)
        )
    ]

    def dropped(**kw):
        res = run_pass(
            make_records(rows),
            cfg=PassConfig(force=True, max_drop_fraction=1.0, now="wall", **kw),
            sim_cfg=SimilarityConfig(device="cpu"),
            version=1,
            wall_h=26280.0,
        )
        return sorted(e["id"] for e in res.events if e["op"] == "drop")

    assert dropped() == ["m1"]
    assert dropped(protect_importance=None) == ["m0", "m1"]
    assert dropped(protect_importance=0.96) == ["m0", "m1"]
    with pytest.raises(ValueError, match="sleep.protect_importance must be in"):
        dropped(protect_importance=1.5)

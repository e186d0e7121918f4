"""The seed example of the product brief, checked by hand."""

import math

import numpy as np
import pytest

from consolidate.config import PassConfig
from consolidate.pipeline import run_pass
from tests.helpers import make_records


def seed_records():
    return make_records(
        [
            {
                "id": "a",
                "namespace": "u",
                "text": "uses vim",
                "vector": [1.0, 0.0],
                "importance": 0.6,
                "created_at": 100.0,
                "last_used": 100.0,
            },
            {
                "id": "b",
                "namespace": "u",
                "text": "prefers vim keybindings",
                "vector": [0.99, 0.1],
                "importance": 0.8,
                "created_at": 90.0,
                "last_used": 90.0,
            },
            {
                "id": "c",
                "namespace": "u",
                "text": "lunch was soup",
                "vector": [0.0, 1.0],
                "importance": 0.1,
                "created_at": 0.0,
                "last_used": 0.0,
            },
        ]
    )


def test_seed_example(device):
    cfg = PassConfig(
        threshold=0.95, tau_hours=72, floor=0.05, cap=10, now="200", tombstone_retention_hours=None
    )
    from consolidate.config import SimilarityConfig

    res = run_pass(
        seed_records(), cfg=cfg, sim_cfg=SimilarityConfig(device=device), version=2, wall_h=300.0
    )
    st = res.stats
    assert st["merges"] == 1 and st["exact_merges"] == 0
    assert st["dropped_floor"] == 1 and st["dropped_cap"] == 0
    assert st["records_out"] == 1 and st["model_calls"] == 0
    m = res.records.meta
    live = m[m["deleted_at"].isna()]
    assert len(live) == 1
    row = live.iloc[0]
    assert row["strength"] == 2.0
    assert row["importance"] == pytest.approx(0.8)
    # created_at: the newest member's, so no later fact in it looks older
    assert row["last_used"] == 100.0 and row["created_at"] == 100.0
    # strength-weighted centroid of [1, 0] and [0.99, 0.1]/|.|, renormalised
    b = np.array([0.99, 0.1]) / math.hypot(0.99, 0.1)
    c = (np.array([1.0, 0.0]) + b) / np.linalg.norm(np.array([1.0, 0.0]) + b)
    vec = res.records.vectors[live.index[0]]
    np.testing.assert_allclose(vec, c, atol=1e-6)
    # members are tombstones pointing at the merged record; "lunch was soup" was dropped
    by_id = m.set_index("id")
    assert by_id.loc["a", "merged_into"] == row["id"] == by_id.loc["b", "merged_into"]
    assert by_id.loc["c", "deleted_reason"] == "floor"
    drop = [e for e in res.events if e["op"] == "drop"]
    assert drop[0]["id"] == "c"
    assert drop[0]["score"] == pytest.approx(0.1 * math.exp(-200 / 72))
    assert res.stats["score_min"] == pytest.approx(0.8 * math.exp(-(200 - 100) / (2 * 72)))
    # the extractive merger keeps the most important text; "uses vim" states no number,
    # date, name or negation it lacks, so it is not appended
    # "uses vim" says something "prefers vim keybindings" does not: both clauses, oldest first
    assert row["text"] == "Prefers vim keybindings. Uses vim."

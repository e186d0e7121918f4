"""Retention-policy calibration: the grid, the frontier and the recommendation by hand, then
the job on two LOCOMO conversations (real embedding model) and its use by the main job."""

import json

import numpy as np
import pandas as pd
import pytest

from consolidate.evaluation.frontier import frontier_mask, policy_grid, policy_name, recommend


def test_policy_grid_in_order_and_checked():
    g = policy_grid({"threshold": [0.8, 0.9], "floor": [0.0, 0.01]})
    assert g == [
        {"threshold": 0.8, "floor": 0.0},
        {"threshold": 0.8, "floor": 0.01},
        {"threshold": 0.9, "floor": 0.0},
        {"threshold": 0.9, "floor": 0.01},
    ]
    assert policy_name(g[1]) == "policy t0.8 floor0.01"
    with pytest.raises(ValueError, match="unknown keys \\['tau'\\]"):
        policy_grid({"tau": [1]})
    with pytest.raises(ValueError, match="no values for \\['floor'\\]"):
        policy_grid({"floor": []})


def test_policy_grid_refuses_bad_values_before_anything_runs():
    from consolidate.evaluation.frontier import check_policy

    with pytest.raises(ValueError, match="sleep.threshold must be in \\[-1, 1\\]"):
        policy_grid({"threshold": [0.9, 2.0]})
    with pytest.raises(ValueError, match="must be lists"):
        policy_grid({"threshold": 0.9})
    with pytest.raises(ValueError, match="must be lists"):
        policy_grid({"threshold": "abc"})
    with pytest.raises(ValueError, match="the same policy twice"):
        policy_grid({"threshold": [0.9, 0.9]})
    with pytest.raises(ValueError, match="sleep.cap"):
        policy_grid({"cap": [float("nan")]})
    with pytest.raises(ValueError, match="decay must be true or false"):
        check_policy({"decay": "false"})
    with pytest.raises(ValueError, match="unknown keys \\['now'\\]"):
        check_policy({"now": "wall"})
    # a whole number written as a float (as JSON tables do) is the integer it means
    assert check_policy({"cap": 100.0, "threshold": 0.9}) == {"cap": 100, "threshold": 0.9}
    assert policy_grid({"cap": [None, 5]}) == [{"cap": None}, {"cap": 5}]


def test_load_policy_refuses_incomplete_or_hostile_files(tmp_path):
    from consolidate.jobs.policy import load_policy

    good = {
        "target": {"share": 0.98, "metrics": ["recall@10"]},
        "task": {"name": "t"},
        "recommended": {
            "pass": {"threshold": 0.9, "cap": 5.0},
            "keeps": {"recall@10": 1.0},
            "tokens_vs_baseline": 0.9,
        },
    }
    f = tmp_path / "p.json"
    f.write_text(json.dumps(good))
    assert load_policy(f)["pass"] == {"threshold": 0.9, "cap": 5}
    for bad, match in [
        ({**good, "recommended": {"pass": {}}}, "incomplete policy.json"),
        ([1, 2], "no recommended policy"),
        (None, "no recommended policy"),
        (
            {**good, "recommended": {**good["recommended"], "pass": {"tau_hours": 0}}},
            "tau_hours must be > 0",
        ),
        (
            {**good, "recommended": {**good["recommended"], "pass": {"max_drop_fraction": 1}}},
            "unknown keys",
        ),
    ]:
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            load_policy(f)
    with pytest.raises(ValueError, match="not a readable policy.json"):
        load_policy(tmp_path)  # a folder
    f.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable policy.json"):
        load_policy(f)


TABLE = pd.DataFrame(
    {
        "variant": ["a", "b", "c", "d", "e"],
        "store_tokens": [100, 80, 80, 60, 90],
        "recall@10": [0.50, 0.49, 0.48, 0.40, 0.49],
        "recall@500tok": [0.60, 0.59, 0.60, 0.50, 0.58],
    }
)


def test_frontier_by_hand():
    # b dominates e (fewer tokens, same recall@10, more recall@500tok); c and b trade
    # recall@10 for recall@500tok at equal tokens; a has the most recall, d the fewest tokens
    mask = frontier_mask(TABLE, "store_tokens", ["recall@10", "recall@500tok"])
    assert mask.tolist() == [True, True, True, True, False]
    # a row without a measure is on no frontier
    t = TABLE.copy()
    t.loc[3, "recall@10"] = float("nan")
    assert frontier_mask(t, "store_tokens", ["recall@10"]).tolist() == [
        True,
        True,
        False,
        False,
        False,
    ]


def test_recommendation_by_hand():
    base = {"recall@10": 0.50, "recall@500tok": 0.60}
    # 98% of the baseline: recall@10 >= 0.49, recall@500tok >= 0.588; b (80 tokens) and e
    # (90, recall@500tok 0.58 < 0.588: out) -> b; c misses recall@10
    r = recommend(TABLE, base, ["recall@10", "recall@500tok"], 0.98)
    assert r["variant"] == "b" and r["keeps"] == {"recall@10": 0.98, "recall@500tok": 0.9833}
    # at 80% every row keeps it: the fewest tokens wins
    assert recommend(TABLE, base, ["recall@10", "recall@500tok"], 0.8)["variant"] == "d"
    assert recommend(TABLE, base, ["recall@10"], 1.0)["variant"] == "a"
    assert recommend(TABLE, {"recall@10": 0.9}, ["recall@10"], 1.0) is None
    with pytest.raises(ValueError, match="share"):
        recommend(TABLE, base, ["recall@10"], 0.0)


@pytest.mark.slow
def test_policy_job_on_two_locomo_conversations(tmp_path, compose_cfg):

    from consolidate.jobs.policy import load_policy, run_policy
    from tests.helpers import DATA_DIR, LOCOMO

    if not LOCOMO.exists():
        pytest.skip("LOCOMO data not present")
    cfg = compose_cfg(
        "policy",
        overrides=[
            f"paths.data_dir={DATA_DIR}",
            "store.conversations=2",
            "embedder.show_progress=false",
            "grid.threshold=[0.85,0.95]",
            "grid.tau_hours=[720,8760]",
            "grid.floor=[0.0,0.01]",
        ],
    )
    doc = run_policy(cfg, tmp_path)
    assert len(doc["policies"]) == 8 and doc["target"]["share"] == 0.98
    res = json.loads((tmp_path / "results.json").read_text())
    abl = {r["variant"]: r for r in res["tables"]["ablation"]}
    base = abl["keep-all"]
    assert doc["baseline"]["store_tokens"] == base["store_tokens"] > 0
    # floor 0 drops nothing: at 0.95 only merges shrink the store
    no_drop = abl[policy_name({"threshold": 0.95, "tau_hours": 8760, "floor": 0.0})]
    assert no_drop["dropped"] == 0 and no_drop["store_size"] <= base["store_size"]
    rows = pd.DataFrame(doc["policies"])
    keep = np.ones(len(rows), bool)
    # chosen on one conversation, on faithful recall; reported on the other
    assert doc["target"]["metrics"] == ["faithful_recall@10", "faithful_recall@500tok"]
    split = doc["split"]
    assert len(split["choose"]) == 1 and len(split["held_out"]) == 1
    assert set(split["choose"] + split["held_out"]) == {
        r["groups"][0] for r in res["tables"]["splits"]
    }
    for m in doc["target"]["metrics"]:
        assert doc["baseline"][m] == pytest.approx(base[f"{m}[choose]"])
        assert doc["baseline"]["held_out"][m] == pytest.approx(base[f"{m}[held_out]"])
        keep &= rows[m].to_numpy() >= 0.98 * base[f"{m}[choose]"] - 1e-12
    rec = doc["recommended"]
    assert rec is not None  # floor 0 at 0.95 keeps nearly everything
    held = abl[policy_name(rec["pass"])]
    assert rec["held_out"]["faithful_recall@10"] == pytest.approx(
        held["faithful_recall@10[held_out]"]
    )
    # the recommendation is the fewest tokens among the policies that keep the target
    assert rec["store_tokens"] == rows[keep]["store_tokens"].min()
    assert rows[rows["variant"] == policy_name(rec["pass"])]["frontier"].item()
    assert (tmp_path / "frontier.png").stat().st_size > 1000
    assert "## Policy calibration" in (tmp_path / "report.md").read_text()
    loaded = load_policy(tmp_path / "policy.json")
    assert loaded["pass"] == rec["pass"] and loaded["task"]["name"] == "locomo10"
    # the main job applies it and says so
    from consolidate.jobs.consolidate import format_summary, run_consolidate

    ccfg = compose_cfg(
        "consolidate",
        overrides=[
            f"paths.data_dir={DATA_DIR}",
            "store.conversations=2",
            f"store.dir={tmp_path / 'store'}",
            "store.create=true",
            "embedder.show_progress=false",
            f"sleep.policy_file={tmp_path / 'policy.json'}",
        ],
    )
    s = run_consolidate(ccfg, str(tmp_path / "out"))
    assert s["policy"]["pass"] == rec["pass"] and s["policy"]["calibrated"] is True
    line = next(x for x in format_summary(s).splitlines() if x.startswith("policy"))
    assert (
        f"threshold {rec['pass']['threshold']}" in line
        and "(held-out half) it kept faithful_recall@10" in line
    )

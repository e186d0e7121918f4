"""The table a consolidate run prints (consolidate.summary.format_summary), line by line."""

from __future__ import annotations

import copy

from consolidate.summary import format_summary

SUMMARY = {
    "store": "stores/x",
    "summary_path": "out/summary.json",
    "wall_time_s": 2.5,
    "import": {"observations": 10, "conversations": 2, "time_s": 1.5, "malformed_evidence": 1},
    "trigger": {
        "new_importance": 7.5,
        "threshold": 5.0,
        "fired": True,
        "forced": False,
        "namespaces_fired": 2,
        "namespaces_with_new": 3,
    },
    "config": {"sleep": {"threshold": 0.9, "tau_hours": 2160, "floor": 0.001, "cap": 1000}},
    "ran": True,
    "dry_run": False,
    "stats": {
        "records_in": 10,
        "exact_duplicates": 1,
        "exact_groups": 1,
        "pairs": 4,
        "clusters": 2,
        "merges": 2,
        "exact_merges": 1,
        "merged_members": 5,
        "merge_text_ratio_mean": 1.5,
        "merge_text_ratio_max": 2.0,
        "members_lost": 0,
        "review_pairs": 1,
        "superseded": 0,
        "dropped_floor": 1,
        "dropped_cap": 0,
        "records_out": 6,
        "model_calls": 0,
        "device": "cpu",
        "engine": "torch",
        "merger": "extractive",
        "time_s": {
            "load": 0.1,
            "exact": 0.01,
            "similarity": 0.02,
            "cluster": 0.03,
            "merge": 0.04,
            "score": 0.05,
            "commit": 0.06,
        },
    },
    "commit": {
        "version": 3,
        "snapshot": "s",
        "changelog": "changelog-000003.jsonl",
        "carried_records": 0,
        "rows_written": 7,
    },
}


def test_a_store_pass_prints_every_stage_and_what_it_wrote():
    pad = " " * 44
    assert format_summary(SUMMARY).splitlines() == [
        "store            stores/x",
        "imported         10 observations from 2 conversations (1.5 s)",
        "import problems  {'malformed_evidence': 1} (listed in import_report.json)",
        "trigger          new importance 7.5 vs 5.0 per namespace: fired in 2 of 3 namespaces "
        "with new memories",
        "policy           threshold 0.9, tau 2160 h, floor 0.001, cap 1000: uncalibrated "
        "(consolidate-policy measures what a policy costs in recall)",
        "stage            result                                      time_s",
        "records in       10                                          0.1",
        "exact duplicates 1 in 1 groups                               0.01",
        "pairs >= thresh  4                                           0.02",
        "clusters         2                                           0.03",
        "merges           2 clusters + 1 exact (5 records)            0.04",
        "merge texts      1.50x the longest member on average (max 2.00x); members lost 0",
        f"review pairs     {'1':<44}",
        f"superseded       {'0 older facts closed (valid_to)':<44}",
        "dropped          1 below floor, 0 over cap                   0.05",
        "records out      6                                           0.06",
        f"model calls      0{pad[1:]}",
        "written          version 3, changelog changelog-000003.jsonl, 7 rows written, "
        "carried 0 late records",
        "device           cpu, engine torch (merger: extractive)",
        "wall time        2.5 s; summary out/summary.json",
    ]


def test_unchanged_skipped_fleet_and_external_lines():
    s = copy.deepcopy(SUMMARY)
    s["commit"] = {"unchanged": True, "version": 3}
    s["fleet"] = {"shards": 4, "workers": 2, "ray_s": 3.5, "commits": [3, 4]}
    out = format_summary(s).splitlines()
    assert "written          nothing changed: no new version (still version 3)" in out
    assert (
        "runner           ray: 4 shards of whole namespaces on 2 actors, 3.5 s on Ray "
        "(stage times are summed over actors)" in out
    )
    assert "commits          2 versions (3, 4), one per group of shards" in out
    s = copy.deepcopy(SUMMARY)
    del s["commit"]
    s["dry_run"] = True
    s["external"] = {"applied": {"merge": 2, "drop": 1}, "plan_id": "0123456789abcdef",
                     "n_skipped": 0, "events": "out/events.jsonl"}  # fmt: skip
    out = format_summary(s).splitlines()
    assert (
        "would apply      1 drop, 2 merges (plan 0123456789ab in plan.json; 0 units skipped; "
        "events out/events.jsonl); source.apply=true writes it" in out
    )
    assert not any(x.startswith("written") or x.startswith("undo") for x in out)
    s["ran"] = False
    assert format_summary(s).splitlines()[-2] == "pass             skipped (no memories to pass)"
    s["trigger"] = {**s["trigger"], "fired": False}
    assert format_summary(s).splitlines()[-2] == (
        "pass             skipped (the trigger above did not fire; sleep.force=true runs anyway)"
    )


def test_late_writes_and_carried_lines_of_an_external_apply():
    s = copy.deepcopy(SUMMARY)
    del s["commit"]
    s["external"] = {
        "applied": {"merge": 1},
        "plan_id": "0123456789abcdef",
        "n_skipped": 0,
        "events": "e.jsonl",
        "late": [{"action": "carried"}, {"action": "undone"}, {"action": "carried"}],
        "carried": 2,
    }
    out = format_summary(s).splitlines()
    assert (
        "late writes      3 units of earlier applies written since: 2 carried, 1 undone "
        "(listed in plan.json)" in out
    )
    assert (
        "appended lines   2 lines an agent appended during the pass, carried into the file" in out
    )

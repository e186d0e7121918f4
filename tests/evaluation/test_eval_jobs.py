"""Evaluate, calibrate, sweep and report jobs end to end (real embedding model)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from consolidate.evaluation.results import read_results
from consolidate.jobs.calibrate import run_calibrate
from consolidate.jobs.common import CONFIG_DIR
from consolidate.jobs.evaluate import run_evaluate
from consolidate.jobs.report import run_report
from tests.helpers import DATA_DIR, LOCOMO, REPO, compose_cfg, require_smollm2

pytestmark = pytest.mark.slow


def _cfg(name, overrides):
    return compose_cfg(name, overrides=[f"paths.data_dir={DATA_DIR}", *overrides])


def test_evaluate_longmemeval_fixture(tmp_path):
    cfg = _cfg(
        "evaluate", ["task=longmemeval-fixture", "embedder.show_progress=false", "latency_sample=3"]
    )
    res = run_evaluate(cfg, tmp_path / "a")
    assert res.task.name == "longmemeval-fixture" and res.task.hash_verified
    assert res.task.counts == {"memories": 10, "questions": 3, "groups": 3, "truncated_texts": 0}
    abl = {r["variant"]: r for r in res.tables["ablation"]}
    # every group holds <= 4 memories, so the top 10 hold all evidence
    assert abl["append-all"]["recall@10"] == 1.0 and abl["append-all"]["store_size"] == 10
    # q3 has two evidence turns: recall@1 can be at most (1 + 1 + 0.5) / 3
    assert abl["append-all"]["recall@1"] <= 2.5 / 3 + 1e-12
    samples = (tmp_path / "a" / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 3 * len(cfg.variants)
    assert (tmp_path / "a" / "ablation.png").stat().st_size > 1000
    assert read_results(tmp_path / "a" / "results.json").schema_version == 1
    # identity: the prompts and models measured; every group holds <= 4 memories, so recall
    # at k >= 4 is the whole context for every question, flagged and out of the headline
    assert res.prompts["decide"] == "decide-v2" and "embedder" in res.models
    abl0 = abl["append-all"]
    assert abl0["full_context@1"] == 0.0 and abl0["full_context@10"] == 1.0
    assert "Full context, not retrieval" in (tmp_path / "a" / "report.md").read_text()
    # reproducible: same numbers on a rerun (timings aside)
    res2 = run_evaluate(cfg, tmp_path / "b")
    drop = ("pass_s", "p50_ms", "p95_ms")
    assert [{k: v for k, v in r.items() if k not in drop} for r in res.tables["ablation"]] == [
        {k: v for k, v in r.items() if k not in drop} for r in res2.tables["ablation"]
    ]


def test_evaluate_unknown_vector_dtype_names_the_variant(tmp_path):
    cfg = _cfg(
        "evaluate",
        [
            "task=longmemeval-fixture",
            "embedder.show_progress=false",
            "variants=[{name: tiny, consolidate: false, vectors: int4}]",
        ],
    )
    with pytest.raises(ValueError, match="variant 'tiny': vectors: .*one of fp32"):
        run_evaluate(cfg, tmp_path)


def test_a_file_given_by_path_is_named_as_it_is_and_not_verified(tmp_path, compose_cfg):
    fixture = Path(CONFIG_DIR).parent / "evaluation/longmemeval_tiny.json"
    mine = tmp_path / "my_longmemeval.json"
    mine.write_bytes(fixture.read_bytes())
    cfg = _cfg(
        "evaluate",
        [
            "task=longmemeval",
            f"longmemeval_file={mine}",
            "embedder.show_progress=false",
            "latency_sample=3",
            "variants=[{name: append-all, consolidate: false}]",
        ],
    )
    res = run_evaluate(cfg, tmp_path / "p")
    assert res.task.name == "longmemeval" and not res.task.hash_verified
    assert list(res.task.files_sha256) == [str(mine)]
    # the report tool refuses to put it in one table with the fixture's run ...
    cfg2 = _cfg(
        "evaluate",
        [
            "task=longmemeval-fixture",
            "embedder.show_progress=false",
            "latency_sample=3",
            "variants=[{name: append-all, consolidate: false}]",
        ],
    )
    run_evaluate(cfg2, tmp_path / "f")
    rc = compose_cfg("report", overrides=[f"runs=[{tmp_path}/p,{tmp_path}/f]"])
    ok = compose_cfg(
        "report",
        overrides=[f"runs=[{tmp_path}/p,{tmp_path}/f]", "allow_mixed=true"],
    )
    with pytest.raises(ValueError, match="evaluate runs differ in task"):
        run_report(rc, tmp_path / "r1")
    # ... unless asked
    assert run_report(ok, tmp_path / "r2")["parquet"].exists()


@pytest.mark.skipif(not LOCOMO.exists(), reason="LOCOMO data not present")
def test_evaluate_locomo_two_conversations(tmp_path):
    cfg = _cfg(
        "evaluate",
        [
            "store.conversations=2",
            "embedder.show_progress=false",
            "latency_sample=5",
            "variants=[{name: append-all, consolidate: false},"
            "{name: p90, sleep: {threshold: 0.9, decay: false}},"
            "{name: int8, consolidate: false, vectors: int8}]",
        ],
    )
    res = run_evaluate(cfg, tmp_path)
    abl = {r["variant"]: r for r in res.tables["ablation"]}
    assert res.task.counts["groups"] == 2 and res.task.counts["questions"] == 304
    assert abl["p90"]["store_size"] < abl["append-all"]["store_size"]
    # int8 storage keeps every memory; its rankings move only where scores nearly tie
    assert abl["int8"]["vectors"] == "int8" and abl["append-all"]["vectors"] == "fp32"
    assert abl["int8"]["store_size"] == abl["append-all"]["store_size"]
    assert abs(abl["int8"]["recall@10"] - abl["append-all"]["recall@10"]) < 0.02
    for r in abl.values():
        assert 0 < r["recall@1"] <= r["recall@5"] <= r["recall@10"] <= r["recall@20"] <= 1
    cats = {m.category_label for m in res.metrics if m.category is not None}
    assert "1 multi-hop / single-hop" in cats


@pytest.mark.skipif(not (DATA_DIR / "pairs").exists(), reason="pairs data not present")
def test_calibrate_subset_and_use_in_consolidate(tmp_path):
    cfg = _cfg("calibrate", ["max_pairs=300"])
    calib = run_calibrate(cfg, tmp_path)
    entries = {e["dataset"]: e for e in calib["entries"]}
    assert set(entries) == {"stsb-dev", "stsb-test", "sick-all"}
    for e in entries.values():
        assert e["pairs"] == 300 and 0 < e["average_precision"] <= 1
        assert -1 <= e["best_f1_threshold"] <= 1
    assert calib["recommended"]["threshold"] == entries["sick-all"]["best_f1_threshold"]
    # every pair is a sample, with its cosine; the guard's flag rates are reported
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 300 and {s["dataset"] for s in samples} == set(entries)
    sick = [s for s in samples if s["dataset"] == "sick-all"]
    thr = entries["sick-all"]["best_f1_threshold"]
    from consolidate.ops.guard import conflict_reason

    above = [s for s in sick if s["score"] >= thr and s["contradiction"]]
    assert entries["sick-all"]["contradictions_above"] == len(above)
    if above:  # recomputed here from the samples: the same share
        want = sum(
            conflict_reason(s["sentence1"], s["sentence2"]) is not None for s in above
        ) / len(above)
        assert entries["sick-all"]["guard_flags_contradictions"] == pytest.approx(want)
    assert "guard_flags_contradictions" in (tmp_path / "report.md").read_text()
    # the same rates at the other thresholds, with what flagged the contradictions
    g = entries["sick-all"]
    assert set(g["guard_at"]) == {"0.90", "0.85", "0.80"}
    for t, r in g["guard_at"].items():
        hit = [
            conflict_reason(s["sentence1"], s["sentence2"])
            for s in sick
            if s["score"] >= float(t) and s["contradiction"]
        ]
        assert r["contradictions_above"] == len(hit)
        assert r["guard_reasons"] == {w: hit.count(w) for w in set(hit) - {None}}
    assert "Conflict guard at other thresholds" in (tmp_path / "report.md").read_text()
    for f in (
        "calibration.json",
        "results.json",
        "report.md",
        "pr_curves.png",
        "hist_sick-all_fp32.png",
    ):
        assert (tmp_path / f).exists(), f
    from consolidate.evaluation.thresholds import load_calibration

    assert (
        load_calibration(tmp_path / "calibration.json")["threshold"]
        == calib["recommended"]["threshold"]
    )


def test_multirun_sweep_collects_a_table(tmp_path, compose_cfg):
    env = {**os.environ, "CONSOLIDATE_DATA_DIR": str(DATA_DIR)}
    p = subprocess.run(
        [
            str(Path(sys.executable).parent / "consolidate-evaluate"),
            "-m",
            "task=longmemeval-fixture",
            "embedder.show_progress=false",
            "latency_sample=3",
            "experiment=sweep_decay",
            "sleep.tau_hours=24,720",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    md = (tmp_path / "runs.md").read_text()
    assert "sleep.tau_hours=24" in md and "sleep.tau_hours=720" in md
    import pandas as pd

    t = pd.read_parquet(tmp_path / "runs.parquet")
    assert len(t) == 2
    by_tau = {
        ("24" if "tau_hours=24 " in o + " " else "720"): r
        for o, r in zip(t["overrides"], t.to_dict("records"), strict=True)
    }
    # a 24 h time constant over a months-long haystack drops most memories
    assert by_tau["24"]["store_size"] < by_tau["720"]["store_size"] == 10
    cfg = compose_cfg("report", overrides=[f"root={tmp_path}"])
    paths = run_report(cfg, tmp_path / "report")
    assert len(pd.read_parquet(paths["parquet"])) == 2
    assert json.loads((tmp_path / "0" / "results.json").read_text())["job"] == "evaluate"


def test_answer_and_judge_path_with_smollm2(tmp_path):
    """SmolLM2-135M answers and judges two questions: structure only (its scores mean
    nothing at this size)."""
    require_smollm2()
    cfg = _cfg(
        "evaluate",
        [
            "task=longmemeval-fixture",
            "embedder.show_progress=false",
            "latency_sample=2",
            "answer.backend=transformers",
            "answer.questions=2",
            "answer.judge_repeats=2",
            "answer.allow_same_judge=true",
            "answer.variants=[append-all]",
            "answer.max_tokens=12",
            f"answer.backend_kwargs.cache_dir={REPO / '.cache' / 'models'}",
            "variants=[{name: append-all, consolidate: false}]",
        ],
    )
    res = run_evaluate(cfg, tmp_path)
    row = res.tables["ablation"][0]
    assert row["answered"] == 2
    # 2 answers + 2 questions x (2 judge + 2 leniency-control) calls
    assert row["model_calls"] == 2 + 2 * 4
    assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0
    for k in ("locomo_f1", "mem0_f1", "bleu1"):
        assert 0.0 <= row[k] <= 1.0, k
    # the judge scores only questions with a valid verdict; SmolLM2 may give none
    assert 0 <= row["judge_questions"] <= 2 and 0.0 <= row["judge_invalid_rate"] <= 1.0
    if row["judge_questions"]:
        assert row["judge_ci_low"] <= row["judge"] <= row["judge_ci_high"]
    assert row["judge_model"] == row["answer_model"] and res.models["judge"]
    answers = [
        json.loads(x)
        for x in (tmp_path / "samples.jsonl").read_text().splitlines()
        if '"kind": "answer"' in x
    ]
    assert len(answers) == 2 and all(isinstance(a["answer"], str) for a in answers)
    assert "## Answers (model backend)" in (tmp_path / "report.md").read_text()
    # without allow_same_judge the answer model may not judge itself
    bad = _cfg(
        "evaluate",
        [
            "task=longmemeval-fixture",
            "embedder.show_progress=false",
            "latency_sample=2",
            "answer.backend=transformers",
            f"answer.backend_kwargs.cache_dir={REPO / '.cache' / 'models'}",
            "variants=[{name: append-all, consolidate: false}]",
        ],
    )
    with pytest.raises(ValueError, match="answer.judge_backend is not set"):
        run_evaluate(bad, tmp_path / "bad")


def test_a_results_file_of_another_schema_is_one_error_naming_it(tmp_path):
    from consolidate.evaluation.results import read_results

    bad = tmp_path / "results.json"
    bad.write_text('{"rows": [1, 2]}')
    with pytest.raises(ValueError, match=rf"{bad} is not a results.json of this harness's schema"):
        read_results(bad)


def test_point_labels_join_nearby_arms_only():
    """Store size 0..1000, recall 0..0.5: within 2% of both spans (20 memories, 0.01) two
    arms share a label; 2509 vs 2541 style neighbours join, a far one does not."""
    import numpy as np

    from consolidate.evaluation.plots import point_labels

    xs = np.array([1000.0, 990.0, 0.0, 1000.0, 500.0])
    ys = np.array([0.50, 0.495, 0.0, 0.45, 0.25])
    got = point_labels(xs, ys)
    assert [g[2] for g in got] == [["1", "2"], ["3"], ["4"], ["5"]]
    assert got[0][:2] == (1000.0, 0.50)
    assert point_labels(np.array([3.0, 3.0]), np.array([0.1, 0.1])) == [(3.0, 0.1, ["1", "2"])]
    assert point_labels(np.array([]), np.array([])) == []

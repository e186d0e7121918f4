"""The pass-floor experiment: its stand-ins leave the pass's array work as it is, and are
gone after it."""

import json

import numpy as np
import pytest

from consolidate.bench import pass_floor
from consolidate.ops.merge import ExtractiveMerger
from consolidate.pipeline import merging, near

ORIGINAL = (near.guard_pairs, ExtractiveMerger.merge_batch, merging.checked_merge)


def test_both_ways_find_the_planted_clusters(tmp_path):
    pass_floor.main(["--n", "2000", "--repeats", "1", "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "results.json").read_text())
    assert [r["way"] for r in runs] == ["full", "no text work"]
    _, info = pass_floor.make_pass_store(2000, 100, seed=0, now_h=500000.0)
    for r in runs:
        # 20 namespaces of 100: 3 planted clusters and 2 duplicated rows each
        assert r["clusters"] == r["merges"] == info["planted_clusters"] == 60
        assert r["exact_merges"] == info["duplicate_groups"] == 40
        assert r["review_pairs"] == 0
        # a duplicate group is its source row and its copy
        assert r["merged_members"] == info["cluster_rows"] + 2 * info["duplicate_rows"]
        # every merge adds a row and tombstones its members: what is live is what was planted
        assert r["out"] - r["merged_members"] == info["expected_out"] == 1805
        assert r["pass_s"] > r["similarity_s"] > 0
    report = (tmp_path / "report.md").read_text()
    assert report.count("| full |") == report.count("| no text work |") == 1
    assert (near.guard_pairs, ExtractiveMerger.merge_batch, merging.checked_merge) == ORIGINAL


def test_stand_ins_answer_without_text_work():
    with pass_floor._without_text_work():
        cls, keys, reasons = near.guard_pairs(
            ["I live in Berlin", "I don't live in Berlin", "x"],
            np.array([0, 1]),
            np.array([1, 2]),
            [(0, 3)],
            1,
        )
        assert cls.tolist() == [0, 1, 2]
        assert keys.tolist() == [0 * 3 + 1, 1 * 3 + 2]
        assert reasons.tolist() == [None, None]  # the real guard flags the negation
    got = near.guard_pairs(
        ["I live in Berlin", "I don't live in Berlin"], np.array([0]), np.array([1]), [(0, 2)], 1
    )
    assert got[2].tolist() != [None]


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    for argv in (["--repeats", "0"], ["--n", "1000", "--ns-size", "300"]):
        with pytest.raises(SystemExit) as e:
            pass_floor.main([*argv, "--out", str(tmp_path / "x")])
        assert e.value.code == 2
        assert "--n a multiple of --ns-size" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

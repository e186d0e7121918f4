"""The judge: a closed-set JSON verdict, invalid verdicts counted neither way, the score over
valid verdicts with the invalid share beside it (scripted model answers)."""

import math

import numpy as np
import pandas as pd
import pytest

from consolidate.evaluation.answer import bootstrap_ci, parse_verdict, score_answers
from tests.helpers import Scripted


@pytest.mark.parametrize(
    "text,want",
    [
        ('{"verdict": "CORRECT"}', 1),
        ('{"verdict": "WRONG"}', 0),
        ('  {"verdict":"CORRECT"}\n', 1),
        ('```json\n{"verdict": "WRONG"}\n```', 0),
        # everything else is invalid: never correct, never wrong
        ("CORRECT", None),
        ("not correct", None),
        ("The answer is not CORRECT.", None),
        ("partially correct", None),
        ('{"verdict": "correct"}', None),
        ('{"verdict": "PARTIALLY CORRECT"}', None),
        ('{"verdict": "CORRECT", "score": 0.5}', None),
        ('Sure! {"verdict": "CORRECT"}', None),
        ('{"verdict": "CORRECT"} {"verdict": "WRONG"}', None),
        ('{"verdict": ["CORRECT"]}', None),
        ('["CORRECT"]', None),
        ("", None),
        (None, None),
    ],
)
def test_verdicts(text, want):
    assert parse_verdict(text) == want


def test_bootstrap():
    lo, hi = bootstrap_ci([1.0] * 10)
    assert lo == hi == 1.0
    lo, hi = bootstrap_ci(np.r_[np.zeros(50), np.ones(50)], n=2000, seed=1)
    assert 0.35 < lo < 0.5 < hi < 0.65


C, W, BAD = '{"verdict": "CORRECT"}', '{"verdict": "WRONG"}', "not correct"


def test_score_over_valid_verdicts_only():
    sample = pd.DataFrame(
        {
            "qid": ["q1", "q2", "q3"],
            "question": ["a?", "b?", "c?"],
            "answer": ["x", "y", "z"],
            "category": [4, 4, 4],
            "group": ["g", "g", "g"],
        }
    )
    answers = Scripted(["x", "y", "z"])
    # per question: 2 verdicts on the answer, then 2 on the wrong-answer control
    judge = Scripted([C, BAD, W, W, W, W, C, W, BAD, BAD, BAD, C])
    s = score_answers(answers, sample, [[], [], []], sample, repeats=2, bootstrap=200, judge=judge)
    t = s.table
    # q1: one valid CORRECT (the invalid one is left out) -> 1.0; q2: WRONG, WRONG -> 0.0;
    # q3: no valid verdict -> not scored
    assert t["judge"].iloc[0] == 1.0 and t["judge"].iloc[1] == 0.0
    assert math.isnan(t["judge"].iloc[2])
    assert s.summary["judge"] == 0.5 and s.summary["judge_questions"] == 2
    assert s.summary["judge_invalid_rate"] == pytest.approx(3 / 6)
    # control: q1 W,W -> 0; q2 C,W -> 0.5; q3 BAD,C -> 1.0
    assert s.summary["judge_wrong_answer_acceptance"] == pytest.approx(0.5)
    assert len(answers.seen) == 3 and len(judge.seen) == 12
    assert all(
        r.json_schema["properties"]["verdict"]["enum"] == ["CORRECT", "WRONG"] for r in judge.seen
    )
    assert s.summary["judge_ci_low"] <= 0.5 <= s.summary["judge_ci_high"]


@pytest.mark.parametrize(
    "text",
    [
        '{"verdict": "WRONG", "verdict": "CORRECT"}',  # a repeated key: not one verdict
        '{"verdict": ' + "[" * 100000 + "]" * 100000 + "}",  # too deep / too long
        "```json\n{" + " " * 16000 + "}",  # an unclosed fence
        b'{"verdict": "CORRECT"}',
        1,
        ["CORRECT"],  # not text
    ],
)
def test_hostile_verdicts_are_invalid(text):
    assert parse_verdict(text) is None

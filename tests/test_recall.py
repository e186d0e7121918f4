"""Recall: top-k by cosine within a hard token cap, with the recall bookkeeping."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from consolidate.recall import fit_token_cap, recall
from consolidate.store import Store
from tests.helpers import REPO, make_records


@pytest.mark.parametrize(
    "tokens,cap,n",
    [
        ([10, 20, 30], 30, 2),
        ([10, 20, 30], 29, 1),
        ([10, 20, 30], 60, 3),
        ([10], 0, 0),
        ([50, 1, 1], 10, 0),  # the best one does not fit: nothing after it is taken either
        ([], 100, 0),
    ],
)
def test_fit_token_cap(tokens, cap, n):
    assert fit_token_cap(np.array(tokens), cap) == n


def test_fit_token_cap_refuses_a_negative_cap():
    with pytest.raises(ValueError, match="max_tokens"):
        fit_token_cap(np.array([1]), -1)


class AxisEmbedder:
    """Query "axis k" embeds as the unit vector e_k (d = 4); tokens = words."""

    def encode(self, texts):
        out = np.zeros((len(texts), 4), np.float32)
        for r, t in enumerate(texts):
            out[r, int(t.split()[-1])] = 1.0
        return out

    def count_tokens(self, texts):
        return np.array([len(t.split()) for t in texts], np.int64)


@pytest.fixture
def store(tmp_path):
    v = {
        "a": [1.0, 0.2, 0, 0],
        "b": [1.0, 0.5, 0, 0],
        "c": [1.0, 1.0, 0, 0],
        "d": [0, 0, 1.0, 0],
        "x": [1.0, 0.0, 0, 0],
    }
    rows = [
        {
            "id": i,
            "namespace": "other" if i == "x" else "u",
            "text": t,
            "vector": v[i],
            "importance": 0.5,
            "created_at": 10.0,
            "last_used": 10.0,
            "strength": s,
        }
        for i, t, s in (
            ("a", "one two three", 19.5),
            ("b", "four five", 1.0),
            ("c", "six", 1.0),
            ("d", "seven eight", 1.0),
            ("x", "not mine", 1.0),
        )
    ]
    s = Store(tmp_path / "s")
    s.create(make_records(rows))
    return s


def test_recall_ranks_caps_and_marks_used(store):
    (r,) = recall(store, "u", ["axis 0"], AxisEmbedder(), k=3, max_tokens=5, now=20.0)
    # cosines to e_0: a 0.981, b 0.894, c 0.707 (x is another namespace's, d is orthogonal)
    assert r.ids == ["a", "b"] and r.tokens == 5 and r.cut_by_tokens == 1
    np.testing.assert_allclose(r.scores, [1 / np.sqrt(1.04), 1 / np.sqrt(1.25)], rtol=1e-6)
    m = store.load().records.meta.set_index("id")
    assert m.loc["a", "strength"] == 20.0 and m.loc["b", "strength"] == 2.0  # capped at 20
    assert m.loc["a", "last_used"] == m.loc["b", "last_used"] == 20.0
    assert m.loc["c", "last_used"] == 10.0 and m.loc["c", "strength"] == 1.0


def test_recall_without_bookkeeping_and_edge_cases(store):
    before = sorted(p.name for p in (store.root / "deltas").iterdir())
    two = recall(store, "u", ["axis 2", "axis 0"], AxisEmbedder(), k=1, mark_used=False)
    assert [r.ids for r in two] == [["d"], ["a"]]
    assert sorted(p.name for p in (store.root / "deltas").iterdir()) == before
    assert recall(store, "nobody", ["axis 0"], AxisEmbedder())[0].ids == []
    assert (
        recall(store, "u", ["axis 0"], AxisEmbedder(), max_tokens=0, mark_used=False)[
            0
        ].cut_by_tokens
        == 4
    )
    with pytest.raises(ValueError, match="k must be"):
        recall(store, "u", ["axis 0"], AxisEmbedder(), k=0)


@pytest.mark.slow
def test_recall_cli(tmp_path):
    from consolidate.embed import Embedder

    emb = Embedder(show_progress=False)
    texts = ["Gina adopted two kittens", "Gina works as a nurse in Porto", "Jon likes jazz"]
    v = emb.encode(texts)
    s = Store(tmp_path / "s")
    s.create(
        make_records(
            [
                {
                    "id": f"m{k}",
                    "namespace": "gina" if k < 2 else "jon",
                    "text": t,
                    "vector": v[k],
                    "created_at": 10.0,
                    "last_used": 10.0,
                }
                for k, t in enumerate(texts)
            ]
        )
    )
    p = subprocess.run(
        [
            str(Path(sys.executable).parent / "consolidate-recall"),
            f"store.dir={s.root}",
            "namespace=gina",
            'query="Does Gina have pets?"',
            "k=2",
            "max_tokens=8",
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln for ln in p.stdout.strip().splitlines() if not ln.startswith("[")]  # no logs
    assert "m0" in lines[0] and "Gina adopted two kittens" in lines[0]
    assert (
        lines[-1].startswith("1 memories, ")
        and "1 more of the top 2 did not fit" in lines[-1]
        and "marked used" in lines[-1]
    )
    m = Store(s.root).load().records.meta.set_index("id")
    assert m.loc["m0", "strength"] == 2.0 and m.loc["m1", "strength"] == 1.0
    # the namespace's newest use (1970 here) is older than tau: the job says what marking
    # recalled memories used at today's clock does to the next pass
    assert "note: the newest memory of 'gina' was last used" in p.stdout
    assert "use mark_used=false on a historical store" in p.stdout
    # a namespace the store does not hold is an error with the closest one
    q = subprocess.run(
        [str(Path(sys.executable).parent / "consolidate-recall"), f"store.dir={s.root}",
         "namespace=gna", "query=pets", "mark_used=false", f"hydra.run.dir={tmp_path}/run2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert q.returncode == 2
    assert f"\nerror: no namespace 'gna' in {s.root}; did you mean gina? (CONSOLIDATE_" in q.stderr
    assert "note: the newest" not in q.stdout

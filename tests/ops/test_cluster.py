"""Centroid-checked clustering: no chaining, order independence, conflict guard."""

import numpy as np
import pytest

from consolidate.config import PassConfig
from consolidate.ops.cluster import centroid_clusters
from consolidate.pipeline import run_pass
from tests.helpers import make_records, random_rows


def chain_vectors():
    """Unit vectors with A.B = B.C = 0.96 and A.C = 0.85 (Gram matrix -> Cholesky)."""
    g = np.array([[1, 0.96, 0.85], [0.96, 1, 0.96], [0.85, 0.96, 1.0]])
    return np.linalg.cholesky(g)  # rows are the vectors


def test_chain_is_not_one_cluster():
    v = chain_vectors()
    s = v @ v.T
    np.testing.assert_allclose([s[0, 1], s[1, 2], s[0, 2]], [0.96, 0.96, 0.85], atol=1e-12)
    # the equal-weight centroid check alone would accept all three (cos ~0.962 each)
    c = v.sum(0) / np.linalg.norm(v.sum(0))
    assert (v @ c >= 0.95).all()
    i, j = np.array([0, 1]), np.array([1, 2])
    res = centroid_clusters(i, j, np.array([0.96, 0.96]), v, np.ones(3), ["A", "B", "C"], 0.95)
    assert res.labels[0] != res.labels[2]
    assert res.clusters == [[0, 1]]  # tie broken by ids: (A, B) before (B, C)
    assert res.rejected == 1


def test_chain_through_the_pass():
    v = chain_vectors()
    rows = [
        {
            "id": k,
            "namespace": "u",
            "text": f"fact {k.lower()}",  # "fact A" / "fact B": two identifiers, never merged
            "vector": v[n],
            "importance": 0.5,
            "last_used": 10.0,
        }
        for n, k in enumerate("ABC")
    ]
    res = run_pass(make_records(rows), cfg=PassConfig(threshold=0.95, now="10"), wall_h=20.0)
    merges = [e for e in res.events if e["op"] == "merge"]
    assert len(merges) == 1
    assert not {"A", "C"} <= set(merges[0]["members"])


def test_centroid_rejects_when_weights_pull_away():
    # x and y are 0.951 apart; a heavy y moves the centroid away from x only slightly,
    # so they merge; every member must stay >= t from the final weighted centroid.
    g = np.array([[1, 0.951], [0.951, 1.0]])
    v = np.linalg.cholesky(g)
    res = centroid_clusters(
        np.array([0]),
        np.array([1]),
        np.array([0.951]),
        v,
        np.array([1.0, 1000.0]),
        ["x", "y"],
        0.95,
    )
    c = v[1] * 1000 + v[0]
    c /= np.linalg.norm(c)
    assert res.clusters == [[0, 1]] and (v @ c >= 0.95).all()


def test_clusters_do_not_depend_on_row_order():
    rows = random_rows(400, 16, seed=5, namespaces=3, dup_frac=0.5, noise=0.1)
    cfg = PassConfig(threshold=0.8, now="1000", decay=False)
    a = run_pass(make_records(rows), cfg=cfg, wall_h=2000.0)
    perm = np.random.default_rng(1).permutation(len(rows))
    b = run_pass(make_records([rows[k] for k in perm]), cfg=cfg, wall_h=2000.0)

    def groups(r):
        return sorted(tuple(e["members"]) for e in r.events if e["op"] == "merge")

    assert groups(a) == groups(b)
    assert len(groups(a)) > 10


@pytest.mark.parametrize(
    "a,b",
    [
        ("I live in Berlin", "I don't live in Berlin"),
        ("has 2 cats", "has 3 cats"),
        ("has two cats", "has 3 cats"),
        ("moved to Paris in May 2023", "moved to Paris in June 2023"),
    ],
)
def test_conflicting_pairs_are_never_merged_by_the_extractive_merger(a, b):
    # identical vectors: only the conflict guard can keep them apart
    rows = [
        {"id": "x", "namespace": "u", "text": a, "vector": [1.0, 0.0], "last_used": 5.0},
        {"id": "y", "namespace": "u", "text": b, "vector": [1.0, 0.0], "last_used": 5.0},
    ]
    res = run_pass(make_records(rows), cfg=PassConfig(threshold=0.5, now="5"), wall_h=6.0)
    assert res.stats["merges"] == 0 and res.stats["records_out"] == 2
    rev = [e for e in res.events if e["op"] == "review"]
    assert len(rev) == 1 and sorted(rev[0]["ids"]) == ["x", "y"]


def test_conflict_blocks_a_third_member_too():
    # x ~ y merge; z conflicts with x (negation) so it must not join their cluster
    rows = [
        {"id": "x", "namespace": "u", "text": "likes tea", "vector": [1.0, 0.0, 0.0]},
        {"id": "y", "namespace": "u", "text": "likes tea a lot", "vector": [0.99, 0.14, 0.0]},
        {"id": "z", "namespace": "u", "text": "does not like tea", "vector": [0.99, 0.0, 0.14]},
    ]
    for r in rows:
        r["last_used"] = 1.0
    res = run_pass(make_records(rows), cfg=PassConfig(threshold=0.9, now="1"), wall_h=2.0)
    merges = [e["members"] for e in res.events if e["op"] == "merge"]
    assert merges == [["x", "y"]]
    assert any(e["op"] == "review" and "z" in e["ids"] for e in res.events)


def test_items_in_no_pair_keep_their_own_label_and_positions_map_back():
    # 7 items; pairs only among {1, 3, 5} (one cluster) and {4, 6} (a conflict); 0 and 2 are
    # in no pair. Keys sort in reverse position order, so the cluster lists 5, 3, 1.
    v = np.zeros((7, 3))
    v[[1, 3, 5], 0] = 1.0
    v[[4, 6], 1] = 1.0
    v[[0, 2], 2] = 1.0
    keys = [f"k{9 - x}" for x in range(7)]
    seen = []

    def conflict(a, b):
        seen.append((a, b))
        return "number" if {a, b} == {4, 6} else None

    res = centroid_clusters(
        np.array([1, 3, 1, 4]),
        np.array([3, 5, 5, 6]),
        np.ones(4),
        v,
        np.ones(7),
        keys,
        0.9,
        conflict=conflict,
    )
    assert res.labels.tolist() == [0, 1, 2, 1, 4, 1, 6]
    assert res.clusters == [[5, 3, 1]]
    assert res.review == [(4, 6, 1.0, "number")]
    assert res.rejected == 1
    assert {frozenset(p) for p in seen} <= {frozenset(p) for p in [(1, 3), (3, 5), (1, 5), (4, 6)]}


def test_isolated_pairs_merge_unless_a_blocking_conflict_and_are_reported():
    # (0, 1), (5, 6), (7, 8): isolated pairs; 2-3-4: a triangle through the full loop.
    # (5, 6) is an undone merge (blocks), (7, 8) a number conflict (a model may resolve it).
    v = np.zeros((9, 4))
    v[[0, 1], 0] = 1.0
    v[[2, 3, 4], 1] = 1.0
    v[[5, 6], 2] = 1.0
    v[[7, 8], 3] = 1.0
    i, j = np.array([1, 2, 3, 2, 5, 7]), np.array([0, 3, 4, 4, 6, 8])
    reasons = {frozenset((5, 6)): "undone merge", frozenset((7, 8)): "number"}

    def conflict(a, b):
        return reasons.get(frozenset((a, b)))

    keys = ["b", "a", "c", "d", "e", "f", "g", "h", "i"]  # item 1 sorts before item 0
    res = centroid_clusters(
        i,
        j,
        np.ones(6),
        v,
        np.ones(9),
        keys,
        0.9,
        conflict=conflict,
        allow_conflicts=True,
        blocking=lambda r: r == "undone merge",
    )
    assert res.clusters == [[1, 0], [2, 3, 4], [7, 8]]
    assert res.labels.tolist() == [0, 0, 2, 2, 2, 5, 6, 7, 7]
    assert res.review == [(5, 6, 1.0, "undone merge"), (7, 8, 1.0, "number")]
    assert res.rejected == 1
    # without a conflict-handling merger both conflicting pairs stay apart
    strict = centroid_clusters(i, j, np.ones(6), v, np.ones(9), keys, 0.9, conflict=conflict)
    assert strict.clusters == [[1, 0], [2, 3, 4]] and strict.rejected == 2


def test_conflict_class_is_read_by_position_not_by_label():
    import pandas as pd

    classes = ["A", "B", "A", "A", "C"]

    def conflict(a, b):
        return "negation" if {classes[a], classes[b]} == {"A", "B"} else None

    v = np.tile([1.0, 0.0], (5, 1))
    args = ([0, 0], [1, 2], [1.0, 0.99], v, np.ones(5), list("abcde"), 0.9)
    for cls in (
        classes,
        pd.Series(classes, index=range(10, 15)),
        pd.Series(classes, index=range(4, -1, -1)),
    ):
        res = centroid_clusters(*args, conflict=conflict, conflict_class=cls)
        assert res.clusters == [[0, 2]]
        assert res.review == [(0, 1, 1.0, "negation")]


def test_conflict_many_and_class_codes_give_the_same_clusters():
    rng = np.random.default_rng(3)
    n = 60
    base = rng.standard_normal((6, 8))
    v = base[rng.integers(0, 6, n)] + 0.05 * rng.standard_normal((n, 8))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    s = v @ v.T
    i, j = np.nonzero(np.triu(s >= 0.9, 1))
    codes = rng.integers(0, 4, n)  # 4 classes; classes 0 and 3 conflict
    # every second item in no pair, so the paired-items path maps the answers too
    keep = (i % 2 == 0) & (j % 2 == 0)
    i, j = i[keep], j[keep]
    sim = s[i, j]
    keys = [f"k{x:03d}" for x in range(n)]
    asked = []

    def conflict(a, b):
        return "number" if {int(codes[a]), int(codes[b])} == {0, 3} else None

    def conflict_many(a, b):
        asked.append(len(a))
        return [conflict(x, y) for x, y in zip(a.tolist(), b.tolist(), strict=True)]

    ref = centroid_clusters(i, j, sim, v, np.ones(n), keys, 0.9, conflict=conflict)
    # codes at or above the number of items name the same classes (0, 1, 60, 120: a key of
    # low * 60 + high would mix the class pairs (0, 120) and (1, 60))
    for cls in (None, codes.tolist(), codes, np.array([0, 1, 60, 120])[codes]):
        for allow in (False, True):
            want = centroid_clusters(
                i,
                j,
                sim,
                v,
                np.ones(n),
                keys,
                0.9,
                conflict=conflict,
                conflict_class=cls,
                allow_conflicts=allow,
            )
            got = centroid_clusters(
                i,
                j,
                sim,
                v,
                np.ones(n),
                keys,
                0.9,
                conflict=conflict,
                conflict_many=conflict_many,
                conflict_class=cls,
                allow_conflicts=allow,
            )
            assert got.clusters == want.clusters and got.review == want.review
            assert got.labels.tolist() == want.labels.tolist()
            assert got.rejected == want.rejected
            if not allow:
                assert got.clusters == ref.clusters
    assert asked and sum(asked) > 0
    assert len(ref.review) > 0  # the case has conflicts to see
    # integer codes of any size become dense codes in [0, n): the pair key low * n + high
    # stays one key per pair of classes
    from consolidate.ops.cluster import _class_codes

    assert _class_codes(np.array([5, 900, 5, -3]), 4).tolist() == [1, 2, 1, 0]
    with pytest.raises(ValueError, match="conflict_class has 3 codes for 60 items"):
        centroid_clusters(i, j, sim, v, np.ones(n), keys, 0.9, conflict_class=codes[:3])


def test_compact_clusters_break_ties_on_unsigned_keys_as_integers():
    import torch

    from consolidate.pipeline.near import compact_clusters
    from consolidate.similarity import Pairs

    # three items, every pair at one similarity: the order of the keys decides the members'
    # order, and a uint64 key of 2**63 or more is the largest, not a negative number
    v = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 3)
    p = Pairs(np.array([0, 0, 1]), np.array([1, 2, 2]), np.ones(3))
    keys = np.array([2**63 + 5, 1, 2], np.uint64)
    _, cr = compact_clusters(p, v, np.ones(3), keys, 0.9)
    _, by_str = compact_clusters(p, v, np.ones(3), np.array(["c", "a", "b"], object), 0.9)
    assert cr.clusters == by_str.clusters == [[1, 2, 0]]


def test_bad_pairs_are_errors():
    v = np.eye(3)
    with pytest.raises(ValueError, match=r"pair positions must be in \[0, 3\)"):
        centroid_clusters([0], [-1], [1.0], v, np.ones(3), list("abc"), 0.9)
    with pytest.raises(ValueError, match="one length"):
        centroid_clusters([0, 1], [2], [1.0], v, np.ones(3), list("abc"), 0.9)
    # an isolated pair whose sim overstates its vectors (orthogonal) fails the centroid check
    with pytest.raises(AssertionError, match="centroid condition"):
        centroid_clusters([0], [2], [0.95], v, np.ones(3), list("abc"), 0.9)


@pytest.mark.parametrize("seed", range(6))
def test_the_component_shortcut_gives_the_loops_result(seed):
    # many small groups of near-identical vectors: complete groups, groups with a missing
    # pair, isolated pairs, conflicts by class (some blocking), equal similarities (ties)
    rng = np.random.default_rng(seed)
    n_groups, d = 300, 16
    sizes = rng.integers(2, 7, n_groups)
    n = int(sizes.sum())
    group = np.repeat(np.arange(n_groups), sizes)
    base = rng.standard_normal((n_groups, d))
    v = base[group] + 0.05 * rng.standard_normal((n, d))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    s = v @ v.T
    a, b = np.triu_indices(n, 1)
    same = group[a] == group[b]
    a, b = a[same], b[same]
    keep = rng.random(len(a)) > 0.1  # some groups lose a pair: incomplete
    a, b = a[keep], b[keep]
    sims = np.round(s[a, b], 2)  # rounded: ties broken by the keys
    thr = float(sims.min()) - 1e-6
    swap = rng.random(len(a)) < 0.5
    a, b = np.where(swap, b, a), np.where(swap, a, b)
    keys = [f"k{x:05d}" for x in rng.permutation(n)]
    cls = rng.integers(0, 40, n)
    xs, ys = rng.integers(0, 40, (2, 25))
    why = rng.choice(["number", "undone merge"], 25)
    bad = {(x, y): r for x, y, r in zip(xs.tolist(), ys.tolist(), why.tolist(), strict=True)}

    def conflict(x, y):
        return bad.get((cls[x], cls[y])) or bad.get((cls[y], cls[x]))

    for allow in (False, True):
        kw = dict(
            conflict=conflict,
            conflict_class=cls.tolist(),
            allow_conflicts=allow,
            blocking=lambda r: r == "undone merge",
        )
        fast = centroid_clusters(a, b, sims, v, rng.uniform(1, 3, n), keys, thr, **kw)
        ref = centroid_clusters(a, b, sims, v, np.ones(n), keys, thr, greedy_only=True, **kw)
        fast_w = centroid_clusters(a, b, sims, v, np.ones(n), keys, thr, **kw)
        assert fast_w.clusters == ref.clusters
        assert fast_w.labels.tolist() == ref.labels.tolist()
        assert fast_w.review == ref.review
        assert fast_w.rejected == ref.rejected
        assert len(ref.clusters) > 50 and ref.review  # the case has both kinds
        # weights change no rule: only the centroid check (an assertion) reads them
        assert fast.clusters == ref.clusters and fast.review == ref.review
        # integer keys in the strings' order (their ranks, as the pass gives them) break
        # ties as the strings do, in the shortcut, the loop and on a subset of paired items
        ranks = np.argsort(np.argsort(np.array(keys, dtype=object), kind="stable"))
        gapped = ranks * 7 + 3  # any increasing integers, not only 0..n-1
        extra = n + 5  # items in no pair: centroid_clusters works on the paired ones
        v_x = np.vstack([v, np.eye(d)[:5]])
        for shortcut in (False, True):
            got = centroid_clusters(
                a, b, sims, v, np.ones(n), gapped, thr, greedy_only=not shortcut, **kw
            )
            assert got.clusters == ref.clusters and got.review == ref.review
            assert got.labels.tolist() == ref.labels.tolist() and got.rejected == ref.rejected
        kw_x = dict(kw, conflict_class=cls.tolist() + [99] * 5)
        str_x = centroid_clusters(
            a, b, sims, v_x, np.ones(extra), keys + [f"z{k}" for k in range(5)], thr, **kw_x
        )
        int_x = centroid_clusters(
            a, b, sims, v_x, np.ones(extra), np.r_[gapped, 10 * n + np.arange(5)], thr, **kw_x
        )
        assert int_x.clusters == str_x.clusters and int_x.review == str_x.review
        assert int_x.labels.tolist() == str_x.labels.tolist()


def test_the_pass_gives_the_same_records_with_and_without_the_shortcut(monkeypatch):
    # a seeded store with conflicting paraphrases (numbers), pins, an undo constraint,
    # exact duplicates and tombstones: every record and event of the pass is the same when
    # every cluster goes through the pair-by-pair loop
    import consolidate.ops.cluster as cl
    from consolidate.bench.pass_bench import make_pass_store

    recs, _ = make_pass_store(3000, 100, d=32, seed=3, now_h=1000.0)
    meta = recs.meta
    texts = meta["text"].to_numpy(object).copy()
    for r in range(0, 3000, 3):  # numbers in many clusters' texts: "number" conflicts
        texts[r] = f"{texts[r]} {3 + r % 2} times"
    meta["text"] = texts
    meta.loc[::50, "pinned"] = True
    meta.loc[1::97, "deleted_at"] = 990.0
    meta.loc[1::97, "deleted_reason"] = "floor"
    ids = meta["id"].tolist()
    meta.at[5, "keep_apart"] = [ids[k] for k in range(6, 3000, 11)]
    cfg = PassConfig(threshold=0.9, cap=None, max_drop_fraction=1.0, now="1000")

    def run():
        res = run_pass(recs, cfg=cfg, wall_h=1001.0)
        return res.records.meta, res.records.vectors, res.events, res.stats

    fast = run()
    real = cl.centroid_clusters
    monkeypatch.setattr(
        "consolidate.pipeline.near.centroid_clusters",
        lambda *a, **k: real(*a, **{**k, "greedy_only": True}),
    )
    ref = run()
    assert fast[3].merges > 10 and fast[3].review_pairs > 0 and fast[3].clusters > 10
    assert fast[0].equals(ref[0])
    assert np.array_equal(fast[1], ref[1])
    assert fast[2] == ref[2]


@pytest.mark.parametrize("seed", range(4))
def test_components_match_a_union_find_and_are_labelled_by_their_smallest_item(seed):
    from consolidate.ops.cluster import components

    rng = np.random.default_rng(seed)
    n = 500
    i, j = rng.integers(0, n, 400), rng.integers(0, n, 400)
    parent = list(range(n))

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for a, b in zip(i.tolist(), j.tolist(), strict=True):
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)
    want = [find(x) for x in range(n)]  # each root is its component's smallest item
    assert components(i, j, n).tolist() == want
    # a path visited in random order: many hooking rounds
    p = rng.permutation(n)
    assert components(p[:-1], p[1:], n).tolist() == [0] * n


def test_vectors_read_through_a_row_view_give_the_same_clusters_and_check():
    import torch

    from consolidate.ops import cluster

    # items that are rows 3, 5, ... of a larger table: RowsOf reads them when the
    # centroid check asks, with the same clusters as a copy of the rows
    rng = np.random.default_rng(4)
    sizes = rng.integers(2, 6, 40)
    n, d = int(sizes.sum()), 12
    group = np.repeat(np.arange(len(sizes)), sizes)
    v = rng.standard_normal((len(sizes), d))[group] + 0.03 * rng.standard_normal((n, d))
    v = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
    rows = 3 + 2 * rng.permutation(n)
    table = torch.from_numpy(rng.standard_normal((3 + 2 * n, d)).astype(np.float32))
    table[rows] = torch.from_numpy(v)
    a, b = np.triu_indices(n, 1)
    a, b = a[group[a] == group[b]], b[group[a] == group[b]]
    s = (v.astype(np.float64) @ v.astype(np.float64).T)[a, b]
    thr = float(s.min()) - 1e-6
    w = rng.uniform(1, 3, n)
    keys = [f"k{x:04d}" for x in range(n)]
    view = cluster.RowsOf(table, rows)
    assert view.shape == (n, d) and np.array_equal(view[np.array([4, 0])], v[[4, 0]])
    monkey = pytest.MonkeyPatch()
    try:
        monkey.setattr(cluster, "_CHECK_ROWS", 16)  # several chunks, reused buffers
        for greedy in (False, True):
            ref = centroid_clusters(a, b, s, v, w, keys, thr, greedy_only=greedy)
            got = centroid_clusters(a, b, s, view, w, keys, thr, greedy_only=greedy)
            assert got.clusters == ref.clusters and len(ref.clusters) == len(sizes)
            assert got.labels.tolist() == ref.labels.tolist()
        # with a pair's stated cosine far above its vectors' (a bug), the check fails
        # through the view too (one item turned away from its group)
        table[rows[0]] = -table[rows[0]]
        with pytest.raises(AssertionError, match="centroid condition violated"):
            centroid_clusters(a, b, s, view, w, keys, thr)
    finally:
        monkey.undo()

"""faiss engine: exact join and top-k against float64 brute force; approximate index recall."""

from functools import partial

import numpy as np
import pytest
import torch

faiss = pytest.importorskip("faiss")

from consolidate.similarity import TopK, threshold_pairs, topk_neighbours  # noqa: E402
from consolidate.similarity.engines import faiss_engine  # noqa: E402
from consolidate.similarity.engines.faiss_engine import (  # noqa: E402
    ApproxIndex,
    _packs,
    _range_by_knn,
    _range_cpu,
    recall_at_k,
)
from tests.helpers import pair_reference as ref_pairs  # noqa: E402
from tests.helpers import random_rows  # noqa: E402


def data(n, d, ns, seed, dup_frac=0.3):
    rows = random_rows(n, d, seed=seed, namespaces=ns, dup_frac=dup_frac)
    v = np.stack([r["vector"] for r in rows]).astype(np.float32)
    seg = np.array([int(r["namespace"][2:]) for r in rows])
    return v, seg


# the entry points with engine="faiss" (tile_rows: rows per faiss call, tile_cols: pack rows)
threshold_pairs_faiss = partial(threshold_pairs, engine="faiss")
topk_faiss = partial(topk_neighbours, engine="faiss")


def as_set(p):
    return set(zip(p.i.tolist(), p.j.tolist(), strict=True))


@pytest.mark.parametrize(
    "n,d,ns",
    [
        (1, 8, 1),
        (2, 8, 1),
        (97, 16, 1),
        (301, 24, 3),
        (513, 32, 7),
        (1000, 48, 40),
        (1201, 20, 300),
    ],
)
@pytest.mark.parametrize("blocks", [(4096, 512), (64, 64), (37, 1), (100, 10_000)])
def test_pairs_equal_float64_reference(n, d, ns, blocks):
    v, seg = data(n, d, ns, seed=n + d)
    v64 = v.astype(np.float64)
    for t in (0.5, 0.8, 0.95):
        got = threshold_pairs_faiss(
            v, t, segments=seg, device="cpu", tile_rows=blocks[0], tile_cols=blocks[1]
        )
        assert as_set(got) == ref_pairs(v, seg, t)
        assert (got.i < got.j).all()
        assert got.i.dtype == np.int64 and got.j.dtype == np.int64
        assert got.sim.dtype == np.float64
        if len(got):
            assert np.all(np.diff(got.i * n + got.j) > 0)  # sorted by (i, j)
            np.testing.assert_allclose(got.sim, (v64[got.i] * v64[got.j]).sum(1), atol=1e-12)
            assert (got.sim >= t).all()
    if n >= 97:
        assert len(ref_pairs(v, seg, 0.8)) > 0  # the planted duplicates give pairs


@pytest.mark.parametrize("dtype", ["fp32", "tf32", "bf16", "fp16"])
def test_pairs_identical_to_torch_engine(dtype):
    v, seg = data(700, 40, 5, seed=4)
    for t in (0.7, 0.9):
        a = threshold_pairs(
            torch.from_numpy(v), t, segments=torch.from_numpy(seg), device="cpu", dtype=dtype
        )
        b = threshold_pairs_faiss(
            torch.from_numpy(v), t, segments=torch.from_numpy(seg), device="cpu", dtype=dtype
        )
        np.testing.assert_array_equal(a.i, b.i)
        np.testing.assert_array_equal(a.j, b.j)
        np.testing.assert_array_equal(a.sim, b.sim)  # same float64 re-scoring, bit for bit


def test_unsorted_segments_and_row_order_do_not_change_pairs():
    v, seg = data(400, 16, 6, seed=11)
    perm = np.random.default_rng(0).permutation(400)
    a = threshold_pairs_faiss(v, 0.85, segments=seg, device="cpu")
    b = threshold_pairs_faiss(
        v[perm], 0.85, segments=seg[perm], device="cpu", tile_rows=50, tile_cols=70
    )
    mapped = {
        (min(perm[i], perm[j]), max(perm[i], perm[j])): s
        for i, j, s in zip(b.i, b.j, b.sim, strict=True)
    }
    assert mapped == {(i, j): s for i, j, s in zip(a.i, a.j, a.sim, strict=True)}


def test_exact_duplicates_and_namespace_boundaries():
    v = np.tile(np.array([[1.0, 0.0]], np.float32), (6, 1))
    seg = np.array([0, 1, 0, 1, 2, 2])
    got = threshold_pairs_faiss(v, 0.99, segments=seg, device="cpu", tile_cols=64)
    assert as_set(got) == {(0, 2), (1, 3), (4, 5)}
    # threshold exactly 1.0 keeps exact copies (sim == 1.0 in float64)
    assert as_set(threshold_pairs_faiss(v, 1.0, device="cpu")) == ref_pairs(v, np.zeros(6), 1.0)


def test_packs_cover_rows_and_keep_segments_whole():
    seg = np.repeat(np.arange(50), np.random.default_rng(1).integers(1, 40, 50))
    for pr in (1, 10, 64, 10_000):
        packs = _packs(seg, pr)
        assert packs[0][0] == 0 and packs[-1][1] == seg.size
        assert all(a[1] == b[0] for a, b in zip(packs, packs[1:], strict=False))
        for p0, p1 in packs:
            assert p0 == 0 or seg[p0] != seg[p0 - 1]  # never splits a segment
            assert p1 - p0 <= pr or seg[p0] == seg[p1 - 1]


def test_range_by_knn_equals_range_search():
    """The growing-k search used on GPU faiss, run here with the cpu knn."""
    v, _ = data(600, 16, 1, seed=2, dup_frac=0.5)
    calls = []

    def knn(q, b, k):
        calls.append(k)
        return faiss.knn(q, b, k, metric=faiss.METRIC_INNER_PRODUCT)

    def fallback(q, b, r):
        calls.append("range")
        return _range_cpu(faiss, q, b, r)

    for radius in (0.2, 0.6, 0.95):
        r1, c1 = _range_by_knn(knn, v[:150], v, radius, ks=(4, 32), fallback=fallback)
        r2, c2 = _range_cpu(faiss, v[:150], v, radius)
        assert set(zip(r1.tolist(), c1.tolist(), strict=True)) == set(
            zip(r2.tolist(), c2.tolist(), strict=True)
        )
    assert "range" in calls and 32 in calls  # both the growth and the fallback ran
    with pytest.raises(RuntimeError, match="more than 4"):
        _range_by_knn(knn, v[:10], v, -1.0, ks=(4,))


def ref_topk(q, keys, k, qs, ks):
    s = q.astype(np.float64) @ keys.astype(np.float64).T
    s[qs[:, None] != ks[None, :]] = -np.inf
    idx = np.argsort(-s, axis=1, kind="stable")[:, :k]
    sc = np.take_along_axis(s, idx, 1)
    idx = np.where(np.isfinite(sc), idx, -1)
    if idx.shape[1] < k:
        pad = k - idx.shape[1]
        idx = np.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
        sc = np.pad(sc, ((0, 0), (0, pad)), constant_values=-np.inf)
    return idx, sc


@pytest.mark.parametrize(
    "nq,n,d,ns,k",
    [
        (50, 1, 8, 1, 3),
        (97, 301, 24, 3, 10),
        (513, 513, 32, 7, 5),
        (200, 1000, 16, 40, 50),
        (31, 7, 8, 1, 10),
    ],
)
def test_topk_equals_float64_reference(nq, n, d, ns, k):
    kv, ks = data(n, d, ns, seed=n + k)
    g = np.random.default_rng(nq)
    qv = kv[g.integers(0, n, nq)] + 0.05 * g.normal(size=(nq, d)).astype(np.float32)
    qv /= np.linalg.norm(qv, axis=1, keepdims=True)
    qs = g.integers(0, ns + 1, nq)  # segment ns has no keys: all padding
    got = topk_faiss(qv, kv, k, query_segments=qs, key_segments=ks, device="cpu")
    ri, rs = ref_topk(qv, kv, k, qs, ks)
    assert got.indices.shape == (nq, k) and got.indices.dtype == np.int64
    assert got.scores.shape == (nq, k) and got.scores.dtype == np.float32
    np.testing.assert_array_equal(got.indices == -1, ri == -1)
    np.testing.assert_array_equal(np.isneginf(got.scores), np.isneginf(rs))
    fin = np.isfinite(rs)
    np.testing.assert_allclose(got.scores[fin], rs[fin], atol=1e-5)
    # ids agree except where float32 reorders a near tie of the float64 scores
    diff = got.indices != ri
    if diff.any():
        v64 = kv.astype(np.float64)
        rows = np.nonzero(diff)[0]
        s_got = (qv[rows].astype(np.float64) * v64[got.indices[diff]]).sum(1)
        np.testing.assert_allclose(s_got, rs[diff], atol=1e-6)


def test_topk_without_segments_and_ties():
    keys = np.array([[1, 0], [0, 1], [1, 0], [1, 0]], np.float32)
    got = topk_faiss(np.array([[1, 0]], np.float32), keys, 5, device="cpu")
    np.testing.assert_array_equal(got.indices, [[0, 2, 3, 1, -1]])  # ties: lower key first
    np.testing.assert_array_equal(got.scores[0, :4], [1, 1, 1, 0])
    assert got.scores[0, 4] == -np.inf


def test_topk_matches_torch_engine_on_a_store():
    v, seg = data(900, 32, 4, seed=8)
    a = topk_neighbours(v, v, 8, query_segments=seg, key_segments=seg, device="cpu")
    b = topk_faiss(
        torch.from_numpy(v),
        torch.from_numpy(v),
        8,
        query_segments=seg,
        key_segments=seg,
        device="cpu",
    )
    np.testing.assert_allclose(a.scores, b.scores, atol=1e-5)
    assert (a.indices == b.indices).mean() > 0.99


def test_bad_arguments():
    eye = np.eye(3, dtype=np.float32)
    with pytest.raises(ValueError, match="dtype"):
        threshold_pairs_faiss(eye, 0.9, dtype="int8", device="cpu")
    with pytest.raises(ValueError, match="segments"):
        threshold_pairs_faiss(eye, 0.9, segments=np.zeros(2), device="cpu")
    with pytest.raises(ValueError, match=r"\[n, d\]"):
        threshold_pairs_faiss(np.ones(3, np.float32), 0.9, device="cpu")
    with pytest.raises(ValueError, match="k must be"):
        topk_faiss(eye, eye, 0, device="cpu")
    with pytest.raises(ValueError, match="both"):
        topk_faiss(eye, eye, 1, query_segments=np.zeros(3), device="cpu")
    if faiss.get_num_gpus() == 0:  # cuda asked: no CUDA, or a faiss without GPU support
        with pytest.raises(ValueError, match="GPU support|CUDA"):
            threshold_pairs_faiss(eye, 0.9, device="cuda")


def test_auto_runs_on_cpu_when_faiss_sees_no_gpu(monkeypatch):
    # a CUDA machine with faiss-cpu: "auto" must not pick cuda for faiss
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 0)
    v, seg = data(40, 8, 2, seed=3)
    got = threshold_pairs_faiss(v, 0.5, segments=seg, device="auto")
    assert as_set(got) == ref_pairs(v, seg, 0.5)


def test_missing_faiss_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **kw):
        if name == "faiss":
            raise ImportError("no faiss")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"consolidate\[faiss\]"):
        threshold_pairs_faiss(np.eye(3, dtype=np.float32), 0.9, device="cpu")


def clustered(n, d, clusters, seed):
    g = np.random.default_rng(seed)
    centres = g.normal(size=(clusters, d))
    x = centres[g.integers(0, clusters, n)] + 0.6 * g.normal(size=(n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32)


@pytest.mark.parametrize(
    "kind,params,bound",
    [
        ("ivf", {"nlist": 64, "nprobe": 16}, 0.9),
        ("hnsw", {"m": 16, "ef_search": 512, "ef_construction": 40}, 0.9),
    ],
)
def test_approx_index_recall_at_10(kind, params, bound):
    x = clustered(20_000, 48, 50, seed=0)
    q = clustered(300, 48, 50, seed=1)
    exact = topk_faiss(q, x, 10, device="cpu")
    idx = ApproxIndex(kind, **params).build(x)
    assert idx.ntotal == 20_000
    approx = idx.search(q, 10)
    assert approx.indices.shape == (300, 10) and approx.scores.dtype == np.float32
    r = recall_at_k(approx, exact)
    assert r >= bound, f"{kind} recall@10 {r:.3f} < {bound}"
    # a single probed cell finds less than 16 of them
    if kind == "ivf":
        low = ApproxIndex("ivf", nlist=64, nprobe=1).build(x).search(q, 10)
        assert recall_at_k(low, exact) < r


def test_approx_index_errors():
    with pytest.raises(ValueError, match="kind"):
        ApproxIndex("lsh")
    with pytest.raises(RuntimeError, match="build"):
        ApproxIndex().search(np.zeros((1, 4), np.float32), 1)
    idx = ApproxIndex("ivf", nlist=4).build(clustered(200, 8, 4, seed=0))
    with pytest.raises(ValueError, match=r"\[q, 8\]"):
        idx.search(np.zeros((1, 5), np.float32), 1)
    # fewer vectors than k: -1 / -inf padding
    small = (
        ApproxIndex("ivf", nprobe=4)
        .build(clustered(5, 8, 1, seed=0))
        .search(clustered(2, 8, 1, seed=1), 8)
    )
    assert (small.indices[:, 5:] == -1).all() and np.isneginf(small.scores[:, 5:]).all()


def test_recall_at_k_hand_computed():
    exact = TopK(np.array([[1, 2, 3], [4, 5, -1], [-1, -1, -1]]), np.zeros((3, 3), np.float32))
    approx = TopK(np.array([[3, 9, 1], [5, -1, -1], [7, 8, 9]]), np.zeros((3, 3), np.float32))
    # row 0: {1, 3} of {1, 2, 3}; row 1: {5} of {4, 5}; row 2: nothing to find -> 3 / 5
    assert recall_at_k(approx, exact) == pytest.approx(3 / 5)
    assert recall_at_k(exact, exact) == 1.0
    # an id found in another query's row does not count
    swapped = TopK(exact.indices[[1, 0, 2]], exact.scores)
    assert recall_at_k(swapped, exact) == 0.0
    assert recall_at_k(approx, TopK(np.full((3, 2), -1), np.zeros((3, 2)))) == 1.0
    with pytest.raises(ValueError, match="same q"):
        recall_at_k(TopK(np.zeros((2, 3), np.int64), None), exact)


def test_similarity_engine_keyword_routes_here(monkeypatch):
    """engine="faiss" runs this module's faiss searches (and only engine="faiss" does)."""
    calls = []
    real_range, real_knn = faiss_engine._range_cpu, faiss_engine._knn_cpu
    monkeypatch.setattr(
        faiss_engine, "_range_cpu", lambda *a: calls.append("range") or real_range(*a)
    )
    monkeypatch.setattr(faiss_engine, "_knn_cpu", lambda *a: calls.append("knn") or real_knn(*a))
    v, seg = data(300, 16, 3, seed=5)
    a = threshold_pairs(v, 0.8, segments=seg, device="cpu", engine="faiss")
    assert calls and set(calls) == {"range"}
    calls.clear()
    b = threshold_pairs(v, 0.8, segments=seg, device="cpu", engine="torch")
    assert calls == []
    np.testing.assert_array_equal(a.i, b.i)
    np.testing.assert_array_equal(a.sim, b.sim)
    ta = topk_neighbours(
        v, v, 4, query_segments=seg, key_segments=seg, device="cpu", engine="faiss"
    )
    assert calls and set(calls) == {"knn"}
    tb = topk_neighbours(
        v, v, 4, query_segments=seg, key_segments=seg, device="cpu", engine="torch"
    )
    np.testing.assert_array_equal(ta.indices, tb.indices)

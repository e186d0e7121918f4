"""Tiled similarity join against a float64 brute-force reference."""

import numpy as np
import pytest
import torch

from consolidate.similarity import auto_tile, threshold_pairs, topk_neighbours
from tests.helpers import pair_reference as reference
from tests.helpers import random_rows, topk_reference


def data(n, d, ns, seed):
    rows = random_rows(n, d, seed=seed, namespaces=ns, dup_frac=0.3)
    v = np.stack([r["vector"] for r in rows]).astype(np.float32)
    seg = np.array([int(r["namespace"][2:]) for r in rows])
    return v, seg


@pytest.mark.parametrize(
    "n,d,ns", [(1, 8, 1), (2, 8, 1), (97, 16, 1), (301, 24, 3), (513, 32, 7), (1000, 48, 40)]
)
@pytest.mark.parametrize("tiles", [(None, None), (64, 64), (100, 77), (4096, 4096)])
def test_pairs_equal_float64_reference(n, d, ns, tiles, device):
    v, seg = data(n, d, ns, seed=n + d)
    for t in (0.8, 0.95):
        ref = reference(v, seg, t)
        got = threshold_pairs(
            torch.from_numpy(v),
            t,
            segments=torch.from_numpy(seg),
            device=device,
            tile_rows=tiles[0],
            tile_cols=tiles[1],
        )
        assert set(zip(got.i.tolist(), got.j.tolist(), strict=True)) == ref
        assert (got.i < got.j).all()
        if len(got):
            v64 = v.astype(np.float64)
            np.testing.assert_allclose(got.sim, (v64[got.i] * v64[got.j]).sum(1), atol=1e-12)
            assert (got.sim >= t).all()
    # planted duplicates do produce pairs at 0.8 for the bigger stores
    if n >= 97:
        assert len(reference(v, seg, 0.8)) > 0


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "tf32"])
@pytest.mark.parametrize("tiles", [(128, 96), (None, None)])  # tiled / batched blocks
def test_reduced_precision_tiles_give_the_fp32_pair_set(dtype, tiles):
    v, seg = data(400, 64, 2, seed=3)
    ref = reference(v, seg, 0.9)
    got = threshold_pairs(
        v, 0.9, segments=seg, device="cpu", dtype=dtype, tile_rows=tiles[0], tile_cols=tiles[1]
    )
    assert set(zip(got.i.tolist(), got.j.tolist(), strict=True)) == ref


def test_block_sizes_pad_at_most_an_eighth():
    from consolidate.similarity.engines.torch_engine import _block_size

    sizes = torch.tensor([1, 2, 8, 9, 100, 127, 128, 129, 1000])
    assert _block_size(sizes).tolist() == [8, 8, 8, 16, 104, 128, 128, 144, 1024]


@pytest.mark.parametrize("t", [0.9, 0.3, 0.0, -0.5])
def test_mixed_namespace_sizes_batched_and_tiled(t, device):
    """Namespaces of 1..300 rows with 64-row tiles: the small ones go through the batched
    padded blocks (rows past a namespace's end are computed and dropped), the big ones
    through tiles with the row-max prefilter (and its whole-tile fallback at low t)."""
    g = np.random.default_rng(5)
    sizes = [1, 2, 3, 7, 8, 9, 17, 64, 65, 100, 300, 1, 40]
    seg = np.repeat(np.arange(len(sizes)), sizes)
    g.shuffle(seg)
    v = g.normal(size=(len(seg), 12)).astype(np.float32)
    v[1::3] = v[::3][: len(v[1::3])] + 0.05 * v[1::3]  # planted near-duplicates
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    ref = reference(v, seg, t)
    got = threshold_pairs(v, t, segments=seg, device=device, tile_rows=64, tile_cols=48)
    assert set(zip(got.i.tolist(), got.j.tolist(), strict=True)) == ref
    assert len(ref) > 0
    default = threshold_pairs(v, t, segments=seg, device=device)  # every namespace batched
    assert set(zip(default.i.tolist(), default.j.tolist(), strict=True)) == ref


def test_unsorted_segments_and_row_order_do_not_change_pairs():
    v, seg = data(300, 16, 5, seed=11)
    perm = np.random.default_rng(0).permutation(300)
    a = threshold_pairs(v, 0.85, segments=seg, device="cpu", tile_rows=64, tile_cols=64)
    b = threshold_pairs(v[perm], 0.85, segments=seg[perm], device="cpu", tile_rows=50, tile_cols=70)
    mapped = {
        (min(perm[i], perm[j]), max(perm[i], perm[j])): s
        for i, j, s in zip(b.i, b.j, b.sim, strict=True)
    }
    assert mapped == {(i, j): s for i, j, s in zip(a.i, a.j, a.sim, strict=True)}


def test_pairs_never_cross_namespaces():
    v = np.tile(np.array([[1.0, 0.0]], np.float32), (6, 1))
    seg = np.array([0, 1, 0, 1, 2, 2])
    got = threshold_pairs(v, 0.99, segments=seg, device="cpu", tile_rows=64, tile_cols=64)
    assert set(zip(got.i.tolist(), got.j.tolist(), strict=True)) == {(0, 2), (1, 3), (4, 5)}


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        threshold_pairs(np.eye(3, dtype=np.float32), 0.9, dtype="int8")
    with pytest.raises(ValueError, match="segments"):
        threshold_pairs(np.eye(3, dtype=np.float32), 0.9, segments=np.zeros(2), device="cpu")
    with pytest.raises(ValueError, match=r"\[n, d\]"):
        threshold_pairs(np.ones(3, dtype=np.float32), 0.9, device="cpu")


def test_auto_tile_respects_budget():
    rows, cols = auto_tile(10**6, torch.device("cpu"), budget_bytes=64 << 20)
    assert rows * cols * 16 <= 64 << 20
    assert rows == 1024 and cols == 2048  # cpu: a tile near cache size
    # a small budget shrinks the columns: 1024 rows x 16 bytes x cols <= 8 MiB
    assert auto_tile(10**6, torch.device("cpu"), budget_bytes=8 << 20) == (1024, 512)
    assert auto_tile(10, torch.device("cpu"), budget_bytes=1 << 30) == (64, 64)
    # the top-k's tiles: 4096 rows, columns from the budget (2 GiB / (16 B x 4096))
    assert auto_tile(10**6, torch.device("cpu"), budget_bytes=2 << 30, cache_sized=False) == (
        4096,
        32768,
    )


@pytest.mark.parametrize(
    "nq,n,segs,k",
    [(1, 1, 1, 1), (37, 211, 1, 10), (50, 300, 4, 7), (64, 90, 9, 20), (33, 5, 2, 10)],
)
@pytest.mark.parametrize("tiles", [(8, 16), (4096, None), (13, 29)])
def test_topk_equals_float64_reference(nq, n, segs, k, tiles, device):
    from consolidate.similarity import topk_neighbours

    g = np.random.default_rng(nq * n)
    keys = g.normal(size=(n, 24)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    q = keys[g.integers(0, n, nq)] + 0.3 * g.normal(size=(nq, 24)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    qseg, kseg = g.integers(0, segs, nq), g.integers(0, segs, n)
    got = topk_neighbours(
        q,
        keys,
        k,
        query_segments=qseg,
        key_segments=kseg,
        device=device,
        tile_rows=tiles[0],
        tile_cols=tiles[1],
    )
    ref = topk_reference(q, keys, qseg, kseg, k)
    assert got.indices.shape == (nq, k)
    assert got.indices.tolist() == ref
    valid = got.indices >= 0
    v64 = (q.astype(np.float64)[:, None, :] * keys.astype(np.float64)[got.indices.clip(0)]).sum(-1)
    np.testing.assert_allclose(got.scores[valid], v64[valid], atol=1e-5)
    assert (got.indices[~valid] == -1).all() and np.isinf(got.scores[~valid]).all()


def test_topk_bad_arguments():
    from consolidate.similarity import topk_neighbours

    e = np.eye(3, dtype=np.float32)
    with pytest.raises(ValueError, match="k must"):
        topk_neighbours(e, e, 0)
    with pytest.raises(ValueError, match="both"):
        topk_neighbours(e, e, 1, query_segments=np.zeros(3))


def test_topk_with_no_keys():
    from consolidate.similarity import topk_neighbours

    got = topk_neighbours(
        np.eye(3, dtype=np.float32), np.zeros((0, 3), np.float32), 4, device="cpu"
    )
    assert got.indices.shape == (3, 4) and (got.indices == -1).all()


def test_engine_torch_and_auto_agree_on_cpu(monkeypatch):
    from consolidate.similarity import topk_neighbours

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    v, seg = data(300, 16, 4, seed=5)
    a = threshold_pairs(v, 0.8, segments=seg, device="cpu", engine="torch")
    b = threshold_pairs(v, 0.8, segments=seg, device="cpu", engine="auto")
    c = threshold_pairs(v, 0.8, segments=seg, device="cpu")
    assert len(a) > 0
    for x in (b, c):
        np.testing.assert_array_equal(a.i, x.i)
        np.testing.assert_array_equal(a.j, x.j)
        np.testing.assert_array_equal(a.sim, x.sim)
    ta = topk_neighbours(
        v[:40], v, 5, query_segments=seg[:40], key_segments=seg, device="cpu", engine="torch"
    )
    tb = topk_neighbours(
        v[:40], v, 5, query_segments=seg[:40], key_segments=seg, device="cpu", engine="auto"
    )
    np.testing.assert_array_equal(ta.indices, tb.indices)
    np.testing.assert_array_equal(ta.scores, tb.scores)


def test_engine_errors(monkeypatch):
    from consolidate.similarity import topk_neighbours

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    e = np.eye(3, dtype=np.float32)
    with pytest.raises(ValueError, match="triton engine needs CUDA or TRITON_INTERPRET=1"):
        threshold_pairs(e, 0.9, device="cpu", engine="triton")
    with pytest.raises(ValueError, match="triton engine needs CUDA or TRITON_INTERPRET=1"):
        topk_neighbours(e, e, 1, device="cpu", engine="triton")
    with pytest.raises(ValueError, match="engine must be one of"):
        threshold_pairs(e, 0.9, device="cpu", engine="numba")
    with pytest.raises(ValueError, match="engine must be one of"):
        topk_neighbours(e, e, 1, device="cpu", engine="cuda")


def test_engine_triton_without_triton_names_pip(monkeypatch):
    import consolidate.similarity.engines.triton_engine as sim

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sim, "_triton_importable", lambda: False)
    with pytest.raises(ImportError, match="pip install triton"):
        threshold_pairs(np.eye(3, dtype=np.float32), 0.9, device="cpu", engine="triton")


def test_engine_faiss_dispatches_lazily(monkeypatch):
    """engine="faiss" goes through the registry to whatever module the import system holds
    under the engine's name, after the checks and segment sorting, with the caller's dtype
    and tile settings."""
    import sys
    import types

    from consolidate.similarity import topk_neighbours
    from consolidate.similarity.engines import REGISTRY
    from consolidate.similarity.types import Engine

    calls = []
    empty = torch.zeros(0, dtype=torch.int64)
    fake = types.ModuleType("consolidate.similarity.engines.faiss_engine")
    fake.ENGINE = Engine(
        "faiss",
        threshold_candidates=lambda *a, **kw: calls.append(("pairs", a, kw)) or (empty, empty),
        topk=lambda qv, kv, qs, lo, hi, kk, **kw: (
            calls.append(("topk", (qv, kv), kw))
            or (
                torch.full((qv.shape[0], kk), float("-inf")),
                torch.full((qv.shape[0], kk), -1, dtype=torch.int64),
            )
        ),
        place=lambda device, dev: calls.append(("place", device)) or dev,
    )
    module = REGISTRY["faiss"].partition(":")[0]
    monkeypatch.setitem(sys.modules, module, fake)
    e = np.eye(3, dtype=np.float32)
    seg = np.zeros(3, np.int64)
    got = threshold_pairs(
        e, 0.9, segments=seg, device="cpu", dtype="fp16", tile_rows=64, engine="faiss"
    )
    top = topk_neighbours(
        e, e, 1, query_segments=seg, key_segments=seg, device="cpu", engine="faiss"
    )
    assert len(got) == 0 and (top.indices == -1).all()
    assert [c[0] for c in calls] == ["place", "pairs", "place", "topk"]
    assert calls[0][1] == "cpu"
    v32, counts, threshold = calls[1][1]
    assert v32.dtype == torch.float32 and counts.tolist() == [3] and threshold == 0.9
    assert calls[1][2] == {
        "dtype": "fp16",
        "tile_rows": 64,
        "tile_cols": None,
        "budget_bytes": None,
    }
    assert set(calls[3][2]) == {"dtype", "tile_rows", "tile_cols", "budget_bytes"}


def test_topk_ties_go_to_the_lower_position_in_every_tile_shape():
    keys = np.tile(np.array([[0.6, 0.8]], np.float32), (300, 1))
    q = np.array([[0.6, 0.8], [0.8, 0.6]], np.float32)
    for cols in (None, 7, 64):
        got = topk_neighbours(q, keys, 3, device="cpu", engine="torch", tile_cols=cols)
        assert got.indices.tolist() == [[0, 1, 2], [0, 1, 2]], cols


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        threshold_pairs(np.eye(3, dtype=np.float32), 0.5, device="cuda")


@pytest.mark.parametrize("k", [1, 5, 40])
@pytest.mark.parametrize("tiles", [(None, None), (16, 32)])  # batched blocks / both paths
def test_topk_mixed_namespaces_equal_float64_reference(k, tiles, device):
    """Namespaces with 0..300 keys and 0..40 queries, shuffled, with exact duplicate keys
    (ties): batched padded blocks (padded key columns must never win) and tiles agree with
    float64 top-k, ties to the lower key position."""
    g = np.random.default_rng(k)
    nkeys = [0, 1, 2, 9, 16, 17, 100, 300, 5, 3]
    nqs = [3, 4, 0, 10, 1, 40, 17, 2, 6, 5]
    kseg = np.repeat(np.arange(len(nkeys)), nkeys)
    qseg = np.repeat(np.arange(len(nqs)), nqs)
    g.shuffle(kseg)
    g.shuffle(qseg)
    keys = g.normal(size=(len(kseg), 8)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    q = g.normal(size=(len(qseg), 8)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    ties = 0
    for s in range(len(nkeys)):  # exact duplicate keys in one namespace: tied scores
        kpos, qpos = np.nonzero(kseg == s)[0], np.nonzero(qseg == s)[0]
        if len(kpos) >= 3 and len(qpos):
            keys[kpos[1]] = keys[kpos[2]] = keys[kpos[0]]
            q[qpos[0]] = keys[kpos[0]]
            ties += 1
    assert ties == 7
    got = topk_neighbours(
        q,
        keys,
        k,
        query_segments=qseg,
        key_segments=kseg,
        device=device,
        engine="torch",
        tile_rows=tiles[0],
        tile_cols=tiles[1],
    )
    assert got.indices.tolist() == topk_reference(q, keys, qseg, kseg, k)
    for s in range(len(nkeys)):  # the tied triple comes first, lower positions first
        kpos, qpos = np.nonzero(kseg == s)[0], np.nonzero(qseg == s)[0]
        if len(kpos) >= 3 and len(qpos):
            top = min(k, 3)
            assert got.indices[qpos[0], :top].tolist() == kpos[:top].tolist()
    # the query whose namespace has no keys gets only padding
    assert (got.indices[qseg == 0] == -1).all() and np.isneginf(got.scores[qseg == 0]).all()


def test_topk_segment_lengths_are_checked():
    e = np.eye(3, dtype=np.float32)
    with pytest.raises(ValueError, match="query_segments"):
        topk_neighbours(e, e, 1, query_segments=np.zeros(2), key_segments=np.zeros(3), device="cpu")


@pytest.mark.parametrize("engine", ["torch", "faiss"])
def test_nan_or_inf_rows_are_a_clear_error(engine):
    if engine == "faiss":
        pytest.importorskip("faiss")
    v = np.eye(4, dtype=np.float32)
    v[2, 0] = np.nan
    v[3, 1] = np.inf
    msg = r"vectors: 2 row\(s\) contain NaN or inf, e\.g\. rows \[2, 3\]"
    with pytest.raises(ValueError, match=msg):
        threshold_pairs(v, 0.9, device="cpu", engine=engine)
    ok = np.eye(4, dtype=np.float32)
    with pytest.raises(ValueError, match=r"keys: 2 row"):
        topk_neighbours(ok, v, 2, device="cpu", engine=engine)
    with pytest.raises(ValueError, match=r"queries: 2 row"):
        topk_neighbours(v, ok, 2, device="cpu", engine=engine)


def test_float64_input_is_rescored_from_itself():
    # cos exactly 0.9 in float64, 0.89999998 after rounding to float32
    c = 0.9
    v = np.array([[1.0, 0.0], [c, np.sqrt(1 - c * c)]])
    assert v[0] @ v[1] == 0.9
    got = threshold_pairs(v, 0.9, device="cpu")
    assert list(zip(got.i.tolist(), got.j.tolist(), strict=True)) == [(0, 1)]
    assert got.sim.tolist() == [0.9]
    assert len(threshold_pairs(v.astype(np.float32), 0.9, device="cpu")) == 0


def test_a_namespace_whose_block_exceeds_the_budget_is_tiled(monkeypatch):
    import consolidate.similarity.engines.torch_engine as sim

    seen = []
    real = sim._small_block_candidates
    monkeypatch.setattr(
        sim,
        "_small_block_candidates",
        lambda vt, st, sz, *a: seen.append(sz.tolist()) or real(vt, st, sz, *a),
    )
    v, seg = data(300, 16, 1, seed=7)
    seg = np.where(np.arange(300) < 40, 1, 0)  # namespaces of 260 and 40 rows
    ref = reference(v, seg, 0.8)
    # 300 x 64 tiles: the budget per block is max(300 * 64, 2^16) scores; the 260-row
    # namespace pads to 288 (288^2 = 82,944 scores: tiled), the 40-row one to 40 (one block)
    got = threshold_pairs(v, 0.8, segments=seg, device="cpu", tile_rows=300, tile_cols=64)
    assert set(zip(got.i.tolist(), got.j.tolist(), strict=True)) == ref and len(ref) > 0
    assert seen == [[40]]


def test_explicit_tile_rows_keep_the_memory_budget(monkeypatch):
    import consolidate.similarity.engines.torch_engine as sim

    shapes = []
    real = sim._tile_topk
    monkeypatch.setattr(
        sim, "_tile_topk", lambda s, kt: shapes.append(tuple(s.shape)) or real(s, kt)
    )
    g = np.random.default_rng(2)
    v = g.normal(size=(9000, 4)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    budget = 16 * 4096 * 1024  # auto: 4096 rows x 1024 columns
    got = topk_neighbours(v, v, 3, device="cpu", tile_rows=8192, budget_bytes=budget)
    assert {c for _, c in shapes} == {512, 9000 % 512}  # 8192 rows x 512 columns
    assert max(r for r, _ in shapes) == 8192
    assert (got.indices[:, 0] == np.arange(9000)).all()


def test_bad_arguments_are_value_errors_before_any_work():
    e = np.eye(3, dtype=np.float32)
    for rows, cols in [(0, None), (-1, 4), (4, 0), (2.0, 4), (True, 4)]:
        with pytest.raises(ValueError, match="tile_rows|tile_cols"):
            threshold_pairs(e, 0.9, device="cpu", tile_rows=rows, tile_cols=cols)
        with pytest.raises(ValueError, match="tile_rows|tile_cols"):
            topk_neighbours(e, e, 1, device="cpu", tile_rows=rows, tile_cols=cols)
    with pytest.raises(ValueError, match="k must be an integer"):
        topk_neighbours(e, e, 2.5, device="cpu")
    with pytest.raises(ValueError, match="threshold"):
        threshold_pairs(e, float("nan"), device="cpu")
    with pytest.raises(ValueError, match="integer namespace codes"):
        threshold_pairs(e, 0.9, segments=np.array([0.2, 0.7, 0.2]), device="cpu")
    with pytest.raises(ValueError, match="integer namespace codes"):
        topk_neighbours(e, e, 1, query_segments=np.zeros(3), key_segments=np.zeros(3), device="cpu")
    # wrong lengths are caught even where there is nothing to compute
    with pytest.raises(ValueError, match="segments"):
        threshold_pairs(e[:1], 0.9, segments=np.zeros(5, np.int64), device="cpu")
    with pytest.raises(ValueError, match="key_segments"):
        topk_neighbours(
            e,
            e[:0],
            1,
            query_segments=np.zeros(3, np.int64),
            key_segments=np.zeros(7, np.int64),
            device="cpu",
        )


def test_tensors_that_require_grad_are_accepted():
    v = torch.eye(3, requires_grad=True)
    v2 = torch.cat([v, v[:1]])  # row 3 duplicates row 0
    got = threshold_pairs(v2, 0.99, device="cpu")
    assert list(zip(got.i.tolist(), got.j.tolist(), strict=True)) == [(0, 3)]
    assert topk_neighbours(v2, v2, 1, device="cpu").indices[:, 0].tolist() == [0, 1, 2, 0]


def test_vectors_that_are_not_unit_are_refused_by_row():
    g = np.random.default_rng(5)
    v = g.normal(size=(6, 8))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    v[1] *= 3.0
    v[4] *= 0.99  # 1e-2 off: never normalised, not rounding
    with pytest.raises(
        ValueError,
        match=r"vectors: 2 row\(s\) are not unit vectors .* "
        r"rows \[1, 4\] with norms \[3\.0, 0\.99\]",
    ):
        threshold_pairs(torch.from_numpy(v).float(), 0.5, device="cpu")
    with pytest.raises(ValueError, match=r"keys: 2 row\(s\) are not unit vectors"):
        topk_neighbours(
            torch.from_numpy(v[:1]).float(), torch.from_numpy(v).float(), 2, device="cpu"
        )
    # the rounding of vectors stored as bf16 is accepted (and the pairs stay exact)
    from consolidate.store.vectors import stored_vectors

    u = g.normal(size=(300, 384))
    u = (u / np.linalg.norm(u, axis=1, keepdims=True)).astype(np.float32)
    b = stored_vectors(u, "bf16")
    assert np.abs(np.linalg.norm(b.astype(np.float64), axis=1) - 1).max() > 1e-4
    p = threshold_pairs(torch.from_numpy(b), 0.1, device="cpu")
    assert set(zip(p.i.tolist(), p.j.tolist(), strict=True)) == reference(b, np.zeros(300), 0.1)


def test_float64_rescoring_is_the_same_in_any_chunk():
    """The re-scoring's value of a pair does not depend on how many pairs share its chunk
    (so the cpu and cuda chunk sizes give one pair set), and it is the float64 dot product."""
    from consolidate.similarity.api import _rescore64

    g = torch.Generator().manual_seed(4)
    v = torch.nn.functional.normalize(torch.randn(300, 40, generator=g), dim=1)
    i = torch.randint(0, 300, (2_500,), generator=g)
    j = torch.randint(0, 300, (2_500,), generator=g)
    ref = (v.double()[i] * v.double()[j]).sum(1)
    for chunk in (None, 1, 7, 1024, 1 << 16):
        assert torch.equal(_rescore64(v, i, j, chunk=chunk), ref)


def test_topk_queries_that_are_not_unit_are_normalised_zero_ones_refused():
    """A query's length carries no meaning: 3x a unit query gives the same neighbours and
    the cosines of the unit query; a zero or NaN query is refused by row."""
    g = np.random.default_rng(11)
    keys = g.normal(size=(40, 16))
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    q = g.normal(size=(5, 16))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    kt = torch.from_numpy(keys).float()
    unit = topk_neighbours(torch.from_numpy(q).float(), kt, 4, device="cpu")
    scaled = topk_neighbours(
        torch.from_numpy(q * [[3.0], [0.5], [1.0], [7.0], [0.9]]).float(), kt, 4, device="cpu"
    )
    np.testing.assert_array_equal(scaled.indices, unit.indices)
    np.testing.assert_allclose(scaled.scores, unit.scores, atol=1e-6)
    ref = np.sort(q @ keys.T, axis=1)[:, ::-1][:, :4]  # float64 cosines
    np.testing.assert_allclose(scaled.scores, ref, atol=1e-5)
    bad = q.copy()
    bad[2] = 0.0
    bad[4, 0] = np.nan
    with pytest.raises(
        ValueError,
        match=r"queries: 2 row\(s\) are zero or contain NaN or inf, e\.g\. rows \[2, 4\]",
    ):
        topk_neighbours(torch.from_numpy(bad).float(), kt, 4, device="cpu")

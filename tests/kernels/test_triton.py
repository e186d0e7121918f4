"""Triton engine of the similarity join against float64 brute-force references.

Without CUDA the kernels run in the Triton interpreter, which has to be switched on before
``triton`` is imported, so every ``check_*`` function below runs in ONE subprocess with
``TRITON_INTERPRET=1`` (started once per session by the ``interpreted`` fixture); each
``test_interpreted[...]`` case then reports its own check with the subprocess traceback.
With CUDA the same checks also run in-process on the GPU (``gpu`` marker).

The stores are small so that the interpreter runs the whole file in well under two minutes
on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import pair_reference as ref_pairs
from tests.helpers import topk_reference as ref_topk

REPO = Path(__file__).resolve().parents[2]

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# ------------------------------------------------------------------ references and data


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def store(n: int, d: int, ns: int, seed: int, dups: float = 0.0) -> tuple[np.ndarray, ...]:
    """Random unit vectors with a share of planted near-duplicates, random namespaces."""
    g = np.random.default_rng(seed)
    v = g.normal(size=(n, d))
    m = int(n * dups)
    if m:
        dst = g.choice(n, m, replace=False)
        v[dst] = v[g.integers(0, n, m)] + g.uniform(0.05, 0.4, (m, 1)) * g.normal(size=(m, d))
    return unit(v), g.integers(0, ns, n)


def pair_set(p) -> set[tuple[int, int]]:
    return set(zip(p.i.tolist(), p.j.tolist(), strict=True))


def near_thresholds(v: np.ndarray, seg: np.ndarray) -> list[float]:
    """Thresholds just around actual same-segment similarities: 1e-9 away (far below the
    float32 error of a tile score, far above the float64 summation-order error of the
    reference) and 1e-7 away."""
    v64 = v.astype(np.float64)
    s = v64 @ v64.T
    s = s[np.triu(np.ones_like(s, bool), 1) & (seg[:, None] == seg[None, :])]
    if not s.size:
        return [0.5]
    top = np.sort(s)[::-1]
    picks = [top[min(len(top) - 1, r)] for r in (0, 3, len(top) // 10)]
    return sorted({float(p + e) for p in picks for e in (-1e-7, -1e-9, 1e-9, 1e-7)})


def assert_same_pairs(a, b) -> None:
    np.testing.assert_array_equal(a.i, b.i)
    np.testing.assert_array_equal(a.j, b.j)
    np.testing.assert_array_equal(a.sim, b.sim)


# ------------------------------------------------------------------ checks (run on `device`)


@check
def check_threshold_random_stores(device: str) -> None:
    from consolidate.similarity import threshold_pairs

    for n, d, ns, tiles in [
        (1, 8, 1, (16, 16)),
        (2, 8, 1, (16, 16)),
        (37, 16, 1, (16, 32)),
        (37, 20, 3, (32, 16)),
        (300, 24, 3, (64, 64)),
        (300, 12, 5, (128, 32)),
    ]:
        v, seg = store(n, d, ns, seed=n * d + ns)
        for t in near_thresholds(v, seg) + [0.0, 0.3]:
            got = threshold_pairs(
                v,
                t,
                segments=seg,
                device=device,
                engine="triton",
                tile_rows=tiles[0],
                tile_cols=tiles[1],
            )
            assert pair_set(got) == ref_pairs(v, seg, t), (n, d, ns, tiles, t)
            assert (got.i < got.j).all() and (got.sim >= t).all()
            # identical to the torch path (same re-scoring and sorting)
            assert_same_pairs(
                got,
                threshold_pairs(
                    v, t, segments=seg, device=device, engine="torch", tile_rows=50, tile_cols=70
                ),
            )


@check
def check_threshold_planted_duplicates(device: str) -> None:
    from consolidate.kernels import triton_join
    from consolidate.similarity import threshold_pairs

    v, seg = store(257, 32, 4, seed=7, dups=0.4)
    for t in (0.8, 0.9, 0.97):
        ref = ref_pairs(v, seg, t)
        assert ref, t
        for tiles in [(16, 16), (32, 64), (64, 64), (128, 128)]:
            got = threshold_pairs(
                v,
                t,
                segments=seg,
                device=device,
                engine="triton",
                tile_rows=tiles[0],
                tile_cols=tiles[1],
            )
            assert pair_set(got) == ref, (t, tiles)
            st = triton_join.LAST_JOIN_STATS
            assert st.launches == 1 and st.passes == 1
            assert (st.block_m, st.block_n) == tiles


@check
def check_threshold_tile_rounding(device: str) -> None:
    """Torch-style tile sizes map onto power-of-two Triton blocks in [16, 128]."""
    from consolidate.kernels import triton_join
    from consolidate.similarity import threshold_pairs

    v, seg = store(90, 16, 2, seed=5, dups=0.3)
    for tiles, blocks in [
        ((100, 77), (64, 64)),
        ((4096, 4096), (128, 128)),
        ((3, 20), (16, 16)),
        ((None, None), (64, 64)),
    ]:
        got = threshold_pairs(
            v,
            0.85,
            segments=seg,
            device=device,
            engine="triton",
            tile_rows=tiles[0],
            tile_cols=tiles[1],
        )
        assert pair_set(got) == ref_pairs(v, seg, 0.85)
        st = triton_join.LAST_JOIN_STATS
        assert (st.block_m, st.block_n) == blocks, (tiles, st)


@check
def check_threshold_dtypes(device: str) -> None:
    from consolidate.similarity import threshold_pairs

    v, seg = store(200, 64, 2, seed=3, dups=0.4)
    for dtype in ("fp32", "tf32", "bf16", "fp16"):
        for t in (0.9, *near_thresholds(v, seg)[:3]):
            got = threshold_pairs(
                v,
                t,
                segments=seg,
                device=device,
                dtype=dtype,
                engine="triton",
                tile_rows=32,
                tile_cols=64,
            )
            assert pair_set(got) == ref_pairs(v, seg, t), (dtype, t)


@check
def check_many_tiny_namespaces_one_launch(device: str) -> None:
    from consolidate.kernels import triton_join
    from consolidate.similarity import threshold_pairs

    g = np.random.default_rng(11)
    sizes = g.integers(1, 8, 150)  # 150 namespaces of 1-7 rows, shuffled rows
    seg = np.repeat(np.arange(150), sizes)
    perm = g.permutation(seg.size)
    seg = seg[perm]
    v, _ = store(seg.size, 16, 1, seed=2, dups=0.5)
    got = threshold_pairs(
        v, 0.7, segments=seg, device=device, engine="triton", tile_rows=32, tile_cols=32
    )
    assert pair_set(got) == ref_pairs(v, seg, 0.7)
    st = triton_join.LAST_JOIN_STATS
    assert st.launches == 1 and st.passes == 1, st
    # 10^4 namespaces x 100 rows: one launch of ~5 * 10^4 tile programs (host tile list)
    ends = np.repeat(np.arange(1, 10**4 + 1) * 100, 100)
    chunks = triton_join.tile_list(ends, 64, 64)
    assert len(chunks) == 1
    rt, ct = chunks[0]
    assert 3 * 10**4 < rt.size < 6 * 10**4
    # every tile pair meets the upper triangle of a segment; consecutive programs
    # share row tiles (groups of 8 row tiles, column-major inside a group)
    r0, c0 = rt.astype(np.int64) * 64, ct.astype(np.int64) * 64
    assert (c0 + 63 > r0).all() and (c0 < ends[np.minimum(r0 + 63, ends.size - 1)]).all()
    assert np.all(np.diff(rt // 8) >= 0)
    assert len(set(zip(rt.tolist(), ct.tolist(), strict=True))) == rt.size


@check
def check_tile_list_covers_every_pair(device: str) -> None:
    """Every same-segment upper-triangle entry lies in exactly one listed tile."""
    from consolidate.kernels import triton_join

    g = np.random.default_rng(4)
    for sizes, bm, bn in [
        ([1, 1, 1], 16, 16),
        ([5, 1, 40, 2, 90, 1], 16, 32),
        ([200], 64, 16),
        (g.integers(1, 30, 40).tolist(), 32, 16),
    ]:
        seg = np.repeat(np.arange(len(sizes)), sizes)
        n = seg.size
        _, counts = np.unique(seg, return_counts=True)
        ends = np.repeat(np.cumsum(counts), counts)
        cover = np.zeros((n, n), np.int64)
        for rt, ct in triton_join.tile_list(ends, bm, bn, max_tiles=7):
            for r, c in zip(rt.tolist(), ct.tolist(), strict=True):
                cover[r * bm : (r + 1) * bm, c * bn : (c + 1) * bn] += 1
        need = np.triu(seg[:, None] == seg[None, :], 1)
        assert (cover[need] == 1).all(), sizes
        assert cover.max() <= 1


@check
def check_overflow_rerun(device: str) -> None:
    from consolidate.kernels import triton_join
    from consolidate.similarity import threshold_pairs

    v, seg = store(120, 16, 2, seed=9, dups=0.5)
    ref = threshold_pairs(v, 0.6, segments=seg, device=device, engine="torch")
    old = triton_join.INITIAL_CAPACITY
    try:
        for cap in (1, 3):
            triton_join.INITIAL_CAPACITY = cap
            got = threshold_pairs(
                v, 0.6, segments=seg, device=device, engine="triton", tile_rows=32, tile_cols=32
            )
            st = triton_join.LAST_JOIN_STATS
            assert st.passes == 2 and st.capacity == st.candidates > cap, st
            assert_same_pairs(got, ref)
    finally:
        triton_join.INITIAL_CAPACITY = old
    # direct call, explicit capacity
    vt = torch.from_numpy(v).to(device)
    ends = torch.full((120,), 120)
    i, j = triton_join.threshold_candidates(vt, ends, 0.5, capacity=2, block_m=16, block_n=16)
    assert triton_join.LAST_JOIN_STATS.passes == 2
    assert set(zip(i.tolist(), j.tolist(), strict=True)) == ref_pairs(v, np.zeros(120), 0.5)


@check
def check_topk_random(device: str) -> None:
    from consolidate.similarity import topk_neighbours

    for nq, n, segs, k, tiles in [
        (1, 1, 1, 1, (None, None)),
        (37, 211, 1, 10, (16, 16)),
        (50, 300, 4, 7, (32, 64)),
        (64, 90, 9, 20, (None, None)),
        (33, 5, 2, 10, (16, 16)),
        (40, 150, 3, 33, (16, 32)),
        (20, 200, 1, 128, (None, 128)),
    ]:
        g = np.random.default_rng(nq * n + k)
        keys = unit(g.normal(size=(n, 24)))
        q = unit(keys[g.integers(0, n, nq)] + 0.3 * g.normal(size=(nq, 24)))
        qseg, kseg = g.integers(0, segs, nq), g.integers(0, segs, n)
        got = topk_neighbours(
            q,
            keys,
            k,
            query_segments=qseg,
            key_segments=kseg,
            device=device,
            engine="triton",
            tile_rows=tiles[0],
            tile_cols=tiles[1],
        )
        assert got.indices.shape == (nq, k) and got.scores.dtype == np.float32
        assert got.indices.tolist() == ref_topk(q, keys, qseg, kseg, k), (nq, n, segs, k)
        valid = got.indices >= 0
        v64 = (q.astype(np.float64)[:, None, :] * keys.astype(np.float64)[got.indices.clip(0)]).sum(
            -1
        )
        np.testing.assert_allclose(got.scores[valid], v64[valid], atol=1e-5)
        assert np.isneginf(got.scores[~valid]).all()
        torch_got = topk_neighbours(
            q, keys, k, query_segments=qseg, key_segments=kseg, device=device, engine="torch"
        )
        np.testing.assert_array_equal(got.indices, torch_got.indices)


@check
def check_topk_segments_without_keys(device: str) -> None:
    from consolidate.kernels import triton_join
    from consolidate.similarity import topk_neighbours

    g = np.random.default_rng(1)
    keys = unit(g.normal(size=(60, 8)))
    q = unit(g.normal(size=(70, 8)))
    qseg = g.integers(0, 6, 70)  # segments 4 and 5 have no keys
    kseg = g.integers(0, 4, 60)
    got = topk_neighbours(
        q,
        keys,
        4,
        query_segments=qseg,
        key_segments=kseg,
        device=device,
        engine="triton",
        tile_rows=16,
        tile_cols=16,
    )
    assert got.indices.tolist() == ref_topk(q, keys, qseg, kseg, 4)
    assert (got.indices[qseg >= 4] == -1).all()
    assert triton_join.LAST_TOPK_STATS.launches == 1


@check
def check_topk_ties_lower_position_wins(device: str) -> None:
    """Small-integer vectors give exact, tied scores: lower key position first."""
    from consolidate.kernels import triton_join

    g = np.random.default_rng(2)
    keys = torch.from_numpy(g.integers(-2, 3, (80, 16)).astype(np.float32))
    keys[40:] = keys[:40]  # every score is tied at least twice
    q = torch.from_numpy(g.integers(-2, 3, (20, 16)).astype(np.float32))
    lo, hi = torch.zeros(20, dtype=torch.int64), torch.full((20,), 80)
    scores, idx = triton_join.topk_candidates(
        q.to(device), keys.to(device), lo, hi, 9, block_m=16, block_n=16
    )
    s = q.double() @ keys.double().T
    for r in range(20):
        order = np.lexsort((np.arange(80), -s[r].numpy()))[:9]
        assert idx[r].tolist() == order.tolist(), r
        assert scores[r].tolist() == s[r, order].tolist()


@check
def check_topk_reduced_precision(device: str) -> None:
    from consolidate.similarity import topk_neighbours

    g = np.random.default_rng(3)
    keys = unit(g.normal(size=(120, 32)))
    q = unit(keys[:30] + 0.5 * g.normal(size=(30, 32)))
    s = q.astype(np.float64) @ keys.astype(np.float64).T
    kth = np.sort(s, 1)[:, ::-1][:, 4]
    for dtype, tol in (("bf16", 3e-2), ("fp16", 6e-3), ("tf32", 4e-3)):
        got = topk_neighbours(q, keys, 5, device=device, dtype=dtype, engine="triton")
        assert (got.indices >= 0).all()
        true = np.take_along_axis(s, got.indices, 1)
        # every returned key is within the dtype error of the true 5th best
        assert (true >= kth[:, None] - 2 * tol).all(), dtype
        np.testing.assert_allclose(got.scores, true, atol=tol)


@check
def check_topk_k_limit(device: str) -> None:
    from consolidate.similarity import topk_neighbours

    v = unit(np.random.default_rng(0).normal(size=(200, 8)))
    with_err = None
    try:
        topk_neighbours(v[:3], v, 129, device=device, engine="triton")
    except ValueError as e:
        with_err = str(e)
    assert with_err and "128" in with_err
    # k beyond the number of keys is padded, not an error
    got = topk_neighbours(v[:3], v[:5], 300, device=device, engine="triton")
    assert got.indices.shape == (3, 300) and (got.indices[:, 5:] == -1).all()


# ------------------------------------------------------------------ runners


def run_checks(device: str, names: list[str]) -> dict[str, dict]:
    """Run checks by name; returns ``{name: {"ok": bool, "error": str, "s": seconds}}``."""
    out = {}
    for name in names:
        t = time.perf_counter()
        try:
            CHECKS[name](device)
            out[name] = {"ok": True, "error": "", "s": time.perf_counter() - t}
        except Exception:  # report every failure, keep going
            out[name] = {"ok": False, "error": traceback.format_exc(), "s": time.perf_counter() - t}
    return out


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, dict]:
    """All checks on cpu in one ``TRITON_INTERPRET=1`` subprocess."""
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("triton") / "results.json"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    code = (
        "import json, sys; from tests.kernels.test_triton import CHECKS, run_checks; "
        "json.dump(run_checks('cpu', list(CHECKS)), open(sys.argv[1], 'w'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode or not out.exists():
        pytest.fail(
            f"interpreter subprocess failed (rc={proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKS))
def test_interpreted(name, interpreted):
    res = interpreted[name]
    assert res["ok"], f"{name} failed under TRITON_INTERPRET=1:\n{res['error']}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CHECKS))
def test_cuda(name):
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set; the cuda checks need compiled kernels")
    pytest.importorskip("triton")
    res = run_checks("cuda", [name])[name]
    assert res["ok"], res["error"]


@pytest.mark.gpu
def test_cuda_ten_thousand_namespaces_one_launch():
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    pytest.importorskip("triton")
    from consolidate.kernels import triton_join
    from consolidate.similarity import threshold_pairs

    v, _ = store(10**6, 32, 1, seed=0, dups=0.1)
    seg = np.repeat(np.arange(10**4), 100)
    got = threshold_pairs(v, 0.8, segments=seg, device="cuda", engine="triton")
    st = triton_join.LAST_JOIN_STATS
    assert st.launches == 1 and st.passes == 1, st
    torch_got = threshold_pairs(v, 0.8, segments=seg, device="cuda", engine="torch")
    assert_same_pairs(got, torch_got)


def test_auto_on_cpu_does_not_import_triton():
    code = (
        "import sys, numpy as np; from consolidate.similarity import threshold_pairs, "
        "topk_neighbours; v = np.eye(4, dtype=np.float32); "
        "threshold_pairs(v, 0.5, device='cpu'); topk_neighbours(v, v, 2, device='cpu'); "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# ------------------------------------------------------------------ compiled (no GPU needed)

AOT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from consolidate.kernels import triton_join as tj

def compile_(fn, sig, consts):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return {"shared": k.metadata.shared, "cubin": len(k.asm["cubin"])}

out = {}
join_sig = {"v_ptr": "", "ends_ptr": "*i32", "tile_r_ptr": "*i32", "tile_c_ptr": "*i32",
            "out_i_ptr": "*i32", "out_j_ptr": "*i32", "counter_ptr": "*i64", "n": "i32",
            "d": "i32", "stride_v": "i32", "cand": "fp32", "capacity": "i32"}
for dt, size, bm, tf32 in [("*fp32", 4, 128, True), ("*bf16", 2, 64, False)]:
    bk = tj._block_k(384, bm, bm, size)
    out[f"join {dt} {bm}"] = compile_(tj._threshold_join_kernel, {**join_sig, "v_ptr": dt},
        {"BLOCK_M": bm, "BLOCK_N": bm, "BLOCK_K": bk, "IS_FP32": dt == "*fp32",
         "ALLOW_TF32": tf32, "UPCAST": False})
topk_sig = {"q_ptr": "*fp32", "k_ptr": "*fp32", "lo_ptr": "*i32", "hi_ptr": "*i32",
            "tlo_ptr": "*i32", "thi_ptr": "*i32", "out_ptr": "*i64", "nq": "i32", "d": "i32",
            "stride_q": "i32", "stride_k": "i32"}
out["topk fp32 kp16"] = compile_(tj._topk_kernel, topk_sig,
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "KP": 16, "IS_FP32": True,
     "ALLOW_TF32": False, "UPCAST": False})
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    """The kernels compile (Triton -> PTX -> cubin with the wheel's ptxas) for an H100/H200
    target without a GPU, within ~99 KiB of shared memory; catches what the interpreter
    does not (types of loop-carried values, scalar atomics, dot operand shapes)."""
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run(
        [sys.executable, "-c", AOT, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert len(res) == 3
    for name, r in res.items():
        assert r["cubin"] > 0 and r["shared"] <= 99 << 10, (name, r)

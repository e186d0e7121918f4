#!/usr/bin/env python3
"""Benchmark the similarity join and top-k search against what a user would write instead.

Everything is measured in the same run, on the same data: our engines (``threshold_pairs`` /
``topk_neighbours`` with engine torch, triton where CUDA and triton are there, faiss where
installed), naive torch tiles, numpy tiles on the cpu, raw faiss-cpu ``range_search`` /
``search``, sentence-transformers ``util.paraphrase_mining_embeddings``,
``util.community_detection`` and ``util.semantic_search``, and a per-namespace Python loop
over our engine; plus the device's matmul peak, so each method's achieved TFLOP/s is also a
share of what the hardware did in this run.

Timing: two warm-up calls (one if the first takes over a second) on a slice of the input
(the first ``--warm-rows`` rows; whole namespaces for the many-namespaces case), then up to
``--repeats`` timed calls on the full input, best kept; a call slower than ``--slow-s`` is
not repeated (``runs`` column). A method whose time extrapolated from the warm-up would
overrun the remaining ``--budget-s`` is skipped and says so. Results are written after
every method, so a run cut short still leaves its table.

Recall (and precision) are against a float64 brute-force reference: all pairs when
``n <= --full-ref-max`` (then also timed as the method "torch float64 tiles"), otherwise the
pairs that touch ``--ref-sample`` random rows; top-k against float64 top-k of up to
``--ref-sample`` queries.

Whole pass (``--only pass``, or after the similarity cases): a synthetic store of n records
(d = 384, namespaces of 100 / 10^4 / 10^5 rows, planted exact duplicates and paraphrase
clusters; ``scripts/pass_bench.py``) is written as a real store by one process, then a fresh
process loads it, runs ``run_pass`` and commits, reporting the load, per-stage, pass and
commit times and the peak RSS (``VmHWM``) against the store's vector + text bytes. With
``--pass-baseline REV`` the same is measured for the ``consolidate/`` package of git revision
REV (exported with ``git archive``) on a copy of the same store: ``ours x faster``.

Usage::

    .venv/bin/python scripts/benchmark.py --only sim            # cpu similarity cases, 3-4 min
    # cpu whole-pass cases against the pass before the rewrite (5244916); the baseline only at
    # n = 10^5 (at n = 10^6 it takes ~220 s and ~10 GB; drop the limit to measure it there)
    .venv/bin/python scripts/benchmark.py --only pass --pass-baseline 5244916 \\
        --pass-baseline-max-n 100000
    .venv/bin/python scripts/benchmark.py --only pass --pass-sizes 100000  # n = 10^5 only
    python3 scripts/benchmark.py --preset gpu --out $OUT/bench  # H200 subset, ~5 min + passes
    python3 scripts/benchmark.py --preset tiny --out /tmp/b     # seconds: a smoke test

The LOCOMO case embeds the observations (data dir ``../shared/data`` or
``CONSOLIDATE_DATA_DIR``; needs hydra-core and the embedding model package) or reads vectors
saved earlier (``--save-locomo-npz`` / ``--locomo-npz``); without either it is skipped.

Output folder (``--out``): ``results.parquet``, ``report.md``, ``benchmark.png``,
``meta.json``, and ``pass_results.json`` (the whole-pass children's own JSON). The ratio
lines of our engine against each baseline are printed last.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

#: the folder a git checkout of this package is in (for ``pass_baseline`` and the git state)
REPO = Path(__file__).resolve().parents[2]

from consolidate.bench.pass_bench import PeakRSS  # noqa: E402
from consolidate.config import BenchConfig  # noqa: E402
from consolidate.device import resolve_device  # noqa: E402
from consolidate.environment import (  # noqa: E402
    device_name,
    git_commit,
    machine,
    package_versions,
)
from consolidate.ops.cluster import centroid_clusters  # noqa: E402
from consolidate.similarity import TopK, threshold_pairs, topk_neighbours  # noqa: E402
from consolidate.similarity.engines.faiss_engine import recall_at_k  # noqa: E402

HAS_FAISS = importlib.util.find_spec("faiss") is not None
HAS_ST = importlib.util.find_spec("sentence_transformers") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
TORCH_DTYPE = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


class Skip(Exception):
    """A method that cannot run here (missing package, over a size cap, over budget)."""


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One benchmark input and the methods to run on it.

    kind: ``join`` (pairs >= threshold, one namespace), ``namespaces`` (join within
    ``namespaces`` namespaces of ``n / namespaces`` rows), ``topk`` (``q`` queries, the first
    rows of the store, against all ``n`` rows; with ``namespaces > 1``, each query only
    against the keys of its namespace).
    """

    kind: str
    n: int
    d: int
    dtype: str
    threshold: float | None = None
    k: int | None = None
    q: int | None = None
    namespaces: int = 1
    source: str = "random"
    methods: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        src = "LOCOMO " if self.source == "locomo" else ""
        if self.kind == "topk":
            ns = f" ns={self.namespaces}" if self.namespaces > 1 else ""
            return f"{src}top-{self.k} q={self.q} n={self.n}{ns} d={self.d} {self.dtype}"
        ns = (
            f" ns={self.namespaces}x{self.n // max(1, self.namespaces)}"
            if self.kind == "namespaces"
            else ""
        )
        return f"{src}join n={self.n}{ns} d={self.d} {self.dtype} t={self.threshold}"


JOIN = [
    "ours (torch)",
    "ours (triton)",
    "ours (faiss)",
    "naive torch tiles",
    "numpy tiles",
    "faiss range_search",
]
ST_JOIN = ["ours pairs + clusters", "st paraphrase_mining", "st community_detection"]
TOPK = [
    "ours (torch)",
    "ours (triton)",
    "ours (faiss)",
    "naive torch tiles",
    "numpy tiles",
    "faiss search",
    "st semantic_search",
    "faiss IVF (approx)",
]
NS = [
    "ours (torch)",
    "ours (triton)",
    "ours (faiss)",
    "loop over ours per namespace",
    "numpy loop per namespace",
    "padded torch.bmm",
]
TOPK_NS = NS[:-1]  # the same method names, top-k variants (padded bmm is a join only)


def preset_cases(preset: str) -> tuple[list[Case], dict[str, Any]]:
    """Cases of a preset and its defaults (budget, caps).

    Raises:
        SystemExit: an unknown preset.
    """
    presets = {"cpu": _cpu_cases, "gpu": _gpu_cases, "tiny": _tiny_cases}
    if preset not in presets:
        raise SystemExit(f"unknown preset {preset!r}")
    return presets[preset]()


def _cpu_cases() -> tuple[list[Case], dict[str, Any]]:
    """The cpu preset: cases for a 2-core machine."""
    return [
        Case("join", 50_000, 384, "fp32", 0.9, methods=JOIN),
        Case(
            "join",
            10_000,
            384,
            "fp32",
            0.9,
            methods=["ours (torch)", "ours (faiss)", "numpy tiles"] + ST_JOIN,
        ),
        Case("topk", 50_000, 384, "fp32", k=10, q=5_000, methods=TOPK),
        Case("namespaces", 200_000, 384, "fp32", 0.9, namespaces=2_000, methods=NS),
        Case("namespaces", 100_000, 384, "fp32", 0.9, namespaces=1_000, methods=NS),
        Case("topk", 200_000, 384, "fp32", k=10, q=20_000, namespaces=2_000, methods=TOPK_NS),
        Case(
            "join",
            0,
            384,
            "fp32",
            0.9,
            source="locomo",
            methods=["ours (torch)", "ours (faiss)", "numpy tiles", "faiss range_search"] + ST_JOIN,
        ),
    ], {
        "budget_s": 300.0,
        "cpu_cap_tflop": 1.5,
        "st_cap_n": 10_000,
        "locomo_conv": 2,
        "repeats": 3,
        "slow_s": 2.0,
        "warm_rows": 4096,
    }


def _gpu_cases() -> tuple[list[Case], dict[str, Any]]:
    """The gpu preset: the leading cases of the issue's grid, most important first; the rest
    of the grid (n=1e4, d=1024 at 0.85/0.95, k=100) runs only while the time budget lasts."""
    # the leading cases of the grid, most important first; the rest of the grid
    # (n=1e4, d=1024 at 0.85/0.95, k=100) runs only while the time budget lasts
    return [
        Case("join", 1_000_000, 1024, "bf16", 0.9, methods=JOIN),
        Case("join", 1_000_000, 384, "bf16", 0.9, methods=JOIN),
        Case(
            "topk",
            1_000_000,
            1024,
            "bf16",
            k=10,
            q=1_000_000,
            methods=["ours (torch)", "ours (triton)", "ours (faiss)", "naive torch tiles"],
        ),
        Case("namespaces", 1_000_000, 384, "bf16", 0.9, namespaces=10_000, methods=NS),
        Case("topk", 1_000_000, 384, "bf16", k=10, q=100_000, namespaces=10_000, methods=TOPK_NS),
        Case("join", 100_000, 384, "bf16", 0.9, methods=JOIN + ST_JOIN),
        Case("join", 0, 384, "bf16", 0.9, source="locomo", methods=JOIN + ST_JOIN),
        Case("join", 100_000, 1024, "bf16", 0.85, methods=JOIN[:4]),
        Case("join", 100_000, 1024, "bf16", 0.95, methods=JOIN[:4]),
        Case(
            "topk",
            100_000,
            384,
            "bf16",
            k=100,
            q=100_000,
            methods=TOPK[:4] + ["st semantic_search"],
        ),
        Case("join", 10_000, 384, "bf16", 0.9, methods=JOIN + ST_JOIN),
        Case(
            "join",
            1_000_000,
            384,
            "bf16",
            0.9,
            methods=["ours pairs + clusters", "st community_detection"],
        ),
    ], {
        "budget_s": 270.0,
        "cpu_cap_tflop": 4.0,
        "st_cap_n": 1_000_000,
        "locomo_conv": 10,
        "repeats": 3,
        "slow_s": 5.0,
        "warm_rows": 65_536,
    }


def _tiny_cases() -> tuple[list[Case], dict[str, Any]]:
    """The tiny preset: a smoke test (fixed costs dominate its times)."""
    return [
        Case("join", 3_000, 64, "fp32", 0.9, methods=JOIN + ST_JOIN),
        Case("topk", 3_000, 64, "fp32", k=10, q=500, methods=TOPK),
        Case("namespaces", 2_000, 64, "fp32", 0.9, namespaces=20, methods=NS),
        Case("topk", 2_000, 64, "fp32", k=10, q=400, namespaces=20, methods=TOPK_NS),
    ], {
        "budget_s": 60.0,
        "cpu_cap_tflop": 0.1,
        "st_cap_n": 10_000,
        "locomo_conv": 1,
        "repeats": 2,
        "slow_s": 1.0,
        "warm_rows": 512,
    }


# --------------------------------------------------------------------------- data


def make_store(
    n: int,
    d: int,
    seed: int,
    device: torch.device,
    dup_frac: float = 0.1,
    cos: tuple[float, float] = (0.8, 0.995),
    seg: np.ndarray | None = None,
) -> torch.Tensor:
    """``float32 [n, d]`` random unit vectors; ``dup_frac * n`` rows replaced by near-copies
    of other rows at a cosine drawn uniformly from ``cos`` (so every threshold in that range
    has pairs on both sides of it). With ``seg`` (namespace codes, changed in place) a
    near-copy moves into its source's namespace."""
    g = torch.Generator(device=device).manual_seed(seed)
    v = torch.randn(n, d, generator=g, device=device)
    v = torch.nn.functional.normalize(v, dim=1)
    m = int(n * dup_frac)
    if m:
        dst = torch.randperm(n, generator=g, device=device)[:m]
        src = torch.randint(0, n, (m,), generator=g, device=device)
        c = torch.empty(m, 1, device=device).uniform_(*cos, generator=g)
        u = torch.nn.functional.normalize(torch.randn(m, d, generator=g, device=device), dim=1)
        base = v[src]
        u = torch.nn.functional.normalize(u - (u * base).sum(1, keepdim=True) * base, dim=1)
        v[dst] = torch.nn.functional.normalize(c * base + (1 - c * c).sqrt() * u, dim=1)
        if seg is not None:
            seg[dst.cpu().numpy()] = seg[src.cpu().numpy()]
    return v


def locomo_store(
    conversations: int, device: torch.device, npz: str | None = None, save: str | None = None
) -> tuple[torch.Tensor, np.ndarray]:
    """Embedded LOCOMO observations and namespace codes, or :class:`Skip` with the reason.

    ``npz``: read ``vectors``/``codes`` saved earlier with ``save`` instead of embedding (a
    machine without the data or the embedding model can still run the case).
    """
    if npz:
        if not Path(npz).exists():
            raise Skip(f"no LOCOMO vectors at {npz}")
        with np.load(npz) as z:  # the store as saved (its conversations, not ``conversations``)
            v, codes = z["vectors"].astype(np.float32), z["codes"].astype(np.int64)
        return torch.from_numpy(np.ascontiguousarray(v)), codes
    data = Path(os.environ.get("CONSOLIDATE_DATA_DIR", Path("..") / "shared" / "data"))
    path = data / "locomo" / "locomo10.json"
    if not path.exists():
        raise Skip(f"LOCOMO not found at {path} (set CONSOLIDATE_DATA_DIR)")
    try:
        from consolidate.embed import Embedder
        from consolidate.store.locomo import locomo_records

        emb = Embedder(device=str(device), show_progress=False)
    except Exception as e:  # missing hydra/omegaconf, model package, ...
        raise Skip(f"LOCOMO store unavailable: {type(e).__name__}: {e}") from e
    recs, _ = locomo_records(path, emb, conversations=conversations)
    codes, _ = pd.factorize(recs.meta["namespace"], sort=True)
    v = np.ascontiguousarray(recs.vectors, np.float32)
    if save:
        np.savez(save, vectors=v, codes=codes.astype(np.int64))
    return torch.from_numpy(v), codes.astype(np.int64)


# --------------------------------------------------------------------------- measurement


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (cuda), so that a timer reads finished work; a
    no-op on the cpu."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: str, size: int, reps: int = 5) -> float:
    """Best TFLOP/s of a ``size``^3 matmul in ``dtype`` on ``device``."""
    tdt = TORCH_DTYPE[dtype]
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=g, device=device).to(tdt)
    b = torch.randn(size, size, generator=g, device=device).to(tdt)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        for _ in range(2):
            a @ b
        sync(device)
        best = math.inf
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            sync(device)
            best = min(best, time.perf_counter() - t)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return 2 * size**3 / best / 1e12


@dataclass
class Ctx:
    """The inputs of one case (or of its warm-up slice) as each method wants them."""

    case: Case
    device: torch.device
    v: torch.Tensor  # float32 [n, d] on device
    seg: np.ndarray | None  # int64 [n] namespace codes
    args: BenchConfig
    cache: dict[str, Any] = field(default_factory=dict)
    _host: np.ndarray | None = None

    @property
    def host(self) -> np.ndarray:
        """float32 numpy copy for the cpu baselines (made once)."""
        if self._host is None:
            self._host = np.ascontiguousarray(self.v.cpu().numpy(), np.float32)
        return self._host

    @property
    def n(self) -> int:
        return int(self.v.shape[0])

    @property
    def q(self) -> int:
        return min(self.case.q or self.n, self.n)

    @property
    def seg_t(self) -> torch.Tensor | None:
        return None if self.seg is None else torch.from_numpy(self.seg)

    def slice(self, rows: int) -> Ctx:
        """The first ``rows`` rows (whole namespaces for a namespace case: the first
        ``rows / rows-per-namespace`` codes), for the warm-up."""
        if self.seg is not None and self.case.kind == "namespaces":
            per = max(1, self.n // max(1, self.case.namespaces))
            keep = np.flatnonzero(self.seg < max(1, rows // per))
            sub = Case(**{**self.case.__dict__, "n": keep.size, "namespaces": max(1, rows // per)})
            idx = torch.from_numpy(keep).to(self.device)
            return Ctx(sub, self.device, self.v[idx], self.seg[keep], self.args)
        rows = min(rows, self.n)
        sub = Case(**{**self.case.__dict__, "n": rows, "q": min(self.q, max(1, rows // 4))})
        return Ctx(
            sub,
            self.device,
            self.v[:rows],
            None if self.seg is None else self.seg[:rows],
            self.args,
        )


def flops(ctx: Ctx) -> float:
    """Useful flops: ``2 n^2 d / 2`` per namespace for a join, ``2 q n d`` for top-k."""
    d = ctx.v.shape[1]
    if ctx.case.kind == "topk":
        if ctx.seg is None:
            return 2.0 * ctx.q * ctx.n * d
        m = int(ctx.seg.max()) + 1
        qc = np.bincount(ctx.seg[: ctx.q], minlength=m).astype(np.float64)
        return float(2.0 * (qc * np.bincount(ctx.seg, minlength=m)).sum() * d)
    if ctx.seg is None:
        return float(ctx.n) ** 2 * d
    counts = np.bincount(ctx.seg - ctx.seg.min()).astype(np.float64)
    return float((counts**2).sum() * d)


# --------------------------------------------------------------------------- methods
# a join method returns (i, j) int64 numpy arrays (i < j, input positions); a top-k method
# returns int64 [q, k] ids; community detection returns a list of communities.


def _faiss_gpu() -> bool:
    if not HAS_FAISS:
        return False
    import faiss

    return hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0


def _ours_engine(ctx: Ctx, engine: str, topk: bool) -> Any:
    c = ctx.case
    dev = ctx.device
    if engine == "faiss" and dev.type == "cuda" and not _faiss_gpu():
        dev = torch.device("cpu")  # faiss-cpu from cuda tensors (precheck caps the size)
    if topk:
        kw: dict[str, Any] = {"device": dev, "dtype": c.dtype}
        if ctx.seg is not None:
            kw.update(query_segments=ctx.seg[: ctx.q], key_segments=ctx.seg)
        return topk_neighbours(ctx.v[: ctx.q], ctx.v, c.k, engine=engine, **kw).indices
    kw = {"segments": ctx.seg_t, "device": dev, "dtype": c.dtype}
    p = threshold_pairs(ctx.v, c.threshold, engine=engine, **kw)
    return p.i, p.j


def _tile_rows(ctx: Ctx, cols: int, bytes_per: int = 4) -> int:
    budget = (8 << 30) if ctx.device.type == "cuda" else (512 << 20)
    return int(max(64, min(16384, budget // (bytes_per * max(cols, 1)))))


def naive_torch_join(ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
    """Row tile x (rows from the tile on): matmul -> mask -> nonzero, scores in the dtype."""
    c, dev = ctx.case, ctx.device
    v = ctx.v.to(TORCH_DTYPE[c.dtype])
    n = ctx.n
    t_rows = min(_tile_rows(ctx, n), n)
    tri = torch.ones(t_rows, t_rows, dtype=torch.bool, device=dev).triu_(1)
    out_i, out_j = [], []
    for r0 in range(0, n, t_rows):
        r1 = min(n, r0 + t_rows)
        m = (v[r0:r1] @ v[r0:].T) >= c.threshold
        m[:, : r1 - r0] &= tri[: r1 - r0, : r1 - r0]
        nz = m.nonzero()
        out_i.append(nz[:, 0] + r0)
        out_j.append(nz[:, 1] + r0)
    return torch.cat(out_i).cpu().numpy(), torch.cat(out_j).cpu().numpy()


def naive_torch_topk(ctx: Ctx) -> np.ndarray:
    """Query tile: matmul -> topk, scores in the dtype."""
    c = ctx.case
    v = ctx.v.to(TORCH_DTYPE[c.dtype])
    t_rows = _tile_rows(ctx, ctx.n)
    out = []
    for r0 in range(0, ctx.q, t_rows):
        r1 = min(ctx.q, r0 + t_rows)
        out.append(torch.topk(v[r0:r1] @ v.T, min(c.k, ctx.n), dim=1).indices)
    return torch.cat(out).cpu().numpy()


def numpy_join(ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
    """numpy float32 tiles: x[r0:r1] @ x[r0:].T -> >= t -> nonzero (upper triangle)."""
    x, t, n = ctx.host, ctx.case.threshold, ctx.n
    t_rows = 2048
    out_i, out_j = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for r0 in range(0, n, t_rows):
        r1 = min(n, r0 + t_rows)
        i, j = np.nonzero(x[r0:r1] @ x[r0:].T >= t)
        keep = j > i
        out_i.append(i[keep] + r0)
        out_j.append(j[keep] + r0)
    return np.concatenate(out_i).astype(np.int64), np.concatenate(out_j).astype(np.int64)


def numpy_topk(ctx: Ctx) -> np.ndarray:
    """numpy float32 query tiles: matmul -> argpartition -> sort."""
    x, k = ctx.host, min(ctx.case.k, ctx.n)
    out = []
    for r0 in range(0, ctx.q, 1024):
        s = x[r0 : min(ctx.q, r0 + 1024)] @ x.T
        part = np.argpartition(-s, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(s, part, 1), axis=1, kind="stable")
        out.append(np.take_along_axis(part, order, 1))
    return np.concatenate(out).astype(np.int64)


def faiss_range(ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
    """IndexFlatIP over the store, range_search of every row (full square), keep i < j."""
    import faiss

    x = ctx.host
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    lims, _, cols = index.range_search(x, ctx.case.threshold)
    rows = np.repeat(np.arange(ctx.n, dtype=np.int64), np.diff(lims).astype(np.int64))
    keep = cols > rows
    return rows[keep], cols[keep].astype(np.int64)


def faiss_search(ctx: Ctx) -> np.ndarray:
    """IndexFlatIP over the store, search of the queries."""
    import faiss

    x = ctx.host
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    return index.search(x[: ctx.q], min(ctx.case.k, ctx.n))[1].astype(np.int64)


def faiss_ivf_build(ctx: Ctx) -> None:
    """ApproxIndex IVF-Flat (nlist 4 sqrt(n), nprobe 16): built before the timing."""
    from consolidate.similarity.engines.faiss_engine import ApproxIndex

    t = time.perf_counter()
    ctx.cache["ivf"] = ApproxIndex("ivf", nprobe=16).build(ctx.host)
    ctx.cache["ivf_build_s"] = time.perf_counter() - t


def faiss_ivf(ctx: Ctx) -> np.ndarray:
    """The baseline method ``faiss IVF``: top-k of the case's queries from the IVF index the
    case built in ``ctx.cache`` (``int64 [q, k]`` neighbour positions)."""
    return ctx.cache["ivf"].search(ctx.host[: ctx.q], ctx.case.k).indices


def st_paraphrase(ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
    """util.paraphrase_mining_embeddings with its defaults (top_k=100, max_pairs=500000),
    then score >= threshold."""
    from sentence_transformers import util

    res = util.paraphrase_mining_embeddings(ctx.v)
    a = np.array(
        [(min(i, j), max(i, j)) for s, i, j in res if s >= ctx.case.threshold], np.int64
    ).reshape(-1, 2)
    return a[:, 0], a[:, 1]


def st_community(ctx: Ctx) -> list[list[int]]:
    """The baseline method ``sentence-transformers community_detection``: groups of at least
    two vectors at the case's threshold (lists of positions)."""
    from sentence_transformers import util

    return util.community_detection(ctx.v, threshold=ctx.case.threshold, min_community_size=2)


def clusters_prepare(ctx: Ctx) -> None:
    """Untimed: record ids (the pass has them) and the float32 host copy of the vectors."""
    ctx.cache["keys"] = [f"m{x:08d}" for x in range(ctx.n)]
    _ = ctx.host


def ours_clusters(ctx: Ctx) -> list[list[int]]:
    """What the pass does: our join (default engine) then centroid-checked, complete-link
    clusters (consolidate.ops.cluster, unit weights, no conflict guard), the counterpart of
    community_detection."""
    c = ctx.case
    p = threshold_pairs(ctx.v, c.threshold, segments=ctx.seg_t, device=ctx.device, dtype=c.dtype)
    cr = centroid_clusters(
        p.i, p.j, p.sim, ctx.host, np.ones(ctx.n), ctx.cache["keys"], c.threshold
    )
    return cr.clusters


def st_semantic(ctx: Ctx) -> np.ndarray:
    """The baseline method ``sentence-transformers semantic_search``: top-k of the case's
    queries (``int64 [q, k]`` positions, ``-1`` where fewer were found)."""
    from sentence_transformers import util

    res = util.semantic_search(ctx.v[: ctx.q], ctx.v, top_k=ctx.case.k)
    out = np.full((ctx.q, ctx.case.k), -1, np.int64)
    for r, hits in enumerate(res):
        out[r, : len(hits)] = [h["corpus_id"] for h in hits]
    return out


def _groups(seg: np.ndarray) -> list[np.ndarray]:
    order = np.argsort(seg, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(seg[order])) + 1)


def loop_ours(ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
    """A Python loop over namespaces, one threshold_pairs call each (default engine)."""
    out_i, out_j = [], []
    for idx in _groups(ctx.seg):
        p = threshold_pairs(
            ctx.v[torch.from_numpy(idx).to(ctx.device)],
            ctx.case.threshold,
            device=ctx.device,
            dtype=ctx.case.dtype,
        )
        a, b = idx[p.i], idx[p.j]
        out_i.append(np.minimum(a, b))
        out_j.append(np.maximum(a, b))
    return np.concatenate(out_i), np.concatenate(out_j)


def loop_ours_topk(ctx: Ctx) -> np.ndarray:
    """A Python loop over namespaces, one topk_neighbours call each (default engine)."""
    k = ctx.case.k
    out = np.full((ctx.q, k), -1, np.int64)
    for idx in _groups(ctx.seg):
        qi = idx[idx < ctx.q]  # the queries are the store's first q rows
        if not qi.size:
            continue
        t = topk_neighbours(
            ctx.v[torch.from_numpy(qi).to(ctx.device)],
            ctx.v[torch.from_numpy(idx).to(ctx.device)],
            k,
            device=ctx.device,
            dtype=ctx.case.dtype,
        )
        out[qi] = np.where(t.indices >= 0, idx[t.indices.clip(0)], -1)
    return out


def loop_numpy_topk(ctx: Ctx) -> np.ndarray:
    """A Python loop over namespaces: q @ x.T -> argpartition -> sort, float32."""
    x, k = ctx.host, ctx.case.k
    out = np.full((ctx.q, k), -1, np.int64)
    for idx in _groups(ctx.seg):
        qi = idx[idx < ctx.q]
        if not qi.size:
            continue
        s = x[qi] @ x[idx].T
        kk = min(k, idx.size)
        part = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
        order = np.argsort(-np.take_along_axis(s, part, 1), axis=1, kind="stable")
        out[qi, :kk] = idx[np.take_along_axis(part, order, 1)]
    return out


def loop_numpy(ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
    """A Python loop over namespaces: x @ x.T -> triu(>= t) -> nonzero, float32."""
    x = ctx.host
    out_i, out_j = [], []
    for idx in _groups(ctx.seg):
        xs = x[idx]
        i, j = np.nonzero(np.triu(xs @ xs.T >= ctx.case.threshold, 1))
        a, b = idx[i], idx[j]
        out_i.append(np.minimum(a, b))
        out_j.append(np.maximum(a, b))
    return np.concatenate(out_i), np.concatenate(out_j)


#: scores in one padded bmm chunk (chunk namespaces x rows x rows); ``None``: 2**20 on cpu
#: (the fastest of 2**14..2**26 at 10^5 rows in 1,000 namespaces of 100 on the 2-core
#: machine: 0.17 s, against 0.38 s at 2**26), 2**26 on cuda
BMM_CHUNK_ELEMENTS: int | None = None


def padded_bmm(ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
    """The plain GPU answer for many small namespaces: namespaces sorted by size, cut into
    chunks whose padded score block ``(B, L, L)`` (``L`` the chunk's largest namespace) holds
    at most :data:`BMM_CHUNK_ELEMENTS` scores (or a chunk of one namespace); per chunk one gather into ``(B, L, d)`` (pad
    rows zero), ``torch.bmm``, ``>= t`` on the upper triangle of valid rows, ``nonzero``.

    Returns ``(i, j)`` int64 store positions, ``i < j``, in no particular order.
    """
    dev, t = ctx.device, ctx.case.threshold
    budget = BMM_CHUNK_ELEMENTS or (1 << 26 if dev.type == "cuda" else 1 << 20)
    seg = ctx.seg if ctx.seg is not None else np.zeros(ctx.n, np.int64)
    order = np.argsort(seg, kind="stable")
    starts = np.r_[0, np.flatnonzero(np.diff(seg[order])) + 1]
    sizes = np.diff(np.r_[starts, order.size])
    by_size = np.argsort(sizes, kind="stable")
    order_t = torch.from_numpy(order).to(dev)
    out_i, out_j = [], []
    lo = 0
    while lo < by_size.size:  # one iteration per chunk, not per namespace
        big = int(sizes[by_size[lo]])
        # grow the chunk while the block of its largest (last, sorted) namespace fits
        step = max(1, budget // max(big * big, 1))
        hi = min(by_size.size, lo + step)
        while hi > lo + 1 and (hi - lo) * int(sizes[by_size[hi - 1]]) ** 2 > budget:
            hi = lo + max(1, (hi - lo) // 2)
        ns = by_size[lo:hi]
        L = int(sizes[ns].max())
        pos = torch.arange(L, device=dev)
        st_t = torch.from_numpy(starts[ns]).to(dev)
        sz_t = torch.from_numpy(sizes[ns]).to(dev)
        valid = pos[None, :] < sz_t[:, None]  # (B, L)
        rows = order_t[(st_t[:, None] + pos[None, :]).clamp(max=order.size - 1)]
        rows = torch.where(valid, rows, torch.zeros_like(rows))
        x = ctx.v[rows] * valid[..., None].to(ctx.v.dtype)  # (B, L, d)
        s = torch.bmm(x, x.transpose(1, 2))
        m = (s >= t) & valid[:, :, None] & valid[:, None, :]
        m &= torch.ones(L, L, dtype=torch.bool, device=dev).triu(1)[None]
        b, r, c = m.nonzero(as_tuple=True)
        a, z = rows[b, r], rows[b, c]
        out_i.append(torch.minimum(a, z))
        out_j.append(torch.maximum(a, z))
        lo = hi
    return torch.cat(out_i).cpu().numpy(), torch.cat(out_j).cpu().numpy()


def ref64_join(ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
    """float64 brute force in row tiles on the device (the exact reference)."""
    v = ctx.v.double()
    n, t, dev = ctx.n, ctx.case.threshold, ctx.device
    seg = None if ctx.seg is None else torch.from_numpy(ctx.seg).to(dev)
    t_rows = _tile_rows(ctx, n, 8)
    out_i, out_j = [], []
    for r0 in range(0, n, t_rows):
        r1 = min(n, r0 + t_rows)
        m = (v[r0:r1] @ v[r0:].T) >= t
        m &= torch.arange(r0, n, device=dev)[None, :] > torch.arange(r0, r1, device=dev)[:, None]
        if seg is not None:
            m &= seg[r0:r1, None] == seg[None, r0:]
        nz = m.nonzero()
        out_i.append(nz[:, 0] + r0)
        out_j.append(nz[:, 1] + r0)
    return torch.cat(out_i).cpu().numpy(), torch.cat(out_j).cpu().numpy()


@dataclass
class Method:
    """How to run one method: ``fn(ctx)``, its family, where it runs (``dev``: the chosen
    device, ``cpu``, ``faiss``: cuda with GPU faiss else cpu), its dtype (``None``: the
    case's), what it needs (``needs``: ``faiss`` / ``st`` / ``triton``), whether it is a cpu
    method capped by ``--cpu-cap-tflop``, and an untimed ``prepare(ctx)``."""

    fn: Callable[[Ctx], Any]
    family: str  # ours | baseline | reference
    where: str = "dev"
    dtype: str | None = None
    needs: str | None = None
    prepare: Callable[[Ctx], None] | None = None


def _cpu(
    fn: Callable[[Ctx], Any], needs: str | None = None, prepare: Callable[[Ctx], None] | None = None
) -> Method:
    return Method(fn, "baseline", "cpu", "fp32", needs, prepare)


_OURS_JOIN = {
    "ours (torch)": Method(lambda c: _ours_engine(c, "torch", False), "ours"),
    "ours (triton)": Method(lambda c: _ours_engine(c, "triton", False), "ours", needs="triton"),
    "ours (faiss)": Method(
        lambda c: _ours_engine(c, "faiss", False), "ours", "faiss", needs="faiss"
    ),
}
_REF = Method(ref64_join, "reference", dtype="fp64")
METHODS: dict[str, dict[str, Method]] = {
    "join": {
        **_OURS_JOIN,
        "naive torch tiles": Method(naive_torch_join, "baseline"),
        "numpy tiles": _cpu(numpy_join),
        "faiss range_search": _cpu(faiss_range, "faiss"),
        "st paraphrase_mining": Method(st_paraphrase, "baseline", dtype="fp32", needs="st"),
        "st community_detection": Method(st_community, "baseline", dtype="fp32", needs="st"),
        "ours pairs + clusters": Method(ours_clusters, "ours", prepare=clusters_prepare),
        "torch float64 tiles (reference)": _REF,
    },
    "topk": {
        "ours (torch)": Method(lambda c: _ours_engine(c, "torch", True), "ours"),
        "ours (triton)": Method(lambda c: _ours_engine(c, "triton", True), "ours", needs="triton"),
        "ours (faiss)": Method(
            lambda c: _ours_engine(c, "faiss", True), "ours", "faiss", needs="faiss"
        ),
        "naive torch tiles": Method(naive_torch_topk, "baseline"),
        "numpy tiles": _cpu(numpy_topk),
        "faiss search": _cpu(faiss_search, "faiss"),
        "st semantic_search": Method(st_semantic, "baseline", dtype="fp32", needs="st-topk"),
        "faiss IVF (approx)": _cpu(faiss_ivf, "faiss", faiss_ivf_build),
        "loop over ours per namespace": Method(loop_ours_topk, "baseline"),
        "numpy loop per namespace": _cpu(loop_numpy_topk),
    },
    "namespaces": {
        **_OURS_JOIN,
        "loop over ours per namespace": Method(loop_ours, "baseline"),
        "numpy loop per namespace": _cpu(loop_numpy),
        "padded torch.bmm": Method(padded_bmm, "baseline"),
        "torch float64 tiles (reference)": _REF,
    },
}


def precheck(ctx: Ctx, name: str, m: Method, where: str) -> None:
    """Raise :class:`Skip` when ``m`` cannot or should not run on this case."""
    dev = ctx.device
    if m.needs == "triton":
        if dev.type != "cuda":
            raise Skip("the triton engine needs a CUDA device")
        if not HAS_TRITON:
            raise Skip("the triton engine needs triton (pip install triton)")
    if m.needs == "faiss" and not HAS_FAISS:
        raise Skip("faiss not installed (pip install 'consolidate[faiss]')")
    if m.needs in ("st", "st-topk"):
        if not HAS_ST:
            raise Skip("sentence-transformers not installed")
        if m.needs == "st" and ctx.n > ctx.args.st_cap_n:
            raise Skip(f"sentence-transformers capped at n={ctx.args.st_cap_n} (time)")
    if where == "cpu" and dev.type == "cuda" or m.where == "cpu":
        tflop = flops(ctx) / 1e12
        if tflop > ctx.args.cpu_cap_tflop:
            raise Skip(
                f"cpu method capped at {ctx.args.cpu_cap_tflop} TFLOP (this case: {tflop:.3g})"
            )


# --------------------------------------------------------------------------- references


class Reference:
    """float64 pairs (all, or those touching a row sample) / top-k of a query sample."""

    def __init__(self, ctx: Ctx, full_pairs: tuple[np.ndarray, np.ndarray] | None) -> None:
        self.ctx = ctx
        n = ctx.n
        g = np.random.default_rng(0)
        if ctx.case.kind == "topk":
            self.rows = np.sort(g.choice(ctx.q, min(ctx.q, ctx.args.ref_sample), replace=False))
            self.topk = self._topk64(self.rows)
            self.scope = f"{self.rows.size} sampled queries"
            return
        if full_pairs is not None:
            self.rows = None
            self.keys = np.unique(full_pairs[0] * n + full_pairs[1])
            self.scope = "all pairs"
        else:
            self.rows = np.sort(g.choice(n, min(n, ctx.args.ref_sample), replace=False))
            self.keys = self._pairs64(self.rows)
            self.scope = f"pairs touching {self.rows.size} sampled rows"

    def _pairs64(self, rows: np.ndarray) -> np.ndarray:
        ctx, n = self.ctx, self.ctx.n
        v = ctx.v.double()
        seg = None if ctx.seg is None else torch.from_numpy(ctx.seg).to(ctx.device)
        keys = [np.zeros(0, np.int64)]
        for r0 in range(0, rows.size, 256):
            r = torch.from_numpy(rows[r0 : r0 + 256]).to(ctx.device)
            m = (v[r] @ v.T) >= ctx.case.threshold
            m[torch.arange(r.numel(), device=ctx.device), r] = False
            if seg is not None:
                m &= seg[r][:, None] == seg[None, :]
            nz = m.nonzero()
            a, b = r[nz[:, 0]].cpu().numpy(), nz[:, 1].cpu().numpy()
            keys.append(np.minimum(a, b) * n + np.maximum(a, b))
        return np.unique(np.concatenate(keys))

    def _topk64(self, rows: np.ndarray) -> TopK:
        ctx = self.ctx
        v = ctx.v.double()
        k = min(ctx.case.k, ctx.n)
        seg = None if ctx.seg is None else torch.from_numpy(ctx.seg).to(ctx.device)
        idx = []
        for r0 in range(0, rows.size, 256):
            r = torch.from_numpy(rows[r0 : r0 + 256]).to(ctx.device)
            s = v[r] @ v.T
            if seg is not None:
                s.masked_fill_(seg[r][:, None] != seg[None, :], float("-inf"))
            top = torch.topk(s, k, dim=1)
            idx.append(torch.where(torch.isfinite(top.values), top.indices, -1).cpu())
        return TopK(torch.cat(idx).numpy(), np.zeros((rows.size, k), np.float32))

    def score_pairs(self, i: np.ndarray, j: np.ndarray) -> tuple[float, float]:
        n = self.ctx.n
        keys = np.unique(np.minimum(i, j).astype(np.int64) * n + np.maximum(i, j))
        if self.rows is not None:
            keys = keys[np.isin(keys // n, self.rows) | np.isin(keys % n, self.rows)]
        hit = np.isin(keys, self.keys, assume_unique=True).sum()
        recall = hit / self.keys.size if self.keys.size else 1.0
        precision = hit / keys.size if keys.size else 1.0
        return float(recall), float(precision)

    def score_communities(self, comms: list[list[int]]) -> tuple[float, float, int]:
        """Share of reference pairs inside one community; precision only for all pairs."""
        n = self.ctx.n
        label = np.full(n, -1, np.int64)
        for c, members in enumerate(comms):
            label[np.asarray(members, np.int64)] = c
        a, b = self.keys // n, self.keys % n
        same = (label[a] >= 0) & (label[a] == label[b])
        recall = float(same.mean()) if self.keys.size else 1.0
        inside = int(sum(len(c) * (len(c) - 1) // 2 for c in comms))
        precision = (same.sum() / inside if inside else 1.0) if self.rows is None else math.nan
        return recall, float(precision), inside

    def score_topk(self, ids: np.ndarray) -> float:
        k = self.topk.indices.shape[1]
        return recall_at_k(TopK(ids[self.rows][:, :k], None), self.topk)


# --------------------------------------------------------------------------- running

REF_NAME = "torch float64 tiles (reference)"


class Runner:
    """Runs the benchmark's cases within the time budget (``bench.budget_s``, for the
    similarity cases), measures each method (:meth:`measure`, :meth:`run_pass_case`), and
    collects the result rows, the measured matmul peak TFLOP/s per device and dtype
    (:meth:`peak`) and the whole-pass children's JSON."""

    def __init__(self, args: BenchConfig, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.rows: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self.peaks: dict[str, float] = {}
        self.pass_raw: list[dict[str, Any]] = []  # the pass children's JSON, as they said it

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def peak(self, where: str, dtype: str) -> float:
        """Measured matmul TFLOP/s of ``where`` (cpu | cuda) in ``dtype`` (cached)."""
        key = f"{where} {dtype}"
        if key not in self.peaks:
            dev = torch.device("cpu") if where == "cpu" else self.device
            size = 8192 if dev.type == "cuda" else self.args.cpu_peak_size
            if dtype == "fp64" and dev.type == "cpu":
                size = min(size, 2048)
            try:
                self.peaks[key] = matmul_peak(dev, dtype, size)
            except Exception as e:  # e.g. a dtype the cpu cannot multiply
                print(f"matmul peak {key}: {e}", flush=True)
                self.peaks[key] = math.nan
        return self.peaks[key]

    def skip_row(self, case: Case, why: str) -> None:
        print(f"[skip] {case.name}: {why}", flush=True)
        self.rows.append(
            {
                "case": case.name,
                "kind": case.kind,
                "method": "(case)",
                "status": "skipped",
                "note": why,
            }
        )

    def run_case(self, case: Case) -> None:
        args, dev = self.args, self.device
        seg = None
        try:
            if case.source == "locomo":
                v, codes = locomo_store(
                    args.locomo_conv, dev, args.locomo_npz, args.save_locomo_npz
                )
                case.n, case.d = int(v.shape[0]), int(v.shape[1])
                case.namespaces = int(codes.max()) + 1 if codes.size else 0
                v = v.to(dev)
            else:
                if case.namespaces > 1:
                    g = np.random.default_rng(args.seed)
                    seg = (np.arange(case.n) % case.namespaces)[g.permutation(case.n)]
                    seg = seg.astype(np.int64)
                v = make_store(case.n, case.d, args.seed + case.n + case.d, dev, seg=seg)
        except Skip as e:
            self.skip_row(case, str(e))
            return
        ctx = Ctx(case, dev, v, seg, args)
        full = case.kind != "topk" and ctx.n <= args.full_ref_max
        methods = ([REF_NAME] if full else []) + list(case.methods)
        extra = (
            f" ({ctx.n} observations of {case.namespaces} namespaces, joined as one store)"
            if case.source == "locomo"
            else ""
        )
        print(f"\n== {case.name}{extra}", flush=True)
        reference = None
        for name in methods:
            row = self.measure(ctx, name, METHODS[case.kind][name])
            if reference is None:
                if full and name == REF_NAME and "out" not in row:
                    full = False  # the reference run was skipped: sample instead
                if not full or name == REF_NAME:
                    t = time.perf_counter()
                    reference = Reference(ctx, row.get("out") if full else None)
                    print(
                        f"   reference: float64, {reference.scope} "
                        f"({time.perf_counter() - t:.1f} s)",
                        flush=True,
                    )
            if "out" in row and reference is not None:
                self.score(row, reference)
            row.pop("out", None)
            self.rows.append(row)
            self.checkpoint()
        del ctx, v
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    @staticmethod
    def score(row: dict[str, Any], ref: Reference) -> None:
        out = row["out"]
        row["recall_scope"] = ref.scope
        if row["kind"] == "topk":
            row["recall"] = ref.score_topk(out)
        elif isinstance(out, list):
            row["recall"], row["precision"], row["pairs"] = ref.score_communities(out)
            row["pairs_per_s"] = row["pairs"] / row["time_s"]
        else:
            row["recall"], row["precision"] = ref.score_pairs(*out)

    def _timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        t = time.perf_counter()
        c = time.process_time()
        out = fn()
        sync(self.device)
        self.last_cpu = time.process_time() - c
        return time.perf_counter() - t, out

    def measure(self, ctx: Ctx, name: str, m: Method) -> dict[str, Any]:
        """One method on one case: warm-up on a slice, the time extrapolated against the
        budget, then up to ``repeats`` timed calls; a row of results (``status`` ok,
        skipped or error: a method that fails is a result, not a crash)."""
        c, dev = ctx.case, self.device
        where = {"dev": dev.type, "cpu": "cpu"}.get(m.where) or (
            "cuda" if dev.type == "cuda" and _faiss_gpu() else "cpu"
        )
        dtype = m.dtype or c.dtype
        if m.where == "faiss" and where == "cuda" and c.dtype in ("bf16", "fp16"):
            dtype = "fp16"
        row: dict[str, Any] = {
            "case": c.name,
            "kind": c.kind,
            "n": ctx.n,
            "q": ctx.q if c.kind == "topk" else None,
            "d": c.d,
            "threshold": c.threshold,
            "k": c.k,
            "namespaces": c.namespaces,
            "method": name,
            "family": m.family,
            "device": where,
            "dtype": dtype,
        }
        f = flops(ctx)
        try:
            if self.left() <= 0:
                raise Skip("time budget spent")
            precheck(ctx, name, m, where)
            times, cpu, out, rss = self._runs(ctx, m, f)
        except Skip as e:
            print(f"   {name:34s} skipped: {e}", flush=True)
            return {**row, "status": "skipped", "note": str(e)}
        except Exception as e:  # an engine that fails here is a result, not a crash
            traceback.print_exc()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            return {**row, "status": "error", "note": f"{type(e).__name__}: {e}"[:300]}
        best = min(times)
        peak = self.peak(where, dtype)
        row.update(
            {
                "status": "ok",
                "time_s": best,
                "runs": len(times),
                "flops": f,
                "cpu_s": cpu[times.index(best)],
                "load1": os.getloadavg()[0],
                "tflops": f / best / 1e12,
                "peak_tflops": peak,
                "share_of_peak": f / best / 1e12 / peak,
                "peak_rss_mb": rss / 2**20,
                "peak_dev_mb": torch.cuda.max_memory_allocated(dev) / 2**20
                if dev.type == "cuda"
                else math.nan,
                "out": out,
            }
        )
        if c.kind == "topk":
            row["queries_per_s"] = ctx.q / best
            row["pairs"] = int(ctx.q * c.k)
        elif not isinstance(out, list):
            row["pairs"] = int(out[0].size)
            row["pairs_per_s"] = out[0].size / best
        if "ivf_build_s" in ctx.cache:  # approximate: scans nprobe / nlist of the store
            row.update(flops=math.nan, tflops=math.nan, share_of_peak=math.nan)
            row["note"] = (
                f"nlist {ctx.cache['ivf'].nlist}, nprobe 16; build "
                f"{ctx.cache.pop('ivf_build_s'):.2f} s not in the time; random vectors have "
                "no clusters (worst case for IVF)"
            )
        print(
            f"   {name:34s} {best:9.3f} s  ({len(times)} run{'s' * (len(times) > 1)}, "
            f"{row['tflops']:.3g} TFLOP/s)",
            flush=True,
        )
        return row

    def _runs(self, ctx: Ctx, m: Method, f: float) -> tuple[list[float], list[float], Any, int]:
        """``(times, cpu seconds, last output, peak RSS bytes)`` of ``m`` on ``ctx``.

        Raises:
            Skip: the warm-up's time, extrapolated to the case, exceeds the budget left.
        """
        dev = self.device
        warm = ctx.slice(self.args.warm_rows)
        with PeakRSS() as rss:
            if m.prepare:
                m.prepare(warm)
            # first call: compiles, allocates, spins up; a second one (if the first was
            # quick) gives the time that is extrapolated to the full case
            t_warm, _ = self._timed(lambda: m.fn(warm))
            if t_warm < 1.0:
                t_warm, _ = self._timed(lambda: m.fn(warm))
            est = t_warm * f / max(flops(warm), 1.0)
            if est > self.left():
                raise Skip(
                    f"estimated {est:.0f} s (from the warm-up) > {self.left():.0f} s "
                    f"left of the budget"
                )
            if m.prepare:
                m.prepare(ctx)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            times, cpu = [], []
            for _ in range(max(1, self.args.repeats)):
                t, out = self._timed(lambda: m.fn(ctx))
                times.append(t)
                cpu.append(self.last_cpu)
                if t > self.args.slow_s or self.left() < 0:
                    break
        return times, cpu, out, rss.peak

    def frame(self) -> pd.DataFrame:
        cols = [
            "case",
            "kind",
            "n",
            "q",
            "d",
            "threshold",
            "k",
            "namespaces",
            "method",
            "family",
            "device",
            "dtype",
            "status",
            "time_s",
            "runs",
            "cpu_s",
            "load1",
            "pairs",
            "pairs_per_s",
            "queries_per_s",
            "flops",
            "tflops",
            "peak_tflops",
            "share_of_peak",
            "peak_rss_mb",
            "peak_dev_mb",
            "recall",
            "precision",
            "recall_scope",
            "note",
            # whole-pass cases (kind "pass")
            "ns_size",
            "layout",
            "records_in",
            "records_out",
            "expected_out",
            "clusters",
            "planted_clusters",
            "merges",
            "exact_merges",
            "similarity_s",
            "nonsim_s",
            "nonsim_stages_s",
            "untimed_s",
            "nonsim_ratio",
            "stage_s",
            "load_s",
            "commit_s",
            "peak_rss_gb",
            "hwm_before_gb",
            "pass_peak_rss_gb",
            "commit_peak_rss_gb",
            "start_rss_gb",
            "data_gb",
            "rss_ratio",
            "workers_private_gb",
            "workers_cpu_s",
            "sys_s",
            "minor_faults",
        ]
        return pd.DataFrame(self.rows).reindex(columns=cols)

    def run_pass_case(self, case: PassCase, baseline: tuple[str, Path] | None) -> None:
        """Generate the case's store in one child, then measure our pass (and the baseline
        revision's, where given and ``n <= --pass-baseline-max-n``) in a fresh child each,
        on a fresh copy of the store."""
        args = self.args
        print(f"\n== {case.name}", flush=True)
        head = {
            "case": case.name,
            "kind": "pass",
            "n": case.n,
            "d": case.d,
            "threshold": 0.9,
            "namespaces": case.namespaces,
            "ns_size": case.ns_size,
            "layout": case.layout,
            "dtype": args.pass_dtype,
        }
        root = Path(tempfile.mkdtemp(prefix="pass-bench-", dir=args.pass_tmp))
        try:
            t = time.perf_counter()
            try:
                gen = pass_child(
                    "generate",
                    {
                        "n": case.n,
                        "ns_size": case.ns_size,
                        "d": case.d,
                        "clusters_per_ns": case.clusters_per_ns,
                        "seed": args.seed,
                        "out": str(root / "gen"),
                    },
                    None,
                    args.pass_timeout_s,
                )
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"   generate failed: {e}", flush=True)
                self.rows.append(
                    {**head, "method": "(case)", "status": "error", "note": f"generate: {e}"[:300]}
                )
                return
            print(
                f"   store: {gen['planted_clusters']} planted clusters, "
                f"{gen['duplicate_rows']} duplicates, {gen['store_bytes'] / 2**20:.0f} MiB "
                f"on disk ({time.perf_counter() - t:.1f} s)",
                flush=True,
            )
            runs: list[tuple[str, str, Path | None]] = [("ours pass", "ours", None)]
            if baseline is not None:
                label = f"baseline pass ({baseline[0]})"
                if case.n <= args.pass_baseline_max_n:
                    runs.append((label, "baseline", baseline[1]))
                else:
                    self.rows.append(
                        {
                            **head,
                            "method": label,
                            "family": "baseline",
                            "status": "skipped",
                            "note": f"n above --pass-baseline-max-n {args.pass_baseline_max_n}",
                        }
                    )
            measured: dict[str, list[dict[str, Any]]] = {m: [] for m, _, _ in runs}
            for method, family, pkg in interleaved(runs, args.pass_repeats):
                measured[method].append(self._pass_run(case, head, gen, root, method, family, pkg))
            for method, _, _ in runs:
                self.rows.append(best_pass_row(measured[method]))
                self.checkpoint()
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _pass_run(
        self,
        case: PassCase,
        head: dict[str, Any],
        gen: dict[str, Any],
        root: Path,
        method: str,
        family: str,
        pkg: Path | None,
    ) -> dict[str, Any]:
        """One package's measurement of a whole-pass case, in a child on a fresh copy of the
        generated store (``root / "gen"``); its result row (``status`` error if it failed)."""
        args = self.args
        work = root / "run"
        shutil.copytree(root / "gen", work)
        # the copy on disk before the child starts: the kernel's writeback of its dirty
        # pages would otherwise run during the pass and slow its first touches of memory
        # (the exact stage took 1.2-1.3 s after a sync, 1.5-3.2 s without, same code)
        if hasattr(os, "sync"):
            os.sync()
        spec = {
            "store": str(work),
            "device": args.pass_device,
            "dtype": args.pass_dtype,
            "threshold": 0.9,
            "warm_rows": args.pass_warm_rows,
        }
        try:
            meas = pass_child("measure", spec, pkg, args.pass_timeout_s)
            row = pass_row(case, gen, meas, method, family, args.pass_dtype)
            print(
                f"   {method:34s} {row['time_s']:9.3f} s  (similarity "
                f"{row['similarity_s']:.3g} s, non-sim {row['nonsim_ratio']:.3g}x; "
                f"load {row['load_s']:.3g} s, commit {row['commit_s']:.3g} s; peak "
                f"RSS {row['peak_rss_gb']:.3g} GB = {row['rss_ratio']:.3g}x data)",
                flush=True,
            )
            self.pass_raw.append(
                {"case": case.name, "method": method, "generate": gen, "measure": meas}
            )
            return row
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, TypeError) as e:
            print(f"   {method:34s} failed: {e}", flush=True)
            return {
                **head,
                "method": method,
                "family": family,
                "status": "error",
                "note": f"{type(e).__name__}: {e}"[:300],
            }
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def checkpoint(self) -> None:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        self.frame().to_parquet(out / "results.parquet", index=False)


def _x(r: float) -> str:
    return f"{r:.2f}x" if r < 10 else f"{r:.0f}x"


def ratio_lines(df: pd.DataFrame) -> list[str]:
    """Per case: our torch engine's time, and every other method as a multiple of it."""
    lines = []
    for case, g in df.groupby("case", sort=False):
        ok = g[g.status == "ok"].set_index("method")
        if "ours (torch)" not in ok.index:
            continue
        base = ok.loc["ours (torch)", "time_s"]
        parts = [
            f"ours (torch) {base:.3g} s" if base >= 0.01 else f"ours (torch) {base * 1e3:.3g} ms"
        ]
        for m, r in ok.iterrows():
            if m == "ours (torch)":
                continue
            x = r.time_s / base
            rec = f" (recall {r.recall:.3g})" if r.recall < 0.999 else ""
            parts.append(f"{m} {_x(x)} slower{rec}" if x >= 1 else f"{m} {_x(1 / x)} faster{rec}")
        lines.append(f"{case}: " + "; ".join(parts))
    return lines


@dataclass
class Target:
    """A goal of the issue: ``ours`` (a method, or ``None`` for the fastest of our engines)
    against ``baseline`` by at least ``ratio`` and/or within ``seconds``, on the case whose
    rows match ``where`` (column -> value)."""

    what: str
    where: dict[str, Any]
    baseline: str | None = None
    ratio: float | None = None
    seconds: float | None = None
    ours: str | None = None


TARGETS = [
    Target(
        "threshold join n=10^6 d=1024 bf16",
        {"kind": "join", "n": 10**6, "d": 1024, "dtype": "bf16"},
        "naive torch tiles",
        1.9,
        1.6,
    ),
    Target(
        "threshold join n=10^6 d=384 bf16",
        {"kind": "join", "n": 10**6, "d": 384, "dtype": "bf16"},
        seconds=0.7,
    ),
    Target(
        "top-10 of every row n=10^6 d=1024",
        {"kind": "topk", "n": 10**6, "d": 1024, "k": 10},
        "naive torch tiles",
        4.0,
        2.5,
    ),
    Target(
        "pairs + centroid clusters n=10^6 d=384",
        {"kind": "join", "n": 10**6, "d": 384},
        "st community_detection",
        20.0,
        ours="ours pairs + clusters",
    ),
    Target(
        "join n=10^5 d=384 vs paraphrase_mining",
        {"kind": "join", "n": 10**5, "d": 384},
        "st paraphrase_mining",
        100.0,
    ),
    Target(
        "10^4 namespaces x 100 d=384",
        {"kind": "namespaces", "n": 10**6, "namespaces": 10**4},
        "loop over ours per namespace",
        20.0,
    ),
    Target(
        "cpu join n=5*10^4 d=384 fp32",
        {"kind": "join", "n": 50_000, "d": 384, "dtype": "fp32", "device": "cpu"},
        "numpy tiles",
        1.0,
    ),
]


def target_lines(df: pd.DataFrame) -> list[str]:
    """One line per issue target whose case ran: the measured time and ratio, and whether
    (and by how much) it was met."""
    lines = []
    ok = df[df.status == "ok"]
    for t in TARGETS:
        m = ok
        for col, val in t.where.items():
            if col not in m.columns:
                m = m.iloc[0:0]
                break
            m = m[m[col] == val]
        ours = (
            m[m.method == t.ours]
            if t.ours
            else m[(m.family == "ours") & (m.method != "ours pairs + clusters")]
        )
        if not len(ours):
            continue
        best = ours.loc[ours.time_s.idxmin()]
        parts = [f"{best.method} {best.time_s:.3g} s"]
        verdict = []
        if t.seconds is not None:
            ok_s = best.time_s <= t.seconds
            parts.append(f"goal <= {t.seconds:g} s")
            verdict.append("met" if ok_s else f"missed by {best.time_s / t.seconds:.2f}x")
        if t.baseline is not None:
            base = m[m.method == t.baseline]
            if len(base):
                x = float(base.time_s.min()) / best.time_s
                parts.append(f"{x:.3g}x faster than {t.baseline} (goal >= {t.ratio:g}x)")
                verdict.append("met" if x >= t.ratio else f"missed by {t.ratio / x:.2f}x")
            else:
                parts.append(f"{t.baseline} did not run")
        lines.append(f"{t.what}: " + "; ".join(parts) + " -> " + ", ".join(verdict or ["-"]))
    return lines + pass_target_lines(df)


# --------------------------------------------------------------------------- whole pass

#: run by path, so that a baseline package first on PYTHONPATH is the one measured
PASS_SCRIPT = Path(__file__).resolve().with_name("pass_bench.py")
#: stage names of ``stats["time_s"]`` that are the similarity search
SIM_STAGES = ("similarity",)


@dataclass
class PassCase:
    """One whole sleep pass (load, ``run_pass``, commit) on a synthetic store of ``n`` rows
    (d = 384) in namespaces of ``ns_size`` rows, ``clusters_per_ns`` planted near-duplicate
    clusters in each (``None``: about 10% of the rows) and 2% exact duplicates; see
    ``scripts/pass_bench.py``."""

    n: int
    ns_size: int
    clusters_per_ns: int | None = None
    d: int = 384

    @property
    def namespaces(self) -> int:
        return self.n // self.ns_size

    @property
    def layout(self) -> str:
        return f"{self.namespaces} x {self.ns_size}"

    @property
    def name(self) -> str:
        cl = f", {self.clusters_per_ns} clusters each" if self.clusters_per_ns else ""
        return f"pass n={self.n} ns={self.namespaces}x{self.ns_size}{cl} d={self.d}"


def preset_pass_cases(preset: str) -> list[PassCase]:
    """Whole-pass cases of a preset: namespaces of 100 rows, of 10^4 rows, and namespaces of
    10^5 rows with 10^4 planted clusters each (one namespace at n = 10^5)."""
    big = [PassCase(10**5, 10**5, 10**4)]
    if preset == "tiny":
        return [PassCase(2_000, 100), PassCase(2_000, 2_000, 200)]
    if preset == "cpu":
        return [PassCase(10**5, 100), PassCase(10**5, 10**4), *big, PassCase(10**6, 100)]
    if preset == "gpu":  # the targets' cases first
        return [
            PassCase(10**6, 100),
            *big,
            PassCase(10**5, 100),
            PassCase(10**5, 10**4),
            PassCase(10**6, 10**4),
            PassCase(10**6, 10**5, 10**4),
        ]
    raise SystemExit(f"unknown preset {preset!r}")


def best_pass_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of a package's fastest measurement of a whole-pass case among ``rows`` (its
    repeats; an error row only if every repeat failed), with ``runs`` (the number of
    measurements) and every pass time in its ``note``.

    Raises:
        ValueError: ``rows`` is empty."""
    if not rows:
        raise ValueError("no measurement of the case")
    ok = [r for r in rows if r.get("status") == "ok"]
    best = dict(min(ok, key=lambda r: r["time_s"]) if ok else rows[0])
    best["runs"] = len(rows)
    if len(rows) > 1:
        times = ", ".join(f"{r['time_s']:.3g} s" if r in ok else "error" for r in rows)
        note = f"fastest of {len(rows)} runs: {times}"
        best["note"] = f"{best['note']}; {note}" if best.get("note") else note
    return best


def pass_row(
    case: PassCase,
    gen: dict[str, Any],
    meas: dict[str, Any],
    method: str,
    family: str,
    dtype: str = "fp32",
) -> dict[str, Any]:
    """A results row from the generator's and the measuring child's JSON.

    non-similarity time = the pass's wall time minus its similarity stage (so it includes
    ``untimed_s``, the time inside ``run_pass`` outside every timed stage); peak RSS =
    ``VmHWM`` after the pass plus the most private memory one forked text worker held
    (``workers_private_gb``, :func:`consolidate.workers.peak_private_bytes`);
    ``rss_ratio`` = peak / (vector bytes + UTF-8 text bytes); ``cpu_s`` counts the
    workers' CPU time too (``workers_cpu_s``).
    """
    stages = {str(k): float(v) for k, v in (meas.get("stages") or {}).items()}
    sim = (
        sum(stages[k] for k in SIM_STAGES if k in stages)
        if any(k in stages for k in SIM_STAGES)
        else math.nan
    )
    stage_sum = sum(stages.values())
    pass_s = float(meas["pass_s"])
    nonsim = pass_s - sim
    data = int(gen["vector_bytes"]) + int(gen["text_bytes"])
    workers_gb = float(meas.get("workers_private_gb") or 0.0)
    peak = (float(meas["hwm_after_gb"]) + workers_gb) * 2**30
    return {
        "case": case.name,
        "kind": "pass",
        "n": case.n,
        "d": case.d,
        "threshold": 0.9,
        "namespaces": case.namespaces,
        "ns_size": case.ns_size,
        "layout": case.layout,
        "method": method,
        "family": family,
        "device": meas.get("device"),
        "dtype": dtype,
        "status": "ok",
        "time_s": pass_s,
        "runs": 1,
        "records_in": meas.get("records_in"),
        "records_out": meas.get("records_out"),
        "expected_out": gen.get("expected_out"),
        "pairs": meas.get("pairs"),
        "clusters": meas.get("clusters"),
        "planted_clusters": gen.get("planted_clusters"),
        "merges": meas.get("merges"),
        "exact_merges": meas.get("exact_merges"),
        "similarity_s": sim,
        "nonsim_s": nonsim,
        "nonsim_stages_s": stage_sum - sim,
        "untimed_s": round(pass_s - stage_sum, 4),  # the stages are rounded to 0.1 ms
        "nonsim_ratio": nonsim / sim if sim > 0 else math.nan,
        "stage_s": json.dumps(stages),
        "load_s": meas.get("load_s"),
        "commit_s": meas.get("commit_s"),
        "peak_rss_gb": peak / 2**30,
        "peak_rss_mb": peak / 2**20,
        "hwm_before_gb": meas.get("hwm_before_gb"),
        "pass_peak_rss_gb": meas.get("pass_sampled_peak_gb"),
        "commit_peak_rss_gb": meas.get("hwm_commit_gb"),
        "start_rss_gb": meas.get("hwm_start_gb"),
        "data_gb": data / 2**30,
        "rss_ratio": peak / data if data else math.nan,
        "workers_private_gb": workers_gb,
        "cpu_s": (meas.get("pass_cpu_s") or 0.0) + (meas.get("workers_cpu_s") or 0.0),
        "workers_cpu_s": meas.get("workers_cpu_s"),
        "sys_s": meas.get("pass_sys_s", math.nan),
        "minor_faults": meas.get("pass_minor_faults", math.nan),
        "load1": meas.get("load1", os.getloadavg()[0]),
    }


def interleaved(runs: list[Any], repeats: int) -> list[Any]:
    """``runs`` (the revisions of a whole-pass case) ``repeats`` times (at least once), the
    order reversed every other time: ``[a, b, b, a, a, b, ...]``. Each revision runs first
    as often as the others (to within one repeat), so none takes alone the effect of its
    place in the run (the state of memory right after the store's copy, the machine's load
    drifting over minutes)."""
    return [r for k in range(max(1, repeats)) for r in (runs if k % 2 == 0 else runs[::-1])]


def _workers_line(r: Any) -> str:
    """The forked text workers' part of a whole-pass row's detail line ("" without them)."""
    gb = getattr(r, "workers_private_gb", None)
    cpu = getattr(r, "workers_cpu_s", None)
    if not gb or (isinstance(gb, float) and math.isnan(gb)):
        return ""
    return f"; forked text workers: {cpu:.3g} cpu s, at most {gb:.3g} GB private memory each"


def _runs_line(r: Any) -> str:
    """The repeats of a whole-pass row (``bench.pass_repeats``) for its detail line ("" for
    one run)."""
    runs = getattr(r, "runs", 1)
    note = getattr(r, "note", None)
    if not isinstance(runs, (int, float)) or math.isnan(runs) or runs <= 1:
        return ""
    return f"; {note}" if isinstance(note, str) and note else f"; fastest of {int(runs)} runs"


def _pass_rows(df: pd.DataFrame) -> pd.DataFrame:
    if "kind" not in df.columns or "ns_size" not in df.columns:
        return df.iloc[0:0]
    return df[(df.kind == "pass") & (df.status == "ok")]


def pass_speedup(df: pd.DataFrame, case: str) -> tuple[float, float, str] | None:
    """``(ours s, baseline s, baseline method)`` of a pass case where both ran."""
    ok = _pass_rows(df)
    g = ok[ok.case == case]
    ours, base = g[g.family == "ours"], g[g.family == "baseline"]
    if not len(ours) or not len(base):
        return None
    b = base.loc[base.time_s.idxmin()]
    return float(ours.time_s.min()), float(b.time_s), str(b.method)


def pass_ratio_lines(df: pd.DataFrame) -> list[str]:
    """Per pass case: our pass time, and the baseline's as a multiple of it."""
    lines = []
    ok = _pass_rows(df)
    for case in dict.fromkeys(ok.case):
        sp = pass_speedup(df, case)
        if sp is not None:
            x = sp[1] / sp[0]
            how = f"{_x(x)} faster" if x >= 1 else f"{_x(1 / x)} slower"
            lines.append(f"{case}: ours pass {sp[0]:.3g} s; {sp[2]} {sp[1]:.3g} s: ours {how}")
    return lines


@dataclass
class PassTarget:
    """A goal of the issue for the whole pass on the case whose rows match ``where``:
    ``metric`` ``nonsim`` (non-similarity time / similarity time <= goal), ``rss`` (peak RSS
    / data bytes <= goal) or ``seconds`` (pass time <= goal). The ratio to a baseline pass
    is printed for every case (:func:`pass_ratio_lines`), not as a goal."""

    what: str
    where: dict[str, Any]
    metric: str
    goal: float


PASS_TARGETS = [
    PassTarget(
        "whole pass n=10^6, 10^4 namespaces x 100 on the cpu: pass without I/O",
        {"n": 10**6, "ns_size": 100, "device": "cpu"},
        "seconds",
        10.0,
    ),
    PassTarget(
        "whole pass n=10^6, 10^4 namespaces x 100: non-similarity work",
        {"n": 10**6, "ns_size": 100},
        "nonsim",
        2.0,
    ),
    PassTarget(
        "whole pass n=10^6, 10^4 namespaces x 100: peak RSS",
        {"n": 10**6, "ns_size": 100},
        "rss",
        3.0,
    ),
    PassTarget(
        "gpu whole pass n=10^6, 10^4 namespaces x 100: pass without I/O",
        {"n": 10**6, "ns_size": 100, "device": "cuda"},
        "seconds",
        2.0,
    ),
]


def _verdict(value: float, goal: float, at_most: bool) -> str:
    """``met by F`` / ``missed by F``: F = how far from the goal, as a factor."""
    if not (value == value and goal == goal) or value <= 0:
        return "not measured"
    f = goal / value if at_most else value / goal
    return f"met by {_x(f)}" if f >= 1 else f"missed by {_x(1 / f)}"


def pass_target_lines(df: pd.DataFrame) -> list[str]:
    """One line per whole-pass target whose case ran (our pass, best row of the case)."""
    lines: list[str] = []
    ok = _pass_rows(df)
    if not len(ok):
        return lines
    for t in PASS_TARGETS:
        m = ok[ok.family == "ours"]
        for col, val in t.where.items():
            m = m[m[col] == val]
        if not len(m):
            continue
        r = m.loc[m.time_s.idxmin()]
        if t.metric == "nonsim":
            text = (
                f"non-similarity {r.nonsim_s:.3g} s = {r.nonsim_ratio:.3g}x the "
                f"similarity stage {r.similarity_s:.3g} s (goal <= {t.goal:g}x; "
                f"{r.untimed_s:.3g} s of it outside the timed stages)"
            )
            verdict = _verdict(r.nonsim_ratio, t.goal, True)
        elif t.metric == "rss":
            text = (
                f"peak RSS {r.peak_rss_gb:.3g} GB = {r.rss_ratio:.3g}x the vector + text "
                f"bytes {r.data_gb:.3g} GB (goal <= {t.goal:g}x)"
            )
            verdict = _verdict(r.rss_ratio, t.goal, True)
        else:
            text = f"ours {r.time_s:.3g} s on {r.device} (goal <= {t.goal:g} s)"
            verdict = _verdict(r.time_s, t.goal, True)
        lines.append(f"{t.what}: {text} -> {verdict}")
    return lines


def pass_table(df: pd.DataFrame) -> list[str]:
    """The whole-pass section of report.md: one row per pass run, then each run's stages."""
    if "kind" not in df.columns:
        return []
    p = df[df.kind == "pass"]
    if not len(p):
        return []
    ok = p[p.status == "ok"].copy()
    out = []
    if len(ok):
        ok["x_vs_baseline"] = [
            (sp[1] / sp[0]) if r.family == "ours" and (sp := pass_speedup(df, r.case)) else math.nan
            for r in ok.itertuples()
        ]
        cols = {
            "n": "n",
            "layout": "namespaces",
            "method": "method",
            "device": "device",
            "records_in": "in",
            "records_out": "out",
            "expected_out": "planted out",
            "pairs": "pairs",
            "clusters": "clusters",
            "merges": "merges",
            "exact_merges": "exact merges",
            "time_s": "pass s",
            "similarity_s": "similarity s",
            "nonsim_s": "non-sim s",
            "nonsim_ratio": "non-sim / sim",
            "untimed_s": "untimed s",
            "load_s": "load s",
            "commit_s": "commit s",
            "cpu_s": "pass cpu s",
            "sys_s": "kernel s",
            "minor_faults": "page faults",
            "load1": "load1",
            "peak_rss_gb": "peak RSS GB",
            "rss_ratio": "RSS / data",
            "x_vs_baseline": "x faster than baseline",
        }
        show = ok[list(cols)].rename(columns=cols).dropna(axis=1, how="all")
        out += [show.to_markdown(index=False, floatfmt=".4g"), ""]
        for r in ok.itertuples():
            st = json.loads(r.stage_s) if isinstance(r.stage_s, str) else {}
            out.append(
                f"* {r.case}, {r.method}: stages "
                + ", ".join(f"{k} {v:.3g} s" for k, v in st.items())
                + f"; RSS after the imports "
                f"{r.start_rss_gb:.3g} GB, peak after load {r.hwm_before_gb:.3g} GB, "
                f"pass-only sampled peak {r.pass_peak_rss_gb:.3g} GB, peak after commit "
                f"{r.commit_peak_rss_gb:.3g} GB" + _workers_line(r) + _runs_line(r)
            )
    out += [
        f"* {r.case}, {r.method}: {r.status}: {r.note}"
        for r in p.itertuples()
        if r.status != "ok" and isinstance(r.note, str)
    ]
    return out + [""]


def export_revision(rev: str, dest: Path) -> str:
    """``git archive REV consolidate`` unpacked into ``dest`` (read-only git); returns the
    short commit."""
    short = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with subprocess.Popen(
        ["git", "-C", str(REPO), "archive", rev, "consolidate"], stdout=subprocess.PIPE
    ) as arch:
        subprocess.run(["tar", "-x", "-C", str(dest)], stdin=arch.stdout, check=True)
        arch.stdout.close()
        if arch.wait() != 0:
            raise RuntimeError(f"git archive {rev} consolidate failed")
    if not (dest / "consolidate" / "__init__.py").exists():
        raise RuntimeError(f"{rev} has no consolidate package")
    return short


def pass_child(
    step: str, spec: dict[str, Any], pkg: Path | None, timeout_s: float
) -> dict[str, Any]:
    """Run ``pass_bench.py STEP SPEC`` in a fresh process (with the package under ``pkg``
    first on its path, else the repository's) and return its JSON line."""
    env = dict(os.environ)
    env.pop("PASS_BENCH_PKG", None)
    if pkg is not None:
        env["PASS_BENCH_PKG"] = str(pkg)
        env["PYTHONPATH"] = os.pathsep.join([str(pkg), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, str(PASS_SCRIPT), step, json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        timeout=timeout_s,
        cwd=REPO,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise RuntimeError(f"{step}: no result (exit {proc.returncode})")
    res = json.loads(lines[-1])
    if not res.get("ok"):
        raise RuntimeError(f"{step}: {res.get('error')}")
    return res


def write_report(df: pd.DataFrame, meta: dict[str, Any], out: Path) -> list[str]:
    """Write ``results.parquet``, ``meta.json``, ``report.md`` and ``benchmark.png`` of a run
    into ``out``; returns the target and ratio lines (also printed by the caller)."""
    df.to_parquet(out / "results.parquet", index=False)
    (out / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    sim_df = df[df.kind != "pass"] if "kind" in df.columns else df
    tables = _case_tables(sim_df)
    ratios = ratio_lines(df) + pass_ratio_lines(df)
    targets = target_lines(df)
    passes = _pass_section(df)
    sim_notes = _similarity_notes(meta) if len(sim_df) else []
    title = " and ".join(
        x for x, on in (("Similarity join / top-k", len(sim_df)), ("whole pass", passes)) if on
    )
    text = [
        f"# {title or 'Similarity join / top-k'} benchmark",
        "",
        *(
            []
            if meta.get("complete", True)
            else [
                "**Partial**: written after a case; the run had not finished (or was cut short).",
                "",
            ]
        ),
        f"`{meta['command']}` on {meta['device']} ({meta['cpu_count']} cpus), torch "
        f"{meta['torch']}, {meta['date']}; {meta['wall_s']:.0f} s in all. Load average at "
        f"start {meta['loadavg_start']}, at end {meta['loadavg_end']} (other processes on a "
        "shared machine add noise: see load1 and cpu_s per row); git "
        f"{meta['git']}.",
        "",
        *sim_notes,
        "## Targets of the issue (same run)",
        "",
        *([f"* {r}" for r in targets] or ["* no case of this run has a target"]),
        "",
        "## Ratios (same run)",
        "",
        *[f"* {r}" for r in ratios],
        "",
        *passes,
        *(["## Results", "", *tables] if tables else []),
    ]
    (out / "report.md").write_text("\n".join(text))
    plot(df, out / "benchmark.png")
    return targets + ratios


def _case_tables(sim_df: pd.DataFrame) -> list[str]:
    """One markdown table per similarity case (the methods that ran), with its recall scope
    and each method's status note."""
    tables = []
    for case, g in sim_df.groupby("case", sort=False):
        ok = g[g.status == "ok"]
        show = ok[
            [
                "method",
                "device",
                "dtype",
                "time_s",
                "runs",
                "cpu_s",
                "load1",
                "pairs",
                "pairs_per_s",
                "queries_per_s",
                "tflops",
                "share_of_peak",
                "peak_rss_mb",
                "peak_dev_mb",
                "recall",
                "precision",
            ]
        ].dropna(axis=1, how="all")
        scope = ok.recall_scope.dropna()
        tables += [f"### {case}", ""]
        if len(show):
            tables += [show.to_markdown(index=False, floatfmt=".4g"), ""]
        if len(scope):
            tables += [f"recall against float64: {scope.iloc[0]}.", ""]
        tables += [
            f"* {r.method}: {r.status}: {r.note}"
            for r in g.itertuples()
            if isinstance(r.note, str) and r.note
        ]
        tables.append("")
    return tables


def _pass_section(df: pd.DataFrame) -> list[str]:
    """The whole-pass section: how the cases are measured, then their table."""
    passes = pass_table(df)
    if passes:
        passes = [
            "## Whole pass (load, run_pass, commit; separate processes)",
            "",
            "* Each case: a synthetic store (d = 384 float32 unit vectors; 2% exact "
            "duplicates; near-duplicate clusters of 2-5 paraphrases at cosine ~0.93-0.99; "
            "the rest random) written by one process as a real store, then, per package "
            "(ours; the baseline revision exported with `git archive` when "
            "`--pass-baseline` is given), a fresh process on a copy of it (flushed to disk "
            "first): `Store.load`, an "
            "untimed warm-up pass on 2,000 rows, `run_pass` (threshold 0.9, cap none, "
            "max_drop_fraction 1, extractive merger), `store.commit` under `store.lock()`.",
            "* pass s: wall time of `run_pass` (no I/O). similarity s: its "
            "`stats['time_s']['similarity']`; non-sim s = pass s - similarity s (includes "
            "untimed s, the time inside run_pass outside every timed stage). planted out: "
            "live records left if the pass finds exactly the planted duplicates and "
            "clusters.",
            "* peak RSS: `VmHWM` of the measuring process after the pass (it includes "
            "loading the store: the load's own peak and the pass-only sampled peak are in "
            "the line under the table), plus the most private memory one of its forked "
            "text workers held (`sleep.text_workers`; the pages they share with the "
            "measuring process are counted once); RSS / data = peak / (vector bytes + UTF-8 "
            "text bytes).",
            "* pass cpu s: cpu seconds of the measuring process (all threads) and its forked "
            "text workers during the pass; "
            "load1: the 1-minute load average after it (other processes on a shared machine "
            "slow the pass down: pass s grows, pass cpu s much less). kernel s, page faults: "
            "the measuring process's system cpu seconds and minor page faults during the "
            "pass (`getrusage`). Most faults are first writes to memory the process has not "
            "written before; on a virtual machine whose host takes back freed memory (free "
            "page reporting) such a write can cost 10-20 us instead of 1-2 us, so kernel s "
            "shows how much of pass s the machine's memory state added.",
            "",
            *passes,
        ]
    return passes


def _similarity_notes(meta: dict[str, Any]) -> list[str]:
    """How the similarity cases are measured (with the run's matmul peaks)."""
    peaks = "; ".join(f"{k}: {v:.3g} TFLOP/s" for k, v in meta["matmul_peak_tflops"].items())
    peaks = peaks or "not measured (no similarity case in this run)"
    return [
        f"Matmul peak measured in this run (square matmul, best of the start and the end of the "
        f"run): {peaks}.",
        "",
        "* time: best of `runs` calls after two warm-up calls (one if it took over 1 s) on "
        "the first "
        f"{meta['args']['warm_rows']} rows; `runs` = 1 where a call took longer than "
        f"{meta['args']['slow_s']} s. Untimed: building the store, the IVF index build "
        "(in its note), the float64 reference of recall.",
        "* TFLOP/s counts useful work only: `n^2 d` per namespace for a join (upper "
        "triangle), `2 q n d` for top-k, whatever the method computes; share_of_peak divides "
        "by the matmul peak measured in this run for the method's device and dtype.",
        "* recall / precision: against float64 brute force (`recall_scope` in "
        "results.parquet). community_detection: recall = share of reference pairs inside one "
        "community, pairs = pairs inside communities. ours pairs + clusters: our join, then "
        "the pass's centroid-checked, complete-link clusters; its recall is below 1 by "
        "design (a pair whose clusters are not completely linked stays apart: no chaining), "
        "where community_detection's precision below 1 shows the pairs its communities add.",
        "* naive torch tiles: row tile against the rows from the tile on (upper triangle), "
        "`>= t` on the scores of the case's dtype, no re-scoring. numpy / faiss: float32 on "
        "the cpu. faiss range_search: the whole store against itself (both triangles). "
        "paraphrase_mining: library defaults (top_k=100, max_pairs=500000) then `>= t`.",
        f"* sentence-transformers paraphrase_mining / community_detection run only up to "
        f"n = {meta['args']['st_cap_n']} (their time grows fast: on the 2-core cpu about a "
        "minute each at n = 50,000); cpu baselines (numpy, faiss-cpu) only up to "
        f"{meta['args']['cpu_cap_tflop']} TFLOP of useful work; a skipped row says why.",
        "* cpu_s: cpu seconds of this process (all threads) in the timed call: with other "
        "processes on the machine, time_s grows but cpu_s much less; load1: the 1-minute "
        "load average after the method (the machine has "
        f"{meta['cpu_count']} cpus).",
        "* peak_rss_mb: the process's resident memory, sampled every 10 ms during the "
        "method (includes the store and earlier allocations); peak_dev_mb: "
        "torch.cuda.max_memory_allocated.",
        "",
    ]


def plot(df: pd.DataFrame, path: Path) -> None:
    """Plot each case's time per call of every method that ran (log scale; ours blue,
    baselines orange), one panel per case, into ``path`` (PNG); nothing when no case
    ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = df[df.status == "ok"]
    cases = list(dict.fromkeys(ok.case))
    if not cases:
        return
    h = [max(1, (ok.case == c).sum()) for c in cases]
    fig, axes = plt.subplots(
        len(cases),
        1,
        figsize=(9, 0.35 * sum(h) + 1.2 * len(cases)),
        gridspec_kw={"height_ratios": h},
        squeeze=False,
    )
    colours = {"ours": "tab:blue", "baseline": "tab:orange", "reference": "tab:gray"}
    for ax, c in zip(axes[:, 0], cases, strict=True):
        g = ok[ok.case == c]
        ax.barh(g.method, g.time_s, color=[colours.get(f, "k") for f in g.family])
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(c, fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
        for y, t in enumerate(g.time_s):
            ax.text(t, y, f" {t:.3g} s", va="center", fontsize=7)
        ax.set_xlim(g.time_s.min() / 2, g.time_s.max() * 4)
    axes[-1, 0].set_xlabel("time per call, s (log scale; blue: ours)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(runner: Runner, meta: dict[str, Any], out: Path, final: bool) -> list[str]:
    """Write results.parquet, report.md, benchmark.png and meta.json; with ``final`` first
    measure the matmul peak again (clocks, thread pools and other load differ between the
    start and the end of a run) and keep the better of the two."""
    if final:
        for key, val in list(runner.peaks.items()):
            where, dtype = key.split()
            runner.peaks.pop(key)
            again = runner.peak(where, dtype)
            runner.peaks[key] = max(val, again) if again == again else val
    df = runner.frame()
    ok = (df.status == "ok") & df.tflops.notna()
    if ok.any():
        best = df.loc[ok].apply(lambda r: runner.peaks[f"{r['device']} {r['dtype']}"], axis=1)
        df.loc[ok, "peak_tflops"] = best
        df.loc[ok, "share_of_peak"] = df.loc[ok, "tflops"] / best
    meta["wall_s"] = time.perf_counter() - runner.t0
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["matmul_peak_tflops"] = dict(runner.peaks)
    meta["complete"] = final
    if runner.pass_raw:
        (out / "pass_results.json").write_text(
            json.dumps(runner.pass_raw, indent=1, default=str) + "\n"
        )
    lines = write_report(df, meta, out)
    write_results_json(df, meta, out)
    return lines


#: columns of a results row reported as metrics in ``results.json`` (name -> higher is better)
METRIC_COLUMNS = {"time_s": False, "recall": True, "precision": True, "tflops": True,
                  "share_of_peak": True, "peak_rss_mb": False, "similarity_s": False,
                  "nonsim_s": False, "load_s": False}  # fmt: skip


def write_results_json(df: pd.DataFrame, meta: dict[str, Any], out: Path) -> Path:
    """``results.json`` in the schema of the evaluation jobs
    (:class:`consolidate.evaluation.results.Results`): one metric per measured method and
    column of :data:`METRIC_COLUMNS` (``variant`` = ``"<case> | <method>"``), the whole
    table under ``tables["results"]``, the run's settings as ``config``."""
    from consolidate.evaluation.results import Metric, Results, TaskInfo, environment, now_iso

    ok = df[df.status == "ok"] if "status" in df.columns else df
    metrics = []
    for rec in ok.to_dict("records"):
        for col, higher in METRIC_COLUMNS.items():
            v = rec.get(col)
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                metrics.append(Metric(name=col, value=float(v), higher_is_better=higher,
                                      variant=f"{rec['case']} | {rec['method']}", n=1))  # fmt: skip
    env = environment(str(meta.get("device", "")))
    rows = json.loads(df.to_json(orient="records"))  # NaN -> null
    res = Results(
        job="bench",
        created_at=str(meta.get("date") or now_iso()),
        task=TaskInfo(
            name=f"benchmark-{meta.get('preset')}",
            version="1",
            files_sha256={},
            hash_verified=False,
            counts={"rows": len(df), "ok": len(ok)},
            main_score="time_s",
        ),  # fmt: skip
        config=dict(meta.get("args", {})),
        git_commit=env["git_commit"],
        packages=env["packages"],
        device=env["device"],
        python=env["python"],
        timings_s={"wall": round(float(meta.get("wall_s", 0.0)), 3)},
        metrics=metrics,
        tables={"results": rows},
    )
    path = out / "results.json"
    path.write_text(res.model_dump_json(indent=1))
    return path


def _numbers(x: Any, what: str) -> list[int]:
    """``[0, 2]``, ``2`` or ``"0,2"`` (or ``"1e5"``) as a list of ints."""
    items = x.split(",") if isinstance(x, str) else list(x) if isinstance(x, (list, tuple)) else [x]
    try:
        return [int(float(v)) for v in items]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be numbers (e.g. {what}=[0,2]), got {x!r}") from None


def _chosen_cases(args: BenchConfig) -> tuple[list[Case], list[PassCase]]:
    """The similarity and whole-pass cases ``args`` asks for (its preset's, picked by
    ``cases``, ``pass_cases``, ``pass_sizes`` and ``only``); fills the ``None`` settings
    with the preset's defaults.

    Raises:
        ValueError: an unknown preset, ``only`` or case number.
    """
    if args.preset not in ("cpu", "gpu", "tiny"):
        raise ValueError(f"preset must be cpu, gpu or tiny, got {args.preset!r}")
    if args.only not in ("all", "sim", "pass"):
        raise ValueError(f"only must be all, sim or pass, got {args.only!r}")
    if args.locomo_npz is None:
        args.locomo_npz = os.environ.get("LOCOMO_NPZ")
    cases, defaults = preset_cases(args.preset)
    pass_cases = preset_pass_cases(args.preset)
    if args.pass_cases is not None:
        pass_cases = _picked(pass_cases, args.pass_cases, "pass_cases", args.preset)
    if args.pass_sizes is not None:
        sizes = set(_numbers(args.pass_sizes, "pass_sizes"))
        pass_cases = [c for c in pass_cases if c.n in sizes]
    if args.pass_device is None:
        args.pass_device = "auto" if args.preset == "gpu" else "cpu"
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out is None:
        args.out = str(Path("outputs") / "bench" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    if args.cases is not None:
        cases = _picked(cases, args.cases, "cases", args.preset)
    if args.locomo_conv == 0:
        cases = [c for c in cases if c.source != "locomo"]
    if args.only == "pass":
        cases = []
    elif args.only == "sim":
        pass_cases = []
    return cases, pass_cases


def _picked(items: list[Any], spec: Any, name: str, preset: str) -> list[Any]:
    """The ``items`` numbered in ``spec`` (the setting ``name``), in its order.

    Raises:
        ValueError: a number outside the preset's cases.
    """
    pick = _numbers(spec, name)
    if any(not 0 <= k < len(items) for k in pick):
        raise ValueError(f"{name}: the {preset} preset has cases 0-{len(items) - 1}")
    return [items[k] for k in pick]


def _run_pass_cases(
    runner: Runner,
    pass_cases: list[PassCase],
    baseline_rev: str | None,
    meta: dict[str, Any],
    out: Path,
) -> None:
    """Each whole-pass case in child processes, ours and (with ``baseline_rev``) the
    baseline revision's package exported beside it; the report rewritten after each."""
    with tempfile.TemporaryDirectory(prefix="pass-baseline-") as tmp:
        baseline = None
        if baseline_rev:
            rev = export_revision(baseline_rev, Path(tmp))
            baseline = (rev, Path(tmp))
            meta["pass_baseline"] = rev
            print(f"baseline pass: consolidate/ of {rev} in {tmp}", flush=True)
        for pc in pass_cases:  # not under --budget-s: each child has --pass-timeout-s
            runner.run_pass_case(pc, baseline)
            report(runner, meta, out, final=False)


def run_benchmark(args: BenchConfig) -> Path:
    """Run the preset's cases and write the report (see the module docstring).

    Args:
        args: the settings (changed in place: the preset's defaults fill the ``None`` ones).

    Returns:
        The output folder: ``results.json`` (the results schema of the evaluation jobs),
        ``results.parquet``, ``report.md``, ``benchmark.png``, ``meta.json``.

    Raises:
        ValueError: an unknown preset, ``only`` or case number.
    """
    cases, pass_cases = _chosen_cases(args)
    dev = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device_name(dev),
        "torch": torch.__version__,
        "cpu_count": machine()["cpus"],
        "torch_threads": torch.get_num_threads(),
        "versions": {"python": machine()["python"], **package_versions()},
        "args": dataclasses.asdict(args),
        "preset": args.preset,
        "loadavg_start": [round(x, 2) for x in load0],
        "git": git_commit(short=True, dirty=True) or "unknown",
    }
    print(f"device {meta['device']}, torch {torch.__version__}", flush=True)
    runner = Runner(args, dev)
    t = time.perf_counter()
    if cases:
        first = {c.dtype for c in cases} | {"fp32"}
        for d in sorted(first):
            runner.peak(dev.type, d)
        if dev.type == "cuda":
            runner.peak("cpu", "fp32")
        print(
            "matmul peak: "
            + ", ".join(f"{k} {v:.3g} TFLOP/s" for k, v in runner.peaks.items())
            + f" ({time.perf_counter() - t:.1f} s)",
            flush=True,
        )
    for case in cases:
        if runner.left() <= 0:
            runner.rows.append(
                {
                    "case": case.name,
                    "kind": case.kind,
                    "method": "(case)",
                    "status": "skipped",
                    "note": "time budget spent",
                }
            )
            print(f"[skip] {case.name}: time budget spent", flush=True)
            continue
        runner.run_case(case)
        report(runner, meta, out, final=False)  # a run cut short keeps its report
    if pass_cases:
        _run_pass_cases(runner, pass_cases, args.pass_baseline, meta, out)
    ratios = report(runner, meta, out, final=True)
    print(
        f"\nwrote {out}/results.json, results.parquet, report.md, benchmark.png, meta.json "
        f"({meta['wall_s']:.0f} s)\n"
        + (
            "\n(the tiny preset is a smoke test: at its sizes fixed costs dominate, and its "
            "ratios say nothing about speed; use the cpu or gpu preset)\n"
            if args.preset == "tiny"
            else ""
        )
    )
    for line in ratios:
        print(line)
    return out

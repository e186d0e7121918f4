"""The faiss engine (``engine="faiss"``): exact join and top-k on faiss, plus approximate search.

faiss is optional and imported on the first call: ``pip install 'consolidate[faiss]'``
(faiss-cpu) or ``'consolidate[faiss-gpu]'``. ``device="auto"`` means cuda only when this faiss
build sees a GPU (a faiss-cpu install on a CUDA machine runs on the cpu).

Join candidates (:func:`threshold_candidates`):

* cpu: an ``IndexFlatIP`` ``range_search`` per row block (``tile_rows``, default 4096 rows)
  against the rows from the block's first row to the end of its pack (upper triangle plus
  the diagonal block, not the full square). Consecutive small namespaces are packed into one
  search of at most ``tile_cols`` rows (default 512; cross-namespace candidates are dropped),
  so 10^4 namespaces of 100 rows cost a few hundred faiss calls, not 10^4.
* cuda (needs a faiss build with GPU support, ``faiss.get_num_gpus() > 0``): GPU faiss has no
  ``range_search`` for flat indexes, so the same blocks run brute-force ``knn_gpu`` with a
  growing ``k`` (64, 256, 1024, 2048: the GPU limit) for the rows whose k-th neighbour is still
  a candidate; rows that still have more candidates at ``k = 2048`` are finished on the cpu
  with ``range_search``. The result is the same; only rows with more than 2048 near
  duplicates cost extra.

Candidates are taken a margin below the threshold (:data:`DTYPE_MARGIN` of fp32 on cpu, of
tf32 or fp16 on cuda), and :mod:`consolidate.similarity.api` re-scores them in float64 like
every engine's, so the pairs and similarities equal the torch engine's.

Top-k (:func:`topk`): an ``IndexFlatIP`` search per namespace (``knn_gpu`` on cuda, ``k <=``
:data:`GPU_MAX_K`); equal scores go to the lower key position.

Approximate search for stores past 10^6 rows: :class:`ApproxIndex` (IVF-Flat or HNSW) and
:func:`recall_at_k` to measure it against the exact top-k.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...device import resolve_device
from ..types import DTYPE_MARGIN, Engine, TopK

__all__ = ["ENGINE", "threshold_candidates", "topk", "ApproxIndex", "recall_at_k", "GPU_MAX_K"]

#: largest ``k`` of faiss's GPU brute-force k-selection (without cuVS)
GPU_MAX_K = 2048
_GPU_KS = (64, 256, 1024, GPU_MAX_K)
#: default query rows per faiss call (``tile_rows``) and rows per pack (``tile_cols``)
_BLOCK_ROWS, _PACK_ROWS = 4096, 512


def _import_faiss() -> Any:
    """Import faiss or raise an ImportError that says how to install it."""
    try:
        import faiss
    except ImportError as e:
        raise ImportError(
            "the faiss engine needs faiss: pip install 'consolidate[faiss]' (faiss-cpu), or "
            "'consolidate[faiss-gpu]' for device='cuda'"
        ) from e
    return faiss


def _faiss_on(device: str | torch.device | None) -> tuple[Any, torch.device]:
    """``(faiss, device)``: ``"auto"`` means cuda only when this faiss build sees a GPU (a
    faiss-cpu install on a CUDA machine runs on the cpu).

    Raises:
        ImportError: faiss is not installed.
        ValueError: an explicit cuda device while faiss has no GPU support.
    """
    faiss = _import_faiss()
    has_gpu = hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0
    if device is None or str(device) == "auto":
        return faiss, resolve_device("cuda" if has_gpu and torch.cuda.is_available() else "cpu")
    dev = resolve_device(device)
    if dev.type == "cuda" and not has_gpu:
        raise ValueError(
            "device='cuda' with the faiss engine needs a faiss build with GPU support "
            "(pip install 'consolidate[faiss-gpu]'); this faiss sees no GPU. Use device=cpu "
            "or auto, or engine=torch"
        )
    return faiss, dev


def place(device: str | torch.device | None, dev: torch.device) -> torch.device:
    """The device faiss runs on for the caller's ``device`` (see :func:`_faiss_on`).

    Raises:
        ImportError: faiss is not installed.
        ValueError: an explicit cuda device while faiss has no GPU support.
    """
    return _faiss_on(device)[1]


def max_topk(dev: torch.device) -> int | None:
    """:data:`GPU_MAX_K` on cuda (faiss's GPU k-selection), no limit on cpu."""
    return GPU_MAX_K if dev.type == "cuda" else None


def _as_f32(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """Host ``float32`` C-contiguous copy (or view) of ``x``, which faiss reads."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


class _Gpu:
    """faiss GPU resources and the device ordinal for ``knn_gpu``."""

    _res: dict[int, Any] = {}

    def __init__(self, faiss: Any, dev: torch.device, dtype: str) -> None:
        self.faiss = faiss
        self.ordinal = dev.index if dev.index is not None else torch.cuda.current_device()
        if self.ordinal not in _Gpu._res:
            _Gpu._res[self.ordinal] = faiss.StandardGpuResources()
        self.res = _Gpu._res[self.ordinal]
        # faiss's brute force takes float32 or float16 inputs (bf16 -> fp16: more precise)
        self.half = dtype in ("fp16", "bf16")
        # cuBLAS may use reduced-precision math for float32: take the tf32 margin then
        self.margin = DTYPE_MARGIN["fp16"] if self.half else DTYPE_MARGIN["tf32"]

    def knn(self, xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.half:
            xq, xb = xq.astype(np.float16), xb.astype(np.float16)
        return self.faiss.knn_gpu(
            self.res, xq, xb, k, metric=self.faiss.METRIC_INNER_PRODUCT, device=self.ordinal
        )


def _range_cpu(
    faiss: Any, xq: np.ndarray, xb: np.ndarray, radius: float
) -> tuple[np.ndarray, np.ndarray]:
    """Candidates ``(query row, base row)`` with inner product ``> radius`` (local indices)."""
    index = faiss.IndexFlatIP(xb.shape[1])
    index.add(xb)
    lims, _, cols = index.range_search(xq, float(radius))
    rows = np.repeat(np.arange(xq.shape[0], dtype=np.int64), np.diff(lims).astype(np.int64))
    return rows, cols.astype(np.int64)


def _range_by_knn(
    knn: Any,
    xq: np.ndarray,
    xb: np.ndarray,
    radius: float,
    ks: tuple[int, ...] = _GPU_KS,
    fallback: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Range search from k-NN searches with a growing ``k`` (for GPU faiss).

    A query whose ``k``-th neighbour still scores ``> radius`` may have more candidates: it
    is searched again with the next ``k``; past the last ``k`` such queries go to
    ``fallback(xq_rows, xb, radius)`` (a true range search).

    Args:
        knn: ``knn(xq, xb, k) -> (scores float32 [q, k], ids int64 [q, k])``, best first.
        xq, xb: ``float32 [q, d]`` / ``[m, d]``.
        radius: keep inner products ``> radius``.
        ks: increasing ``k`` values to try.
        fallback: ``fallback(xq, xb, radius) -> (rows, cols)``; required when some query
            may have more than ``ks[-1]`` candidates.

    Returns:
        ``(rows, cols)`` int64 local indices, every pair with inner product ``> radius``.
    """
    m = xb.shape[0]
    todo = np.arange(xq.shape[0], dtype=np.int64)
    out_r, out_c = [], []
    for k in ks:
        if not todo.size:
            break
        kk = min(k, m)
        scores, ids = knn(xq[todo], xb, kk)
        hit = (scores > radius) & (ids >= 0)
        # rows that may have more candidates than kk
        more = hit[:, -1] if kk < m else np.zeros(todo.size, bool)
        done = ~more
        r, c = np.nonzero(hit[done])
        out_r.append(todo[done][r])
        out_c.append(ids[done][r, c].astype(np.int64))
        todo = todo[more]
    if todo.size:
        if fallback is None:
            raise RuntimeError(f"{todo.size} queries have more than {ks[-1]} candidates")
        r, c = fallback(xq[todo], xb, radius)
        out_r.append(todo[r])
        out_c.append(c)
    if not out_r:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(out_r), np.concatenate(out_c)


def _packs(seg_sorted: np.ndarray, pack_rows: int) -> list[tuple[int, int]]:
    """Consecutive runs of whole segments, each ``<= pack_rows`` rows unless one segment is
    bigger (then that segment alone)."""
    n = seg_sorted.shape[0]
    if n == 0:
        return []
    starts = np.flatnonzero(np.r_[True, seg_sorted[1:] != seg_sorted[:-1]])
    ends = np.r_[starts[1:], n]
    packs: list[tuple[int, int]] = []
    p0 = int(starts[0])
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        if e - p0 > pack_rows and s > p0:
            packs.append((p0, s))
            p0 = s
    packs.append((p0, n))
    return packs


def threshold_candidates(
    v32: torch.Tensor,
    counts: torch.Tensor,
    threshold: float,
    *,
    dtype: str = "fp32",
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    budget_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate pairs of the join (the :class:`~consolidate.similarity.types.Engine`
    interface) from faiss searches over packs of whole segments.

    Args:
        v32: ``float32 [n, d]`` rows sorted by segment; copied to host memory (faiss reads
            it there); its device picks faiss-cpu (``range_search``) or GPU faiss
            (``knn_gpu`` with a growing ``k``).
        counts: cpu ``int64`` rows per segment, in sorted order.
        threshold: cosine threshold; faiss keeps scores ``> threshold - margin``, the margin
            making that strictness irrelevant.
        dtype: faiss-cpu always computes in float32; on cuda ``fp16``/``bf16`` send float16
            vectors to ``knn_gpu``.
        tile_rows: query rows per faiss call (default 4096).
        tile_cols: consecutive small segments are searched together up to this many rows
            (default 512).
        budget_bytes: not used.

    Returns:
        ``(ci, cj)``: ``int64 [p]`` sorted positions ``ci < cj`` on ``v32``'s device.

    Raises:
        ImportError: faiss is not installed.
    """
    faiss = _import_faiss()
    dev = v32.device
    block_rows = _BLOCK_ROWS if tile_rows is None else int(tile_rows)
    pack_rows = _PACK_ROWS if tile_cols is None else int(tile_cols)
    vs = _as_f32(v32)
    # one code per segment, in sorted order
    seg_s = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts.numpy())
    if dev.type == "cuda":
        gpu = _Gpu(faiss, dev, dtype)
        cand = threshold - gpu.margin

        def search(xq: np.ndarray, xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return _range_by_knn(
                gpu.knn, xq, xb, cand, fallback=lambda q, b, r: _range_cpu(faiss, q, b, r)
            )
    else:
        cand = threshold - DTYPE_MARGIN["fp32"]

        def search(xq: np.ndarray, xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return _range_cpu(faiss, xq, xb, cand)

    out_i, out_j = [], []
    for p0, p1 in _packs(seg_s, pack_rows):
        multi = seg_s[p0] != seg_s[p1 - 1]
        for r0 in range(p0, p1, block_rows):
            r1 = min(p1, r0 + block_rows)
            rows, cols = search(vs[r0:r1], vs[r0:p1])
            rows += r0
            cols += r0
            keep = cols > rows
            if multi:
                keep &= seg_s[rows] == seg_s[cols]
            out_i.append(rows[keep])
            out_j.append(cols[keep])
    ci = np.concatenate(out_i) if out_i else np.zeros(0, np.int64)
    cj = np.concatenate(out_j) if out_j else np.zeros(0, np.int64)
    return torch.from_numpy(ci).to(dev), torch.from_numpy(cj).to(dev)


def _knn_cpu(faiss: Any, xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact ``IndexFlatIP`` search: ``float32 [q, k]`` scores and ``int64 [q, k]`` ids."""
    index = faiss.IndexFlatIP(xb.shape[1])
    index.add(xb)
    return index.search(xq, k)


def topk(
    qv: torch.Tensor,
    kv: torch.Tensor,
    qs_s: torch.Tensor,
    lo_of: torch.Tensor,
    hi_of: torch.Tensor,
    kk: int,
    *,
    dtype: str = "fp32",
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    budget_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``kk`` (the :class:`~consolidate.similarity.types.Engine` interface): one
    ``IndexFlatIP`` search per segment, ``knn_gpu`` on cuda (float16 inputs for
    ``fp16``/``bf16``, ``kk <=`` :data:`GPU_MAX_K`); the tile sizes and ``budget_bytes`` are
    not used. Equal scores are ordered by the lower key position.

    Raises:
        ImportError: faiss is not installed.
    """
    faiss = _import_faiss()
    dev = qv.device
    q, key = _as_f32(qv), _as_f32(kv)
    nq = q.shape[0]
    qs, lo_all, hi_all = qs_s.numpy(), lo_of.numpy(), hi_of.numpy()
    best_i = np.full((nq, kk), -1, np.int64)
    best_s = np.full((nq, kk), -np.inf, np.float32)
    gpu = _Gpu(faiss, dev, dtype) if dev.type == "cuda" else None
    q_starts = np.flatnonzero(np.r_[True, qs[1:] != qs[:-1]])
    q_ends = np.r_[q_starts[1:], nq]
    for a, b in zip(q_starts.tolist(), q_ends.tolist(), strict=True):
        lo, hi = int(lo_all[a]), int(hi_all[a])
        if hi == lo:
            continue
        kq = min(kk, hi - lo)
        xb = np.ascontiguousarray(key[lo:hi])
        xq = np.ascontiguousarray(q[a:b])
        scores, ids = gpu.knn(xq, xb, kq) if gpu is not None else _knn_cpu(faiss, xq, xb, kq)
        valid = ids >= 0
        pos = np.where(valid, ids.astype(np.int64) + lo, -1)
        scores = np.where(valid, scores, -np.inf).astype(np.float32)
        # equal scores: lower key position first
        srt = np.lexsort((np.where(valid, pos, np.iinfo(np.int64).max), -scores), axis=1)
        best_i[a:b, :kq] = np.take_along_axis(pos, srt, 1)
        best_s[a:b, :kq] = np.take_along_axis(scores, srt, 1)
    return torch.from_numpy(best_s).to(dev), torch.from_numpy(best_i).to(dev)


ENGINE = Engine(
    "faiss", threshold_candidates=threshold_candidates, topk=topk, place=place, max_topk=max_topk
)


class ApproxIndex:
    """Approximate top-k index (faiss IVF-Flat or HNSW, inner product) for stores past 10^6.

    Exact search costs ``2 * q * n * d`` flops; an IVF index scans only ``nprobe / nlist`` of
    the store per query, HNSW walks a graph. Use one index per namespace; measure the
    recall of a setting with :func:`recall_at_k` against the exact
    ``topk_neighbours(..., engine="faiss")`` on a sample of queries before trusting it.

    Args:
        kind: ``"ivf"`` (IVF-Flat: ``nlist`` k-means cells, ``nprobe`` scanned per query) or
            ``"hnsw"`` (``m`` links per node, ``ef_search`` / ``ef_construction`` beam widths).
        nlist: IVF cells (default ``4 * sqrt(n)``, at least 1 and at most ``n / 39``).
        nprobe: IVF cells scanned per query (clipped to ``nlist``).
        m, ef_search, ef_construction: HNSW parameters.
        train_size: IVF training sample (default ``min(n, 64 * nlist)``).
        device: ``"cpu"`` or ``"cuda[:k]"`` (IVF only; needs faiss GPU support).
        seed: seed of the training sample and of k-means.

    Raises:
        ValueError: unknown ``kind``, HNSW on cuda, or a cuda device where torch sees no CUDA.
    """

    def __init__(
        self,
        kind: str = "ivf",
        *,
        nlist: int | None = None,
        nprobe: int = 16,
        m: int = 32,
        ef_search: int = 128,
        ef_construction: int = 200,
        train_size: int | None = None,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        if kind not in ("ivf", "hnsw"):
            raise ValueError(f"kind must be 'ivf' or 'hnsw', got {kind!r}")
        self.kind = kind
        self.nlist, self.nprobe = nlist, nprobe
        self.m, self.ef_search, self.ef_construction = m, ef_search, ef_construction
        self.train_size, self.seed = train_size, seed
        _, self.device = _faiss_on(device)
        if kind == "hnsw" and self.device.type == "cuda":
            raise ValueError("faiss HNSW runs on the cpu only; use kind='ivf' on cuda")
        self.index: Any = None
        self.dim = 0

    @property
    def ntotal(self) -> int:
        """Vectors in the index (0 before :meth:`build`)."""
        return int(self.index.ntotal) if self.index is not None else 0

    def build(self, vectors: torch.Tensor | np.ndarray) -> ApproxIndex:
        """Train (IVF) and fill the index.

        Args:
            vectors: ``float32 [n, d]`` unit vectors, ``n >= 1``; positions become the ids.

        Returns:
            ``self``.

        Raises:
            ImportError: faiss is not installed.
            ValueError: ``vectors`` is not ``[n, d]`` with ``n >= 1``.
        """
        faiss = _import_faiss()
        x = _as_f32(vectors)
        if x.ndim != 2 or x.shape[0] < 1:
            raise ValueError(f"vectors must be [n, d] with n >= 1, got {tuple(x.shape)}")
        n, d = x.shape
        self.dim = d
        if self.kind == "hnsw":
            index = faiss.IndexHNSWFlat(d, self.m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = self.ef_construction
            index.hnsw.efSearch = self.ef_search
            index.add(x)
            self.index = index
            return self
        nlist = self.nlist or int(4 * np.sqrt(n))
        nlist = int(max(1, min(nlist, n // 39 if n >= 39 else 1)))
        self.nlist = nlist
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = self.seed
        ts = min(n, self.train_size or 64 * nlist)
        sample = np.random.default_rng(self.seed).choice(n, ts, replace=False)
        if self.device.type == "cuda":
            ordinal = self.device.index or 0
            self._res = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(self._res, ordinal, index)
        index.train(np.ascontiguousarray(x[np.sort(sample)]))
        index.add(x)
        index.nprobe = min(self.nprobe, nlist)
        self.index = index
        return self

    def search(self, queries: torch.Tensor | np.ndarray, k: int) -> TopK:
        """Approximate top-k by inner product.

        Args:
            queries: ``float32 [q, d]`` unit vectors.
            k: neighbours per query (>= 1).

        Returns:
            :class:`~consolidate.similarity.TopK`: ``indices int64 [q, k]`` (positions in
            the built vectors, ``-1`` where fewer than ``k`` were found), ``scores float32
            [q, k]`` (``-inf`` there).

        Raises:
            RuntimeError: :meth:`build` was not called.
            ValueError: ``k < 1`` or a dimension mismatch.
        """
        if self.index is None:
            raise RuntimeError("call build(vectors) before search")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        x = _as_f32(queries)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"queries must be [q, {self.dim}], got {tuple(x.shape)}")
        scores, ids = self.index.search(x, k)
        ids = ids.astype(np.int64)
        scores = np.where(ids >= 0, scores, -np.inf).astype(np.float32)
        return TopK(ids, scores)


def recall_at_k(approx: TopK, exact: TopK) -> float:
    """Share of the exact top-k ids that the approximate search found.

    ``sum over queries |approx ids ∩ exact ids| / sum over queries |exact ids|``, ignoring
    ``-1`` padding on both sides; the two may have different ``k`` (recall of the exact
    top-``k_exact`` within the approximate top-``k_approx``).

    Args:
        approx: approximate :class:`~consolidate.similarity.TopK`, ``indices [q, ka]``.
        exact: exact :class:`~consolidate.similarity.TopK`, ``indices [q, ke]``.

    Returns:
        recall in [0, 1]; ``1.0`` when ``exact`` holds no ids.

    Raises:
        ValueError: different numbers of queries.
    """
    a = np.asarray(approx.indices, np.int64)
    e = np.asarray(exact.indices, np.int64)
    if a.ndim != 2 or e.ndim != 2 or a.shape[0] != e.shape[0]:
        raise ValueError(f"approx {a.shape} and exact {e.shape} must be [q, k] with the same q")
    total = int((e >= 0).sum())
    if total == 0:
        return 1.0
    # one key per (query, id): ids are < 2**40 and queries < 2**23 in any practical store
    span = int(max(a.max(initial=0), e.max(initial=0))) + 1
    qa = np.arange(a.shape[0], dtype=np.int64)[:, None] * span
    ka = np.unique((qa + a)[a >= 0])
    ke = (qa + e)[e >= 0]
    # an id listed twice in one exact row counts once per listing (does not happen in TopK)
    return float(np.isin(ke, ka).sum() / total)

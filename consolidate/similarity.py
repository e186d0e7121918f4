"""Tiled cosine-similarity join: every pair above a threshold, within each namespace.

One code path for cpu and cuda (a ``device`` argument). The rows are sorted by namespace
(segment) so that each namespace is a contiguous block; a row tile ``[r0, r1)`` is compared only
with columns ``[r0, end of the last segment in the tile)``: the upper triangle of each block,
and many small namespaces share one matmul (block-diagonal packing), so 10^4 stores of 100 rows
cost a few hundred tile launches, not 10^4 Python calls. No more than one ``tile_rows x
tile_cols`` block of scores exists at a time.

Exactness: tiles are computed in the chosen dtype with a margin below the threshold; every
candidate is then re-scored in float64 from the float32 vectors and kept only if ``>=
threshold``. The pair set therefore equals a float64 brute-force reference, and the similarity
values do not depend on row order or tile sizes (which makes clustering order-independent).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .store.batch import resolve_device

__all__ = ["Pairs", "TopK", "threshold_pairs", "topk_neighbours", "auto_tile", "DTYPE_MARGIN"]

#: candidate margin below the threshold per tile dtype (max |error| of a unit-vector dot
#: product in that dtype for d <= 4096, with headroom); candidates are re-scored in float64.
DTYPE_MARGIN = {"fp32": 1e-4, "tf32": 4e-3, "bf16": 3e-2, "fp16": 6e-3}
_TORCH_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                "fp16": torch.float16}


@dataclass
class Pairs:
    """Sparse similarity pairs, ``i < j`` (positions in the input), sorted by (i, j).

    Attributes:
        i, j: ``int64 [p]`` numpy arrays.
        sim: ``float64 [p]`` cosine similarity, re-scored in float64.
    """

    i: np.ndarray
    j: np.ndarray
    sim: np.ndarray

    def __len__(self) -> int:
        return int(self.i.shape[0])


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def auto_tile(n: int, device: torch.device, budget_bytes: int | None = None) -> tuple[int, int]:
    """Tile shape ``(rows, cols)`` whose working set fits the memory budget.

    The working set of a tile is about 16 bytes per score (float32 scores, the boolean mask
    and the index temporaries of ``nonzero``). Default budget: 1/8 of available memory, at
    most 2 GiB on cpu and 8 GiB on cuda.

    Args:
        n: number of rows.
        device: target device.
        budget_bytes: override the budget (bytes).

    Returns:
        ``(tile_rows, tile_cols)``, each >= 64 and <= max(n, 64).
    """
    if budget_bytes is None:
        cap = (8 << 30) if device.type == "cuda" else (2 << 30)
        budget_bytes = min(_available_bytes(device) // 8, cap)
    rows = 4096 if device.type == "cpu" else 16384
    rows = max(64, min(rows, n))
    cols = max(64, min(budget_bytes // (16 * rows), max(n, 64)))
    return int(rows), int(cols)


def threshold_pairs(
    vectors: torch.Tensor | np.ndarray,
    threshold: float,
    *,
    segments: torch.Tensor | np.ndarray | None = None,
    device: str | torch.device = "auto",
    dtype: str = "fp32",
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    budget_bytes: int | None = None,
) -> Pairs:
    """All pairs ``i < j`` in the same segment with cosine ``>= threshold``.

    Args:
        vectors: ``float32 [n, d]`` unit vectors (cpu or cuda tensor, or numpy).
        threshold: cosine threshold in [-1, 1].
        segments: ``int64 [n]`` namespace codes; pairs never cross segments. ``None`` = one.
        device: ``"auto"`` (cuda if available), ``"cpu"`` or ``"cuda[:k]"``.
        dtype: tile precision, one of ``fp32``, ``tf32``, ``bf16``, ``fp16``. Results are
            exact in every dtype (float64 re-scoring of candidates within
            :data:`DTYPE_MARGIN`); lower precision only makes the tiles faster on GPUs.
        tile_rows, tile_cols: tile shape (default: :func:`auto_tile`).
        budget_bytes: memory budget for :func:`auto_tile`.

    Returns:
        :class:`Pairs` with positions into the input rows, sorted by ``(i, j)``.

    Raises:
        ValueError: bad shapes, unknown dtype, or ``segments`` of the wrong length.
    """
    if dtype not in _TORCH_DTYPE:
        raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPE)}, got {dtype!r}")
    dev = resolve_device(device)
    v = torch.as_tensor(vectors)
    if v.ndim != 2:
        raise ValueError(f"vectors must be [n, d], got shape {tuple(v.shape)}")
    n = v.shape[0]
    empty = Pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64))
    if n < 2:
        return empty
    seg = (torch.zeros(n, dtype=torch.int64) if segments is None
           else torch.as_tensor(segments, dtype=torch.int64).cpu())
    if seg.shape != (n,):
        raise ValueError(f"segments must have shape ({n},), got {tuple(seg.shape)}")
    order = torch.argsort(seg, stable=True)
    seg_sorted = seg[order]
    # end (exclusive) of each row's segment, in sorted positions
    _, counts = torch.unique_consecutive(seg_sorted, return_counts=True)
    ends = torch.repeat_interleave(torch.cumsum(counts, 0), counts)

    v32 = v.to(dev, torch.float32)[order.to(dev)]
    vt = v32.to(_TORCH_DTYPE[dtype])
    seg_dev = seg_sorted.to(dev)
    cand = threshold - DTYPE_MARGIN[dtype]
    if tile_rows is None or tile_cols is None:
        ar, ac = auto_tile(n, dev, budget_bytes)
        tile_rows, tile_cols = tile_rows or ar, tile_cols or ac
    tf32_prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    out_i, out_j = [], []
    try:
        for r0 in range(0, n, tile_rows):
            r1 = min(n, r0 + tile_rows)
            cend = int(ends[r1 - 1])
            rows = vt[r0:r1]
            rseg = seg_dev[r0:r1]
            for c0 in range(r0, cend, tile_cols):
                c1 = min(cend, c0 + tile_cols)
                s = rows @ vt[c0:c1].T
                m = s >= cand
                # upper triangle: column index > row index
                ri = torch.arange(r0, r1, device=dev)[:, None]
                ci = torch.arange(c0, c1, device=dev)[None, :]
                m &= ci > ri
                m &= rseg[:, None] == seg_dev[c0:c1][None, :]
                nz = m.nonzero()
                if nz.numel():
                    out_i.append(nz[:, 0] + r0)
                    out_j.append(nz[:, 1] + c0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_prev
    if not out_i:
        return empty
    ci_ = torch.cat(out_i)
    cj_ = torch.cat(out_j)
    sim = _rescore64(v32, ci_, cj_)
    keep = sim >= threshold
    ci_, cj_, sim = ci_[keep], cj_[keep], sim[keep]
    oi = order.to(dev)[ci_]
    oj = order.to(dev)[cj_]
    lo, hi = torch.minimum(oi, oj), torch.maximum(oi, oj)
    lo, hi, sim = lo.cpu().numpy(), hi.cpu().numpy(), sim.cpu().numpy()
    srt = np.lexsort((hi, lo))
    return Pairs(lo[srt].astype(np.int64), hi[srt].astype(np.int64), sim[srt])


def _rescore64(v32: torch.Tensor, i: torch.Tensor, j: torch.Tensor,
               chunk: int = 1 << 16) -> torch.Tensor:
    """float64 dot products of rows ``i`` and ``j`` of ``v32`` (deterministic per pair)."""
    out = torch.empty(i.shape[0], dtype=torch.float64, device=v32.device)
    for k in range(0, i.shape[0], chunk):
        a = v32[i[k : k + chunk]].double()
        b = v32[j[k : k + chunk]].double()
        out[k : k + chunk] = (a * b).sum(1)
    return out


@dataclass
class TopK:
    """Top-k neighbours per query.

    Attributes:
        indices: ``int64 [q, k]`` key positions, best first; ``-1`` where a query has fewer
            than ``k`` keys in its segment.
        scores: ``float32 [q, k]`` cosine in the tile dtype (``-inf`` for padding).
    """

    indices: np.ndarray
    scores: np.ndarray


def topk_neighbours(
    queries: torch.Tensor | np.ndarray,
    keys: torch.Tensor | np.ndarray,
    k: int,
    *,
    query_segments: torch.Tensor | np.ndarray | None = None,
    key_segments: torch.Tensor | np.ndarray | None = None,
    device: str | torch.device = "auto",
    dtype: str = "fp32",
    tile_rows: int = 4096,
    tile_cols: int | None = None,
    budget_bytes: int | None = None,
) -> TopK:
    """Top-k keys by cosine for every query, only within the query's segment (namespace).

    Queries and keys are sorted by segment internally, so a query tile is compared only with
    the key range of the segments it contains; a running top-k per row is merged tile by
    tile, so memory stays at one ``tile_rows x tile_cols`` block. Ties are broken by the
    lower key position (stable order).

    Args:
        queries: ``float32 [q, d]`` unit vectors.
        keys: ``float32 [n, d]`` unit vectors.
        k: neighbours per query (>= 1).
        query_segments, key_segments: ``int64 [q]`` / ``[n]`` segment codes (both or neither).
        device, dtype, tile_rows, tile_cols, budget_bytes: as for :func:`threshold_pairs`.

    Returns:
        :class:`TopK` in the original query order with original key positions.

    Raises:
        ValueError: bad shapes, ``k < 1``, or only one of the segment arrays given.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if (query_segments is None) != (key_segments is None):
        raise ValueError("give both query_segments and key_segments, or neither")
    if dtype not in _TORCH_DTYPE:
        raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPE)}, got {dtype!r}")
    dev = resolve_device(device)
    q = torch.as_tensor(queries).to(dev, torch.float32)
    key = torch.as_tensor(keys).to(dev, torch.float32)
    if q.ndim != 2 or key.ndim != 2 or q.shape[1] != key.shape[1]:
        raise ValueError(f"queries {tuple(q.shape)} and keys {tuple(key.shape)} must be "
                         f"[q, d] and [n, d]")
    nq, n = q.shape[0], key.shape[0]
    if n == 0 or nq == 0:
        return TopK(np.full((nq, k), -1, np.int64), np.full((nq, k), -np.inf, np.float32))
    if query_segments is None:
        qs = torch.zeros(nq, dtype=torch.int64)
        ks = torch.zeros(n, dtype=torch.int64)
    else:
        qs = torch.as_tensor(query_segments, dtype=torch.int64).cpu()
        ks = torch.as_tensor(key_segments, dtype=torch.int64).cpu()
    qord = torch.argsort(qs, stable=True)
    kord = torch.argsort(ks, stable=True)
    qs_s, ks_s = qs[qord], ks[kord]
    # key range [lo, hi) of each segment value, looked up by searchsorted
    lo_of = torch.searchsorted(ks_s, qs_s, side="left")
    hi_of = torch.searchsorted(ks_s, qs_s, side="right")
    tdt = _TORCH_DTYPE[dtype]
    qv = q[qord.to(dev)].to(tdt)
    kv = key[kord.to(dev)].to(tdt)
    ks_dev, qs_dev = ks_s.to(dev), qs_s.to(dev)
    if tile_cols is None:
        tile_cols = auto_tile(max(n, 1), dev, budget_bytes)[1]
    kk = min(k, max(n, 1))
    best_s = torch.full((nq, kk), float("-inf"), device=dev)
    best_i = torch.full((nq, kk), -1, dtype=torch.int64, device=dev)
    tf32_prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        for r0 in range(0, nq, tile_rows):
            r1 = min(nq, r0 + tile_rows)
            c_lo, c_hi = int(lo_of[r0:r1].min()), int(hi_of[r0:r1].max())
            bs, bi = best_s[r0:r1], best_i[r0:r1]
            for c0 in range(c_lo, c_hi, tile_cols):
                c1 = min(c_hi, c0 + tile_cols)
                s = (qv[r0:r1] @ kv[c0:c1].T).float()
                s.masked_fill_(qs_dev[r0:r1, None] != ks_dev[None, c0:c1], float("-inf"))
                idx = torch.arange(c0, c1, device=dev).expand(r1 - r0, -1)
                cs = torch.cat([bs, s], 1)
                ci = torch.cat([bi, idx], 1)
                top = torch.topk(cs, kk, dim=1, sorted=True)
                bs, bi = top.values, torch.gather(ci, 1, top.indices)
            best_s[r0:r1], best_i[r0:r1] = bs, bi
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_prev
    kord_dev = kord.to(dev)
    mapped = torch.where(bi_valid := (best_i >= 0) & torch.isfinite(best_s),
                         kord_dev[best_i.clamp(min=0)], torch.full_like(best_i, -1))
    best_s = torch.where(bi_valid, best_s, torch.full_like(best_s, float("-inf")))
    inv = torch.empty_like(qord)
    inv[qord] = torch.arange(nq)
    inv = inv.to(dev)
    out_i, out_s = mapped[inv].cpu().numpy(), best_s[inv].cpu().numpy()
    if kk < k:  # fewer keys than k
        pad = k - kk
        out_i = np.pad(out_i, ((0, 0), (0, pad)), constant_values=-1)
        out_s = np.pad(out_s, ((0, 0), (0, pad)), constant_values=-np.inf)
    return TopK(out_i.astype(np.int64), out_s.astype(np.float32))

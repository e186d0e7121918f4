"""Tiled cosine-similarity join: every pair above a threshold, within each namespace.

One code path for cpu and cuda (a ``device`` argument). The rows are sorted by namespace
(segment) so that each namespace is a contiguous block. A namespace that fits one row tile is
one padded block, and the namespaces of one padded size share batched matmuls, so 10^4 stores
of 100 rows cost a few launches, not 10^4 Python calls. A bigger namespace is cut into
``tile_rows x tile_cols`` tiles over its upper triangle. No more than about one tile's worth
of scores exists at a time, never the n x n matrix.

Exactness: tiles are computed in the chosen dtype with a margin below the threshold; every
candidate is then re-scored in float64 from the float32 vectors (from the input itself when it
is float64) and kept only if ``>= threshold``. The pair set therefore equals a float64
brute-force reference, and the similarity values do not depend on row order or tile sizes
(which makes clustering order-independent). The float64 dot product is one fixed summation
order; another float64 order can differ in the last bit, so a pair whose cosine equals the
threshold to ~1e-16 (e.g. exact duplicates at threshold 1.0) may fall on either side.

Engines (keyword ``engine`` of :func:`threshold_pairs` and :func:`topk_neighbours`):

* ``"torch"``: the tiled torch path described above (cpu or cuda).
* ``"triton"``: fused Triton kernels (:mod:`consolidate.kernels.triton_join`): each program
  computes one tile of scores on chip and writes only the surviving candidate pairs (or
  keeps a running top-k on chip); one launch covers every namespace. The candidates go
  through the same float64 re-scoring and sorting as the torch path, so the pairs and
  similarities are identical. Needs ``pip install triton`` and a CUDA device, or
  ``TRITON_INTERPRET=1`` (set before triton is imported) to run on cpu in the interpreter.
* ``"faiss"``: delegated to :mod:`consolidate.faiss_engine` (imported lazily).
* ``"auto"`` (default): ``"triton"`` on a cuda device when triton imports, else ``"torch"``;
  on cpu the default is therefore the torch path. Triton is imported only when chosen.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from .store.batch import resolve_device

__all__ = ["Pairs", "TopK", "threshold_pairs", "topk_neighbours", "auto_tile", "DTYPE_MARGIN",
           "ENGINES", "check_engine"]

#: candidate margin below the threshold per tile dtype (max |error| of a unit-vector dot
#: product in that dtype for d <= 4096, with headroom); candidates are re-scored in float64.
DTYPE_MARGIN = {"fp32": 1e-4, "tf32": 4e-3, "bf16": 3e-2, "fp16": 6e-3}
_TORCH_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                "fp16": torch.float16}
#: values of the ``engine`` keyword.
ENGINES = ("auto", "torch", "triton", "faiss")
#: default Triton tile (BLOCK_M, BLOCK_N) of the threshold join; tile_rows/tile_cols given
#: to the Triton engine are rounded down to a power of two in [16, 128].
_TRITON_TILE = (64, 64)


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


def auto_tile(n: int, device: torch.device, budget_bytes: int | None = None,
              cache_sized: bool = True) -> tuple[int, int]:
    """Tile shape ``(rows, cols)`` whose working set fits the memory budget.

    The working set of a tile is about 16 bytes per score (float32 scores, the boolean mask
    and the index temporaries of ``nonzero``). Default budget: 1/8 of available memory, at
    most 2 GiB on cpu and 8 GiB on cuda. On cpu the tile is also kept near cache size
    (1024 x 2048 float32 scores = 8 MiB, inside a 32 MiB L3): the threshold pass then reads
    scores that the matmul has just written from cache, not from memory. On a 2-core EPYC,
    n = 50,000, d = 384, this made the join about 1.5x faster than 4096 x 32768 tiles (same
    run, ``scripts/benchmark.py``).

    Args:
        n: number of rows.
        device: target device.
        budget_bytes: override the budget (bytes).
        cache_sized: on cpu, keep the tile near cache size (the threshold join). The top-k
            passes ``False`` (4096 rows, columns from the budget): it merges a running top-k
            per column tile, and narrow tiles made it 3-4x slower (n = 200,000, q = 4,096).

    Returns:
        ``(tile_rows, tile_cols)``, each >= 64 and <= max(n, 64).
    """
    if budget_bytes is None:
        cap = (8 << 30) if device.type == "cuda" else (2 << 30)
        budget_bytes = min(_available_bytes(device) // 8, cap)
    rows = 16384 if device.type == "cuda" else (1024 if cache_sized else 4096)
    rows = max(64, min(rows, n))
    cols = max(64, min(budget_bytes // (16 * rows), max(n, 64)))
    if device.type != "cuda" and cache_sized:
        cols = min(cols, 2048)
    return int(rows), int(cols)


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check_tiles(tile_rows: int | None, tile_cols: int | None) -> None:
    """Raise ``ValueError`` unless each tile size is ``None`` or an integer >= 1."""
    for name, val in (("tile_rows", tile_rows), ("tile_cols", tile_cols)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, (int, np.integer))
                                or val < 1):
            raise ValueError(f"{name} must be an integer >= 1 or None, got {val!r}")


def _resolve_engine(engine: str, dev: torch.device) -> str:
    """The engine to run: validates ``engine`` and resolves ``"auto"``.

    Raises:
        ValueError: unknown engine, or ``"triton"`` on a non-cuda device without
            ``TRITON_INTERPRET=1``.
        ImportError: ``"triton"`` without triton installed.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
    if engine == "auto":
        return "triton" if dev.type == "cuda" and _triton_importable() else "torch"
    if engine == "triton":
        if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the triton engine needs CUDA or TRITON_INTERPRET=1 (set before "
                             f"triton is imported); device is {dev}")
        if not _triton_importable():
            raise ImportError("engine='triton' needs triton: pip install triton "
                              "(or pip install 'consolidate[gpu]')")
    return engine


def check_engine(engine: str, device: str | torch.device = "auto") -> str:
    """The engine that ``engine`` means on ``device`` (``"auto"`` resolved), checked before
    any work starts.

    Raises:
        ValueError: unknown engine or device, a cuda device without CUDA, or
            ``"triton"`` on cpu without ``TRITON_INTERPRET=1``.
        ImportError: ``"triton"`` without triton installed.
    """
    return _resolve_engine(engine, resolve_device(device))


def _triton_join():
    """The Triton kernel module (imports triton)."""
    from .kernels import triton_join

    return triton_join


def _triton_block(size: int | None, default: int | None) -> int | None:
    """A torch-path tile size as a Triton block: power of two in [16, 128] (rounded down)."""
    if size is None:
        return default
    return 1 << (min(128, max(16, int(size))).bit_length() - 1)


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
    engine: str = "auto",
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
        tile_rows, tile_cols: tile shape (default: :func:`auto_tile`; cpu 1024 x 2048). A
            namespace of at most ``tile_rows`` rows is one padded block, batched with others
            of its padded size into about ``tile_rows * tile_cols`` scores per matmul. For the
            Triton engine they are the kernel's block shape, rounded down to a power of two
            in [16, 128] (default 64 x 64).
        budget_bytes: memory budget for :func:`auto_tile` (torch engine only).
        engine: ``"auto"``, ``"torch"``, ``"triton"`` or ``"faiss"`` (see the module
            docstring); every engine returns the same pair set.

    Returns:
        :class:`Pairs` with positions into the input rows, sorted by ``(i, j)``.

    Raises:
        ValueError: bad shapes, unknown dtype, ``segments`` of the wrong length, unknown
            engine, or ``engine="triton"`` on cpu without ``TRITON_INTERPRET=1``.
        ImportError: ``engine="triton"`` without triton installed.
    """
    dev = resolve_device(device)
    eng = _resolve_engine(engine, dev)
    if dtype not in _TORCH_DTYPE:
        raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPE)}, got {dtype!r}")
    if not np.isfinite(threshold):
        raise ValueError(f"threshold must be a finite cosine, got {threshold!r}")
    _check_tiles(tile_rows, tile_cols)
    v = torch.as_tensor(vectors).detach()
    if v.ndim != 2:
        raise ValueError(f"vectors must be [n, d], got shape {tuple(v.shape)}")
    _check_finite(v, "vectors")
    n = v.shape[0]
    seg = torch.zeros(n, dtype=torch.int64) if segments is None else _codes(segments, "segments")
    if seg.shape != (n,):
        raise ValueError(f"segments must have shape ({n},), got {tuple(seg.shape)}")
    if eng == "faiss":
        from .faiss_engine import threshold_pairs_faiss

        return threshold_pairs_faiss(vectors, threshold, segments=segments, device=device,
                                     dtype=dtype)
    empty = Pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64))
    if n < 2:
        return empty
    grp, seg_sorted = _grouped(seg)  # None when already grouped: no copy of the store
    order = torch.arange(n) if grp is None else grp
    v32 = _take(v.to(dev, torch.float32), grp)
    # rows per namespace, in sorted order
    _, counts = torch.unique_consecutive(seg_sorted, return_counts=True)
    vt = v32.to(_TORCH_DTYPE[dtype])
    cand = threshold - DTYPE_MARGIN[dtype]
    if eng == "triton":
        # end (exclusive) of each row's segment, in sorted positions
        ends = torch.repeat_interleave(torch.cumsum(counts, 0), counts)
        ci_, cj_ = _triton_join().threshold_candidates(
            vt, ends, cand, block_m=_triton_block(tile_rows, _TRITON_TILE[0]),
            block_n=_triton_block(tile_cols, _TRITON_TILE[1]), allow_tf32=dtype == "tf32")
    else:
        ci_, cj_ = _torch_candidates(vt, counts, cand, dtype, tile_rows, tile_cols,
                                     budget_bytes)
    if not ci_.numel():
        return empty
    # float64 input is re-scored from itself, not from its float32 rounding
    src = v.to(dev) if v.dtype == torch.float64 else None
    return _pairs_from_candidates(v32, order.to(dev), ci_, cj_, threshold, src=src)


def _codes(x: torch.Tensor | np.ndarray, what: str) -> torch.Tensor:
    """Namespace codes as a cpu ``int64`` tensor; ``ValueError`` for non-integer codes (a
    float 0.2 and 0.7 would both truncate to namespace 0)."""
    t = torch.as_tensor(x).detach()
    if t.is_floating_point() or t.is_complex():
        raise ValueError(f"{what} must be integer namespace codes, got dtype {t.dtype}")
    return t.to(torch.int64).cpu()


def _check_finite(x: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` naming the first rows of ``x`` (``[n, d]``) with NaN or inf: their
    scores compare false against every threshold and would silently hide pairs."""
    step = max(1, (8 << 20) // max(1, x.shape[1]))  # row chunks: at most 8 MiB of mask
    bad = torch.cat([~torch.isfinite(x[r : r + step]).all(dim=1)
                     for r in range(0, x.shape[0], step)] or [x.new_zeros(0, dtype=torch.bool)])
    if bool(bad.any()):
        rows = bad.nonzero()[:, 0]
        raise ValueError(f"{what}: {rows.numel()} row(s) contain NaN or inf, e.g. rows "
                         f"{rows[:10].tolist()}")


def _block_size(size: torch.Tensor) -> torch.Tensor:
    """Padded block size of a namespace of ``size`` rows: rounded up to a multiple of
    ``max(8, 2**(floor(log2 size) - 3))``, so padding adds at most 1/8 per side and sizes
    fall into about 8 buckets per octave (one batched matmul each)."""
    step = torch.clamp(2 ** (torch.floor(torch.log2(size.double().clamp(min=1))) - 3), min=8)
    step = step.to(torch.int64)
    return (size + step - 1) // step * step


#: on cpu, a batched block's gathered rows plus scores stay near this size (bytes), so the
#: matmul reads the rows the gather has just written from cache, not from memory
_CPU_BATCH_BYTES = 8 << 20


def _per_batch(block_scores: int, scores: int, gathered_bytes: int, dev: torch.device) -> int:
    """Namespaces per batched matmul: about ``block_scores`` scores in all, and on cpu at most
    :data:`_CPU_BATCH_BYTES` of gathered rows and float32 scores."""
    per = max(1, block_scores // scores)
    if dev.type != "cuda":
        per = min(per, max(1, _CPU_BATCH_BYTES // (gathered_bytes + 4 * scores)))
    return per


def _blocks(x: torch.Tensor, starts: torch.Tensor, p: int) -> torch.Tensor:
    """``[B, p, d]`` copy of rows ``starts[b] .. starts[b] + p - 1`` of ``x`` (``[n, d]``),
    the last row repeated past the end; the caller drops rows past each namespace's size."""
    ix = (starts[:, None] + torch.arange(p, device=x.device)[None, :]).clamp(max=x.shape[0] - 1)
    return x.index_select(0, ix.reshape(-1)).view(-1, p, x.shape[1])


def _small_block_candidates(vt: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor,
                            cand: float, block_scores: int) -> list[tuple[torch.Tensor, ...]]:
    """Candidates of namespaces that fit one row tile: each namespace is one padded ``P x P``
    block, and the namespaces of one padded size go through batched matmuls (``bmm`` over a
    ``[B, P, d]`` gather) of about ``block_scores`` scores each. Rows past a namespace's end
    (the next namespace's, or the last row repeated) are computed and dropped by the
    ``c < size`` test, so the blocks never need a mask pass.

    Args:
        vt: ``[n, d]`` sorted vectors in the tile dtype.
        starts, sizes: ``int64`` (cpu) first sorted position and row count per namespace.
        cand: candidate threshold (threshold minus the dtype margin).
        block_scores: scores per batched matmul (the tile budget).

    Returns:
        list of ``(i, j)`` int64 tensors on ``vt``'s device, ``i < j``.
    """
    d = vt.shape[1]
    dev = vt.device
    out = []
    padded = _block_size(sizes)
    for p in torch.unique(padded).tolist():
        sel = (padded == p).nonzero()[:, 0]
        per = _per_batch(block_scores, p * p, p * d * vt.element_size(), dev)
        for b0 in range(0, sel.numel(), per):
            st = starts[sel[b0 : b0 + per]].to(dev)
            sz = sizes[sel[b0 : b0 + per]].to(dev)
            x = _blocks(vt, st, p)
            b, r, c = (torch.bmm(x, x.transpose(1, 2)) >= cand).nonzero().unbind(1)
            keep = (r < c) & (c < sz[b])
            b, r, c = b[keep], r[keep], c[keep]
            out.append((st[b] + r, st[b] + c))
    return out


def _tile_hits(s: torch.Tensor, cand: float, row_prefilter: bool) -> torch.Tensor:
    """``[h, 2]`` (row, col) positions of ``s >= cand`` in one score tile. With
    ``row_prefilter`` the row maxima are taken first and ``nonzero`` runs only on the rows
    that reach ``cand`` (most rows of a near-duplicate join have none); past half the rows it
    runs on the whole tile."""
    if not row_prefilter:
        return (s >= cand).nonzero()
    hit = (s.amax(1) >= cand).nonzero()[:, 0]
    if not hit.numel():
        return hit.new_zeros((0, 2))
    if 2 * hit.numel() > s.shape[0]:
        return (s >= cand).nonzero()
    nz = (s[hit] >= cand).nonzero()
    nz[:, 0] = hit[nz[:, 0]]
    return nz


def _torch_candidates(vt: torch.Tensor, counts: torch.Tensor, cand: float, dtype: str,
                      tile_rows: int | None, tile_cols: int | None,
                      budget_bytes: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate pairs (sorted positions, ``int64``) of the tiled torch path.

    ``counts`` (cpu ``int64``): rows per namespace, in sorted order. A namespace of at most
    ``tile_rows`` rows whose padded block holds at most ``tile_rows * tile_cols`` scores is
    one block, batched with the others of its padded size
    (:func:`_small_block_candidates`): 10^4 stores of 100 rows cost a few batched matmuls.
    A bigger namespace is split into ``tile_rows x tile_cols`` tiles over its upper
    triangle. On cpu the tiles are thresholded with a row-max prefilter
    (:func:`_tile_hits`); on cuda with one ``nonzero`` per tile.
    """
    n, dev = vt.shape[0], vt.device
    if tile_rows is None or tile_cols is None:
        ar, ac = auto_tile(n, dev, budget_bytes)
        # columns for the rows actually used, so an explicit tile_rows keeps the budget
        if tile_cols is None:
            tile_cols = ac if tile_rows is None else max(64, ar * ac // tile_rows)
        tile_rows = tile_rows or ar
    starts = torch.cumsum(counts, 0) - counts
    block_scores = max(tile_rows * tile_cols, 1 << 16)
    # a namespace is one block only if that block fits the tile budget
    fits = (counts <= tile_rows) & (_block_size(counts) ** 2 <= block_scores)
    small = (counts >= 2) & fits
    large = ((counts >= 2) & ~fits).nonzero()[:, 0].tolist()
    prefilter = dev.type != "cuda"
    tf32_prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    parts: list[tuple[torch.Tensor, ...]] = []
    try:
        if bool(small.any()):
            parts += _small_block_candidates(vt, starts[small], counts[small], cand,
                                             block_scores)
        for g in large:
            s0, s1 = int(starts[g]), int(starts[g] + counts[g])
            for r0 in range(s0, s1, tile_rows):
                r1 = min(s1, r0 + tile_rows)
                rows = vt[r0:r1]
                for c0 in range(r0, s1, tile_cols):
                    c1 = min(s1, c0 + tile_cols)
                    s = rows @ vt[c0:c1].T
                    if c0 == r0:  # the diagonal: a row's own score would pass the prefilter
                        s.diagonal().fill_(float("-inf"))
                    nz = _tile_hits(s, cand, prefilter)
                    if nz.numel():
                        i, j = nz[:, 0] + r0, nz[:, 1] + c0
                        keep = j > i
                        parts.append((i[keep], j[keep]))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_prev
    if not parts:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return empty, empty
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _pairs_from_candidates(v32: torch.Tensor, order: torch.Tensor, ci_: torch.Tensor,
                           cj_: torch.Tensor, threshold: float,
                           src: torch.Tensor | None = None) -> Pairs:
    """Re-score candidates in float64, keep ``>= threshold``, map back to input positions
    and sort by ``(i, j)`` (shared by every engine, so their results are identical).
    ``v32``: sorted float32 rows; ``src``: the input rows in input order, used for the
    re-scoring instead when given (float64 input)."""
    oi = order[ci_]
    oj = order[cj_]
    sim = _rescore64(v32, ci_, cj_) if src is None else _rescore64(src, oi, oj)
    keep = sim >= threshold
    oi, oj, sim = oi[keep], oj[keep], sim[keep]
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


def _grouped(seg: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(order, seg[order])`` grouping equal codes together (stable); ``order`` is ``None``
    when ``seg`` is already non-decreasing, so the vectors need not be copied."""
    if bool((seg[1:] >= seg[:-1]).all()):
        return None, seg
    order = torch.argsort(seg, stable=True)
    return order, seg[order]


def _take(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``x`` in ``order`` (``x`` itself for ``None``)."""
    return x if order is None else x.index_select(0, order.to(x.device))


@dataclass
class TopK:
    """Top-k neighbours per query.

    Attributes:
        indices: ``int64 [q, k]`` key positions, best first; ``-1`` where a query has fewer
            than ``k`` keys in its segment.
        scores: ``float32 [q, k]`` cosine in the tile dtype (``-inf`` for padding); the torch
            engine rounds 16-bit tiles to their dtype, the Triton engine accumulates the
            16-bit products in float32.
    """

    indices: np.ndarray
    scores: np.ndarray


def _rank_key(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``int64`` keys whose order is (score desc, position asc): the float32 score's bits made
    order-preserving in the high 32 bits, ``2**32 - 1 - position`` in the low 32 (``-1``
    padding ranks last). ``torch.topk`` over floats is not stable, so equal scores would
    otherwise come back in any order."""
    bits = scores.float().contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    low = torch.where(pos >= 0, 0xFFFFFFFF - pos, torch.zeros_like(pos))
    return (ordered << 32) | low


def topk_neighbours(
    queries: torch.Tensor | np.ndarray,
    keys: torch.Tensor | np.ndarray,
    k: int,
    *,
    query_segments: torch.Tensor | np.ndarray | None = None,
    key_segments: torch.Tensor | np.ndarray | None = None,
    device: str | torch.device = "auto",
    dtype: str = "fp32",
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    budget_bytes: int | None = None,
    engine: str = "auto",
) -> TopK:
    """Top-k keys by cosine for every query, only within the query's segment (namespace).

    Queries and keys are sorted by segment internally, so a query tile is compared only with
    the key range of the segments it contains; a running top-k per row is merged tile by
    tile, so memory stays at one ``tile_rows x tile_cols`` block (torch engine) or on chip
    (Triton engine). Ties are broken by the lower key position (stable order). Ties are
    decided on the tile-dtype scores: BLAS kernels of different tile widths can give the same
    pair scores one float32 ulp apart, so exact duplicate keys may come back in another order
    than a float64 reference when ``tile_cols`` splits them unevenly.

    Args:
        queries: ``float32 [q, d]`` unit vectors.
        keys: ``float32 [n, d]`` unit vectors.
        k: neighbours per query (>= 1).
        query_segments, key_segments: ``int64 [q]`` / ``[n]`` segment codes (both or neither).
        device, dtype, tile_cols, budget_bytes: as for :func:`threshold_pairs`.
        tile_rows: query rows per tile (torch default 4096; Triton: rounded down to a power
            of two in [16, 128], default 64/32/16 as k grows).
        engine: ``"auto"``, ``"torch"``, ``"triton"`` or ``"faiss"`` (see the module
            docstring). The Triton engine supports ``min(k, n) <= 128``; ``"auto"`` falls
            back to torch above that.

    Returns:
        :class:`TopK` in the original query order with original key positions.

    Raises:
        ValueError: bad shapes, ``k < 1``, only one of the segment arrays given, unknown
            dtype or engine, ``engine="triton"`` on cpu without ``TRITON_INTERPRET=1``, or
            ``engine="triton"`` with ``min(k, n) > 128``.
        ImportError: ``engine="triton"`` without triton installed.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    k = int(k)
    _check_tiles(tile_rows, tile_cols)
    if (query_segments is None) != (key_segments is None):
        raise ValueError("give both query_segments and key_segments, or neither")
    dev = resolve_device(device)
    eng = _resolve_engine(engine, dev)
    if dtype not in _TORCH_DTYPE:
        raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPE)}, got {dtype!r}")
    q, key = torch.as_tensor(queries).detach(), torch.as_tensor(keys).detach()
    if q.ndim != 2 or key.ndim != 2 or q.shape[1] != key.shape[1]:
        raise ValueError(f"queries {tuple(q.shape)} and keys {tuple(key.shape)} must be "
                         f"[q, d] and [n, d]")
    _check_finite(q, "queries")
    _check_finite(key, "keys")
    nq, n = q.shape[0], key.shape[0]
    if query_segments is None:
        qs = torch.zeros(nq, dtype=torch.int64)
        ks = torch.zeros(n, dtype=torch.int64)
    else:
        qs = _codes(query_segments, "query_segments")
        ks = _codes(key_segments, "key_segments")
        if qs.shape != (nq,) or ks.shape != (n,):
            raise ValueError(f"query_segments {tuple(qs.shape)} and key_segments "
                             f"{tuple(ks.shape)} must have shapes ({nq},) and ({n},)")
    if eng == "faiss":
        from .faiss_engine import topk_faiss

        return topk_faiss(queries, keys, k, query_segments=query_segments,
                          key_segments=key_segments, device=device, dtype=dtype)
    q, key = q.to(dev, torch.float32), key.to(dev, torch.float32)
    if n == 0 or nq == 0:
        return TopK(np.full((nq, k), -1, np.int64), np.full((nq, k), -np.inf, np.float32))
    kk = min(k, max(n, 1))
    if eng == "triton" and kk > _triton_join().MAX_TOPK:
        if engine == "auto":
            eng = "torch"
        else:
            raise ValueError(f"engine='triton' supports min(k, n) <= "
                             f"{_triton_join().MAX_TOPK}, got {kk}; use engine='torch'")
    qord, qs_s = _grouped(qs)
    kord, ks_s = _grouped(ks)
    # key range [lo, hi) of each segment value, looked up by searchsorted
    lo_of = torch.searchsorted(ks_s, qs_s, side="left")
    hi_of = torch.searchsorted(ks_s, qs_s, side="right")
    tdt = _TORCH_DTYPE[dtype]
    qv = _take(q, qord).to(tdt)
    kv = _take(key, kord).to(tdt)
    if eng == "triton":
        best_s, best_i = _triton_join().topk_candidates(
            qv, kv, lo_of, hi_of, kk, block_m=_triton_block(tile_rows, None),
            block_n=_triton_block(tile_cols, 64), allow_tf32=dtype == "tf32")
    else:
        best_s, best_i = _topk_torch(qv, kv, qs_s, lo_of, hi_of, kk, dtype,
                                     4096 if tile_rows is None else tile_rows, tile_cols,
                                     budget_bytes)
    bi_valid = (best_i >= 0) & torch.isfinite(best_s)
    if kord is not None:  # back to the callers' key positions
        best_i = kord.to(dev)[best_i.clamp(min=0)]
    mapped = torch.where(bi_valid, best_i, torch.full_like(best_i, -1))
    best_s = torch.where(bi_valid, best_s, torch.full_like(best_s, float("-inf")))
    if qord is not None:  # back to the callers' query order
        inv = torch.empty_like(qord)
        inv[qord] = torch.arange(nq)
        mapped, best_s = mapped[inv.to(dev)], best_s[inv.to(dev)]
    out_i, out_s = mapped.cpu().numpy(), best_s.cpu().numpy()
    if kk < k:  # fewer keys than k
        pad = k - kk
        out_i = np.pad(out_i, ((0, 0), (0, pad)), constant_values=-1)
        out_s = np.pad(out_s, ((0, 0), (0, pad)), constant_values=-np.inf)
    return TopK(out_i.astype(np.int64), out_s.astype(np.float32))


def _tile_topk(s: torch.Tensor, kt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``kt`` of each row of a ``float32 [r, m]`` score tile, ordered by (score desc,
    column asc): ``[r, kt]`` scores and column positions.

    ``torch.topk`` is not stable, so it takes one more than needed; rows where the
    ``(kt+1)``-th score equals the ``kt``-th (a tie straddles the cut) are redone with the
    exact (score, position) key, and the kept columns are then ordered by that key."""
    m, dev = s.shape[1], s.device
    v, ix = torch.topk(s, min(kt + 1, m), dim=1, sorted=True)
    tied = torch.zeros(s.shape[0], dtype=torch.bool, device=dev)
    if v.shape[1] > kt:
        tied = (v[:, kt] == v[:, kt - 1]) & torch.isfinite(v[:, kt])
    v, ix = v[:, :kt], ix[:, :kt]
    if bool(tied.any()):
        # in row chunks: the int64 keys take ~40 bytes per score, the tile 4
        tied_rows = tied.nonzero()[:, 0]
        step = max(1, s.shape[0] // 8)
        for c in range(0, tied_rows.numel(), step):
            rows = tied_rows[c : c + step]
            pos = torch.arange(m, device=dev).expand(len(rows), -1)
            ix[rows] = torch.topk(_rank_key(s[rows], pos), kt, dim=1).indices
            v[rows] = torch.gather(s[rows], 1, ix[rows])
    top = torch.topk(_rank_key(v, ix), kt, dim=1, sorted=True).indices
    return torch.gather(v, 1, top), torch.gather(ix, 1, top)


def _topk_small_blocks(qv: torch.Tensor, kv: torch.Tensor, qst: torch.Tensor,
                       qcnt: torch.Tensor, kst: torch.Tensor, kcnt: torch.Tensor, kk: int,
                       best_s: torch.Tensor, best_i: torch.Tensor, block_scores: int) -> None:
    """Top-``kk`` of namespaces whose queries fit one row tile and keys one column tile,
    written into ``best_s`` / ``best_i`` (sorted query rows, sorted key positions).

    Each namespace is one padded ``Pq x Pk`` block (sizes from :func:`_block_size`); the
    namespaces of one padded shape go through batched matmuls of about ``block_scores``
    scores. Padded key columns (other namespaces' rows) are set to ``-inf`` before the
    top-k; padded query rows are not written.

    Args:
        qv, kv: ``[q, d]`` / ``[n, d]`` sorted queries and keys in the tile dtype.
        qst, qcnt: ``int64`` (cpu) first sorted query row and query count per namespace.
        kst, kcnt: ``int64`` (cpu) first sorted key position and key count (>= 1).
        kk: neighbours per query.
        best_s, best_i: ``float32 / int64 [q, kk]`` outputs (``-inf`` / ``-1`` prefilled).
        block_scores: scores per batched matmul (the tile budget).
    """
    d = qv.shape[1]
    dev = qv.device
    pq_all, pk_all = _block_size(qcnt), _block_size(kcnt)
    shape_id = pq_all * (int(pk_all.max()) + 1) + pk_all
    for sid in torch.unique(shape_id).tolist():
        sel = (shape_id == sid).nonzero()[:, 0]
        pq, pk = int(pq_all[sel[0]]), int(pk_all[sel[0]])
        arq, ark = torch.arange(pq, device=dev), torch.arange(pk, device=dev)
        kt = min(kk, pk)
        per = _per_batch(block_scores, pq * pk, (pq + pk) * d * qv.element_size(), dev)
        for b0 in range(0, sel.numel(), per):
            part = sel[b0 : b0 + per]
            qs0, qc = qst[part].to(dev), qcnt[part].to(dev)
            ks0, kc = kst[part].to(dev), kcnt[part].to(dev)
            sc = torch.bmm(_blocks(qv, qs0, pq), _blocks(kv, ks0, pk).transpose(1, 2)).float()
            sc.masked_fill_(ark[None, None, :] >= kc[:, None, None], float("-inf"))
            v, ix = _tile_topk(sc.view(-1, pk), kt)
            b, r = (arq[None, :] < qc[:, None]).nonzero().unbind(1)
            flat = b * pq + r
            v, ix = v[flat], ix[flat]
            rows = qs0[b] + r
            best_s[rows, :kt] = v
            best_i[rows, :kt] = torch.where(torch.isfinite(v), ix + ks0[b, None],
                                            torch.full_like(ix, -1))


def _topk_torch(qv: torch.Tensor, kv: torch.Tensor, qs_s: torch.Tensor, lo_of: torch.Tensor,
                hi_of: torch.Tensor, kk: int, dtype: str, tile_rows: int,
                tile_cols: int | None, budget_bytes: int | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Running top-``kk`` of the tiled torch path: ``float32 [q, kk]`` scores and ``int64
    [q, kk]`` sorted key positions (``-1``/``-inf`` where missing), queries sorted.

    ``qs_s`` (cpu): sorted query segment codes; ``lo_of`` / ``hi_of`` (cpu): each sorted
    query's key range. A namespace with at most ``tile_rows`` queries and ``tile_cols`` keys
    is one block, batched with the others of its padded shape
    (:func:`_topk_small_blocks`); a bigger one runs query tiles against its key range tile
    by tile, merging a running top-k."""
    nq, n, dev = qv.shape[0], kv.shape[0], qv.device
    if tile_cols is None:
        ar, ac = auto_tile(max(n, 1), dev, budget_bytes, cache_sized=False)
        tile_cols = max(64, ar * ac // tile_rows)  # the budget at the rows actually used
    best_s = torch.full((nq, kk), float("-inf"), device=dev)
    best_i = torch.full((nq, kk), -1, dtype=torch.int64, device=dev)
    _, qcnt = torch.unique_consecutive(qs_s, return_counts=True)
    qst = torch.cumsum(qcnt, 0) - qcnt
    kst, kcnt = lo_of[qst], hi_of[qst] - lo_of[qst]
    block_scores = max(tile_rows * tile_cols, 1 << 16)
    small = (kcnt > 0) & (qcnt <= tile_rows) & (kcnt <= tile_cols) & (
        _block_size(qcnt) * _block_size(kcnt) <= block_scores)
    large = ((kcnt > 0) & ~small).nonzero()[:, 0].tolist()
    tf32_prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        if bool(small.any()):
            _topk_small_blocks(qv, kv, qst[small], qcnt[small], kst[small], kcnt[small], kk,
                               best_s, best_i, block_scores)
        for g in large:
            a, b = int(qst[g]), int(qst[g] + qcnt[g])
            lo, hi = int(kst[g]), int(kst[g] + kcnt[g])
            for r0 in range(a, b, tile_rows):
                r1 = min(b, r0 + tile_rows)
                # start from the -inf / -1 rows (padding where a namespace holds < kk keys)
                # and merge each column tile's top-k into the running top-k: memory stays
                # at one tile plus [rows, 2 kk]
                run_s, run_i = best_s[r0:r1], best_i[r0:r1]
                for c0 in range(lo, hi, tile_cols):
                    c1 = min(hi, c0 + tile_cols)
                    v, ix = _tile_topk((qv[r0:r1] @ kv[c0:c1].T).float(), min(kk, c1 - c0))
                    cs, ci = torch.cat([run_s, v], 1), torch.cat([run_i, ix + c0], 1)
                    top = torch.topk(_rank_key(cs, ci), kk, dim=1, sorted=True).indices
                    run_s, run_i = torch.gather(cs, 1, top), torch.gather(ci, 1, top)
                best_s[r0:r1], best_i[r0:r1] = run_s, run_i
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_prev
    return best_s, best_i

"""Cosine-similarity join and top-k within namespaces: the entry points of every engine.

:func:`threshold_pairs` returns every pair above a threshold within each namespace
(segment); :func:`topk_neighbours` the top-k keys of every query within its namespace. Both
check every input here, sort rows by segment (so each namespace is a contiguous block), hand
the sorted rows to an engine, and map the engine's answer back to input positions. No engine
ever holds the n x n matrix.

Exactness: an engine computes scores in the chosen tile dtype and returns the candidates
within a margin below the threshold (:data:`DTYPE_MARGIN`); every candidate is then re-scored
here in float64 from the float32 vectors (from the input itself when it is float64) and kept
only if ``>= threshold``. The pair set therefore equals a float64 brute-force reference, and
the similarity values do not depend on the engine, row order or tile sizes (which makes
clustering order-independent). The float64 dot product is one fixed summation order; another
float64 order can differ in the last bit, so a pair whose cosine equals the threshold to
~1e-16 (e.g. exact duplicates at threshold 1.0) may fall on either side.

Engines (keyword ``engine``; the registry is :mod:`consolidate.similarity.engines`, and an
engine's module is imported only when it is chosen):

* ``"torch"`` (:mod:`~consolidate.similarity.engines.torch_engine`): tiled torch matmuls, one
  code path for cpu and cuda. A namespace that fits one row tile is one padded block, and
  the namespaces of one padded size share batched matmuls, so 10^4 stores of 100 rows cost a
  few launches, not 10^4 Python calls; a bigger namespace is cut into ``tile_rows x
  tile_cols`` tiles over its upper triangle (about one tile of scores at a time).
* ``"triton"`` (:mod:`~consolidate.similarity.engines.triton_engine`): fused Triton kernels
  (:mod:`consolidate.kernels.triton_join`): each program computes one tile of scores on chip
  and writes only the surviving candidate pairs (or keeps a running top-k on chip); one
  launch covers every namespace. Needs ``pip install triton`` and a CUDA device, or
  ``TRITON_INTERPRET=1`` (set before triton is imported) to run on cpu in the interpreter.
* ``"faiss"`` (:mod:`~consolidate.similarity.engines.faiss_engine`): ``IndexFlatIP``
  ``range_search`` / ``search`` over packs of namespaces on faiss-cpu, ``knn_gpu`` on GPU
  faiss; ``device="auto"`` is cuda only when faiss sees a GPU.
* ``"auto"`` (default): ``"triton"`` on a cuda device when triton imports, else ``"torch"``;
  on cpu the default is therefore the torch path. Triton is imported only when chosen.

The top-k's scores are the engine's (tile dtype), not re-scored; ties go to the lower key
position in every engine.
"""

from __future__ import annotations

import numpy as np
import torch

from ..device import resolve_device
from ..registry import did_you_mean
from .engines import get_engine, names
from .tiling import auto_tile
from .types import DTYPE_MARGIN, TORCH_DTYPE, Engine, Pairs, TopK

__all__ = [
    "Pairs",
    "TopK",
    "threshold_pairs",
    "topk_neighbours",
    "auto_tile",
    "DTYPE_MARGIN",
    "ENGINES",
    "check_engine",
]

#: values of the ``engine`` keyword: ``"auto"`` and every registered engine.
ENGINES = ("auto", *names())


def _check_tiles(tile_rows: int | None, tile_cols: int | None) -> None:
    """Raise ``ValueError`` unless each tile size is ``None`` or an integer >= 1."""
    for name, val in (("tile_rows", tile_rows), ("tile_cols", tile_cols)):
        if val is not None and (
            isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1
        ):
            raise ValueError(f"{name} must be an integer >= 1 or None, got {val!r}")


def _check_dtype(dtype: str) -> None:
    if dtype not in TORCH_DTYPE:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPE)}, got {dtype!r}")


def _usable(engine: Engine, dev: torch.device) -> bool:
    try:
        engine.check(dev)
    except (ImportError, ValueError):
        return False
    return True


def _resolve_engine(engine: str, dev: torch.device) -> str:
    """The engine to run: validates ``engine`` and resolves ``"auto"``.

    Raises:
        ValueError: unknown engine, or ``"triton"`` on a non-cuda device without
            ``TRITON_INTERPRET=1``.
        ImportError: ``"triton"`` without triton installed.
    """
    if engine not in ENGINES:
        raise ValueError(
            f"engine must be one of {list(ENGINES)}, got {engine!r}"
            f"{did_you_mean(str(engine), ENGINES)}"
        )
    if engine == "auto":
        # triton is not even tried on cpu (the interpreter is for tests)
        return "triton" if dev.type == "cuda" and _usable(get_engine("triton"), dev) else "torch"
    get_engine(engine).check(dev)
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


def _codes(x: torch.Tensor | np.ndarray, what: str) -> torch.Tensor:
    """Namespace codes as a cpu ``int64`` tensor; ``ValueError`` for non-integer codes (a
    float 0.2 and 0.7 would both truncate to namespace 0)."""
    t = torch.as_tensor(x).detach()
    if t.is_floating_point() or t.is_complex():
        raise ValueError(f"{what} must be integer namespace codes, got dtype {t.dtype}")
    return t.to(torch.int64).cpu()


#: largest accepted | ||v|| - 1 | of an input row: above the rounding of vectors stored as
#: bf16 (at most 2**-9 relative per component), far below a vector that was never
#: normalised (norms 0.99, 3 or 0.1 rank by magnitude instead of by cosine)
UNIT_TOLERANCE = 4e-3


def _check_unit(x: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` naming the first rows of ``x`` (``[n, d]``) that hold NaN or inf
    (their scores compare false against every threshold and would silently hide pairs) or
    are not unit vectors within :data:`UNIT_TOLERANCE` (a dot product is a cosine only for
    unit vectors). One norm reduction over the rows finds both."""
    if not x.numel() or not (x.is_floating_point() or x.is_complex()):
        return
    norm = torch.linalg.vector_norm(
        x, dim=1, dtype=None if x.dtype in (torch.float64, torch.float32) else torch.float32
    )
    bad = ~(torch.abs(norm - 1) <= UNIT_TOLERANCE)  # NaN compares false
    if not bool(bad.any()):
        return
    rows = bad.nonzero()[:, 0]
    nonfinite = rows[~torch.isfinite(x.index_select(0, rows)).all(dim=1)]
    if nonfinite.numel():
        raise ValueError(
            f"{what}: {nonfinite.numel()} row(s) contain NaN or inf, e.g. rows "
            f"{nonfinite[:10].tolist()}"
        )
    raise ValueError(
        f"{what}: {rows.numel()} row(s) are not unit vectors (|norm - 1| > "
        f"{UNIT_TOLERANCE:g}), e.g. rows {rows[:10].tolist()} with norms "
        f"{[round(float(v), 6) for v in norm[rows[:10]].tolist()]}; normalise them first"
    )


def _unit_queries(q: torch.Tensor) -> torch.Tensor:
    """``q`` (``[q, d]``) with rows rescaled to unit length where they are not unit vectors
    (a query is asked, not stored: its length carries no meaning). Unit rows are returned
    as they are.

    Raises:
        ValueError: a row holds NaN or inf, or is a zero vector (names the rows)."""
    if not q.numel() or not q.is_floating_point():
        return q
    norm = torch.linalg.vector_norm(
        q, dim=1, dtype=torch.float32 if q.dtype != torch.float64 else None
    )
    if bool((torch.abs(norm - 1) <= UNIT_TOLERANCE).all()):
        return q
    bad = (~torch.isfinite(norm) | (norm <= 1e-12)).nonzero()[:, 0]
    if bad.numel():
        raise ValueError(
            f"queries: {bad.numel()} row(s) are zero or contain NaN or inf, e.g. rows "
            f"{bad[:10].tolist()}"
        )
    return (q.to(norm.dtype) / norm[:, None]).to(q.dtype)


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
        vectors: ``float32 [n, d]`` unit vectors (cpu or cuda tensor, or numpy; float64 is
            re-scored from itself).
        threshold: cosine threshold in [-1, 1].
        segments: ``int64 [n]`` namespace codes (any integer dtype); pairs never cross
            segments. ``None`` = one.
        device: ``"auto"`` (cuda if available; for faiss: if faiss sees a GPU), ``"cpu"`` or
            ``"cuda[:k]"``.
        dtype: tile precision, one of ``fp32``, ``tf32``, ``bf16``, ``fp16``. Results are
            exact in every dtype (float64 re-scoring of candidates within
            :data:`DTYPE_MARGIN`); lower precision only makes the tiles faster on GPUs.
        tile_rows, tile_cols: tile shape (default: :func:`auto_tile`; cpu 1024 x 2048). A
            namespace of at most ``tile_rows`` rows is one padded block, batched with others
            of its padded size into about ``tile_rows * tile_cols`` scores per matmul. For the
            Triton engine they are the kernel's block shape, rounded down to a power of two
            in [16, 128] (default 64 x 64). For faiss: query rows per faiss call (default
            4096) and the most rows of consecutive small namespaces searched together
            (default 512).
        budget_bytes: memory budget for :func:`auto_tile` (torch engine only).
        engine: ``"auto"``, ``"torch"``, ``"triton"`` or ``"faiss"`` (see the module
            docstring); every engine returns the same pairs and similarities.

    Returns:
        :class:`Pairs` with positions into the input rows, sorted by ``(i, j)``.

    Raises:
        ValueError: ``vectors`` not ``[n, d]``, with NaN/inf rows or rows that are not
            unit vectors (within :data:`UNIT_TOLERANCE`), a non-finite
            ``threshold``, unknown dtype, tile sizes that are not integers >= 1, ``segments``
            of the wrong length or not integer codes, unknown engine or device, a cuda
            device without CUDA, ``engine="triton"`` on cpu without ``TRITON_INTERPRET=1``,
            or ``engine="faiss"`` on cuda with a faiss that sees no GPU.
        ImportError: ``engine="triton"`` without triton, or ``engine="faiss"`` without
            faiss installed.
    """
    dev = resolve_device(device)
    name = _resolve_engine(engine, dev)
    _check_dtype(dtype)
    if not np.isfinite(threshold):
        raise ValueError(f"threshold must be a finite cosine, got {threshold!r}")
    _check_tiles(tile_rows, tile_cols)
    v, seg = _threshold_inputs(vectors, segments)
    eng = get_engine(name)
    tiles = {"tile_rows": tile_rows, "tile_cols": tile_cols, "budget_bytes": budget_bytes}
    return _join(v, seg, eng, eng.place(device, dev), threshold, dtype, tiles)


def _join(
    v: torch.Tensor,
    seg: torch.Tensor,
    eng: Engine,
    dev: torch.device,
    threshold: float,
    dtype: str,
    tiles: dict[str, int | None],
) -> Pairs:
    """:func:`threshold_pairs` on checked inputs: rows grouped by segment, the engine's
    candidates, float64 re-scoring (:func:`_pairs_from_candidates`)."""
    n = v.shape[0]
    empty = Pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64))
    if n < 2:
        return empty
    grp, seg_sorted = _grouped(seg)  # None when already grouped: no copy of the store
    order = (torch.arange(n) if grp is None else grp).to(dev)
    vdev = v.to(dev, torch.float32)
    # an engine that gathers its blocks reads the input rows through the order: no sorted
    # copy of the whole store
    lazy = grp is not None and eng.gathers
    v32 = vdev if lazy else _take(vdev, grp)
    ci_, cj_ = eng.threshold_candidates(
        v32,
        torch.unique_consecutive(seg_sorted, return_counts=True)[1],  # rows per namespace
        threshold,
        dtype=dtype,
        **tiles,
        **({"rows": order} if lazy else {}),
    )
    if not ci_.numel():
        return empty
    # float64 input is re-scored from itself, not from its float32 rounding; input in
    # input order (lazy) from the input rows by their positions
    src = v.to(dev) if v.dtype == torch.float64 else (vdev if lazy else None)
    return _pairs_from_candidates(v32, order, ci_, cj_, threshold, src=src)


def _threshold_inputs(
    vectors: torch.Tensor | np.ndarray, segments: torch.Tensor | np.ndarray | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`threshold_pairs`'s inputs checked: ``(vectors, int64 [n] segment codes)`` (one
    segment when none are given).

    Raises:
        ValueError: see :func:`threshold_pairs`.
    """
    v = torch.as_tensor(vectors).detach()
    if v.ndim != 2:
        raise ValueError(f"vectors must be [n, d], got shape {tuple(v.shape)}")
    _check_unit(v, "vectors")
    n = v.shape[0]
    seg = torch.zeros(n, dtype=torch.int64) if segments is None else _codes(segments, "segments")
    if seg.shape != (n,):
        raise ValueError(f"segments must have shape ({n},), got {tuple(seg.shape)}")
    return v, seg


def _pairs_from_candidates(
    v32: torch.Tensor,
    order: torch.Tensor,
    ci_: torch.Tensor,
    cj_: torch.Tensor,
    threshold: float,
    src: torch.Tensor | None = None,
) -> Pairs:
    """Re-score candidates in float64, keep ``>= threshold``, map back to input positions
    and sort by ``(i, j)`` (shared by every engine, so their results are identical).
    ``v32``: sorted float32 rows; ``order``: input position of each sorted row; ``ci_`` /
    ``cj_``: candidate sorted positions; ``src``: the input rows in input order, used for
    the re-scoring instead when given (float64 input)."""
    oi = order[ci_]
    oj = order[cj_]
    sim = _rescore64(v32, ci_, cj_) if src is None else _rescore64(src, oi, oj)
    keep = sim >= threshold
    oi, oj, sim = oi[keep], oj[keep], sim[keep]
    lo, hi = torch.minimum(oi, oj), torch.maximum(oi, oj)
    lo_, hi_, sim_ = lo.cpu().numpy(), hi.cpu().numpy(), sim.cpu().numpy()
    srt = np.lexsort((hi_, lo_))
    return Pairs(lo_[srt].astype(np.int64), hi_[srt].astype(np.int64), sim_[srt])


def _rescore64(
    v32: torch.Tensor, i: torch.Tensor, j: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """float64 dot products of rows ``i`` and ``j`` of ``v32`` (deterministic per pair: the
    same value whatever the chunk). ``chunk`` pairs at a time (default 2**16 on cuda; 1024 on
    cpu, where the float64 copies of a chunk then stay in cache: 15,471 pairs of d = 384 in
    47 ms against 283 ms with 2**16)."""
    if chunk is None:
        chunk = 1 << 16 if v32.device.type == "cuda" else 1024
    out = torch.empty(i.shape[0], dtype=torch.float64, device=v32.device)
    for k in range(0, i.shape[0], chunk):
        a = v32[i[k : k + chunk]].double()
        b = v32[j[k : k + chunk]].double()
        out[k : k + chunk] = (a * b).sum(1)
    return out


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
    (Triton engine); faiss searches each namespace. Ties are broken by the lower key
    position (stable order). Ties are decided on the tile-dtype scores: BLAS kernels of
    different tile widths can give the same pair scores one float32 ulp apart, so exact
    duplicate keys may come back in another order than a float64 reference when
    ``tile_cols`` splits them unevenly.

    Args:
        queries: ``float32 [q, d]`` vectors, rescaled to unit length if they are not.
        keys: ``float32 [n, d]`` unit vectors (stored vectors: not rescaled).
        k: neighbours per query (>= 1).
        query_segments, key_segments: ``int64 [q]`` / ``[n]`` integer segment codes (both or
            neither).
        device, dtype, tile_cols, budget_bytes: as for :func:`threshold_pairs`.
        tile_rows: query rows per tile (torch default 4096; Triton: rounded down to a power
            of two in [16, 128], default 64/32/16 as k grows). faiss ignores the tile sizes.
        engine: ``"auto"``, ``"torch"``, ``"triton"`` or ``"faiss"`` (see the module
            docstring). The Triton engine supports ``min(k, n) <= 128``, faiss on cuda
            ``min(k, n) <= 2048``; ``"auto"`` falls back to torch above the Triton limit.

    Returns:
        :class:`TopK` in the original query order with original key positions.

    Raises:
        ValueError: as :func:`threshold_pairs` (for the keys; query rows are rescaled, zero
            ones refused), and ``queries``/``keys`` of different widths, ``k`` not an
            integer >= 1, only one of the segment arrays given, or ``min(k, n)`` above the
            engine's limit.
        ImportError: as :func:`threshold_pairs`.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    k = int(k)
    _check_tiles(tile_rows, tile_cols)
    dev = resolve_device(device)
    name = _resolve_engine(engine, dev)
    _check_dtype(dtype)
    q, key, qs, ks = _topk_inputs(queries, keys, query_segments, key_segments)
    nq, n = q.shape[0], key.shape[0]
    eng = get_engine(name)
    dev = eng.place(device, dev)
    q, key = q.to(dev, torch.float32), key.to(dev, torch.float32)
    if n == 0 or nq == 0:
        return TopK(np.full((nq, k), -1, np.int64), np.full((nq, k), -np.inf, np.float32))
    kk = min(k, max(n, 1))
    eng = _topk_engine(eng, name, engine != "auto", dev, kk)
    qord, qs_s = _grouped(qs)
    kord, ks_s = _grouped(ks)
    best_s, best_i = eng.topk(
        _take(q, qord),
        _take(key, kord),
        qs_s,
        # key range [lo, hi) of each query's segment
        torch.searchsorted(ks_s, qs_s, side="left"),
        torch.searchsorted(ks_s, qs_s, side="right"),
        kk,
        dtype=dtype,
        tile_rows=tile_rows,
        tile_cols=tile_cols,
        budget_bytes=budget_bytes,
    )
    return _topk_in_callers_order(best_s, best_i, qord, kord, kk, k)


def _topk_inputs(
    queries: torch.Tensor | np.ndarray,
    keys: torch.Tensor | np.ndarray,
    query_segments: torch.Tensor | np.ndarray | None,
    key_segments: torch.Tensor | np.ndarray | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`topk_neighbours`'s inputs checked: ``(unit queries, keys, query segment
    codes, key segment codes)`` (one segment when none are given).

    Raises:
        ValueError: see :func:`topk_neighbours`.
    """
    if (query_segments is None) != (key_segments is None):
        raise ValueError("give both query_segments and key_segments, or neither")
    q, key = torch.as_tensor(queries).detach(), torch.as_tensor(keys).detach()
    if q.ndim != 2 or key.ndim != 2 or q.shape[1] != key.shape[1]:
        raise ValueError(
            f"queries {tuple(q.shape)} and keys {tuple(key.shape)} must be [q, d] and [n, d]"
        )
    q = _unit_queries(q)
    _check_unit(key, "keys")
    nq, n = q.shape[0], key.shape[0]
    if query_segments is None or key_segments is None:
        return q, key, torch.zeros(nq, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    qs = _codes(query_segments, "query_segments")
    ks = _codes(key_segments, "key_segments")
    if qs.shape != (nq,) or ks.shape != (n,):
        raise ValueError(
            f"query_segments {tuple(qs.shape)} and key_segments "
            f"{tuple(ks.shape)} must have shapes ({nq},) and ({n},)"
        )
    return q, key, qs, ks


def _topk_engine(eng: Engine, name: str, chosen: bool, dev: torch.device, kk: int) -> Engine:
    """``eng``, or the torch engine when ``min(k, n) = kk`` is above ``eng``'s limit on
    ``dev`` and the engine was not ``chosen`` by name.

    Raises:
        ValueError: ``kk`` above the limit of an engine chosen by name.
    """
    limit = eng.max_topk(dev)
    if limit is None or kk <= limit:
        return eng
    if chosen:
        raise ValueError(
            f"engine={name!r} supports min(k, n) <= {limit} on {dev.type}, "
            f"got {kk}; use engine='torch'"
        )
    return get_engine("torch")


def _topk_in_callers_order(
    best_s: torch.Tensor,
    best_i: torch.Tensor,
    qord: torch.Tensor | None,
    kord: torch.Tensor | None,
    kk: int,
    k: int,
) -> TopK:
    """The engine's ``[q, kk]`` answer over segment-sorted queries and keys as a
    :class:`TopK` in the callers' query order and key positions, padded to ``k`` columns
    (``-1`` / ``-inf``) when there are fewer keys than ``k``."""
    dev, nq = best_i.device, best_i.shape[0]
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

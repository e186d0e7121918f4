"""The tiled torch engine (``engine="torch"``): one code path for cpu and cuda.

Rows arrive sorted by namespace (segment), so each namespace is a contiguous block. A
namespace that fits one row tile is one padded block, and the namespaces of one padded size
share batched matmuls, so 10^4 stores of 100 rows cost a few launches, not 10^4 Python calls.
A bigger namespace is cut into ``tile_rows x tile_cols`` tiles over its upper triangle. No
more than about one tile's worth of scores exists at a time, never the n x n matrix. Tiles
are computed in the chosen dtype; the join keeps candidates :data:`DTYPE_MARGIN` below the
threshold for the caller's float64 re-scoring.

The top-k runs query tiles against the key range of their namespaces, merging a running
top-k per row tile by tile (batched padded blocks for namespaces that fit one tile); equal
scores go to the lower key position.
"""

from __future__ import annotations

import torch

from ..tiling import auto_tile
from ..types import DTYPE_MARGIN, TORCH_DTYPE, Engine

__all__ = ["ENGINE", "threshold_candidates", "topk"]


def threshold_candidates(
    v32: torch.Tensor,
    counts: torch.Tensor,
    threshold: float,
    *,
    dtype: str = "fp32",
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    budget_bytes: int | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate pairs of the join (the :class:`~consolidate.similarity.types.Engine`
    interface): the tiles in ``dtype``, kept ``>= threshold - DTYPE_MARGIN[dtype]``.

    Args:
        v32: ``float32 [n, d]`` rows sorted by segment (cpu or cuda), or in any order with
            ``rows``.
        counts: cpu ``int64`` rows per segment, in sorted order.
        threshold: cosine threshold.
        dtype: tile precision, a key of :data:`DTYPE_MARGIN`.
        tile_rows, tile_cols: tile shape (default: :func:`auto_tile`, cpu 1024 x 2048).
        budget_bytes: memory budget for :func:`auto_tile`.
        rows: ``int64 [n]`` on ``v32``'s device: the row of ``v32`` at each sorted
            position (``None``: ``v32`` is sorted). The batched blocks of small namespaces
            gather their rows through it; a namespace too big for one block needs
            contiguous rows, so then the sorted copy is made once here.

    Returns:
        ``(ci, cj)``: ``int64 [p]`` sorted positions ``ci < cj`` on ``v32``'s device.
    """
    return _torch_candidates(
        v32.to(TORCH_DTYPE[dtype]),
        counts,
        threshold - DTYPE_MARGIN[dtype],
        dtype,
        tile_rows,
        tile_cols,
        budget_bytes,
        rows,
    )


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
    """Running top-``kk`` (the :class:`~consolidate.similarity.types.Engine` interface) on
    tiles in ``dtype``: ``tile_rows`` query rows per tile (default 4096), ``tile_cols`` key
    columns (default from :func:`auto_tile` and ``budget_bytes``). See :func:`_topk_torch`.
    """
    tdt = TORCH_DTYPE[dtype]
    return _topk_torch(
        qv.to(tdt),
        kv.to(tdt),
        qs_s,
        lo_of,
        hi_of,
        kk,
        dtype,
        4096 if tile_rows is None else tile_rows,
        tile_cols,
        budget_bytes,
    )


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


def _blocks(
    x: torch.Tensor, starts: torch.Tensor, p: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, p, d]`` copy of sorted rows ``starts[b] .. starts[b] + p - 1`` of ``x``
    (``[n, d]``; sorted position ``k`` is ``x[rows[k]]`` when ``rows`` is given), the last
    row repeated past the end; the caller drops rows past each namespace's size."""
    ix = (starts[:, None] + torch.arange(p, device=x.device)[None, :]).clamp(max=x.shape[0] - 1)
    ix = ix.reshape(-1)
    return x.index_select(0, ix if rows is None else rows[ix]).view(-1, p, x.shape[1])


def _small_block_candidates(
    vt: torch.Tensor,
    starts: torch.Tensor,
    sizes: torch.Tensor,
    cand: float,
    block_scores: int,
    rows: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Candidates of namespaces that fit one row tile: each namespace is one padded ``P x P``
    block (``P`` the largest namespace of its :func:`_block_size` bucket, so stores of one
    size are not padded at all), and the namespaces of one bucket go through batched matmuls (``bmm`` over a
    ``[B, P, d]`` gather) of about ``block_scores`` scores each. Rows past a namespace's end
    (the next namespace's, or the last row repeated) are computed and dropped by the
    ``c < size`` test, so the blocks never need a mask pass.

    Args:
        vt: ``[n, d]`` sorted vectors in the tile dtype (any order with ``rows``).
        starts, sizes: ``int64`` (cpu) first sorted position and row count per namespace.
        cand: candidate threshold (threshold minus the dtype margin).
        block_scores: scores per batched matmul (the tile budget).
        rows: the row of ``vt`` at each sorted position (``None``: ``vt`` is sorted).

    Returns:
        list of ``(i, j)`` int64 sorted positions on ``vt``'s device, ``i < j``.
    """
    d = vt.shape[1]
    dev = vt.device
    out: list[tuple[torch.Tensor, ...]] = []
    padded = _block_size(sizes)
    for bucket in torch.unique(padded).tolist():
        sel = (padded == bucket).nonzero()[:, 0]
        p = int(sizes[sel].max())  # the bucket's largest namespace: no padding past it
        per = _per_batch(block_scores, p * p, p * d * vt.element_size(), dev)
        for b0 in range(0, sel.numel(), per):
            st = starts[sel[b0 : b0 + per]].to(dev)
            sz = sizes[sel[b0 : b0 + per]].to(dev)
            x = _blocks(vt, st, p, rows)
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


def _torch_candidates(
    vt: torch.Tensor,
    counts: torch.Tensor,
    cand: float,
    dtype: str,
    tile_rows: int | None,
    tile_cols: int | None,
    budget_bytes: int | None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate pairs (sorted positions, ``int64``) of the tiled torch path (``rows``:
    see :func:`threshold_candidates`).

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
    if rows is not None and large:  # the tiles below slice sorted rows
        vt, rows = vt.index_select(0, rows), None
    prefilter = dev.type != "cuda"
    tf32_prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    parts: list[tuple[torch.Tensor, ...]] = []
    try:
        if bool(small.any()):
            parts += _small_block_candidates(
                vt, starts[small], counts[small], cand, block_scores, rows
            )
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


def _rank_key(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``int64`` keys whose order is (score desc, position asc): the float32 score's bits made
    order-preserving in the high 32 bits, ``2**32 - 1 - position`` in the low 32 (``-1``
    padding ranks last). ``torch.topk`` over floats is not stable, so equal scores would
    otherwise come back in any order."""
    bits = scores.float().contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    low = torch.where(pos >= 0, 0xFFFFFFFF - pos, torch.zeros_like(pos))
    return (ordered << 32) | low


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


def _topk_small_blocks(
    qv: torch.Tensor,
    kv: torch.Tensor,
    qst: torch.Tensor,
    qcnt: torch.Tensor,
    kst: torch.Tensor,
    kcnt: torch.Tensor,
    kk: int,
    best_s: torch.Tensor,
    best_i: torch.Tensor,
    block_scores: int,
) -> None:
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
            best_i[rows, :kt] = torch.where(
                torch.isfinite(v), ix + ks0[b, None], torch.full_like(ix, -1)
            )


def _topk_torch(
    qv: torch.Tensor,
    kv: torch.Tensor,
    qs_s: torch.Tensor,
    lo_of: torch.Tensor,
    hi_of: torch.Tensor,
    kk: int,
    dtype: str,
    tile_rows: int,
    tile_cols: int | None,
    budget_bytes: int | None,
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
    small = (
        (kcnt > 0)
        & (qcnt <= tile_rows)
        & (kcnt <= tile_cols)
        & (_block_size(qcnt) * _block_size(kcnt) <= block_scores)
    )
    large = ((kcnt > 0) & ~small).nonzero()[:, 0].tolist()
    tf32_prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        if bool(small.any()):
            _topk_small_blocks(
                qv,
                kv,
                qst[small],
                qcnt[small],
                kst[small],
                kcnt[small],
                kk,
                best_s,
                best_i,
                block_scores,
            )
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


ENGINE = Engine("torch", threshold_candidates=threshold_candidates, topk=topk, gathers=True)

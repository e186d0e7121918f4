"""Fused Triton kernels for the similarity engine (``engine="triton"``).

This module imports ``triton`` at import time; :mod:`consolidate.similarity` imports it only
when the Triton engine is chosen. On a machine without CUDA the kernels run under the
Triton interpreter, which must be switched on (``TRITON_INTERPRET=1``) before ``triton`` is
first imported in the process.

Both kernels work on rows already sorted by segment (namespace), as
:mod:`consolidate.similarity` prepares them, and on the vectors already cast to the tile
dtype (float32, bfloat16 or float16). Products are accumulated in float32 by ``tl.dot``.

Threshold join (:func:`threshold_candidates`)
    One program per ``(row tile, col tile)`` pair of a tile list built on the host from the
    segment ends: only tile pairs that meet the upper triangle of some segment's diagonal
    block are listed, so many small namespaces share one launch (10^4 namespaces of 100 rows
    are about 5 * 10^4 programs in one launch). The list is ordered in groups of
    ``group_m`` row tiles, column-tile-major inside a group, so consecutive programs reuse
    the same few row tiles and column tiles from L2. Each program computes its
    ``BLOCK_M x BLOCK_N`` block of cosines on chip, keeps the entries with ``score >=
    threshold - margin``, ``col > row`` and ``col < end of row's segment`` (same segment,
    since rows are sorted), and compacts them into a preallocated global ``(i, j)`` buffer:
    one ``tl.atomic_add`` on a global counter reserves a run of slots for the tile, and an
    in-tile prefix sum gives each survivor its slot. Scores never go to global memory.
    The counter keeps counting when the buffer is full (stores past the end are masked),
    so after the launches the host knows the exact candidate count; if it exceeds the
    capacity the host reallocates a buffer of exactly that size and reruns every launch
    once (:attr:`JoinStats.passes` is then 2).

Top-k (:func:`topk_candidates`)
    One program per query row tile. It loops over the key column tiles of the key range of
    the segments its rows belong to, computes a block of scores, masks keys outside each
    row's segment to ``-inf`` and merges the block into a running top-k held on chip. The
    running top-k is a ``[BLOCK_M, KP]`` tensor (``KP`` = k rounded up to a power of two) of
    int64 keys packing the float32 score (order-preserving bit pattern) in the high half
    and ``2^31 - 1 - key position`` in the low half, so one integer order sorts by score
    and breaks ties by the lower key position, and all keys of a row are distinct. A merge
    is "replace the minimum": while some row's largest remaining key of the block beats
    the smallest key of its running set, that key replaces it (``tl.max``/``tl.min``
    row reductions; a block that cannot improve any row costs one check, and a row takes
    at most ``KP`` keys from a block). The ``KP`` keys of each row are written unordered and
    sorted on the host (``q x KP`` int64, cheap), then unpacked to scores and positions.
    (A bitonic merge with ``tl.topk`` works too, but the Triton interpreter runs its
    custom-combine reductions element by element, far too slowly for CPU tests.)

Tile sizes and ``num_warps`` are compile-time constants with defaults that are sensible
but untuned (tuning needs a GPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = [
    "JoinStats",
    "TopKStats",
    "LAST_JOIN_STATS",
    "LAST_TOPK_STATS",
    "INITIAL_CAPACITY",
    "MAX_TOPK",
    "tile_list",
    "threshold_candidates",
    "topk_candidates",
]

#: largest ``k`` the on-chip top-k supports (the running list lives in registers).
MAX_TOPK = 128
#: initial output-buffer slots of the threshold join; ``None`` = ``max(2^16, 4 n)``. Tests
#: set it tiny to exercise the overflow rerun.
INITIAL_CAPACITY: int | None = None
#: tile pairs per launch at most (bounds the host tile list for one huge namespace: a
#: million-row namespace with 64 x 64 tiles is ~1.2 * 10^8 tiles, ~30 launches).
MAX_TILES_PER_LAUNCH = 1 << 22


@dataclass
class JoinStats:
    """Diagnostics of the last :func:`threshold_candidates` call.

    Attributes:
        launches: kernel launches per pass (1 unless the tile list exceeds
            :data:`MAX_TILES_PER_LAUNCH`).
        passes: 1, or 2 when the output buffer overflowed and the join was rerun.
        tiles: programs (tile pairs) per pass.
        capacity: output-buffer slots of the final pass.
        candidates: pairs written (score ``>= threshold - margin``), before re-scoring.
        block_m, block_n, block_k: tile shape used.
    """

    launches: int
    passes: int
    tiles: int
    capacity: int
    candidates: int
    block_m: int
    block_n: int
    block_k: int


@dataclass
class TopKStats:
    """Diagnostics of the last :func:`topk_candidates` call.

    Attributes:
        launches: kernel launches (always 1 for a non-empty query set).
        programs: query row tiles.
        block_m, block_n, block_k: tile shape used; ``kp``: padded k (a power of two).
    """

    launches: int
    programs: int
    block_m: int
    block_n: int
    block_k: int
    kp: int


#: set by :func:`threshold_candidates` / :func:`topk_candidates` (diagnostics, not
#: thread-safe).
LAST_JOIN_STATS: JoinStats | None = None
LAST_TOPK_STATS: TopKStats | None = None


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _on(dev: torch.device):
    """Launch context: Triton launches on the current cuda device, so make it ``dev``."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _upcast(v: torch.Tensor) -> bool:
    # cpu tensors only reach a kernel under the interpreter (see _dot_tile)
    return v.dtype == torch.bfloat16 and v.device.type == "cpu"


def _block_k(d: int, block_m: int, block_n: int, elem_bytes: int) -> int:
    """Reduction chunk: next_pow2(d) clipped to [16, 64], and small enough that three
    pipeline stages of the two operand tiles fit in ~96 KiB of shared memory (fp32 128 x 128
    tiles get 32; 64 KiB per stage would not fit an A100)."""
    fit = (96 << 10) // (3 * (block_m + block_n) * elem_bytes)
    return max(16, min(64, _next_pow2(d), 1 << (max(fit, 1).bit_length() - 1)))


# --------------------------------------------------------------------------- kernels


@triton.jit
def _dot_tile(
    a_base,
    b_base,
    rows,
    cols,
    rmask,
    cmask,
    d,
    stride_a,
    stride_b,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_FP32: tl.constexpr,
    ALLOW_TF32: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """float32 ``[BLOCK_M, BLOCK_N]`` block of ``a[rows] @ b[cols].T`` (masked rows are 0).

    ``UPCAST`` multiplies in float32 (exact for 16-bit inputs, same fp32 accumulation): set
    for bfloat16 under the Triton interpreter, whose ``dot`` multiplies the raw uint16 bits
    of bfloat16 operands.
    """
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_base + rows.to(tl.int64)[:, None] * stride_a + ks[None, :]
    b_ptrs = b_base + cols.to(tl.int64)[None, :] * stride_b + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):
        kmask = (k0 + ks) < d
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif IS_FP32:
            if ALLOW_TF32:
                acc = tl.dot(a, b, acc, input_precision="tf32")
            else:
                acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _threshold_join_kernel(
    v_ptr,
    ends_ptr,
    tile_r_ptr,
    tile_c_ptr,
    out_i_ptr,
    out_j_ptr,
    counter_ptr,
    n,
    d,
    stride_v,
    cand,
    capacity,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_FP32: tl.constexpr,
    ALLOW_TF32: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rt = tl.load(tile_r_ptr + pid)
    ct = tl.load(tile_c_ptr + pid)
    rows = rt * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = ct * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n
    cmask = cols < n
    s = _dot_tile(
        v_ptr,
        v_ptr,
        rows,
        cols,
        rmask,
        cmask,
        d,
        stride_v,
        stride_v,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        IS_FP32,
        ALLOW_TF32,
        UPCAST,
    )
    # end (exclusive) of each row's segment; rows are sorted by segment, so
    # row < col < end[row] means "upper triangle, same segment" (and col < n)
    end_r = tl.load(ends_ptr + rows, mask=rmask, other=0)
    keep = (s >= cand) & (cols[None, :] > rows[:, None]) & (cols[None, :] < end_r[:, None])
    flat = tl.reshape(keep.to(tl.int32), [BLOCK_M * BLOCK_N])
    cnt = tl.sum(flat, axis=0)
    if cnt > 0:
        # reserve cnt slots for this tile, then each survivor takes base + (its rank)
        base = tl.atomic_add(counter_ptr, cnt.to(tl.int64), sem="relaxed")
        pos = base + (tl.cumsum(flat, axis=0) - 1).to(tl.int64)
        ii = tl.reshape(tl.broadcast_to(rows[:, None], [BLOCK_M, BLOCK_N]), [BLOCK_M * BLOCK_N])
        jj = tl.reshape(tl.broadcast_to(cols[None, :], [BLOCK_M, BLOCK_N]), [BLOCK_M * BLOCK_N])
        ok = (flat != 0) & (pos < capacity)
        tl.store(out_i_ptr + pos, ii, mask=ok)
        tl.store(out_j_ptr + pos, jj, mask=ok)


@triton.jit
def _pack(score, low):
    """int64 keys ordered like ``(score, low)``: float32 score bits made order-preserving as
    a signed int32 in the high half, ``low`` (>= 0, < 2^32) in the low half."""
    bits = score.to(tl.int32, bitcast=True)
    enc = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (enc.to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def _topk_kernel(
    q_ptr,
    k_ptr,
    lo_ptr,
    hi_ptr,
    tlo_ptr,
    thi_ptr,
    out_ptr,
    nq,
    d,
    stride_q,
    stride_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    KP: tl.constexpr,
    IS_FP32: tl.constexpr,
    ALLOW_TF32: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < nq
    lo = tl.load(lo_ptr + rows, mask=rmask, other=0)  # key range of each row's segment
    hi = tl.load(hi_ptr + rows, mask=rmask, other=0)
    c_lo = tl.load(tlo_ptr + pid)  # union of those ranges over the tile
    c_hi = tl.load(thi_ptr + pid)
    # running top-k per row: an unordered set of KP distinct keys. Empty slots hold
    # (-inf, slot + 1); masked scores become (-inf, 0), below every slot, so they never
    # enter. Real keys are (score, 2^31 - 1 - col): distinct per row, lower col wins ties.
    slots = tl.broadcast_to(tl.arange(0, KP)[None, :] + 1, (BLOCK_M, KP))
    best = _pack(tl.full((BLOCK_M, KP), float("-inf"), tl.float32), slots)
    floor = _pack(
        tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32),
        tl.zeros((BLOCK_M, BLOCK_N), tl.int32),
    )
    thr = tl.min(best, axis=1)  # the current k-th best key of each row
    for c0 in range(c_lo, c_hi, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        cmask = cols < c_hi
        s = _dot_tile(
            q_ptr,
            k_ptr,
            rows,
            cols,
            rmask,
            cmask,
            d,
            stride_q,
            stride_k,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            IS_FP32,
            ALLOW_TF32,
            UPCAST,
        )
        inside = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        key = tl.where(inside, _pack(s, 2147483647 - cols[None, :]), floor)
        m = tl.max(key, axis=1)
        # replace-the-minimum: while some row's best remaining tile key beats its k-th
        # best, swap it in (at most min(KP, BLOCK_N) rounds; usually 0-2 once warmed up)
        while tl.max((m > thr).to(tl.int32), axis=0) > 0:
            take = (best == thr[:, None]) & (m > thr)[:, None]
            best = tl.where(take, m[:, None], best)
            key = tl.where(key == m[:, None], floor, key)
            thr = tl.min(best, axis=1)
            m = tl.max(key, axis=1)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * KP + tl.arange(0, KP)[None, :]
    tl.store(out_ptrs, best, mask=rmask[:, None])


# --------------------------------------------------------------------------- host side


def tile_list(
    ends: np.ndarray,
    block_m: int,
    block_n: int,
    group_m: int = 8,
    max_tiles: int = MAX_TILES_PER_LAUNCH,
):
    """Tile pairs of the upper triangle of each segment's diagonal block, in launch chunks.

    Row tile ``rt`` covers rows ``[rt*block_m, (rt+1)*block_m)``; it is paired with the
    column tiles (``block_n`` wide, on a global grid) that meet ``[first row with a
    partner + 1, end of the last such row's segment)``. Row tiles whose rows are all alone
    in their segment are dropped.

    Args:
        ends: ``int64 [n]`` end (exclusive) of each row's segment, rows sorted by segment.
        block_m, block_n: tile shape.
        group_m: row tiles per L2 group (order: group, then column tile, then row tile).
        max_tiles: tile pairs per chunk at most (a single row tile is never split).

    Returns:
        list of ``(rt, ct)`` pairs of ``int32 [t]`` numpy arrays, one per launch.
    """
    ends = np.asarray(ends, dtype=np.int64)
    n = ends.shape[0]
    if n < 2:
        return []
    r = np.arange(n, dtype=np.int64)
    live = ends > r + 1  # row has a partner after it in its segment
    starts = np.arange(0, n, block_m, dtype=np.int64)
    first = np.minimum.reduceat(np.where(live, r, n), starts)
    last_end = np.maximum.reduceat(np.where(live, ends, -1), starts)
    ok = first < n
    rts = (starts // block_m)[ok]
    ct_lo = (first[ok] + 1) // block_n
    ct_hi = (last_end[ok] - 1) // block_n  # inclusive
    counts = ct_hi - ct_lo + 1
    if not counts.size:
        return []
    cum = np.cumsum(counts)
    chunks = []
    a = 0
    while a < counts.size:
        done = cum[a - 1] if a else 0
        b = max(a + 1, int(np.searchsorted(cum, done + max_tiles, side="right")))
        cnt = counts[a:b]
        rt = np.repeat(rts[a:b], cnt)
        off = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        ct = np.repeat(ct_lo[a:b], cnt) + off
        order = np.lexsort((rt, ct, rt // group_m))
        chunks.append((rt[order].astype(np.int32), ct[order].astype(np.int32)))
        a = b
    return chunks


def _check_block(name: str, value: int) -> int:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    return value


def _kernel_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous; on the cpu (Triton's interpreter) also in torch-owned memory: the
    interpreter re-binds each argument's storage, which fails for memory shared with numpy
    (``torch.as_tensor`` of an array)."""
    x = x.contiguous()
    if x.device.type == "cpu" and not x.untyped_storage().resizable():
        x = x.clone()
    return x


def threshold_candidates(
    vt: torch.Tensor,
    ends: torch.Tensor | np.ndarray,
    cand: float,
    *,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int | None = None,
    num_warps: int | None = None,
    group_m: int = 8,
    allow_tf32: bool = False,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate pairs ``row < col`` in the same segment with score ``>= cand``.

    Args:
        vt: ``[n, d]`` vectors in the tile dtype (float32, bfloat16 or float16), rows sorted
            by segment, on cuda (or cpu under ``TRITON_INTERPRET=1``).
        ends: ``int64 [n]`` end (exclusive, sorted positions) of each row's segment.
        cand: score cut-off (the threshold minus the dtype margin).
        block_m, block_n: tile shape (powers of two >= 16).
        block_k: reduction chunk (default ``next_pow2(d)`` in [16, 64], lowered so that
            three pipeline stages of the operand tiles fit ~96 KiB of shared memory).
        num_warps: warps per program (default 8 for tiles of 128 x 128 or more, else 4).
        group_m: row tiles per L2 group of the tile list.
        allow_tf32: float32 inputs multiplied in tf32.
        capacity: initial output-buffer slots (default :data:`INITIAL_CAPACITY` or
            ``max(2^16, 4 n)``); on overflow the join is rerun once with the exact count.

    Returns:
        ``(i, j)``: ``int64 [p]`` sorted row positions on ``vt``'s device, unordered.

    Raises:
        ValueError: a block size that is not a power of two >= 16, or ``vt`` not 2-d.
    """
    global LAST_JOIN_STATS
    if vt.ndim != 2:
        raise ValueError(f"vt must be [n, d], got shape {tuple(vt.shape)}")
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    vt = _kernel_input(vt)
    n, d = vt.shape
    dev = vt.device
    bk = (
        _check_block("block_k", block_k)
        if block_k
        else _block_k(d, block_m, block_n, vt.element_size())
    )
    ends_np = torch.as_tensor(ends).cpu().numpy().astype(np.int64)
    chunks = tile_list(ends_np, block_m, block_n, group_m)
    tiles = [(torch.from_numpy(rt).to(dev), torch.from_numpy(ct).to(dev)) for rt, ct in chunks]
    n_tiles = sum(int(rt.shape[0]) for rt, _ in chunks)
    if capacity is None:
        capacity = INITIAL_CAPACITY if INITIAL_CAPACITY is not None else max(1 << 16, 4 * n)
    capacity = max(1, int(capacity))
    ends_dev = torch.as_tensor(ends_np, dtype=torch.int32).to(dev)
    is_fp32 = vt.dtype == torch.float32
    if num_warps is None:
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    passes = 0
    while True:
        passes += 1
        out_i = torch.empty(capacity, dtype=torch.int32, device=dev)
        out_j = torch.empty(capacity, dtype=torch.int32, device=dev)
        counter = torch.zeros(1, dtype=torch.int64, device=dev)
        with _on(dev):
            for rt, ct in tiles:
                _threshold_join_kernel[(int(rt.shape[0]),)](
                    vt,
                    ends_dev,
                    rt,
                    ct,
                    out_i,
                    out_j,
                    counter,
                    n,
                    d,
                    vt.stride(0),
                    float(cand),
                    capacity,
                    BLOCK_M=block_m,
                    BLOCK_N=block_n,
                    BLOCK_K=bk,
                    IS_FP32=is_fp32,
                    ALLOW_TF32=bool(allow_tf32 and is_fp32),
                    UPCAST=_upcast(vt),
                    num_warps=num_warps,
                )
        count = int(counter.item())
        if count <= capacity:
            break
        capacity = count  # the counter counted every survivor: one rerun suffices
    LAST_JOIN_STATS = JoinStats(
        launches=len(tiles),
        passes=passes,
        tiles=n_tiles,
        capacity=capacity,
        candidates=count,
        block_m=block_m,
        block_n=block_n,
        block_k=bk,
    )
    return out_i[:count].long(), out_j[:count].long()


def _topk_block_m(kp: int) -> int:
    # keep the running list (int64 [BLOCK_M, KP]) small enough for registers
    return 64 if kp <= 32 else (32 if kp <= 64 else 16)


def topk_candidates(
    qv: torch.Tensor,
    kv: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    k: int,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int | None = None,
    num_warps: int = 4,
    allow_tf32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Running on-chip top-k of ``qv @ kv.T`` restricted to ``[lo[r], hi[r])`` per row.

    Args:
        qv: ``[q, d]`` queries in the tile dtype, sorted by segment.
        kv: ``[n, d]`` keys in the same dtype, sorted by segment.
        lo, hi: ``int [q]`` key range (sorted positions) of each query's segment.
        k: neighbours per query, ``1 <= k <= MAX_TOPK``.
        block_m: query rows per program (default 64, 32 or 16 as k grows).
        block_n: key columns per step.
        block_k, num_warps, allow_tf32: as for :func:`threshold_candidates`.

    Returns:
        ``(scores, idx)``: ``float32 [q, k]`` scores (``-inf`` where a query has fewer than
        ``k`` keys) and ``int64 [q, k]`` sorted key positions (``-1`` there), best first,
        ties broken by the lower key position.

    Raises:
        ValueError: ``k`` outside ``[1, MAX_TOPK]`` or a bad block size.
    """
    global LAST_TOPK_STATS
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"the triton top-k supports 1 <= k <= {MAX_TOPK}, got {k}")
    qv, kv = _kernel_input(qv), _kernel_input(kv)
    nq, d = qv.shape
    dev = qv.device
    kp = _next_pow2(k)
    bm = _check_block("block_m", block_m) if block_m else _topk_block_m(kp)
    bn = _check_block("block_n", block_n)
    bk = _check_block("block_k", block_k) if block_k else _block_k(d, bm, bn, qv.element_size())
    lo_c = torch.as_tensor(lo, dtype=torch.int64).cpu()
    hi_c = torch.as_tensor(hi, dtype=torch.int64).cpu()
    n_prog = (nq + bm - 1) // bm
    pad = n_prog * bm - nq
    lo_p = torch.cat([lo_c, lo_c.new_full((pad,), 2**62)]).view(n_prog, bm)
    hi_p = torch.cat([hi_c, hi_c.new_full((pad,), -1)]).view(n_prog, bm)
    t_lo = lo_p.min(1).values
    t_hi = torch.maximum(hi_p.max(1).values, t_lo)
    keys = torch.empty((nq, kp), dtype=torch.int64, device=dev)
    is_fp32 = qv.dtype == torch.float32
    with _on(dev):
        _topk_kernel[(n_prog,)](
            qv,
            kv,
            lo_c.to(dev, torch.int32),
            hi_c.to(dev, torch.int32),
            t_lo.to(dev, torch.int32),
            t_hi.to(dev, torch.int32),
            keys,
            nq,
            d,
            qv.stride(0),
            kv.stride(0),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            KP=kp,
            IS_FP32=is_fp32,
            ALLOW_TF32=bool(allow_tf32 and is_fp32),
            UPCAST=_upcast(qv),
            num_warps=num_warps,
        )
    LAST_TOPK_STATS = TopKStats(
        launches=1, programs=n_prog, block_m=bm, block_n=bn, block_k=bk, kp=kp
    )
    # the kernel leaves each row's KP best keys unordered: sort them (q x KP, cheap)
    keys = torch.sort(keys, dim=1, descending=True).values[:, :k]
    enc = (keys >> 32).to(torch.int32)
    bits = torch.where(enc < 0, enc ^ 0x7FFFFFFF, enc)
    scores = bits.view(torch.float32)
    idx = 2147483647 - (keys & 0xFFFFFFFF)
    valid = scores > float("-inf")
    idx = torch.where(valid, idx, torch.full_like(idx, -1))
    return scores, idx

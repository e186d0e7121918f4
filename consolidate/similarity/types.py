"""Shared leaf of the similarity package: result types, tile dtypes and the engine record.

Imported by the entry points (:mod:`consolidate.similarity.api`) and by every engine; it
imports only numpy and torch, so engines never need the entry points.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DTYPE_MARGIN", "TORCH_DTYPE", "Pairs", "TopK", "Engine"]

#: candidate margin below the threshold per tile dtype (max |error| of a unit-vector dot
#: product in that dtype for d <= 4096, with headroom); candidates are re-scored in float64.
DTYPE_MARGIN = {"fp32": 1e-4, "tf32": 4e-3, "bf16": 3e-2, "fp16": 6e-3}
#: torch dtype of the tiles per ``dtype`` name (tf32: float32 inputs, tf32 matmuls).
TORCH_DTYPE = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


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


@dataclass
class TopK:
    """Top-k neighbours per query.

    Attributes:
        indices: ``int64 [q, k]`` key positions, best first; ``-1`` where a query has fewer
            than ``k`` keys in its segment.
        scores: ``float32 [q, k]`` cosine in the tile dtype (``-inf`` for padding); the torch
            engine rounds 16-bit tiles to their dtype, the Triton engine accumulates the
            16-bit products in float32, faiss computes in float32 (float16 inputs on cuda
            for ``fp16``/``bf16``).
    """

    indices: np.ndarray
    scores: np.ndarray


def _no_check(dev: torch.device) -> None:
    return None


def _same_device(device: str | torch.device | None, dev: torch.device) -> torch.device:
    return dev


def _no_limit(dev: torch.device) -> int | None:
    return None


@dataclass(frozen=True)
class Engine:
    """One similarity engine, as :mod:`consolidate.similarity.api` calls it.

    The entry points validate every input, sort rows by segment and re-score candidates in
    float64; an engine only finds candidates (join) or a running top-k (search) on rows
    already sorted by segment.

    Attributes:
        name: the value of the ``engine`` keyword.
        threshold_candidates: ``(v32, counts, threshold, *, dtype, tile_rows, tile_cols,
            budget_bytes) -> (ci, cj)``. ``v32``: ``float32 [n, d]`` rows sorted by segment
            on the engine's device (:attr:`place`), ``n >= 2``; ``counts``: cpu ``int64``
            rows per segment in sorted order (each >= 1); ``threshold``: the cosine
            threshold; ``dtype``: a key of :data:`DTYPE_MARGIN`; tile sizes are ``None`` or
            integers >= 1; ``budget_bytes``: ``None`` or a memory budget. Returns ``int64
            [p]`` sorted positions ``ci < cj`` in one segment on ``v32``'s device, in any
            order, without duplicates, holding at least every pair whose cosine is
            ``>= threshold`` (extra candidates are dropped by the float64 re-scoring).
        topk: ``(qv, kv, qs_s, lo_of, hi_of, kk, *, dtype, tile_rows, tile_cols,
            budget_bytes) -> (best_s, best_i)``. ``qv`` / ``kv``: ``float32 [q, d]`` /
            ``[n, d]`` sorted by segment on the engine's device, ``q, n >= 1``; ``qs_s``:
            cpu ``int64 [q]`` sorted query segment codes; ``lo_of`` / ``hi_of``: cpu
            ``int64 [q]`` key range ``[lo, hi)`` of each sorted query's segment; ``kk``:
            ``1 <= kk <= n``. Returns ``float32 [q, kk]`` scores and ``int64 [q, kk]``
            sorted key positions on ``qv``'s device, best first, equal scores by the lower
            position, ``-inf`` / ``-1`` where a segment has fewer than ``kk`` keys.
        check: ``check(dev)`` raises ``ValueError`` / ``ImportError`` when the engine cannot
            run on ``dev`` (called when the engine is resolved, before any work).
        place: ``place(device, dev) -> device`` the engine computes on, from the caller's
            ``device`` argument and its :func:`~consolidate.device.resolve_device` ``dev``;
            may raise ``ImportError`` / ``ValueError`` (called after the input checks).
        max_topk: ``max_topk(dev) -> int | None``: the largest ``kk`` the top-k supports
            on ``dev`` (``None``: no limit).
        gathers: the join accepts ``rows=`` (``int64 [n]`` on the device: the row of ``v32``
            at each sorted position), so ``v32`` may come in input order and the engine
            gathers what it reads (no sorted copy of the whole store); the candidates are
            sorted positions all the same.
    """

    name: str
    threshold_candidates: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    check: Callable[[torch.device], None] = _no_check
    place: Callable[[str | torch.device | None, torch.device], torch.device] = _same_device
    max_topk: Callable[[torch.device], int | None] = _no_limit
    gathers: bool = False

"""The Triton engine (``engine="triton"``): an adapter to :mod:`consolidate.kernels.triton_join`.

Each kernel program computes one tile of scores on chip and writes only the surviving
candidate pairs (or keeps a running top-k on chip); one launch covers every namespace. Needs
``pip install triton`` and a CUDA device, or ``TRITON_INTERPRET=1`` (set before triton is
imported) to run on cpu in the interpreter. Importing this module does not import triton:
the kernel module is imported on the first call.

The torch-style tile sizes become the kernels' block shape, rounded down to a power of two
in [16, 128] (join default 64 x 64; top-k rows default 64/32/16 as k grows, columns 64).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from ..types import DTYPE_MARGIN, TORCH_DTYPE, Engine

__all__ = ["ENGINE", "threshold_candidates", "topk"]

#: default Triton tile (BLOCK_M, BLOCK_N) of the threshold join
_TRITON_TILE = (64, 64)


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_join() -> ModuleType:
    """The Triton kernel module (imports triton)."""
    from ...kernels import triton_join

    return triton_join


def _triton_block(size: int | None, default: int | None) -> int | None:
    """A torch-path tile size as a Triton block: power of two in [16, 128] (rounded down)."""
    if size is None:
        return default
    return 1 << (min(128, max(16, int(size))).bit_length() - 1)


def check(dev: torch.device) -> None:
    """Raise unless the kernels can run on ``dev``.

    Raises:
        ValueError: a non-cuda device without ``TRITON_INTERPRET=1``.
        ImportError: triton is not installed.
    """
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the triton engine needs CUDA or TRITON_INTERPRET=1 (set before "
            f"triton is imported); device is {dev}"
        )
    if not _triton_importable():
        raise ImportError(
            "engine='triton' needs triton: pip install triton (or pip install 'consolidate[gpu]')"
        )


def max_topk(dev: torch.device) -> int:
    """The largest ``min(k, n)`` of the top-k kernel (its running list lives on chip)."""
    return int(_triton_join().MAX_TOPK)


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
    interface) from :func:`~consolidate.kernels.triton_join.threshold_candidates`, kept
    ``>= threshold - DTYPE_MARGIN[dtype]``; ``budget_bytes`` is not used (scores stay on
    chip).

    Returns:
        ``(ci, cj)``: ``int64 [p]`` sorted positions ``ci < cj`` on ``v32``'s device.
    """
    # end (exclusive) of each row's segment, in sorted positions
    ends = torch.repeat_interleave(torch.cumsum(counts, 0), counts)
    return _triton_join().threshold_candidates(
        v32.to(TORCH_DTYPE[dtype]),
        ends,
        threshold - DTYPE_MARGIN[dtype],
        block_m=_triton_block(tile_rows, _TRITON_TILE[0]),
        block_n=_triton_block(tile_cols, _TRITON_TILE[1]),
        allow_tf32=dtype == "tf32",
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
    """Running top-``kk`` (the :class:`~consolidate.similarity.types.Engine` interface) from
    :func:`~consolidate.kernels.triton_join.topk_candidates`, ``kk <= MAX_TOPK``; the 16-bit
    products are accumulated in float32."""
    tdt = TORCH_DTYPE[dtype]
    return _triton_join().topk_candidates(
        qv.to(tdt),
        kv.to(tdt),
        lo_of,
        hi_of,
        kk,
        block_m=_triton_block(tile_rows, None),
        block_n=_triton_block(tile_cols, 64),
        allow_tf32=dtype == "tf32",
    )


ENGINE = Engine(
    "triton", threshold_candidates=threshold_candidates, topk=topk, check=check, max_topk=max_topk
)

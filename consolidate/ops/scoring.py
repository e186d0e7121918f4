"""Retention score, floor and cap.

The retention score follows the forgetting-curve form used by MemoryBank (Zhong et al., 2024,
"MemoryBank: Enhancing Large Language Models with Long-Term Memory", after Ebbinghaus), with
importance as a prior and strength stretching the time constant:

    score = importance * exp(-(now - last_used) / (strength * tau))

with times in hours. A memory recalled or merged more often (higher strength) decays slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["retention_score", "Selection", "select_survivors"]


def retention_score(
    importance: torch.Tensor,
    last_used: torch.Tensor,
    strength: torch.Tensor,
    now: float | torch.Tensor,
    tau: float,
) -> torch.Tensor:
    """Vectorised retention score.

    Args:
        importance: ``[n]`` in [0, 1].
        last_used: ``[n]`` hours since the epoch (float64 recommended).
        strength: ``[n]`` >= 1.
        now: hours since the epoch, a scalar or a ``[n]`` tensor (per-row "now"). Rows with
            ``last_used > now`` get age 0 (no growth above ``importance``).
        tau: time constant in hours (> 0); e.g. 720 h (30 days).

    Returns:
        ``float64 [n]`` on the inputs' device.

    Raises:
        ValueError: ``tau <= 0``.
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0 hours, got {tau}")
    lu = last_used.to(torch.float64)
    now_t = torch.as_tensor(now, dtype=torch.float64, device=lu.device)
    age = torch.clamp(now_t - lu, min=0.0)
    return importance.to(torch.float64) * torch.exp(-age / (strength.to(torch.float64) * tau))


@dataclass
class Selection:
    """Outcome of :func:`select_survivors`.

    Attributes:
        keep: ``bool [n]``.
        reason: ``object [n]``: ``None`` if kept, else ``"floor"`` or ``"cap"``.
    """

    keep: np.ndarray
    reason: np.ndarray


def select_survivors(
    score: np.ndarray,
    pinned: np.ndarray,
    namespace: np.ndarray,
    ids: np.ndarray,
    floor: float,
    cap: int | None,
    protected: np.ndarray | None = None,
) -> Selection:
    """Drop rows below ``floor``, then keep the top ``cap`` per namespace.

    Pinned rows are always kept and take their slots of the cap first; the remaining
    ``max(cap - pinned, 0)`` slots go to the highest scores, ties broken by id ascending.

    Args:
        score: ``float [n]`` retention scores.
        pinned: ``bool [n]``.
        namespace: ``[n]`` namespace names, or integer namespace codes.
        ids: ``[n]`` record ids, or integer ranks of the ids (tie-breaking: lower first).
        floor: drop non-pinned rows with ``score < floor``.
        cap: maximum rows per namespace (``None`` = no cap).
        protected: ``bool [n]`` rows exempt from the floor but not from the cap (an
            importance at or above ``sleep.protect_importance``); ``None`` = none.

    Returns:
        :class:`Selection`.
    """
    n = len(score)
    score = np.asarray(score, dtype=np.float64)
    pinned = np.asarray(pinned, dtype=bool)
    reason = np.full(n, None, dtype=object)
    keep = pinned | (score >= floor)
    if protected is not None:
        keep |= np.asarray(protected, dtype=bool)
    reason[~keep] = "floor"
    if cap is not None and n:
        ns = np.asarray(namespace)
        ns_codes = ns.astype(np.int64) if np.issubdtype(ns.dtype, np.integer) else _codes(ns)[0]
        id_arr = np.asarray(ids)
        id_rank = (
            id_arr
            if np.issubdtype(id_arr.dtype, np.integer)
            else np.argsort(np.argsort(id_arr.astype(object), kind="stable"))
        )
        # order: namespace, pinned first, score desc, id asc
        order = np.lexsort((id_rank, -score, ~pinned, ns_codes))
        ns_sorted = ns_codes[order]
        start = np.r_[0, np.flatnonzero(np.diff(ns_sorted)) + 1]
        run_start = np.repeat(start, np.diff(np.r_[start, n]))
        # rank among the kept rows of the namespace, in sorted order
        kept_sorted = keep[order].astype(np.int64)
        csum = np.cumsum(kept_sorted)
        before = csum - kept_sorted - np.where(run_start > 0, csum[run_start - 1], 0)
        over = (kept_sorted == 1) & (before >= cap) & ~pinned[order]
        drop = order[over]
        keep[drop] = False
        reason[drop] = "cap"
    return Selection(keep, reason)


def _codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uniq, codes = np.unique(np.asarray(x, dtype=object).astype(str), return_inverse=True)
    return codes.astype(np.int64), uniq

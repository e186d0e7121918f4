"""The pass's "now" per row, and the nightly trigger."""

from __future__ import annotations

import contextlib

import numpy as np
import pandas as pd

from ..store.schema import Records, hours_from_datetime

__all__ = ["resolve_now", "trigger"]


def resolve_now(
    spec: str | float, meta: pd.DataFrame, wall_h: float, ns: np.ndarray | None = None
) -> np.ndarray:
    """Per-row "now" in hours since the epoch.

    Args:
        spec: ``"wall"`` (the wall clock ``wall_h``), ``"latest"`` (per namespace, the latest
            ``last_used``/``created_at`` among its live records: a simulated clock for
            historical stores such as LOCOMO), an ISO datetime string, or hours since the
            epoch (a float or a numeric string).
        meta: the records' table.
        wall_h: wall clock, hours since the epoch.
        ns: ``int64 [n]`` namespace codes of ``meta``'s rows (default: factorised from its
            ``namespace`` column).

    Returns:
        ``float64 [n]``.

    Raises:
        ValueError: an unparseable ``spec``.
    """
    n = len(meta)
    if isinstance(spec, str):
        with contextlib.suppress(ValueError):
            spec = float(spec)
    if isinstance(spec, (int, float)):
        return np.full(n, float(spec))
    if spec == "wall":
        return np.full(n, wall_h)
    if spec == "latest":
        if ns is None:
            ns = pd.factorize(meta["namespace"].to_numpy(object))[0]
        live = meta["deleted_at"].isna().to_numpy()
        t = np.fmax(meta["last_used"].to_numpy(np.float64), meta["created_at"].to_numpy(np.float64))
        s = pd.Series(np.where(live, t, np.nan)).groupby(ns).transform("max").to_numpy()
        return np.where(np.isnan(s), wall_h, s)
    try:
        return np.full(n, hours_from_datetime(spec))
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"sleep.now must be 'wall', 'latest', hours or an ISO datetime; got {spec!r}"
        ) from e


def trigger(records: Records, threshold: float) -> tuple[bool, float]:
    """Should the nightly pass run? Sums the importance of live records that no pass has
    processed yet (``last_pass`` is null).

    Returns:
        ``(fire, new_importance)`` with ``fire = new_importance >= threshold``.
    """
    m = records.meta
    new = records.live_mask() & m["last_pass"].isna().to_numpy()
    total = float(m["importance"].to_numpy(np.float64)[new].sum())
    return total >= threshold, total

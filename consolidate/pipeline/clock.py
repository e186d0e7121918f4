"""The pass's "now" per row, and the nightly trigger."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pandas as pd

from ..store.schema import Records

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
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        if not math.isfinite(spec):
            raise ValueError(f"sleep.now must be finite hours since the epoch; got {spec!r}")
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
    from ..times import hours_from_values  # strict ISO 8601: "yesterday" is no time

    try:
        h = float(hours_from_values([spec], what="sleep.now")[0])
    except (ValueError, TypeError):
        h = math.nan
    if not math.isfinite(h):
        raise ValueError(
            f"sleep.now must be 'wall', 'latest', hours since the epoch or an ISO 8601 "
            f"datetime (2025-02-02T10:00:00, naive = UTC); got {spec!r}"
        )
    return np.full(n, h)


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

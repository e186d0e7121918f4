"""Retention-policy calibration: which merge threshold, τ, floor and cap keep a recall target
with the smallest store.

A policy is a set of :class:`~consolidate.config.PassConfig` overrides. Each policy of a grid
is run as an evaluation variant (:func:`consolidate.evaluation.evaluate.run_evaluate`); its row of
the ablation table gives the store's size in memories (``store_size``) and in stored tokens
(``store_tokens``, the embedder's tokenizer) and its evidence recall. Memory count alone is
not store size: merges that concatenate hold the same tokens in fewer rows, so the frontier
and the recommendation are on tokens.

Definitions:

* baseline: the variant that keeps every memory (no pass); its recall is 100%.
* a policy *keeps the target* when, for every metric in ``metrics``, its recall is at least
  ``share`` x the baseline's (default 0.98 on ``faithful_recall@10`` and
  ``faithful_recall@500tok``).
* frontier: the policies no other policy beats on tokens and on every metric at once (at
  most as many tokens and at least the recall of each metric, one of them strictly).
* recommendation: among policies that keep the target, the fewest stored tokens (ties: the
  higher recall on the first metric, then the grid order).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["policy_grid", "policy_name", "check_policy", "frontier_mask", "recommend"]

#: the PassConfig fields a policy may set
POLICY_KEYS = ("threshold", "tau_hours", "floor", "cap", "decay", "near_dedup")


def policy_name(policy: Mapping[str, Any]) -> str:
    """A variant name for ``policy`` (``"policy t0.9 tau720 floor0.001 capNone"``)."""
    short = {
        "threshold": "t",
        "tau_hours": "tau",
        "floor": "floor",
        "cap": "cap",
        "decay": "decay",
        "near_dedup": "near",
    }
    return "policy " + " ".join(f"{short[k]}{policy[k]}" for k in POLICY_KEYS if k in policy)


def check_policy(policy: Mapping[str, Any], where: str = "policy") -> dict[str, Any]:
    """``policy`` as a plain ``dict`` once its keys and values pass the pass's own settings
    check (a whole number for ``cap`` written as ``100.0`` becomes ``100``).

    Raises:
        ValueError: not a mapping, an unknown key, or a value the pass refuses (the message
            starts with ``where``).
    """
    from ..config import PassConfig
    from ..pipeline.run import check_settings

    if not isinstance(policy, Mapping):
        raise ValueError(
            f"{where}: a policy is a mapping of pass settings, got {type(policy).__name__}"
        )
    bad = sorted(set(policy) - set(POLICY_KEYS))
    if bad:
        raise ValueError(f"{where}: unknown keys {bad} (a policy sets {', '.join(POLICY_KEYS)})")
    out = dict(policy)
    cap = out.get("cap")
    if isinstance(cap, float) and cap.is_integer():
        out["cap"] = int(cap)
    for k in ("decay", "near_dedup"):
        if k in out and not isinstance(out[k], bool):
            raise ValueError(f"{where}: {k} must be true or false, got {out[k]!r}")
    try:
        check_settings(PassConfig(**out))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return out


def policy_grid(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of ``grid``'s values, in the order the keys and values are given,
    each checked with :func:`check_policy`.

    Args:
        grid: ``{PassConfig field: [values]}``; fields from :data:`POLICY_KEYS`.

    Returns:
        One ``dict`` per policy (distinct).

    Raises:
        ValueError: an unknown key, a key whose values are not a non-empty list, a value
            the pass refuses, or the same policy twice.
    """
    bad = sorted(set(grid) - set(POLICY_KEYS))
    if bad:
        raise ValueError(f"policy grid: unknown keys {bad} (use {', '.join(POLICY_KEYS)})")
    not_list = sorted(
        k for k, v in grid.items() if isinstance(v, (str, bytes)) or not isinstance(v, Sequence)
    )
    if not_list:
        raise ValueError(
            f"policy grid: {not_list} must be lists of values (e.g. grid.threshold=[0.85,0.9])"
        )
    empty = sorted(k for k, v in grid.items() if not len(v))
    if empty:
        raise ValueError(f"policy grid: no values for {empty}")
    keys = list(grid)
    combos = [
        dict(zip(keys, c, strict=True)) for c in itertools.product(*(list(grid[k]) for k in keys))
    ]
    out = [check_policy(c, f"policy grid {c}") for c in combos]
    names = [policy_name(p) for p in out]
    if len(set(names)) < len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"policy grid: the same policy twice ({dup[0]})")
    return out


def frontier_mask(table: pd.DataFrame, cost: str, gains: Sequence[str]) -> np.ndarray:
    """``bool [len(table)]``: rows no other row dominates (``cost`` at most theirs and every
    ``gains`` column at least theirs, one of them strictly). O(n^2) over policies, which
    number in the tens."""
    c = table[cost].to_numpy(np.float64)
    g = table[list(gains)].to_numpy(np.float64)
    # a row with no measure (NaN) is on no frontier
    bad = np.isnan(c) | np.isnan(g).any(1)
    c = np.where(bad, np.inf, c)
    g = np.where(bad[:, None], -np.inf, g)
    no_worse = (c[None, :] <= c[:, None]) & (g[None, :, :] >= g[:, None, :]).all(-1)
    better = (c[None, :] < c[:, None]) | (g[None, :, :] > g[:, None, :]).any(-1)
    dominated = (no_worse & better).any(1)  # [i]: some j dominates i
    return ~dominated & ~bad


def recommend(
    table: pd.DataFrame,
    baseline: Mapping[str, float],
    metrics: Sequence[str],
    share: float,
    cost: str = "store_tokens",
) -> dict[str, Any] | None:
    """The policy row that keeps ``share`` of ``baseline``'s recall on every metric with the
    fewest ``cost`` (see the module docstring), or ``None`` if none does.

    Args:
        table: one row per policy with ``cost`` and ``metrics`` columns.
        baseline: the no-consolidation row's metrics.
        metrics: recall columns the target applies to.
        share: fraction of the baseline's recall to keep, in (0, 1].

    Returns:
        The chosen row as a ``dict`` with ``keeps`` (per metric: its share of the baseline).

    Raises:
        ValueError: ``share`` outside (0, 1], or a metric missing from the table.
    """
    if not (isinstance(share, (int, float)) and 0 < share <= 1):
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    if not len(metrics):
        raise ValueError("policy recommendation: no metrics to keep")
    missing = [m for m in metrics if m not in table.columns or m not in baseline]
    if missing:
        raise ValueError(f"policy recommendation: no column {missing}")
    ok = np.ones(len(table), bool)
    for m in metrics:
        ok &= table[m].to_numpy(np.float64) >= share * float(baseline[m]) - 1e-12
    if not ok.any():
        return None
    cand = table[ok].assign(_order=np.flatnonzero(ok))
    best = cand.sort_values(
        [cost, metrics[0], "_order"], ascending=[True, False, True], kind="stable"
    ).iloc[0]
    row = {k: (v.item() if hasattr(v, "item") else v) for k, v in best.drop("_order").items()}
    row["keeps"] = {
        m: round(float(best[m]) / float(baseline[m]), 4) if baseline[m] else None for m in metrics
    }
    return row

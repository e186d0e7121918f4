"""Collect many runs into one table and plot: the ``report`` job and the Hydra multirun
callback share :func:`collect`.

A run folder holds ``results.json`` (evaluate, calibrate) or ``summary.json`` (consolidate);
its ``.hydra/overrides.yaml`` names the swept values.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback

from .results import read_results

__all__ = ["collect", "write_report", "CollectResults"]

log = logging.getLogger("consolidate")


def _overrides(run: Path) -> str:
    p = run / ".hydra" / "overrides.yaml"
    if not p.exists():
        return ""
    lines = [x.strip()[2:] for x in p.read_text().splitlines() if x.strip().startswith("- ")]
    return " ".join(lines)


def collect(run_dirs: Iterable[str | Path]) -> pd.DataFrame:
    """One row per (run, variant / calibration entry / pass) from the given run folders.

    Columns: ``run`` (folder), ``overrides``, ``job``, ``variant``, for results files
    ``task``, ``data_sha256`` (the data files' hashes) and ``prompts`` (prompt versions),
    and the run's metrics (evaluate: its ablation table; calibrate: one row per dataset and
    dtype; bench: one row per case and method measured; consolidate: the pass counts and
    wall time).
    """
    rows: list[dict[str, Any]] = []
    for d in sorted(Path(x) for x in run_dirs):
        head = {"run": str(d), "overrides": _overrides(d)}
        if (d / "results.json").exists():
            r = read_results(d / "results.json")
            head = {
                **head,
                "task": r.task.name,
                "data_sha256": ",".join(sorted(r.task.files_sha256.values())),
                "prompts": ",".join(f"{k}={v}" for k, v in sorted(r.prompts.items())),
            }
            for t in r.tables.get("ablation", []):
                rows.append({**head, "job": r.job, **t})
            if r.job == "bench":  # one row per measured case and method
                for t in r.tables.get("results", []):
                    if t.get("status") == "ok":
                        rows.append({**head, "job": "bench",
                                     "variant": f"{t.get('case')} | {t.get('method')}", **t})  # fmt: skip
            for t in r.tables.get("calibration", []):
                flat = {k: v for k, v in t.items() if k != "threshold_at_precision"}
                flat.update({f"t@P{p}": v for p, v in t["threshold_at_precision"].items()})
                rows.append(
                    {**head, "job": r.job, "variant": f"{t['dataset']} {t['dtype']}", **flat}
                )
        elif (d / "summary.json").exists():
            s = json.loads((d / "summary.json").read_text())
            st = s.get("stats", {})
            rows.append(
                {
                    **head,
                    "job": "consolidate",
                    "variant": "pass",
                    **{
                        k: st.get(k)
                        for k in (
                            "records_in",
                            "records_out",
                            "pairs",
                            "clusters",
                            "merges",
                            "exact_merges",
                            "dropped_floor",
                            "dropped_cap",
                            "review_pairs",
                        )
                    },
                    "wall_time_s": s.get("wall_time_s"),
                    "ran": s.get("ran"),
                }
            )
    return pd.DataFrame(rows)


def check_comparable(table: pd.DataFrame) -> None:
    """Refuse one table of runs of a job that measured different data or prompts.

    Raises:
        ValueError: two runs of one job with different ``task``/``data_sha256`` or
            ``prompts``; the message lists the runs of each kind.
    """
    if table.empty or "data_sha256" not in table:
        return
    for job, g in table[table["data_sha256"].notna()].groupby("job"):
        for col in ("task", "data_sha256", "prompts"):
            kinds = g.groupby(col)["run"].unique()
            if len(kinds) > 1:
                which = "; ".join(
                    f"{k[:40] or '(none)'}: {', '.join(sorted(map(str, v)))}"
                    for k, v in kinds.items()
                )
                raise ValueError(
                    f"{job} runs differ in {col} ({which}); they measured "
                    f"different things: report them apart, or set "
                    f"allow_mixed=true to put them in one table anyway"
                )


def write_report(table: pd.DataFrame, out_dir: str | Path, title: str) -> dict[str, Path]:
    """``<out>/runs.parquet``, ``runs.md`` and (when recall columns exist) ``runs.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"parquet": out / "runs.parquet", "markdown": out / "runs.md"}
    table.to_parquet(paths["parquet"], index=False)
    show = table.drop(columns=[c for c in ("run",) if c in table])
    paths["markdown"].write_text(
        f"# {title}\n\n{len(table)} rows\n\n" + show.round(4).to_markdown(index=False) + "\n"
    )
    if {"store_size", "recall@10"} <= set(table.columns):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        groups = list(table.groupby(table["overrides"].fillna("") + " " + table["variant"]))
        fig, ax = plt.subplots(figsize=(7 + (4 if groups else 0), max(5, 0.18 * len(groups))))
        for label, g in groups:
            ax.scatter(g["store_size"], g["recall@10"], label=str(label).strip()[:70])
        ax.set_xlabel("live memories after the pass")
        ax.set_ylabel("evidence recall@10")
        ax.grid(alpha=0.3)
        # outside the axes: a legend of many runs would cover the points
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        fig.tight_layout()
        fig.savefig(out / "runs.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths["plot"] = out / "runs.png"
    return paths


class CollectResults(Callback):
    """Hydra callback: at the end of a multirun, collect every job's results into
    ``<sweep dir>/runs.{parquet,md,png}``."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        runs = [
            p
            for p in sweep.iterdir()
            if p.is_dir() and ((p / "results.json").exists() or (p / "summary.json").exists())
        ]
        if not runs:
            return
        paths = write_report(collect(runs), sweep, f"sweep {sweep}")
        log.info("collected %d runs into %s", len(runs), paths["markdown"])

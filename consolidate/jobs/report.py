"""``consolidate-report runs=[dir, ...]`` (or ``root=outputs``): rebuild one table and plot
from many runs' ``results.json`` / ``summary.json`` (Hydra job)."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ..evaluation.sweep import check_comparable, collect, write_report
from .cli import job
from .common import user_errors


def run_report(cfg: DictConfig, out_dir: str | Path) -> dict[str, Path]:
    """Collect ``cfg.runs`` plus every run folder under ``cfg.root`` (if set).

    Raises:
        FileNotFoundError: no run folder with results was found.
        ValueError: runs of one job measured different data or prompts (unless
            ``allow_mixed``).
    """
    dirs = [Path(r) for r in cfg.runs or []]
    if cfg.root:
        dirs += [p.parent for p in Path(cfg.root).rglob("results.json")]
        dirs += [p.parent for p in Path(cfg.root).rglob("summary.json")]
    dirs = sorted({d.resolve() for d in dirs if d.resolve() != Path(out_dir).resolve()})
    if not dirs:
        raise FileNotFoundError(
            f"no results.json or summary.json under runs={list(cfg.runs)} root={cfg.root!r}"
        )
    table = collect(dirs)
    if not cfg.get("allow_mixed", False):
        check_comparable(table)
    return write_report(table, out_dir, cfg.title)


@job("report")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-report``: :func:`run_report` into the run's
    output folder, then the files it wrote."""
    with user_errors():
        paths = run_report(cfg, HydraConfig.get().runtime.output_dir)
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))


if __name__ == "__main__":
    main()

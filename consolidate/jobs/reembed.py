"""``consolidate-reembed``: re-embed a store with another embedding model, calibrate the
merge threshold for that model, and switch the store to the new vectors atomically (Hydra
job; see ``consolidate/conf/reembed.yaml`` and :mod:`consolidate.reembed`).

Examples::

    consolidate-reembed store.dir=stores/alice embedder.model_path=/models/bge-small
    consolidate-reembed store.dir=stores/alice action=switch other=stores/alice.pre-reembed-...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from ..config import EmbedderConfig, StoreConfig
from .cli import job
from .common import CONFIG_DIR, make_embedder, typed, user_errors, write_summary


def run_reembed(cfg: DictConfig, out_dir: str | Path | None = None) -> dict[str, Any]:
    """``action=reembed``: calibrate the new model (``consolidate-calibrate``'s config with
    ``calibration`` merged over it, into ``<out_dir>/calibration``), then
    :func:`~consolidate.reembed.reembed_store`. ``action=switch``:
    :func:`~consolidate.reembed.switch_stores` with ``other``. Returns the summary (also in
    ``<out_dir>/summary.json``).

    Raises:
        ValueError: an unknown ``action``, or ``action=switch`` without ``other``.
        StoreNotFoundError, LockTimeoutError, OSError: see :mod:`consolidate.reembed`.
    """
    from ..reembed import check_backup, reembed_store, switch_stores
    from ..store.lance import open_store_dir

    out = Path(
        out_dir
        or (HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else "outputs")
    )
    scfg: StoreConfig = typed(cfg, "store", StoreConfig)
    if cfg.action == "switch":
        if not cfg.other:
            raise ValueError("action=switch needs other=PATH (the store to switch to)")
        summary = {
            "action": "switch",
            **switch_stores(scfg.dir, cfg.other, lock_timeout_s=scfg.lock_timeout_s),
        }
        write_summary(out, summary)
        return summary
    if cfg.action != "reembed":
        raise ValueError(f"action must be 'reembed' or 'switch', got {cfg.action!r}")
    open_store_dir(scfg.dir).head()  # a missing store is named before any model loads
    if cfg.backup:
        check_backup(scfg.dir, cfg.backup)
    ecfg: EmbedderConfig = typed(cfg, "embedder", EmbedderConfig)
    summary: dict[str, Any] = {"action": "reembed", "model": str(ecfg.model_path or ecfg.name)}
    if cfg.calibrate:
        from .calibrate import run_calibrate

        ccfg = _compose("calibrate")
        with open_dict(ccfg):
            ccfg.merge_with(cfg.calibration)
            ccfg.embedder = OmegaConf.merge(ccfg.embedder, cfg.embedder)
            ccfg.paths = cfg.paths
        calib = run_calibrate(ccfg, out / "calibration")
        summary["calibration"] = {
            **calib["recommended"],
            "file": str(out / "calibration" / "calibration.json"),
        }
    emb = make_embedder(ecfg)
    summary.update(
        reembed_store(
            scfg.dir,
            emb,
            model=summary["model"],
            lock_timeout_s=scfg.lock_timeout_s,
            backup=cfg.backup,
        )
    )
    summary["summary_path"] = str(write_summary(out, summary))
    return summary


def _compose(name: str) -> DictConfig:
    """The job config ``name`` (inside a Hydra app, or from :data:`CONFIG_DIR`)."""
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return hydra.compose(config_name=name)
    with hydra.initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra.compose(config_name=name)


@job("reembed")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-reembed``: :func:`run_reembed` (re-embed a
    store, or switch to the re-embedded copy), then what it did."""
    with user_errors():
        s = run_reembed(cfg)
    if s["action"] == "switch":
        print(
            f"{s['store']} now holds the store that was at {s['other']} (version "
            f"{s['now_version']}, d={s['now_dim']}); the other is at {s['other']}"
        )
        return
    print(
        f"re-embedded {s['records']} memories of {s['store']} with {s['model']} "
        f"(d {s['old_dim']} -> {s['dim']}; {s['texts_embedded']} texts, {s['late_texts']} "
        f"appended during the run) in {s['seconds']} s; the old store is at {s['backup']}"
    )
    if "calibration" in s:
        c = s["calibration"]
        print(
            f"threshold for the new model: {c['threshold']:.4f} ({c['rule']} on "
            f"{c['dataset']}); a pass with it: consolidate store.dir={s['store']} "
            f"sleep.calibration_file={c['file']} sleep.force=true"
        )
    print(
        f"switch back with: consolidate-reembed store.dir={s['store']} action=switch "
        f"other={s['backup']}"
    )


if __name__ == "__main__":
    main()

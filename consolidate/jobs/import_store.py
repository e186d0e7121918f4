"""``consolidate-import``: build a store from LOCOMO observations (Hydra job)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from .common import CONFIG_DIR, open_store, user_errors


def run_import(cfg: DictConfig) -> dict:
    """Build ``cfg.store.dir`` if missing; returns the import report (``{}`` if it existed)."""
    store, report = open_store(cfg)
    head = store.head()
    return {"store": str(store.root), "version": head.version, **(report or {})}


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="import")
def _main(cfg: DictConfig) -> None:
    with user_errors():
        out = run_import(cfg)
    if "observations" in out:
        print(f"built {out['store']}: {out['observations']} memories from "
              f"{out['conversations']} conversations; {len(out['malformed_evidence'])} with "
              f"malformed evidence (kept, listed in import_report.json)")
    else:
        print(f"{out['store']} already exists (snapshot {out['version']}); nothing to do")


def main() -> None:
    _main()


if __name__ == "__main__":
    main()

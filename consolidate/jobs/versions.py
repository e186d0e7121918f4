"""``consolidate-versions``: list, compare, roll back, restore and export a Lance store's
versions, verify every file of every retained version, and rebuild its indexes (Hydra job; see ``consolidate/conf/versions.yaml``)."""

from __future__ import annotations

import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config import StoreConfig
from .cli import job
from .common import open_store, typed, user_errors


def run_versions(cfg: DictConfig) -> dict[str, Any]:
    """Run ``cfg.action`` on ``cfg.store.dir``; returns what it printed as data.

    Raises:
        ValueError: an unknown action, a missing ``version``/``out``/``ids``, or a store
            that is not a Lance store.
        StoreNotFoundError / CorruptStoreError / LockTimeoutError: see the store.
    """
    from ..store import CorruptStoreError

    scfg: StoreConfig = typed(cfg, "store", StoreConfig)
    store, _ = open_store(cfg, build=False)
    if not store.TIME_TRAVEL:
        raise ValueError(
            f"{store.root} is a {store.FORMAT.capitalize()} store: versions need a Lance store "
            f"(consolidate-convert src={store.root} dst=NEW)"
        )
    act = cfg.action
    if act == "list":
        return {"versions": store.versions()}
    if act == "diff":
        if cfg.version is None:
            raise ValueError("action=diff needs version=A (and other=B, default newest)")
        t = store.diff(int(cfg.version), None if cfg.other is None else int(cfg.other))
        return {"diff": t}
    if act == "rollback":
        if cfg.version is None:
            raise ValueError("action=rollback needs version=N")
        return store.rollback(
            int(cfg.version), dry_run=bool(cfg.dry_run), lock_timeout_s=scfg.lock_timeout_s
        )
    if act == "restore":
        ids = OmegaConf.to_container(cfg.ids) if cfg.ids is not None else []
        if not ids:
            raise ValueError("action=restore needs ids=[id1,id2,...]")
        return store.restore([str(i) for i in ids], lock_timeout_s=scfg.lock_timeout_s)
    if act == "export":
        if not cfg.out:
            raise ValueError("action=export needs out=FILE.parquet or out=FILE.jsonl")
        return store.export(cfg.out, None if cfg.version is None else int(cfg.version))
    if act == "verify":
        out = store.verify_all()
        bad = [v for v in out if "error" in v]
        if bad:
            lines = "; ".join(f"version {v['version']}: {v['error']}" for v in bad[:3])
            raise CorruptStoreError(
                f"{len(bad)} of {len(out)} retained versions of {store.root} are damaged: {lines}"
            )
        return {"verified": out}
    if act == "reindex":
        with store.lock(timeout_s=scfg.lock_timeout_s):
            return store.reindex()
    raise ValueError(
        f"action must be list, diff, rollback, restore, export, verify or reindex, got {act!r}"
    )


@job("versions")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-versions``: :func:`run_versions` (list, diff
    or verify a store's versions), then its table."""
    with user_errors():
        out = run_versions(cfg)
    if "versions" in out:
        print(f"{'version':>7}  {'time (UTC)':<26} {'op':<9} {'rows':>9}  {'changelog':<24}summary")
        for v in out["versions"]:
            summ = ", ".join(f"{k} {n}" for k, n in sorted(v["summary"].items()))
            print(
                f"{v['version']:>7}  {str(v['timestamp']):<26} {v['op'] or '(lance)':<9} "
                f"{v['rows']:>9}  {v.get('changelog') or '-':<24}{summ}"
            )
    elif "diff" in out:
        print(out["diff"].to_string())
    elif "verified" in out:
        n = sum(v["checked"] for v in out["verified"])
        left = sum(v["unrecorded"] for v in out["verified"])
        print(
            f"verified {len(out['verified'])} versions: {n} file checks matched their CRC32"
            + (f", {left} files with no CRC32 recorded (not checked)" if left else "")
        )
    elif cfg.action == "export":
        print(f"wrote version {out['version']} ({out['records']} records) to {out['path']}")
    else:
        print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()

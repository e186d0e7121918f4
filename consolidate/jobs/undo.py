"""``consolidate-undo merge_id=m-...``: restore the members of one merge (Hydra job)."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from ..config import StoreConfig
from ..pipeline import undo_merge
from ..store import hours_now
from ..store.lance_store import LanceStore
from .cli import job
from .common import open_store, typed, user_errors

log = logging.getLogger("consolidate")


def run_undo(cfg: DictConfig) -> dict[str, Any]:
    """Undo ``cfg.merge_id`` in ``cfg.store.dir`` as a new snapshot; returns the commit info.

    Raises:
        KeyError / ValueError: see :func:`consolidate.pipeline.undo_merge`.
    """
    scfg: StoreConfig = typed(cfg, "store", StoreConfig)
    merge_id = cfg.merge_id  # a missing id is the user's error before the store's
    store, _ = open_store(cfg, build=False)
    with store.lock(timeout_s=scfg.lock_timeout_s):
        snap = store.load()
        recs = undo_merge(snap.records, merge_id)
        restored = recs.meta["id"][
            snap.records.meta["merged_into"].eq(merge_id).to_numpy()
        ].tolist()
        ev = [{"op": "undo", "id": merge_id, "restored": restored}]
        extra = {"op": "undo"} if isinstance(store, LanceStore) else {}
        commit = store.commit(
            recs, ev, base=snap, pass_time_h=snap.last_pass_at or hours_now(), **extra
        )
    return {"undone": merge_id, "restored": restored, **commit}


@job("undo")
def main(cfg: DictConfig) -> None:
    with user_errors():
        out = run_undo(cfg)
    print(
        f"undid {out['undone']}: restored {len(out['restored'])} records "
        f"({', '.join(out['restored'][:5])}); now at snapshot {out['version']}"
    )


if __name__ == "__main__":
    main()

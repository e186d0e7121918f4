"""``consolidate-recall namespace=... query="..."``: what an agent would inject (Hydra job).

Prints the recalled memories, best first, with their cosine and token count; applies the
recall bookkeeping unless ``mark_used=false``. Reads an existing store (never builds one).
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from ..config import EmbedderConfig
from ..recall import Recalled, recall
from .cli import job
from .common import make_embedder, open_store, sim_cfg, typed, user_errors

log = logging.getLogger("consolidate")


def run_recall(cfg: DictConfig) -> Recalled:
    """Recall ``cfg.query`` in ``cfg.namespace`` of ``cfg.store.dir``.

    Raises:
        StoreNotFoundError: no store at ``store.dir``.
        ValueError: a bad ``k`` or ``max_tokens``, an empty or over-long query.
    """
    store, _ = open_store(cfg, build=False)
    emb = make_embedder(typed(cfg, "embedder", EmbedderConfig))
    (out,) = recall(
        store,
        str(cfg.namespace),
        [str(cfg.query)],
        emb,
        k=int(cfg.k),
        max_tokens=int(cfg.max_tokens),
        mark_used=bool(cfg.mark_used),
        strength_cap=cfg.strength_cap,
        device=sim_cfg(cfg).device,
    )
    return out


@job("recall")
def main(cfg: DictConfig) -> None:
    with user_errors():
        out = run_recall(cfg)
    if not out.ids:
        print(f"no live memories in namespace {cfg.namespace!r}")
        return
    for i, t, s in zip(out.ids, out.texts, out.scores, strict=True):
        print(f"{s:6.3f}  {i}  {t}")
    print(
        f"{len(out.ids)} memories, {out.tokens} tokens (cap {cfg.max_tokens}; "
        f"{out.cut_by_tokens} more of the top {cfg.k} did not fit)"
        + ("; marked used" if cfg.mark_used else "")
    )


if __name__ == "__main__":
    main()

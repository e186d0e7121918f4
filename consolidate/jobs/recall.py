"""``consolidate-recall namespace=... query="..."``: what an agent would inject (Hydra job).

Prints the recalled memories, best first, with their cosine and token count; applies the
recall bookkeeping unless ``mark_used=false``. Reads an existing store (never builds one).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig

from ..config import EmbedderConfig, PassConfig
from .cli import job, suggest
from .common import make_embedder, open_store, sim_cfg, typed, user_errors

if TYPE_CHECKING:
    from ..recall import Recalled

log = logging.getLogger("consolidate")


def run_recall(cfg: DictConfig) -> Recalled:
    """Recall ``cfg.query`` in ``cfg.namespace`` of ``cfg.store.dir``.

    Raises:
        StoreNotFoundError: no store at ``store.dir``.
        ValueError: a bad ``k`` or ``max_tokens``, an empty or over-long query.
    """
    from ..recall import recall  # with torch: not for --help

    namespace, query = str(cfg.namespace), str(cfg.query)  # missing values before any work
    store, _ = open_store(cfg, build=False)
    if cfg.mark_used:
        _warn_if_historical(store, namespace)
    emb = make_embedder(typed(cfg, "embedder", EmbedderConfig))
    (out,) = recall(
        store,
        namespace,
        [query],
        emb,
        k=int(cfg.k),
        max_tokens=int(cfg.max_tokens),
        mark_used=bool(cfg.mark_used),
        strength_cap=cfg.strength_cap,
        device=sim_cfg(cfg).device,
    )
    if not out.ids:
        known = _namespaces(store)
        if namespace not in known:
            hint = suggest(namespace, sorted(known))
            raise ValueError(
                f"no namespace {namespace!r} in {store.root}"
                + (f"; did you mean {hint}?" if hint else f" ({len(known)} namespaces)")
            )
    return out


def _namespaces(store: Any) -> set[str]:
    """Every namespace of the store (live or not)."""
    return set(store.namespaces())


def _warn_if_historical(store: Any, namespace: str) -> None:
    """Say so when the namespace's newest activity is older than the default τ: marking
    recalled memories used at the wall clock moves its "latest" to now, and the next pass
    (``sleep.now=latest``) then ages the others from today."""
    from ..store import hours_now

    snap = store.load(namespaces=[namespace]) if store.PARTIAL_LOADS else store.load()
    m = snap.records.meta
    m = m[(m["namespace"] == namespace) & m["deleted_at"].isna()]
    if not len(m):
        return
    latest = float(np.nanmax(np.maximum(m["last_used"].to_numpy(), m["created_at"].to_numpy())))
    tau = PassConfig().tau_hours
    if hours_now() - latest > tau:
        days = (hours_now() - latest) / 24
        msg = (
            f"note: the newest memory of {namespace!r} was last used {days:.0f} days ago "
            f"(more than tau, {tau / 24:.0f} days): marking recalled memories used now makes "
            f"the next pass (sleep.now=latest) age its other memories from today; use "
            f"mark_used=false on a historical store"
        )
        log.warning(msg)


@job("recall")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-recall``: :func:`run_recall`, then the
    recalled memories with their scores and the token count."""
    with user_errors():
        out = run_recall(cfg)
    if not out.ids:
        if out.cut_by_tokens:
            print(f"nothing fits in max_tokens={cfg.max_tokens}: none of the top "
                  f"{out.cut_by_tokens} memories of {cfg.namespace!r} is that short")  # fmt: skip
        else:
            print(f"no live memories in namespace {cfg.namespace!r} (all are tombstones)")
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

"""``consolidate-convert src=PATH dst=PATH``: copy a Parquet store into a new Lance store."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from .cli import job
from .common import user_errors


def run_convert(cfg: DictConfig) -> dict[str, Any]:
    """Convert ``cfg.src`` (any store) into a new Lance store at ``cfg.dst``.

    Raises:
        StoreNotFoundError: no store at ``src``.
        FileExistsError: ``dst`` is not empty.
    """
    from ..store.lance import LanceStore, convert, open_store_dir

    src = open_store_dir(cfg.src)
    src.head()  # StoreNotFoundError with the path
    out = convert(src, LanceStore(cfg.dst, vector_dtype=cfg.vector_dtype))
    return {"src": str(cfg.src), "dst": str(cfg.dst), **out}


@job("convert")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-convert``: :func:`run_convert` (a Parquet
    store into a new Lance store), then what was converted."""
    with user_errors():
        out = run_convert(cfg)
    print(
        f"converted {out['src']} (version {out['source_version']}) into the Lance store "
        f"{out['dst']}: {out['records']} records, version {out['version']}"
    )


if __name__ == "__main__":
    main()

"""Objects built from a composed config: typed config nodes, the store (opened, or built from
LOCOMO), the embedder, and the run summary file. The jobs and the library functions they
call (:func:`consolidate.consolidation.run_consolidate`, :func:`consolidate.evaluation.evaluate.
run_evaluate`, ...) use these, so Python code composes a config and calls the same."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .config import EmbedderConfig, PassConfig, SimilarityConfig, StoreConfig
from .store import MemoryStore, StoreNotFoundError

__all__ = ["typed", "pass_cfg", "sim_cfg", "open_store", "make_store", "make_embedder",
           "write_summary"]  # fmt: skip

log = logging.getLogger("consolidate")


def typed(cfg: DictConfig, key: str, cls: type) -> Any:
    """``cfg[key]`` as an instance of the dataclass ``cls`` (extra keys are an error)."""
    node = cfg.get(key) if key in cfg else None
    if node is None:
        raise ValueError(
            f"the config has no '{key}' settings (removed with ~{key}?); this job needs them"
        )
    allowed = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(node.keys()) - allowed)
    if extra:
        import difflib

        hints = {x: difflib.get_close_matches(x, sorted(allowed), n=1, cutoff=0.7) for x in extra}
        said = "; ".join(f"did you mean {key}.{h[0]}?" for h in hints.values() if h)
        raise ValueError(
            f"unknown key(s) {extra} in '{key}'"
            + (f": {said}" if said else "")
            + f" (allowed: {sorted(allowed)})"
        )
    obj = OmegaConf.to_object(node)
    if isinstance(obj, cls):
        return obj
    return cls(**obj)  # type: ignore[arg-type]


def pass_cfg(cfg: DictConfig) -> PassConfig:
    """The ``sleep`` group of a composed config as a typed
    :class:`~consolidate.config.PassConfig`."""
    return typed(cfg, "sleep", PassConfig)


def sim_cfg(cfg: DictConfig) -> SimilarityConfig:
    """The ``similarity`` group of a composed config as a typed
    :class:`~consolidate.config.SimilarityConfig`."""
    return typed(cfg, "similarity", SimilarityConfig)


def open_store(cfg: DictConfig, *, build: bool = True) -> tuple[MemoryStore, dict[str, Any] | None]:
    """Open ``cfg.store.dir``; build it from ``store.init_from`` if it is missing.

    Returns:
        ``(store, import_report or None)``.

    Raises:
        StoreNotFoundError: no store and ``init_from`` is null (or ``build=False``), or
            ``store.dir`` is not the default location and ``store.create`` is not true
            (names the closest existing store).
        FileExistsError: no store, but ``store.dir`` is a file or a non-empty folder.
        ValueError: ``store.name`` is not a plain folder name.
    """
    scfg: StoreConfig = typed(cfg, "store", StoreConfig)
    name = scfg.name
    if not (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    ):
        raise ValueError(
            f"store.name must be a plain folder name (no '/', not '..'), got "
            f"{name!r}; use store.dir=PATH for a store elsewhere"
        )
    store = make_store(scfg)
    if store.exists() or not build or scfg.init_from is None:
        if not store.exists():
            store.head()  # raises StoreNotFoundError with the path
        return store, None
    root = Path(scfg.dir)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(  # before any model is loaded (Store.create checks it again)
            f"{root} is not empty and holds no store (CURRENT is missing): a store is built "
            f"only in a new or empty directory; if it held a store, restore its CURRENT or "
            f"move the folder aside"
        )
    _check_create(cfg, scfg, root)
    if scfg.init_from != "locomo":
        raise ValueError(f"store.init_from must be 'locomo' or null, got {scfg.init_from!r}")
    from .store.locomo import locomo_records

    ecfg: EmbedderConfig = typed(cfg, "embedder", EmbedderConfig)
    log.info("building store %s from LOCOMO %s", scfg.dir, scfg.locomo_file)
    emb = make_embedder(ecfg)
    recs, report = locomo_records(scfg.locomo_file, emb, scfg.importance, scfg.conversations)
    store.create(recs, source=scfg.locomo_file)
    rep = {**report.__dict__, "embedder": ecfg.name, "embedder_device": str(emb.device)}
    (Path(scfg.dir) / "import_report.json").write_text(json.dumps(rep, indent=1))
    return store, rep


def _check_create(cfg: DictConfig, scfg: StoreConfig, root: Path) -> None:
    """A new store is built at ``root`` only when ``store.create`` is true, or when it is
    null and ``root`` is the default location ``<paths.store_root>/<store.name>`` (a
    mistyped ``store.dir`` must not build a whole new store).

    Raises:
        StoreNotFoundError: naming the closest existing store beside ``root``.
    """
    import difflib

    if scfg.create is True:
        return
    paths = cfg.get("paths") if hasattr(cfg, "get") else None
    default = Path(paths.store_root) / scfg.name if paths is not None else None
    if scfg.create is None and default is not None and root.resolve() == default.resolve():
        return
    near = []
    parent = root.resolve().parent
    if parent.is_dir():
        stores = [d.name for d in parent.iterdir() if (d / "CURRENT").is_file()]
        near = difflib.get_close_matches(root.name, stores, n=1, cutoff=0.5)
    hint = f" (the closest existing store: {parent / near[0]})" if near else ""
    raise StoreNotFoundError(
        f"no store at {root}{hint}: store.create=true builds a new one there from {scfg.init_from}"
    )


def make_store(scfg: StoreConfig) -> MemoryStore:
    """The store at ``scfg.dir`` in its own format (``scfg.format`` for a new one).

    Raises:
        ValueError: an unknown ``store.format``.
    """
    from .store.lance import open_store_dir

    kw: dict[str, Any] = {
        "keep_snapshots": scfg.keep_snapshots,
        "quarantine": scfg.quarantine,
        "vector_dtype": scfg.vector_dtype,
    }
    return open_store_dir(scfg.dir, format=scfg.format, retention_h=float(scfg.retention_h), **kw)


def make_embedder(ecfg: EmbedderConfig) -> Any:
    """The embedder of ``ecfg._target_`` (:class:`~consolidate.embed.Embedder` by default),
    built with the config's other fields as keyword arguments (``hydra.utils.instantiate``).

    Raises:
        ImportError / ValueError: a ``_target_`` that does not import, or settings the
            embedder refuses.
    """
    from hydra.utils import instantiate

    return instantiate(dataclasses.asdict(ecfg))


def write_summary(out_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Write ``summary`` as ``summary.json`` into ``out_dir`` (created if missing); returns
    the file's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = out / "summary.json"
    p.write_text(json.dumps(summary, indent=1, default=str))
    return p

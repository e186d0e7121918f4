"""Helpers shared by the jobs: typed config nodes, store opening/building, summary output."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config import EmbedderConfig, PassConfig, SimilarityConfig, StoreConfig
from ..store import Store

log = logging.getLogger("consolidate")


def typed(cfg: DictConfig, key: str, cls: type) -> Any:
    """``cfg[key]`` as an instance of the dataclass ``cls`` (extra keys are an error)."""
    node = cfg[key]
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
    return typed(cfg, "pass", PassConfig)


def sim_cfg(cfg: DictConfig) -> SimilarityConfig:
    return typed(cfg, "similarity", SimilarityConfig)


def open_store(cfg: DictConfig, *, build: bool = True) -> tuple[Store, dict[str, Any] | None]:
    """Open ``cfg.store.dir``; build it from ``store.init_from`` if it is missing.

    Returns:
        ``(store, import_report or None)``.

    Raises:
        StoreNotFoundError: no store and ``init_from`` is null (or ``build=False``).
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
    if scfg.init_from != "locomo":
        raise ValueError(f"store.init_from must be 'locomo' or null, got {scfg.init_from!r}")
    from ..store.locomo import locomo_records

    ecfg: EmbedderConfig = typed(cfg, "embedder", EmbedderConfig)
    log.info("building store %s from LOCOMO %s", scfg.dir, scfg.locomo_file)
    emb = make_embedder(ecfg)
    recs, report = locomo_records(scfg.locomo_file, emb, scfg.importance, scfg.conversations)
    store.create(recs, source=scfg.locomo_file)
    rep = {**report.__dict__, "embedder": ecfg.name, "embedder_device": str(emb.device)}
    (Path(scfg.dir) / "import_report.json").write_text(json.dumps(rep, indent=1))
    return store, rep


def make_store(scfg: StoreConfig) -> Store:
    """The store at ``scfg.dir`` in its own format (``scfg.format`` for a new one).

    Raises:
        ValueError: an unknown ``store.format``.
    """
    from ..store.lance_store import LanceStore, open_store_dir

    kw: dict[str, Any] = {
        "keep_snapshots": scfg.keep_snapshots,
        "quarantine": scfg.quarantine,
        "vector_dtype": scfg.vector_dtype,
    }
    store = open_store_dir(scfg.dir, format=scfg.format, **kw)
    if isinstance(store, LanceStore):
        store.retention_h = float(scfg.retention_h)
    return store


def make_embedder(ecfg: EmbedderConfig) -> Any:
    """An :class:`~consolidate.embed.Embedder` from its config."""
    from ..embed import Embedder

    return Embedder(
        ecfg.model_path,
        ecfg.device,
        ecfg.batch_size,
        ecfg.show_progress,
        ecfg.dtype,
        ecfg.pipeline,
        ecfg.batch_tokens,
        ecfg.long_text,
    )


def write_summary(out_dir: str | Path, summary: dict[str, Any]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = out / "summary.json"
    p.write_text(json.dumps(summary, indent=1, default=str))
    return p


#: The jobs' Hydra configs, shipped inside the package (``consolidate/conf/``).
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def _log_to_files(msg: str) -> None:
    """Write ``msg`` as an ERROR record to the log files only (the job's ``<job>.log``), so
    a failed run's folder says why; the console gets the ``error:`` line alone."""
    rec = logging.LogRecord("consolidate", logging.ERROR, __file__, 0, msg, None, None)
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(rec)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors a user can fix (bad input, bad settings, a locked or corrupt store, a
    missing file or package) into one line on stderr and exit status 2, instead of a
    traceback."""
    from hydra.errors import InstantiationException

    from ..evaluation.tasks import DatasetHashError
    from ..pipeline import MassDropError
    from ..store import (
        ConcurrentCommitError,
        CorruptStoreError,
        InvalidRecordsError,
        LockTimeoutError,
        StoreNotFoundError,
    )

    user = (
        InvalidRecordsError,
        MassDropError,
        LockTimeoutError,
        CorruptStoreError,
        StoreNotFoundError,
        ConcurrentCommitError,
        DatasetHashError,
        FileNotFoundError,
        KeyError,
        ValueError,
        ImportError,
    )
    from omegaconf.errors import MissingMandatoryValue

    try:
        try:
            yield
        except InstantiationException as e:  # a `_target_` whose constructor refused
            if isinstance(e.__cause__, user):
                raise e.__cause__ from e
            raise
        except MissingMandatoryValue as e:  # a `???` in the config the user did not set
            key = getattr(e, "full_key", None) or str(e)
            raise ValueError(f"{key} has no value: set it on the command line ({key}=...)") from e
    except user as e:
        if os.environ.get("CONSOLIDATE_DEBUG"):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        _log_to_files(f"error: {msg}")
        print(f"error: {msg}\n(set CONSOLIDATE_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        # a full disk, a read-only or forbidden folder, a folder that is in the way
        if os.environ.get("CONSOLIDATE_DEBUG") or not (
            isinstance(e, (FileExistsError, PermissionError))
            or e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
        ):
            raise
        _log_to_files(f"error: {e}")
        print(f"error: {e}\n(set CONSOLIDATE_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(2)

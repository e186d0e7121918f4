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
           "write_summary", "as_typed", "expect_plan_text", "command_line_overrides"]  # fmt: skip

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


def command_line_overrides() -> list[str]:
    """The running Hydra job's overrides as typed (``hydra.overrides.task``, its
    interpolations left unresolved), or ``[]`` outside a Hydra job (a call from Python)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = HydraConfig.get().overrides.task
    except (ValueError, AttributeError):
        return []
    return [str(o) for o in OmegaConf.to_container(task, resolve=False)]  # type: ignore[union-attr]


def _typed_text(key: str, line: str, value: Any) -> str | None:
    """The text ``line`` (``key=...``, ``+key=...``, ``++key=...``) gives ``key`` when
    Hydra's parse of it is ``value`` (as is, or as the text a ``str`` field made of it);
    otherwise ``None``: another key, a sweep, an interpolation (``value`` is what it
    resolved to), or a line that some code changed the setting after."""
    if "=" not in line or key not in line:
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        o = OverridesParser.create().parse_override(line)
    except HydraException:  # not an override Hydra reads (an argument of another kind)
        return None
    if o.key_or_group != key or o.is_sweep_override() or o.is_delete():
        return None
    parsed = o.value()
    if isinstance(parsed, str):
        return parsed.strip() if parsed == value else None
    same = parsed == value or (
        isinstance(value, str) and parsed is not None and str(parsed) == value
    )
    return line.partition("=")[2].strip() if same else None


def as_typed(key: str, value: Any, *, numbers: bool = True) -> str | None:
    """``value`` of the setting ``key`` (a dotted path: ``id``, ``source.expect_plan``) as
    the user typed it. Hydra reads ``661775e6`` (a hex id) as the float 6.61775e11 and
    ``1_000`` as 1000, so where ``value`` is not text, or is the text a ``str`` field made
    of a number, the text comes from the command line: the job's override, or under
    ``--multirun`` (whose jobs get overrides rewritten from the parsed values) the process's
    arguments, whichever Hydra parses to ``value``. A quoted value (``key='661775e6'``)
    and an interpolation are the composed value as it is.

    Args:
        key: the setting's dotted path as it is written on the command line.
        value: the setting's value in the composed config (``None``: not set).
        numbers: outside a Hydra job (a config composed in Python, a config file), return
            a number as ``str(value)``; ``False``: refuse it, since its text is lost.

    Returns:
        The text, stripped of spaces, or ``None`` when ``value`` is ``None``.

    Raises:
        ValueError: a boolean or another non-text value; a number with ``numbers=False``
            (the message says how to quote it).
    """
    if value is None:
        return None
    import sys

    # the arguments first: a --multirun job's own overrides hold the parsed values' text
    for line in [*reversed(sys.argv[1:]), *reversed(command_line_overrides())]:
        text = _typed_text(key, line, value)
        if text is not None:
            return text
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if numbers:
            return str(value)
        leaf = key.rpartition(".")[2]
        raise ValueError(
            f"{key}={value!r} reached the job as a number, so the id's text is lost (Hydra "
            f"and YAML read an id of digits with one 'e', such as 661775e6, as a number): "
            f"quote it: on the command line {key}=\"'<id>'\", in a config file "
            f"{leaf}: '<id>'"
        )
    raise ValueError(f"{key}={value!r} is not an id: give it as text ({key}='...')")


def expect_plan_text(value: Any) -> str | None:
    """``source.expect_plan`` checked before any work: the plan id, or a prefix of it, that
    an apply must match (:func:`as_typed` gives its text).

    Args:
        value: the setting's value in the composed config.

    Returns:
        The lower-case hex prefix, or ``None`` (not set).

    Raises:
        ValueError: not text (a number outside a Hydra job), shorter than 4 characters, or
            not hex digits (plan ids are the first 32 hex digits of a SHA-256, as
            ``plan.json`` and the dry run's summary print them).
    """
    e = as_typed("source.expect_plan", value, numbers=False)
    if e is None:
        return None
    e = e.lower()
    if len(e) < 4:
        raise ValueError(f"source.expect_plan={e}: give 4 characters of the plan id at least")
    if set(e) - set("0123456789abcdef"):
        raise ValueError(
            f"source.expect_plan={e}: not a plan id (hex digits, as the dry run printed it "
            f"and plan.json's plan_id holds it)"
        )
    return e

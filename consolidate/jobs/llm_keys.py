"""The model backends on the command line. Every model a job runs takes the one ``llm``
config group (``conf/llm/``: transformers, vllm, openai) at the key of its use:
``llm@merge``, ``llm@reflect``, ``llm@ingest``, ``llm@answer``. A use is there either always
(the job's primary config lists ``llm@<use>``: ingest, answer) or with a choice of its group
whose file takes ``/llm@_here_`` (``merge=llm``, ``merge=vllm``, ``reflect=llm``).

This module turns what a user gets wrong about that into one line saying what to write:
a backend chosen where the use has no model (:func:`describe_llm_override`), and
``<use>.backend=X`` that differs from ``llm@<use>``, refused because the name alone would
keep the other backend's settings (``backend_kwargs``) (:func:`check_llm_backends`).
Both read the YAML files of ``conf/`` and the overrides, never compose a config.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .common import CONFIG_DIR

__all__ = ["GROUP", "llm_uses", "describe_llm_override", "check_llm_backends"]

#: the config group of the model backends
GROUP = "llm"


@functools.cache
def _defaults(path: Path) -> tuple[Any, ...]:
    """The ``defaults`` list of a YAML config file (empty if it has none)."""
    if not path.is_file():
        return ()
    node = OmegaConf.to_container(OmegaConf.load(path))
    entries = node.get("defaults") if isinstance(node, dict) else None
    return tuple(entries or ())


def _entry_keys(path: Path) -> list[str]:
    """The names in a defaults list: a plain entry, or the key of a ``group: choice`` one."""
    out = []
    for e in _defaults(path):
        out += [str(k) for k in e] if isinstance(e, dict) else [str(e)]
    return out


def _primaries() -> list[str]:
    """The jobs' primary configs (``conf/<job>.yaml``)."""
    return sorted(p.stem for p in Path(CONFIG_DIR).glob("*.yaml"))


def _chain(config_name: str) -> list[str]:
    """The primary config and the primary configs it extends (``policy`` -> ``evaluate``)."""
    out = [config_name]
    for name in _entry_keys(Path(CONFIG_DIR) / f"{config_name}.yaml"):
        if name != config_name and name in _primaries():
            out += _chain(name)
    return out


def _group_defaults(config_name: str) -> dict[str, str | None]:
    """The job's groups and their default choice, as its primary configs list them."""
    out: dict[str, str | None] = {}
    for name in reversed(_chain(config_name)):
        for e in _defaults(Path(CONFIG_DIR) / f"{name}.yaml"):
            if isinstance(e, dict):
                for g, c in e.items():
                    if (Path(CONFIG_DIR) / str(g)).is_dir() or str(g).startswith(f"{GROUP}@"):
                        out[str(g)] = None if c is None else str(c)
    return out


def llm_uses(config_name: str) -> dict[str, list[str]]:
    """The models of a job: use -> the group choices that give it one.

    Args:
        config_name: the job's primary config.

    Returns:
        ``{"merge": ["merge=llm", "merge=vllm"], "reflect": ["reflect=llm"]}`` for
        ``consolidate``; an empty list for a use the job always has (``ingest``,
        ``answer``: its primary config lists ``llm@<use>``).
    """
    uses: dict[str, list[str]] = {}
    for group in _group_defaults(config_name):
        if group.startswith(f"{GROUP}@"):
            uses[group.split("@", 1)[1]] = []
            continue
        for p in sorted((Path(CONFIG_DIR) / group).glob("*.yaml")):
            if any(k.removeprefix("override ").lstrip("/").startswith(f"{GROUP}@_here_")
                   for k in _entry_keys(p)):  # fmt: skip
                uses.setdefault(group, []).append(f"{group}={p.stem}")
    return uses


def _prog(config_name: str) -> str:
    """The console script of the job ``config_name`` (``consolidate-ingest``)."""
    return "consolidate" if config_name == "consolidate" else f"consolidate-{config_name}"


def _options() -> list[str]:
    """The backends of the ``llm`` group (its YAML files)."""
    return sorted(p.stem for p in (Path(CONFIG_DIR) / GROUP).glob("*.yaml"))


def _typed(args: Sequence[str], key: str) -> str | None:
    """The value the user gave ``key`` (``+``/``~`` prefixes ignored), as typed."""
    for a in args:
        k, sep, v = a.partition("=")
        if k.lstrip("+~") == key:
            return v if sep else None
    return None


def _choice(config_name: str, group: str, args: Sequence[str]) -> str | None:
    """The choice of ``group`` after the overrides (``None``: no choice, or ``~group``)."""
    for a in reversed(args):
        k, sep, v = a.partition("=")
        if k.lstrip("+") == group and sep:
            return None if v == "null" else v
        if k == f"~{group}":
            return None
    return _group_defaults(config_name).get(group)


def _home(homes: list[str]) -> str:
    """The choice to name first among those that give a use its model (``merge=llm``)."""
    return next((h for h in homes if h.endswith(f"={GROUP}")), homes[0])


def _backend(use: str, value: str | None) -> str:
    """``llm@<use>=<value>``, or the closest backend to a mistyped value, or the choices."""
    from .cli import suggest

    opts = _options()
    if value in opts:
        return f"{GROUP}@{use}={value}"
    hint = suggest(value or "", opts)
    if hint:
        return f"{GROUP}@{use}={hint}"
    return f"{GROUP}@{use}=<{'|'.join(opts)}>"


def _owners(use: str) -> list[str]:
    """The console scripts of the jobs that have a model at ``use``."""
    return [_prog(j) for j in _primaries() if use in llm_uses(j)]


def _models_of(config_name: str) -> str:
    """``its models: llm@merge (with merge=llm), llm@reflect (with reflect=llm)``."""
    uses = llm_uses(config_name)
    return "its models: " + ", ".join(
        f"{GROUP}@{u}" + (f" (with {_home(h)})" if h else "") for u, h in uses.items()
    )


def describe_llm_override(config_name: str, key: str, args: Sequence[str]) -> str | None:
    """One line for an override about a model that did not compose, or ``None`` when
    ``key`` is no such override.

    Args:
        config_name: the job's primary config.
        key: the key Hydra could not override (``llm@merge``, ``llm``, ``merge.backend``).
        args: the command line's overrides.

    Covers ``llm=X`` (the group is taken per use), ``llm@<use>=X`` where ``<use>``'s group
    choice has no model (``merge=extractive``: add ``merge=llm``) or the job has no such use,
    and ``<use>.backend=X`` or ``<use>.backend_kwargs.*`` in those cases (the backend is
    chosen with ``llm@<use>=X``).
    """
    uses = llm_uses(config_name)
    value = _typed(args, key)
    shown = f"{key}={value}" if value is not None else key
    if key == GROUP:
        if not uses:
            return f"{shown}: {_prog(config_name)} runs no model"
        ways = [_backend(u, value) + (f" (with {_home(h)})" if h else "") for u, h in uses.items()]
        return f"{shown}: each model takes the {GROUP} group at its own key: " + ", ".join(ways)
    if key.startswith(f"{GROUP}@"):
        use, kind = key.split("@", 1)[1], "backend"
    elif "." in key and key.split(".")[1] in ("backend", "backend_kwargs"):
        use, kind = key.split(".", 1)[0], "key"
    else:
        return None
    if use not in uses:
        owners = _owners(use)
        if kind == "key" and not owners:  # store.backend=...: no model's key at all
            return None
        whose = f"{GROUP}@{use} belongs to {', '.join(owners)}" if owners else "no job has one"
        if not uses:
            return f"{shown}: {_prog(config_name)} runs no model ({whose})"
        return (f"{shown}: {_prog(config_name)} has no {use} model ({whose}); "
                f"{_models_of(config_name)}")  # fmt: skip
    homes = uses[use]
    if not homes:
        return None
    current = _choice(config_name, use, args)
    if f"{use}={current}" in homes:  # the use has its model: some other mistake
        return None
    home = _home(homes)
    if kind == "backend":
        return (f"{shown} sets the backend of the {use} model, and {use}={current or 'null'} "
                f"has no model: add {home} ({_prog(config_name)} {home} {_backend(use, value)})")  # fmt: skip
    if key == f"{use}.backend":
        return (f"{shown}: a model's backend is chosen with its {GROUP}@ key, and "
                f"{use}={current or 'null'} has no model: write {home} {_backend(use, value)}")  # fmt: skip
    return (f"{shown}: {use}={current or 'null'} has no model: add {home} "
            f"(and {_backend(use, None)} for its backend)")  # fmt: skip


def check_llm_backends(
    config_name: str, cfg: DictConfig, choices: Mapping[str, Any], overrides: Sequence[str]
) -> None:
    """Refuse a composed config whose models and backends disagree, before any model loads.

    Args:
        config_name: the job's primary config.
        cfg: the composed config.
        choices: the group choices (``hydra.runtime.choices``), with ``llm@<use>`` keys.
        overrides: the command line's overrides (``hydra.overrides.task``).

    Raises:
        ValueError: ``<use>.backend=X`` that is not the ``llm@<use>`` choice (the name alone
            would keep the other backend's ``backend_kwargs``: use ``llm@<use>=X``);
            ``+llm@<use>=X`` where ``<use>``'s choice has no model; ``llm@<use>=X`` while
            ``<use>.backend=null`` turns that model off (the answers of
            ``consolidate-evaluate``). A backend given as a config (``_target_``) is left
            alone.
    """
    uses = llm_uses(config_name)
    for group, chosen in choices.items():
        if not str(group).startswith(f"{GROUP}@"):
            continue
        use = str(group).split("@", 1)[1]
        homes = uses.get(use) or []
        if homes and f"{use}={choices.get(use)}" not in homes:
            home = _home(homes)
            raise ValueError(
                f"{group}={chosen} sets the backend of the {use} model, and "
                f"{use}={choices.get(use)} has no model: add {home} "
                f"({_prog(config_name)} {home} {group}={chosen})"
            )
        node = cfg.get(use)
        if not isinstance(node, DictConfig) or "backend" not in node:
            continue
        if OmegaConf.is_missing(node, "backend"):
            continue
        backend = node.get("backend")
        if backend is None:
            if _typed(overrides, str(group)) is not None:
                raise ValueError(
                    f"{group}={chosen} has no effect while {use}.backend=null (no {use} "
                    f"model): add {use}.backend={chosen}"
                )
            continue
        if isinstance(backend, str) and backend != chosen:
            raise ValueError(_mismatch(config_name, use, backend, f"{group}={chosen}"))


def _mismatch(config_name: str, use: str, backend: str, chosen: str) -> str:
    """The message for ``<use>.backend=<backend>`` beside the choice ``chosen``."""
    fix = _backend(use, backend)
    head = f"{use}.backend={backend} would keep the settings of {chosen} ({use}.backend_kwargs)"
    if "backend" not in _own_keys(config_name, use):
        return f"{head}: choose the backend with {fix} instead"
    # evaluate writes answer.backend itself (null: no answers): there the name also turns
    # the model on, so it stays and llm@answer goes beside it
    if backend in _options():
        return f"{head}: add {fix}"
    name = fix.rpartition("=")[2]
    again = f"; did you mean {use}.backend={name} {fix}?" if name in _options() else ""
    return f"{use}.backend={backend}: no such backend (choices: {', '.join(_options())}){again}"


def _own_keys(config_name: str, use: str) -> set[str]:
    """The keys the job's primary configs write under ``use`` themselves (evaluate writes
    ``answer.backend: null``: there the name also turns the model on)."""
    keys: set[str] = set()
    for name in _chain(config_name):
        node = OmegaConf.load(Path(CONFIG_DIR) / f"{name}.yaml")
        sub = node.get(use) if isinstance(node, DictConfig) else None
        if isinstance(sub, DictConfig):
            keys |= {str(k) for k in sub}
    return keys

"""The command-line face of the jobs: one decorator turns a task function into a console
script that composes its Hydra config, answers ``--help`` with what the job does, its config
groups and their choices, and reports every user error (an unknown key, a bad value, an
unknown choice, an override that does not parse) as one ``error:`` line with exit status 2.

``CONSOLIDATE_DEBUG=1`` re-raises instead, with the traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import io
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .common import CONFIG_DIR

__all__ = ["job", "suggest", "config_keys", "help_text", "lazy_library"]


def lazy_library(module: str, library: str, names: Iterable[str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for the job module ``module`` (its ``__name__``):
    each of ``names`` is taken from the module ``library`` (an absolute module name),
    imported when first named, so that a job's ``--help`` and a mistyped setting are
    answered without importing torch.

    The returned function raises ``AttributeError`` for any other name, as a module does.
    """
    wanted = frozenset(names)

    def __getattr__(name: str) -> Any:
        if name in wanted:
            import importlib

            return getattr(importlib.import_module(library), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def job(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], None]]:
    """Decorate ``task(cfg)`` as the console script of the job ``config_name``.

    Args:
        config_name: the primary config, ``consolidate/conf/<config_name>.yaml``.

    Returns:
        A ``main()`` that reads ``sys.argv``: ``--help``/``-h`` prints :func:`help_text`
        and exits 0; otherwise Hydra composes the config (overrides, ``--cfg``,
        ``--multirun`` and Hydra's other flags as usual) and calls ``task``. A config that
        does not compose prints one ``error:`` line on stderr and exits 2, and so does one
        whose model backends disagree with their ``llm@<use>`` choices
        (:func:`~consolidate.jobs.llm_keys.check_llm_backends`), before ``task`` runs.
    """
    import hydra

    def deco(task: Callable[[DictConfig], Any]) -> Callable[[], None]:
        started: list[bool] = []

        @functools.wraps(task)
        def logged(cfg: DictConfig) -> Any:
            started.append(True)
            with _stdout_to_log():
                _check_models(config_name, cfg)
                return task(cfg)

        hydra_main = hydra.main(version_base="1.3", config_path=CONFIG_DIR,
                                config_name=config_name)(logged)  # fmt: skip
        about = sys.modules[task.__module__].__doc__ or ""

        @functools.wraps(task)
        def main() -> None:
            started.clear()
            args = sys.argv[1:] = renamed_overrides(sys.argv[1:])
            if "--help" in args or "-h" in args:
                overrides = _overrides_only(args)
                try:
                    text = help_text(config_name, about, overrides)
                except Exception as e:  # an override the help cannot compose
                    _fail(config_name, e)
                print(text)
                sys.exit(0)
            # Hydra re-raises instead of printing its multi-line report (and exiting 1)
            os.environ["HYDRA_FULL_ERROR"] = "1"
            try:
                hydra_main()
            except Exception as e:
                # anything raised before the job started is about the command line or a
                # config file (Hydra raises some of those as plain ValueErrors)
                if started and not _is_config_error(e):
                    raise
                _fail(config_name, e)

        return main

    return deco


class _Tee(io.TextIOBase):
    """Writes to the console stream and to the open log files of the run."""

    def __init__(self, console: Any, files: list[logging.FileHandler]):
        self.console, self.files = console, files

    def write(self, s: str) -> int:
        self.console.write(s)
        for h in self.files:
            h.acquire()
            try:
                if h.stream is None:
                    h.stream = h._open()
                h.stream.write(s)
                h.stream.flush()
            finally:
                h.release()
        return len(s)

    def flush(self) -> None:
        self.console.flush()

    def isatty(self) -> bool:
        return bool(getattr(self.console, "isatty", lambda: False)())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.console, "encoding", "utf-8")


@contextlib.contextmanager
def _stdout_to_log() -> Iterator[None]:
    """While the job runs, what it prints (its summary and stage table) also goes to the
    run's ``<job>.log``, so the log holds the whole result."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:
        yield
        return
    console = sys.stdout
    sys.stdout = _Tee(console, files)
    try:
        yield
    finally:
        sys.stdout = console


#: config groups renamed: old name -> new name (``pass`` is a Python keyword)
RENAMED_GROUPS = {"pass": "sleep"}


def renamed_overrides(args: list[str]) -> list[str]:
    """``args`` with overrides of a renamed group spelled with its new name
    (``pass.threshold=0.8`` -> ``sleep.threshold=0.8``, ``+pass.x``, ``~pass``,
    ``pass=default``), and a note on stderr for each; other arguments unchanged."""
    out = []
    for a in args:
        for old, new in RENAMED_GROUPS.items():
            prefix = a[: len(a) - len(a.lstrip("+~"))]
            rest = a[len(prefix) :]
            if rest.startswith((f"{old}.", f"{old}=")) or rest == old:
                fixed = prefix + new + rest[len(old) :]
                print(f"note: the config group {old!r} is now {new!r}: read {a} as {fixed}",
                      file=sys.stderr)  # fmt: skip
                a = fixed
        out.append(a)
    return out


def _check_models(config_name: str, cfg: DictConfig) -> None:
    """Refuse, as a user error (one ``error:`` line, exit 2), models and backends that
    disagree (:func:`~consolidate.jobs.llm_keys.check_llm_backends`), before the job runs."""
    from hydra.core.hydra_config import HydraConfig

    from .common import command_line_overrides, user_errors
    from .llm_keys import check_llm_backends

    hc = HydraConfig.get()
    with user_errors():
        check_llm_backends(config_name, cfg, hc.runtime.choices, command_line_overrides())


def _is_config_error(e: BaseException) -> bool:
    from hydra.errors import HydraException, InstantiationException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(e, (HydraException, OmegaConfBaseException)) and not isinstance(
        e, InstantiationException
    )


def _fail(config_name: str, e: BaseException) -> None:
    if os.environ.get("CONSOLIDATE_DEBUG"):
        raise e
    print(f"error: {describe(config_name, e)} (CONSOLIDATE_DEBUG=1 shows the traceback)",
          file=sys.stderr)  # fmt: skip
    sys.exit(2)


def describe(config_name: str, e: BaseException) -> str:
    """One line for a config that did not compose: what is wrong, and a close match.

    Args:
        config_name: the job's primary config (to list its groups and keys).
        e: the exception Hydra or OmegaConf raised while composing.
    """
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

    nokey = next((a for a in sys.argv[1:] if a.startswith("=")), None)
    if nokey is not None:
        return f"{nokey!r} has no key: write KEY=VALUE (e.g. sleep.threshold{nokey})"
    cause = e.__cause__ if e.__cause__ is not None else e
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, MissingConfigException):
        group, _, value = (e.missing_cfg_file or "").rpartition("/")
        choices = [o for o in (e.options or []) if o != "base"]
        if group and choices:
            hint = suggest(value, choices)
            key = _typed_key(group, value, _overrides_only(sys.argv[1:]))
            return (f"{key}={value}: no such choice (choices: {', '.join(choices)})"
                    + (f"; did you mean {key}={hint}?" if hint else ""))  # fmt: skip
        return text.removeprefix(f"In '{config_name}': ")
    if isinstance(e, OverrideParseException):
        lines = [ln for ln in str(e).strip().splitlines() if ln and not ln.startswith("See ")]
        detail = next((ln for ln in lines if not ln.startswith("Error parsing")), "")
        bad = _unparsable(sys.argv[1:])
        return (
            f"cannot read the override {bad!r}: {detail} " if bad is not None else f"{detail}: "
        ) + ("(quote a value that holds '=', ':', '[', ']', ',' or spaces, e.g. key='\"a: b\"')")
    about_llm = _about_llm(config_name, e)
    if about_llm:
        return about_llm
    if "No match in the defaults list" in text:
        group = text.split("'")[1] if "'" in text else "?"
        groups = sorted(_groups(config_name))
        hint = suggest(group, groups)
        return (f"{group}: no such config group in {config_name} (groups: {', '.join(groups) or 'none'})"
                + (f"; did you mean {hint}?" if hint else ""))  # fmt: skip
    if isinstance(cause, MissingMandatoryValue):
        key = getattr(cause, "full_key", "") or text
        return f"{key} has no value: set it on the command line ({key}=...)"
    if isinstance(cause, ValidationError) and not isinstance(cause, ConfigKeyError):
        key = getattr(cause, "full_key", "")
        msg = str(getattr(cause, "msg", "") or cause).strip().splitlines()[0]
        return f"{key}: {msg}" if key else msg
    if isinstance(cause, (ConfigKeyError, AttributeError, KeyError)):
        bad = _override_key(e) or getattr(cause, "full_key", "") or ""
        keys = config_keys(config_name)
        hint = suggest(bad, keys)
        return (
            f"unknown key '{bad}' in {config_name}'s config"
            + (f"; did you mean {hint}?" if hint else "")
            + f" ({_prog(config_name)} --help lists its settings)"
        )
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].endswith("raised while composing config:"):
        # a config file of the run that does not fit the schema: name the file and the key
        return f"{lines[0].split(':')[0]}: {lines[1]}"
    return text


#: Hydra's flags that take a value (the value is not an override)
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp",
                "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}  # fmt: skip


def _overrides_only(args: list[str]) -> list[str]:
    """The overrides among ``args``: flags and the values of Hydra's value flags left out;
    in a multirun (``-m``) the sweeps are left out too (help shows one composition)."""
    out, skip = [], False
    multirun = "-m" in args or "--multirun" in args
    for a in args:
        if skip:
            skip = False
            continue
        if a in _VALUE_FLAGS:
            skip = True
            continue
        if a.startswith("-") or (multirun and "," in a):
            continue
        out.append(a)
    return out


def _unparsable(args: list[str]) -> str | None:
    """The first of ``args`` that Hydra's override grammar does not read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for a in _overrides_only(args):
        try:
            parser.parse_override(a)
        except Exception:
            return a
    return None


def _typed_key(group: str, value: str, args: list[str]) -> str:
    """The key the user chose ``value`` of ``group`` at: ``llm@merge`` for
    ``llm@merge=opnai`` (a group taken at a package), else ``group``."""
    for a in args:
        key, _, v = a.partition("=")
        key = key.lstrip("+")
        if (key == group or key.startswith(f"{group}@")) and value in v.split(","):
            return key
    return group


def _about_llm(config_name: str, e: BaseException) -> str | None:
    """The message for a model override that did not compose (``llm@merge=openai``
    without ``merge=llm``, ``merge.backend=openai``, ``llm=openai``), else ``None``."""
    from .llm_keys import describe_llm_override

    key = _override_key(e)
    return describe_llm_override(config_name, key, _overrides_only(sys.argv[1:])) if key else None


def _override_key(e: BaseException) -> str | None:
    """The key of the override Hydra names in ``Could not override 'KEY'``."""
    msg = str(e)
    if msg.startswith("Could not override '"):
        return msg.split("'")[1]
    return None


def _prog(config_name: str) -> str:
    """The console script of a job (``consolidate``, ``consolidate-<job>``)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if name.startswith("consolidate"):
        return name
    return "consolidate" if config_name == "consolidate" else f"consolidate-{config_name}"


def suggest(bad: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``bad`` (``difflib`` ratio >= 0.7), or ``None``.

    ``bad`` is compared whole and by its last dotted part, so ``treshold`` finds
    ``sleep.threshold``.
    """
    known = list(known)
    hit = difflib.get_close_matches(bad, known, n=1, cutoff=0.7)
    if hit:
        return hit[0]
    last = bad.rsplit(".", 1)[-1]
    by_last: dict[str, str] = {}
    for k in known:
        by_last.setdefault(k.rsplit(".", 1)[-1], k)
    hit = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.7)
    return by_last[hit[0]] if hit else None


def _compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name, overrides=overrides or [], return_hydra_config=True)


def config_keys(config_name: str) -> list[str]:
    """Every dotted key of the job's composed default config (Hydra's own left out)."""
    cfg = _compose(config_name)
    tree = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(tree, dict)
    tree.pop("hydra", None)
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                key = f"{prefix}{k}"
                out.append(key)
                walk(v, key + ".")

    walk(tree, "")
    return out


def _groups(config_name: str, cfg: DictConfig | None = None) -> dict[str, str | None]:
    """The user-facing config groups of the job, with their selected choice."""
    cfg = cfg if cfg is not None else _compose(config_name)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices, resolve=False)
    assert isinstance(choices, dict)
    return {g: c for g, c in choices.items() if not str(g).startswith("hydra")}


def _options(group: str, config_name: str) -> list[str]:
    """The choices of ``group`` for the job: its YAML files, less those whose header says
    ``# jobs: a, b`` without the job."""
    out = []
    for p in sorted((Path(CONFIG_DIR) / group).glob("*.yaml")):
        head = [ln for ln in p.read_text().splitlines()[:5] if ln.startswith("# jobs:")]
        jobs = {j.strip() for j in head[0].removeprefix("# jobs:").split(",")} if head else None
        if jobs is None or config_name in jobs:
            out.append(p.stem)
    return out


def help_text(config_name: str, about: str, overrides: list[str] | None = None) -> str:
    """The ``--help`` page of a job: its description, its config groups with their choices
    (the selected one marked ``*``), and its settings as composed with ``overrides``."""
    cfg = _compose(config_name, overrides)
    groups = _groups(config_name, cfg)
    prog = _prog(config_name)
    lines = [about.strip().replace("``", "`"), "",
             f"Usage: {prog} [GROUP=CHOICE ...] [KEY=VALUE ...]"]  # fmt: skip
    if groups:
        lines += ["", "Config groups (* = the default or the one chosen):"]
    width = max((len(g) for g in groups), default=0)
    for g, chosen in reversed(groups.items()):  # in the order of the defaults list
        opts = [("*" if o == chosen else "") + o for o in _options(g, config_name)]
        if chosen is None:
            opts.append("*null")
        elif f"*{chosen}" not in opts:
            opts.append(f"*{chosen}")
        lines.append(f"  {g.ljust(width)}  {', '.join(opts)}")
    body = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(body, dict)
    body.pop("hydra", None)
    from ..config import JOB_SCHEMAS

    schema = JOB_SCHEMAS.get("evaluate" if config_name == "policy" else config_name)
    doc = inspect.cleandoc(schema.__doc__ or "") if schema is not None else ""
    if doc:
        lines += ["", "About its own settings:", "", doc.replace("``", "`")]
    lines += ["", "Settings (KEY=VALUE overrides any of them):", "",
              OmegaConf.to_yaml(body).rstrip(), "",
              f"`{prog} --cfg job` prints the composed config; `{prog} --hydra-help` lists "
              f"Hydra's own flags (--multirun, --cfg, --info). Configs: {CONFIG_DIR}"]  # fmt: skip
    return "\n".join(lines)

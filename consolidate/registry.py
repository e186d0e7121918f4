"""One lazy registry for every pluggable kind: similarity engines, LLM backends, external
sources and store formats.

A :class:`Registry` maps a name to ``"module:attr"`` and imports the module only when the
name is used, so importing a registry imports none of its entries' packages (triton, faiss,
vllm, psycopg, ...). An unknown name is a ``ValueError`` that lists the registered names and
suggests the closest one (``did you mean 'faiss'?``); a missing package is an
``ImportError`` that names the install command registered with the entry.

Registering your own entry is one call, e.g.
``ENGINES.register("mine", "mypkg.engine:ENGINE")``.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["Registry", "did_you_mean"]


def did_you_mean(name: str, known: list[str] | tuple[str, ...]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``known`` to ``name`` (difflib ratio at
    least 0.6), else ``""``."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class Registry(Mapping[str, str]):
    """Names of one kind of thing, each bound to ``"module:attr"``, imported on first use.

    A read-only mapping name -> target (in registration order), plus :meth:`register` and
    :meth:`load`.

    Args:
        kind: what the names are, for messages (``"similarity engine"``).
        entries: name -> ``"module:attr"``, or name -> ``("module:attr", install hint)``.
    """

    def __init__(
        self, kind: str, entries: Mapping[str, str | tuple[str, str]] | None = None
    ) -> None:
        self.kind = kind
        self._targets: dict[str, str] = {}
        self._hints: dict[str, str] = {}
        for name, entry in (entries or {}).items():
            target, hint = (entry, "") if isinstance(entry, str) else entry
            self.register(name, target, hint=hint)

    def register(self, name: str, target: str, *, hint: str = "") -> None:
        """Bind ``name`` to ``target`` (``"module:attr"``; replaces an earlier binding).

        Args:
            hint: how to install the packages the module needs (shown when its import fails).

        Raises:
            ValueError: ``target`` is not of the form ``"module:attr"``.
        """
        module, sep, attr = target.partition(":")
        if not (module and sep and attr):
            raise ValueError(f"{self.kind} {name!r}: target must be 'module:attr', got {target!r}")
        self._targets[name] = target
        self._hints[name] = hint

    def __getitem__(self, name: str) -> str:
        return self._targets[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._targets)

    def unknown(self, name: object) -> ValueError:
        """The error for a name that is not registered: the known names and the closest."""
        known = tuple(self._targets)
        return ValueError(
            f"unknown {self.kind} {name!r}; known: {', '.join(known)}"
            f"{did_you_mean(str(name), known)}"
        )

    def load(self, name: str) -> Any:
        """The object registered as ``name``, importing its module (through the import
        system on every call: ``sys.modules`` after the first, so a module replaced there is
        the one used).

        Raises:
            ValueError: ``name`` is not registered (with the closest registered name).
            ImportError: the module, or a package it needs, is missing (with the install
                hint registered for ``name``).
            AttributeError: the module has no such attribute.
        """
        if name not in self._targets:
            raise self.unknown(name)
        module, _, attr = self._targets[name].partition(":")
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            hint = self._hints.get(name)
            if not hint:
                raise
            raise ImportError(
                f"{self.kind} {name!r} needs packages that are missing ({e}); install with: {hint}"
            ) from e
        return getattr(mod, attr)

"""Registry of the similarity engines: name -> ``"module:attr"`` of an
:class:`~consolidate.similarity.types.Engine`, imported on first use.

Importing this package imports no engine (and so neither triton nor faiss):
:func:`get_engine` imports the engine's module when an engine is chosen. Registering an
engine is one entry in :data:`REGISTRY`; its module defines an ``Engine`` (the interface
that :mod:`consolidate.similarity.api` calls after its checks and segment sorting) and
imports nothing from :mod:`consolidate.similarity.api` or :mod:`consolidate.store`.
"""

from __future__ import annotations

import importlib

from ..types import Engine

__all__ = ["REGISTRY", "get_engine", "names"]

#: engine name -> ``"module:attr"`` of its :class:`~consolidate.similarity.types.Engine`
REGISTRY: dict[str, str] = {
    "torch": "consolidate.similarity.engines.torch_engine:ENGINE",
    "triton": "consolidate.similarity.engines.triton_engine:ENGINE",
    "faiss": "consolidate.similarity.engines.faiss_engine:ENGINE",
}


def names() -> tuple[str, ...]:
    """Registered engine names, in registration order."""
    return tuple(REGISTRY)


def get_engine(name: str) -> Engine:
    """The engine registered as ``name``, importing its module on first use.

    The module is looked up through the import system on every call (``sys.modules`` after
    the first), so a module replaced there is the one used.

    Raises:
        ValueError: ``name`` is not registered.
    """
    try:
        target = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; registered: {list(REGISTRY)}") from None
    module, _, attr = target.partition(":")
    engine = getattr(importlib.import_module(module), attr)
    if not isinstance(engine, Engine):
        raise TypeError(f"{target} is a {type(engine).__name__}, not an Engine")
    return engine

"""Registry of the similarity engines: name -> ``"module:attr"`` of an
:class:`~consolidate.similarity.types.Engine`, imported on first use (a
:class:`~consolidate.registry.Registry`).

Importing this package imports no engine (and so neither triton nor faiss):
:func:`get_engine` imports the engine's module when an engine is chosen. Registering an
engine is one entry in :data:`REGISTRY` (``REGISTRY.register(name, "module:attr")``); its module defines an ``Engine`` (the interface
that :mod:`consolidate.similarity.api` calls after its checks and segment sorting) and
imports nothing from :mod:`consolidate.similarity.api` or :mod:`consolidate.store`.
"""

from __future__ import annotations

from ...registry import Registry
from ..types import Engine

__all__ = ["REGISTRY", "get_engine", "names"]

#: engine name -> ``"module:attr"`` of its :class:`~consolidate.similarity.types.Engine`
REGISTRY = Registry(
    "similarity engine",
    {
        "torch": "consolidate.similarity.engines.torch_engine:ENGINE",
        "triton": "consolidate.similarity.engines.triton_engine:ENGINE",
        "faiss": "consolidate.similarity.engines.faiss_engine:ENGINE",
    },
)


def names() -> tuple[str, ...]:
    """Registered engine names, in registration order."""
    return REGISTRY.names()


def get_engine(name: str) -> Engine:
    """The engine registered as ``name``, importing its module on first use.

    The module is looked up through the import system on every call (``sys.modules`` after
    the first), so a module replaced there is the one used.

    Raises:
        ValueError: ``name`` is not registered (with the closest registered name).
        TypeError: the registered object is not an :class:`Engine`.
    """
    engine = REGISTRY.load(name)
    if not isinstance(engine, Engine):
        raise TypeError(f"{REGISTRY[name]} is a {type(engine).__name__}, not an Engine")
    return engine

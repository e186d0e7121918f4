"""``consolidate``: the nightly sleep pass over one store (Hydra job).

Examples::

    consolidate                                   # LOCOMO store, built on first run
    consolidate sleep.force=true sleep.threshold=0.85 similarity.device=cpu
    consolidate experiment=nightly store.dir=/data/stores/alice
    consolidate source=pgvector source.dsn=postgresql://... source.table=memories
"""

from __future__ import annotations

import importlib
from typing import Any

from omegaconf import DictConfig

from ..summary import format_summary  # noqa: F401  (printed below; tests import it here)
from .cli import job
from .common import user_errors

#: the names this module gives from its library (:func:`__getattr__`)
_LIBRARY = ("run_consolidate",)


def __getattr__(name: str) -> Any:
    """This job's library (``run_consolidate``), imported when first named: ``consolidate
    --help`` and a mistyped setting are answered without importing torch."""
    if name in _LIBRARY:
        return getattr(importlib.import_module("..consolidation", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@job("consolidate")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate``: :func:`run_consolidate`, then its summary
    table; a user error prints one line and exits 1
    (:func:`~consolidate.jobs.common.user_errors`)."""
    from ..consolidation import run_consolidate

    with user_errors():
        summary = run_consolidate(cfg)
    print(format_summary(summary))


if __name__ == "__main__":
    main()

"""``consolidate``: the nightly sleep pass over one store (Hydra job).

Examples::

    consolidate                                   # LOCOMO store, built on first run
    consolidate sleep.force=true sleep.threshold=0.85 similarity.device=cpu
    consolidate experiment=nightly store.dir=/data/stores/alice
    consolidate source=pgvector source.dsn=postgresql://... source.table=memories
"""

from __future__ import annotations

from omegaconf import DictConfig

from ..summary import format_summary  # noqa: F401  (printed below; tests import it here)
from .cli import job, lazy_library
from .common import user_errors

#: this job's library names, imported when first named (``--help`` imports no torch)
__getattr__ = lazy_library(__name__, "consolidate.consolidation", ("run_consolidate",))


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

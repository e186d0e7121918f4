"""``consolidate-bench``: ours against what a user would write instead, measured in the same
run (the similarity join and top-k search, the whole pass; :mod:`consolidate.bench.benchmark`).

Examples::

    consolidate-bench bench=tiny                       # seconds: a smoke test
    consolidate-bench bench.only=sim                   # cpu similarity cases, 3-4 min
    consolidate-bench bench.only=pass bench.pass_sizes=100000 bench.pass_baseline=5244916
    consolidate-bench bench=gpu bench.out=$OUT/bench   # on a CUDA machine

Writes ``results.json`` (the schema of ``consolidate-evaluate``), ``results.parquet``,
``report.md``, ``benchmark.png`` and ``meta.json`` to the run folder
(``outputs/bench/<date_time>/``, or ``bench.out``).
"""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ..config import BenchConfig
from .cli import job
from .common import typed, user_errors


@job("bench")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-bench``:
    :func:`~consolidate.bench.benchmark.run_benchmark` with the ``bench`` group's
    settings, written under ``bench.out`` (default: the run's output folder)."""
    with user_errors():
        from ..bench.benchmark import run_benchmark

        opts: BenchConfig = typed(cfg, "bench", BenchConfig)
        if opts.out is None and HydraConfig.initialized():
            opts.out = HydraConfig.get().runtime.output_dir
        run_benchmark(opts)


if __name__ == "__main__":
    main()

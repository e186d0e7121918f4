"""``consolidate-policy``: retention-policy calibration (Hydra job).

Runs every policy of ``grid`` (merge threshold, τ, floor, cap) as a variant of the
evaluation job on its task (LOCOMO by default), next to the baseline that keeps every
memory, and writes the frontier of store size (memories and stored tokens) against evidence
recall, and the recommended policy: the fewest stored tokens that keeps ``target.share`` of
the baseline's recall on every ``target.metrics`` (see :mod:`consolidate.evaluation.policy`).
Writes ``policy.json`` (accepted by ``consolidate sleep.policy_file=...``), the evaluation's
``results.json``, ``report.md`` and ``samples.jsonl``, and ``frontier.png``.
"""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from .cli import job, lazy_library
from .common import user_errors

#: this job's library names, imported when first named (``--help`` imports no torch)
__getattr__ = lazy_library(
    __name__, "consolidate.evaluation.policy", ("load_policy", "policy_verdict", "run_policy")
)


@job("policy")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-policy``: :func:`run_policy`, then the verdict
    and how to use the recommended ``policy.json``."""
    from ..evaluation.policy import policy_verdict, run_policy

    with user_errors():
        doc = run_policy(cfg)
    out = HydraConfig.get().runtime.output_dir
    print(policy_verdict(doc))
    if doc["recommended"] is not None:
        print(f"use it with: consolidate sleep.policy_file={out}/policy.json")
    print(f"results in {out}")


if __name__ == "__main__":
    main()

"""``consolidate-calibrate``: the merge threshold from labelled pairs (Hydra job).

STS-B (score >= 4 = duplicate) and SICK (mutual entailment = duplicate; contradiction pairs
reported separately as hard negatives) are embedded per embedding dtype; one sorted pass per
dataset gives the PR curve, average precision, the best-F1 threshold and the threshold at each
target precision. Writes ``calibration.json`` (accepted by ``consolidate
sleep.calibration_file=...``), ``results.json``, ``report.md`` and PNG plots.
"""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ..evaluation.calibrate import run_calibrate  # noqa: F401  (this job's library)
from .cli import job
from .common import user_errors


@job("calibrate")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-calibrate``: :func:`run_calibrate`, then one
    line per dataset and dtype (average precision, best F1 and its threshold, the
    guard's flag rates)."""
    with user_errors():
        calib = run_calibrate(cfg)
    for e in calib["entries"]:
        print(
            f"{e['dataset']:<12} {e['dtype']:<5} AP {e['average_precision']:.4f}  best F1 "
            f"{e['best_f1']:.4f} at {e['best_f1_threshold']:.4f}"
        )
        if e["guard_flags_contradictions"] is not None:
            print(
                f"{'':<18} conflict guard at {e['best_f1_threshold']:.4f}: flags "
                f"{e['guard_flags_contradictions']:.1%} of {e['contradictions_above']} "
                f"contradiction pairs, {e['guard_flags_duplicates']:.1%} of "
                f"{e['duplicates_above']} duplicate pairs"
            )
    for g in calib["guard_pairs"]:
        print(
            f"conflict guard on hand-written {g['kind']} pairs: flags {g['flagged']} of "
            f"{g['pairs']} ({g['flagged_share']:.1%}); {g['reasons'] or 'none flagged'}"
        )
    r = calib["recommended"]
    out = HydraConfig.get().runtime.output_dir
    print(
        f"recommended threshold {r['threshold']:.4f}; use it with: consolidate "
        f"sleep.calibration_file={out}/calibration.json"
    )


if __name__ == "__main__":
    main()

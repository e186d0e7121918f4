"""``consolidate-evaluate``: evidence recall before and after consolidation, with the
ablation table (Hydra job; the run itself is
:func:`consolidate.evaluation.evaluate.run_evaluate`). Tasks: ``locomo10`` (default),
``longmemeval-fixture`` (a tiny file in LongMemEval's format shipped in the package),
``longmemeval`` (any file in that format, ``longmemeval_file=...``).

One run builds the task's memory store in memory, embeds the questions once, and for
each variant (no consolidation, hash-only, the full pass at several thresholds, decay off)
runs the pass with "now" = the date of each conversation's last session, then retrieves for
every question. It answers: how much smaller can the store get before recall drops?
"""

from __future__ import annotations

import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from .cli import job, lazy_library
from .common import user_errors


def judge_line(r: dict) -> str:
    """The judge's console line for one ablation row: accuracy with its bootstrap 95%
    interval and the leniency control (share of deliberately wrong answers accepted); the
    accuracy is withheld when invalid verdicts exceed 20% or fewer than 30 questions got a
    valid verdict."""
    n, inv = int(r.get("judge_questions") or 0), float(r.get("judge_invalid_rate") or 0.0)
    len_ = r.get("judge_wrong_answer_acceptance")
    lenient = "n/a" if len_ is None or len_ != len_ else f"{len_:.0%}"
    tail = (
        f"over {n} of {int(r['answered'])} questions, invalid verdicts {inv:.0%}, "
        f"leniency control {lenient}, judge model {r.get('judge_model')}; LOCOMO F1 "
        f"{r['locomo_f1']:.3f}"
    )
    if inv > 0.2 or n < 30:
        why = f"invalid verdicts {inv:.0%} > 20%" if inv > 0.2 else f"only {n} < 30 questions"
        return f"{r['variant']}: judge accuracy withheld ({why}): {tail}"
    return (
        f"{r['variant']}: judge {r['judge']:.3f} [95% CI {r['judge_ci_low']:.3f}, "
        f"{r['judge_ci_high']:.3f}] {tail}"
    )


#: this job's library names, imported when first named (``--help`` imports no torch)
__getattr__ = lazy_library(
    __name__, "consolidate.evaluation.evaluate", ("full_context", "run_evaluate")
)


@job("evaluate")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-evaluate``: :func:`run_evaluate`, then the
    ablation table (store size, faithful recall and recall at k and at a token budget)."""
    from ..evaluation.evaluate import full_context, run_evaluate

    with user_errors():
        res = run_evaluate(cfg)
    abl = pd.DataFrame(res.tables["ablation"])
    full = {c for c, v in full_context(abl).items() if v > 0.5}
    cols = [
        "variant",
        "store_size",
        "faithful_recall@10",
        "faithful_recall@500tok",
        "recall@10",
        "recall@500tok",
        f"tokens@{cfg.tokens_at_k}",
    ]
    full |= {"faithful_" + c for c in full}
    print(abl[[c for c in cols if c in abl and c not in full]].to_string(index=False))
    print(
        "faithful_recall: evidence whose original text the retrieved memory still says "
        "(the headline); recall: provenance only (retrieval)"
    )
    if "answered" in abl:
        for r in abl[abl["answered"].notna()].to_dict("records"):
            print(judge_line(r))
    if full:
        print(f"left out of this table, full context for most questions: {sorted(full)}")
    print(f"results in {HydraConfig.get().runtime.output_dir}")


if __name__ == "__main__":
    main()

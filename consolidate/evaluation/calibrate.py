"""The calibration run of ``consolidate-calibrate``: labelled pairs embedded per dtype,
precision-recall curves, the conflict guard's rates, the recommended threshold in
``calibration.json`` (:func:`run_calibrate`)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ..config import EmbedderConfig
from ..factory import make_embedder, typed
from .results import (
    Metric,
    Results,
    TaskInfo,
    environment,
    hashes_verified,
    now_iso,
    write_results,
)
from .tasks import TASKS, load_sick, load_stsb, verify
from .thresholds import pr_curve

log = logging.getLogger("consolidate")


def _pairs(name: str, split: str | None, root: str) -> pd.DataFrame:
    if name == "stsb":
        df = load_stsb(root, split or "dev").to_pandas()
        df["contradiction"] = 0
    elif name == "sick":
        df = load_sick(root, split).to_pandas()
    else:
        raise ValueError(f"unknown pair dataset {name!r} (stsb, sick)")
    return df[["sentence1", "sentence2", "label", "contradiction"]]


def _guard_rates(
    key: str,
    df: pd.DataFrame,
    cos: np.ndarray,
    threshold: float,
    memo: dict[tuple[str, int], str | None],
) -> dict[str, Any]:
    """Flag rates of the conflict guard (:func:`consolidate.ops.guard.conflict_reason`) among the
    pairs a pass at ``threshold`` would merge: contradiction pairs (should be flagged) and
    duplicate pairs (should not), with the count of each reason among the flagged
    contradictions. One guard call per pair, shared across dtypes and thresholds through
    ``memo`` (``(dataset, pair) -> reason``)."""
    from ..ops.guard import conflict_reason

    above = np.flatnonzero(cos >= threshold)
    s1, s2 = df["sentence1"].astype(str).to_numpy(), df["sentence2"].astype(str).to_numpy()
    why = [
        memo[(key, k)]
        if (key, k) in memo
        else memo.setdefault((key, k), conflict_reason(s1[k], s2[k]))
        for k in above.tolist()
    ]
    flag = np.array([w is not None for w in why], dtype=bool)
    contra = df["contradiction"].to_numpy()[above] == 1
    dup = df["label"].to_numpy()[above] == 1
    reasons = pd.Series(
        [w for w, c in zip(why, contra.tolist(), strict=True) if c and w is not None], dtype=object
    ).value_counts()
    return {
        "contradictions_above": int(contra.sum()),
        "guard_flags_contradictions": float(flag[contra].mean()) if contra.any() else None,
        "duplicates_above": int(dup.sum()),
        "guard_flags_duplicates": float(flag[dup].mean()) if dup.any() else None,
        "guard_reasons": {str(k): int(v) for k, v in reasons.items()},
    }


def run_calibrate(cfg: DictConfig, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Calibrate on every ``cfg.datasets`` entry for every ``cfg.dtypes``; returns the
    ``calibration.json`` content (also written to ``out_dir``).

    Phases: read and verify the pair datasets; per dtype and dataset, embed, score and
    measure (:func:`_calibrate_one`: PR curve, thresholds, the conflict guard's rates, the
    histogram); the guard on the hand-written pairs; the recommended threshold
    (:func:`_recommend`); then ``calibration.json``, results and the report."""
    out = Path(out_dir or HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    root = cfg.paths.data_dir
    shas: dict[str, str] = {}
    for d in cfg.datasets:
        shas.update(verify(TASKS[d.name], root, cfg.allow_hash_mismatch))
    data = {f"{d.name}-{d.split or 'all'}": _pairs(d.name, d.split, root) for d in cfg.datasets}
    if cfg.max_pairs:  # a deterministic subset (first N pairs) for quick checks
        data = {k: v.head(int(cfg.max_pairs)) for k, v in data.items()}
    base: EmbedderConfig = typed(cfg, "embedder", EmbedderConfig)
    run = _CalibrationRun()
    guard: dict[tuple[str, int], str | None] = {}  # (dataset, pair) -> the guard's reason
    for dtype in cfg.dtypes:
        emb = make_embedder(EmbedderConfig(**{**base.__dict__, "dtype": dtype}))
        for key, df in data.items():
            _calibrate_one(run, cfg, base, emb, dtype, key, df, guard, out)
    pairs = guard_pair_rates(make_embedder(EmbedderConfig(**{**base.__dict__, "dtype": "fp32"})))
    thr = _recommend(run, cfg)
    from .plots import plot_pr

    plot_pr(run.curves, out / "pr_curves.png", run.marks)
    calib = {
        "schema_version": 1,
        "created_at": now_iso(),
        "entries": run.entries,
        "guard_pairs": pairs,
        "recommended": {
            "threshold": thr,
            "dataset": cfg.recommend.dataset,
            "dtype": cfg.recommend.dtype,
            "rule": cfg.recommend.rule,
            "precision": cfg.recommend.precision,
            "model": str(base.model_path or base.name),
        },
    }
    (out / "calibration.json").write_text(json.dumps(calib, indent=1))
    res = Results(
        job="calibrate",
        created_at=calib["created_at"],
        task=TaskInfo(
            name="+".join(d.name for d in cfg.datasets),
            version="1.0",
            files_sha256=shas,
            hash_verified=hashes_verified(
                {f: h for d in cfg.datasets for f, h in TASKS[d.name].files.items()}, shas
            ),
            main_score="average_precision",
        ),
        config=OmegaConf.to_container(cfg, resolve=False),
        **environment(str(emb.device)),
        timings_s={"total": round(time.perf_counter() - t0, 3)},
        metrics=run.metrics,
        tables={"calibration": run.entries},
    )
    write_results(out, res, run.samples, _calibration_report(res, run.entries, pairs, thr, cfg))
    return calib


@dataclass
class _CalibrationRun:
    """What :func:`run_calibrate` collects over its (dtype, dataset) entries."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[Metric] = field(default_factory=list)
    curves: dict[str, tuple] = field(default_factory=dict)
    marks: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)
    prs: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)


def _calibrate_one(
    run: _CalibrationRun,
    cfg: DictConfig,
    base: EmbedderConfig,
    emb: Any,
    dtype: str,
    key: str,
    df: pd.DataFrame,
    guard: dict[tuple[str, int], str | None],
    out: Path,
) -> None:
    """One dataset at one dtype: cosine of every pair (float64 from the embedder's vectors),
    its PR curve, thresholds at the best F1 and at each target precision, the conflict
    guard's rates there and at ``cfg.guard_thresholds``, the score histogram; added to
    ``run``."""
    cos = _pair_cosines(emb, df)
    c = pr_curve(cos, df["label"].to_numpy())
    contra = cos[df["contradiction"].to_numpy() == 1]
    e = {
        "dataset": key,
        "model": str(base.model_path or base.name),
        "dtype": dtype,
        "pairs": int(c.n),
        "duplicates": int(c.positives),
        "average_precision": c.average_precision,
        "best_f1": c.best_f1,
        "best_f1_threshold": c.best_f1_threshold,
        "threshold_at_precision": {
            str(p): c.threshold_at_precision(p) for p in cfg.target_precisions
        },
        "contradiction_pairs": int(len(contra)),
        "contradictions_above_best_f1_threshold": (
            float((contra >= c.best_f1_threshold).mean()) if len(contra) else None
        ),
        **_guard_rates(key, df, cos, c.best_f1_threshold, guard),
        "guard_at": {
            f"{t:.2f}": _guard_rates(key, df, cos, float(t), guard) for t in cfg.guard_thresholds
        },
    }
    run.samples += _samples(key, dtype, df, cos)
    run.entries.append(e)
    label = f"{key} {dtype}"
    _add_curve(run, label, c)
    lab = df["label"].to_numpy() == 1
    groups = {
        "duplicates": cos[lab],
        "non-duplicates": cos[~lab & (df["contradiction"].to_numpy() == 0)],
        "contradictions": contra,
    }
    ths = {"best F1": c.best_f1_threshold}
    tp = e["threshold_at_precision"].get(str(cfg.recommend.precision))
    if tp is not None:
        ths[f"P>={cfg.recommend.precision}"] = tp
    from .plots import plot_histograms

    plot_histograms(groups, out / f"hist_{key}_{dtype}.png", f"{label}: cosine", ths)
    log.info(
        "%s: AP %.4f, best F1 %.4f at %.4f",
        label,
        c.average_precision,
        c.best_f1,
        c.best_f1_threshold,
    )


def _samples(key: str, dtype: str, df: pd.DataFrame, cos: np.ndarray) -> list[dict[str, Any]]:
    """One ``samples.jsonl`` record per pair: dataset, dtype, sentences, labels, cosine."""
    return [
        {
            "dataset": key,
            "dtype": dtype,
            "sentence1": s1,
            "sentence2": s2,
            "label": int(lab),
            "contradiction": int(con),
            "score": float(x),
        }
        for s1, s2, lab, con, x in zip(
            df["sentence1"].astype(str),
            df["sentence2"].astype(str),
            df["label"],
            df["contradiction"],
            cos,
            strict=True,
        )
    ]


def _pair_cosines(emb: Any, df: pd.DataFrame) -> np.ndarray:
    """``float64 [len(df)]``: the cosine of each pair's ``sentence1`` and ``sentence2``, each
    distinct sentence embedded once (float64 products of the embedder's unit vectors)."""
    sents = pd.unique(pd.concat([df["sentence1"], df["sentence2"]]).astype(str))
    pos = {s: k for k, s in enumerate(sents)}
    v = emb.encode(list(sents)).astype(np.float64)
    a = v[[pos[s] for s in df["sentence1"].astype(str)]]
    b = v[[pos[s] for s in df["sentence2"].astype(str)]]
    return (a * b).sum(1)


def _add_curve(run: _CalibrationRun, label: str, c: Any) -> None:
    """The PR curve ``c`` of one dataset and dtype into ``run``: the curve, its best-F1
    mark, and the metrics average precision, best F1 and its threshold."""
    run.curves[label] = (c.recall, c.precision, c.average_precision)
    run.prs[label] = c
    best = int(np.argmax(c.f1)) if len(c.f1) else None
    if best is not None:
        run.marks[label] = [
            (
                float(c.recall[best]),
                float(c.precision[best]),
                f"best F1 at {c.best_f1_threshold:.3f}",
            )
        ]
    for name, val in (
        ("average_precision", c.average_precision),
        ("best_f1", c.best_f1),
        ("best_f1_threshold", c.best_f1_threshold),
    ):
        run.metrics.append(
            Metric(
                name=name,
                value=val,
                higher_is_better=name != "best_f1_threshold",
                variant=label,
                n=c.n,
            )
        )


def _recommend(run: _CalibrationRun, cfg: DictConfig) -> Any:
    """The threshold ``cfg.recommend`` picks (best F1, or the threshold at its precision) from
    its dataset and dtype, marked on that PR curve.

    Raises:
        ValueError: that dataset and dtype were not calibrated.
    """
    rec_entry = next(
        (
            e
            for e in run.entries
            if e["dataset"] == cfg.recommend.dataset and e["dtype"] == cfg.recommend.dtype
        ),
        None,
    )
    if rec_entry is None:
        raise ValueError(
            f"recommend.dataset={cfg.recommend.dataset!r} with dtype "
            f"{cfg.recommend.dtype!r} was not calibrated"
        )
    if cfg.recommend.rule == "best_f1":
        thr = rec_entry["best_f1_threshold"]
    else:
        thr = rec_entry["threshold_at_precision"][str(cfg.recommend.precision)]
    rec_label = f"{rec_entry['dataset']} {rec_entry['dtype']}"
    c = run.prs.get(rec_label)
    if c is not None and thr is not None:
        at = np.flatnonzero(c.thresholds >= thr)
        if len(at):
            run.marks.setdefault(rec_label, []).append(
                (
                    float(c.recall[at[-1]]),
                    float(c.precision[at[-1]]),
                    f"recommended {thr:.3f} ({cfg.recommend.rule})",
                )
            )
    return thr


def _calibration_report(
    res: Results, entries: list[dict[str, Any]], pairs: Any, thr: float, cfg: DictConfig
) -> str:
    """``report.md``: the calibration table, the guard at other thresholds and on the
    hand-written pairs, the PR curves."""
    table = pd.DataFrame(
        [
            {
                k: v
                for k, v in e.items()
                if k not in ("threshold_at_precision", "guard_at", "guard_reasons")
            }
            | {f"t@P{p}": e["threshold_at_precision"][p] for p in e["threshold_at_precision"]}
            for e in entries
        ]
    )
    return "\n".join(
        [
            "# Threshold calibration",
            "",
            f"- created {res.created_at}; git {res.git_commit}; device {res.device}",
            "- duplicate = STS-B score >= 4; SICK mutual entailment. `contradictions_above_best_"
            "f1_threshold`: share of SICK contradiction pairs a pass at that threshold would "
            "merge without the conflict guard. `guard_flags_contradictions` / `guard_flags_"
            "duplicates`: of the contradiction / duplicate pairs at or above that threshold, the "
            "share the conflict guard keeps apart (negation, number, date, opposite, value, "
            "roles; see `consolidate.ops.guard.conflict_reason`): the first should be high (target "
            ">= 0.9), the second low (target <= 0.1).",
            f"- recommended threshold: {thr:.4f} ({cfg.recommend.rule} on {cfg.recommend.dataset},"
            f" {cfg.recommend.dtype})",
            "",
            table.round(4).to_markdown(index=False),
            "",
            "## Conflict guard at other thresholds",
            "",
            "Pairs at or above each threshold; `reasons`: what flagged the contradiction pairs.",
            "",
            _guard_table(entries).to_markdown(index=False),
            "",
            "## Conflict guard on hand-written identifier and paraphrase pairs",
            "",
            "`consolidate/evaluation/guard_pairs.jsonl`: pairs that differ only in an "
            "identifier (a revision letter, a version, a code, a seat, a name: all must be "
            "flagged) and paraphrases (at most 5% may be flagged); cosine from the fp32 "
            "embedder.",
            "",
            pd.DataFrame(pairs).to_markdown(index=False),
            "",
            "![PR curves](pr_curves.png)",
            "",
        ]
    )


GUARD_PAIRS = Path(__file__).with_name("guard_pairs.jsonl")


def load_guard_pairs(path: Path = GUARD_PAIRS) -> pd.DataFrame:
    """The hand-written conflict-guard pairs: columns ``a``, ``b`` (``str``) and ``kind``
    (``"identifier"``: the two texts differ only in an identifier and must be flagged;
    ``"paraphrase"``: the same statement, must stay mergeable). Written for this project.

    Raises:
        ValueError: a line without ``a``, ``b`` or a known ``kind`` (named by line).
    """
    rows = []
    for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        d = json.loads(line)
        if not (
            isinstance(d.get("a"), str)
            and isinstance(d.get("b"), str)
            and d.get("kind") in ("identifier", "paraphrase")
        ):
            raise ValueError(
                f"{path}: line {k}: needs text a, text b and kind identifier|paraphrase"
            )
        rows.append(d)
    return pd.DataFrame(rows, columns=["a", "b", "kind"])


def guard_pair_rates(embedder: Any = None, path: Path = GUARD_PAIRS) -> list[dict[str, Any]]:
    """Per kind of :func:`load_guard_pairs`: ``pairs``, ``flagged`` (count and share the
    conflict guard, :func:`consolidate.ops.guard.conflict_reason`, keeps apart), ``reasons`` and,
    with an ``embedder`` (``encode(texts) -> float32 [n, d]``, unit rows), the mean and
    minimum cosine of the pairs and the count at or above 0.9."""
    from ..ops.guard import conflict_reason

    df = load_guard_pairs(path)
    why = [conflict_reason(a, b) for a, b in zip(df["a"], df["b"], strict=True)]
    df["reason"] = why
    if embedder is not None:
        va = np.asarray(embedder.encode(list(df["a"])), np.float64)
        vb = np.asarray(embedder.encode(list(df["b"])), np.float64)
        df["cosine"] = (va * vb).sum(1)
    out = []
    for kind, g in df.groupby("kind", sort=True):
        flagged = g["reason"].notna()
        row: dict[str, Any] = {
            "kind": kind,
            "pairs": len(g),
            "flagged": int(flagged.sum()),
            "flagged_share": float(flagged.mean()),
            "reasons": ", ".join(
                f"{r} {n}" for r, n in g["reason"].value_counts().sort_index().items()
            ),
        }
        if "cosine" in g:
            row |= {
                "cosine_mean": round(float(g["cosine"].mean()), 4),
                "cosine_min": round(float(g["cosine"].min()), 4),
                "at_or_above_0.9": int((g["cosine"] >= 0.9).sum()),
            }
        out.append(row)
    return out


def _guard_table(entries: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per dataset with contradiction pairs, dtype and threshold (the best-F1 one,
    then ``guard_thresholds``)."""
    rows = []
    for e in entries:
        if not e["contradiction_pairs"]:
            continue
        at = {f"best F1 {e['best_f1_threshold']:.4f}": e} | e["guard_at"]
        for t, g in at.items():
            rows.append(
                {
                    "dataset": e["dataset"],
                    "dtype": e["dtype"],
                    "threshold": t,
                    "contradictions": g["contradictions_above"],
                    "flagged": g["guard_flags_contradictions"],
                    "duplicates": g["duplicates_above"],
                    "flagged ": g["guard_flags_duplicates"],
                    "reasons": ", ".join(f"{k} {v}" for k, v in sorted(g["guard_reasons"].items())),
                }
            )
    return pd.DataFrame(rows).round(4)

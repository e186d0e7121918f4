"""The retention-policy search of ``consolidate-policy``: every policy of a grid as an
evaluation variant, the frontier and the recommendation in ``policy.json``
(:func:`run_policy`, :func:`load_policy`).

The policy is chosen on one half of the task's question groups (LOCOMO: conversations) and
reported on the other (:func:`policy_split`, a fixed rule recorded in ``policy.json``), so the
figure a user reads was not used to pick the policy."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from .evaluate import run_evaluate
from .frontier import frontier_mask, policy_grid, policy_name, recommend
from .results import now_iso

BASELINE = "keep-all"
CHOOSE, HELD_OUT = "choose", "held_out"


def policy_split(groups: list[str]) -> dict[str, list[str]]:
    """The fixed split of question groups: ordered by the SHA-256 of their name, the first
    ``ceil(n / 2)`` choose the policy (``"choose"``), the rest report it (``"held_out"``).
    The same groups always split the same way, whatever their order.

    Raises:
        ValueError: fewer than two groups (nothing to hold out).
    """
    if len(set(groups)) < 2:
        raise ValueError(
            f"the policy search needs at least two question groups to hold one out, got "
            f"{sorted(set(groups))}"
        )
    order = sorted(set(groups), key=lambda g: hashlib.sha256(str(g).encode()).hexdigest())
    n = (len(order) + 1) // 2
    return {CHOOSE: sorted(order[:n]), HELD_OUT: sorted(order[n:])}


def run_policy(cfg: DictConfig, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Evaluate every policy of ``cfg.grid`` and recommend one; returns the
    ``policy.json`` content (also written to ``out_dir``).

    Raises:
        ValueError: a bad grid or target.
    """
    out = Path(out_dir or HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    grid = OmegaConf.to_container(cfg.grid, resolve=True)
    if not isinstance(grid, dict) or not grid:
        raise ValueError("grid must map pass settings to lists of values")
    policies = policy_grid(grid)
    metrics, share = _target(cfg)  # checked before any policy runs
    variants = [{"name": BASELINE, "consolidate": False}] + [
        {"name": policy_name(p), "sleep": p} for p in policies
    ]
    ecfg = cfg.copy()
    with open_dict(ecfg):
        ecfg.variants = variants
    res = run_evaluate(ecfg, out, splits=policy_split)
    abl = pd.DataFrame(res.tables["ablation"]).set_index("variant")
    held = [f"{m}[{HELD_OUT}]" for m in metrics]
    chosen_on = [f"{m}[{CHOOSE}]" for m in metrics]
    # the search sees the choosing half only, under the metrics' plain names
    view = abl[["store_size", "store_tokens", "merges", "dropped", *held]].join(
        abl[chosen_on].set_axis(metrics, axis=1)
    )
    base = view.loc[BASELINE]
    cols = ["store_size", "store_tokens", "merges", "dropped", *metrics, *held]
    rows = pd.DataFrame(
        [
            {**p, "variant": policy_name(p), **view.loc[policy_name(p), cols].to_dict()}
            for p in policies
        ]
    )
    rows["frontier"] = frontier_mask(rows, "store_tokens", metrics)
    rec = recommend(rows, base, metrics, share)
    doc = _policy_doc(res, policies, rows, base, rec, metrics, share)
    (out / "policy.json").write_text(json.dumps(doc, indent=1, default=str))
    _policy_report(out, doc, rows, base, rec, metrics)
    return doc


def _target(cfg: DictConfig) -> tuple[list[str], float]:
    """``(metrics, share)`` of ``cfg.target``, checked: measured recalls, a share in (0, 1].

    Raises:
        ValueError: a metric that is not measured, or a bad share.
    """
    metrics = list(cfg.target.metrics)
    share = cfg.target.share
    measured = {f"recall@{k}" for k in cfg.ks} | {f"recall@{b}tok" for b in cfg.budgets}
    measured |= {"faithful_" + m for m in measured}
    if not metrics or set(metrics) - measured:
        raise ValueError(
            f"target.metrics must be a non-empty list of measured recalls "
            f"({', '.join(sorted(measured))}), got {metrics}"
        )
    if not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0 < share <= 1):
        raise ValueError(f"target.share must be in (0, 1], got {share!r}")
    return metrics, float(share)


def _policy_doc(
    res: Any,
    policies: list[dict[str, Any]],
    rows: pd.DataFrame,
    base: pd.Series,
    rec: Any,
    metrics: list[str],
    share: float,
) -> dict[str, Any]:
    """The ``policy.json`` document: provenance, target, split, baseline, the recommended
    policy (on the choosing half and on the held-out half) and every policy's row."""
    held = [f"{m}[{HELD_OUT}]" for m in metrics]
    split = {r["split"]: r for r in res.tables["splits"]}
    return {
        "schema_version": 1,
        "created_at": now_iso(),
        "git_commit": res.git_commit,
        "task": {
            "name": res.task.name,
            "files_sha256": res.task.files_sha256,
            "hash_verified": res.task.hash_verified,
        },
        "target": {"share": share, "metrics": metrics},
        "split": {
            "rule": "groups ordered by sha256 of their name; the first ceil(n/2) choose",
            CHOOSE: split[CHOOSE]["groups"],
            HELD_OUT: split[HELD_OUT]["groups"],
            "questions": {k: split[k]["questions"] for k in (CHOOSE, HELD_OUT)},
        },
        "baseline": {
            "store_size": int(base["store_size"]),
            "store_tokens": int(base["store_tokens"]),
            **{m: float(base[m]) for m in metrics},
            HELD_OUT: {m: float(base[h]) for m, h in zip(metrics, held, strict=True)},
        },
        "recommended": None
        if rec is None
        else {
            # the policy as the grid gave it (the table's columns are floats, NaN for null)
            "pass": next(p for p in policies if policy_name(p) == rec["variant"]),
            "store_size": int(rec["store_size"]),
            "store_tokens": int(rec["store_tokens"]),
            **{m: float(rec[m]) for m in metrics},
            "keeps": rec["keeps"],
            "tokens_vs_baseline": round(rec["store_tokens"] / max(base["store_tokens"], 1), 4),
            HELD_OUT: {
                **{m: float(rec[h]) for m, h in zip(metrics, held, strict=True)},
                "keeps": {
                    m: round(float(rec[h]) / float(base[h]), 4) if base[h] else None
                    for m, h in zip(metrics, held, strict=True)
                },
            },
        },
        "policies": rows.round(6).to_dict("records"),
    }


def _policy_report(
    out: Path,
    doc: dict[str, Any],
    rows: pd.DataFrame,
    base: pd.Series,
    rec: Any,
    metrics: list[str],
) -> None:
    """``frontier.png`` (both halves' recalls against store tokens) and the policy section
    appended to ``report.md``."""
    held = [f"{m}[{HELD_OUT}]" for m in metrics]
    chosen_on = [f"{m}[{CHOOSE}]" for m in metrics]
    both = rows.rename(columns=dict(zip(metrics, chosen_on, strict=True)))
    from .plots import plot_frontier

    plot_frontier(
        both,
        base.rename(dict(zip(metrics, chosen_on, strict=True))),
        [*chosen_on, *held],
        out / "frontier.png",
        None if rec is None else rec["variant"],
    )
    with open(out / "report.md", "a") as f:
        f.write(
            "\n".join(
                [
                    "",
                    "## Policy calibration",
                    "",
                    policy_verdict(doc),
                    "",
                    rows.round(4).to_markdown(index=False),
                    "",
                    "![frontier](frontier.png)",
                    "",
                ]
            )
        )


def policy_verdict(doc: dict[str, Any]) -> str:
    """One sentence: the recommended policy and what it costs, or that none keeps the
    target."""
    t, b, r = doc["target"], doc["baseline"], doc["recommended"]
    want = " and ".join(t["metrics"])
    if r is None:
        return (
            f"No policy of the grid keeps {t['share']:.0%} of the baseline's {want}; "
            f"widen the grid or lower target.share."
        )
    keeps = ", ".join(f"{m} {r[m]:.4f} ({v:.1%} of {b[m]:.4f})" for m, v in r["keeps"].items())
    out = (
        f"Recommended: {r['pass']}: {r['store_size']} memories and {r['store_tokens']} "
        f"stored tokens ({r['tokens_vs_baseline']:.1%} of keeping all {b['store_size']} "
        f"memories, {b['store_tokens']} tokens), keeping {keeps} on the choosing half"
    )
    h, hb = r.get(HELD_OUT), b.get(HELD_OUT)
    if not h or not hb:
        return out + "."
    held = ", ".join(
        f"{m} {h[m]:.4f} ({v:.1%} of {hb[m]:.4f})" for m, v in h["keeps"].items() if v is not None
    )
    out += f"; on the held-out half: {held}."
    over = [m for m, v in h["keeps"].items() if v is not None and v > 1.0]
    if over:
        out += (
            f" Above 1.0x on {', '.join(over)}: merged memories rank higher or fit more "
            f"evidence in the token budget; no memory says more than before, so this is "
            f"a retrieval effect, not a reason to pick the policy."
        )
    return out


def load_policy(path: str | Path) -> dict[str, Any]:
    """Read ``policy.json``'s recommendation: ``{"pass": {...}, "file", "target", "task",
    "baseline", ...}``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file holds no recommendation (no policy kept the target) or a
            setting that is not a policy key.
    """
    from .frontier import check_policy

    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable policy.json ({e})") from None
    rec = d.get("recommended") if isinstance(d, dict) else None
    if not isinstance(rec, dict) or not isinstance(rec.get("pass"), dict):
        raise ValueError(
            f"{path}: no recommended policy (no policy of its grid kept the "
            f"target, or not a policy.json)"
        )
    pol = check_policy(rec["pass"], f"{path}: recommended.pass")
    target, task = d.get("target"), d.get("task")
    keeps, ratio = rec.get("keeps"), rec.get("tokens_vs_baseline")

    def num(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x

    if not (
        isinstance(target, dict)
        and num(target.get("share"))
        and isinstance(target.get("metrics"), list)
        and isinstance(keeps, dict)
        and keeps
        and all(num(v) for v in keeps.values())
        and num(ratio)
        and isinstance(task, dict)
        and isinstance(task.get("name"), str)
    ):
        raise ValueError(
            f"{path}: incomplete policy.json (needs target.share, "
            f"target.metrics, task.name, recommended.keeps and "
            f"recommended.tokens_vs_baseline, as consolidate-policy writes)"
        )
    return {
        **rec,
        "pass": pol,
        "file": str(path),
        "target": target,
        "task": task,
        "baseline": d.get("baseline"),
    }

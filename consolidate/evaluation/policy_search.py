"""The retention-policy search of ``consolidate-policy``: every policy of a grid as an
evaluation variant, the frontier and the recommendation in ``policy.json``
(:func:`run_policy`, :func:`load_policy`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from .ablation import run_evaluate
from .plots import plot_frontier
from .policy import frontier_mask, policy_grid, policy_name, recommend
from .results import now_iso

BASELINE = "keep-all"


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
    metrics = list(cfg.target.metrics)
    share = cfg.target.share
    # the target is checked before any policy runs
    measured = {f"recall@{k}" for k in cfg.ks} | {f"recall@{b}tok" for b in cfg.budgets}
    if not metrics or set(metrics) - measured:
        raise ValueError(
            f"target.metrics must be a non-empty list of measured recalls "
            f"({', '.join(sorted(measured))}), got {metrics}"
        )
    if not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0 < share <= 1):
        raise ValueError(f"target.share must be in (0, 1], got {share!r}")
    share = float(share)
    variants = [{"name": BASELINE, "consolidate": False}] + [
        {"name": policy_name(p), "sleep": p} for p in policies
    ]
    ecfg = cfg.copy()
    with open_dict(ecfg):
        ecfg.variants = variants
    res = run_evaluate(ecfg, out)
    abl = pd.DataFrame(res.tables["ablation"]).set_index("variant")
    base = abl.loc[BASELINE]
    rows = pd.DataFrame(
        [
            {
                **p,
                "variant": policy_name(p),
                **abl.loc[
                    policy_name(p), ["store_size", "store_tokens", "merges", "dropped", *metrics]
                ].to_dict(),
            }
            for p in policies
        ]
    )
    rows["frontier"] = frontier_mask(rows, "store_tokens", metrics)
    rec = recommend(rows, base, metrics, share)
    doc = {
        "schema_version": 1,
        "created_at": now_iso(),
        "git_commit": res.git_commit,
        "task": {
            "name": res.task.name,
            "files_sha256": res.task.files_sha256,
            "hash_verified": res.task.hash_verified,
        },
        "target": {"share": share, "metrics": metrics},
        "baseline": {
            "store_size": int(base["store_size"]),
            "store_tokens": int(base["store_tokens"]),
            **{m: float(base[m]) for m in metrics},
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
        },
        "policies": rows.round(6).to_dict("records"),
    }
    (out / "policy.json").write_text(json.dumps(doc, indent=1, default=str))
    plot_frontier(
        rows, base, metrics, out / "frontier.png", None if rec is None else rec["variant"]
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
    return doc


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
    return (
        f"Recommended: {r['pass']}: {r['store_size']} memories and {r['store_tokens']} "
        f"stored tokens ({r['tokens_vs_baseline']:.1%} of keeping all {b['store_size']} "
        f"memories, {b['store_tokens']} tokens), keeping {keeps}."
    )


def load_policy(path: str | Path) -> dict[str, Any]:
    """Read ``policy.json``'s recommendation: ``{"pass": {...}, "file", "target", "task",
    "baseline", ...}``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file holds no recommendation (no policy kept the target) or a
            setting that is not a policy key.
    """
    from .policy import check_policy

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

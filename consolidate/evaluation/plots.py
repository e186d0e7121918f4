"""Matplotlib plots for evaluation and calibration reports (Agg backend, PNG files)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

__all__ = ["plot_ablation", "plot_pr", "plot_histograms", "plot_frontier"]


def plot_ablation(table: pd.DataFrame, path: str | Path, ks: list[str]) -> Path:
    """Recall per variant (grouped bars) and store size vs recall (scatter)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(table))
    w = 0.8 / max(len(ks), 1)
    for n, k in enumerate(ks):
        a.bar(x + n * w, table[k], w, label=k)
    a.set_xticks(x + 0.4 - w / 2, table["variant"], rotation=30, ha="right")
    a.set_ylabel("evidence recall")
    a.set_ylim(0, 1)
    a.legend(fontsize=8)
    a.set_title("evidence recall by variant")
    for k, m in zip(ks[-2:], ("o", "s"), strict=False):
        b.scatter(table["store_size"], table[k], marker=m, label=k)
    for _, r in table.iterrows():
        b.annotate(r["variant"], (r["store_size"], r[ks[-1]]), fontsize=7)
    b.set_xlabel("live memories after the pass")
    b.set_ylabel("evidence recall")
    b.legend(fontsize=8)
    b.set_title("store size vs recall")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_pr(curves: dict[str, tuple[np.ndarray, np.ndarray, float]], path: str | Path) -> Path:
    """Precision-recall curves: ``{label: (recall, precision, ap)}``."""
    fig, ax = plt.subplots(figsize=(6, 5))
    for label, (r, p, ap) in curves.items():
        ax.plot(r, p, label=f"{label} (AP {ap:.3f})")
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    ax.set_title("duplicate detection by cosine threshold")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_histograms(
    groups: dict[str, np.ndarray],
    path: str | Path,
    title: str,
    thresholds: dict[str, float] | None = None,
) -> Path:
    """Cosine histograms per group (duplicates, non-duplicates, contradictions)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.linspace(-0.2, 1.0, 61)
    for label, v in groups.items():
        if len(v):
            ax.hist(v, bins=bins, alpha=0.5, density=True, label=f"{label} (n={len(v)})")
    for label, t in (thresholds or {}).items():
        ax.axvline(t, ls="--", lw=1, color="k")
        ax.annotate(label, (t, ax.get_ylim()[1] * 0.9), rotation=90, fontsize=7)
    ax.set_xlabel("cosine")
    ax.set_ylabel("density")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_frontier(
    policies: pd.DataFrame,
    baseline: pd.Series,
    metrics: list[str],
    path: str | Path,
    recommended: str | None,
) -> Path:
    """One column per recall metric, two rows: each policy's store size in stored tokens
    (top) and in memories (bottom) against its recall; the frontier on tokens
    (``policies["frontier"]``) joined by a line, the baseline (keep every memory) as a star
    and the recommended policy (variant name) circled."""
    fig, axes = plt.subplots(2, len(metrics), figsize=(6 * len(metrics), 9), squeeze=False)
    for row, (size, label) in enumerate(
        (
            ("store_tokens", "stored tokens after the pass"),
            ("store_size", "memories after the pass"),
        )
    ):
        for ax, m in zip(axes[row], metrics, strict=True):
            ax.scatter(policies[size], policies[m], s=14, color="0.6", label="policy")
            f = policies[policies["frontier"]].sort_values(size)
            ax.plot(f[size], f[m], "-o", ms=4, label="frontier (on tokens)")
            ax.scatter(
                [baseline[size]], [baseline[m]], marker="*", s=160, color="k", label="keep all"
            )
            if recommended is not None:
                r = policies[policies["variant"] == recommended]
                ax.scatter(
                    r[size],
                    r[m],
                    s=160,
                    facecolors="none",
                    edgecolors="r",
                    linewidths=2,
                    label="recommended",
                )
            ax.set_xlabel(label)
            ax.set_ylabel(m)
            ax.set_title(f"{m} vs {label.split(' after')[0]}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)

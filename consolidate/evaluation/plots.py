"""Matplotlib plots for evaluation and calibration reports (Agg backend, PNG files)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

__all__ = ["plot_ablation", "plot_pr", "plot_histograms", "plot_frontier", "point_labels"]


def plot_ablation(table: pd.DataFrame, path: str | Path, ks: list[str]) -> Path:
    """Recall per variant (horizontal grouped bars, one row per variant, numbered) and store
    size against recall (scatter, each point labelled with its variant's number; arms at
    the same point share one label), legends outside the axes so that no label covers the
    data.

    Args:
        table: one row per variant with ``variant``, ``store_size`` and the ``ks`` columns.
        path: the PNG to write.
        ks: recall columns; the scatter uses the last two.
    """
    n = len(table)
    names = [f"{k + 1}. {v}" for k, v in enumerate(table["variant"])]
    h = max(4.5, 0.9 + n * (0.1 * len(ks) + 0.15)) if n <= 16 else max(4.5, 1.2 + 0.22 * n)
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, h), gridspec_kw={"width_ratios": [1.1, 1]})
    y = np.arange(n)
    w = 0.8 / max(len(ks), 1)
    # many arms (a policy grid): one row of markers each, not a block of bars
    for j, k in enumerate(ks):
        if n > 16:
            a.plot(table[k], y, "o", ms=4, label=k)
        else:
            a.barh(y - 0.4 + (j + 0.5) * w, table[k], w, label=k)
    a.set_yticks(y, names, fontsize=8)
    a.invert_yaxis()
    a.set_xlabel("evidence recall")
    a.set_xlim(0, 1)
    a.grid(axis="x", alpha=0.3)
    a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False)
    a.set_title("evidence recall by variant")
    for k, m in zip(ks[-2:], ("o", "s"), strict=False):
        b.scatter(table["store_size"], table[k], marker=m, label=k)
    groups = point_labels(table["store_size"].to_numpy(float), table[ks[-1]].to_numpy(float))
    for x, v, nums in groups:
        b.annotate(",".join(nums), (x, v), xytext=(4, 4), textcoords="offset points", fontsize=8)
    b.set_xlabel("live memories after the pass")
    b.set_ylabel("evidence recall")
    b.grid(alpha=0.3)
    b.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    b.set_title("store size vs recall (numbers: the variants on the left)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def point_labels(
    xs: np.ndarray, ys: np.ndarray, tol: float = 0.02
) -> list[tuple[float, float, list[str]]]:
    """One label per group of nearby points, so that the numbers of a scatter do not
    collide: a point within ``tol`` of the axes' spans (in x and in y) of a group's first
    point joins it. Returns ``(x, y, ["1", "3", ...])`` per group, numbered from 1 in the
    order of ``xs``; the loop runs over the plotted arms, not over records.

    Args:
        xs, ys: ``float [n]`` coordinates.
        tol: the share of each axis's span within which two points share a label.
    """
    span_x = max(float(np.ptp(xs)), 1e-12) if len(xs) else 1.0
    span_y = max(float(np.ptp(ys)), 1e-12) if len(ys) else 1.0
    groups: list[tuple[float, float, list[str]]] = []
    for k, (x, y) in enumerate(zip(xs.tolist(), ys.tolist(), strict=True)):
        for gx, gy, nums in groups:
            if abs(x - gx) / span_x < tol and abs(y - gy) / span_y < tol:
                nums.append(str(k + 1))
                break
        else:
            groups.append((x, y, [str(k + 1)]))
    return groups


def plot_pr(
    curves: dict[str, tuple[np.ndarray, np.ndarray, float]],
    path: str | Path,
    marks: dict[str, list[tuple[float, float, str]]] | None = None,
) -> Path:
    """Precision-recall curves: ``{label: (recall, precision, ap)}``; ``marks`` puts
    points on a curve, ``{label: [(recall, precision, text)]}`` (the best-F1 threshold,
    the recommended one), each with its text beside it. The legend sits outside the axes.
    """
    fig, ax = plt.subplots(figsize=(8.5, 5))
    for label, (r, p, ap) in curves.items():
        (line,) = ax.plot(r, p, label=f"{label} (AP {ap:.3f})")
        for x, v, text in (marks or {}).get(label, []):
            ax.plot([x], [v], "o", ms=6, color=line.get_color(), mec="k")
            ax.annotate(text, (x, v), xytext=(5, -10), textcoords="offset points", fontsize=7)
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title("duplicate detection by cosine threshold")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
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

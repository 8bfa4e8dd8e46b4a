"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed).

Two shapes cover every sub-command: bars with min–max whiskers (systems side by side)
and lines over a size axis (scale). Both take `report.summary` dicts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless machines, CI
import matplotlib.pyplot as plt  # noqa: E402

Stats = dict[str, Any]


def _whiskers(stats: list[Stats]) -> tuple[list[float], list[list[float]]]:
    """Medians (0 when missing) and their distances to min and max."""
    medians = [s.get("median") or 0.0 for s in stats]
    low, high = [], []
    for m, s in zip(medians, stats, strict=True):
        low.append(m - (s["min"] if s.get("min") is not None else m))
        high.append((s["max"] if s.get("max") is not None else m) - m)
    return medians, [low, high]


def bars(
    path: Path, title: str, panels: list[tuple[str, list[tuple[str, Stats]]]], unit: str
) -> Path:
    """One horizontal bar chart per panel (e.g. planned / failure): a bar per system at
    its median, whiskers to min and max; systems not measured are labelled so."""
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(8, 1.2 + 0.55 * sum(len(p[1]) for p in panels)), squeeze=False
    )
    for ax, (panel_title, items) in zip(axes[:, 0], panels, strict=True):
        labels = [
            label if stats.get("median") is not None else f"{label} (not measured)"
            for label, stats in items
        ]
        medians, err = _whiskers([s for _, s in items])
        y = list(range(len(items)))
        ax.barh(y, medians, xerr=err, capsize=3, color="tab:blue")
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_xlabel(unit)
        ax.set_title(panel_title, fontsize=10)
        for yi, m in zip(y, medians, strict=True):
            if m:
                ax.annotate(
                    f"{m:.3g}",
                    (m, yi),
                    xytext=(4, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=8,
                )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def lines(
    path: Path,
    title: str,
    xs: list[float],
    series: dict[str, list[Stats]],
    xlabel: str,
    ylabel: str,
    log: bool = False,
) -> Path:
    """One line per series over `xs`, whiskers to min and max."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, stats in series.items():
        medians, err = _whiskers(stats)
        ax.errorbar(xs, medians, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

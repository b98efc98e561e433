"""Helpers the benchmark modules share to print their report: medians with their range, and
figures (matplotlib, written as PNG next to docs/benchmarks.md)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "img"


def spread(values: Sequence[float], digits: int = 2, scale: float = 1.0) -> str:
    """``median (min-max)`` of ``values`` times ``scale``."""
    v = [x * scale for x in values]
    if not v:
        return "-"
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, name: str, caption: str, figures: Path = FIGURES) -> str:
    """Write ``fig`` as ``figures/name`` and return the markdown that shows it (relative to
    docs/ when the figure is under docs/)."""
    figures.mkdir(parents=True, exist_ok=True)
    path = figures / name
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    try:
        shown = path.relative_to(ROOT / "docs")
    except ValueError:
        shown = path
    return f"![{caption}]({shown})"

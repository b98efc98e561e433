"""A picture of a job's history: world size over time, events marked, stood-still shaded.

``efdl timeline --job-id J --out job.png``. Needs matplotlib (``pip install 'efdl[timeline]'``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from efdl.errors import ConfigError
from efdl.fleet.holdings import Holding
from efdl.history import still_intervals
from efdl.rendezvous.records import Event, EventKind, RoundStatus

# How each kind of event is marked: colour, and whether it gets a label.
_MARKS = {
    EventKind.JOIN: ("tab:green", True),
    EventKind.LEAVE: ("tab:blue", True),
    EventKind.CRASH: ("tab:red", True),
    EventKind.EVICT: ("darkred", True),
    EventKind.LEASE_LOST: ("tab:purple", True),
    EventKind.HANG: ("tab:brown", True),
    EventKind.RESTART: ("tab:orange", False),
    EventKind.RESUME: ("tab:cyan", True),
    EventKind.PERSIST: ("tab:gray", False),
    EventKind.HOLD: ("black", True),
    EventKind.RELEASE: ("tab:olive", True),
    EventKind.HEALTH: ("gold", False),
}


def world_steps(events: list[Event]) -> list[tuple[float, int]]:
    """(time, world size) from each round on: the size the job trained at (0 while it waits
    below --min or after it ended). In place, a round's size takes effect when rank 0 first
    steps at it (its rescale event: until then the others go on at the old size); in restart
    mode, at the round."""
    trained_at = {e.generation: e.time for e in events if e.kind is EventKind.RESCALE}
    steps = []
    for e in events:
        if e.round_status is None:
            continue
        active = e.round_status is RoundStatus.ACTIVE
        at = trained_at.get(e.generation, e.time) if active else e.time
        steps.append((at, e.world_size if active else 0))
    return sorted(steps)


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "efdl timeline draws with matplotlib, which is not installed: "
            "pip install 'efdl[timeline]' (or matplotlib)."
        ) from None
    return plt


def draw(events: list[Event], out: Path, title: str, now: float | None = None) -> Path:
    """Draw ``events`` to the PNG ``out``; returns it.

    Raises:
        ConfigError: matplotlib is not installed, or there is nothing to draw.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    steps = world_steps(events)
    if not steps:
        raise ConfigError(f"{title}: no rounds in its history to draw.")
    end = max(e.time for e in events) if now is None else now
    t0 = steps[0][0]
    fig: Any
    fig, ax = plt.subplots(figsize=(11, 4.2), dpi=110)
    xs = [t - t0 for t, _ in steps] + [end - t0]
    ys = [w for _, w in steps] + [steps[-1][1]]
    ax.step(xs, ys, where="post", color="black", linewidth=1.8, label="world size")
    shaded = False
    for start, stop, why in still_intervals(events, end):
        ax.axvspan(
            start - t0,
            max(stop - t0, start - t0 + 0.05),
            color="tab:red" if why == "rescale" else "tab:orange",
            alpha=0.25,
            label=None if shaded else "stood still",
        )
        shaded = True
    top = max(ys) + 1
    labelled: set[EventKind] = set()
    for e in events:
        mark = _MARKS.get(e.kind)
        if mark is None or e.time < t0:
            continue
        colour, text = mark
        ax.axvline(
            e.time - t0,
            color=colour,
            linestyle=":",
            linewidth=1,
            label=None if e.kind in labelled else e.kind.value,
        )
        labelled.add(e.kind)
        if text:
            ax.annotate(
                f"{e.node}",
                (e.time - t0, top - 0.3),
                rotation=90,
                fontsize=7,
                color=colour,
                ha="right",
                va="top",
            )
    ax.set_ylim(0, top)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"seconds since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t0))}")
    ax.set_ylabel("workers")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8, ncol=4)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def draw_fleet(
    held: Sequence[Holding],
    out: Path,
    title: str,
    marks: Sequence[tuple[float, str]] = (),
) -> Path:
    """Draw which job held which GPU when (one row per GPU, one colour per job) to the PNG
    ``out``, with ``marks`` (time, label) as vertical lines; returns it.

    Raises:
        ConfigError: matplotlib is not installed, or nothing was held.
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    if not held:
        raise ConfigError(f"{title}: no job held a GPU in its history; nothing to draw.")
    t0 = min(h.start for h in held)
    rows = sorted({(h.host, h.index) for h in held})
    first: dict[str, float] = {}
    for h in held:
        first[h.job_id] = min(first.get(h.job_id, h.start), h.start)
    jobs = sorted(first, key=first.__getitem__)
    cmap = plt.get_cmap("tab10" if len(jobs) <= 10 else "tab20")
    colour = {j: cmap(i % cmap.N) for i, j in enumerate(jobs)}
    fig: Any
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.28 * len(rows)), dpi=110)
    for h in held:
        y = rows.index((h.host, h.index))
        ax.broken_barh(
            [(h.start - t0, max(h.end - h.start, 0.05))], (y - 0.4, 0.8), color=colour[h.job_id]
        )
    for at, label in marks:
        ax.axvline(at - t0, color="black", linestyle=":", linewidth=1)
        ax.annotate(label, (at - t0, -0.5), rotation=90, fontsize=7, ha="right", va="top")
    ax.set_yticks(range(len(rows)), [f"{host}:{i}" for host, i in rows], fontsize=7)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t0))}")
    ax.set_title(title)
    handles = [Patch(color=colour[j], label=j) for j in jobs]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out

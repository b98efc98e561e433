"""Who held which GPUs when, from the fleet's events (pure: ``efdl jobs --history`` prints
it, ``efdl timeline --fleet`` draws it, the fleet benchmark measures it)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from efdl.fleet.records import FleetEvent, describe


@dataclass(frozen=True, slots=True)
class Holding:
    """One job on one GPU for one stretch of time (``end``: when it gave it up, or the
    reading's end while it still holds it)."""

    job_id: str
    host: str
    index: int
    start: float
    end: float


def holdings(events: Sequence[FleetEvent], until: float) -> list[Holding]:
    """Every stretch each job held each GPU, from ``events`` in time order."""
    held: dict[str, dict[tuple[str, int], float]] = {}
    out: list[Holding] = []
    for e in events:
        now = {(h, i) for h, ix in e.status.gpus for i in ix}
        mine = held.setdefault(e.job_id, {})
        for gpu in [g for g in mine if g not in now]:
            out.append(Holding(e.job_id, *gpu, mine.pop(gpu), e.time))
        for gpu in now - mine.keys():
            mine[gpu] = e.time
    out += [Holding(j, *g, since, until) for j, m in held.items() for g, since in m.items()]
    return sorted(out, key=lambda h: (h.host, h.index, h.start))


def format_history(events: Sequence[FleetEvent], job_id: str | None = None) -> str:
    """``efdl jobs --history``: one line per status change, oldest first."""
    lines = [f"{'TIME':19} {'JOB':24} {'PHASE':10} {'GPUS':>4}  WHERE / WHY"]
    for e in events:
        if job_id is not None and e.job_id != job_id:
            continue
        st = e.status
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time))
        where = f"{describe(st.gpus)}: {st.reason}" if st.gpus else st.reason
        lines.append(f"{when:19} {e.job_id:24} {st.phase.value:10} {st.size:>4}  {where}")
    if len(lines) == 1:
        lines.append("(no events)" if job_id is None else f"(no events of job {job_id})")
    return "\n".join(lines)

"""The allocator's decision written out (efdl.fleet.allocate): each job's new status and,
in one sentence, why."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from efdl.fleet.placement import Held
from efdl.fleet.records import Gpus, JobStatus, Phase, describe, gpu_count
from efdl.fleet.work import Allocation, Reason, Work


def phase_of(w: Work) -> Phase:
    was = w.job.status.phase
    if w.admitted or (was is Phase.RUNNING and not w.spec.cache_url):
        return Phase.RUNNING
    return Phase.SUSPENDED if was is Phase.RUNNING else was


def decision(work: list[Work], changed: dict[str, int], now: float) -> Allocation:
    gained = sorted(
        (w for w in work if changed.get(w.id, 0) > 0), key=lambda w: (-w.spec.priority, w.order)
    )
    statuses: dict[str, JobStatus] = {}
    reasons: list[Reason] = []
    for w in work:
        old, phase = w.job.status, phase_of(w)
        gpus = _gpus(w.held) if phase is Phase.RUNNING else ()
        notes = [*w.facts, *_notes(w, phase, changed.get(w.id, 0), gained)]
        text = "; ".join([*notes, w.waiting] if w.waiting else notes)
        if gpus != old.gpus or phase is not old.phase:  # (the GPUs are in the record:
            # a reason names them while they are few)
            text = text or "placed"
            if phase is Phase.RUNNING:
                size = f"{w.spec.min_workers}-{w.spec.max_workers}"
                where = describe(gpus) if len(gpus) <= 4 else f"{len(gpus)} hosts"
                text += f": {gpu_count(gpus)} of {size} workers on {where}"
            if phase is not Phase.RUNNING:
                started = 0.0
            elif old.phase is Phase.RUNNING:
                started = old.started  # (also placed again after losing every GPU)
            else:
                started = now  # started or resumed
            stopped = old.phase is Phase.RUNNING and phase is not Phase.RUNNING
            lost_all = old.phase is Phase.RUNNING and bool(old.gpus) and not w.running
            statuses[w.id] = JobStatus(
                phase,
                gpus,
                now,
                text,
                old.attained(now),
                started,
                old.held(now),
                old.suspends + int(stopped or (lost_all and phase is Phase.RUNNING)),
            )
        elif text and (same := dataclasses.replace(old, reason=text)) != old:
            statuses[w.id] = same  # the same place, a new reason (a waiting job)
        else:
            continue
        reasons.append(Reason(w.id, statuses[w.id].reason))
    return Allocation(statuses, tuple(reasons))


def _notes(w: Work, phase: Phase, delta: int, gained: list[Work]) -> list[str]:
    """What this decision did to ``w``, in words."""
    was = w.job.status.phase
    if phase is not Phase.RUNNING:
        if was is not Phase.RUNNING:
            return []
        if w.hopeless or not _for(w, gained):
            return [f"suspended: below its min of {w.spec.min_workers} and no GPUs to make it up"]
        return [f"suspended to make room for {_for(w, gained) or 'higher-priority jobs'}"]
    if was is not Phase.RUNNING:
        return ["resumed" if was is Phase.SUSPENDED else "started"]
    if delta > 0:
        return [f"grew by {gpus_word(delta)}"]
    if delta < 0:
        by = _for(w, gained)
        return [f"shrunk by {gpus_word(-delta)}" + (f" for {by}" if by else "")]
    return []


def _for(w: Work, gained: list[Work]) -> str:
    """The job of ``w``'s priority or higher that gained GPUs this decision, the highest
    priority first ("x (priority p)"), or "": whom ``w``'s loss served."""
    for v in gained:
        if v is not w and v.spec.priority >= w.spec.priority:
            return f"{v.id} (priority {v.spec.priority})"
    return ""


def _gpus(held: Held) -> Gpus:
    return tuple((h, tuple(sorted(ix))) for h, ix in sorted(held.items()) if ix)


def gpus_word(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def why_lost(lost: Iterable[str], usable: dict[str, set[int]], held: Mapping[str, str]) -> str:
    hosts = {g.split(":")[0] for g in lost}
    out = sorted(hosts & set(held))
    if out:
        return f"host {out[0]} is held out ({held[out[0]]})" + (
            f" and {len(out) - 1} more" if len(out) > 1 else ""
        )
    gone = {h for h in hosts if h not in usable}
    if gone:
        return (
            f"host {', '.join(sorted(gone))} is gone" if len(gone) == 1 else "their hosts are gone"
        )
    return "taken by a process that is not efdl's, or by a higher-priority claim"

"""The fleet's one decision: which job holds which GPUs. Pure: hosts, jobs and the clock in,
each job's status and the reasons out; no I/O (the elected loop reads etcd and writes this).

The rules, in the order they apply:

1. A GPU that a process not of efdl's holds (inference at peak), or whose host is gone, is
   nobody's: a job that held it loses it at once (that is not the allocator's choice and
   waits for nothing). A host whose record went only lately (``lingering``: its daemon may be
   restarting while its agents train on) keeps its GPUs with the jobs that hold them, and
   nothing new is placed there, for ``FleetPolicy.host_grace_s``.
2. Jobs are served by priority (higher first), then in the order they were submitted.
3. A job gets at least its ``min`` workers or nothing. What its min needs comes from free
   GPUs first; then from lower-priority jobs, shrunk in place (never below their own min),
   lowest priority first; then from equal-priority jobs' GPUs above their min; then by
   suspending whole lower-priority jobs that have a remote cache (they persist, stop, and
   resume later at whatever size is free). If all that cannot make its min, nothing is taken
   from anyone and the job waits. A running job that fell below its min and cannot get it
   back is suspended when it has a cache (its GPUs would idle), else it waits as it is.
   Mins are served again, by priority, until nothing changes: the GPUs a suspension frees
   serve every job that waits for them in the same decision (a job suspended earlier in it
   included, which then runs on), so that deciding again at once changes nothing.
4. GPUs left over go to running elastic jobs up to their ``max``: higher priority first,
   and within a priority one GPU at a time to the job that holds the fewest (fair share).
5. Placement prefers fewer hosts per job: a job grows first on hosts it is on, then on the
   host that fits what it needs most tightly, else on the hosts with the most free GPUs;
   fragments are used (one free GPU on each of two hosts makes a 2-worker job). A shrink
   gives back GPUs on the hosts where the job has the fewest.
6. No thrashing: the allocator changes a running job's GPUs at most once per
   ``resize_interval_s``, except to give it back its min. Everything one decision changes is
   one resize per job (its agents rebuild once).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from efdl.fleet.records import (
    Gpus,
    Host,
    JobSpec,
    JobStatus,
    Phase,
    describe,
    gpu_count,
)

# A job's GPUs while deciding: host id -> GPU indices.
Held = dict[str, set[int]]


@dataclass(frozen=True, slots=True)
class FleetPolicy:
    """The allocator's settings.

    Attributes:
        resize_interval_s: the least time between two of the allocator's changes to a running
            job's GPUs (a job that lost GPUs gets its min back at once).
        host_grace_s: how long a host whose record went keeps its GPUs with its jobs (its
            daemon restarting, or away from etcd, while its agents train on).
        history_s: how long the fleet's events are kept (the leader deletes older ones,
            hourly: efdl.fleet.registry.prune_events); decisions do not read them.
    """

    resize_interval_s: float = 60.0
    host_grace_s: float = 60.0
    history_s: float = 7 * 86400.0


@dataclass(frozen=True, slots=True)
class Job:
    """A job as the allocator sees it: what was asked (spec) and where it stands (status)."""

    spec: JobSpec
    status: JobStatus


@dataclass(frozen=True, slots=True)
class Reason:
    """Why one job's status changed: one sentence, recorded as a fleet event."""

    job_id: str
    text: str


@dataclass(frozen=True, slots=True)
class Allocation:
    """Each job's new status (only the jobs whose status changed) and why."""

    statuses: dict[str, JobStatus]
    reasons: tuple[Reason, ...]


@dataclass(slots=True)
class _Work:
    """One job while deciding."""

    job: Job
    held: Held = field(default_factory=dict)
    phase: Phase = Phase.QUEUED
    facts: list[str] = field(default_factory=list)  # what befell it (rule 1), not a choice
    notes: list[str] = field(default_factory=list)  # what this decision did to it
    frozen: bool = False  # resized less than the interval ago: the allocator leaves it be
    waiting: str = ""  # why it lacks its min, if it does

    @property
    def id(self) -> str:
        return self.job.spec.job_id

    @property
    def spec(self) -> JobSpec:
        return self.job.spec

    @property
    def size(self) -> int:
        return sum(len(ix) for ix in self.held.values())

    @property
    def excess(self) -> int:
        """GPUs above its min (what a shrink may take)."""
        return max(0, self.size - self.spec.min_workers)


def allocate(
    hosts: Sequence[Host],
    jobs: Sequence[Job],
    now: float,
    policy: FleetPolicy = FleetPolicy(),
    lingering: Iterable[str] = (),
) -> Allocation:
    """Decide every unfinished job's GPUs (the rules in this module's docstring).
    ``lingering``: hosts whose record went less than ``policy.host_grace_s`` ago."""
    usable = {h.host_id: set(h.usable()) for h in hosts}
    staying = set(lingering) - set(usable)
    work = [
        _Work(j, phase=j.status.phase)
        for j in sorted(jobs, key=lambda j: (-j.spec.priority, j.spec.submitted, j.spec.job_id))
        if not j.status.phase.final
    ]
    free = {h: set(ix) for h, ix in usable.items()}
    for w in work:  # rule 1: what each running job still holds (the first claim wins)
        if w.phase is not Phase.RUNNING:
            continue
        lost: list[str] = []
        for host, indices in w.job.status.gpus:
            if host in staying:  # kept, and placed nowhere else: the host is not usable
                w.held.setdefault(host, set()).update(indices)
                continue
            for i in indices:
                if i in free.get(host, ()):
                    free[host].discard(i)
                    w.held.setdefault(host, set()).add(i)
                else:
                    lost.append(f"{host}:{i}")
        if lost:
            named = " ".join(lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
            w.facts.append(f"lost {_gpus_word(len(lost))} ({named}: {_why_lost(lost, usable)})")
        if w.size > w.spec.max_workers:  # a record from before a change of its spec
            _give_back(w, free, w.size - w.spec.max_workers)
            w.facts.append(f"shrunk to its max of {w.spec.max_workers}")
        w.frozen = now - w.job.status.changed < policy.resize_interval_s
    for _ in range(3 * len(work) + 3):  # rules 2-3: each job's min, by priority, again
        # while a pass changed something (a suspension's GPUs may make another's min). Each
        # pass that changes something moves GPUs to a job of higher priority or starts one;
        # the bound only guards against a mistake in that argument.
        if not any([_serve_min(w, work, free) for w in work]):
            break
    _grow(work, free)  # rule 4
    return _decision(work, now)


def _serve_min(w: _Work, work: list[_Work], free: Held) -> bool:
    """Give ``w`` its min if it lacks it (rule 3); True if that freed GPUs for others."""
    need = w.spec.min_workers - w.size
    if need <= 0:
        return False
    short = need - _count(free)
    plan, found = _reclaim_plan(w, work, short)
    if found < short:
        if w.phase is Phase.RUNNING and w.spec.cache_url:
            _stop(
                w,
                free,
                f"suspended: below its min of {w.spec.min_workers} and no GPUs to make it up",
            )
            return True
        if w.phase is Phase.RUNNING:
            w.waiting = (
                f"runs below its min of {w.spec.min_workers} (no cache to suspend to); "
                "waits for GPUs"
            )
        else:
            w.waiting = (
                f"waits: its min of {w.spec.min_workers} needs {_gpus_word(need)}; at most "
                f"{_count(free) + found} could be freed for it"
            )
        return False
    w.waiting = ""
    for victim, take in plan:
        if take >= victim.size:
            _stop(victim, free, f"suspended to make room for {w.id} (priority {w.spec.priority})")
        else:
            _give_back(victim, free, take)
            victim.notes.append(
                f"shrunk by {_gpus_word(take)} for {w.id} (priority {w.spec.priority})"
            )
    _place(w, free, need)
    if w.phase is not Phase.RUNNING:
        was = w.job.status.phase
        if was is Phase.RUNNING:  # suspended earlier in this decision: it never stops
            w.notes = [f"kept at its min of {w.spec.min_workers} on GPUs freed meanwhile"]
        else:
            w.notes.append("resumed" if was is Phase.SUSPENDED else "started")
        w.phase = Phase.RUNNING
    return _count(free) > 0


def _stop(w: _Work, free: Held, why: str) -> None:
    """Take all of ``w``'s GPUs. A job that ran before this decision is suspended; one that
    started in it goes back to where it was (queued or suspended), as if it never started."""
    _give_back(w, free, w.size)
    was = w.job.status.phase
    if was is Phase.RUNNING:
        w.phase = Phase.SUSPENDED
        w.notes = [why]
    else:
        w.phase = was
        w.notes = []


def _reclaim_plan(w: _Work, work: list[_Work], short: int) -> tuple[list[tuple[_Work, int]], int]:
    """What to take from whom so that ``short`` more GPUs are free for ``w``'s min, and how
    many it found (fewer than ``short``: it cannot be done)."""
    plan: dict[str, tuple[_Work, int]] = {}
    found = 0
    if short <= 0:
        return [], 0
    others = [
        v for v in work if v is not w and v.phase is Phase.RUNNING and v.size and not v.frozen
    ]
    lowest_first = sorted(others, key=lambda v: (v.spec.priority, -v.spec.submitted, v.id))
    shrinks = [v for v in lowest_first if v.spec.priority < w.spec.priority]
    shrinks += [v for v in lowest_first if v.spec.priority == w.spec.priority]
    for v in shrinks:  # shrink in place, never below their min
        take = min(v.excess, short - found)
        if take:
            plan[v.id] = (v, take)
            found += take
        if found >= short:
            return list(plan.values()), found
    for v in lowest_first:  # then suspend whole lower-priority jobs that can resume
        if v.spec.priority >= w.spec.priority or not v.spec.cache_url:
            continue
        found += v.size - plan.get(v.id, (v, 0))[1]
        plan[v.id] = (v, v.size)
        if found >= short:
            break
    return list(plan.values()), found


def _grow(work: list[_Work], free: Held) -> None:
    """Rule 4: the free GPUs to running elastic jobs up to their max, by priority, then one
    at a time to the one holding the fewest."""
    grown: dict[str, int] = {}
    while _count(free):
        wanting = [
            w
            for w in work
            if w.phase is Phase.RUNNING and w.size < w.spec.max_workers and not w.frozen
        ]
        if not wanting:
            break
        top = max(w.spec.priority for w in wanting)
        w = min((w for w in wanting if w.spec.priority == top), key=lambda w: w.size)
        grown[w.id] = grown.get(w.id, 0) + 1
        _place(w, free, 1)
    for w in work:
        if w.id in grown and w.job.status.phase is Phase.RUNNING:  # else it started now
            w.notes.append(f"grew by {_gpus_word(grown[w.id])} onto free GPUs")


# ---------------------------------------------------------------- placement


def _place(w: _Work, free: Held, n: int) -> None:
    """Give ``w`` ``n`` free GPUs: on its own hosts first (most free first), then on the
    host that fits the rest most tightly, else on the hosts with the most free."""
    while n > 0:
        own = [h for h in w.held if free.get(h)]
        if own:
            host = min(own, key=lambda h: (-len(free[h]), h))
        else:
            fits = [h for h in free if len(free[h]) >= n]
            if fits:
                host = min(fits, key=lambda h: (len(free[h]), h))
            else:
                host = min((h for h in free if free[h]), key=lambda h: (-len(free[h]), h))
        chosen = sorted(free[host])[:n]
        free[host].difference_update(chosen)
        w.held.setdefault(host, set()).update(chosen)
        n -= len(chosen)


def _give_back(w: _Work, free: Held, n: int) -> None:
    """Take ``n`` GPUs from ``w``, from the hosts where it has the fewest (highest indices
    first), back to ``free``."""
    while n > 0 and w.held:
        host = min(w.held, key=lambda h: (len(w.held[h]), h))
        for i in sorted(w.held[host], reverse=True)[:n]:
            w.held[host].discard(i)
            free.setdefault(host, set()).add(i)
            n -= 1
        if not w.held[host]:
            del w.held[host]


def _count(held: Held) -> int:
    return sum(len(ix) for ix in held.values())


# ---------------------------------------------------------------- the result


def _decision(work: list[_Work], now: float) -> Allocation:
    statuses: dict[str, JobStatus] = {}
    reasons: list[Reason] = []
    for w in work:
        old = w.job.status
        gpus = _gpus(w.held) if w.phase is Phase.RUNNING else ()
        notes = [*w.facts, *w.notes]
        text = "; ".join([*notes, w.waiting] if w.waiting else notes)
        if gpus != old.gpus or w.phase is not old.phase:  # (the GPUs are in the record:
            # a reason names them while they are few)
            text = text or "placed"
            if w.phase is Phase.RUNNING:
                size = f"{w.spec.min_workers}-{w.spec.max_workers}"
                where = describe(gpus) if len(gpus) <= 4 else f"{len(gpus)} hosts"
                text += f": {gpu_count(gpus)} of {size} workers on {where}"
            statuses[w.id] = JobStatus(w.phase, gpus, now, text)
        elif text and (same := JobStatus(old.phase, old.gpus, old.changed, text)) != old:
            statuses[w.id] = same  # the same place, a new reason (a waiting job)
        else:
            continue
        reasons.append(Reason(w.id, statuses[w.id].reason))
    return Allocation(statuses, tuple(reasons))


def _gpus(held: Held) -> Gpus:
    return tuple((h, tuple(sorted(ix))) for h, ix in sorted(held.items()) if ix)


def _gpus_word(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _why_lost(lost: Iterable[str], usable: dict[str, set[int]]) -> str:
    gone = {g.split(":")[0] for g in lost if g.split(":")[0] not in usable}
    if gone:
        return (
            f"host {', '.join(sorted(gone))} is gone" if len(gone) == 1 else "their hosts are gone"
        )
    return "taken by a process that is not efdl's, or by a higher-priority claim"

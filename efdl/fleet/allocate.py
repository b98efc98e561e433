"""The fleet's one decision: which job holds which GPUs. Pure: hosts, jobs and the clock in,
each job's status and the reasons out; no I/O (the elected loop reads etcd and writes this).

A decision counts first (how many GPUs each job gets) and places second (which GPUs), so
that every rule below is applied to the whole fleet at once, in one pass (again if it
suspended a job: what that job held is for the claims before it too), and deciding
again at once changes nothing (a fixed point). A job's status carries what the rules read
of its past (efdl.fleet.records.JobStatus): GPU-seconds and seconds held, the last start,
the suspensions; the allocator keeps them in the statuses it writes.

The rules, in the order they apply:

1. A GPU that a process not of efdl's holds (inference at peak), or whose host is gone, is
   nobody's: a job that held it loses it at once (that is not the allocator's choice and
   waits for nothing). A host whose record went only lately (``lingering``: its daemon may be
   restarting while its agents train on) keeps its GPUs with the jobs that hold them, and
   nothing new is placed there, for ``FleetPolicy.host_grace_s``.
2. What the allocator may not take: a job resized less than ``resize_interval_s`` ago and
   holding at least its min keeps what it holds (it is *frozen*); a running job without a
   remote cache keeps its min (it cannot be suspended: its state lives only in its workers).
   A frozen job below its min is not protected: in its turn it gets its min back, or is
   suspended.
3. Whose min is admitted, in one pass over the claims (a job's min, then its growth up to its
   max), in this order: the jobs that waited past ``max_wait_s`` (starved); then the
   smallest job first (by max: most jobs are small and short, and serving them first
   shortens the mean completion time), within a size the least attained service first (the
   GPU-seconds a job has held, in levels at ``levels_gpu_s``, so that a job moves down
   rarely), running jobs before waiting ones, then by priority, then the serving order
   (running: the largest min first; waiting: the oldest first). So a job grows to its max
   before the next of its size and level starts (not everyone slow at once under load), and
   a job served earlier takes what a later one holds above its min (it shrinks, never
   suspended for that). The running jobs' mins (a job recorded running that lost every GPU
   included: it is placed again, not suspended) are claimed last and kept against every
   claim before them, with one exception: a waiting job that waited ``preempt_after_s``
   (600 s: a job is not suspended for one that might find room in minutes) may take the min
   of a running job of lower priority, or of its own priority and a higher level, that is
   not *protected*; such a job is suspended (it has a cache). Protected: started or resumed
   less than ``protect_s`` ago, or one more suspension would take it past
   ``suspends_per_h`` per hour it held GPUs (the first is free). The running jobs' mins go
   in this order: those past their budget (and those without a cache), then the protected,
   then the others, each by priority, then the least attained service first; when they do
   not all fit (inference took GPUs), the last are suspended: a job within its budget
   before a protected one, then the lowest priority, most attained service, smallest
   first. A starved job may take any unprotected min of its
   priority or lower, and while it waits (its min could fit the fleet) no waiting job of
   its priority or lower starts. If a waiting job's min cannot be met, nothing is taken
   from anyone and it waits (its status says how many GPUs could be freed for it). A job
   suspended less than ``resume_after_s`` ago stays suspended, twice as long for each
   suspension beyond its budget. With ``priority_first``, every claim of a higher priority
   goes first (its growth before a lower job's start): strict priority, at a cost in mean
   completion time (docs/benchmarks.md).
4. The sizes: every admitted min, then growth up to each job's max in the same order.
5. Placement prefers fewer hosts per job, away from inference: a job that shrinks gives
   back GPUs on the hosts where it has the fewest; a job that grows takes all it needs at
   once, first on hosts it is on, then on the host that fits the rest most tightly among
   those where no process of inference runs (inference grows on its hosts first), then among
   the others, else on the hosts with the most free GPUs; fragments are used (one free GPU
   on each of two hosts makes a 2-worker job).
6. No thrashing: the allocator changes a running job's GPUs at most once per
   ``resize_interval_s``, except to give it back its min (rule 2). Everything one decision
   changes is one resize per job (its agents rebuild once).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from efdl.fleet.claims import Grown, Pending
from efdl.fleet.outcome import decision, gpus_word, phase_of, why_lost
from efdl.fleet.placement import FreeIndex, Held, count, give_back, take
from efdl.fleet.policy import FleetPolicy
from efdl.fleet.records import (
    Host,
    JobStatus,
    Phase,
)
from efdl.fleet.work import Allocation, Job, Reason, Work

__all__ = ["Allocation", "Job", "Reason", "allocate"]


def allocate(
    hosts: Sequence[Host],
    jobs: Sequence[Job],
    now: float,
    policy: FleetPolicy = FleetPolicy(),
    lingering: Iterable[str] = (),
    held: Mapping[str, str] = MappingProxyType({}),
) -> Allocation:
    """Decide every unfinished job's GPUs (the rules in this module's docstring).
    ``lingering``: hosts whose record went less than ``policy.host_grace_s`` ago; ``held``:
    hosts held out of the fleet (drained, quarantined: efdl.rendezvous.holds), each with why,
    whose GPUs go to no job (its jobs lose them, as to a foreign process: in place)."""
    usable = {h.host_id: set() if h.host_id in held else set(h.usable()) for h in hosts}
    staying = set(lingering) - set(usable)
    work = [
        Work(_stamped_by(j, now, policy))
        for j in sorted(jobs, key=lambda j: (-j.spec.priority, j.spec.submitted, j.spec.job_id))
        if not j.status.phase.final
    ]
    free = {h: set(ix) for h, ix in usable.items()}
    kept: set[tuple[str, int]] = set()
    for w in work:  # rule 1 (the first claim, by priority, wins)
        if w.job.status.phase is Phase.RUNNING:
            _still_held(w, free, usable, staying, kept, held)
        w.running = w.size > 0
        w.incumbent = w.job.status.phase is Phase.RUNNING
        w.frozen = w.running and now - w.job.status.changed < policy.resize_interval_s
    for w in work:
        w.level = bisect.bisect_right(policy.levels_gpu_s, w.job.status.attained(now))
    work.sort(key=lambda w: _serving_key(w, now, policy))
    for n, w in enumerate(work):
        w.order = n
    pool = count(free) + sum(w.movable for w in work)  # what the allocator may move
    _admit(work, pool, now, policy)  # rules 2-4
    shared = {h.host_id for h in hosts if any(g.foreign for g in h.gpus)}
    changed = _place(work, free, staying, shared)  # rule 5
    return decision(work, changed, now)


def _stamped_by(job: Job, now: float, policy: FleetPolicy) -> Job:
    """``job`` with its status's times at most one resize interval before ``now``: a leader
    whose clock ran ahead stamped them in the future, and read as they are they would freeze
    and protect the job for as long as the skew (an hour's skew, an hour of no resize). So
    such a stamp counts as a change the interval ago: the job may be resized at once, once."""
    st, last = job.status, now - policy.resize_interval_s
    if st.changed <= now and st.started <= now:
        return job
    return Job(
        job.spec,
        dataclasses.replace(st, changed=min(st.changed, last), started=min(st.started, last)),
    )


def _serving_key(w: Work, now: float, policy: FleetPolicy) -> tuple[object, ...]:
    """Rule 3's order, by priority: running jobs first (those started less than
    ``protect_s`` ago, then by level of attained service, the least first; the largest min
    first), then waiting jobs (those that waited past ``max_wait_s``, then by level, the
    smallest max first, then the oldest). Nothing in it changes by the decision itself (a
    fixed point)."""
    spec = w.spec
    p = -spec.priority
    if w.running:
        protected = _protected(w, now, policy)
        level = 0 if protected else w.level
        return (p, 0, 0 if protected else 1, level, -spec.min_workers, spec.submitted,
                spec.job_id)  # fmt: skip
    band = 0 if _starved(w, now, policy) else 1
    return (p, 1, band, w.level, spec.max_workers, spec.submitted, spec.job_id)


def _protected(w: Work, now: float, policy: FleetPolicy) -> bool:
    """A running job that no waiting job may take the min of (it is suspended only for want
    of GPUs): started or resumed less than ``protect_s`` ago, or one more suspension would
    take it past ``suspends_per_h`` per hour it held GPUs (the first is free)."""
    st = w.job.status
    return now - st.started < policy.protect_s or _over_budget(st, now, policy)


def _over_budget(st: JobStatus, now: float, policy: FleetPolicy) -> bool:
    """One more suspension would take it past ``suspends_per_h`` per hour it held GPUs."""
    return st.suspends + 1 > max(1.0, policy.suspends_per_h * st.held(now) / 3600.0)


def _urgent(w: Work, now: float, policy: FleetPolicy) -> bool:
    """A waiting job that may take lower-priority jobs' mins: it waited ``preempt_after_s``
    (since it was submitted, or suspended), or it is recorded running (it lost its GPUs)."""
    st = w.job.status
    if st.phase is Phase.QUEUED:
        return now - w.spec.submitted >= policy.preempt_after_s
    return st.phase is Phase.RUNNING or now - st.changed >= policy.preempt_after_s


def _still_held(
    w: Work,
    free: Held,
    usable: dict[str, set[int]],
    staying: set[str],
    kept: set[tuple[str, int]],
    held: Mapping[str, str],
) -> None:
    """Rule 1: what a running job still holds (``free`` and ``kept``: what no job before it
    claimed, on usable and on lingering hosts; ``held``: the hosts held out, and why)."""
    lost: list[str] = []
    for host, indices in w.job.status.gpus:
        for i in indices:
            if host in staying and (host, i) not in kept:  # kept, placed nowhere else
                kept.add((host, i))
                w.held.setdefault(host, set()).add(i)
                w.kept += 1
            elif i in free.get(host, ()):
                free[host].discard(i)
                w.held.setdefault(host, set()).add(i)
            else:
                lost.append(f"{host}:{i}")
    if lost:
        named = " ".join(lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
        w.facts.append(f"lost {gpus_word(len(lost))} ({named}: {why_lost(lost, usable, held)})")
    if w.size > w.spec.max_workers:  # a record from before a change of its spec
        before = w.size
        give_back(w.held, free, w.size - w.spec.max_workers, staying)
        if w.size < before:
            w.facts.append(f"shrunk by {gpus_word(before - w.size)} toward its max")


# ---------------------------------------------------------------- rules 2-3: mins


_MIN, _GROW = 0, 1


Claim = tuple[tuple[object, ...], int, "Work"]  # (its place in the order, _MIN or _GROW, job)


def _claims(work: list[Work], now: float, policy: FleetPolicy) -> list[Claim]:
    """Every claim in the order served: the jobs that waited past ``max_wait_s`` first (min,
    then growth), then in :func:`_rank` order, each job's min then its growth (the first
    served grows to its max before the next starts). Then the running jobs' mins in
    :func:`_kept_key` order (the last are the first suspended)."""
    keyed: list[Claim] = []
    for w in work:
        if w.incumbent:
            keyed.append(((2, *_kept_key(w, now, policy)), _MIN, w))
            keyed.append(((1, *_rank(w, 0, w.level, policy), _GROW), _GROW, w))
        else:
            for kind in (_MIN, _GROW):
                keyed.append((_waiting_key(w, kind, now, policy), kind, w))
    keyed.sort(key=lambda x: x[0])
    return keyed


def _waiting_key(w: Work, kind: int, now: float, policy: FleetPolicy) -> tuple[object, ...]:
    """The place of a waiting job's claim (a running one's min, were it waiting)."""
    band = 0 if _starved(w, now, policy) else 1
    return (band, *_rank(w, 1, 0 if band == 0 else w.level, policy), kind)


def _rank(w: Work, waiting: int, level: int, policy: FleetPolicy) -> tuple[int, ...]:
    """A claim's place (after the starved jobs'): the smallest job (by max) first, then by
    level of attained service (the least first), running jobs before waiting ones, then by
    priority and serving order; with ``priority_first``, by priority first, then level,
    then size."""
    p, size = -w.spec.priority, w.spec.max_workers
    if policy.priority_first:
        return (p, level, waiting, size, w.order)
    return (size, level, waiting, p, w.order)


def _kept_key(w: Work, now: float, policy: FleetPolicy) -> tuple[int, int, int, int]:
    """The order of the running jobs' mins (when they do not all fit, the last are
    suspended): first those no waiting job may take, those without a cache that still hold
    GPUs (their state lives in their workers) or past their suspension budget, then those
    started less than ``protect_s`` ago (or in this decision); then the others; each by
    priority, then by level (the most attained service last), the largest min first (the
    smallest are suspended first: fewer GPUs restart)."""
    st = w.job.status
    if w.seated:
        kept = 1  # (it starts now: protected)
    elif (not w.spec.cache_url and w.running) or _over_budget(st, now, policy):
        kept = 0  # (one without a cache that lost every GPU has no state left to keep)
    else:
        kept = 1 if now - st.started < policy.protect_s else 2
    return (kept, -w.spec.priority, w.level, w.order)


def _admit(work: list[Work], pool: int, now: float, policy: FleetPolicy) -> None:
    """Rules 2-4: whose min is admitted and each job's size. Only what can never be
    suspended is reserved ahead (a frozen job at its min or above, the min of a job without
    a cache), so no job's turn depends on a job after it; a frozen job below its min
    competes for it in its turn like any other. One pass over the claims in serving order
    (:func:`_claims`) decides whose min is admitted: a running job's min is kept for it
    against every claim before it but those of waiting jobs that waited ``preempt_after_s``
    and go before it (efdl.fleet.claims.Pending), and only if it is not protected; no job
    grows into a running job's min. Then the sizes: the admitted mins, and growth in the
    same order."""
    for w in work:
        if not w.running:
            w.floor = 0
        elif w.frozen and (w.movable >= w.low or not w.spec.cache_url):
            w.floor = w.movable
        elif not w.spec.cache_url:
            w.floor = min(w.movable, w.low)
        else:
            w.floor = 0
    reserved = sum(w.floor for w in work)
    # A running job whose min is not admitted is suspended, and frees all it held: a claim
    # before it that could not be met might be now. So the pass runs again as the next
    # decision would see it: those jobs suspended, the jobs it started running (their mins
    # kept, protected), until no other job is suspended (each pass suspends and starts
    # more, or is the last: a decision is a fixed point; nearly always one pass).
    stopped: set[str] = set()
    while True:
        claims = _claims(work, now, policy)
        _admit_pass(work, claims, pool, reserved, stopped, now, policy)
        more = {w.id for w in work if w.incumbent and not w.admitted and w.spec.cache_url}
        if not more - stopped:
            break
        stopped |= more
        for w in work:
            if w.admitted and not w.incumbent:
                w.incumbent = w.seated = True
    # the sizes: every admitted min, then growth in serving order
    for w in work:
        w.target = w.base if w.admitted else w.floor
    left = pool - sum(w.target for w in work)
    for _, kind, w in claims:
        if kind == _GROW and _grows(w) and left > 0:
            step = min(w.high - w.target, left)
            w.target += step
            left -= step


def _admit_pass(
    work: list[Work],
    claims: list[Claim],
    pool: int,
    reserved: int,
    stopped: set[str],
    now: float,
    policy: FleetPolicy,
) -> None:
    """One pass over the claims (:func:`_admit`); the jobs in ``stopped`` are suspended."""
    left = pool - reserved
    for w in work:
        w.admitted, w.waiting = False, ""
    # the running jobs' mins that could be kept (in their order, were nothing else served):
    # kept ahead; one that could not be is in no one's way
    kept: list[tuple[tuple[int, int, int, int], int]] = []
    sure: set[str] = set()  # (their mins kept, or in their floors: they grow on top)
    room = left
    for key, need, w in sorted(
        ((_kept_key(w, now, policy), w.base - w.floor, w) for w in work if w.incumbent),
        key=lambda x: x[0],
    ):
        if w.id not in stopped and need <= room:
            kept.append((key, need))
            sure.add(w.id)
            room -= need
    pending = Pending(kept)
    grown = Grown()
    held_back = pending.total  # what the claims before the running mins leave them
    blocked_below: int | None = None  # a starved job's priority: nobody of it or lower
    for w in work:  # (a running job grows on top of its min, kept for it until its claim)
        w.target = w.base if w.id in sure else w.floor
    for place, kind, w in claims:
        if w.id in stopped:
            w.target = w.floor
            w.waiting = ""
            continue
        if kind == _GROW:
            if _grows(w) or (w.id in sure and not w.frozen and w.target < w.high):
                step = min(w.high - w.target, left - held_back)
                if step > 0:
                    w.target += step
                    left -= step
                    grown.add(w, step, place)
            continue
        need = w.base - w.floor
        w.hopeless = need > pool - reserved
        opens: int | None = (
            None  # the level up to which it may take others' (see efdl.fleet.claims.Grown)
        )
        if w.incumbent:
            held_back = 0
            avail = left
            if (
                need > avail and w.spec.cache_url
            ):  # rather than suspended: see efdl.fleet.claims.Grown
                mine = _waiting_key(w, _MIN, now, policy)
                if need <= avail + grown.after(mine):
                    left += grown.take_after(mine, need - avail)
                    avail = left
        else:
            avail = left - held_back
            if _starved(w, now, policy):  # it may take the min of any job not protected,
                opens = -1  # of its priority or lower
            elif _urgent(w, now, policy):
                opens = w.level
            if opens is not None:
                avail += pending.open_to(w.spec.priority, opens)
                avail += grown.open_to(w.spec.priority, opens)
        blocked = not w.incumbent and blocked_below is not None and w.spec.priority <= blocked_below
        if need <= avail and not blocked and _may_start(w, now, policy):
            w.admitted = True
            if opens is not None and need > left - held_back:  # growth back before mins
                left += grown.take(w.spec.priority, opens, need - (left - held_back))
            left -= need
        elif w.running and not w.spec.cache_url:
            w.waiting = (
                f"runs below its min of {w.spec.min_workers} (no cache to suspend to); "
                "waits for GPUs"
            )
        elif not w.running:
            w.waiting = _why_waiting(w, need, avail, blocked, now, policy)
            if _starved(w, now, policy) and w.low <= pool and blocked_below is None:
                blocked_below = w.spec.priority  # (one whose min could fit; waiting jobs of
                # lower priority come later)
        # else: running with a cache, its min not admitted: suspended (rule 3)
        w.target = w.base if w.admitted else w.floor


def _grows(w: Work) -> bool:
    """Whether ``w`` may grow (rule 4): admitted, or running below its min without a cache;
    not frozen; below its max."""
    return (
        (w.admitted or (w.running and not w.spec.cache_url)) and not w.frozen and w.target < w.high
    )


def _may_start(w: Work, now: float, policy: FleetPolicy) -> bool:
    st = w.job.status
    return not (st.phase is Phase.SUSPENDED and now - st.changed < _hold(st, policy))


def _hold(st: JobStatus, policy: FleetPolicy) -> float:
    """How long a suspended job stays suspended: ``resume_after_s``, doubled for each
    suspension it had beyond ``suspends_per_h`` per hour it held GPUs (at most 16 times)."""
    budget = max(1.0, policy.suspends_per_h * st.held_s / 3600.0)
    over = min(4, max(0, math.ceil(st.suspends - budget)))
    return policy.resume_after_s * float(2**over)


def _starved(w: Work, now: float, policy: FleetPolicy) -> bool:
    """Queued, or suspended and free to resume, for longer than ``max_wait_s`` (a job
    recorded running that holds no GPU is not: it is suspended now, or waits as it is)."""
    st = w.job.status
    if st.phase is Phase.QUEUED:
        return now - w.spec.submitted >= policy.max_wait_s
    since = now - st.changed
    return st.phase is Phase.SUSPENDED and since >= max(policy.max_wait_s, _hold(st, policy))


def _why_waiting(
    w: Work, need: int, left: int, blocked: bool, now: float, policy: FleetPolicy
) -> str:
    if not _may_start(w, now, policy):
        return (
            f"waits: suspended less than {_hold(w.job.status, policy):g} s ago; resumes after "
            "that if its min fits"
        )
    if need <= left and blocked:
        return "waits: a job of its priority or higher has waited longer and goes first"
    return (
        f"waits: its min of {w.spec.min_workers} needs {gpus_word(need)}; at most "
        f"{max(0, left)} could be freed for it"
    )


# ---------------------------------------------------------------- rule 5: placement


def _place(work: list[Work], free: Held, staying: set[str], shared: set[str]) -> dict[str, int]:
    """Move GPUs so that each job holds its target: shrinks first, then growth, the largest
    growth first (it finds whole hosts). Returns each moved job's change in GPUs."""
    changed: dict[str, int] = {}
    for w in work:
        if phase_of(w) is not Phase.RUNNING:
            w.target = 0
        if w.movable > w.target:
            changed[w.id] = w.target - w.movable
            give_back(w.held, free, w.movable - w.target, staying)
    growing = sorted(
        (w for w in work if w.target > w.movable), key=lambda w: (w.movable - w.target, w.order)
    )
    index = FreeIndex(free, shared)
    for w in growing:
        changed[w.id] = w.target - w.movable
        take(w.held, index, w.target - w.movable)
    return changed

"""Faults found by trying to break the fleet allocator (efdl.fleet.allocate) after issue 56's
rework, each one the case that found it. Each docstring says what the allocator did then;
the assertions say what it does now (efdl.fleet.claims.Grown, allocate._stamped_by,
allocate._kept_key)."""

from __future__ import annotations

from efdl.fleet.allocate import Job, allocate
from efdl.fleet.policy import FleetPolicy
from efdl.fleet.records import Host, JobStatus, Phase
from tests.unit.test_allocate import NOW, after, host, queued, spec


def _ran(gpus: tuple[tuple[str, tuple[int, ...]], ...], since: float) -> JobStatus:
    """Running since ``since`` (started then too), no suspension yet: not protected."""
    return JobStatus(Phase.RUNNING, gpus, since, "placed", 0.0, since, 0.0, 0)


def test_a_job_whose_growth_would_do_is_not_suspended_for_a_higher_one() -> None:
    """One host of 5 GPUs; "small" (priority 0, 1-2, running 2 h, unprotected) holds 2;
    "high" (priority 5, 4-4) waited 700 s. Shrinking small to its min makes high's min (3
    free + 1). The allocator served small's growth first (it is smaller), then let high
    take small's *min*, which suspends small and frees its growth too: small is suspended
    and one GPU stays idle (small may not resume on it for resume_after_s). Taking a job's
    min is the stronger act; its growth should go first."""
    hosts = [host("a", 5)]
    jobs = [
        Job(spec("small", 1, 2, 0, at=1), _ran((("a", (0, 1)),), NOW - 7200)),
        queued(spec("high", 4, 4, 5, at=NOW - 700)),
    ]
    final = {j.spec.job_id: j.status for j in after(allocate(hosts, jobs, NOW), jobs)}
    assert final["high"].phase is Phase.RUNNING and final["high"].size == 4
    assert final["small"].phase is Phase.RUNNING, final["small"].reason  # at its min of 1
    assert final["small"].size == 1


def test_a_higher_job_is_not_kept_waiting_by_a_lower_jobs_growth_until_it_starves() -> None:
    """One host of 5 GPUs; "small" (priority 0, 1-2, unprotected, with a cache) holds 2, 3
    are free; "high" (priority 5, 5-5) waited 700 s (past preempt_after_s). Suspending small
    frees 2 + 3 = 5 = high's min, which the rules allow (a lower job's min, not protected).
    The allocator counts only small's min as takeable (its growth was served first), says
    "at most 4 could be freed", and high waits with 3 GPUs idle until max_wait_s (12 h),
    when it finally suspends small."""
    hosts = [host("a", 5)]
    jobs = [
        Job(spec("small", 1, 2, 0, at=1), _ran((("a", (0, 1)),), NOW - 7200)),
        queued(spec("high", 5, 5, 5, at=NOW - 700)),
    ]
    d = allocate(hosts, jobs, NOW)
    high = d.statuses["high"]
    assert high.phase is Phase.RUNNING, high.reason  # "at most 4 could be freed for it"
    assert d.statuses["small"].phase is Phase.SUSPENDED
    # the same after an hour: no decision changes it before the 12 h starvation guard
    later = allocate(hosts, jobs, NOW + 3600, FleetPolicy())
    assert later.statuses["high"].phase is Phase.RUNNING, later.statuses["high"].reason


E2E = FleetPolicy(preempt_after_s=0, protect_s=0, resume_after_s=0)  # the e2e fleet's flags


def _chain(waited: float, since: float) -> tuple[list[Host], list[Job]]:
    """One host of 3 GPUs: "high" (priority 100, 1-2) holds 2, "low" (priority 0, 1-1) holds
    1, "mid" (priority 50, 1-8) waits. high is smaller than mid, so its growth is served
    before mid's min; mid takes low's min (lower priority). But low, once suspended, is a
    waiting 1-GPU job, smaller than high, so its min is served before high's growth."""
    hosts = [host("a", 3)]
    jobs = [
        Job(spec("high", 1, 2, 100, at=1), _ran((("a", (0, 1)),), since)),
        Job(spec("low", 1, 1, 0, at=2), _ran((("a", (2,)),), since)),
        queued(spec("mid", 1, 8, 50, at=NOW - waited)),
    ]
    return hosts, jobs


def test_a_decision_that_suspends_a_job_is_a_fixed_point_with_the_e2e_flags() -> None:
    """--resume-after 0 --preempt-after 0 --protect 0 (the e2e fleet): the decision
    suspends low for mid; deciding again at once, the same clock, resumes low by shrinking
    high (low's min goes before high's growth). The pass that re-runs "as the next decision
    would see it" keeps a job it suspended stopped even when resume_after_s lets it resume."""
    hosts, jobs = _chain(30, NOW - 3000)
    d = allocate(hosts, jobs, NOW, E2E)
    final = after(d, jobs)
    again = allocate(hosts, final, NOW, E2E).statuses
    was = {j.spec.job_id: (j.status.phase, j.status.gpus) for j in final}
    changed = {k for k, v in again.items() if (v.phase, v.gpus) != was[k]}
    assert changed == set(), {k: again[k].reason for k in changed}


def test_a_job_is_not_suspended_only_to_resume_when_its_hold_ends() -> None:
    """Default policy: mid waited 700 s, low and high ran 2 h (unprotected). low is
    suspended for mid; at the end of low's hold (600 s), with nothing else changed, low
    resumes by shrinking high: high 1, low 1, mid 1, which the first decision could have
    made at once. A suspend/resume round trip (a resume's cost, 10 minutes lost) for
    nothing."""
    hosts, jobs = _chain(700, NOW - 7200)
    d = allocate(hosts, jobs, NOW)
    final = after(d, jobs)
    assert d.statuses["mid"].phase is Phase.RUNNING
    later = after(allocate(hosts, final, NOW + FleetPolicy().resume_after_s), final)
    low = [j.status for j in (final[1], later[1])]  # low now, and once its hold ended
    round_trip = low[0].phase is Phase.SUSPENDED and low[1].phase is Phase.RUNNING
    assert not round_trip, (low[0].reason, low[1].reason, later[0].status.reason)


def test_no_lower_job_grows_in_a_decision_that_suspends_a_higher_one() -> None:
    """One host of 12 GPUs: "grower" (priority 0, 2-5, started 30 min ago: protected) holds
    2; "midA" and "midB" (priority 50, 3-3, 2 h: not protected) hold 3 each; 4 are free.
    "big" (priority 100, 6-6) waited 700 s. Suspending one mid job makes big's min (4 free
    + 3). The allocator suspends both mid jobs, then gives grower (priority 0) 3 more GPUs
    in the same decision and leaves one idle: grower's growth is served before big's min
    (it is smaller) and counted as gone when big's need is reckoned. (The fleet_sim day,
    seed 1, load 1: a 32-GPU high job suspended 26 jobs, 10 of priority 50, while two
    priority-0 jobs grew by 15 GPUs and 8 GPUs stayed idle.)"""
    hosts = [host("a", 12)]
    grower = _ran((("a", (0, 1)),), NOW - 1800)
    jobs = [
        Job(spec("grower", 2, 5, 0, at=1), grower),
        Job(spec("midA", 3, 3, 50, at=2), _ran((("a", (2, 3, 4)),), NOW - 7200)),
        Job(spec("midB", 3, 3, 50, at=3), _ran((("a", (5, 6, 7)),), NOW - 7200)),
        queued(spec("big", 6, 6, 100, at=NOW - 700)),
    ]
    d = allocate(hosts, jobs, NOW)
    final = {j.spec.job_id: j.status for j in after(d, jobs)}
    assert final["big"].phase is Phase.RUNNING
    suspended = sorted(k for k in ("midA", "midB") if final[k].phase is Phase.SUSPENDED)
    assert len(suspended) <= 1, (suspended, final["grower"].reason)
    assert final["grower"].size <= 3  # a priority-0 job does not grow past a mid one's loss


def test_a_status_stamped_by_a_leader_whose_clock_ran_ahead_does_not_freeze_a_job() -> None:
    """Any efdl node may lead; one whose clock runs an hour ahead stamps changed (and
    started) an hour in the future. When a leader with the right clock takes over, the
    job reads as resized "less than resize_interval_s ago" and started "less than
    protect_s ago" for the whole skew: here a priority-100 job (smaller: served first) waits
    for the hour while a priority-0 job holds 3 GPUs above its min of 1, and its reason says
    "at most 0 could be freed". A stamp from the future should count as now at most (the
    interval, not the skew)."""
    hosts = [host("a", 4)]
    ahead = NOW + 3600
    skewed = JobStatus(Phase.RUNNING, (("a", (0, 1, 2, 3)),), ahead, "placed", 0.0, ahead)
    jobs = [Job(spec("low", 1, 4, 0, at=1), skewed), queued(spec("high", 3, 3, 100, at=NOW))]
    later = NOW + 2 * FleetPolicy().resize_interval_s + FleetPolicy().preempt_after_s
    d = allocate(hosts, jobs, later)
    assert d.statuses["high"].phase is Phase.RUNNING, d.statuses["high"].reason


def test_a_job_without_a_cache_that_lost_every_gpu_suspends_no_higher_job() -> None:
    """The job "bare" (priority 0, 4-4, no cache) lost all 4 GPUs to inference on host b; "high"
    (priority 100, 4-4, with a cache, resumed 10 min ago: protected) runs on host a. The
    allocator keeps bare's min first of all (a job without a cache "cannot be suspended":
    its state lives in its workers), so it suspends high, which lost nothing, with the
    reason "below its min of 4 and no GPUs to make it up", and restarts bare on high's
    GPUs. But bare's workers are all gone: it has no state left to keep, it restarts
    either way; it should wait as a priority-0 job, not take a protected priority-100
    job's GPUs."""
    hosts = [host("a", 4), host("b", 4, foreign=range(4))]
    jobs = [
        Job(spec("bare", 4, 4, 0, cache=False, at=1), _ran((("b", (0, 1, 2, 3)),), NOW - 7200)),
        Job(spec("high", 4, 4, 100, at=2), _ran((("a", (0, 1, 2, 3)),), NOW - 600)),
    ]
    d = allocate(hosts, jobs, NOW)
    assert "high" not in d.statuses, d.statuses["high"].reason

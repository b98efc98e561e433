"""The fleet simulation (benchmarks.fleet_sim) on its quick case: the invariants every
scheduler must keep, checked on every tick and over the whole run."""

from __future__ import annotations

import math

import pytest

from benchmarks import fleet_sim
from benchmarks.fleet_sim import (
    Costs,
    Outcome,
    Trace,
    TraceJob,
    check_outcome,
    make_trace,
    simulate_efdl,
    simulate_gang,
    summarize,
)

COSTS = Costs(horizon_s=72 * 3600.0)


def quick(packed: bool) -> Trace:
    return make_trace(1, 1.0, n_jobs=100, n_hosts=8, packed=packed, horizon_s=COSTS.horizon_s)


def outcomes(trace: Trace) -> list[Outcome]:
    """Every scheduler on ``trace``, with the per-tick checks on: no GPU held by two jobs
    or by a job and inference, and (gang) no job running at other than its gang size."""
    return [
        simulate_efdl(trace, COSTS, check=True),
        simulate_gang(trace, COSTS, "max", check=True),
        simulate_gang(trace, COSTS, "min", check=True),
        simulate_gang(trace, COSTS, "max", reserve=True, check=True),
        simulate_gang(trace, COSTS, "min", reserve=True, check=True),
    ]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "spread"])
def test_invariants(packed: bool) -> None:
    trace = quick(packed)
    assert len({j.job_id for j in trace.jobs}) == len(trace.jobs) == 100
    runs = outcomes(trace)
    for o in runs:
        check_outcome(o, COSTS)  # GPU-time and work add up
        s = summarize(o)
        finished = [r for r in o.runs if r.finish is not None]
        assert len(finished) + s["unfinished"] == len(trace.jobs), o.name
        for r in finished:
            assert r.first_start is not None and r.finish is not None
            assert r.job.arrive_s <= r.first_start <= r.finish <= o.end_s, r.job.job_id
        assert 0 < s["util"] <= 1 and 0 <= s["idle"] <= 1
        if o.name.startswith("gang") and "+res" not in o.name:
            assert s["idle_fit"] == 0, "greedy backfill leaves no GPU idle a waiting job fits"
        if o.name.startswith("gang"):
            assert s["resizes"] == 0 and o.paying_gpu_s > 0
    assert summarize(runs[0])["unfinished"] == 0  # efdl finishes every job of the case


def test_skipping_unchanged_ticks_changes_nothing() -> None:
    """allocate() is called only on ticks whose input changed: the same run as on every."""
    trace = quick(True)
    a = simulate_efdl(trace, COSTS)
    b = simulate_efdl(trace, COSTS, every_tick=True)
    assert len(a.decide_ms) < len(b.decide_ms)
    assert [r.finish for r in a.runs] == [r.finish for r in b.runs]
    assert summarize(a) == summarize(b)


def test_gang_preemption_goes_back_to_the_checkpoint() -> None:
    """A gang job on a GPU inference takes stops whole and trains again from its last
    checkpoint: the redone GPU-time is counted, and the job still finishes."""
    trace = quick(False)
    o = simulate_gang(trace, COSTS, "max", check=True)
    assert o.suspensions and o.redone_gpu_s > 0
    assert all(s.cause == "inference took a GPU" for s in o.suspensions)


def test_cli_quick(capsys: pytest.CaptureFixture[str]) -> None:
    fleet_sim.main(["--quick", "--check"])
    out = capsys.readouterr().out
    assert "| 1x | packed | efdl |" in out and "| 1x | spread | gang-min+res |" in out
    assert "Goals (issue 56)" in out and ("PASS" in out or "FAIL" in out)


def test_easy_reservation_holds_back_only_what_would_delay_the_head() -> None:
    """One host of 8 GPUs, no inference: A (4 GPUs, 2 h) runs; B (8 GPUs) cannot fit and
    gets the reservation at A's end; C (4 GPUs, 3 h) would still hold GPUs then, so it
    waits behind B; D (4 GPUs, 10 min) ends before A does and backfills. Greedy backfill
    starts C at once and B waits for C too."""
    host = "gke-train-a3-a000.us-central1-a.c.fleet-prod.internal"
    jobs = (
        TraceJob("low-a", 0.0, 4, 4, 0, 4 * 2 * 3600.0, True),
        TraceJob("low-b", 60.0, 8, 8, 0, 8 * 3600.0, True),
        TraceJob("low-c", 120.0, 4, 4, 0, 4 * 3 * 3600.0, True),
        TraceJob("low-d", 180.0, 4, 4, 0, 4 * 600.0, True),
    )
    trace = Trace((host,), 8, tuple((host, i) for i in range(8)), (0,), 300.0, jobs, True)
    start: dict[bool, dict[str, float]] = {}
    for reserve in (False, True):
        o = simulate_gang(trace, COSTS, "max", reserve=reserve, check=True)
        check_outcome(o, COSTS)
        start[reserve] = {r.job.job_id: r.first_start or math.inf for r in o.runs}
    assert start[False]["low-c"] == 120.0 and start[False]["low-b"] > 3 * 3600
    easy = start[True]
    assert easy["low-d"] == 180.0  # it ends before the reservation: backfilled
    assert easy["low-b"] < 2.2 * 3600 <= easy["low-c"] < math.inf

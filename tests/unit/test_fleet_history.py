"""Who held which GPU when (efdl.fleet.holdings), from fleet events."""

from __future__ import annotations

from efdl.fleet.holdings import Holding, format_history, holdings
from efdl.fleet.records import FleetEvent, JobStatus, Phase

A = "gpu-a.us-central1-a.c.proj.internal"
B = "gpu-b.us-central1-a.c.proj.internal"


def event(
    t: float, job: str, phase: Phase, gpus: dict[str, tuple[int, ...]], why: str
) -> FleetEvent:
    return FleetEvent(t, job, JobStatus(phase, tuple(sorted(gpus.items())), t, why))


EVENTS = [
    event(10, "low", Phase.QUEUED, {}, "submitted"),
    event(11, "low", Phase.RUNNING, {A: (0, 1), B: (0,)}, "started"),
    event(50, "high", Phase.RUNNING, {B: (0,)}, "started"),
    event(50, "low", Phase.RUNNING, {A: (0, 1)}, "shrunk by 1 GPU for high (priority 5)"),
    event(70, "low", Phase.RUNNING, {A: (0, 1, 2)}, "grew by 1 GPU onto free GPUs"),
    event(90, "high", Phase.FINISHED, {}, "its agent finished (exit 0)"),
]


def test_holdings_are_each_jobs_stretches_on_each_gpu() -> None:
    assert holdings(EVENTS, 100) == [
        Holding("low", A, 0, 11, 100),
        Holding("low", A, 1, 11, 100),
        Holding("low", A, 2, 70, 100),
        Holding("low", B, 0, 11, 50),
        Holding("high", B, 0, 50, 90),
    ]


def test_a_gpu_is_never_held_by_two_jobs_at_once() -> None:
    held = holdings(EVENTS, 100)
    for h in held:
        for other in held:
            if other is not h and (other.host, other.index) == (h.host, h.index):
                assert other.end <= h.start or h.end <= other.start


def test_the_history_has_a_line_per_change_and_filters_by_job() -> None:
    text = format_history(EVENTS)
    assert len(text.splitlines()) == 1 + len(EVENTS)
    assert f"{A}:0,1 {B}:0: started" in text
    only = format_history(EVENTS, "high")
    assert len(only.splitlines()) == 3 and "low" not in only
    assert "(no events of job nope)" in format_history(EVENTS, "nope")

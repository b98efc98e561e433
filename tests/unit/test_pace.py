"""The nodes' pace (efdl.worker.pace) and the agent's verdict on it (efdl.launcher.stragglers):
pure parts, with a clock the test moves."""

from __future__ import annotations

import pytest

from efdl.config import LaunchConfig
from efdl.errors import ConfigError
from efdl.launcher.stragglers import PaceJudge
from efdl.protocol.messages import Paced, decode, encode
from efdl.worker import pace
from efdl.worker.pace import MIN_EXCESS_S, Pace, StepClock, pace_window, slots, verdict


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(pace.time, "monotonic", c)
    return c


def test_busy_time_is_the_step_less_the_wait_at_the_end_of_backward(clock: Clock) -> None:
    c = StepClock()
    assert c.committed() is None  # the first commit: no step before it
    clock.now += 0.3  # forward and backward
    c.grad_ready()
    clock.now += 0.5  # waits for a slower peer's gradients
    c.step_started()
    clock.now += 0.1  # the optimizer step
    assert c.committed() == pytest.approx(0.4)
    # A step with no gradient (an evaluation's commit): all of it is busy.
    clock.now += 0.2
    assert c.committed() == pytest.approx(0.2)


def test_accumulation_counts_the_wait_of_the_synchronizing_micro_step_only(clock: Clock) -> None:
    c = StepClock()
    c.committed()
    for _ in range(3):  # no_sync micro-steps: each gradient ready is followed by more work
        clock.now += 0.1
        c.grad_ready()
    clock.now += 0.25  # the last micro-step's all-reduce wait
    c.step_started()
    assert c.committed() == pytest.approx(0.3)


def test_a_rebuild_is_not_a_step(clock: Clock) -> None:
    c = StepClock()
    c.committed()
    clock.now += 5.0
    c.restart()
    assert c.committed() is None


def test_slots_give_the_own_node_its_microseconds() -> None:
    assert slots(3, 1, 0.25) == [0, 250_000, 0]
    assert slots(3, 2, None) == [0, 0, 0]
    assert slots(2, 0, 0.0) == [1, 0]  # known but tiny: not "unknown"


def test_a_node_stands_against_the_median_of_the_others() -> None:
    p = Pace(window=5)
    rows = [[200_000, 100_000, 110_000]] * 4 + [[900_000, 100_000, 110_000]]
    judged = [p.add(r) for r in rows]
    assert judged == [False] * 4 + [True]
    slow = p.of_node(0)
    assert slow is not None
    assert slow.node_s == pytest.approx(0.2)  # one slow step does not move the median
    assert slow.others_s == pytest.approx(0.105)
    assert slow.ratio == pytest.approx(0.2 / 0.105)
    fast = p.of_node(1)
    assert fast is not None and fast.ratio < 1


def test_two_nodes_each_against_the_other() -> None:
    p = Pace(window=5)
    for _ in range(5):
        p.add([400_000, 200_000])
    a, b = p.of_node(0), p.of_node(1)
    assert a is not None and a.ratio == pytest.approx(2.0)
    assert b is not None and b.ratio == pytest.approx(0.5)


def test_no_standing_without_a_whole_window_or_a_peer() -> None:
    p = Pace(window=5)
    for _ in range(4):
        p.add([1, 2])
    assert p.of_node(0) is None
    alone = Pace(window=5)
    for _ in range(5):
        alone.add([100])
    assert alone.of_node(0) is None


def test_a_step_with_an_unknown_node_is_left_out_and_reset_starts_over() -> None:
    p = Pace(window=5)
    assert not p.add([0, 100])  # a node's first commit of the generation
    for _ in range(4):
        p.add([100, 100])
    assert p.of_node(0) is None
    p.add([100, 100])
    assert p.of_node(0) is not None
    p.reset()
    assert p.of_node(0) is None


def test_verdict_needs_the_ratio_and_a_real_excess() -> None:
    assert verdict(0.2, 0.1, 1.5)
    assert not verdict(0.14, 0.1, 1.5)
    assert not verdict(0.002, 0.001, 1.5)  # 2x, but a millisecond: noise
    assert verdict(0.1 + 2 * MIN_EXCESS_S, 0.1, 1.1)
    assert not verdict(0.1 + MIN_EXCESS_S / 2, 0.1, 1.01)
    assert not verdict(0.2, 0.0, 1.5)


def test_the_window_comes_from_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EFDL_STRAGGLER_WINDOW", raising=False)
    assert pace_window() == pace.DEFAULT_WINDOW
    monkeypatch.setenv("EFDL_STRAGGLER_WINDOW", "30")
    assert pace_window() == 30
    for bad in ("3", "ten"):
        monkeypatch.setenv("EFDL_STRAGGLER_WINDOW", bad)
        with pytest.raises(ValueError, match=f"EFDL_STRAGGLER_WINDOW='{bad}'"):
            pace_window()
    with pytest.raises(ValueError, match="at least 5"):
        Pace(window=2)


def test_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"--straggler-ratio \(1\) must be greater than 1"):
        LaunchConfig(straggler_ratio=1.0)
    with pytest.raises(ConfigError, match=r"--straggler-window \(2\) must be at least 5"):
        LaunchConfig(straggler_window=2)


def test_the_report_crosses_the_channel() -> None:
    import json

    msg = Paced(3, 0.4, 0.2, 20)
    assert decode(json.loads(encode(msg))) == msg


def paced(generation: int, node_s: float, others_s: float) -> Paced:
    return Paced(generation, node_s, others_s, 20)


def test_the_agent_says_slow_once_per_generation() -> None:
    judge = PaceJudge(1.5, evict=False)
    assert judge.judge(paced(1, 0.12, 0.1), 2, 4, 0, 1) is None
    assert judge.last_ratio == pytest.approx(1.2)
    slow = judge.judge(paced(1, 0.25, 0.1), 2, 4, 0, 1)
    assert slow is not None and not slow.evict
    assert "2.50x" in slow.text and "--evict-stragglers is off" in slow.text
    assert judge.judge(paced(1, 0.3, 0.1), 2, 4, 0, 1) is None  # said already
    assert judge.judge(paced(2, 0.3, 0.1), 2, 4, 0, 1) is not None  # a new generation


def test_the_agent_evicts_only_where_the_job_keeps_its_min() -> None:
    judge = PaceJudge(1.5, evict=True)
    slow = judge.judge(paced(1, 0.3, 0.1), 2, 4, 0, 4)
    assert slow is not None and slow.evict and "leaving in place" in slow.text
    short = PaceJudge(1.5, evict=True).judge(paced(1, 0.3, 0.1), 2, 2, 0, 4)
    assert short is not None and not short.evict and "may not make --min 4" in short.text
    spare = PaceJudge(1.5, evict=True).judge(paced(1, 0.3, 0.1), 2, 2, 1, 3)
    assert spare is not None and spare.evict  # 2 + a spare's one worker at least make 3

"""A rank's verdict on its steps' communication (efdl.worker.verdict), with stand-in events:
on NCCL a step counts on a rank only once its work completed while the group reported no
error; a rank whose group reported one holds no step it had not verified before."""

from __future__ import annotations

from dataclasses import dataclass

from efdl.worker.verdict import Verdicts


@dataclass
class FakeEvent:
    """A CUDA event stand-in: done when the test says its work ended."""

    done: bool = False

    def query(self) -> bool:
        return self.done


class Group:
    def __init__(self) -> None:
        self.error = False
        self.events: list[FakeEvent] = []

    def event(self) -> FakeEvent:
        self.events.append(FakeEvent())
        return self.events[-1]


def test_a_blocking_backend_verifies_every_commit() -> None:
    v = Verdicts(lambda: False, lambda: None)
    for step in (1, 2, 3):
        v.committed(step)
    assert (v.verified, v.failed, v.holds(3)) == (3, False, True)


def test_a_step_counts_once_its_work_completed_without_error() -> None:
    g = Group()
    v = Verdicts(lambda: g.error, g.event)
    v.committed(1)
    v.committed(2)
    assert v.verified == 0  # enqueued, not known complete
    g.events[0].done = True
    v.committed(3)
    assert (v.verified, v.failed) == (1, False)
    assert v.holds(3)  # nothing failed: the steps in flight are the step's own business


def test_an_error_makes_the_unverified_steps_torn() -> None:
    """A peer died while step 3's all-reduce ran: the abort ends the kernels early and the
    enqueued optimizer.step() runs on partial gradients; steps 1-2 completed before."""
    g = Group()
    v = Verdicts(lambda: g.error, g.event)
    for step in (1, 2, 3):
        v.committed(step)
    g.events[0].done = g.events[1].done = True
    v.settle()
    g.error = True
    g.events[2].done = True  # ended by the abort
    v.after_failure(1.0)
    assert (v.verified, v.failed) == (2, True)
    assert v.holds(2) and not v.holds(3)
    v.committed(4)  # a later step can never be verified once the group failed
    assert not v.holds(4)
    v.reset(5)  # the sync gave it step 5
    assert (v.verified, v.failed, v.holds(5)) == (5, False, True)


def test_the_wait_for_unfinished_work_is_bounded() -> None:
    g = Group()
    v = Verdicts(lambda: g.error, g.event)
    v.committed(1)
    g.error = True
    v.after_failure(0.05)  # its event never completes: the wait ends at its deadline
    assert v.failed and not v.holds(1)


def test_work_stuck_on_a_dead_peer_is_not_waited_for_and_its_step_is_suspect() -> None:
    """The side group saw the peer die while step 2's all-reduce waits on it: NCCL reports
    no error yet, and the abort that follows will end the kernel early, on torn data."""
    g = Group()
    v = Verdicts(lambda: g.error, g.event)
    v.committed(1)
    g.events[0].done = True
    v.committed(2)
    v.after_failure(30.0)  # bounded by about two steps' time, not by the 30 s
    assert (v.verified, v.failed) == (1, True)
    assert v.holds(1) and not v.holds(2)


@dataclass
class SlowEvent(FakeEvent):
    """Work that ends after a few more queries (the GPU was a little behind)."""

    queries_left: int = 3

    def query(self) -> bool:
        self.queries_left -= 1
        return self.queries_left <= 0


def test_work_that_ends_in_the_wait_without_an_error_is_verified() -> None:
    """The peer died after its part of step 2 was done: the survivor's step ends normally."""
    events: list[FakeEvent] = [FakeEvent(done=True), SlowEvent()]
    v = Verdicts(lambda: False, lambda: events.pop(0))
    v.committed(1)
    v.committed(2)
    v.after_failure(30.0)
    assert (v.verified, v.failed, v.holds(2)) == (2, False, True)


def test_an_abort_between_the_error_check_and_the_query_does_not_verify_a_torn_step() -> None:
    """The group is aborted while settle() looks: the abort ends the work early (its event
    completes) and sets the error. Whatever the order in which the two are seen, a step whose
    event completed by the abort is never verified."""
    error = False

    class AbortedWhileAsked(FakeEvent):
        def query(self) -> bool:
            nonlocal error
            error = True  # the abort lands as the event is asked: the work "completes"
            return True

    v = Verdicts(lambda: error, AbortedWhileAsked)
    v.committed(1)
    assert (v.verified, v.failed) == (0, True)
    assert not v.holds(1)

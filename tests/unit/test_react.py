"""The agent's reactions (efdl.launcher.react), on hand-built views: what a node does on a
round, a worker's exit and a signal, with no process, clock or etcd behind it."""

from __future__ import annotations

import logging
import signal
from dataclasses import replace

import pytest

from efdl.launcher import react
from efdl.launcher.react import AgentPhase, AgentView, EndedWorker, Limits, WorkerMode
from efdl.launcher.restarts import RestartBudget
from efdl.launcher.workers import WorkerExit
from efdl.rendezvous.records import EventKind, Member, Round, RoundStatus

LIMITS = Limits(slots=2, max_workers=8, grace_period_s=30.0, join_timeout_s=600.0)


def view(**changes: object) -> AgentView:
    base = AgentView(
        LIMITS,
        AgentPhase.FOLLOWING,
        generation=3,
        workers=WorkerMode.PLAIN,
        placed=True,
        restarts=RestartBudget(3),
        trained=None,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def round_(generation: int = 4, status: RoundStatus = RoundStatus.ACTIVE, **kw: object) -> Round:
    member = kw.pop("member", Member("a", workers=2, first_rank=2))
    return Round(generation, status, world_size=4, nodes=2, reason="r", member=member, **kw)  # type: ignore[arg-type]


def kinds(reaction: react.Reaction) -> list[type]:
    return [type(a) for a in reaction.actions]


def ended(code: int = 1, **facts: object) -> EndedWorker:
    base = EndedWorker(
        WorkerExit(4, local_rank=1, rank=3, pid=77, code=code),
        ours=True,
        leaving=False,
        standing_by=False,
        in_place=False,
        all_ended=False,
        all_clean=False,
        error="ValueError: bad\n  File x",
    )
    return replace(base, **facts)  # type: ignore[arg-type]


# ---------------------------------------------------------------- rounds


def test_a_round_already_acted_on_changes_nothing() -> None:
    reaction = react.on_round(view(phase=AgentPhase.RESTARTING), round_(generation=3))
    assert reaction == react.Reaction(AgentPhase.RESTARTING)


def test_an_active_round_is_followed_then_handed_over_on_a_fresh_view() -> None:
    r = round_()
    reaction = react.on_round(view(phase=AgentPhase.RESTARTING), r)
    assert reaction.phase is AgentPhase.FOLLOWING  # the round that restarts them came
    assert reaction.actions == (
        react.EnterRound(r),
        react.ReadProgress(),
        react.Follow(r),
        react.HandOver(r),
    )
    left_out = react.on_round(view(), round_(member=None))
    assert kinds(left_out) == [react.EnterRound, react.ReadProgress, react.HandOver]


def test_plain_workers_are_restarted_with_their_new_ranks() -> None:
    r = round_()
    reaction = react.hand_over(view(), r)
    assert reaction.phase is AgentPhase.FOLLOWING
    assert reaction.actions == (
        react.StopWorkers(),
        react.MarkPause(),
        react.StartWorkers(r, (0, 1)),
    )


def test_in_place_workers_are_rebuilt_not_stopped() -> None:
    r = round_()
    reaction = react.hand_over(view(workers=WorkerMode.IN_PLACE), r)
    assert reaction.actions == (react.RebuildInPlace(r),)


@pytest.mark.parametrize(
    ("world_size", "said"),
    [(7, "this node is a spare"), (4, "was decided without this node")],
)
def test_a_node_left_out_stops_its_workers_and_says_why(world_size: int, said: str) -> None:
    r = replace(round_(member=None), world_size=world_size)
    reaction = react.hand_over(view(), r)
    assert kinds(reaction) == [react.StopWorkers, react.MarkPause, react.Say]
    assert said in reaction.actions[-1].message  # type: ignore[union-attr]


@pytest.mark.parametrize(("status", "code"), [(RoundStatus.CLOSED, 0), (RoundStatus.FAILED, 1)])
def test_a_stopped_or_failed_job_stops_the_workers_and_ends(status: RoundStatus, code: int) -> None:
    reaction = react.on_round(view(), round_(status=status))
    assert kinds(reaction) == [react.EnterRound, react.StopWorkers, react.EndAgent]
    assert reaction.actions[-1].code == code  # type: ignore[union-attr]


def test_a_finished_job_waits_for_running_workers_within_the_grace() -> None:
    reaction = react.on_round(view(), round_(status=RoundStatus.FINISHED))
    assert reaction.phase is AgentPhase.FINISHING
    assert kinds(reaction) == [react.EnterRound, react.Say, react.AwaitFinish]


def test_a_finished_job_with_no_worker_running_here_ends_at_once() -> None:
    reaction = react.on_round(view(workers=WorkerMode.NONE), round_(status=RoundStatus.FINISHED))
    assert reaction.phase is AgentPhase.FINISHING
    assert reaction.actions[-1] == react.EndAgent(0, "The job finished (r).")


def test_finishing_is_not_left_for_a_later_round() -> None:
    reaction = react.on_round(view(phase=AgentPhase.FINISHING), round_())
    assert reaction.phase is AgentPhase.FINISHING


def test_a_waiting_job_keeps_in_place_workers_and_stops_plain_ones() -> None:
    waiting = round_(status=RoundStatus.WAITING)
    kept = react.on_round(view(workers=WorkerMode.IN_PLACE), waiting)
    assert react.TellWaiting(600.0) in kept.actions
    assert react.StopWorkers() not in kept.actions
    stopped = react.on_round(view(), waiting)
    assert react.StopWorkers() in stopped.actions


# ---------------------------------------------------------------- exits


def test_an_exit_of_a_group_stopped_on_purpose_is_ignored() -> None:
    assert react.on_exit(view(), ended(ours=False)) == react.Reaction(AgentPhase.FOLLOWING)


@pytest.mark.parametrize(
    ("facts", "code"),
    [({"leaving": True}, 1), ({"standing_by": True}, 0)],
)
def test_a_worker_that_left_as_asked_is_dismissed(facts: dict[str, bool], code: int) -> None:
    reaction = react.on_exit(view(), ended(code, **facts))
    assert reaction.actions == (react.Dismiss(77),)


def test_a_clean_exit_while_others_run_is_only_noted() -> None:
    reaction = react.on_exit(view(), ended(0, all_ended=False, all_clean=True, error=""))
    assert reaction.actions == (react.NoteExit(1, 0),)


def test_all_workers_finishing_cleanly_finishes_the_job() -> None:
    reaction = react.on_exit(view(), ended(0, all_ended=True, all_clean=True, error=""))
    assert kinds(reaction) == [react.NoteExit, react.DropWorkers, react.FinishJob]
    finishing = react.on_exit(
        view(phase=AgentPhase.FINISHING), ended(0, all_ended=True, all_clean=True, error="")
    )
    assert kinds(finishing) == [react.NoteExit, react.DropWorkers, react.EndAgent]


def judged(v: AgentView, failure: EndedWorker) -> react.Reaction:
    """The failure's reaction, then its follow-up's on the same view."""
    first = react.on_exit(v, failure)
    follow = first.actions[-1]
    assert isinstance(follow, react.JudgeFailure)
    return react.judge_failure(v, follow)


def test_a_plain_failure_stops_the_workers_and_asks_for_a_round() -> None:
    first = react.on_exit(view(), ended())
    assert first.actions == (
        react.NoteExit(1, 1),
        react.ReportCrash(ended().exit, ended().error),
        react.StopWorkers(5.0),  # the grace, at most 5 s
        react.JudgeFailure(ended().exit, ended().error, in_place=False),
    )
    reaction = judged(view(), ended())
    assert reaction.phase is AgentPhase.RESTARTING
    assert kinds(reaction) == [
        react.CountRestart,
        react.RefillSoon,
        react.Record,
        react.Say,
        react.ReportFailure,
        react.HoldRestart,
    ]
    budget = RestartBudget(3).judge(1, ended().error, None).budget
    assert reaction.actions[0] == react.CountRestart(budget)
    record = reaction.actions[2]
    assert isinstance(record, react.Record)
    assert (record.kind, record.text) == (
        EventKind.RESTART,
        "restarting the workers (restart 1 of 3)",
    )


def test_an_in_place_failure_replaces_only_that_worker() -> None:
    v = view(workers=WorkerMode.IN_PLACE)
    first = react.on_exit(v, ended(in_place=True))
    assert react.Detach(77) in first.actions
    assert react.StopWorkers(5.0) not in first.actions
    reaction = judged(v, ended(in_place=True))
    assert reaction.phase is AgentPhase.FOLLOWING
    assert reaction.actions[-1] == react.StartReplacement(1)


def test_an_in_place_worker_of_no_round_yet_restarts_the_workers() -> None:
    reaction = judged(view(placed=False), ended(in_place=True))
    assert reaction.phase is AgentPhase.RESTARTING


def test_the_same_error_again_with_nothing_trained_ends_the_node() -> None:
    once = judged(view(), ended())
    budget = next(a.budget for a in once.actions if isinstance(a, react.CountRestart))
    again = judged(view(restarts=budget), ended())
    end = again.actions[-1]
    assert isinstance(end, react.EndAgent) and end.code == 1
    assert end.message.startswith(
        "Worker rank 3 failed with exit code 1: ValueError: bad, the same"
    )
    trained = judged(view(restarts=budget, trained=5), ended())  # a step trained since
    assert reaction_restarts(trained)


def reaction_restarts(reaction: react.Reaction) -> bool:
    return any(isinstance(a, react.CountRestart) for a in reaction.actions)


def test_a_spent_budget_ends_the_node() -> None:
    reaction = judged(view(restarts=RestartBudget(0)), ended(-9, error=""))
    assert reaction.actions[-1] == react.EndAgent(
        1,
        "Worker rank 3 failed with signal SIGKILL; this node has used all 0 restarts "
        "(--max-restarts), so it leaves the job.",
    )


def test_a_failure_after_the_job_finished_ends_the_node() -> None:
    reaction = react.on_exit(view(phase=AgentPhase.FINISHING), ended())
    assert reaction.actions[-1] == react.EndAgent(
        1, "Worker rank 3 failed with exit code 1 after the job finished."
    )


# ---------------------------------------------------------------- signals


def test_a_signal_leaves_plain_workers_by_stopping_them() -> None:
    reaction = react.on_signal(view(), signal.SIGTERM)
    assert reaction.phase is AgentPhase.LEAVING
    assert kinds(reaction) == [
        react.Record,
        react.Say,
        react.StopWorkers,
        react.LeaveRendezvous,
        react.EndLeft,
    ]
    assert reaction.actions[-1] == react.EndLeft(15, "Left the job on SIGTERM", finished=False)
    assert reaction.actions[1] == react.Say(
        logging.INFO, "SIGTERM: leaving gracefully (grace period 30 s)."
    )


def test_a_signal_has_in_place_workers_leave_at_a_step_boundary_first() -> None:
    reaction = react.on_signal(view(workers=WorkerMode.IN_PLACE, phase=AgentPhase.FINISHING), 2)
    assert kinds(reaction)[2:5] == [react.TellLeave, react.LeaveRendezvous, react.AwaitWorkers]
    assert reaction.actions[-1] == react.EndLeft(2, "Left the job on SIGINT", finished=True)

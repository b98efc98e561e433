"""The agent's reactions, pure: what it does on a new round, a worker's exit, a signal.

Each reaction takes the agent's view (:class:`AgentView`, a frozen snapshot the agent takes
just before it reacts) and the event, and returns a :class:`Reaction`: the phase the agent
is in afterwards and the actions to run, in order. ``NodeAgent`` (efdl.launcher.agent) sets
the phase, then runs the actions and does all of the I/O; nothing here reads a clock, a
file, a process or etcd, so each decision is tested on a hand-built view
(tests/unit/test_react.py). The pattern is torch.distributed.elastic's dynamic rendezvous:
a pure operation returns an action, one executor runs it. Where a decision must see what an
earlier action left (the workers still running after the job's progress was read from etcd,
the last step trained once the failed workers were stopped), the reaction ends in a follow-up
(:class:`HandOver`, :class:`JudgeFailure`), which the agent answers with a fresh view.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from enum import StrEnum

from efdl.launcher.restarts import RestartBudget, Verdict
from efdl.launcher.workers import WorkerExit
from efdl.rendezvous.holds import HoldKind
from efdl.rendezvous.records import EventKind, Round, RoundStatus


class AgentPhase(StrEnum):
    """Where the agent is in its job. FINISHING and LEAVING are never left."""

    JOINING = "joining"  # registering this node; no round yet
    FOLLOWING = "following"  # joined: follows the job's rounds, its workers running or not
    # Its workers failed and were stopped (restart mode): it awaits the round that restarts
    # them, and asks for one if none comes soon (efdl.launcher.agent.RESTART_HOLD_S).
    RESTARTING = "restarting"
    FINISHING = "finishing"  # the job finished elsewhere: its workers finish, within the grace
    LEAVING = "leaving"  # it leaves the job (a signal): no round is held for this node


class WorkerMode(StrEnum):
    """What this node's running workers are, as a round finds them."""

    NONE = "none"  # none runs
    PLAIN = "plain"  # restarted on each round (a plain script, or one that has not said hello)
    IN_PLACE = "in_place"  # every one is efdl-aware and alive: each is rebuilt in place


@dataclass(frozen=True, slots=True)
class Limits:
    """What an agent's reactions take from its configuration, the same all its life.

    Args:
        slots: this node's worker slots.
        max_workers: the job's largest world size (``--max``).
        grace_period_s: how long a worker is given to stop, or to finish.
        join_timeout_s: how long a worker waits, with its state in memory, for a round.
    """

    slots: int
    max_workers: int
    grace_period_s: float
    join_timeout_s: float


@dataclass(frozen=True, slots=True)
class AgentView:
    """What a reaction needs to know of the agent.

    Args:
        limits: its configuration's part in the reactions.
        phase: where the agent is.
        generation: the newest generation it acted on.
        workers: what its running workers are.
        placed: a round has placed this node (its workers' round is known).
        restarts: the node's restart budget.
        trained: the last step its workers committed, None if unknown.
        held: this node's hold in force, in words (``drain: <reason>``), "" if none.
        now: monotonic seconds when the view was taken (the crash-loop window).
    """

    limits: Limits
    phase: AgentPhase
    generation: int
    workers: WorkerMode
    placed: bool
    restarts: RestartBudget
    trained: int | None
    held: str = ""
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class EndedWorker:
    """A worker's exit, with what the agent knew of that worker when it ended.

    Args:
        exit: the exit.
        ours: the worker is of the node's current group (not of one stopped on purpose).
        leaving: it was told to leave at a step boundary.
        standing_by: a replacement not placed in a round yet.
        in_place: it said hello (efdl-aware).
        all_ended: every worker of the group has ended.
        all_clean: every exit of the group, this one included, has code 0.
        error: its error's summary (the exception, then the stack), '' if none.
    """

    exit: WorkerExit
    ours: bool
    leaving: bool
    standing_by: bool
    in_place: bool
    all_ended: bool
    all_clean: bool
    error: str = ""


# ---------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class EnterRound:
    """Take ``round``'s generation as the newest (the log's context, the metrics, timers)."""

    round: Round


@dataclass(frozen=True, slots=True)
class ReadProgress:
    """Learn the job's newest committed step from etcd (kept as it was if etcd fails)."""


@dataclass(frozen=True, slots=True)
class Follow:
    """``round`` placed this node: it is the round its workers run."""

    round: Round


@dataclass(frozen=True, slots=True)
class RebuildInPlace:
    """Place the running workers in ``round``, start local ranks missing, send the rest away."""

    round: Round


@dataclass(frozen=True, slots=True)
class HandOver:
    """Follow-up: give this node's workers their part in ``round`` (:func:`hand_over`)."""

    round: Round


@dataclass(frozen=True, slots=True)
class JudgeFailure:
    """Follow-up: a worker failed (``exit``, with ``error``); judge whether the node restarts
    it (:func:`judge_failure`); ``in_place``: it is replaced alone, its peers going on."""

    exit: WorkerExit
    error: str
    in_place: bool


@dataclass(frozen=True, slots=True)
class StartWorkers:
    """Start workers for ``local_ranks`` of ``round``."""

    round: Round
    local_ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StartReplacement:
    """Start a replacement for ``local_rank`` in the workers' round; it stands by, connected,
    until a round places it, and the node offers one worker fewer until it says hello."""

    local_rank: int


@dataclass(frozen=True, slots=True)
class StopWorkers:
    """Stop every worker (``grace_s``: how long each has to exit; None: the grace period)."""

    grace_s: float | None = None


@dataclass(frozen=True, slots=True)
class AwaitWorkers:
    """Wait up to ``timeout_s`` for every worker to exit by itself."""

    timeout_s: float


@dataclass(frozen=True, slots=True)
class AwaitFinish:
    """Give the workers the grace period to finish; past it, stop them and end."""


@dataclass(frozen=True, slots=True)
class TellWaiting:
    """Tell every running worker that the job waits, up to ``timeout_s``."""

    timeout_s: float


@dataclass(frozen=True, slots=True)
class TellLeave:
    """Tell every running worker to leave at its next step boundary."""


@dataclass(frozen=True, slots=True)
class MarkPause:
    """Training stands still from the workers' last step until the restarted ones step."""


@dataclass(frozen=True, slots=True)
class NoteExit:
    """Keep the exit code of ``local_rank``."""

    local_rank: int
    code: int


@dataclass(frozen=True, slots=True)
class Dismiss:
    """Worker ``pid`` left as it was asked (or stood by, unplaced): forget it."""

    pid: int


@dataclass(frozen=True, slots=True)
class Detach:
    """Worker ``pid`` failed in place: drop it, its peers go on without it."""

    pid: int


@dataclass(frozen=True, slots=True)
class DropWorkers:
    """Every worker ended: the node has no group any more."""


@dataclass(frozen=True, slots=True)
class ReportCrash:
    """Log a failed worker's error and record its crash in the job's history."""

    exit: WorkerExit
    error: str


@dataclass(frozen=True, slots=True)
class CountRestart:
    """Keep ``budget``: the restart just judged is spent."""

    budget: RestartBudget


@dataclass(frozen=True, slots=True)
class HoldOut:
    """Hold this node out of the job (efdl.rendezvous.holds) with ``reason``: the leader's
    next round leaves it out, its workers leave at a step boundary, and it waits (a
    quarantine: for ``ttl_s``, default ``--quarantine-ttl``). If etcd does not take the hold,
    run ``otherwise`` (what the node would have done without it)."""

    kind: HoldKind
    reason: str
    otherwise: tuple[Action, ...] = ()
    ttl_s: float | None = None


@dataclass(frozen=True, slots=True)
class RefillSoon:
    """Refill the warm pool as soon as the next workers start: a second round is likely near."""


@dataclass(frozen=True, slots=True)
class HoldRestart:
    """Ask for a round of the same members if none comes soon (a dead peer's brings one)."""


@dataclass(frozen=True, slots=True)
class ReportFailure:
    """Tell the rendezvous that ``generation``'s workers failed: the nodes are probed."""

    generation: int


@dataclass(frozen=True, slots=True)
class LeaveRendezvous:
    """Leave the rendezvous (this node's record goes): the others' next round is without it."""


@dataclass(frozen=True, slots=True)
class Record:
    """Write an event of ``kind`` into the job's history."""

    kind: EventKind
    generation: int
    text: str


@dataclass(frozen=True, slots=True)
class Say:
    """Log ``message`` (a sentence) at ``level``, after the agent's job, node and generation."""

    level: int
    message: str


@dataclass(frozen=True, slots=True)
class FinishJob:
    """This node's workers finished: end the job as finished in etcd, then end the agent."""


@dataclass(frozen=True, slots=True)
class EndAgent:
    """End the agent with exit ``code``; ``message`` says why."""

    code: int
    message: str


@dataclass(frozen=True, slots=True)
class EndLeft:
    """End the agent that left on ``signum``: its code says whether the job goes on without
    it (efdl.launcher.agent.leave_code); ``finished``: the job had finished before."""

    signum: int
    what: str
    finished: bool


Action = (
    EnterRound
    | ReadProgress
    | Follow
    | RebuildInPlace
    | HandOver
    | JudgeFailure
    | StartWorkers
    | StartReplacement
    | StopWorkers
    | AwaitWorkers
    | AwaitFinish
    | TellWaiting
    | TellLeave
    | MarkPause
    | NoteExit
    | Dismiss
    | Detach
    | DropWorkers
    | ReportCrash
    | CountRestart
    | HoldOut
    | RefillSoon
    | HoldRestart
    | ReportFailure
    | LeaveRendezvous
    | Record
    | Say
    | FinishJob
    | EndAgent
    | EndLeft
)


@dataclass(frozen=True, slots=True)
class Reaction:
    """The agent's phase after an event, and the actions to run for it, in order."""

    phase: AgentPhase
    actions: tuple[Action, ...] = ()


# ---------------------------------------------------------------- reactions


def how_ended(code: int) -> str:
    """How a worker process ended, from its exit status (negative: the signal)."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _sticky(phase: AgentPhase) -> bool:
    return phase in (AgentPhase.FINISHING, AgentPhase.LEAVING)


def on_round(view: AgentView, r: Round) -> Reaction:
    """A served round ``r``: once per generation, stop or end on a final one, keep in-place
    workers waiting on a waiting one, else rebuild the workers in place or restart them
    with their new ranks (none on a node the round left out)."""
    if r.generation <= view.generation:
        return Reaction(view.phase)
    phase = view.phase if _sticky(view.phase) else AgentPhase.FOLLOWING
    enter = EnterRound(r)
    if r.status is RoundStatus.CLOSED:
        return Reaction(
            phase, (enter, StopWorkers(), EndAgent(0, f"The job was stopped ({r.reason})."))
        )
    if r.status is RoundStatus.FAILED:
        return Reaction(phase, (enter, StopWorkers(), EndAgent(1, f"The job failed: {r.reason}.")))
    if r.status is RoundStatus.FINISHED:
        if view.workers is WorkerMode.NONE:
            return Reaction(
                AgentPhase.FINISHING, (enter, EndAgent(0, f"The job finished ({r.reason})."))
            )
        waiting = Say(logging.INFO, "the job finished elsewhere; waiting for this node's workers.")
        return Reaction(AgentPhase.FINISHING, (enter, waiting, AwaitFinish()))
    if r.status is RoundStatus.WAITING:
        # In-place workers wait for the next round with their state in memory, as long as
        # their wait for a placement may last.
        # A held node's are told to leave instead: the wait is not for it.
        keep: Action = (
            (TellLeave() if view.held else TellWaiting(view.limits.join_timeout_s))
            if view.workers is WorkerMode.IN_PLACE
            else StopWorkers()
        )
        return Reaction(phase, (enter, keep, Say(logging.INFO, f"the job waits: {r.reason}.")))
    # Its workers are told how far the job got (a generation of newcomers only must not
    # start over from step 0, nor stale holders roll it back): one small read per round, by
    # spares too, so that a spare placed after etcd forgot the record still knows.
    actions: list[Action] = [enter, ReadProgress()]
    if r.member is not None:
        actions.append(Follow(r))
    return Reaction(phase, (*actions, HandOver(r)))


def hand_over(view: AgentView, r: Round) -> Reaction:
    """Give this node's workers their part in the active round ``r`` (the follow-up of
    :func:`on_round`): efdl-aware ones are rebuilt in place; plain ones are stopped and
    started again with their new ranks, none on a node the round left out."""
    if view.workers is WorkerMode.IN_PLACE:
        return Reaction(view.phase, (RebuildInPlace(r),))
    phase = view.phase
    actions: list[Action] = [StopWorkers(), MarkPause()]
    member = r.member
    if member is not None:
        return Reaction(phase, (*actions, StartWorkers(r, tuple(range(member.workers)))))
    most = view.limits.max_workers
    if view.held:
        why = (
            f"this node is held out of the job ({view.held}); it waits, not placed, until "
            "the hold is released (efdl release) or ends."
        )
    elif r.world_size + view.limits.slots > most:
        why = f"this node is a spare (the job has {r.world_size} workers; --max {most})."
    else:  # a round decided before this node joined: the next one adds it
        why = (
            f"round {r.generation} (world size {r.world_size}) was decided without this node; "
            "waiting for the round that adds it."
        )
    return Reaction(phase, (*actions, Say(logging.INFO, why)))


def on_exit(view: AgentView, ended: EndedWorker) -> Reaction:
    """A worker ended: forget one that left as asked; when all ended cleanly, the job is
    done; a failure is replaced in place, or restarts the workers, while the restart budget
    lasts and the error is not the last one again (efdl.launcher.restarts)."""
    e = ended.exit
    if not ended.ours:
        return Reaction(view.phase)  # a worker of a group stopped on purpose
    if ended.leaving or (ended.standing_by and e.code == 0):
        # It left at a step boundary, as asked, or a replacement was sent away before a round
        # placed it.
        return Reaction(view.phase, (Dismiss(e.pid),))
    note = NoteExit(e.local_rank, e.code)
    if e.code != 0:
        return _failed(view, ended, note)
    if not (ended.all_ended and ended.all_clean):
        return Reaction(view.phase, (note,))
    if view.phase is AgentPhase.FINISHING:
        done = EndAgent(0, "This node's workers finished; the job is done.")
        return Reaction(view.phase, (note, DropWorkers(), done))
    return Reaction(view.phase, (note, DropWorkers(), FinishJob()))


def _failed(view: AgentView, ended: EndedWorker, note: NoteExit) -> Reaction:
    e = ended.exit
    in_place = ended.in_place and view.placed  # the others roll back and go on
    actions: list[Action] = [
        note,
        ReportCrash(e, ended.error),
        Detach(e.pid) if in_place else StopWorkers(min(view.limits.grace_period_s, 5.0)),
    ]
    if view.phase is AgentPhase.FINISHING:
        how = how_ended(e.code)
        ends = EndAgent(1, f"Worker rank {e.rank} failed with {how} after the job finished.")
        return Reaction(view.phase, (*actions, ends))
    return Reaction(view.phase, (*actions, JudgeFailure(e, ended.error, in_place)))


def judge_failure(view: AgentView, failure: JudgeFailure) -> Reaction:
    """Whether the node restarts after a worker's failure (the follow-up of
    :func:`on_exit`, judged on the last step trained once the failed workers stopped):
    replace the worker in place, or ask for a round that restarts the workers, while the
    restart budget lasts and the error is not the last one again; else leave the job."""
    e, in_place = failure.exit, failure.in_place
    how = how_ended(e.code)
    first_line = (failure.error.splitlines() or [""])[0]
    judged = view.restarts.judge(e.code, failure.error, view.trained, view.now)
    failed = f"Worker rank {e.rank} failed with {how}{': ' + first_line if first_line else ''}"
    if judged.verdict is Verdict.QUARANTINE:
        window = view.restarts.window_s
        reason = (
            f"crash loop: workers failed {judged.repeats} times within {window:g} s with "
            f"{how}{': ' + first_line if first_line else ''}"
        )
        said = (
            f"{failed}, the same error {judged.repeats} times within {window:g} s "
            "(--quarantine-after): quarantining this node instead of restarting it again."
        )
        # In place, this node's other workers go on until the round that holds it out sends
        # them away at a step boundary; restarted ones were stopped already. If the hold
        # cannot be written, the node restarts as it would have without it.
        otherwise: tuple[Action, ...] = (
            (StartReplacement(e.local_rank),)
            if in_place
            else (ReportFailure(view.generation), HoldRestart())
        )
        hold = HoldOut(HoldKind.QUARANTINE, reason, otherwise)
        return Reaction(view.phase, (CountRestart(judged.budget), Say(logging.ERROR, said), hold))
    if judged.verdict is Verdict.REPEATED:
        message = (
            f"{failed}, the same error as the last failure, with no step trained since: a "
            "restart would fail the same way, so this node leaves the job (fix the error "
            "and start it again)."
        )
        return Reaction(view.phase, (EndAgent(1, message),))
    if judged.verdict is Verdict.EXHAUSTED:
        message = (
            f"{failed}; this node has used all {view.restarts.max_restarts} restarts "
            "(--max-restarts), so it leaves the job."
        )
        return Reaction(view.phase, (EndAgent(1, message),))
    count = f"restart {judged.budget.used} of {view.restarts.max_restarts}"
    what = "replacing the worker in place" if in_place else "restarting the workers"
    said = (
        "replacing the failed worker; the others go on without it"
        if in_place
        else "restarting the workers"
    )
    actions: list[Action] = [
        CountRestart(judged.budget),
        RefillSoon(),
        Record(EventKind.RESTART, view.generation, f"{what} ({count})"),
        Say(logging.WARNING, f"{said} ({count})."),
    ]
    if in_place:
        # Shrink, then grow: the node offers one worker fewer until the replacement, started
        # now, says it is ready; it waits for a round that places it.
        return Reaction(view.phase, (*actions, StartReplacement(e.local_rank)))
    # A peer's death may be what killed it (restart mode): have the nodes probed, and ask for
    # a round of the same members only if none comes meanwhile.
    phase = view.phase if _sticky(view.phase) else AgentPhase.RESTARTING
    return Reaction(phase, (*actions, ReportFailure(view.generation), HoldRestart()))


def on_signal(view: AgentView, signum: int) -> Reaction:
    """A signal to leave (SIGTERM, SIGINT, ``--signals-to-handle``): leave gracefully.
    In-place workers pause with everyone at a step boundary, commit and exit, the rendezvous
    left at once so that the others' new round pauses them at the same step as ours (the
    pause agreement takes the max of all flags) and nobody waits for our interpreters."""
    name = signal.Signals(signum).name
    actions: list[Action] = [
        Record(EventKind.LEAVE, view.generation, f"leaving on {name}"),
        Say(
            logging.INFO,
            f"{name}: leaving gracefully (grace period {view.limits.grace_period_s:.0f} s).",
        ),
    ]
    if view.workers is WorkerMode.IN_PLACE:
        actions += [TellLeave(), LeaveRendezvous(), AwaitWorkers(view.limits.grace_period_s)]
    finished = view.phase is AgentPhase.FINISHING
    actions += [
        StopWorkers(),
        LeaveRendezvous(),
        EndLeft(signum, f"Left the job on {name}", finished),
    ]
    return Reaction(AgentPhase.LEAVING, tuple(actions))

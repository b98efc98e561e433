"""What reaches the agent's loop: one queue, the kinds of event on it, and how a worker's
message gets there.

Everything that happens to a node reaches its agent as an event on one queue, handled on
the main thread (efdl.launcher.agent): the kinds are :data:`AgentEvent`. The rendezvous,
the lease, the hang judge and the signal handler post the kinds defined here; the workers'
processes post their exits (efdl.launcher.workers.WorkerExit); the workers' messages
(efdl.protocol.messages) arrive on the channel's threads, where :class:`WorkerReports`
takes what needs no loop and posts the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from efdl.launcher.health import Finding
from efdl.launcher.job_progress import JobProgress
from efdl.launcher.metrics import Metrics
from efdl.launcher.workers import WorkerExit
from efdl.protocol.messages import (
    Agreed,
    Hello,
    Paced,
    PeerFailed,
    Persisted,
    Rescaled,
    ResumedFromCache,
    StateLost,
    Stepped,
    ToAgent,
)
from efdl.rendezvous.event_log import EventLog
from efdl.rendezvous.holds import Hold
from efdl.rendezvous.records import Event, EventKind, Round
from efdl.worker.hang import Hang


@dataclass(frozen=True, slots=True)
class RoundSeen:
    """The rendezvous saw a new served round."""

    round: Round


@dataclass(frozen=True, slots=True)
class SignalReceived:
    """The agent's process got signal ``signum`` (one it handles: it leaves the job)."""

    signum: int


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """etcd said this node's lease has expired; the rendezvous registers it again."""

    reason: str


@dataclass(frozen=True, slots=True)
class EtcdSilent:
    """etcd has not answered for a lease TTL: no round can come until it does."""


@dataclass(frozen=True, slots=True)
class Reached:
    """The agent reached etcd again (monotonic ``at``) after its workers' fence closed."""

    at: float


@dataclass(frozen=True, slots=True)
class RendezvousFailed:
    """The rendezvous cannot go on (``reason``): the agent ends with code 1."""

    reason: str


@dataclass(frozen=True, slots=True)
class Hung:
    """An in-place worker made no step for the hang timeout while a peer waited on it
    (efdl.launcher.hangs)."""

    pid: int
    hang: Hang


@dataclass(frozen=True, slots=True)
class HoldChanged:
    """This node's hold, as it is now (None: none): written, renewed or released
    (efdl.launcher.holding)."""

    hold: Hold | None


@dataclass(frozen=True, slots=True)
class HealthFound:
    """A health check found something wrong with this node (efdl.launcher.health)."""

    findings: tuple[Finding, ...]


AgentEvent = (
    RoundSeen
    | HoldChanged
    | HealthFound
    | SignalReceived
    | LeaseLost
    | EtcdSilent
    | Reached
    | RendezvousFailed
    | Hung
    | WorkerExit
    | Hello
    | Persisted
    | Stepped
    | PeerFailed
    | Paced
    | StateLost
    | Event  # one for the job's history, made on a channel thread
)


class WorkerReports:
    """Takes a worker's message on the channel's thread: a commit moves the node's view of
    the job on at once (and the metrics, and, on rank 0's node, the progress record); a
    resume or a rescale becomes an event for the history; the rest go to the loop as they
    are. Only reads and writes of single attributes here: the loop runs meanwhile.

    Args:
        post: puts an event on the agent's queue.
        history: the job's history, which makes the events.
        metrics: the node's metrics.
        progress: the node's view of the job's progress.
        generation: the newest generation the agent acted on.
        publishes: whether this node runs rank 0 (it publishes the job's progress).
    """

    def __init__(
        self,
        post: Callable[[AgentEvent], None],
        history: EventLog,
        metrics: Metrics,
        progress: JobProgress,
        generation: Callable[[], int],
        publishes: Callable[[], bool],
    ) -> None:
        self._post = post
        self._history = history
        self._metrics = metrics
        self._progress = progress
        self._generation = generation
        self._publishes = publishes
        self.trained: int | None = None  # the last step local rank 0 reported committed
        self.trained_at = 0.0  # when (wall clock)

    def __call__(self, msg: ToAgent) -> None:
        if isinstance(msg, Hello | Persisted | Stepped | PeerFailed | Paced | StateLost):
            self._post(msg)
        elif isinstance(msg, Agreed):
            self.trained, self.trained_at = msg.step, time.time()
            self._metrics.progress(msg.step)  # thread-safe: no need for the main thread
            # Every rank of the generation committed `agreed`.
            self._progress.agreed(msg.generation, msg.agreed, self._publishes())
        elif isinstance(msg, ResumedFromCache):
            text = f"resumed from the snapshot of step {msg.step} in {msg.source}"
            self._post(
                self._history.event(EventKind.RESUME, self._generation(), text, step=msg.step)
            )
        elif isinstance(msg, Rescaled):
            text = f"training went on at world size {msg.world_size}"
            event = self._history.event(
                EventKind.RESCALE, msg.generation, text, msg.world_size, msg.step, msg.stood_still
            )
            self._post(event)

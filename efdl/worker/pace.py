"""Who sets the pace: each node's own share of a synchronous step, seen from the commits.

In a synchronous step every rank takes as long as the slowest: the others wait for it in the
gradient all-reduce, so the step's length says nothing of who is slow. What a rank did *not*
spend waiting is what it took itself: its **busy time**, per step, is the time from its last
commit to this one less the time it stood at the end of backward waiting for its peers (from
its own last gradient ready, a parameter's post-accumulate-grad hook, to its optimizer step's
start: DDP's reducer waits there for the last buckets' all-reduce, which a fast rank waits
out for the slow one, and the slow one only for the transfer).

Each rank puts its busy time, in microseconds, into its node's slot of the commit agreement
(efdl.worker.commit: the all-reduce every commit starts anyway, with MAX, so a node's slot
holds its slowest rank), and every rank reads every node's busy time one commit later: no
extra synchronisation. :class:`Pace` keeps the last ``window`` steps of a generation; every
``window`` steps a node's local rank 0 tells its agent its **ratio**: the median of its own
node's busy times over the window against the median of the other nodes' (a median of
medians: one slow step, an evaluation or a checkpoint save on one rank, does not move it).
The agent judges (:func:`verdict`): a node is slow when its ratio is at least the threshold
(``--straggler-ratio``) and its excess at least :data:`MIN_EXCESS_S`.

What it can tell: a node whose own work is slower (a throttled or failing GPU, a starved
CPU, a slow data loader on that host). What it cannot: a slow network link between two nodes
makes every rank wait in the all-reduce alike (a ring runs at its slowest link), so no node
stands out; nor a rank slow only in work outside efdl's DDP wrapper's backward (FSDP2's
collectives are waited on inside backward and forward: there the busy time is the whole
step on every rank, and nothing is named).

Torch-free (the agent imports :func:`verdict`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from efdl.protocol.env import MIN_STRAGGLER_WINDOW as MIN_WINDOW
from efdl.protocol.env import STRAGGLER_WINDOW_ENV

DEFAULT_WINDOW = 20  # steps per judgment (--straggler-window)
DEFAULT_RATIO = 1.5  # a node this many times slower than the rest is slow (--straggler-ratio)
MIN_EXCESS_S = 0.01  # and at least this much slower per step: no verdict on millisecond noise


def pace_window() -> int:
    """The window the agent set (``EFDL_STRAGGLER_WINDOW``), or the default."""
    raw = os.environ.get(STRAGGLER_WINDOW_ENV, "")
    try:
        window = int(raw) if raw else DEFAULT_WINDOW
    except ValueError:
        window = 0
    if window < MIN_WINDOW:
        raise ValueError(
            f"{STRAGGLER_WINDOW_ENV}={raw!r}; expected a whole number of steps, at least "
            f"{MIN_WINDOW}."
        )
    return window


class StepClock:
    """One rank's busy time per step: commit to commit, less the wait at the end of backward."""

    def __init__(self) -> None:
        self._last_commit: float | None = None
        self._grad_at: float | None = None  # the last gradient ready in this step
        self._waited = 0.0

    def grad_ready(self, *_: object) -> None:
        """A parameter's gradient is accumulated (a post-accumulate-grad hook)."""
        self._grad_at = time.monotonic()

    def step_started(self) -> None:
        """The optimizer step starts: backward, and its wait for the peers, is over."""
        if self._grad_at is not None:
            self._waited += max(0.0, time.monotonic() - self._grad_at)
            self._grad_at = None

    def committed(self) -> float | None:
        """This rank's busy seconds since its last commit; None at the first one (or the
        first after :meth:`restart`)."""
        now = time.monotonic()
        busy = None
        if self._last_commit is not None:
            busy = max(0.0, now - self._last_commit - self._waited)
        self._last_commit, self._waited, self._grad_at = now, 0.0, None
        return busy

    def restart(self) -> None:
        """A new generation: the time until its first commit is a rebuild, not a step."""
        self._last_commit, self._waited, self._grad_at = None, 0.0, None


def slots(nodes: int, node: int, busy_s: float | None) -> list[int]:
    """This rank's words for the agreement: ``nodes`` slots, its own node's holding its busy
    microseconds (0 where unknown: MAX keeps its peers')."""
    out = [0] * nodes
    if busy_s is not None:
        out[node] = max(1, round(busy_s * 1e6))
    return out


@dataclass(frozen=True, slots=True)
class NodePace:
    """One node's pace over a window: its median busy seconds per step and the others'."""

    node_s: float
    others_s: float
    steps: int
    slower: int = 0  # other nodes slower still (equal medians: the lower index is slower)

    @property
    def ratio(self) -> float:
        return self.node_s / self.others_s if self.others_s > 0 else 1.0


class Pace:
    """The last ``window`` steps' busy times of every node of a generation."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < MIN_WINDOW:
            raise ValueError(
                f"The straggler window is {window} steps; expected at least {MIN_WINDOW}."
            )
        self.window = window
        self._rows: deque[tuple[int, ...]] = deque(maxlen=window)
        self._seen = 0

    def reset(self) -> None:
        self._rows.clear()
        self._seen = 0

    def add(self, agreed_slots: Sequence[int]) -> bool:
        """One step's agreed slots (microseconds per node; 0: unknown). True when a whole
        new window has come in (time to judge)."""
        if not agreed_slots or min(agreed_slots) <= 0:
            return False  # a first commit somewhere: not a step
        self._rows.append(tuple(agreed_slots))
        self._seen += 1
        return self._seen % self.window == 0

    def of_node(self, node: int) -> NodePace | None:
        """``node``'s pace over the window against the other nodes'; None with one node or
        no whole window."""
        if len(self._rows) < self.window or len(self._rows[0]) < 2:
            return None
        width = len(self._rows[0])
        medians = [statistics.median(r[i] for r in self._rows) / 1e6 for i in range(width)]
        others = [m for i, m in enumerate(medians) if i != node]
        mine = (medians[node], -node)
        slower = sum(1 for i, m in enumerate(medians) if i != node and (m, -i) > mine)
        return NodePace(medians[node], statistics.median(others), len(self._rows), slower)


def verdict(node_s: float, others_s: float, ratio: float) -> bool:
    """Whether a node whose steps take ``node_s`` of its own against the others' ``others_s``
    is slow at threshold ``ratio``."""
    return others_s > 0 and node_s >= ratio * others_s and node_s - others_s >= MIN_EXCESS_S

"""Each rank's verdict on its steps' communication: a step counts only where it succeeded.

On gloo a collective returns only when it is done (or raises), so a step that reaches
``commit()`` had its communication succeed on this rank, and every commit is verified at once.
On NCCL, ``backward()`` only enqueues the gradient all-reduce and ``optimizer.step()`` after it:
a collective that a failure ends early (a dead peer, an abort, the watchdog's timeout) leaves
the already enqueued update to run on partial gradients, on some ranks and not on others, and
the CPU reaches ``commit()`` long before the GPU knows. So there each ``commit()`` records a
CUDA event on the current stream (no synchronisation), and a step is *verified* once its event
has completed while the group reported no error (``ProcessGroupNCCL.get_error()``); the next
commits ask, without waiting (``DeviceEvent.query()``).

What a verdict changes:

- the per-commit agreement carries a ``FAILED`` flag: a rank whose group reported an error
  makes every rank pause at the same commit (efdl.worker.state), so no rank trains on after a
  step some rank saw fail;
- after a failure, a rank that holds steps not verified before the error (its update may have
  run on torn gradients) holds no step: it is torn, and receives the state from a rank whose
  steps were verified (or from the remote cache); the holders' digests are compared too
  (efdl.worker.digest).

Cost: nothing on gloo; on NCCL one event record and a few ``query()`` calls per step, and one
wait of about two steps' time after a failure for the work still running (work that waits
on a dead peer never ends by itself: its steps are then suspect, not waited for).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

# The least time given a failed step's work to end (a step's time may be unknown).
_MIN_WAIT_S = 1.0


class DeviceEvent(Protocol):
    """What efdl needs of a CUDA event (``torch.cuda.Event``)."""

    def query(self) -> bool: ...


class Verdicts:
    """This rank's record of which committed steps' communication succeeded.

    Args:
        errored: whether the group has reported a communication error (NCCL: ``get_error()``
            is not SUCCESS; any backend: efdl cut the group itself).
        event: records an event after the work enqueued so far; None where the backend
            blocks (a step that reaches ``commit()`` is verified there).
    """

    def __init__(
        self, errored: Callable[[], bool], event: Callable[[], DeviceEvent | None]
    ) -> None:
        self._errored = errored
        self._event = event
        self._pending: deque[tuple[int, DeviceEvent]] = deque()  # (step, its event), oldest first
        self.verified = 0  # the newest step known to have succeeded here
        self.failed = False  # the group reported an error while steps were unverified
        self._last_commit: float | None = None
        self._gap = 0.0  # seconds between the last two commits: about one step's work

    def committed(self, step: int) -> None:
        """``commit()`` counted ``step``: record it, and settle what has completed since."""
        now = time.monotonic()
        if self._last_commit is not None:
            self._gap = now - self._last_commit
        self._last_commit = now
        event = self._event()
        if event is None:  # nothing can fail after a blocking collective returned
            self.verified = step
            return
        self._pending.append((step, event))
        self.settle()

    def settle(self) -> None:
        """Mark the completed steps verified, unless the group reports an error: then every
        step not verified before it is suspect (``failed``).

        The events are asked first and the group second: an abort between the two ends the
        work early (its event completes, on torn data) and is then seen as the error. Asked
        the other way round, a step whose work an abort ended just after a clean error check
        would count as verified."""
        if self.failed or not self._pending:
            return
        done = 0
        for _, event in self._pending:
            if not event.query():
                break
            done += 1
        if self._errored():
            self.failed = True
            return
        for _ in range(done):
            self.verified = self._pending.popleft()[0]

    def after_failure(self, timeout_s: float) -> None:
        """A collective failed: settle once the steps' work has ended, waiting about two
        steps' time (at most ``timeout_s``) for it. Work still running then waits on a dead
        or hung peer; the abort that follows ends it early, on torn data, so its steps are
        suspect (``failed``). Waiting longer would only delay the rebuild."""
        limit = min(timeout_s, _MIN_WAIT_S + 2 * self._gap)
        deadline = time.monotonic() + limit
        while self._pending and not self.failed and time.monotonic() < deadline:
            self.settle()
            if self._pending:
                time.sleep(0.005)
        self.settle()
        if self._pending:
            self.failed = True

    def holds(self, step: int) -> bool:
        """Whether this rank's tensors at ``step`` may be trusted: nothing failed here, or
        every step up to ``step`` was verified before it did."""
        return not self.failed or self.verified >= step

    def reset(self, step: int) -> None:
        """A sync made this rank hold ``step`` (received, or found whole): a fresh start."""
        self._pending.clear()
        self.verified, self.failed = step, False
        self._last_commit = None

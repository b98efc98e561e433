"""The agent's side of the fence: its workers commit only while it reaches etcd.

The deadline itself is a file the workers read (efdl.worker.fence.FenceWriter; docs/
rendezvous.md, "Fencing"). Here is what the agent does with it: it moves the deadline on
each time it reaches etcd; efdl-aware workers stop at their own commits past it, while
plain workers, which have none, are stopped (SIGSTOP, their state in memory) until the
agent reaches etcd again, and are killed, not woken, if a round replaces them meanwhile.
Once the fence has closed, it opens again only if the round the workers run is still the
job's.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path

from efdl.errors import StoreError
from efdl.launcher.inbox import Reached
from efdl.launcher.node_workers import NodeWorkers
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.reading import parse_round
from efdl.rendezvous.records import JobKeys
from efdl.worker.fence import FenceWriter

log = logging.getLogger(__name__)

THAW_CHECK_S = 0.5  # how often the agent looks at a fence that holds its workers stopped


class WorkerFence:
    """The fence of this node's workers.

    Args:
        path: the fence's file (in the agent's private directory).
        timeout_s: the fence timeout F (``--fence-timeout``).
        workers: this node's workers.
        store: the etcd store, to read the job's round before the fence opens again.
        job_id: the job.
        post: puts :class:`Reached` on the agent's queue.
        tag: says the job, node and generation, for the log.
    """

    def __init__(
        self,
        path: Path,
        timeout_s: float,
        workers: NodeWorkers,
        store: KVStore,
        job_id: str,
        post: Callable[[Reached], None],
        tag: Callable[[], str],
    ) -> None:
        self._writer = FenceWriter(path, timeout_s)
        self._workers = workers
        self._store = store
        self._keys = JobKeys(job_id)
        self._post = post
        self._tag = tag
        self.frozen: set[int] = set()  # plain workers stopped by the fence

    @property
    def path(self) -> Path:
        return self._writer.path

    def contact(self, at: float) -> None:
        """From the lease's thread: this agent reached etcd at monotonic ``at``. While the
        fence is open this moves it on; once it has closed, the agent's loop first checks
        that the round its workers run is still the job's (:meth:`reopen`)."""
        if self._writer.open():
            self._writer.reached(at)
        else:
            self._post(Reached(at))

    def reopen(self, at: float) -> None:
        """The fence closed, and etcd answers again: let the workers commit again if the
        round they run is still the job's (one read of the round key). If a newer round
        replaced it (even one this node has already acted on: its old workers may not have
        left yet), they stay fenced: that round's news (a placement, or leave) reaches them
        from the agent's loop, and nothing of the old generation commits meanwhile."""
        if self._writer.open():
            self._writer.reached(at)
            return
        if self._workers.running():
            r = self._workers.round
            try:
                current = parse_round(self._store.get(self._keys.round), self._keys)
            except StoreError as exc:  # the next contact tries again
                log.warning("%s: could not read the round to lift the fence: %s", self._tag(), exc)
                return
            if r is None or current is None or current.round_id != r.round_id:
                log.warning(
                    "%s: etcd answers again, but round %s is not the one this node's workers "
                    "run (%s): they stay fenced until its news reaches them.",
                    self._tag(),
                    current.generation if current is not None else "(none)",
                    r.generation if r is not None else "none",
                )
                return
        self._writer.reached(at)
        log.warning("%s: etcd answers again; the workers' fence is open.", self._tag())
        self.apply()

    def due(self) -> float | None:
        """When (monotonic) to look at the fence next (plain workers only: efdl-aware ones
        stop at their own commits): when it closes, or, while it holds them stopped, twice a
        second."""
        if not self._workers.plain():
            return None
        if self.frozen:
            return time.monotonic() + THAW_CHECK_S
        return self._writer.deadline

    def apply(self) -> None:
        """Stop this node's plain workers (SIGSTOP, state in memory) while the agent has not
        reached etcd for the fence timeout, and let them go on (SIGCONT) once it has; a round
        that replaced them stops them for good meanwhile."""
        if self._workers.group is None:
            return
        plain = self._workers.plain()
        if not self._writer.open() and not self.frozen and plain:
            for w in plain:
                w.signal_group(signal.SIGSTOP)
                self.frozen.add(w.pid)
            log.warning(
                "%s: this agent has not reached etcd for %.0f s (--fence-timeout): its "
                "workers %s are stopped (SIGSTOP, state in memory) until it does, since a "
                "leader may replace a generation cut off from etcd.",
                self._tag(),
                self._writer.timeout_s,
                [w.pid for w in plain],
            )
        elif self.frozen and self._writer.open():
            for w in self._workers.running():
                if w.pid in self.frozen:
                    w.signal_group(signal.SIGCONT)
            log.warning("%s: etcd answers again; workers %s go on.", self._tag(), self.frozen)
            self.frozen.clear()

    def kill_frozen(self) -> None:
        """The workers are being stopped: a worker the fence stopped is killed, not woken:
        woken to take a signal, it would run on a moment in a generation that may have been
        replaced."""
        for w in self._workers.running():
            if w.pid in self.frozen:
                w.signal_group(signal.SIGKILL)
        self.frozen.clear()

    def close(self) -> None:
        self._writer.close()

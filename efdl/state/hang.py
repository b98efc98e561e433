"""Find a hung worker: one that makes no step while a peer waits on it.

A worker whose main thread is stuck outside any collective (a DataLoader deadlock, a process
stuck in the CUDA driver after a GPU fault, a sleep) still answers its agent and is counted
in for every new generation; its peers wait in their next collective until it times out,
and then the healthy ones fail. So each in-place worker watches its own progress on a thread
of its own. Once it has made no commit for the hang timeout (in a new generation: since its
state was synced and its training function called), and a peer has entered a collective that
it has not entered itself, it is the rank the others wait on: it tells its agent, which kills
it and reports it down; the job shrinks, then grows back with a replacement
(efdl.launcher.agent). A rank stuck at its first batch after a rescale (a DataLoader worker
that waits on a read) is one: were it spared until its first commit, its peers would fail
at every generation and their nodes leave, and it would hold the job alone.

"Entered" is counted by the collectives' sequence numbers (every process group counts the
collectives it was asked for, in the same order on every rank). A rank that has stood still
for a while marks its count on the generation's c10d store, and looks for a mark one higher:
a peer stuck inside a collective marks one more than the rank it waits for. Ranks that all
stand still together (a long evaluation on every rank, a checkpoint every rank writes) mark
the same count and judge nobody.

The hang timeout is ``--hang-timeout`` (``EFDL_HANG_TIMEOUT``), or by default 90% of the
collective timeout, and at least five times the longest step seen: a rank that holds its
peers longer than that would make their collectives time out anyway, so efdl acts first and
replaces the rank that holds the job, not the ones that wait. A step slower than usual on one
rank while the others wait (rank 0's evaluation or checkpoint) is therefore allowed what the
collective timeout allows; raise both for longer ones. No rank is judged during the state
sync of a generation (a newcomer's setup before it, and the transfers in it, make peers wait
on purpose).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from efdl.state.channel import HANG_TIMEOUT_ENV

log = logging.getLogger(__name__)

STEPS = 5  # the default timeout is at least this many of the longest step seen
SHARE = 0.9  # and 90% of the collective timeout
POLL_S = 1.0  # how often the watch looks
MARK_KEY = "efdl/hang/{}"  # on the generation's store: some rank stands inside collective N


def default_timeout(collective_s: float, longest_step_s: float) -> float:
    """The hang timeout when none is set (see the module docstring)."""
    return max(SHARE * collective_s, STEPS * longest_step_s)


def entered(skip: Any = None) -> int:
    """How many collectives this process has been asked for, over all its process groups but
    ``skip`` (efdl's own side group, used at every commit)."""
    total = 0
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is skip:
            continue
        try:
            total += int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]
        except (RuntimeError, AttributeError):  # a backend without sequence numbers
            continue
    return total


class HangWatch:
    """This worker's watch over its own progress (see the module docstring).

    Args:
        report: called once (from the watch's thread) with what to tell the agent.
        collective_s: the collective timeout (seconds).
        timeout_s: the hang timeout; None: the default, from ``collective_s`` and the steps.
        active: whether the main thread trains now (inside the ``@efdl.elastic`` function):
            before and after it (evaluation, saving, exit) nothing is judged.
        clock: monotonic seconds.
        count: the collectives entered, but those of the group given (:func:`entered`).
    """

    def __init__(
        self,
        report: Callable[[dict[str, Any]], None],
        collective_s: float,
        timeout_s: float | None = None,
        active: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        count: Callable[[Any], int] = entered,
    ) -> None:
        self._report = report
        self._active = active
        self._count = count
        self._collective_s = collective_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=64)
        self._last: float | None = None  # the last commit in this generation; None: none yet
        self._since: float | None = None  # when it began to train in it (after the sync)
        self._step = 0
        self._connect: Callable[[], Any] | None = None  # the generation's store, if in one
        self._skip: Any = None
        self._store: Any = None
        self._marked = -1
        self._reported = False
        self._paused = False  # the main thread waits on purpose
        self._warned = False  # that the collective timeout is short for the steps
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def from_env(
        report: Callable[[dict[str, Any]], None],
        collective_s: float,
        active: Callable[[], bool] = lambda: True,
    ) -> HangWatch:
        """With the timeout the agent passes (``--hang-timeout``), if any."""
        raw = os.environ.get(HANG_TIMEOUT_ENV, "")
        return HangWatch(report, collective_s, float(raw) if raw else None, active)

    def timeout_s(self) -> float:
        with self._lock:
            longest = max(self._steps, default=0.0)
        if self._timeout_s is not None:
            return self._timeout_s
        timeout = default_timeout(self._collective_s, longest)
        if timeout > self._collective_s and not self._warned:
            self._warned = True
            log.warning(
                "Steps take up to %.1f s: a peer's collective times out (%.0f s) before a rank "
                "that holds it is taken for hung (%.0f s); raise the collective timeout "
                "(efdl.init_process_group(timeout_s=...)) above five steps.",
                longest,
                self._collective_s,
                timeout,
            )
        return timeout

    def set_collective_timeout(self, seconds: float) -> None:
        self._collective_s = seconds

    def committed(self, step: int) -> None:
        """A commit (the main thread): progress."""
        now = self._clock()
        with self._lock:
            if self._last is not None:
                self._steps.append(now - self._last)
            self._last, self._step = now, step

    def joined(self, connect: Callable[[], Any], skip: Any) -> None:
        """This worker is in a new generation: ``connect`` gives a client of its store;
        ``skip`` is efdl's side group. Nothing is judged until it trains in it (trains())."""
        with self._lock:
            self._connect, self._skip = connect, skip
            self._store, self._marked, self._last, self._since = None, -1, None, None
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="efdl-hang", daemon=True)
            self._thread.start()

    def trains(self) -> None:
        """The state is synced and the training function called (the main thread): from now
        on, standing still while a peer waits holds the job, before its first commit too."""
        with self._lock:
            if self._connect is not None:
                self._since = self._clock()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The main thread stands still on purpose (fenced, efdl.state.fence): judge nothing
        meanwhile; its clock starts again when it goes on."""
        with self._lock:
            self._paused = True
        try:
            yield
        finally:
            now = self._clock()
            with self._lock:
                self._paused = False
                if self._last is not None:
                    self._last = now
                if self._since is not None:
                    self._since = now

    def left(self) -> None:
        """This worker left its generation (a rescale, a failure): nothing to judge."""
        with self._lock:
            self._connect, self._store, self._last, self._since = None, None, None, None

    def close(self) -> None:
        """Stop (at exit: no store call may be under way while the interpreter ends)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                self._look()
            except Exception as exc:  # the store went with its generation: judge nothing
                log.debug("The hang watch could not look: %s", exc)
                with self._lock:
                    self._store = None

    def _look(self) -> None:
        timeout = self.timeout_s()
        with self._lock:
            last = self._last if self._last is not None else self._since
            connect, step, first = self._connect, self._step, self._last is None
            paused = self._paused
        if last is None or connect is None or self._reported or paused or not self._active():
            return
        still = self._clock() - last
        if still < min(2.0, timeout / 4):
            return
        count = self._count(self._skip)
        store = self._store or connect()
        with self._lock:
            if self._connect is not connect:  # left the generation meanwhile
                return
            self._store = store
        if count != self._marked:
            store.add(MARK_KEY.format(count), 1)
            self._marked = count
        if still < timeout or not store.check([MARK_KEY.format(count + 1)]):
            return
        self._reported = True
        log.error(
            "No step for %.0f s since %s while a peer waits in a collective this rank has "
            "not entered (hang timeout %.0f s): this rank holds the job; its agent replaces it.",
            still,
            f"its state was synced at step {step}" if first else f"step {step}",
            timeout,
        )
        self._report(
            {"type": "hung", "step": step, "stalled_s": round(still, 1), "timeout_s": timeout}
        )

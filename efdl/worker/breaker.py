"""Cut a stalled generation's connections, so a survivor need not wait out the collective timeout.

(gloo: shut its sockets down; NCCL: abort its communicators.)

A peer that dies closes its sockets and the survivors' collective fails at once. A peer that
hangs (SIGSTOP, a network partition) closes nothing: the survivors wait inside the collective
for the whole timeout (30 s by default), although their agents learn within the lease TTL that
the peer is gone and already hand out the next generation. ``ProcessGroupGloo.abort()`` does
not interrupt a pending operation (torch 2.13), but shutting its sockets down does: the
operation fails as if the peer had died, and the usual rollback and rebuild follow.

So each generation's group creation is recorded (the socket inodes it opened), every commit is
counted, and when a newer generation is ready while this worker makes no progress for a grace
period (a few step times), the older generations' sockets are shut down. A healthy worker
pauses within two commits of the new generation being ready, so only a stalled one is cut; if
a slow step is cut by mistake, it is rolled back like any failure (one step's work).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

MIN_GRACE_S = 2.0  # no cut sooner than this after the last step, whatever the step time
STEPS_OF_GRACE = 3  # nor sooner than this many of the longest recent step times


def _socket_inodes() -> dict[int, int]:
    """This process's socket file descriptors and their inodes."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (listdir's own descriptor, too)
            continue
        if link.startswith("socket:["):
            found[int(name)] = int(link[8:-1])
    return found


def _shut_down(fd: int, inode: int) -> bool:
    """Shut down the connected socket at ``fd`` if it is still the one with ``inode``; the
    descriptor itself stays with its owner (gloo), which sees the connection end."""
    try:
        dup = os.dup(fd)
    except OSError:  # closed meanwhile
        return False
    try:
        if os.fstat(dup).st_ino != inode:  # reused for something else meanwhile
            os.close(dup)
            return False
        s = socket.socket(fileno=dup)  # owns (and closes) the duplicate only
    except OSError:
        os.close(dup)
        return False
    with s:
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False  # a listener: gloo aborts the process if its accept fails
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected
            return False
    return True


class Breaker:
    """The sockets each generation's groups opened, and a watch over step progress."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._opened: dict[int, int] = {}  # socket inode -> generation
        self._aborts: dict[int, list[Callable[[], None]]] = {}  # generation -> NCCL aborts
        self._commits = 0
        self._steps: deque[float] = deque(maxlen=9)  # the last step times (s), any generation
        self._last: float | None = None  # the last commit's time; None: none since a rebuild
        self._cut_below = 0  # every generation below this one was cut

    @contextmanager
    def recording(self, generation: int) -> Iterator[None]:
        """Around making ``generation``'s groups: remember the sockets they open."""
        before = set(_socket_inodes().values())
        try:
            yield
        finally:
            opened = set(_socket_inodes().values()) - before
            with self._lock:
                self._opened.update(dict.fromkeys(opened, generation))
                self._last = None  # the first commit after the rebuild ends no step

    def on_cut(self, generation: int, abort: Callable[[], None]) -> None:
        """Call ``abort`` when ``generation`` is cut (NCCL: abort its communicators, which
        open their sockets lazily, out of ``recording``'s sight)."""
        with self._lock:
            self._aborts.setdefault(generation, []).append(abort)

    def forget(self) -> None:
        """The groups were destroyed: their descriptors may be reused by anything now."""
        with self._lock:
            self._opened.clear()
            self._aborts.clear()

    def stepped(self) -> None:
        """A commit: the worker makes progress."""
        with self._lock:
            self._commits += 1
            now = self._clock()
            if self._last is not None:
                self._steps.append(now - self._last)
            self._last = now

    def grace(self) -> float:
        """How long no commit means stalled: a few of the longest recent step times, and at
        least MIN_GRACE_S. Step times carry over rebuilds (a model whose step takes 5 s must
        not be cut 2 s into its first step in a new generation); the time from a group's
        creation to its first commit, which includes the state sync, is not a step."""
        with self._lock:
            longest = max(self._steps, default=0.0)
        return max(MIN_GRACE_S, STEPS_OF_GRACE * longest)

    def cut(self, below: int) -> int:
        """Shut down the sockets of generations older than ``below`` and abort their NCCL
        communicators; how many connections and communicators were."""
        with self._lock:
            self._cut_below = max(self._cut_below, below)
            doomed = {ino for ino, g in self._opened.items() if g < below}
            for ino in doomed:
                del self._opened[ino]
            aborts = [f for g in sorted(self._aborts) if g < below for f in self._aborts.pop(g)]
        n = sum(_shut_down(fd, ino) for fd, ino in _socket_inodes().items() if ino in doomed)
        for abort in aborts:
            try:
                abort()
                n += 1
            except Exception as exc:  # a communicator already gone: nothing left to cut
                log.warning("Aborting an older generation's communicators failed: %s", exc)
        return n

    def was_cut(self, generation: int) -> bool:
        """Whether efdl cut ``generation``'s groups itself (what its collectives raise after
        is that cut, whatever the words: efdl.worker.failure)."""
        with self._lock:
            return generation < self._cut_below

    def watch(self, generation: int, trains_older: Callable[[], bool]) -> None:
        """In the background, now that ``generation`` is ready: while ``trains_older()`` (this
        worker still trains an older one), cut the older ones if no commit comes in a grace
        period."""

        def run() -> None:
            while True:
                with self._lock:
                    seen = self._commits
                grace = self.grace()
                time.sleep(grace)
                if not trains_older():
                    return
                with self._lock:
                    stalled = self._commits == seen
                if stalled:
                    n = self.cut(below=generation)
                    if n:
                        log.warning(
                            "No step for %.1f s while generation %d waits (a peer hangs?): "
                            "shut down %d connections of the older generation.",
                            grace,
                            generation,
                            n,
                        )
                    return

        threading.Thread(target=run, name=f"efdl-breaker-{generation}", daemon=True).start()

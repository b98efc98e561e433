"""Fencing: a generation cut off from etcd stops committing before another may replace it.

A generation's collectives need all of its ranks, so a generation with a member on etcd's
side cannot train beside its successor: that member leaves it for the next round. A
generation cut off from etcd whole (its only node, or all of its nodes, while a spare or a
newcomer is not) has no such member, and would train on beside the generation that replaces
it, into the same cache. So time decides, on both sides:

- each agent knows when it last reached etcd (the send time of the newest lease refresh
  that etcd answered): its workers may commit until that time plus the fence timeout F, and
  stop after it (their state kept in memory) until the agent reaches etcd again, or tells
  them of a new round or to leave;
- a leader replaces a generation none of whose members is still on etcd's side only once F
  and a margin have passed since the last of their records went (a record goes a lease TTL
  after its node last reached etcd: the leader's wait starts later than the node's fence,
  never earlier; efdl.rendezvous.decide).

The agent writes the deadline into a small file in its private directory; a worker maps it
and reads it at each commit (one read of a page, no system call). ``CLOCK_MONOTONIC`` is one
clock for every process of a host, and it does not jump with the wall clock.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

from efdl.protocol.env import FENCE_ENV

log = logging.getLogger(__name__)

_FORMAT = struct.Struct("<d")  # the deadline: monotonic seconds


class FenceWriter:
    """The agent's side: the deadline until which its workers may commit.

    Args:
        path: the file (in the agent's private directory; made 0600).
        timeout_s: the fence timeout F.
        clock: monotonic seconds.
    """

    def __init__(
        self, path: Path, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._clock = clock
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.deadline = 0.0
        self.reached(clock())  # the agent is starting: it has just reached etcd, or exits

    def reached(self, at: float) -> None:
        """The agent reached etcd at monotonic time ``at``: its workers may commit until
        ``at`` plus the timeout. Thread-safe enough: one 8-byte write, and a deadline only
        moves on."""
        deadline = at + self.timeout_s
        if deadline <= self.deadline:
            return
        self.deadline = deadline
        os.pwrite(self._fd, _FORMAT.pack(deadline), 0)

    def open(self) -> bool:
        """Whether the workers may commit now."""
        return self._clock() <= self.deadline

    def close(self) -> None:
        os.close(self._fd)


class Fence:
    """A worker's side: the deadline its agent writes, read at each commit.

    Args:
        path: the agent's fence file.
        clock: monotonic seconds.
    """

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        fd = os.open(path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, _FORMAT.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def deadline(self) -> float:
        """The deadline as the agent wrote it last (read until two reads agree: a write
        under way is never taken half)."""
        while True:
            first = _FORMAT.unpack_from(self._map)[0]
            if _FORMAT.unpack_from(self._map)[0] == first:
                return float(first)

    def open(self) -> bool:
        """Whether this worker may commit now."""
        return self._clock() <= self.deadline()

    def closed_for(self) -> float:
        """Seconds since the fence closed (0 while it is open)."""
        return max(0.0, self._clock() - self.deadline())


_fence: Fence | None = None
_looked = False


def fence() -> Fence | None:
    """This process's fence (its agent's file, ``EFDL_FENCE_FILE``); None where no agent
    fences (not under efdl-run, or an older one): nothing is fenced then."""
    global _fence, _looked
    if not _looked:
        _looked = True
        path = os.environ.get(FENCE_ENV)
        if path:
            try:
                _fence = Fence(path)
            except (OSError, ValueError) as exc:
                log.warning("Cannot read the agent's fence file %s (%s): no fencing.", path, exc)
    return _fence

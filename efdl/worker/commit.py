"""What ``commit()`` waits on: the ranks' agreement at the step boundary, and the fence.

Each commit starts one asynchronous MAX all-reduce of this rank's flags (:class:`Flag`) on the
CPU side group and reads the one the previous commit started (:class:`Agreement`): by then it
is long done, and every rank reads the same result, so all pause (and persist) at the same
commit. A rank whose agent has not reached etcd for the fence timeout commits nothing more
until it does (:func:`wait_fenced`; efdl.worker.fence).
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from efdl.errors import RendezvousTimeoutError
from efdl.protocol.env import GRACE_ENV
from efdl.worker.fence import Fence
from efdl.worker.persist import Persister
from efdl.worker.runtime import Runtime

log = logging.getLogger(__name__)

# How often a fenced rank looks whether its agent reached etcd again (a mapped page).
FENCE_POLL_S = 0.1


class Rescale(Exception):
    """All ranks agreed to pause at this commit."""


class StepFailed(dist.DistError):
    """A rank's group reported a communication error: every rank leaves the generation at
    the same commit (a failure of the job's communication: rebuilt in place)."""


class Fenced(dist.DistError):
    """This rank stopped committing because its agent could not reach etcd (efdl.worker.fence),
    and its agent has since placed it in a newer generation, or asked it to leave: it leaves
    its generation as after a failure, its state as committed."""


class Flag(enum.IntEnum):
    """One rank's word in the per-commit agreement (all-reduced with MAX)."""

    NEWS = 0  # the agent has news (a ready generation, or leave): pause
    PERSIST = 1  # rank 0: a snapshot is due
    BUSY = 2  # this rank's writer is still writing the last one
    LEAVING = 3  # this rank was asked to leave
    STAYING = 4  # this rank was not
    FAILED = 5  # this rank's group reported a communication error (efdl.worker.verdict)
    ATTEMPT = 6  # rank 0: a random number, the attempt of a snapshot started here
    PEER_PERSIST = 7  # rank 0: a peer copy is due (efdl.worker.peers)
    PEER_BUSY = 8  # this rank's peer-copy writer still writes one begun before this commit


class Agreement:
    """The all-reduce of the ranks' flags started at one commit and read at the next.

    Cost: nine integers on the CPU gloo group per commit, and one per node of the
    generation (efdl.worker.pace: each node's busy time in the step), overlapping the step."""

    def __init__(self) -> None:
        self._words = torch.zeros(len(Flag), dtype=torch.int64)
        self._work: Any = None

    def read(self) -> list[int] | None:
        """The agreed words of the all-reduce started at the commit before, waiting for it:
        the flags (indexed by :class:`Flag`), then the nodes' pace slots; None if none was
        started (the first commit of a generation, or not elastic)."""
        if self._work is None:
            return None
        self._work.wait()
        self._work = None
        return [int(x) for x in self._words.tolist()]

    def start(self, flags: Sequence[int], group: Any, slots: Sequence[int] = ()) -> None:
        """All-reduce ``flags`` and ``slots`` (this rank's) on ``group`` with MAX, without
        waiting (every rank of the group gives as many slots)."""
        words = [*flags, *slots]
        if self._words.numel() != len(words):
            self._words = torch.zeros(len(words), dtype=torch.int64)
        self._words.copy_(torch.tensor(words, dtype=torch.int64))
        self._work = dist.all_reduce(self._words, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def drop(self) -> None:
        """Forget the all-reduce in flight: its group is gone (a new generation)."""
        self._work = None


def own_flags(
    rt: Runtime,
    failed: bool,
    persister: Persister | None,
    step: int,
    peers: Persister | None = None,
) -> list[int]:
    """This rank's flags at the commit of ``step`` (``failed``: its group reported a
    communication error; ``persister``: the remote cache's writer, ``peers``: the peer
    copies')."""
    flags = [0] * len(Flag)
    if rt.channel is not None and rt.placement is not None:
        flags[Flag.NEWS] = int(rt.channel.pending(rt.placement.generation))
        flags[Flag.LEAVING] = int(rt.channel.leave_requested)
    flags[Flag.STAYING] = 1 - flags[Flag.LEAVING]
    flags[Flag.FAILED] = int(failed)
    if persister is not None:
        flags[Flag.PERSIST] = int(dist.get_rank() == 0 and persister.due(step))
        flags[Flag.BUSY] = int(persister.busy)
    if peers is not None:
        flags[Flag.PEER_PERSIST] = int(dist.get_rank() == 0 and peers.due(step, pipelined=True))
        # A copy begun at this commit does not count: it has a step to finish, and each rank
        # waits a little for its own at the next (so copies can follow every commit).
        flags[Flag.PEER_BUSY] = int(peers.busy_before(step))
    if dist.get_rank() == 0 and (persister is not None or peers is not None):
        flags[Flag.ATTEMPT] = secrets.randbits(62) | 1  # not the seeded random
    return flags


def persists_here(agreed: Sequence[int], pause: bool, persister: Persister | None) -> bool:
    """Whether every rank persists at this commit: all decide alike, from ``agreed``,
    except that when everyone leaves, a rank whose writer is still busy after waiting
    half the grace period skips (that snapshot then lacks its parts and never completes,
    the one before it stands)."""
    if persister is None:
        return False
    busy = bool(agreed[Flag.BUSY])
    if pause and agreed[Flag.LEAVING]:  # ranks leave: their part of the state goes along
        if not busy:
            return True
        if not agreed[Flag.STAYING]:  # everyone leaves (preemption): finish, then persist
            persister.flush(max(1.0, float(os.environ.get(GRACE_ENV, "30")) / 2))
            return not persister.busy
        return False
    return bool(agreed[Flag.PERSIST]) and not busy


def peers_copy_here(agreed: Sequence[int], pause: bool, peers: Persister | None) -> bool:
    """Whether every rank writes a peer copy at this commit: due, no rank's writer busy, and
    no pause (a rescale's sync moves the state anyway)."""
    if peers is None or pause:
        return False
    return bool(agreed[Flag.PEER_PERSIST]) and not agreed[Flag.PEER_BUSY]


def wait_fenced(f: Fence, step: int, rt: Runtime) -> None:
    """This rank's agent has not reached etcd for the fence timeout: commit nothing more
    (no progress, no snapshot, no next step), the state kept in memory, until it does;
    leave the generation if the agent places this rank in a newer one or asks it to
    leave meanwhile (:class:`Fenced`). Waits up to the join timeout, checking the
    fence's page and the channel ten times a second."""
    generation = rt.placement.generation if rt.placement is not None else 0
    log.warning(
        "This rank's agent has not reached etcd for longer than its fence timeout (%.1f s "
        "past it): step %d is kept in memory and nothing more is committed until it does, "
        "since a leader may replace a generation cut off from etcd (waiting up to %.0f s).",
        f.closed_for(),
        step,
        rt.join_timeout_s,
    )
    deadline = time.monotonic() + rt.join_timeout_s
    with rt.hang_paused():
        while True:
            channel = rt.channel
            # News first, and once more when the fence opens: a rank its agent has since
            # placed elsewhere or sent away never commits again in this generation.
            if channel is not None and (
                channel.leave_requested or channel.closed or channel.superseded(generation)
            ):
                raise Fenced(
                    f"Fenced at step {step} (generation {generation}), and this "
                    "rank's agent has since placed it in a newer generation or asked it "
                    "to leave."
                )
            if f.open():
                break
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"This rank's agent did not reach etcd within {rt.join_timeout_s:.0f} s "
                    f"of its fence closing at step {step}: ending this worker."
                )
            time.sleep(FENCE_POLL_S)
    log.warning("This rank's agent reached etcd again: step %d goes on.", step)

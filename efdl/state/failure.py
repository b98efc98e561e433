"""What an exception inside a training step means for the job. Pure.

Only a failure of the job's communication leads to an in-place rebuild: a peer died (its
connections closed), or a hung peer was cut loose (efdl.state.breaker shuts its connections
down, or aborts its NCCL communicators). Anything else is the worker's own error (CUDA out of
memory, a shape bug, an exception in the user's code) and ends the worker with it, so the
agent's restart policy applies. A collective that timed out with every connection up is a
stuck job, not a lost member: it ends the worker too, unless a newer generation is already
known (then the timeout was the membership change showing itself).
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

# How torch's backends word a connection the peer closed (gloo raises plain RuntimeErrors),
# then other signs of a broken group or an aborted NCCL communicator; lower case.
_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe")
_BROKEN = (
    *_CLOSED,
    "gloo/transport",
    "communicator was aborted",
    "ncclremoteerror",
    "nccl error",
    "socket closed",
)
_TIMEOUT = ("timed out", "timeout")


class Failure(enum.StrEnum):
    PEER = "peer"  # the job's communication broke: rebuild in place
    TIMEOUT = "timeout"  # a collective waited out its timeout with its connections up
    OWN = "own"  # not communication: the worker's own error


def classify(exc: BaseException) -> Failure:
    """What ``exc``, raised inside a step, says about the job."""
    if isinstance(exc, torch.OutOfMemoryError) or not isinstance(exc, RuntimeError):
        return Failure.OWN
    text = str(exc).lower()
    first = text.splitlines()[0] if text else ""
    if any(word in first for word in _TIMEOUT) and not any(w in first for w in _CLOSED):
        return Failure.TIMEOUT
    if isinstance(exc, dist.DistError) or any(word in text for word in _BROKEN):
        return Failure.PEER
    return Failure.OWN

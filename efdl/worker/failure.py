"""What an exception inside a training step means for the job. Pure.

Only a failure of the job's communication leads to an in-place rebuild: a peer died (its
connections closed), or a hung peer was cut loose (efdl.worker.breaker shuts its connections
down, or aborts its NCCL communicators). Anything else is the worker's own error (CUDA out of
memory, a GPU fault, a shape bug, an exception in the user's code) and ends the worker with it,
so the agent's restart policy applies. A collective that timed out with every connection up is
a stuck job, not a lost member: it ends the worker too, unless a newer generation is already
known (then the timeout was the membership change showing itself).

The verdict comes from what torch says, in this order: efdl's own record (it cut this rank's
group itself: whatever the collective then raised is that cut); the exception's type
(``torch.OutOfMemoryError`` and ``torch.AcceleratorError`` are the device's, ``DistNetworkError``
a lost connection, ``DistStoreError`` a store wait that timed out); for ``DistBackendError``,
NCCL's result code, which torch puts in the message (``ncclUnhandledCudaError``: a fault of
this rank's GPU; ``ncclInvalidArgument``/``ncclInvalidUsage``: a bug; ``ncclRemoteError``,
``ncclSystemError``, ``ncclInternalError``, an aborted communicator: the job's communication).
Only gloo leaves nothing but words: it raises plain ``RuntimeError``s ("Connection closed by
peer", "Timed out waiting ... for recv"), read here as the last resort.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist


class Failure(enum.StrEnum):
    PEER = "peer"  # the job's communication broke: rebuild in place
    TIMEOUT = "timeout"  # a collective waited out its timeout with its connections up
    OWN = "own"  # not communication: the worker's own error


# NCCL result codes (ncclResult_t names, as torch's DistBackendError messages carry them).
_NCCL_OWN = ("ncclunhandledcudaerror", "ncclinvalidargument", "ncclinvalidusage")
_NCCL_OWN_WORDS = ("unhandled cuda error", "invalid argument", "invalid usage")
# How gloo words a connection the peer closed, and a timeout; lower case.
_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe")
_GLOO_BROKEN = (*_CLOSED, "gloo/transport", "socket closed")
_TIMEOUT = ("timed out", "timeout")
# Device errors that older torch raised as plain RuntimeErrors.
_DEVICE = ("cuda error", "device-side assert", "illegal memory access")

# The device's own errors (torch.AcceleratorError: torch >= 2.8).
_ACCELERATOR = getattr(torch, "AcceleratorError", torch.OutOfMemoryError)
_DEVICE_TYPES: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, _ACCELERATOR)


def classify(exc: BaseException, cut: bool = False) -> Failure:
    """What ``exc``, raised inside a step, says about the job. ``cut``: efdl itself cut or
    aborted this rank's group before ``exc`` (efdl.worker.breaker)."""
    if isinstance(exc, _DEVICE_TYPES) or not isinstance(exc, RuntimeError):
        return Failure.OWN
    if cut:
        return Failure.PEER
    text = str(exc).lower()
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, dist.DistNetworkError):
        return Failure.PEER
    if isinstance(exc, dist.DistStoreError):
        return Failure.TIMEOUT
    if isinstance(exc, dist.DistBackendError):
        if any(code in text for code in _NCCL_OWN) or any(w in first for w in _NCCL_OWN_WORDS):
            return Failure.OWN
        return Failure.TIMEOUT if any(w in first for w in _TIMEOUT) else Failure.PEER
    if isinstance(exc, dist.DistError):
        return Failure.PEER
    # A plain RuntimeError: gloo's words, the last resort.
    if any(w in first for w in _DEVICE):
        return Failure.OWN
    if any(w in first for w in _TIMEOUT) and not any(w in first for w in _CLOSED):
        return Failure.TIMEOUT
    if any(w in text for w in _GLOO_BROKEN):
        return Failure.PEER
    return Failure.OWN

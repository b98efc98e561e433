"""Which errors in a step rebuild the job in place and which end the worker."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from efdl.worker.failure import Failure, classify

GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (
            RuntimeError(
                GLOO + "pair.cc:537] Read error [127.0.0.1]:52382: Connection reset by peer. "
                "This is typically caused by a remote worker hanging or bugs."
            ),
            Failure.PEER,
        ),
        (
            RuntimeError(GLOO + "pair.cc:534] Connection closed by peer [127.0.0.1]:41234"),
            Failure.PEER,
        ),
        (dist.DistBackendError("NCCL communicator was aborted on rank 1."), Failure.PEER),
        (
            dist.DistBackendError(
                "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited "
                "or there was a network error, NCCL version 2.21.5\nncclRemoteError"
            ),
            Failure.PEER,
        ),
        (
            RuntimeError(
                GLOO + "unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"
            ),
            Failure.TIMEOUT,
        ),
        (RuntimeError("Application timeout caused pair closure"), Failure.TIMEOUT),
        (
            dist.DistBackendError(
                "[Rank 0] Watchdog caught collective operation timeout: "
                "WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 30000 milliseconds "
                "before timing out."
            ),
            Failure.TIMEOUT,
        ),
        (
            dist.DistBackendError(
                "NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with "
                "NCCL_DEBUG=INFO for details), NCCL version 2.27.3\nncclUnhandledCudaError: "
                "Call to CUDA function failed.\nLast error:\nCuda failure 'an illegal memory "
                "access was encountered'"
            ),
            Failure.OWN,  # this rank's GPU faulted, reported through NCCL: not a peer
        ),
        (
            dist.DistBackendError(
                "NCCL error in: ProcessGroupNCCL.cpp:2101, invalid usage, NCCL version 2.27.3\n"
                "ncclInvalidUsage: This usually reflects invalid usage of NCCL library."
            ),
            Failure.OWN,
        ),
        (
            dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed."),
            Failure.PEER,
        ),
        (dist.DistStoreError("wait timeout after 30000ms, keys: /gen/3/ready"), Failure.TIMEOUT),
        (
            torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
            Failure.OWN,
        ),
        (RuntimeError("CUDA error: device-side assert triggered"), Failure.OWN),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), Failure.OWN),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x1)"), Failure.OWN),
        (RuntimeError("Expected to have finished reduction in the prior iteration"), Failure.OWN),
        (ValueError("bad learning rate"), Failure.OWN),
        (KeyError("labels"), Failure.OWN),
    ],
)
def test_classify(exc: BaseException, kind: Failure) -> None:
    assert classify(exc) is kind


def test_efdls_own_cut_decides_whatever_the_words() -> None:
    """After efdl cut the group itself (breaker, abort), the collective's error is the cut."""
    odd = RuntimeError("[gloo] unexpected message type 3")
    assert classify(odd) is Failure.OWN
    assert classify(odd, cut=True) is Failure.PEER
    assert classify(torch.OutOfMemoryError("CUDA out of memory"), cut=True) is Failure.OWN

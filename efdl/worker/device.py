"""A worker's own device, and how efdl makes and breaks NCCL communicators on it.

NCCL settings (what efdl sets and why):

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: the agent gives plain scripts torchrun's ``1`` (an NCCL
  error or timeout aborts the communicators and ends the process; the agent restarts it).
  An efdl-aware worker sets ``2`` in ``efdl.init_process_group``: the watchdog aborts the
  communicators and the operations raise, but the process lives on to rebuild in place.
- Communicators are non-blocking (``config.blocking = False``, as TorchFT makes them): an
  abort from another thread returns instead of waiting behind a stuck kernel.
- They are made eagerly on the worker's GPU (``device_id``), inside the join, where a peer
  that cannot join makes the join fail (and be retried), not the first training step.
- The collective timeout is efdl's (``timeout_s`` / ``EFDL_COLLECTIVE_TIMEOUT``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from efdl.protocol.env import DEVICE_ENV

log = logging.getLogger(__name__)


@functools.cache
def device() -> torch.device:
    """This worker's own device, the same for its whole life: its GPU, or the CPU on a host
    without one.

    Under ``efdl-run`` it is ``cuda:LOCAL_RANK`` (the agent orders ``CUDA_VISIBLE_DEVICES``
    so; on MIG ``cuda:0``), under torchrun ``cuda:LOCAL_RANK``, alone ``cuda:0``.

    Raises:
        RuntimeError: the index is not one of the visible GPUs.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    text = os.environ.get(DEVICE_ENV) or os.environ.get("LOCAL_RANK") or "0"
    count = torch.cuda.device_count()
    if not text.isdigit() or int(text) >= count:
        raise RuntimeError(
            f"This worker's GPU is number {text!r} (from {DEVICE_ENV} or LOCAL_RANK), but it "
            f"sees {count} GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})."
        )
    return torch.device("cuda", int(text))


def nccl_options() -> dict[str, Any]:
    """Keyword arguments for ``init_process_group("nccl", ...)``: eager, non-blocking
    communicators on this worker's GPU."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.blocking = False
    return {"device_id": device(), "pg_options": options}


def nccl_aborter(group: Any) -> Callable[[], None]:
    """A function that aborts ``group``'s NCCL communicators (from any thread), so that an
    operation stuck on a hung peer fails now. It leaves torch's group registry alone: the
    main thread destroys the group when it rebuilds."""

    def abort() -> None:
        group._get_backend(torch.device("cuda")).abort()

    return abort

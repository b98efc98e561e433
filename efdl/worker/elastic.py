"""In-process elasticity: pause at a step boundary, rebuild the process group, sync, go on.

The user contract (about ten changed lines in a DDP script)::

    efdl.init_process_group("gloo")                     # instead of dist.init_process_group
    state = efdl.elastic_state(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @efdl.elastic(state)
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for x, y in loader:                          # a DataLoader over efdl.ElasticSampler
                loss = loss_fn(state.ddp(x), y)          # state.ddp: DDP, rebuilt per group
                ...
                state.commit()

    train(state)

The parts: efdl.worker.runtime (this worker's groups and agent), efdl.worker.state (the state,
``commit`` and the sync: efdl.worker.commit, efdl.worker.sync), efdl.worker.transaction (what a
failure leaves of the state), efdl.worker.transfer (moving tensors between ranks),
efdl.worker.persist and efdl.worker.resume (the remote cache). This module is the loop that
ties them: all ranks pause at the same commit, or a peer's death makes their collective fail;
each rank makes its state a committed one again, waits for its new placement from its agent,
joins the new group, and syncs.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from efdl._process import exit_left
from efdl.errors import RendezvousTimeoutError
from efdl.protocol.env import GRACE_ENV
from efdl.worker.failure import Failure
from efdl.worker.runtime import get_runtime, init_process_group
from efdl.worker.state import ElasticState, Fenced, Rescale, elastic_state

__all__ = ["ElasticState", "elastic", "elastic_state", "init_process_group"]

log = logging.getLogger(__name__)

R = TypeVar("R")


def _rebuild(state: ElasticState, failure: BaseException | None) -> bool:
    """Wait for the next placement and join its group; False if this worker should exit.

    Args:
        failure: the communication failure that left the generation (None: a pause). If no
            new placement comes within the placement timeout (longer while the job waits
            below --min), the failure was no membership change: it is raised again.
    """
    rt = get_runtime()
    assert rt.channel is not None and rt.placement is not None
    placement = rt.channel.wait(rt.placement.generation, rt.placement_timeout_s)
    if placement is None and failure is not None and not rt.channel.leave_requested:
        log.error(
            "No new generation came within %.0f s of a failed collective in generation %d: "
            "it was not a member leaving; ending this worker with the error.",
            rt.placement_timeout_s,
            rt.placement.generation,
        )
        raise failure
    if placement is None and not rt.channel.leave_requested and not rt.channel.closed:
        # The others paused for a generation this rank's agent has not placed it in (cut
        # off from etcd): not a leave, and not the end of training (exit 0 would say both).
        raise RendezvousTimeoutError(
            f"No placement came within {rt.placement_timeout_s:.0f} s of the pause at step "
            f"{state.step} (generation {rt.placement.generation}): this worker's agent did "
            "not learn of the next round; ending this worker (its agent replaces it)."
        )
    if failure is None:  # a pause: the old group still stands
        state.hand_over(placement.rank if placement is not None else None)
    if placement is None and rt.channel.leave_requested:
        # Leaving at a step boundary, maybe with every other node (preemption): the ranks
        # started persisting this step at the pause; let it reach storage, within the
        # agent's grace period.
        grace = float(os.environ.get(GRACE_ENV, "30"))
        if not state.flush(timeout_s=max(1.0, grace - 2.0)):
            log.warning("Leaving before step %d was persisted (grace period).", state.step)
    rt.destroy_group(abort=failure is not None)
    if placement is None or rt.join(placement) is None:
        return False
    state.rebuilt()
    return True


def _record(exc: BaseException) -> None:
    """Write ``exc`` to torch's error file (as ``@record`` does), so the agent reports it."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


def elastic(state: ElasticState) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Run the training function so it survives rescales (Horovod's ``hvd.elastic.run``).

    On a pause, or when the job's communication fails inside a step (a peer died or was cut
    loose), the function is left, the group rebuilt, the state synced, and the function
    called again: it must resume from ``state`` (epoch, sampler). Any other error (CUDA out
    of memory, a bug, a collective that timed out while no member left) ends the worker with
    that error, written to torch's error file; the agent's restart policy applies.
    Returns the function's result. A worker the agent asks to leave (its node leaves, or
    becomes a spare) exits 0 at the pause (``SystemExit``): the code after the training
    function, which expects a finished training and a process group, does not run.
    """

    def wrap(fn: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> R:
            rt = get_runtime()
            while True:
                failure: BaseException | None = None
                try:
                    rt.in_elastic_fn = True
                    if not rt.enter():  # a newcomer's generation was replaced
                        raise Rescale()
                    state.sync()  # a peer may die in here too
                    rt.trains()
                    return fn(*args, **kwargs)
                except Rescale:
                    pass
                except Exception as exc:
                    if not _left_generation(exc):
                        _record(exc)
                        raise
                    rt.report(exc)
                    action = state.recover()
                    log.warning(
                        "A collective failed (%s); recovering: %s (step %d).",
                        str(exc).splitlines()[0][:200],
                        action,
                        state.step,
                    )
                    failure = exc
                finally:
                    rt.in_elastic_fn = False
                try:
                    rebuilt = _rebuild(state, failure)
                except Exception as exc:
                    _record(exc)
                    raise
                if not rebuilt:
                    log.info("Left the job at step %d, as the agent asked.", state.step)
                    exit_left()

        return run

    return wrap


def _left_generation(exc: BaseException) -> bool:
    """Whether ``exc`` means this worker's generation is over (rebuild in place) rather than
    the worker's own failure."""
    rt = get_runtime()
    if rt.channel is None:
        return False
    if isinstance(exc, Fenced):
        return True
    kind = rt.classify(exc)
    if kind is Failure.TIMEOUT and rt.placement is not None:
        return rt.channel.superseded(rt.placement.generation)
    return kind is Failure.PEER

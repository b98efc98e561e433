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

How it works. Each ``commit()`` ends a step: it waits on a tiny all-reduce started at the
previous commit on a side gloo group (on the CPU: no GPU synchronisation, and by then it is
long done) and starts the next one with this rank's "the agent has news" flag. Every rank sees
the same result of the same all-reduce, so all pause at the same commit, after which none of
them is inside a collective. A peer that dies mid-step makes the survivors' collective fail
within seconds (gloo's bounded timeout, or at once when its sockets close); they roll back to
the last snapshot. Then every rank waits for its new placement from its agent, destroys the
old group, joins the new one on the generation's fresh store, and the rank holding the newest
committed state broadcasts it to all, newcomers included.
"""

from __future__ import annotations

import copy
import datetime
import functools
import io
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from efdl.state.channel import SOCKET_ENV, AgentChannel, Placement
from efdl.state.sampler import ElasticSampler

log = logging.getLogger(__name__)

R = TypeVar("R")


class _Rescale(Exception):
    """All ranks agreed to pause at this commit."""


class _Runtime:
    """This worker's view of the job: its placement, its groups, its agent."""

    def __init__(self) -> None:
        self.channel: AgentChannel | None = None
        self.placement: Placement | None = None
        self.backend = "gloo"
        self.timeout = datetime.timedelta(
            seconds=float(os.environ.get("EFDL_COLLECTIVE_TIMEOUT", "30"))
        )
        self.side: Any = None  # the CPU (gloo) group for the pause agreement

    @property
    def elastic(self) -> bool:
        return self.channel is not None

    def init_group(self, p: Placement) -> None:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            p.master_addr, p.master_port, p.world_size, False, self.timeout
        )
        dist.init_process_group(
            self.backend, store=store, rank=p.rank, world_size=p.world_size, timeout=self.timeout
        )
        self.side = dist.new_group(backend="gloo") if self.backend != "gloo" else dist.new_group()
        self.placement = p
        if self.backend == "nccl":
            torch.cuda.set_device(0)

    def destroy_group(self) -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group broken by a dead peer may not shut down cleanly
            log.warning("Destroying the old process group failed (%s); going on.", exc)
        self.side = None


_runtime = _Runtime()


def init_process_group(backend: str = "gloo", timeout_s: float | None = None) -> None:
    """``dist.init_process_group`` for efdl: joins this generation's group and, when started by
    ``efdl-run``, tells the agent that this worker rebuilds in place (no restarts).

    Args:
        backend: ``gloo`` or ``nccl``.
        timeout_s: bound on collectives and on joining a group; a dead peer surfaces as an
            error within this (default 30 s, or ``EFDL_COLLECTIVE_TIMEOUT``). Longer than the
            slowest legitimate collective.
    """
    rt = _runtime
    rt.backend = backend
    if timeout_s is not None:
        rt.timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # error out, don't kill
    path = os.environ.get(SOCKET_ENV)
    placement = Placement.from_env()
    if path:
        rt.channel = AgentChannel(path, placement.local_rank)
    rt.init_group(placement)


class ElasticState:
    """What must survive a rescale, and the step boundary (``commit``).

    Args:
        model: the module (not the DDP wrapper: ``state.ddp`` is rebuilt for each group).
        optimizer: its optimizer.
        sampler: an :class:`ElasticSampler`, told the world size and advanced on commit.
        scheduler: an LR scheduler, if any.
        snapshot_every: keep a rollback copy every this many commits. Each copy clones the
            model and optimizer state on their own device (memory: about 3x the parameter
            bytes with Adam; time: one device-to-device copy of those bytes, no host sync).
            A crash loses the steps since the last copy; raise it if copies show in the step.
        **values: any picklable user values (hyper-parameters, counters), read and written as
            attributes (``state.lr``); they are synced and rolled back with the rest.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: ElasticSampler | None = None,
        scheduler: Any = None,
        snapshot_every: int = 1,
        **values: Any,
    ) -> None:
        object.__setattr__(self, "_values", dict(values))
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.scheduler = scheduler
        self.snapshot_every = max(1, snapshot_every)
        self.step = 0
        self.ddp: DistributedDataParallel | torch.nn.Module = model
        self.generation = 0
        self._snapshot: dict[str, Any] | None = None
        self._pause_flag = torch.zeros(1, dtype=torch.int64)
        self._pause_work: Any = None
        self.rescales = 0

    # user values as attributes
    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        values = object.__getattribute__(self, "_values")
        if name in values:
            values[name] = value
            if name == "epoch" and self.sampler is not None:
                self.sampler.set_epoch(int(value))
        else:
            object.__setattr__(self, name, value)

    # ---------------------------------------------------------------- commit and snapshots

    def commit(self) -> None:
        """End a step: count it, advance the sampler, keep a rollback copy every
        ``snapshot_every`` commits, and pause here if all ranks agree that the agent has news.

        Cost: one asynchronous one-integer all-reduce on a CPU gloo group per call, waited at
        the next call (so it overlaps the step); no GPU synchronisation.
        """
        self.step += 1
        if self.sampler is not None:
            self.sampler.advance()
        rt = _runtime
        pause = False
        if rt.elastic and self._pause_work is not None:
            self._pause_work.wait()
            pause = bool(self._pause_flag.item())
        if pause or self.step % self.snapshot_every == 0:
            # At a pause the state at this boundary is the committed state: one copy either way.
            self._snapshot = self._save()
        if not rt.elastic:
            return
        assert rt.channel is not None and rt.placement is not None
        if pause:
            self._pause_work = None
            raise _Rescale()
        self._pause_flag.fill_(int(rt.channel.pending(rt.placement.generation)))
        self._pause_work = dist.all_reduce(
            self._pause_flag, op=dist.ReduceOp.MAX, group=rt.side, async_op=True
        )

    def _state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "sampler": self.sampler.state_dict() if self.sampler else None,
            "step": self.step,
            "values": object.__getattribute__(self, "_values"),
        }

    def _save(self) -> dict[str, Any]:
        """A rollback copy: tensors cloned on their own device (no host synchronisation),
        everything else deep-copied."""
        snapshot: dict[str, Any] = _clone(self._state_dict())
        return snapshot

    def _load(self, data: dict[str, Any]) -> None:
        self.model.load_state_dict(data["model"])
        if self.optimizer is not None and data["optimizer"] is not None:
            self.optimizer.load_state_dict(_clone(data["optimizer"]))
        if self.scheduler is not None and data["scheduler"] is not None:
            self.scheduler.load_state_dict(data["scheduler"])
        if self.sampler is not None and data["sampler"] is not None:
            self.sampler.load_state_dict(data["sampler"])
        self.step = int(data["step"])
        object.__getattribute__(self, "_values").update(copy.deepcopy(data["values"]))

    def restore(self) -> None:
        """Roll back to the last snapshot (after a failure inside a step)."""
        if self._snapshot is not None:
            self._load(self._snapshot)

    # ---------------------------------------------------------------- sync

    def sync(self) -> None:
        """Make every rank hold the newest committed state; rebuild DDP for this group.

        The rank with the highest committed step (lowest rank on ties) broadcasts it.
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        has_state = self._snapshot is not None
        key = torch.tensor([(self.step if has_state else -1) * (1 << 20) + (world - rank)])
        dist.all_reduce(key, op=dist.ReduceOp.MAX)
        src = world - int(key.item()) % (1 << 20)
        best_step = int(key.item()) >> 20
        if best_step >= 0:
            # Over the CPU side group (gloo), whatever the training backend.
            side = _runtime.side
            blob = b""
            if rank == src and self._snapshot is not None:
                buffer = io.BytesIO()
                torch.save(_to_cpu(self._snapshot), buffer)
                blob = buffer.getvalue()
            size = torch.tensor([len(blob)], dtype=torch.int64)
            dist.broadcast(size, src, group=side)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            if rank == src:
                data.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            dist.broadcast(data, src, group=side)
            if rank != src:
                received = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
                self._load(received)
                self._snapshot = self._save()
        if self.sampler is not None:
            self.sampler.set_world(rank, world)
        self.ddp = (
            DistributedDataParallel(self.model) if world > 1 or _runtime.elastic else self.model
        )
        rt = _runtime
        self.generation = rt.placement.generation if rt.placement else 0
        self._pause_work = None


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def elastic_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: ElasticSampler | None = None,
    scheduler: Any = None,
    snapshot_every: int = 1,
    **values: Any,
) -> ElasticState:
    """Track what must survive a rescale; see :class:`ElasticState`."""
    return ElasticState(model, optimizer, sampler, scheduler, snapshot_every, **values)


def _rebuild(state: ElasticState, failed: bool) -> bool:
    """Wait for the next placement and join its group; False if this worker should exit."""
    rt = _runtime
    assert rt.channel is not None and rt.placement is not None
    if failed:
        state.restore()
    placement = rt.channel.wait(rt.placement.generation)
    rt.destroy_group()
    if placement is None:
        return False
    rt.init_group(placement)
    state.rescales += 1
    return True


def elastic(state: ElasticState) -> Callable[[Callable[..., R]], Callable[..., R | None]]:
    """Run the training function so it survives rescales (Horovod's ``hvd.elastic.run``).

    On a pause or a failure inside a step, the function is left, the group rebuilt, the state
    synced, and the function called again: it must resume from ``state`` (epoch, sampler).
    Returns the function's result, or None if the agent asked this worker to leave.
    """

    def wrap(fn: Callable[..., R]) -> Callable[..., R | None]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> R | None:
            state.sync()
            while True:
                try:
                    return fn(*args, **kwargs)
                except _Rescale:
                    failed = False
                except (RuntimeError, dist.DistError) as exc:
                    if not _runtime.elastic:
                        raise
                    log.warning(
                        "A collective failed (%s); rolling back to step %d.",
                        str(exc).splitlines()[0][:200],
                        state.step,
                    )
                    failed = True
                if not _rebuild(state, failed):
                    return None
                state.sync()

        return run

    return wrap

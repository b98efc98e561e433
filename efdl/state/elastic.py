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
them is inside a collective. A peer that dies mid-step makes the survivors' collective fail at
once (its sockets close); one that hangs is cut loose by efdl.state.breaker once the next
generation is ready; they roll back to the last snapshot. Then every rank waits for its new
placement from its agent, destroys the old group, joins the new one on the generation's fresh
store, and the rank holding the newest committed state broadcasts it to all, newcomers
included.
"""

from __future__ import annotations

import copy
import datetime
import functools
import io
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.nn.parallel import DistributedDataParallel

from efdl._process import free_port
from efdl.state import ready
from efdl.state import values as state_values
from efdl.state.breaker import Breaker
from efdl.state.cache import CacheSettings, FileInfo, Manifest, SnapshotError, rank_file
from efdl.state.channel import (
    GRACE_ENV,
    JOIN_TIMEOUT_ENV,
    PLACEMENT_TIMEOUT_ENV,
    SOCKET_ENV,
    AgentChannel,
    Placement,
)
from efdl.state.device import device, nccl_aborter, nccl_options
from efdl.state.failure import Failure, classify
from efdl.state.persist import Persister
from efdl.state.sampler import ElasticBatchSampler, ElasticSampler

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
        # How long to wait for the next placement after leaving a generation, and how long a
        # generation may take to gather all its ranks: set by the agent from its settings.
        self.placement_timeout_s = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "60"))
        self.join_timeout_s = float(os.environ.get(JOIN_TIMEOUT_ENV, "600"))
        self.side: Any = None  # the CPU (gloo) group for control: agreement, sizes, CPU state
        self.gate = ready.ReadinessGate(self.timeout, self.join_timeout_s)
        self.breaker = Breaker()
        self.inside = False  # the main thread runs the @elastic function (not setup, not exit)

    @property
    def elastic(self) -> bool:
        return self.channel is not None

    def init_group(self, p: Placement) -> None:
        if self.channel is not None:  # the agent serves it; a newer round may replace it
            channel = self.channel
            store = ready.connect(p, self.timeout, lambda: channel.superseded(p.generation))
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = ready.connect(p, self.timeout)
        else:  # no launcher's store (plain env://): rank 0 serves it, as torch does
            store = dist.TCPStore(  # type: ignore[attr-defined]
                p.master_addr, p.master_port, p.world_size, p.rank == 0, self.timeout
            )
        if self.elastic:
            self.gate.declare_and_wait(p, store)
        nccl = self.backend == "nccl"
        with self.breaker.recording(p.generation):
            dist.init_process_group(
                self.backend,
                store=store,
                rank=p.rank,
                world_size=p.world_size,
                timeout=self.timeout,
                **(nccl_options() if nccl else {}),
            )
            # Bounded like the rest: an agreement that waits on a dead peer must fail, not hang.
            self.side = dist.new_group(backend="gloo", timeout=self.timeout)
        if nccl:  # a hung NCCL peer is cut loose by aborting the communicators
            default = dist.distributed_c10d._get_default_group()
            self.breaker.on_cut(p.generation, nccl_aborter(default))
        self.placement = p

    def join(self, p: Placement) -> Placement | None:
        """Join ``p``'s group. If that fails because a newer generation replaced ``p`` (its
        store is closed when the next one is served: a node joined or left meanwhile), join
        the newer one. Returns the placement joined; None if asked to leave meanwhile."""
        while True:
            try:
                self.init_group(p)
                return p
            except RuntimeError as exc:  # dist.DistError too
                if self.channel is None:
                    raise
                self.destroy_group(abort=True)
                newer = self.channel.wait(p.generation, self.timeout.total_seconds())
                if newer is None:
                    if self.channel.leave_requested:
                        return None
                    raise
                log.warning(
                    "Joining generation %d failed (%s); generation %d replaced it: joining that.",
                    p.generation,
                    str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                    newer.generation,
                )
                p = newer

    def destroy_group(self, abort: bool = False) -> None:
        """Leave the current groups. ``abort``: they broke (a peer died); an operation may
        still wait on the dead peer until the collective timeout, and a plain destroy would
        wait for it, so abort them (NCCL: abort the communicators) and keep the broken group
        objects alive until then: gloo's destructor joins its worker threads, which are the
        ones waiting (found with a 3-rank job where a node died: 15 s in the destructor)."""
        if not dist.is_initialized():
            return
        try:
            if abort:
                _bury(list(dist.distributed_c10d._world.pg_names), self.timeout)
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception as exc:  # a group broken by a dead peer may not shut down cleanly
            log.warning("Destroying the old process group failed (%s); going on.", exc)
        self.breaker.forget()
        self.side = None

    def behind(self, generation: int) -> bool:
        """Whether the main thread still trains a generation older than ``generation``."""
        p = self.placement
        return self.inside and p is not None and p.generation < generation


_runtime = _Runtime()


def _bury(groups: list[Any], timeout: datetime.timedelta) -> None:
    """Hold ``groups`` until their pending operations have timed out, then drop them on a
    daemon thread, so that their destructors never block training."""

    def drop_later() -> None:
        time.sleep(timeout.total_seconds() + 5)
        groups.clear()

    threading.Thread(target=drop_later, name="efdl-broken-groups", daemon=True).start()


def _warm_up() -> None:
    """Import what the first optimizer of any script imports lazily (``torch._dynamo``, over a
    second here), so that a newcomer does it before the survivors pause for it, not after."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as exc:  # only an optimisation
        log.debug("Warm-up import failed: %s", exc)


def _on_round(p: Placement) -> None:
    """A new placement came: count this rank in, and open the pause once every rank is
    (then, if this worker is stuck in a collective with a hung peer, cut it loose)."""
    rt = _runtime
    channel = rt.channel
    assert channel is not None

    def go() -> None:
        channel.open(p.generation)
        rt.breaker.watch(p.generation, lambda: rt.behind(p.generation))

    rt.gate.watch(p, lambda: channel.superseded(p.generation), go)


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
    path = os.environ.get(SOCKET_ENV)
    if backend == "nccl":
        torch.cuda.set_device(device())
        if path:
            # On an NCCL error or a collective timeout, ProcessGroupNCCL's watchdog aborts the
            # communicators (2: CleanUpOnly) and the pending and next operations raise; the
            # process lives on to rebuild in place. torchrun's 1 (and torch's default, 3) end
            # the process instead: right for restart mode, fatal to in-place recovery.
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    if "RANK" not in os.environ and path is None:  # plain `python train.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    placement = Placement.from_env()
    rt.gate = ready.ReadinessGate(rt.timeout, rt.join_timeout_s)
    if path and placement.generation > 1:
        _warm_up()  # a newcomer: get the slow first-use imports done before counting in
    if path:
        rt.channel = AgentChannel(path, placement.local_rank, on_round=_on_round)
    if rt.join(placement) is None:
        raise SystemExit(0)  # the agent sent this worker away before it ever trained


class ElasticState:
    """What must survive a rescale, and the step boundary (``commit``).

    Args:
        model: the module (not the DDP wrapper: ``state.ddp`` is rebuilt for each group).
        optimizer: its optimizer.
        sampler: an :class:`ElasticSampler` or :class:`ElasticBatchSampler`, told the world
            size and advanced on commit.
        scheduler: an LR scheduler, if any.
        snapshot_every: keep a rollback copy every this many commits. Each copy clones the
            model and optimizer state on their own device (memory: about 3x the parameter
            bytes with Adam; time: one device-to-device copy of those bytes, no host sync).
            A crash loses the steps since the last copy; raise it if copies show in the step.
        **values: user values (hyper-parameters, counters), read and written as attributes
            (``state.lr``); they are synced and rolled back with the rest. Plain data only
            (numbers, strings, bytes, tensors, and lists, tuples, sets and dicts of them):
            anything else is refused here, on assignment and at ``commit()``
            (:class:`efdl.state.values.StateValueError`), since no rank or snapshot could
            read it back.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: ElasticSampler | ElasticBatchSampler | None = None,
        scheduler: Any = None,
        snapshot_every: int = 1,
        **values: Any,
    ) -> None:
        state_values.check_all(values)
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
        # [news from the agent, rank 0 says persist, some rank's writer is busy]: agreed on
        # by one all-reduce (max) per commit, so every rank decides the same.
        self._flags = torch.zeros(3, dtype=torch.int64)
        self._agree_work: Any = None
        self.rescales = 0
        settings = CacheSettings.from_env()
        self._persister = Persister(settings) if settings is not None else None
        if self._persister is not None and optimizer is not None:
            persister = self._persister
            optimizer.register_step_pre_hook(lambda *_: persister.fence())

    # user values as attributes
    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        values = object.__getattribute__(self, "_values")
        if name in values:
            state_values.check(name, value)
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
        the next call (so it overlaps the step), and a walk of the user values; no GPU
        synchronisation.
        """
        # Values changed in place (a list appended to) are checked here, before they spread.
        state_values.check_all(object.__getattribute__(self, "_values"))
        self.step += 1
        if self.sampler is not None:
            self.sampler.advance()
        rt = _runtime
        rt.breaker.stepped()
        pause = persist = False
        if self._agree_work is not None:
            self._agree_work.wait()
            pause, persist = bool(self._flags[0]), bool(self._flags[1]) and not self._flags[2]
            self._agree_work = None
        if pause or self.step % self.snapshot_every == 0:
            # At a pause the state at this boundary is the committed state: one copy either way.
            self._snapshot = self._save()
        if persist:
            self._persist()
        if pause:
            raise _Rescale()
        if not (rt.elastic or self._persister is not None) or rt.side is None:
            return
        if rt.channel is not None and rt.placement is not None:
            self._flags[0] = int(rt.channel.pending(rt.placement.generation))
        if self._persister is not None:
            self._flags[1] = int(dist.get_rank() == 0 and self._persister.due(self.step))
            self._flags[2] = int(self._persister.busy)
        self._agree_work = dist.all_reduce(
            self._flags, op=dist.ReduceOp.MAX, group=rt.side, async_op=True
        )

    # ---------------------------------------------------------------- the remote cache

    def fence(self) -> None:
        """Wait until the snapshot being persisted has copied the parameters; call before
        changing parameters in place outside ``optimizer.step()`` (which waits by itself)."""
        if self._persister is not None:
            self._persister.fence()

    def _persist(self, collect_timeout_s: float = 10.0) -> None:
        """Hand this commit's state to the background writer (see efdl.state.persist)."""
        p = self._persister
        assert p is not None
        rt = _runtime
        rank, world = dist.get_rank(), dist.get_world_size()
        epoch = object.__getattribute__(self, "_values").get("epoch")
        placement = rt.placement or Placement.from_env()
        p.start(
            self.step,
            epoch if isinstance(epoch, int) else None,
            world,
            rank,
            self._state_dict() if rank == 0 else None,
            {f"/model/{name}" for name, _ in self.model.named_buffers()},
            {"rng": _rng_state()},
            _collector(placement, rt.timeout.total_seconds(), collect_timeout_s),
            _published,
        )

    def persist_now(self, timeout_s: float) -> bool:
        """Persist the state at this boundary and wait for it (a graceful leave: the job may
        be preempted everywhere); True if it is on storage."""
        p = self._persister
        if p is None:
            return True
        if not p.flush(timeout_s):
            return False
        if p.last_persisted != self.step:
            self._persist(collect_timeout_s=3.0)
        return p.flush(timeout_s)

    def _state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            # `is not None`, never truthiness: a sampler at the end of its epoch has length 0
            # (a crash right after an epoch's last commit then lost the cursor, and the
            # finished epoch was trained again).
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
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

    def _restore_from_cache(self) -> dict[str, Any] | None:
        """Rank 0: load the newest intact cached snapshot; the snapshot to broadcast."""
        assert self._persister is not None
        found = self._persister.store.newest()
        if found is None:
            log.info("No snapshot in %s: a cold start.", self._persister.settings.url)
            return None
        m, data = found
        log.warning(
            "No rank holds committed state: resuming from step %d (epoch %s) in %s.",
            m.step,
            m.epoch,
            self._persister.settings.url,
        )
        self._load(data)
        self._snapshot = self._save()
        return self._snapshot

    def _restore_own(self) -> None:
        """This rank's own part (RNG) of the snapshot just restored, if it wrote one."""
        p = self._persister
        assert p is not None
        try:
            m = p.store.manifest(self.step)
            name = rank_file(dist.get_rank())
            if name in m.files:
                _set_rng_state(p.store.read(m, name)["rng"])
        except (SnapshotError, KeyError, TypeError, RuntimeError) as exc:
            log.warning("Not restoring this rank's RNG state: %s", exc)

    def restore(self) -> None:
        """Roll back to the last snapshot (after a failure inside a step)."""
        if self._snapshot is not None:
            self._load(self._snapshot)

    # ---------------------------------------------------------------- sync

    def sync(self) -> None:
        """Make every rank hold the newest committed state; rebuild DDP for this group.

        The rank with the highest committed step (lowest rank on ties) broadcasts it (see
        :func:`_broadcast_state`: control on the CPU side group, each tensor on its device).
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        side = _runtime.side
        has_state = self._snapshot is not None
        key = torch.tensor([(self.step if has_state else -1) * (1 << 20) + (world - rank)])
        dist.all_reduce(key, op=dist.ReduceOp.MAX, group=side)
        src = world - int(key.item()) % (1 << 20)
        best_step = int(key.item()) >> 20
        snapshot = self._snapshot
        restored: int | None = None
        if best_step < 0 and self._persister is not None:
            # Nobody holds committed state: the newest intact snapshot in the cache, if any.
            src = 0
            if rank == 0:
                snapshot = self._restore_from_cache()
                restored = self.step if snapshot is not None else None
        if best_step >= 0 or self._persister is not None:
            received = _broadcast_state(snapshot if rank == src else None, src, side)
            if rank != src and received is not None:
                self._load(received)
                self._snapshot = self._save()
                if best_step < 0:
                    self._restore_own()
        if restored is not None:
            self._restore_own()
        if self.sampler is not None:
            self.sampler.set_world(rank, world)
        self.ddp = (
            DistributedDataParallel(self.model) if world > 1 or _runtime.elastic else self.model
        )
        rt = _runtime
        self.generation = rt.placement.generation if rt.placement else 0
        self._agree_work = None


def _rng_state() -> dict[str, Any]:
    """This rank's random number generators (the part of a snapshot that is its own)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python = state.get("python")
    if isinstance(python, tuple) and len(python) == 3:
        random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _collector(
    p: Placement, connect_s: float, wait_s: float
) -> Callable[[int, str, FileInfo], dict[str, FileInfo]]:
    """Ranks report their shard on the generation's store; rank 0 gathers what came within
    ``wait_s`` (a rank that left or died just leaves its RNG state out of the snapshot)."""

    def collect(step: int, name: str, info: FileInfo) -> dict[str, FileInfo]:
        store = ready.connect(p, datetime.timedelta(seconds=connect_s))
        prefix = f"efdl/persist/{step}/"
        store.set(f"{prefix}{p.rank}", json.dumps([name, info.size, info.sha256]))
        if p.rank != 0:
            return {}
        keys = [f"{prefix}{r}" for r in range(1, p.world_size)]
        if keys:
            try:
                store.wait(keys, datetime.timedelta(seconds=wait_s))
            except dist.DistStoreError as exc:  # the ranks that reported are taken
                log.warning("Step %d: not every rank reported its shard in time (%s).", step, exc)
        files = {}
        for key in keys:
            if store.check([key]):
                other, size, sha = json.loads(store.get(key))
                files[str(other)] = FileInfo(int(size), str(sha))
        return files

    return collect


def _published(m: Manifest) -> None:
    """Rank 0 wrote a snapshot: tell the agent, which publishes its step in etcd."""
    log.info("Persisted step %d (world size %d).", m.step, m.world_size)
    channel = _runtime.channel
    if channel is not None:
        channel.notify(
            {"type": "persisted", "step": m.step, "epoch": m.epoch, "world_size": m.world_size}
        )


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _broadcast_state(state: dict[str, Any] | None, src: int, side: Any) -> dict[str, Any] | None:
    """Broadcast ``state`` (given on rank ``src`` only) to every rank of the group.

    Its structure and every non-tensor value go as one pickle over the CPU side group; each
    tensor then goes on its own device: CPU tensors over the side group, device tensors over
    the training group (NCCL on GPUs), received straight into a tensor on this worker's own
    device. So no collective of the training group ever carries a CPU tensor, and no GPU
    tensor is staged through host memory. Returns the state (None where ``src`` had none).
    """
    tensors: list[torch.Tensor] = []
    blob = b""
    if state is not None:
        leaves, _ = pytree.tree_flatten(state)
        tensors = [leaf.detach() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        skeleton = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), state
        )
        buffer = io.BytesIO()
        torch.save({"skeleton": skeleton, "device_types": [t.device.type for t in tensors]}, buffer)
        blob = buffer.getvalue()
    size = torch.tensor([len(blob)], dtype=torch.int64)
    dist.broadcast(size, src, group=side)
    if not int(size.item()):
        return None
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    if blob:
        data.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    dist.broadcast(data, src, group=side)
    if state is not None:
        for t in tensors:
            dist.broadcast(t.contiguous(), src, group=side if t.device.type == "cpu" else None)
        return state
    header = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
    own = device()
    leaves, spec = pytree.tree_flatten(header["skeleton"])
    kinds = iter(header["device_types"])
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            kind = next(kinds)
            t = torch.empty(leaf.shape, dtype=leaf.dtype, device="cpu" if kind == "cpu" else own)
            dist.broadcast(t, src, group=side if kind == "cpu" else None)
            leaf = t
        out.append(leaf)
    result: dict[str, Any] = pytree.tree_unflatten(out, spec)
    return result


def elastic_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: ElasticSampler | ElasticBatchSampler | None = None,
    scheduler: Any = None,
    snapshot_every: int = 1,
    **values: Any,
) -> ElasticState:
    """Track what must survive a rescale; see :class:`ElasticState`."""
    return ElasticState(model, optimizer, sampler, scheduler, snapshot_every, **values)


def _rebuild(state: ElasticState, failure: BaseException | None) -> bool:
    """Wait for the next placement and join its group; False if this worker should exit.

    Args:
        failure: the communication failure that left the generation (None: a pause). If no
            new placement comes within the placement timeout (longer while the job waits
            below --min), the failure was no membership change: it is raised again.
    """
    rt = _runtime
    assert rt.channel is not None and rt.placement is not None
    if failure is not None:
        state.restore()
    placement = rt.channel.wait(rt.placement.generation, rt.placement_timeout_s)
    if placement is None and failure is not None and not rt.channel.leave_requested:
        log.error(
            "No new generation came within %.0f s of a failed collective in generation %d: "
            "it was not a member leaving; ending this worker with the error.",
            rt.placement_timeout_s,
            rt.placement.generation,
        )
        raise failure
    if placement is None and rt.channel.leave_requested:
        # Leaving at a step boundary, maybe with every other node (preemption): put the state
        # on storage first, within the agent's grace period.
        grace = float(os.environ.get(GRACE_ENV, "30"))
        if not state.persist_now(timeout_s=max(1.0, grace - 2.0)):
            log.warning("Leaving before step %d was persisted (grace period).", state.step)
    rt.destroy_group(abort=failure is not None)
    if placement is None or rt.join(placement) is None:
        return False
    state.rescales += 1
    return True


def _record(exc: BaseException) -> None:
    """Write ``exc`` to torch's error file (as ``@record`` does), so the agent reports it."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


def elastic(state: ElasticState) -> Callable[[Callable[..., R]], Callable[..., R | None]]:
    """Run the training function so it survives rescales (Horovod's ``hvd.elastic.run``).

    On a pause, or when the job's communication fails inside a step (a peer died or was cut
    loose), the function is left, the group rebuilt, the state synced, and the function
    called again: it must resume from ``state`` (epoch, sampler). Any other error (CUDA out
    of memory, a bug, a collective that timed out while no member left) ends the worker with
    that error, written to torch's error file; the agent's restart policy applies.
    Returns the function's result, or None if the agent asked this worker to leave.
    """

    def wrap(fn: Callable[..., R]) -> Callable[..., R | None]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> R | None:
            while True:
                failure: BaseException | None = None
                try:
                    _runtime.inside = True
                    state.sync()  # a peer may die in here too
                    return fn(*args, **kwargs)
                except _Rescale:
                    pass
                except Exception as exc:
                    if not _left_generation(exc):
                        _record(exc)
                        raise
                    log.warning(
                        "A collective failed (%s); rolling back to step %d.",
                        str(exc).splitlines()[0][:200],
                        state.step,
                    )
                    failure = exc
                finally:
                    _runtime.inside = False
                try:
                    if not _rebuild(state, failure):
                        return None
                except Exception as exc:
                    _record(exc)
                    raise

        return run

    return wrap


def _left_generation(exc: BaseException) -> bool:
    """Whether ``exc`` means this worker's generation is over (rebuild in place) rather than
    the worker's own failure."""
    rt = _runtime
    if rt.channel is None:
        return False
    kind = classify(exc)
    if kind is Failure.TIMEOUT and rt.placement is not None:
        return rt.channel.superseded(rt.placement.generation)
    return kind is Failure.PEER

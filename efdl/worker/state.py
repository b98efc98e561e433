"""What must survive a rescale, the step boundary (``commit``), and the rebuild's sync.

``commit()`` ends a step: it waits on a tiny all-reduce started at the previous commit on the
CPU side group (no GPU synchronisation; by then it is long done) and starts the next one with
this rank's flags (efdl.worker.commit). Every rank reads the same result of the same
all-reduce, so all pause (and persist) at the same commit, after which none of them is inside
a collective.

Nothing is copied per step: the step is a transaction (efdl.worker.transaction), and on NCCL a
step counts on a rank only once its communication is known to have succeeded there
(efdl.worker.verdict). After a rebuild, :meth:`ElasticState.sync` makes every rank hold the
newest committed state (efdl.worker.sync): only the ranks that lack it receive it, tensor by
tensor in bounded messages, from the ranks that hold it (efdl.worker.transfer); when no rank
holds any, from the remote cache (efdl.worker.resume). What a rank holds is one tree
(efdl.worker.tree); its user values are efdl.worker.values.UserValues.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from efdl.protocol.messages import Paced, Persisted
from efdl.worker import sync
from efdl.worker.cache import CacheSettings, Manifest
from efdl.worker.commit import (
    Agreement,
    Fenced,
    Flag,
    Rescale,
    StepFailed,
    own_flags,
    peers_copy_here,
    persists_here,
    wait_fenced,
)
from efdl.worker.fence import Fence, fence
from efdl.worker.pace import Pace, StepClock, pace_window, slots
from efdl.worker.peers import PeerCopies, copies_every
from efdl.worker.persist import Persister
from efdl.worker.rng import rng_state
from efdl.worker.runtime import Runtime, get_runtime
from efdl.worker.sampler import Position
from efdl.worker.transaction import Recovery, Standing, StepPhase, recovery
from efdl.worker.transfer import Moved
from efdl.worker.tree import StateTree, clone_tree
from efdl.worker.values import UserValues
from efdl.worker.verdict import Verdicts

__all__ = ["RESERVED", "ElasticState", "Fenced", "Rescale", "StepFailed", "elastic_state"]

log = logging.getLogger(__name__)

# At a commit where a peer copy is due, a rank waits at most this share of its last step for
# its copy of the commit before to finish; past it, it skips this copy.
PEER_WAIT = 0.1

# DistributedDataParallel's options that efdl sets on each wrapper it builds.
_DDP_OWN = frozenset({"process_group", "device_mesh", "init_sync", "module"})


class ElasticState:
    """What must survive a rescale, and the step boundary (``commit``).

    Args:
        model: the module (not the DDP wrapper: ``state.ddp`` is rebuilt for each group).
        optimizer: its optimizer. Its ``step()`` is the one place the tensors change (the
            step is a transaction: see efdl.worker.transaction); efdl watches it through the
            optimizer's step hooks.
        sampler: an :class:`ElasticSampler`, :class:`ElasticBatchSampler` or
            :class:`efdl.ElasticStream`, told the world size and advanced on commit.
        scheduler: an LR scheduler, if any.
        ddp_kwargs: DistributedDataParallel's options for ``state.ddp`` (``bucket_cap_mb``,
            ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
            ``broadcast_buffers``, ``device_ids``, ...), given to every wrapper efdl builds:
            one per process group, so again after each rescale. ``process_group``,
            ``device_mesh`` and ``init_sync`` are efdl's (the new group; no init broadcast).
        comm_hook: a DDP communication hook (``bf16_compress_hook``, PowerSGD's
            ``powerSGD_hook``, ...) registered with ``comm_hook_state`` on every wrapper.
            Its state must name no process group (``None``: the group of the moment), for
            the group changes with each rescale. (A hook the script registers on
            ``state.ddp`` in the ``@efdl.elastic`` function is registered again by each
            entry, which follows each rebuild; one registered once elsewhere is not.)
        comm_hook_state: the hook's state (DDP's ``register_comm_hook(state, hook)``).
        snapshot_every: 0 (the default): no rollback copies. A positive N keeps a copy of the
            whole state every N commits, on the tensors' own devices, and a failure rolls
            back to it: for scripts that change the state outside ``optimizer.step()`` in a
            way a failure could tear (memory: one more copy of model and optimizer state;
            time: one device-to-device copy of it per N commits).
        **values: user values (hyper-parameters, counters), read and written as attributes
            (``state.lr``); they go with the state everywhere. Plain data only (numbers,
            strings, bytes, tensors, and lists, tuples, sets and dicts of them): anything
            else is refused here, on assignment and at ``commit()``
            (:class:`efdl.worker.values.StateValueError`), since no rank or snapshot could read
            it back.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: Position | None = None,
        scheduler: Any = None,
        snapshot_every: int = 0,
        ddp_kwargs: Mapping[str, Any] | None = None,
        comm_hook: Callable[..., Any] | None = None,
        comm_hook_state: Any = None,
        **values: Any,
    ) -> None:
        owned = sorted(set(ddp_kwargs or {}) & _DDP_OWN)
        if owned:
            raise ValueError(
                f"ddp_kwargs sets {owned[0]!r}, which efdl sets on each rebuilt DDP (the new "
                "process group, no init broadcast); leave it out."
            )
        if comm_hook is not None and not callable(comm_hook):
            raise ValueError(f"comm_hook is {comm_hook!r}; expected a DDP communication hook.")
        if not isinstance(snapshot_every, int) or snapshot_every < 0:
            raise ValueError(
                f"snapshot_every is {snapshot_every!r}; expected 0 (no rollback copies, the "
                "default) or a positive number of commits between copies."
            )
        # efdl's own attributes are all private (``_name``, set as usual); a public name is
        # efdl's (a property or method: RESERVED) or a user value, in ``_tree.values``.
        self._tree = StateTree(model, optimizer, scheduler, sampler, UserValues(values, RESERVED))
        self._snapshot_every = snapshot_every
        self._ddp: DistributedDataParallel | torch.nn.Module = model
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._hook = (comm_hook, comm_hook_state) if comm_hook is not None else None
        self._generation = 0
        self._rescales = 0
        self._phase = StepPhase.COMMITTED
        self._copy: dict[str, Any] | None = None  # the rollback copy (snapshot_every)
        self._agreement = Agreement()
        self._clock = StepClock()  # this rank's busy time per step (efdl.worker.pace)
        self._pace = Pace(pace_window())
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._clock.grad_ready)  # type: ignore[no-untyped-call]
        self._last_sync: Moved | None = None  # what the last sync moved here
        rt = get_runtime()
        self._verdicts = Verdicts(rt.errored, rt.step_event)
        settings = CacheSettings.from_env()
        self._fence = fence()
        self._persister = Persister(settings, fence=self._fence) if settings is not None else None
        self._peers = _peer_copies(self._tree, self._fence)
        self._committed_at = time.monotonic()
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._on_step_start)
            optimizer.register_step_post_hook(self._on_step_end)

    # ---------------------------------------------------------------- what efdl keeps

    @property
    def model(self) -> torch.nn.Module:
        """The module (sharded: on the current world's mesh; rebuilt after a rescale)."""
        return self._tree.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._tree.optimizer

    @property
    def sampler(self) -> Position | None:
        return self._tree.sampler

    @property
    def scheduler(self) -> Any:
        return self._tree.scheduler

    @property
    def snapshot_every(self) -> int:
        return self._snapshot_every

    @property
    def ddp(self) -> DistributedDataParallel | torch.nn.Module:
        """What the training step calls: the model wrapped for this generation's group."""
        return self._ddp

    @property
    def step(self) -> int:
        """The job's committed steps: one per ``commit()`` (a resume or a sync sets it)."""
        return self._tree.step

    @property
    def generation(self) -> int:
        """The generation (membership) this rank trains in; 0 before the first."""
        return self._generation

    @property
    def rescales(self) -> int:
        """How often this worker's state was rebuilt in place."""
        return self._rescales

    def rebuilt(self) -> None:
        """This worker joined its next generation in place (efdl.worker.elastic)."""
        self._rescales += 1

    @property
    def phase(self) -> StepPhase:
        """Where the current step stands (efdl.worker.transaction)."""
        return self._phase

    @property
    def last_sync(self) -> Moved | None:
        """What the last sync moved to and from this rank."""
        return self._last_sync

    # ---------------------------------------------------------------- user values

    def __getattr__(self, name: str) -> Any:
        """``state.<name>`` for a name that is not efdl's: the user value ``name``
        (efdl.worker.values.UserValues; AttributeError if none was declared so)."""
        if name.startswith("_"):  # efdl's own, not set yet
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self._tree.values.read(name)

    def __setattr__(self, name: str, value: Any) -> None:
        """``state.<name> = value`` sets the user value ``name``, declared at
        ``elastic_state(...)`` (``state.epoch`` also tells the sampler its epoch); a name
        that is efdl's, or was never declared, is refused (StateValueError). efdl's own
        attributes are private (``_name``) and set as usual."""
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        self._tree.values.write(name, value)
        if name == "epoch" and self._tree.sampler is not None:
            self._tree.sampler.set_epoch(int(value))

    # ---------------------------------------------------------------- the step transaction

    def _on_step_start(self, *_: Any) -> None:
        self._clock.step_started()
        self.fence()  # the snapshots being written have copied the tensors
        self._phase = StepPhase.STEPPING

    def _on_step_end(self, *_: Any) -> None:
        self._phase = StepPhase.STEPPED

    def commit(self) -> None:
        """End a step: count it, advance the sampler, and pause here if all ranks agree that
        the agent has news (persisting here if a snapshot is due).

        Cost: one asynchronous seven-integer all-reduce on a CPU gloo group per call, waited
        at the next call (so it overlaps the step), and a walk of the user values; no copy
        and no GPU synchronisation.
        """
        tree, rt = self._tree, get_runtime()
        busy = self._clock.committed()
        now = time.monotonic()
        step_s, self._committed_at = now - self._committed_at, now
        # Values changed in place (a list appended to) are checked here, before they spread.
        tree.values.check()
        tree.count_step()
        self._phase, tree.settled = StepPhase.COMMITTED, True
        rt.committed(tree.step)
        self._verdicts.committed(tree.step)
        agreed = self._agreement.read()
        if self._fence is not None and not self._fence.open():
            wait_fenced(self._fence, tree.step, rt)
        if agreed is not None:
            # Every rank has committed the step before this one (they all started the
            # agreement there): the newest step the job can count on, whatever fails next.
            floor = tree.step - 1
            if self._snapshot_every:  # a failure rolls back to the copies
                floor -= floor % self._snapshot_every
            rt.agreed(tree.step, floor)
            self._paced(agreed[len(Flag) :], rt)
            if agreed[Flag.FAILED]:
                raise StepFailed(
                    f"A rank's training group reported a communication error by step "
                    f"{tree.step}: every rank leaves this generation here."
                )
        if self._snapshot_every and tree.step % self._snapshot_every == 0:
            self._copy = tree.clone()
        if agreed is not None:
            pause = bool(agreed[Flag.NEWS])
            if persists_here(agreed, pause, self._persister):
                assert self._persister is not None
                self._persist(agreed[Flag.ATTEMPT], self._persister, _published)
            peers = self._peers.persister if self._peers is not None else None
            if peers_copy_here(agreed, pause, peers):
                assert peers is not None
                # Its copy of the commit before has had a step; a tenth of one more at most.
                if peers.flush(PEER_WAIT * step_s):
                    self._persist(agreed[Flag.ATTEMPT], peers, _copied)
                else:
                    peers.skip(tree.step, dist.get_rank(), agreed[Flag.ATTEMPT])
            if pause:
                raise Rescale()
        writers = self._writers()
        if not (rt.elastic or writers) or rt.side is None:
            return
        flags = own_flags(
            rt,
            self._verdicts.failed,
            self._persister,
            tree.step,
            self._peers.persister if self._peers is not None else None,
        )
        p = rt.placement
        own = slots(p.group_world_size, p.group_rank, busy) if p is not None else []
        self._agreement.start(flags, rt.side, own)

    def _paced(self, agreed_slots: Sequence[int], rt: Runtime) -> None:
        """One more step of every node's busy time; at each whole window, local rank 0
        tells its agent how its node stands (efdl.worker.pace)."""
        p = rt.placement
        if p is None or not self._pace.add(agreed_slots) or p.local_rank != 0:
            return
        pace = self._pace.of_node(p.group_rank)
        if pace is not None and rt.channel is not None:
            rt.channel.notify(
                Paced(p.generation, pace.node_s, pace.others_s, pace.steps, pace.slower)
            )

    def recover(self) -> Recovery:
        """After a failure inside a step or a sync: make this rank's state a committed one
        again (efdl.worker.transaction), and drop the step's partial gradients."""
        tree = self._tree
        self.fence()  # the writers have copied the rows a rollback is about to overwrite
        self._verdicts.after_failure(get_runtime().timeout.total_seconds())
        if self._copy is not None:
            target = int(self._copy["step"])
        else:
            target = tree.step + int(self._phase is StepPhase.STEPPED)
        trusted = self._verdicts.holds(target)
        action = recovery(self._phase, self._copy is not None, trusted)
        if not trusted:
            log.warning(
                "This rank's communication failed after step %d was verified: its tensors "
                "(step %d) may come from torn gradients; it takes the state from a peer.",
                self._verdicts.verified,
                target,
            )
        if action is Recovery.RESTORE_COPY:
            assert self._copy is not None
            copied = dict(self._copy)
            copied["optimizer"] = clone_tree(copied["optimizer"])  # the optimizer adopts them
            copied["values"] = copy.deepcopy(copied["values"])
            tree.load(copied, model_in_place=False)
            tree.holds, tree.settled = True, True
        elif action is Recovery.ROLL_FORWARD:
            tree.count_step()  # optimizer.step() had applied it
            tree.settled = False
        elif action is Recovery.DISCARD:
            tree.holds, tree.torn = False, True
        self._phase = StepPhase.COMMITTED
        tree.model.zero_grad(set_to_none=True)
        return action

    def standing(self) -> Standing:
        """What this rank holds, as the sync compares it."""
        return self._tree.standing(self._generation)

    # ---------------------------------------------------------------- the remote cache

    def fence(self) -> None:
        """Wait until the snapshot being persisted has copied the parameters; call before
        changing parameters in place outside ``optimizer.step()`` (which waits by itself)."""
        for writer in self._writers():
            writer.fence()

    def _writers(self) -> list[Persister]:
        """The background writers: the remote cache's, the peer copies'."""
        peers = self._peers.persister if self._peers is not None else None
        return [w for w in (self._persister, peers) if w is not None]

    def _persist(self, attempt: int, p: Persister, done: Callable[[float, Manifest], None]) -> None:
        """Hand this commit's state to background writer ``p`` (see efdl.worker.persist), as
        ``attempt`` (the same on every rank: efdl.worker.cache); rank 0 calls ``done`` with
        the time it began and the manifest once the snapshot is complete."""
        tree = self._tree
        epoch = tree.values.data.get("epoch")
        p.start(
            tree.step,
            epoch if isinstance(epoch, int) else None,
            dist.get_rank(),
            dist.get_world_size(),
            tree.tree(),
            tree.buffer_keys(),
            {"rng": rng_state()},
            functools.partial(done, time.monotonic()),
            attempt,
            self._generation,
        )

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the snapshot in flight; True if none is left."""
        return self._persister is None or self._persister.flush(timeout_s)

    # ---------------------------------------------------------------- sync

    def sync(self) -> None:
        """Make every rank hold the newest committed state; rebuild DDP for this group.

        One all-gather on the CPU side group says what each rank holds; the rank holding the
        newest step settled (the primary) shares the state's structure and every value that
        is not a tensor (a small pickle); the tensors go only to the ranks that lack that
        step, from every rank that holds it (efdl.worker.sync, efdl.worker.transfer). When no
        rank holds any (sharded: no step's rows are all held, as after a crash), the ranks
        read the newest snapshot of the remote cache between them (efdl.worker.resume); with
        no cache, rank 0's state is the job's at a cold start, and lost after a crash.
        """
        rt, tree = get_runtime(), self._tree
        world = dist.get_world_size()
        sync.said_setup(self._generation, rt)
        self.fence()  # a snapshot being persisted has copied the tensors the sync may change
        self._last_sync = None
        if self._peers is not None:
            self._peers.place(rt.side)
        tiers = [w for w in (self._peers.persister if self._peers else None, self._persister) if w]
        self._last_sync = sync.sync_tree(tree, self._generation, rt, tiers)
        for writer in tiers:  # counted from the step held now (a resume may go back)
            writer.count_from(tree.step)
        self._verdicts.reset(tree.step)
        if self._snapshot_every:
            self._copy = tree.clone()
        if tree.sampler is not None:
            tree.sampler.set_world(dist.get_rank(), world)
        self._rewrap(world > 1 or rt.elastic)
        self._generation = rt.placement.generation if rt.placement else 0
        self._agreement.drop()
        self._clock.restart()
        self._pace.reset()

    def hand_over(self, new_rank: int | None) -> None:
        """Sharded, at a pause, before the old group goes: the rows of the ranks that leave
        (``new_rank`` None) go to the ranks that stay, laid out over them in the order of
        their new ranks, so that the sync in the new group finds every row held (and, if
        nobody joins, moves nothing more). Every rank of the old group calls it."""
        tree = self._tree
        if tree.sharding is None or not tree.holds or tree.layout is None:
            return
        self.fence()  # a snapshot being persisted has copied the rows before they go
        moved = sync.hand_over(tree, new_rank, get_runtime())
        if moved is not None:
            self._last_sync = moved

    def _rewrap(self, wrapped: bool) -> None:
        """A new DDP wrapper for the new process group, with the script's options and
        communication hook."""
        model = self._tree.model
        self._ddp = model  # the old wrapper's buckets go before the new one's come
        if self._tree.sharding is not None or not wrapped:
            return
        # No init sync: every rank holds the same state now (it would broadcast the whole
        # model from rank 0 over the training group on every rebuild).
        ddp = DistributedDataParallel(model, init_sync=False, **self._ddp_kwargs)
        if self._hook is not None:
            hook, state = self._hook
            ddp.register_comm_hook(state, hook)
        self._ddp = ddp


RESERVED: frozenset[str] = frozenset(n for n in dir(ElasticState) if not n.startswith("_"))
"""The names efdl keeps on a state (attributes and methods): no user value may take one."""


def _published(started: float, m: Manifest) -> None:
    """Rank 0 wrote a snapshot (begun at monotonic ``started``): tell the agent, which
    publishes its step in etcd."""
    log.info("Persisted step %d (world size %d).", m.step, m.world_size)
    channel = get_runtime().channel
    if channel is not None:
        size = sum(f.size for f in m.files.values())
        seconds = time.monotonic() - started
        channel.notify(Persisted(m.step, m.epoch, m.world_size, size, seconds, m.generation))


def _copied(started: float, m: Manifest) -> None:
    """Rank 0 completed a peer copy (begun at monotonic ``started``)."""
    log.debug("Peer copy of step %d complete in %.2f s.", m.step, time.monotonic() - started)


def _peer_copies(tree: StateTree, fence: Fence | None) -> PeerCopies | None:
    """The peer copies the agent asked for (--peer-copies), for a sharded model: a
    replicated one is held whole by every survivor of a crash."""
    if tree.sharding is None:
        if copies_every(os.environ):
            log.info("--peer-copies is for sharded models (efdl.fully_shard): this one is not.")
        return None
    return PeerCopies.from_env(fence)


def elastic_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: Position | None = None,
    scheduler: Any = None,
    snapshot_every: int = 0,
    ddp_kwargs: Mapping[str, Any] | None = None,
    comm_hook: Callable[..., Any] | None = None,
    comm_hook_state: Any = None,
    **values: Any,
) -> ElasticState:
    """Track what must survive a rescale; see :class:`ElasticState`."""
    return ElasticState(
        model,
        optimizer,
        sampler,
        scheduler,
        snapshot_every,
        ddp_kwargs,
        comm_hook,
        comm_hook_state,
        **values,
    )

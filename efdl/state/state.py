"""What must survive a rescale, the step boundary (``commit``), and the rebuild's sync.

``commit()`` ends a step: it waits on a tiny all-reduce started at the previous commit on the
CPU side group (no GPU synchronisation; by then it is long done) and starts the next one with
this rank's flags. Every rank reads the same result of the same all-reduce, so all pause (and
persist) at the same commit, after which none of them is inside a collective.

Nothing is copied per step: the step is a transaction (efdl.state.transaction), and on NCCL a
step counts on a rank only once its communication is known to have succeeded there
(efdl.state.verdict). After a rebuild, :meth:`ElasticState.sync` gathers what each rank holds
and a digest of it (efdl.state.digest: a replica unlike the others is torn), and only the
ranks that lack the newest committed state receive it, tensor by tensor in bounded messages,
from the ranks that hold it (efdl.state.transfer); when no rank holds any, from the remote
cache (efdl.state.resume).
"""

from __future__ import annotations

import copy
import enum
import functools
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from efdl.errors import RendezvousTimeoutError, StateLostError
from efdl.protocol.env import GRACE_ENV, SYNC_BUCKET_ENV
from efdl.protocol.messages import Persisted, ResumedFromCache, StateLost
from efdl.state import sharded, transfer
from efdl.state import values as state_values
from efdl.state.cache import CacheSettings, Manifest
from efdl.state.device import device
from efdl.state.digest import digest
from efdl.state.fence import Fence, fence
from efdl.state.layout import Layout, byte_span, rows
from efdl.state.persist import Persister
from efdl.state.resume import Resumed, resume
from efdl.state.rng import rng_state
from efdl.state.runtime import Runtime, runtime
from efdl.state.sampler import Position
from efdl.state.transaction import Choice, Loss, Recovery, Standing, StepPhase, choose, recovery
from efdl.state.values import StateValueError
from efdl.state.verdict import Verdicts

log = logging.getLogger(__name__)


# A newcomer whose setup after joining the group made the others wait this long says so.
SETUP_SAID_S = 1.0
# How often a fenced rank looks whether its agent reached etcd again (a mapped page).
FENCE_POLL_S = 0.1
# DistributedDataParallel's options that efdl sets on each wrapper it builds.
_DDP_OWN = frozenset({"process_group", "device_mesh", "init_sync", "module"})


class Rescale(Exception):
    """All ranks agreed to pause at this commit."""


class _Flag(enum.IntEnum):
    """One rank's word in the per-commit agreement (all-reduced with MAX)."""

    NEWS = 0  # the agent has news (a ready generation, or leave): pause
    PERSIST = 1  # rank 0: a snapshot is due
    BUSY = 2  # this rank's writer is still writing the last one
    LEAVING = 3  # this rank was asked to leave
    STAYING = 4  # this rank was not
    FAILED = 5  # this rank's group reported a communication error (efdl.state.verdict)
    ATTEMPT = 6  # rank 0: a random number, the attempt of a snapshot started here


class StepFailed(dist.DistError):
    """A rank's group reported a communication error: every rank leaves the generation at
    the same commit (a failure of the job's communication: rebuilt in place)."""


class Fenced(dist.DistError):
    """This rank stopped committing because its agent could not reach etcd (efdl.state.fence),
    and its agent has since placed it in a newer generation, or asked it to leave: it leaves
    its generation as after a failure, its state as committed."""


class ElasticState:
    """What must survive a rescale, and the step boundary (``commit``).

    Args:
        model: the module (not the DDP wrapper: ``state.ddp`` is rebuilt for each group).
        optimizer: its optimizer. Its ``step()`` is the one place the tensors change (the
            step is a transaction: see efdl.state.transaction); efdl watches it through the
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
            (:class:`efdl.state.values.StateValueError`), since no rank or snapshot could read
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
        taken = sorted(set(values) & RESERVED)
        if taken:
            raise StateValueError(
                f"The state value name {taken[0]!r} is efdl's own (state.{taken[0]} is "
                f"read-only){_OWN_HINT}"
            )
        state_values.check_all(values)
        object.__setattr__(self, "_values", dict(values))
        self._model = model
        self._sharding = sharded.sharding_of(model)
        self._layout: Layout | None = None  # the rows this rank holds (sharded)
        self._rows: dict[str, transfer.Region] | None = None  # held apart from the model
        self._optimizer = optimizer
        self._sampler = sampler
        self._scheduler = scheduler
        self._snapshot_every = snapshot_every
        self._step = 0
        self._ddp: DistributedDataParallel | torch.nn.Module = model
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._hook = (comm_hook, comm_hook_state) if comm_hook is not None else None
        self._generation = 0
        self._rescales = 0
        self._phase = StepPhase.COMMITTED
        self._holds = False  # the tensors are a committed step's (False: new, or torn)
        self._settled = True  # and so is the rest (False after a roll-forward)
        self._torn = False  # it held state and a failure tore it
        self._copy: dict[str, Any] | None = None  # the rollback copy (snapshot_every)
        self._flags = torch.zeros(len(_Flag), dtype=torch.int64)
        self._agree_work: Any = None
        self._last_sync: transfer.Moved | None = None  # what the last sync moved here
        self._verdicts = Verdicts(runtime.errored, runtime.step_event)
        settings = CacheSettings.from_env()
        self._fence = fence()
        self._persister = Persister(settings, fence=self._fence) if settings is not None else None
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._on_step_start)
            optimizer.register_step_post_hook(self._on_step_end)

    # ---------------------------------------------------------------- what efdl keeps

    @property
    def model(self) -> torch.nn.Module:
        """The module (sharded: on the current world's mesh; rebuilt after a rescale)."""
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    @property
    def sampler(self) -> Position | None:
        return self._sampler

    @property
    def scheduler(self) -> Any:
        return self._scheduler

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
        return self._step

    @property
    def generation(self) -> int:
        """The generation (membership) this rank trains in; 0 before the first."""
        return self._generation

    @property
    def rescales(self) -> int:
        """How often this worker's state was rebuilt in place."""
        return self._rescales

    def rebuilt(self) -> None:
        """This worker joined its next generation in place (efdl.state.elastic)."""
        self._rescales += 1

    @property
    def phase(self) -> StepPhase:
        """Where the current step stands (efdl.state.transaction)."""
        return self._phase

    @property
    def last_sync(self) -> transfer.Moved | None:
        """What the last sync moved to and from this rank."""
        return self._last_sync

    # ---------------------------------------------------------------- user values

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(
            f"The state has no value {name!r}; its values are {sorted(values)} (declare one "
            f"as efdl.elastic_state(..., {name}=<initial value>))."
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):  # efdl's own bookkeeping
            object.__setattr__(self, name, value)
            return
        values = object.__getattribute__(self, "_values")
        if name in values:
            state_values.check(name, value)
            values[name] = value
            if name == "epoch" and self._sampler is not None:
                self._sampler.set_epoch(int(value))
        elif name in RESERVED:
            raise StateValueError(f"state.{name} is efdl's own and read-only{_OWN_HINT}")
        else:
            raise StateValueError(
                f"state.{name} is not a value of this state, so it would not go with the state "
                f"to other ranks or snapshots: declare it as efdl.elastic_state(..., "
                f"{name}=<initial value>)."
            )

    # ---------------------------------------------------------------- the step transaction

    def _on_step_start(self, *_: Any) -> None:
        if self._persister is not None:
            self._persister.fence()  # the snapshot being persisted has copied the tensors
        self._phase = StepPhase.STEPPING

    def _on_step_end(self, *_: Any) -> None:
        self._phase = StepPhase.STEPPED

    def _count_step(self) -> None:
        self._step += 1
        if self._sampler is not None:
            self._sampler.advance()

    def commit(self) -> None:
        """End a step: count it, advance the sampler, and pause here if all ranks agree that
        the agent has news (persisting here if a snapshot is due).

        Cost: one asynchronous seven-integer all-reduce on a CPU gloo group per call, waited
        at the next call (so it overlaps the step), and a walk of the user values; no copy
        and no GPU synchronisation.
        """
        # Values changed in place (a list appended to) are checked here, before they spread.
        state_values.check_all(object.__getattribute__(self, "_values"))
        self._count_step()
        self._phase, self._settled = StepPhase.COMMITTED, True
        rt = runtime
        rt.committed(self._step)
        self._verdicts.committed(self._step)
        agreed: list[int] | None = None
        if self._agree_work is not None:
            self._agree_work.wait()
            agreed = [int(x) for x in self._flags.tolist()]
            self._agree_work = None
        if self._fence is not None and not self._fence.open():
            self._wait_fenced(self._fence)
        if agreed is not None:
            # Every rank has committed the step before this one (they all started the
            # agreement there): the newest step the job can count on, whatever fails next.
            floor = self._step - 1
            if self._snapshot_every:  # a failure rolls back to the copies
                floor -= floor % self._snapshot_every
            rt.agreed(self._step, floor)
        if agreed is not None and agreed[_Flag.FAILED]:
            raise StepFailed(
                f"A rank's training group reported a communication error by step {self._step}: "
                "every rank leaves this generation here."
            )
        if self._snapshot_every and self._step % self._snapshot_every == 0:
            self._copy = self._clone()
        if agreed is not None:
            pause = bool(agreed[_Flag.NEWS])
            if self._persists_here(agreed, pause):
                self._persist(agreed[_Flag.ATTEMPT])
            if pause:
                raise Rescale()
        if not (rt.elastic or self._persister is not None) or rt.side is None:
            return
        flags = [0] * len(_Flag)
        if rt.channel is not None and rt.placement is not None:
            flags[_Flag.NEWS] = int(rt.channel.pending(rt.placement.generation))
            flags[_Flag.LEAVING] = int(rt.channel.leave_requested)
        flags[_Flag.STAYING] = 1 - flags[_Flag.LEAVING]
        flags[_Flag.FAILED] = int(self._verdicts.failed)
        if self._persister is not None:
            flags[_Flag.PERSIST] = int(dist.get_rank() == 0 and self._persister.due(self._step))
            flags[_Flag.BUSY] = int(self._persister.busy)
            if dist.get_rank() == 0:
                flags[_Flag.ATTEMPT] = secrets.randbits(62) | 1  # not the seeded random
        self._flags.copy_(torch.tensor(flags))
        self._agree_work = dist.all_reduce(
            self._flags, op=dist.ReduceOp.MAX, group=rt.side, async_op=True
        )

    def _wait_fenced(self, f: Fence) -> None:
        """This rank's agent has not reached etcd for the fence timeout: commit nothing more
        (no progress, no snapshot, no next step), the state kept in memory, until it does;
        leave the generation if the agent places this rank in a newer one or asks it to
        leave meanwhile (:class:`Fenced`). Waits up to the join timeout, checking the
        fence's page and the channel ten times a second."""
        rt = runtime
        generation = rt.placement.generation if rt.placement is not None else 0
        log.warning(
            "This rank's agent has not reached etcd for longer than its fence timeout (%.1f s "
            "past it): step %d is kept in memory and nothing more is committed until it does, "
            "since a leader may replace a generation cut off from etcd (waiting up to %.0f s).",
            f.closed_for(),
            self._step,
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
                        f"Fenced at step {self._step} (generation {generation}), and this "
                        "rank's agent has since placed it in a newer generation or asked it "
                        "to leave."
                    )
                if f.open():
                    break
                if time.monotonic() > deadline:
                    raise RendezvousTimeoutError(
                        f"This rank's agent did not reach etcd within {rt.join_timeout_s:.0f} s "
                        f"of its fence closing at step {self._step}: ending this worker."
                    )
                time.sleep(FENCE_POLL_S)
        log.warning("This rank's agent reached etcd again: step %d goes on.", self._step)

    def _persists_here(self, agreed: list[int], pause: bool) -> bool:
        """Whether every rank persists at this commit: all decide alike, from ``agreed``,
        except that when everyone leaves, a rank whose writer is still busy after waiting
        half the grace period skips (that snapshot then lacks its parts and never completes,
        the one before it stands)."""
        p = self._persister
        if p is None:
            return False
        busy = bool(agreed[_Flag.BUSY])
        if pause and agreed[_Flag.LEAVING]:  # ranks leave: their part of the state goes along
            if not busy:
                return True
            if not agreed[_Flag.STAYING]:  # everyone leaves (preemption): finish, then persist
                p.flush(max(1.0, float(os.environ.get(GRACE_ENV, "30")) / 2))
                return not p.busy
            return False
        return bool(agreed[_Flag.PERSIST]) and not busy

    def recover(self) -> Recovery:
        """After a failure inside a step or a sync: make this rank's state a committed one
        again (efdl.state.transaction), and drop the step's partial gradients."""
        self._verdicts.after_failure(runtime.timeout.total_seconds())
        if self._copy is not None:
            target = int(self._copy["step"])
        else:
            target = self._step + int(self._phase is StepPhase.STEPPED)
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
            tree = dict(self._copy)
            tree["optimizer"] = _clone(tree["optimizer"])  # the optimizer adopts its tensors
            tree["values"] = copy.deepcopy(tree["values"])
            self._load(tree, model_in_place=False)
            self._holds, self._settled = True, True
        elif action is Recovery.ROLL_FORWARD:
            self._count_step()  # optimizer.step() had applied it
            self._settled = False
        elif action is Recovery.DISCARD:
            self._holds, self._torn = False, True
        self._phase = StepPhase.COMMITTED
        self._model.zero_grad(set_to_none=True)
        return action

    def standing(self) -> Standing:
        """What this rank holds, as the sync compares it."""
        if not self._holds:
            return Standing(None, torn=self._torn)
        return Standing(self._step, self._settled, generation=self._generation)

    # ---------------------------------------------------------------- the remote cache

    def fence(self) -> None:
        """Wait until the snapshot being persisted has copied the parameters; call before
        changing parameters in place outside ``optimizer.step()`` (which waits by itself)."""
        if self._persister is not None:
            self._persister.fence()

    def _persist(self, attempt: int) -> None:
        """Hand this commit's state to the background writer (see efdl.state.persist), as
        ``attempt`` (the same on every rank: efdl.state.cache)."""
        p = self._persister
        assert p is not None
        epoch = object.__getattribute__(self, "_values").get("epoch")
        p.start(
            self._step,
            epoch if isinstance(epoch, int) else None,
            dist.get_rank(),
            dist.get_world_size(),
            self._state_dict(),
            self._buffer_keys(),
            {"rng": rng_state()},
            functools.partial(_published, time.monotonic()),
            attempt,
            self._generation,
        )

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the snapshot in flight; True if none is left."""
        return self._persister is None or self._persister.flush(timeout_s)

    # ---------------------------------------------------------------- the state tree

    def _state_dict(self) -> dict[str, Any]:
        return {
            "model": self._model.state_dict(),
            # `is not None`, never truthiness: a sampler at the end of its epoch has length 0
            # (a crash right after an epoch's last commit then lost the cursor, and the
            # finished epoch was trained again).
            "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None,
            "scheduler": self._scheduler.state_dict() if self._scheduler is not None else None,
            "sampler": self._sampler.state_dict() if self._sampler is not None else None,
            "step": self._step,
            "values": object.__getattribute__(self, "_values"),
        }

    def _clone(self) -> dict[str, Any]:
        """A rollback copy: tensors cloned on their own device (no host synchronisation)."""
        cloned: dict[str, Any] = _clone(self._state_dict())
        return cloned

    def _load(self, tree: dict[str, Any], model_in_place: bool) -> None:
        """Take ``tree`` as this rank's state. ``model_in_place``: the model's tensors in it
        are the model's own (received in place): nothing to copy."""
        if not model_in_place:
            self._model.load_state_dict(tree["model"])
        if self._optimizer is not None and tree["optimizer"] is not None:
            self._optimizer.load_state_dict(tree["optimizer"])  # adopts the tensors: no copy
        if self._scheduler is not None and tree["scheduler"] is not None:
            self._scheduler.load_state_dict(tree["scheduler"])
        if self._sampler is not None and tree["sampler"] is not None:
            self._sampler.load_state_dict(tree["sampler"])
        self._step = int(tree["step"])
        object.__getattribute__(self, "_values").update(tree["values"])

    def _buffer_keys(self) -> set[str]:
        """The key paths of the model's buffers (what the next forward changes, and DDP
        broadcasts from rank 0)."""
        return {_key("model", name) for name, _ in self._model.named_buffers()}

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's tensors by key path: what a received tensor may land in."""
        leaves, _ = pytree.tree_flatten_with_path(self._state_dict())
        return {pytree.keystr(p): t for p, t in leaves if isinstance(t, torch.Tensor)}

    # ---------------------------------------------------------------- sync

    def sync(self) -> None:
        """Make every rank hold the newest committed state; rebuild DDP for this group.

        One all-gather on the CPU side group says what each rank holds; the rank holding the
        newest step settled (the primary) shares the state's structure and every value that
        is not a tensor (a small pickle); the tensors go only to the ranks that lack that
        step, from every rank that holds it (efdl.state.transfer). When no rank holds any
        (sharded: no step's rows are all held, as after a crash), the ranks read the newest
        snapshot of the remote cache between them (efdl.state.resume); with no cache, rank
        0's state is the job's at a cold start, and lost after a crash.
        """
        rt = runtime
        side = rt.side
        rank, world = dist.get_rank(), dist.get_world_size()
        self._said_setup(rt)
        self.fence()  # a snapshot being persisted has copied the tensors the sync may change
        held = self._layout if self._holds else None
        mine = torch.tensor(
            [
                self.standing().key(),
                *((held.shards, held.index) if held else (0, 0)),
                self._digest(),
            ],
            dtype=torch.int64,
        )
        gathered = [torch.zeros(4, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(gathered, mine, group=side)
        keys = [int(g[0].item()) for g in gathered]
        layouts = [Layout(int(g[1]), int(g[2])) if int(g[1]) else None for g in gathered]
        digests = [int(g[3].item()) for g in gathered]
        p = rt.placement
        job_step, job_generation = (p.job_step, p.job_generation) if p is not None else (0, 0)
        sharded_state = self._sharding is not None
        choice = choose(
            keys,
            layouts if sharded_state else None,
            job_step,
            None if sharded_state else digests,
            job_generation,
        )
        if choice.diverged and rank == choice.primary:
            log.warning(
                "The replicas of step %s differ: rank(s) %s hold tensors unlike those of "
                "rank(s) %s (digests %s): they are taken as torn and receive the state.",
                choice.step,
                list(choice.diverged),
                list(choice.holders),
                {r: hex(digests[r] & (2**64 - 1)) for r in (*choice.diverged, choice.primary)},
            )
        self._last_sync = None
        resumed = None
        if choice.step is None:
            resumed = self._resume()
        elif choice.loss is Loss.BEHIND:  # only a newer snapshot than the holders' will do
            resumed = self._resume(above=(choice.generation, choice.step))
        if resumed is not None:
            self._last_sync = resumed.moved
            if runtime.channel is not None and dist.get_rank() == 0:
                runtime.channel.notify(ResumedFromCache(resumed.manifest.step))
            log.warning(
                "%s: resuming from step %d (epoch %s, generation %d) in %s.",
                "No committed step is held whole by the ranks"
                if choice.step is None
                else f"The newest step the ranks hold ({choice.step}) is behind the job's "
                f"({job_step})",
                resumed.manifest.step,
                resumed.manifest.epoch,
                resumed.manifest.generation,
                self._persister.settings.url if self._persister is not None else "?",
            )
        elif choice.loss is not None:
            error = StateLostError(self._why_lost(choice, keys, (job_generation, job_step)))
            if runtime.channel is not None and rank == 0:
                runtime.channel.notify(StateLost(str(error)))
            raise error
        elif self._sharding is not None:
            self._reshard(choice, layouts)
        else:
            self._receive(choice)
        self._holds, self._settled, self._torn = True, True, False
        self._verdicts.reset(self._step)
        if self._snapshot_every:
            self._copy = self._clone()
        if self._sampler is not None:
            self._sampler.set_world(rank, world)
        self._rewrap(world > 1 or rt.elastic)
        self._generation = rt.placement.generation if rt.placement else 0
        self._agree_work = None

    def _said_setup(self, rt: Runtime) -> None:
        """A newcomer to a job that trains, at its first sync, if it declared itself at its
        join (NCCL: Runtime.defer_join): the others stopped training when it joined the
        group (efdl.init_process_group) and wait here for it; what it did since (building its
        model, most often) they waited for. Said when that is long."""
        p, since = rt.placement, rt.held_up_since
        if self._generation or p is None or not p.job_step or since is None:
            return
        waited = time.monotonic() - since
        if waited >= SETUP_SAID_S:
            log.warning(
                "The job's other ranks stood still %.1f s for this newcomer's setup between "
                "efdl.init_process_group() and its training function (building its model, "
                "most often): build the model and optimizer before efdl.init_process_group() "
                "where the script can, and they train on meanwhile.",
                waited,
            )

    def _rewrap(self, wrapped: bool) -> None:
        """A new DDP wrapper for the new process group, with the script's options and
        communication hook."""
        self._ddp = self._model  # the old wrapper's buckets go before the new one's come
        if self._sharding is not None or not wrapped:
            return
        # No init sync: every rank holds the same state now (it would broadcast the whole
        # model from rank 0 over the training group on every rebuild).
        ddp = DistributedDataParallel(self._model, init_sync=False, **self._ddp_kwargs)
        if self._hook is not None:
            hook, state = self._hook
            ddp.register_comm_hook(state, hook)
        self._ddp = ddp

    def _digest(self) -> int:
        """This replica's digest (efdl.state.digest) of its parameters and optimizer state; 0
        where there is none to compare: a rank that holds no step, or a sharded state (its
        rows differ by design). Buffers are left out: DDP broadcasts them from rank 0 only at
        the next forward (batch-norm statistics differ between replicas until then)."""
        if not self._holds or self._sharding is not None:
            return 0
        buffers = self._buffer_keys()
        return digest(
            t
            for k, t in self._own_tensors().items()
            if k.startswith(("['model']", "['optimizer']")) and k not in buffers
        )

    def _why_lost(self, choice: Choice, keys: list[int], job: tuple[int, int]) -> str:
        """The :class:`StateLostError` message: what was lost, why, and the ways on."""
        p = self._persister
        loss, (job_generation, job_step) = choice.loss, job
        cache = (
            f"the remote cache {p.settings.url} holds no snapshot yet"
            if p is not None
            else "no remote cache holds a snapshot (run with --cache-url to survive this)"
        )
        if loss is Loss.BEHIND:
            newer = (
                f"the remote cache {p.settings.url} holds nothing newer"
                if p is not None
                else "no remote cache holds anything newer (run with --cache-url)"
            )
            return (
                f"The job's state is lost: it had committed step {job_step} (in generation "
                f"{job_generation}), but the newest state any rank of this generation holds is "
                f"step {choice.step} of generation {choice.generation}: the ranks that trained "
                f"past it are gone, and {newer}. It will not go back "
                f"{max(0, job_step - (choice.step or 0))} steps by itself: resume it from a remote "
                "cache (--cache-url, persisted before the loss), or start it afresh with "
                "efdl-run --new-run."
            )
        if loss is Loss.UNCOVERED:
            held = sorted({k // 2 for k in keys if k >= 0})
            return (
                "The job's sharded state is lost: no step's rows are all held by the ranks left "
                "(a rank that held some died, and its peers have stepped past the step before; "
                f"steps held: {held}), and {cache}."
            )
        if loss is Loss.TORN:
            return (
                "The job's state is lost: every rank that held it was torn, by a failure "
                "inside optimizer.step() (an optimizer that communicates inside step()) or, on "
                "NCCL, by an update enqueued behind a step's communication that failed before "
                f"it was known complete, and {cache}. Keep rollback copies "
                "(efdl.elastic_state(..., snapshot_every=1)) or a remote cache (--cache-url)."
            )
        return (
            f"The job's state is lost: it had committed step {job_step}, but no rank of this "
            f"generation holds any step (every worker that held one is gone), and {cache}. "
            "It will not start over from step 0 by itself: resume it from a remote cache "
            "(--cache-url, persisted before the loss), or start it afresh with efdl-run "
            "--new-run."
        )

    def _resume(self, above: tuple[int, int] | None = None) -> Resumed | None:
        """Every rank: load the remote cache's newest snapshot (newer than ``above``, a
        (generation, step), if given; none: None). A sharded model is built on this world's
        mesh first and its rows read into it (its old rows, of a world that is gone and a
        step not whole, are freed before)."""
        p = self._persister
        if p is None:
            return None
        own = self._own_tensors()
        load = functools.partial(
            resume,
            p.storage,
            links=self._links(),
            timeout=runtime.timeout,
            bucket=_bucket(),
            above=above,
        )
        if self._sharding is None:
            resumed = load(own=own, own_device=device())
            if resumed is not None:
                self._load(resumed.tree, resumed.model_in_place)
            return resumed
        model = self._on_this_world()
        if model is not self._model:
            self._holds, self._torn = False, self._holds or self._torn
            sharded.release(self._model, self._optimizer)
        mesh = sharded.mesh_of(model)
        into = {_key("model", n): t for n, t in model.state_dict().items()}

        def rows_into(key: str, meta: torch.Tensor) -> torch.Tensor:
            found = into.get(key)
            return found if found is not None else sharded.empty(meta.shape, meta.dtype, mesh)

        resumed = load(own={**own, **into}, own_device=device(), rows_into=rows_into)
        if resumed is not None:
            self._adopt(model, resumed.tree)
        return resumed

    def _on_this_world(self) -> torch.nn.Module:
        """The sharded model on this world's mesh: the model itself if it is sharded over
        this group already (a newcomer, a cold start), else built anew."""
        assert self._sharding is not None
        if sharded.on_current_group(self._model):
            return self._model
        return self._sharding.build(sharded.mesh())

    def _adopt(self, model: torch.nn.Module, tree: dict[str, Any]) -> None:
        """Take ``model`` (sharded on this world's mesh, its rows in ``tree``) and ``tree`` as
        this rank's state; free the old model's rows."""
        old = self._model
        if model is not old and self._optimizer is not None:
            sharded.rebind(self._optimizer, old, model)
        self._model = model
        self._load(tree, model_in_place=True)
        self._layout, self._rows = Layout(dist.get_world_size(), dist.get_rank()), None
        if model is not old:
            sharded.release(old, None)

    def _links(self) -> dict[bool, transfer.Link]:
        side, cpu = runtime.side, torch.device("cpu")
        on_device = transfer.Link(None, device()) if runtime.backend == "nccl" else None
        return {False: transfer.Link(side, cpu), True: on_device or transfer.Link(side, cpu)}

    def _header(self, primary: int) -> dict[str, Any]:
        """The state's structure and values (no tensor data) from ``primary``, on every rank."""
        mine = transfer.header(self._state_dict()) if dist.get_rank() == primary else None
        shared: dict[str, Any] = transfer.share(mine, primary, runtime.side)
        return shared

    def _move(
        self,
        leaves: Sequence[transfer.Leaf],
        held: Sequence[transfer.Region | None],
        wanted: Sequence[transfer.Region | None],
        fresh: Sequence[bool],
    ) -> transfer.Moved:
        """Move ``leaves`` over this group's links, in buckets, within its timeout."""
        return transfer.move(leaves, held, wanted, self._links(), runtime.timeout, _bucket(), fresh)

    def _receive(self, choice: Choice) -> None:
        rank = dist.get_rank()
        header = self._header(choice.primary)
        holding = rank in choice.holders
        if rank in choice.needy:  # torn until every tensor has arrived
            self._holds, self._torn = False, self._holds
        lands = transfer.targets(
            header["tree"], header["devices"], self._own_tensors(), holding, device()
        )
        ranks = range(dist.get_world_size())
        leaves = [transfer.Leaf.whole(t.nbytes, t.on_device, choice.holders, ranks) for t in lands]
        tensors = [t.tensor for t in lands]
        regions = [transfer.Region(t) for t in tensors]
        fresh = [not t.own and not t.on_device for t in lands]
        self._last_sync = self._move(leaves, regions, regions, fresh)
        if rank != choice.primary:
            in_place = all(t.own for t in lands if t.key.startswith("['model']"))
            self._load(transfer.fill(header["tree"], tensors), model_in_place=in_place)

    def hand_over(self, new_rank: int | None) -> None:
        """Sharded, at a pause, before the old group goes: the rows of the ranks that leave
        (``new_rank`` None) go to the ranks that stay, laid out over them in the order of
        their new ranks, so that the sync in the new group finds every row held (and, if
        nobody joins, moves nothing more). Every rank of the old group calls it."""
        rt = runtime
        if self._sharding is None or not self._holds or self._layout is None:
            return
        self.fence()  # a snapshot being persisted has copied the rows before they go
        rank, world = dist.get_rank(), dist.get_world_size()
        fate = torch.tensor([-1 if new_rank is None else new_rank], dtype=torch.int64)
        fates = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(fates, fate, group=rt.side)
        stayers = sorted(
            (r for r in range(world) if int(fates[r]) >= 0), key=lambda r: int(fates[r])
        )
        if len(stayers) in (0, world):  # nobody leaves, or everyone does
            return
        after = {r: Layout(len(stayers), i) for i, r in enumerate(stayers)}
        leaves: list[transfer.Leaf] = []
        held: list[transfer.Region | None] = []
        wanted: list[transfer.Region | None] = []
        kept: dict[str, transfer.Region] = {}
        for key, t in self._own_tensors().items():
            if not isinstance(t, DTensor):
                continue
            shape, itemsize = t.shape, t.element_size()
            leaves.append(
                transfer.rows_leaf(
                    shape,
                    itemsize,
                    t.device.type != "cpu",
                    [(r, Layout(world, r)) for r in range(world)],
                    after.items(),
                )
            )
            held.append(
                transfer.Region(sharded.local(t), byte_span(shape, itemsize, self._layout)[0])
            )
            if rank in after:
                start, end = rows(shape[0], after[rank])
                mine = torch.empty((end - start, *shape[1:]), dtype=t.dtype, device=t.device)
                kept[key] = transfer.Region(mine, byte_span(shape, itemsize, after[rank])[0])
            wanted.append(kept.get(key))
        fresh = [w is not None and w.tensor.device.type == "cpu" for w in wanted]
        self._last_sync = self._move(leaves, held, wanted, fresh)
        if rank in after:
            self._rows, self._layout = kept, after[rank]
            sharded.release(self._model, self._optimizer)  # the rows are in self._rows now

    def _reshard(self, choice: Choice, layouts: list[Layout | None]) -> None:
        """Sharded: build the model anew on this world's mesh (unless it is built on it
        already: a newcomer, or a cold start) and give every rank its new rows, from the
        holders of ``choice.step`` (their rows in ``layouts``) and from its own old rows."""
        assert self._sharding is not None
        rank, world = dist.get_rank(), dist.get_world_size()
        old = self._model
        current = sharded.on_current_group(old)
        new_layout = Layout(world, rank)
        if choice.step is None:  # a cold start: every rank's rows are the job's
            if not current:
                raise StateLostError("No rank holds any rows of the job's sharded state.")
            self._layout = new_layout
            return
        header = self._header(choice.primary)
        holding = rank in choice.holders
        model = self._on_this_world()
        mesh = sharded.mesh_of(model)
        own = self._own_tensors() if holding or current else {}
        model_tensors = {_key("model", n): t for n, t in model.state_dict().items()}
        split: set[str] = set(header["sharded"])
        leaves: list[transfer.Leaf] = []
        held: list[transfer.Region | None] = []
        wanted: list[transfer.Region | None] = []
        landed: list[torch.Tensor] = []
        fresh: list[bool] = []
        for key, meta in transfer.tensor_leaves(header["tree"]):
            on_device = header["devices"].get(key, "cpu") != "cpu"
            mine = own.get(key) if holding else None
            if key in split:
                span = functools.partial(byte_span, meta.shape, meta.element_size())
                dest = model_tensors.get(key)
                if dest is None:  # optimizer state: new rows, filled below
                    dest = sharded.empty(meta.shape, meta.dtype, mesh)
                leaves.append(
                    transfer.rows_leaf(
                        meta.shape,
                        meta.element_size(),
                        on_device,
                        [(r, lay) for r in choice.holders if (lay := layouts[r]) is not None],
                        [(r, Layout(world, r)) for r in range(world)],
                    )
                )
                if mine is None or self._layout is None:
                    held.append(None)
                elif self._rows is not None:  # handed over at the pause
                    held.append(self._rows[key])
                else:
                    held.append(transfer.Region(sharded.local(mine), span(self._layout)[0]))
                wanted.append(transfer.Region(sharded.local(dest), span(new_layout)[0]))
                landed.append(dest)
                fresh.append(False)
                continue
            into = model_tensors.get(key, own.get(key))
            land = transfer.target(
                key, meta, header["devices"].get(key, "cpu"), into, False, device()
            )
            leaves.append(transfer.Leaf.whole(meta.nbytes, on_device, choice.holders, range(world)))
            held.append(transfer.Region(mine) if mine is not None else None)
            wanted.append(transfer.Region(land.tensor))
            landed.append(land.tensor)
            fresh.append(not land.own and not on_device)
        # A failure in here leaves the old rows and tensors as they were (new ones land apart).
        self._last_sync = self._move(leaves, held, wanted, fresh)
        self._adopt(model, transfer.fill(header["tree"], landed))


RESERVED: frozenset[str] = frozenset(n for n in dir(ElasticState) if not n.startswith("_"))
"""The names efdl keeps on a state (attributes and methods): no user value may take one."""

_OWN_HINT = (
    f"; give your value another name (e.g. my_step=0 for a step counter of your own). "
    f"efdl's own names: {', '.join(sorted(RESERVED))}."
)


def _key(*names: str) -> str:
    return pytree.keystr(tuple(pytree.MappingKey(n) for n in names))


def _clone(tree: Any) -> Any:
    return pytree.tree_map(
        lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x), tree
    )


def _bucket() -> int:
    mb = float(os.environ.get(SYNC_BUCKET_ENV, transfer.DEFAULT_BUCKET / (1 << 20)))
    return max(1, int(mb * (1 << 20)))


def _published(started: float, m: Manifest) -> None:
    """Rank 0 wrote a snapshot (begun at monotonic ``started``): tell the agent, which
    publishes its step in etcd."""
    log.info("Persisted step %d (world size %d).", m.step, m.world_size)
    channel = runtime.channel
    if channel is not None:
        size = sum(f.size for f in m.files.values())
        seconds = time.monotonic() - started
        channel.notify(Persisted(m.step, m.epoch, m.world_size, size, seconds, m.generation))


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

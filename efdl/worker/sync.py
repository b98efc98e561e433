"""The rebuild's sync: every rank of a new generation comes to hold the newest committed state.

One all-gather on the CPU side group says which step each rank holds (and a digest of it:
efdl.worker.digest, a replica unlike the others is torn); the rank holding the newest step
settled (the primary) shares the state's structure and every value that is not a tensor (a
small pickle), and the tensors go only to the ranks that lack that step, from every rank that
holds it, in bounded messages (efdl.worker.transfer). A sharded (FSDP2) state is laid out again
over the new world (efdl.worker.layout), its leavers' rows handed to the ranks that stay at the
pause before (:func:`hand_over`). When no rank holds any step whole, the ranks read the newest
snapshot of the remote cache between them (efdl.worker.resume).

Each function here changes the :class:`~efdl.worker.tree.StateTree` it is given and returns
what it moved to and from this rank (``ElasticState.last_sync``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from efdl.errors import StateLostError
from efdl.protocol.env import SYNC_BUCKET_ENV
from efdl.protocol.messages import ResumedFromCache, StateLost
from efdl.worker import peers, resume, sharded, transfer
from efdl.worker.cache import SnapshotError
from efdl.worker.device import device
from efdl.worker.layout import Layout, byte_span, rows
from efdl.worker.persist import Persister
from efdl.worker.runtime import Runtime
from efdl.worker.transaction import Choice, Loss, choose, why_lost
from efdl.worker.tree import StateTree, key

log = logging.getLogger(__name__)

# A newcomer whose setup after joining the group made the others wait this long says so.
SETUP_SAID_S = 1.0


def sync_tree(
    tree: StateTree, generation: int, rt: Runtime, tiers: Sequence[Persister]
) -> transfer.Moved | None:
    """Make this rank's ``tree`` the newest committed state (every rank of the group at once).

    Args:
        generation: the generation this rank trained in (its standing's).
        tiers: the writers whose storage a resume reads (the peer copies', the remote
            cache's); empty: none.

    Raises:
        StateLostError: no rank holds the job's newest state, and the remote cache holds
            nothing to resume from (with no cache, rank 0's state is the job's at a cold
            start, and lost after a crash).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    held = tree.layout if tree.holds else None
    mine = torch.tensor(
        [
            tree.standing(generation).key(),
            *((held.shards, held.index) if held else (0, 0)),
            tree.digest(),
        ],
        dtype=torch.int64,
    )
    gathered = [torch.zeros(4, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, mine, group=rt.side)
    keys = [int(g[0].item()) for g in gathered]
    layouts = [Layout(int(g[1]), int(g[2])) if int(g[1]) else None for g in gathered]
    digests = [int(g[3].item()) for g in gathered]
    p = rt.placement
    job_step, job_generation = (p.job_step, p.job_generation) if p is not None else (0, 0)
    sharded_state = tree.sharding is not None
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
    moved: transfer.Moved | None = None
    found = None
    if choice.step is None:
        found = resume_from_cache(tree, tiers, rt)
    elif choice.loss is Loss.BEHIND:  # only a newer snapshot than the holders' will do
        found = resume_from_cache(tree, tiers, rt, above=(choice.generation, choice.step))
    remote = next((t.settings.url for t in tiers if t.settings.url != peers.URL), None)
    if found is not None:
        resumed, where = found
        moved = resumed.moved
        source = "the peer copies" if where == peers.URL else "the cache"
        if rt.channel is not None and rank == 0:
            rt.channel.notify(ResumedFromCache(resumed.manifest.step, source))
        why = (
            "No committed step is held whole by the ranks"
            if choice.step is None
            else f"The newest step the ranks hold ({choice.step}) is behind the job's ({job_step})"
        )
        log.warning(
            "%s: resuming from step %d (epoch %s, generation %d) in %s.",
            why,
            resumed.manifest.step,
            resumed.manifest.epoch,
            resumed.manifest.generation,
            source if where == peers.URL else where,
        )
    elif choice.loss is not None:
        error = StateLostError(why_lost(choice, keys, (job_generation, job_step), remote))
        if rt.channel is not None and rank == 0:
            rt.channel.notify(StateLost(str(error)))
        raise error
    elif tree.sharding is not None:
        moved = reshard(tree, choice, layouts, rt)
    else:
        moved = receive(tree, choice, rt)
    tree.holds, tree.settled, tree.torn = True, True, False
    return moved


def said_setup(generation: int, rt: Runtime) -> None:
    """A newcomer to a job that trains, at its first sync, if it declared itself at its
    join (NCCL: Runtime.defer_join): the others stopped training when it joined the
    group (efdl.init_process_group) and wait here for it; what it did since (building its
    model, most often) they waited for. Said when that is long. (``generation``: the one
    this rank trained in; 0: none, a newcomer.)"""
    p, since = rt.placement, rt.held_up_since
    if generation or p is None or not p.job_step or since is None:
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


def receive(tree: StateTree, choice: Choice, rt: Runtime) -> transfer.Moved:
    """Replicated: the tensors of ``choice.step`` to the ranks lacking them, the rest of the
    state from the primary."""
    rank = dist.get_rank()
    shared = header(tree, choice.primary, rt)
    holding = rank in choice.holders
    if rank in choice.needy:  # torn until every tensor has arrived
        tree.holds, tree.torn = False, tree.holds
    lands = transfer.targets(
        shared["tree"], shared["devices"], tree.own_tensors(), holding, device()
    )
    ranks = range(dist.get_world_size())
    leaves = [transfer.Leaf.whole(t.nbytes, t.on_device, choice.holders, ranks) for t in lands]
    tensors = [t.tensor for t in lands]
    regions = [transfer.Region(t) for t in tensors]
    fresh = [not t.own and not t.on_device for t in lands]
    moved = move(leaves, regions, regions, fresh, rt)
    if rank != choice.primary:
        in_place = all(t.own for t in lands if t.key.startswith("['model']"))
        tree.load(transfer.fill(shared["tree"], tensors), model_in_place=in_place)
    return moved


def hand_over(tree: StateTree, new_rank: int | None, rt: Runtime) -> transfer.Moved | None:
    """Sharded, at a pause, before the old group goes: the rows of the ranks that leave
    (``new_rank`` None) go to the ranks that stay, laid out over them in the order of
    their new ranks. Every rank of the old group calls it; None: nothing moved (nobody
    leaves, or everyone does)."""
    assert tree.layout is not None
    rank, world = dist.get_rank(), dist.get_world_size()
    fate = torch.tensor([-1 if new_rank is None else new_rank], dtype=torch.int64)
    fates = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(fates, fate, group=rt.side)
    stayers = sorted((r for r in range(world) if int(fates[r]) >= 0), key=lambda r: int(fates[r]))
    if len(stayers) in (0, world):  # nobody leaves, or everyone does
        return None
    after = {r: Layout(len(stayers), i) for i, r in enumerate(stayers)}
    leaves: list[transfer.Leaf] = []
    held: list[transfer.Region | None] = []
    wanted: list[transfer.Region | None] = []
    kept: dict[str, transfer.Region] = {}
    for name, t in tree.own_tensors().items():
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
        held.append(transfer.Region(sharded.local(t), byte_span(shape, itemsize, tree.layout)[0]))
        if rank in after:
            start, end = rows(shape[0], after[rank])
            mine = torch.empty((end - start, *shape[1:]), dtype=t.dtype, device=t.device)
            kept[name] = transfer.Region(mine, byte_span(shape, itemsize, after[rank])[0])
        wanted.append(kept.get(name))
    fresh = [w is not None and w.tensor.device.type == "cpu" for w in wanted]
    moved = move(leaves, held, wanted, fresh, rt)
    if rank in after:
        tree.rows, tree.layout = kept, after[rank]
        sharded.release(tree.model, tree.optimizer)  # the rows are in tree.rows now
    return moved


def reshard(
    tree: StateTree, choice: Choice, layouts: list[Layout | None], rt: Runtime
) -> transfer.Moved | None:
    """Sharded: build the model anew on this world's mesh (unless it is built on it
    already: a newcomer, or a cold start) and give every rank its new rows, from the
    holders of ``choice.step`` (their rows in ``layouts``) and from its own old rows.
    None: a cold start, nothing moved."""
    assert tree.sharding is not None
    rank, world = dist.get_rank(), dist.get_world_size()
    current = sharded.on_current_group(tree.model)
    new_layout = Layout(world, rank)
    if choice.step is None:  # a cold start: every rank's rows are the job's
        if not current:
            raise StateLostError("No rank holds any rows of the job's sharded state.")
        tree.layout = new_layout
        return None
    shared = header(tree, choice.primary, rt)
    holding = rank in choice.holders
    model = tree.on_this_world()
    mesh = sharded.mesh_of(model)
    own = tree.own_tensors() if holding or current else {}
    model_tensors = {key("model", n): t for n, t in model.state_dict().items()}
    split: set[str] = set(shared["sharded"])
    leaves: list[transfer.Leaf] = []
    held: list[transfer.Region | None] = []
    wanted: list[transfer.Region | None] = []
    landed: list[torch.Tensor] = []
    fresh: list[bool] = []
    for name, meta in transfer.tensor_leaves(shared["tree"]):
        on_device = shared["devices"].get(name, "cpu") != "cpu"
        mine = own.get(name) if holding else None
        if name in split:
            span = functools.partial(byte_span, meta.shape, meta.element_size())
            dest = model_tensors.get(name)
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
            if mine is None or tree.layout is None:
                held.append(None)
            elif tree.rows is not None:  # handed over at the pause
                held.append(tree.rows[name])
            else:
                held.append(transfer.Region(sharded.local(mine), span(tree.layout)[0]))
            wanted.append(transfer.Region(sharded.local(dest), span(new_layout)[0]))
            landed.append(dest)
            fresh.append(False)
            continue
        into = model_tensors.get(name, own.get(name))
        land = transfer.target(
            name, meta, shared["devices"].get(name, "cpu"), into, False, device()
        )
        leaves.append(transfer.Leaf.whole(meta.nbytes, on_device, choice.holders, range(world)))
        held.append(transfer.Region(mine) if mine is not None else None)
        wanted.append(transfer.Region(land.tensor))
        landed.append(land.tensor)
        fresh.append(not land.own and not on_device)
    # A failure in here leaves the old rows and tensors as they were (new ones land apart).
    moved = move(leaves, held, wanted, fresh, rt)
    tree.adopt(model, transfer.fill(shared["tree"], landed))
    return moved


def resume_from_cache(
    tree: StateTree,
    tiers: Sequence[Persister],
    rt: Runtime,
    above: tuple[int, int] | None = None,
) -> tuple[resume.Resumed, str] | None:
    """Every rank: load the newest snapshot of ``tiers`` (newer than ``above``, a
    (generation, step), if given), and the URL of the tier it came from; none: None. The
    tier with the newest complete snapshot is tried first; one that cannot be read whole
    gives way to the next. A sharded model is built on this world's mesh first and its rows
    read into it (its old rows, of a world that is gone and a step not whole, are freed
    before)."""
    if not tiers:
        return None
    own = tree.own_tensors()
    order = newest_first(tiers, rt)
    load = functools.partial(
        _resume_from,
        order,
        links=links(rt),
        timeout=rt.timeout,
        bucket=bucket(),
        above=above,
    )
    if tree.sharding is None:
        found = load(own=own, own_device=device())
        if found is not None:
            tree.load(found[0].tree, found[0].model_in_place)
        return found
    model = tree.on_this_world()
    if model is not tree.model:
        tree.holds, tree.torn = False, tree.holds or tree.torn
        sharded.release(tree.model, tree.optimizer)
    mesh = sharded.mesh_of(model)
    into = {key("model", n): t for n, t in model.state_dict().items()}

    def rows_into(name: str, meta: torch.Tensor) -> torch.Tensor:
        found = into.get(name)
        return found if found is not None else sharded.empty(meta.shape, meta.dtype, mesh)

    found = load(own={**own, **into}, own_device=device(), rows_into=rows_into)
    if found is not None:
        tree.adopt(model, found[0].tree)
    return found


def newest_first(tiers: Sequence[Persister], rt: Runtime) -> list[Persister]:
    """``tiers`` by their newest complete snapshot, newest first (rank 0 lists them and
    shares the order; a tie keeps the given order)."""
    if len(tiers) < 2:
        return list(tiers)
    order = None
    if dist.get_rank() == 0:
        newest = []
        for tier in tiers:
            found = tier.storage.manifests()
            newest.append(found[0].position if found else (-1, -1))
        order = sorted(range(len(tiers)), key=lambda i: newest[i], reverse=True)
    shared: list[int] = transfer.share(order, 0, rt.side)
    return [tiers[i] for i in shared]


def _resume_from(tiers: Sequence[Persister], **kwargs: Any) -> tuple[resume.Resumed, str] | None:
    """The first of ``tiers`` that resumes (efdl.worker.resume), with its URL. A tier whose
    snapshots cannot be read whole gives way to the next; if none resumes, its error."""
    failed: SnapshotError | None = None
    for tier in tiers:
        try:
            resumed = resume.resume(tier.storage, **kwargs)
        except SnapshotError as exc:
            log.warning("%s", exc)
            failed = failed or exc
            continue
        if resumed is not None:
            return resumed, tier.settings.url
    if failed is not None:
        raise failed
    return None


def links(rt: Runtime) -> dict[bool, transfer.Link]:
    """The links tensors travel on, by whether they live on the device: the CPU side group,
    and on NCCL the training group for device tensors."""
    side, cpu = rt.side, torch.device("cpu")
    on_device = transfer.Link(None, device()) if rt.backend == "nccl" else None
    return {False: transfer.Link(side, cpu), True: on_device or transfer.Link(side, cpu)}


def header(tree: StateTree, primary: int, rt: Runtime) -> dict[str, Any]:
    """The state's structure and values (no tensor data) from ``primary``, on every rank."""
    mine = transfer.header(tree.tree()) if dist.get_rank() == primary else None
    shared: dict[str, Any] = transfer.share(mine, primary, rt.side)
    return shared


def move(
    leaves: Sequence[transfer.Leaf],
    held: Sequence[transfer.Region | None],
    wanted: Sequence[transfer.Region | None],
    fresh: Sequence[bool],
    rt: Runtime,
) -> transfer.Moved:
    """Move ``leaves`` over this group's links, in buckets, within its timeout."""
    return transfer.move(leaves, held, wanted, links(rt), rt.timeout, bucket(), fresh)


def bucket() -> int:
    """The most bytes one message carries (``EFDL_SYNC_BUCKET_MB``)."""
    mb = float(os.environ.get(SYNC_BUCKET_ENV, transfer.DEFAULT_BUCKET / (1 << 20)))
    return max(1, int(mb * (1 << 20)))

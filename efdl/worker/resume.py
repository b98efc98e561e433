"""Resuming from the remote cache when no rank holds committed state (the whole job was
preempted, or every node died).

Rank 0 picks the newest snapshot whose manifest and structure (``state.pt``) read, and shares
the structure. The ranks then read its parts between them (part ``i`` by rank
``i mod world``), each checking every part it reads against the manifest and loading it into
its own tensors; one all-reduce says whether every part read. If one did not, all go to the
snapshot before. Then each rank sends what it read to every other rank
(efdl.worker.transfer: one holder per part), so the storage is read once, in parallel, and
every rank's link carries about the state's size. Each rank also restores its own RNG states,
if the snapshot has a file for its rank.

A sharded model's tensors (FSDP2) are not shared that way: each rank reads, straight into
its own new rows, the rows it holds on this world from the parts of the snapshot's ranks
whose rows overlap them (efdl.worker.layout), so a snapshot of any world size is laid out
anew on this one, and no rank holds more than its rows and a part.

Memory: a part (at most a few hundred MB, a larger tensor alone) twice while it loads, on the
rank that reads it.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from efdl.worker import sharded, transfer
from efdl.worker.cache import Manifest, Position, SnapshotError, SnapshotStorage, rank_file
from efdl.worker.layout import Layout, overlap, rows
from efdl.worker.rng import set_rng_state

log = logging.getLogger(__name__)


# A sharded tensor's key path and whole shape (a meta tensor) -> where this rank's rows of it
# land: a DTensor on this world's mesh.
RowsInto = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Resumed:
    manifest: Manifest
    tree: dict[str, Any]  # the snapshot's state, this rank's tensors in it
    model_in_place: bool  # every model tensor in ``tree`` is the model's own
    moved: transfer.Moved


def resume(
    storage: SnapshotStorage,
    own: Mapping[str, torch.Tensor],
    links: dict[bool, transfer.Link],
    timeout: datetime.timedelta,
    bucket: int,
    own_device: torch.device,
    rows_into: RowsInto | None = None,
    above: Position | None = None,
) -> Resumed | None:
    """Every rank at once: load the newest intact snapshot into ``own`` (this rank's tensors
    by key path; others are made). None if there is no snapshot to resume from.

    Args:
        rows_into: for a sharded model, where this rank's rows of each sharded tensor land
            (None: the model is replicated, and so must the snapshot's be).
        above: only a snapshot newer than this (generation, step) will do (what the ranks
            hold is behind the job's step: only something newer is worth reading).

    Raises:
        SnapshotError: snapshots were found but none could be read whole, after some were
            partly loaded: the model is no longer its initial self, and training it from step
            0 would silently throw the cache away.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    side = links[False].group
    below: Position | None = None
    broken: list[int] = []
    while True:
        found = None
        if rank == 0 and (structure := storage.newest_structure(below, above)) is not None:
            found = {
                "step": structure.manifest.step,
                "generation": structure.manifest.generation,
                "tree": structure.tree,
                "parts": structure.parts,
                "rows": structure.rows,
                "devices": structure.devices,
                "holders": storage.holders(structure.manifest.step),
            }
        found = transfer.share(found, 0, side)
        if found is not None:
            storage.know(found["holders"])
        if found is None:
            if broken:
                raise SnapshotError(
                    f"No snapshot in {storage.url} could be read whole (steps "
                    f"{', '.join(map(str, broken))} failed, see the warnings): the job stops "
                    "rather than train from scratch. Repair or move the cache, then start it "
                    "again (an empty cache starts from scratch)."
                )
            return None
        step = int(found["step"])
        split: dict[str, list[str]] = found["rows"]
        if bool(split) != (rows_into is not None):
            raise SnapshotError(
                f"The snapshot of step {step} in {storage.url} is of a "
                f"{'sharded' if split else 'replicated'} model, this job's is "
                f"{'sharded' if rows_into is not None else 'replicated'}: resume it with the "
                "script that wrote it, or point --cache-url elsewhere."
            )
        lands = [
            transfer.target(
                key, meta, found["devices"].get(key, "cpu"), own.get(key), False, own_device
            )
            for key, meta in transfer.tensor_leaves(found["tree"])
            if key not in split
        ]
        index = {t.key: t for t in lands}
        dests = {
            key: rows_into(key, meta)
            for key, meta in transfer.tensor_leaves(found["tree"])
            if key in split and rows_into is not None
        }
        parts: dict[str, str] = found["parts"]
        names = sorted(set(parts.values()))
        manifest: Manifest | None = None
        try:
            manifest = storage.manifest(step)
            for name in names[rank::world]:
                for key, tensor in storage.read(manifest, name).items():
                    target = index.get(key)
                    if target is None or not isinstance(tensor, torch.Tensor):
                        raise SnapshotError(f"{storage.path(step, name)}: unexpected {key!r}.")
                    _check(
                        storage.path(step, name),
                        key,
                        tensor,
                        tuple(target.tensor.shape),
                        target.tensor.dtype,
                    )
                    target.tensor.copy_(tensor)
            _read_rows(storage, manifest, split, dests, Layout(world, rank))
            ok = 1
        except SnapshotError as exc:
            log.warning("Skipping cached snapshot of step %d: %s", step, exc)
            ok = 0
        verdict = torch.tensor([ok], dtype=torch.int64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=side)
        if not int(verdict.item()) or manifest is None:
            broken.append(step)
            below = (int(found["generation"]), step)
            continue
        reader = {name: i % world for i, name in enumerate(names)}
        ranks = range(world)
        leaves = [
            transfer.Leaf.whole(t.nbytes, t.on_device, (reader[parts[t.key]],), ranks)
            for t in lands
        ]
        tensors = [t.tensor for t in lands]
        regions = [transfer.Region(t) for t in tensors]
        fresh = [not t.own and not t.on_device for t in lands]  # the parts read here are not
        moved = transfer.move(  # received here, so they are never zero-filled
            leaves, regions, regions, links, timeout, bucket, fresh
        )
        _restore_rng(storage, manifest, rank)
        in_place = all(t.own for t in lands if t.key.startswith("['model']"))
        placed = {**{t.key: t.tensor for t in lands}, **dests}
        ordered = [placed[key] for key, _ in transfer.tensor_leaves(found["tree"])]
        return Resumed(manifest, transfer.fill(found["tree"], ordered), in_place, moved)


def _check(
    where: str, key: str, got: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """``got`` (``key`` as read from file ``where``) is of the ``shape`` and ``dtype`` the
    snapshot's structure says; else a SnapshotError that says both."""
    if tuple(got.shape) != shape or got.dtype != dtype:
        raise SnapshotError(
            f"{where}: {key} is {tuple(got.shape)} {got.dtype}, its structure says {shape} {dtype}."
        )


def _read_rows(
    storage: SnapshotStorage,
    m: Manifest,
    split: Mapping[str, list[str]],
    dests: Mapping[str, torch.Tensor],
    mine: Layout,
) -> None:
    """This rank's rows (``mine``) of every sharded tensor into ``dests``, from the parts of
    the snapshot's ranks whose rows overlap them, a part at a time."""
    # part -> (key, the rows the part holds, the rows of them this rank holds)
    wanted: dict[str, list[tuple[str, tuple[int, int], tuple[int, int]]]] = {}
    for key, names in split.items():
        length = dests[key].shape[0]
        for r, name in enumerate(names):
            theirs = Layout(m.world_size, r)
            start, end = overlap(length, theirs, mine)
            if start < end:
                wanted.setdefault(name, []).append((key, rows(length, theirs), (start, end)))
    for name in sorted(wanted):
        part = storage.read(m, name)
        for key, held, (start, end) in wanted[name]:
            dest = dests[key]
            got = part.get(key) if isinstance(part, dict) else None
            if not isinstance(got, torch.Tensor):
                raise SnapshotError(f"{storage.path(m.step, name)} holds no rows of {key}.")
            shape = (held[1] - held[0], *dest.shape[1:])
            _check(storage.path(m.step, name), key, got, shape, dest.dtype)
            first = rows(dest.shape[0], mine)[0]
            sharded.local(dest)[start - first : end - first].copy_(
                got[start - held[0] : end - held[0]]
            )
        del part, got  # before the next part is read


def _restore_rng(storage: SnapshotStorage, m: Manifest, rank: int) -> None:
    """This rank's own part of the snapshot (its RNG states), if it has one."""
    name = rank_file(rank)
    if name not in m.files:
        return
    try:
        set_rng_state(storage.read(m, name)["rng"])
    except Exception as exc:  # only the random streams: the job's state is whole
        log.warning(
            "Not restoring this rank's RNG state from %s: %s", storage.path(m.step, name), exc
        )

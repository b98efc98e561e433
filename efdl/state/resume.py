"""Resuming from the remote cache when no rank holds committed state (the whole job was
preempted, or every node died).

Rank 0 picks the newest snapshot whose manifest and structure (``state.pt``) read, and shares
the structure. The ranks then read its parts between them (part ``i`` by rank
``i mod world``), each checking every part it reads against the manifest and loading it into
its own tensors; one all-reduce says whether every part read. If one did not, all go to the
snapshot before. Then each rank sends what it read to every other rank
(efdl.state.transfer: one holder per part), so the storage is read once, in parallel, and
every rank's link carries about the state's size. Each rank also restores its own RNG states,
if the snapshot has a file for its rank.

Memory: a part (at most a few hundred MB, a larger tensor alone) twice while it loads, on the
rank that reads it.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from efdl.state import transfer
from efdl.state.cache import Manifest, SnapshotError, SnapshotStore, rank_file
from efdl.state.rng import set_rng_state

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Resumed:
    manifest: Manifest
    tree: dict[str, Any]  # the snapshot's state, this rank's tensors in it
    model_in_place: bool  # every model tensor in ``tree`` is the model's own
    moved: transfer.Moved


def resume(
    store: SnapshotStore,
    own: Mapping[str, torch.Tensor],
    links: dict[bool, transfer.Link],
    timeout: datetime.timedelta,
    bucket: int,
    own_device: torch.device,
) -> Resumed | None:
    """Every rank at once: load the newest intact snapshot into ``own`` (this rank's tensors
    by key path; others are made). None if there is no snapshot to resume from.

    Raises:
        SnapshotError: snapshots were found but none could be read whole, after some were
            partly loaded: the model is no longer its initial self, and training it from step
            0 would silently throw the cache away.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    side = links[False].group
    below: int | None = None
    broken: list[int] = []
    while True:
        found = None
        if rank == 0 and (layout := store.newest_layout(below)) is not None:
            found = {
                "step": layout.manifest.step,
                "tree": layout.tree,
                "parts": layout.parts,
                "devices": layout.devices,
            }
        found = transfer.share(found, 0, side)
        if found is None:
            if broken:
                raise SnapshotError(
                    f"No snapshot in {store.url} could be read whole (steps "
                    f"{', '.join(map(str, broken))} failed, see the warnings): the job stops "
                    "rather than train from scratch. Repair or move the cache, then start it "
                    "again (an empty cache starts from scratch)."
                )
            return None
        step = int(found["step"])
        lands = transfer.targets(found["tree"], found["devices"], own, False, own_device)
        index = {t.key: t for t in lands}
        parts: dict[str, str] = found["parts"]
        names = sorted(set(parts.values()))
        manifest: Manifest | None = None
        try:
            manifest = store.manifest(step)
            for name in names[rank::world]:
                for key, tensor in store.read(manifest, name).items():
                    target = index.get(key)
                    if target is None or not isinstance(tensor, torch.Tensor):
                        raise SnapshotError(f"{store.path(step, name)}: unexpected {key!r}.")
                    if tensor.shape != target.tensor.shape or tensor.dtype != target.tensor.dtype:
                        raise SnapshotError(
                            f"{store.path(step, name)}: {key} is {tuple(tensor.shape)} "
                            f"{tensor.dtype}, its structure says {tuple(target.tensor.shape)} "
                            f"{target.tensor.dtype}."
                        )
                    target.tensor.copy_(tensor)
            ok = 1
        except SnapshotError as exc:
            log.warning("Skipping cached snapshot of step %d: %s", step, exc)
            ok = 0
        verdict = torch.tensor([ok], dtype=torch.int64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=side)
        if not int(verdict.item()) or manifest is None:
            broken.append(step)
            below = step
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
        _restore_rng(store, manifest, rank)
        in_place = all(t.own for t in lands if t.key.startswith("['model']"))
        return Resumed(manifest, transfer.fill(found["tree"], tensors), in_place, moved)


def _restore_rng(store: SnapshotStore, m: Manifest, rank: int) -> None:
    """This rank's own part of the snapshot (its RNG states), if it has one."""
    name = rank_file(rank)
    if name not in m.files:
        return
    try:
        set_rng_state(store.read(m, name)["rng"])
    except Exception as exc:  # only the random streams: the job's state is whole
        log.warning(
            "Not restoring this rank's RNG state from %s: %s", store.path(m.step, name), exc
        )

"""Samplers whose epoch survives a change of world size.

One seeded permutation per epoch and a global cursor (samples consumed by committed steps).
After a rescale, the rest of the epoch, ``perm[cursor:]``, is split over the new world, so
within an epoch every sample is trained once whatever the world did, except the steps after
the last commit of a rank that crashed (they are trained again).

Two ways to split a step: :class:`ElasticSampler` keeps the per-rank batch (the global batch
grows and shrinks with the world, as with torch's DistributedSampler);
:class:`ElasticBatchSampler` keeps the global batch (each rank's share grows and shrinks), so
a step means the same whatever the world size and the learning rate needs no rescaling.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Protocol

import torch
from torch.utils.data import Sampler


class Position(Protocol):
    """What the elastic state drives in a sampler or stream (efdl.data.ElasticStream): told
    the world after each sync and the epoch when ``state.epoch`` is set, advanced at each
    commit, and its position (``state_dict``) moved with the state."""

    def set_world(self, rank: int, world: int) -> None: ...

    def set_epoch(self, epoch: int) -> None: ...

    def advance(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _EpochCursor:
    """The state both samplers share: epoch, cursor, rank and world, and the global batches
    from the cursor to the end of the epoch."""

    def __init__(self, data: Sized | int, batch: int, shuffle: bool, seed: int, what: str):
        self.n = data if isinstance(data, int) else len(data)
        if self.n < 1 or batch < 1:
            raise ValueError(f"{what} needs data and a batch size (got {self.n}, {batch}).")
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self.rank, self.world = 0, 1

    def step_size(self) -> int:
        """Samples one step consumes across all ranks."""
        raise NotImplementedError

    def set_world(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (from its beginning, if it is a new one)."""
        if epoch != self.epoch:
            self.epoch, self.cursor = epoch, 0

    def permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def _global_batches(self) -> Iterator[list[int]]:
        perm = self.permutation()
        step = self.step_size()
        for start in range(self.cursor, self.n, step):
            batch = perm[start : start + step]
            if len(batch) < self.world:  # every rank needs at least one sample
                batch = batch + perm[: self.world - len(batch)]
            yield batch

    def _shares(self) -> Iterator[list[int]]:
        """This rank's share of each global batch left in the epoch."""
        for batch in self._global_batches():
            yield batch[self.rank :: self.world]

    def advance(self) -> None:
        """One step was committed: move the cursor past its global batch."""
        self.cursor = min(self.n, self.cursor + self.step_size())

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor, self.seed = (
            int(state["epoch"]),
            int(state["cursor"]),
            int(state["seed"]),
        )


class ElasticSampler(_EpochCursor, Sampler[int]):
    """Per-rank indices for one epoch; give the DataLoader the same ``batch_size``.

    Step ``s`` of the epoch consumes the global batch ``perm[cursor : cursor + world*batch]``;
    rank ``r`` trains on its ``r::world`` share. Every rank gets the same number of batches
    (DDP needs that): only when the epoch's last global batch has fewer samples than ranks are
    a few samples (at most ``world - 1``) repeated to fill it.

    Args:
        data: the dataset (or its length).
        batch_size: per-rank batch size; must equal the DataLoader's.
        shuffle: a new permutation each epoch (seeded by ``seed + epoch``).
        seed: the same on every rank.
    """

    def __init__(self, data: Sized | int, batch_size: int, shuffle: bool = True, seed: int = 0):
        super().__init__(data, batch_size, shuffle, seed, "ElasticSampler")
        self.batch_size = batch_size

    def step_size(self) -> int:
        return self.world * self.batch_size

    def __iter__(self) -> Iterator[int]:
        for share in self._shares():
            yield from share

    def __len__(self) -> int:
        return sum(len(share) for share in self._shares())


class ElasticBatchSampler(_EpochCursor, Sampler[list[int]]):
    """This rank's batches of a fixed global batch: ``DataLoader(data, batch_sampler=it)``.

    Every step trains on ``global_batch_size`` samples whatever the world size: rank ``r``
    gets the ``r::world`` share of ``perm[cursor : cursor + global_batch_size]``. Shares are
    equal when the world size divides the global batch; otherwise they differ by one sample
    (DDP's gradient average then weights those samples slightly differently). Pick a global
    batch that every world size you expect divides (48 for 1-4 and 6, 96 for up to 8 but 5).

    Args:
        data: the dataset (or its length).
        global_batch_size: samples per step over all ranks.
        shuffle: a new permutation each epoch (seeded by ``seed + epoch``).
        seed: the same on every rank.
    """

    def __init__(
        self, data: Sized | int, global_batch_size: int, shuffle: bool = True, seed: int = 0
    ):
        super().__init__(data, global_batch_size, shuffle, seed, "ElasticBatchSampler")
        self.global_batch_size = global_batch_size

    def step_size(self) -> int:
        return self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        return self._shares()

    def __len__(self) -> int:
        return sum(1 for _ in self._global_batches())

"""A sampler whose epoch survives a change of world size.

One seeded permutation per epoch and a global cursor (samples consumed by committed steps).
After a rescale, the rest of the epoch, ``perm[cursor:]``, is split over the new world, so
within an epoch every sample is trained once whatever the world did, except the steps after
the last commit of a rank that crashed (they are trained again).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


class ElasticSampler(Sampler[int]):
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
        self.n = data if isinstance(data, int) else len(data)
        if self.n < 1 or batch_size < 1:
            raise ValueError(
                f"ElasticSampler needs data and a batch size (got {self.n}, {batch_size})."
            )
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self.rank, self.world = 0, 1

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
        step = self.world * self.batch_size
        for start in range(self.cursor, self.n, step):
            batch = perm[start : start + step]
            if len(batch) < self.world:  # every rank needs at least one sample
                batch = batch + perm[: self.world - len(batch)]
            yield batch

    def __iter__(self) -> Iterator[int]:
        for batch in self._global_batches():
            yield from batch[self.rank :: self.world]

    def __len__(self) -> int:
        return sum(len(b[self.rank :: self.world]) for b in self._global_batches())

    def advance(self) -> None:
        """One step was committed: move the cursor past its global batch."""
        self.cursor = min(self.n, self.cursor + self.world * self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor, self.seed = (
            int(state["epoch"]),
            int(state["cursor"]),
            int(state["seed"]),
        )

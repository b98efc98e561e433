"""ElasticSampler: every sample once per epoch across rescales, equal batches per rank;
ElasticBatchSampler: the same global batch per step whatever the world size."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from efdl.worker.sampler import ElasticBatchSampler, ElasticSampler


def run_epoch(n: int, bs: int, worlds: list[int], steps_per_world: int) -> Counter[int]:
    """Train an epoch, changing the world size after ``steps_per_world`` steps each time."""
    seen: Counter[int] = Counter()
    s = ElasticSampler(n, bs, seed=7)
    for i, world in enumerate(worlds):
        shares = []
        for rank in range(world):
            s.set_world(rank, world)
            shares.append(list(s))
        batches = [[share[j : j + bs] for j in range(0, len(share), bs)] for share in shares]
        assert len({len(b) for b in batches}) == 1, "ranks got different numbers of batches"
        last = i == len(worlds) - 1
        for step in range(len(batches[0]) if last else min(steps_per_world, len(batches[0]))):
            for rank in range(world):
                seen.update(batches[rank][step])
            s.advance()
    return seen


@pytest.mark.parametrize(
    ("n", "bs", "worlds"),
    [(240, 4, [2, 3, 2]), (101, 3, [4, 1, 3]), (64, 8, [1]), (50, 4, [3, 2, 5])],
)
def test_each_sample_once_per_epoch_across_rescales(n: int, bs: int, worlds: list[int]) -> None:
    seen = run_epoch(n, bs, worlds, steps_per_world=3)
    assert set(seen) == set(range(n))
    # Only the last global batch may repeat a few samples, when it has fewer than world.
    assert sum(seen.values()) - n <= max(worlds) - 1


def test_permutation_is_seeded_per_epoch_and_state_roundtrips() -> None:
    a, b = ElasticSampler(100, 4, seed=3), ElasticSampler(100, 4, seed=3)
    assert a.permutation() == b.permutation()
    a.set_epoch(1)
    assert a.permutation() != b.permutation()
    a.advance()
    b.load_state_dict(a.state_dict())
    assert (b.epoch, b.cursor) == (1, 4) and list(b) == list(a)
    b.set_epoch(1)
    assert b.cursor == 4  # the same epoch keeps its place
    b.set_epoch(2)
    assert b.cursor == 0


def test_rejects_empty_data() -> None:
    with pytest.raises(ValueError, match="needs data"):
        ElasticSampler(0, 4)


@pytest.mark.parametrize(("n", "gbs", "worlds"), [(480, 48, [4, 3, 2, 4]), (101, 12, [2, 5, 1])])
def test_batch_sampler_keeps_the_global_batch_across_rescales(
    n: int, gbs: int, worlds: list[int]
) -> None:
    """Whatever the world, step k of the epoch trains perm[k*gbs:(k+1)*gbs], split over ranks."""
    s = ElasticBatchSampler(n, gbs, seed=5)
    perm = s.permutation()
    trained: list[list[int]] = []
    for i, world in enumerate(worlds):
        shares = []
        for rank in range(world):
            s.set_world(rank, world)
            shares.append(list(s))
        assert len({len(b) for b in shares}) == 1, "ranks got different numbers of batches"
        assert len(shares[0]) == len(s)
        for step in range(len(shares[0]) if i == len(worlds) - 1 else 2):
            sizes = [len(shares[r][step]) for r in range(world)]
            assert max(sizes) - min(sizes) <= 1
            trained.append(sorted(x for r in range(world) for x in shares[r][step]))
            s.advance()
    expected = [sorted(perm[k : k + gbs]) for k in range(0, n, gbs)]
    assert trained == expected


def test_batch_sampler_feeds_a_dataloader() -> None:
    data = TensorDataset(torch.arange(10))
    s = ElasticBatchSampler(data, 4, shuffle=False)
    s.set_world(1, 2)
    got = [x.tolist() for (x,) in DataLoader(data, batch_sampler=s)]
    assert got == [[1, 3], [5, 7], [9]]
    with pytest.raises(ValueError, match="ElasticBatchSampler needs data"):
        ElasticBatchSampler(data, 0)

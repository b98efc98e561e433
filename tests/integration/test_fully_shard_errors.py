"""efdl.fully_shard refuses what it cannot lay out again, with an error that names it
(a real one-rank gloo group; FSDP2's own fully_shard)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import efdl


@pytest.fixture()
def group(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_all(model: nn.Module, mesh: object) -> None:
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)


def test_a_model_is_sharded_and_its_skeleton_kept_on_the_meta_device(group: None) -> None:
    model = efdl.fully_shard(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), shard_all)
    out = model(torch.randn(3, 4))
    assert out.shape == (3, 2)
    skeleton = model._efdl_sharding.skeleton
    assert all(p.device.type == "meta" for p in skeleton.parameters())


def test_an_already_sharded_model_is_refused(group: None) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    shard_all(model, None)
    with pytest.raises(ValueError, match="before it is sharded"):
        efdl.fully_shard(model, shard_all)


def test_a_shard_function_that_leaves_a_parameter_whole_is_named(group: None) -> None:
    def blocks_only(model: nn.Module, mesh: object) -> None:
        fully_shard(model[0], mesh=mesh)  # the root's own parameters stay plain tensors

    with pytest.raises(ValueError, match=r"Parameter 1\.weight is not sharded"):
        efdl.fully_shard(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), blocks_only)

"""An efdl-aware FSDP2 script for the e2e tests: a sharded model resharded in place.

One JSON line per step to $OUT_DIR/events.jsonl (after optimizer.step(), before commit()), as
elastic_steps.py writes: node, pid, rank, world, generation, step, epoch, and exact digests of
the whole model before and after the update ("before", "digest") and of the optimizer state
("opt_before", "opt"). A digest is position-weighted sums of the tensors' bits, each rank
summing its own rows, all-reduced in int64: exact whatever the layout, so equal digests
across world sizes mean the same bits. Knobs: STEP_SECONDS, EPOCHS, SAMPLES, BATCH,
MODEL_WIDTH (default 64). It trains on efdl.device(), as efdl shards it: the GPU where there
is one (the GPU suite: the ranks share it over gloo).
"""

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import efdl
from efdl.worker.layout import Layout, rows

out = Path(os.environ["OUT_DIR"])
epochs = int(os.environ.get("EPOCHS", "1000"))
delay = float(os.environ.get("STEP_SECONDS", "0.1"))
width = int(os.environ.get("MODEL_WIDTH", "64"))
efdl.init_process_group("gloo", timeout_s=float(os.environ.get("COLLECTIVE_TIMEOUT", "15")))
dev = efdl.device()
torch.manual_seed(int(os.environ.get("RANK", "0")))  # each rank's own init: rows differ


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def shard(model: nn.Module, mesh: object) -> None:
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


model = efdl.fully_shard(nn.Sequential(Block(), Block(), nn.Linear(width, 1)), shard)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
n = int(os.environ.get("SAMPLES", "96"))
batch = int(os.environ.get("BATCH", "2"))
data = TensorDataset(
    torch.randn(n, width, generator=torch.Generator().manual_seed(5)), torch.arange(n)
)
sampler = efdl.ElasticSampler(data, batch_size=batch, seed=1)
loader = DataLoader(data, batch_size=batch, sampler=sampler)
state = efdl.elastic_state(model, optimizer, sampler, epoch=0)


def digest(tensors: list[torch.Tensor]) -> int:
    """Exact: sum over every element of (its bits as int32) x (its global position + 1)."""
    total = torch.zeros(1, dtype=torch.int64)
    world, rank = dist.get_world_size(), dist.get_rank()
    for i, t in enumerate(tensors):
        if isinstance(t, DTensor):
            start, _ = rows(t.shape[0], Layout(world, rank))
            local = t._local_tensor.detach().cpu()
            first = start * math.prod(t.shape[1:])
        else:  # replicated: rank 0 counts it
            local, first = t.detach().cpu(), 0
            if rank:
                continue
        bits = local.reshape(-1).view(torch.int32).long()
        where = torch.arange(first, first + bits.numel(), dtype=torch.int64) + 1 + i * 10_000_019
        total += (bits * where).sum()
    dist.all_reduce(total)
    return int(total.item())


def opt_tensors() -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for k, v in sorted(s.items()) if k != "step"]


@efdl.elastic(state)
def train(state: efdl.ElasticState) -> None:
    model = state.model  # laid out anew on each world
    for state.epoch in range(state.epoch, epochs):
        for x, idx in loader:
            rank, world = dist.get_rank(), dist.get_world_size()
            loss = model(x.to(dev)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            before = digest(list(model.parameters()))
            opt_before = digest(opt_tensors())
            optimizer.step()
            row = {
                "node": os.environ["EFDL_NODE_ID"],
                "pid": os.getpid(),
                "rank": rank,
                "world": world,
                "gen": state.generation,
                "step": state.step + 1,
                "epoch": state.epoch,
                "before": before,
                "digest": digest(list(model.parameters())),
                "opt_before": opt_before,
                "opt": digest(opt_tensors()),
                "samples": idx.tolist(),
                "t": time.time(),
                "rescales": state.rescales,
                "device": str(next(model.parameters()).device),
            }
            with open(out / "events.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if delay:
                time.sleep(delay)
            state.commit()


train(state)
if dist.is_initialized():
    dist.destroy_process_group()

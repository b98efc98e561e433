"""One rank of the resharding tests: real gloo groups (FileStore), FSDP2, ElasticState.sync().

Args: old world, old rank (-1: a newcomer), new world, new rank (-1: it leaves), a
directory, an output JSON path. With RESHARD_CRASH set, the ranks that leave die instead
(nobody hands rows over). The old world's ranks shard a small transformer-shaped model with
efdl.fully_shard, train 3 AdamW steps and write the full state (every tensor gathered) to
the directory after the last (after each where a cache may resume an earlier one), and hand
the rows of the ranks that leave to those that stay, as at a pause; with EFDL_CACHE_URL set
they persist every step, and wait for the last snapshot; then every rank of the new world
joins its group, survivors with the model they trained, newcomers with their own, and syncs.
The new world's ranks write whether the full state they hold between them is the old one,
bit for bit.
"""

import datetime
import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import efdl
from efdl.worker.runtime import get_runtime
from efdl.worker.sampler import ElasticSampler
from efdl.worker.state import ElasticState

old_world, old_rank, new_world, new_rank = map(int, sys.argv[1:5])
where, out = Path(sys.argv[5]), sys.argv[6]
timeout = datetime.timedelta(seconds=120)  # a peer writing snapshots on a busy disk
WIDTH = 512  # 6.3M parameters: 76 MB of state with AdamW's two moments


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(101, WIDTH)  # 101 rows: uneven chunks at every world size
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 7)
        self.register_buffer("scale", torch.tensor([0.5]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)) * self.scale)


def shard(model: nn.Module, mesh: object) -> None:
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def join(world: int, rank: int, name: str) -> None:
    store = dist.FileStore(str(where / name), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    get_runtime().side = dist.new_group(backend="gloo", timeout=timeout)


def start(seed: int) -> ElasticState:
    torch.manual_seed(seed)
    model = efdl.fully_shard(Net(), shard)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return ElasticState(model, opt, ElasticSampler(1000, batch_size=4, seed=1), epoch=0)


def full(state: ElasticState) -> dict[str, torch.Tensor]:
    """Every tensor of the state, whole (a collective)."""
    assert state.optimizer is not None
    tensors = dict(state.model.state_dict())
    for i, s in state.optimizer.state_dict()["state"].items():
        tensors |= {f"opt.{i}.{k}": v for k, v in s.items()}
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in tensors.items()
    }


state = None
if old_rank >= 0:
    join(old_world, old_rank, "old")
    state = start(0)
    state.sync()
    data = torch.Generator().manual_seed(3)
    for _ in range(3):
        assert state.optimizer is not None
        state.optimizer.zero_grad(set_to_none=True)
        x = torch.randint(0, 101, (4, 5), generator=data)
        state.model(x).pow(2).mean().backward()
        state.optimizer.step()
        state.commit()
        if state.step == 3 or os.environ.get("EFDL_CACHE_URL"):  # where a resume may start
            before = full(state)
            if old_rank == 0:
                torch.save({"tensors": before}, where / f"before-{state.step}.pt")
            del before
    state.model.zero_grad(set_to_none=True)
    assert state.flush(60), "the last snapshot was not written within 60 s"
    if not os.environ.get("RESHARD_CRASH"):  # a pause (else the ranks that leave die)
        state.hand_over(new_rank if new_rank >= 0 else None)
    dist.destroy_process_group()
    if new_rank < 0:  # this rank leaves
        Path(out).write_text(json.dumps({"left": True}))
        sys.exit(0)

join(new_world, new_rank, "new")
if state is None:
    state = start(100 + new_rank)  # a newcomer: its own init


def memory(field: str) -> int:
    """A line of /proc/self/status, in bytes (VmRSS: now; VmHWM: the peak since reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


gc.collect()
Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
rss_before = memory("VmRSS")
result: dict[str, object] = {}
try:
    state.sync()
except Exception as exc:  # the test reads the error
    result["error"] = f"{type(exc).__name__}: {exc}"
    result["traceback"] = traceback.format_exc()
else:
    grew = memory("VmHWM") - rss_before  # before anything whole is gathered below
    after = full(state)
    ref = torch.load(where / f"before-{state.step}.pt", weights_only=True)
    assert state.optimizer is not None
    result |= {
        "step": state.step,
        "same": sorted(k for k, v in ref["tensors"].items() if torch.equal(after.get(k), v)),
        "keys": sorted(ref["tensors"]),
        "received": state.last_sync.received if state.last_sync else 0,
        "sent": state.last_sync.sent if state.last_sync else 0,
        "grew": grew,
        "state_bytes": sum(v.nbytes for v in ref["tensors"].values()),
        "optimizer_on_model": all(
            a is b
            for a, b in zip(
                state.optimizer.param_groups[0]["params"], state.model.parameters(), strict=True
            )
        ),
    }
    # One more step on the new world: the resharded model trains.
    state.optimizer.zero_grad(set_to_none=True)
    state.model(torch.randint(0, 101, (4, 5))).pow(2).mean().backward()
    state.optimizer.step()
    state.commit()
    result["trained"] = True
Path(out).write_text(json.dumps(result))
dist.destroy_process_group()

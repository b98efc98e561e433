"""A plain torchrun DDP script for benchmarks.state_scale (no efdl import): an MLP of LAYERS
linear layers of WIDTH x WIDTH (with ReLUs) trained with SGD + momentum on synthetic data.
mlp_efdl.py is this script with the efdl change.

One JSON line per step to $OUT_DIR/events.jsonl: time, step, world, rank, pid, node, and this
process's peak resident memory so far. Knobs: WIDTH, LAYERS, BATCH (per worker), STEPS,
SLOW_FILE (see slow()).
"""

import contextlib
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

out = Path(os.environ["OUT_DIR"])
width, layers = int(os.environ["WIDTH"]), int(os.environ["LAYERS"])
batch, steps = int(os.environ.get("BATCH", "16")), int(os.environ.get("STEPS", "1000000"))

slow_file = os.environ.get("SLOW_FILE")


def slow() -> None:
    """While SLOW_FILE exists, sleep the seconds it holds before each forward pass (a node
    that became slow: benchmarks.stragglers)."""
    if slow_file and os.path.exists(slow_file):
        with contextlib.suppress(OSError, ValueError):  # being written: next step
            time.sleep(float(Path(slow_file).read_text() or 0))


torch.manual_seed(0)
model = torch.nn.Sequential(
    *[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
data = TensorDataset(torch.randn(1024, width, generator=torch.Generator().manual_seed(1)))
dist.init_process_group("gloo")
sampler = DistributedSampler(data, seed=0)
loader = DataLoader(data, batch_size=batch, sampler=sampler)
ddp = DistributedDataParallel(model)
step, epoch = 0, 0
while step < steps:
    sampler.set_epoch(epoch)
    for (x,) in loader:
        slow()
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        row = {
            "t": time.time(),
            "step": step,
            "world": dist.get_world_size(),
            "rank": dist.get_rank(),
            "pid": os.getpid(),
            "node": os.environ.get("EFDL_NODE_ID", ""),
            "gen": 0,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        with open(out / "events.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if step >= steps:
            break
    epoch += 1
dist.destroy_process_group()

"""A plain torchrun DDP script for the e2e tests and benchmarks (no efdl import).

Writes one JSON line per step to $OUT_DIR/events.jsonl. Resumes its step counter from
$OUT_DIR/state.json (as a torchrun script resumes from a checkpoint).
Knobs: STEPS, STEP_SECONDS (sleep per step), MODEL_WIDTH (0: a tiny model, else a 3-layer
MLP of that width), BATCH. Faults: FAIL_AT="rank:step[:restart]" exits 3 on that rank at
that step (only at that TORCHELASTIC_RESTART_COUNT, default 0). CRASH_NODE="node:n": every
worker process on that node (EFDL_NODE_ID) exits 3 after its own n-th step, at every start
(a node that crash-loops: a bad GPU, say).
"""

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(os.environ["OUT_DIR"])
steps = int(os.environ.get("STEPS", "1000000"))
delay = float(os.environ.get("STEP_SECONDS", "0.1"))
fail_at = os.environ.get("FAIL_AT", "")
crash_node, _, crash_after = os.environ.get("CRASH_NODE", "").partition(":")
crashes = crash_node != "" and crash_node == os.environ.get("EFDL_NODE_ID")
width = int(os.environ.get("MODEL_WIDTH", "0"))


def make_model() -> torch.nn.Module:
    if not width:
        return torch.nn.Linear(4, 1)
    layers = [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)]
    return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(width, 1))


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
state = out / "state.json"
start = json.loads(state.read_text())["step"] + 1 if state.exists() else 0
model = torch.nn.parallel.DistributedDataParallel(make_model())
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
batch = int(os.environ.get("BATCH", "2"))
x_in = torch.randn(batch, width or 4)
batches = None
if width:  # the same data pipeline as elastic_steps.py: a DataLoader over a DistributedSampler
    data = torch.utils.data.TensorDataset(torch.randn(batch * world * 64, width))
    sampler = torch.utils.data.DistributedSampler(data, seed=1)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler))
for taken, step in enumerate(range(start, steps)):
    if crashes and taken >= int(crash_after):
        os._exit(3)
    if batches is not None:
        try:
            (x_in,) = next(batches)
        except StopIteration:
            batches = iter(torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler))
            (x_in,) = next(batches)
    if fail_at:
        f_rank, f_step, *f_restart = (int(x) for x in fail_at.split(":"))
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if rank == f_rank and step == f_step and restart == (f_restart[0] if f_restart else 0):
            # A crash: gone at once. (SystemExit tears torch.distributed down first, closing
            # the connections early: a peer could fail, and be reported, before this rank.)
            os._exit(3)
    loss = model(x_in).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    event = {
        "node": os.environ.get("EFDL_NODE_ID", os.environ.get("GROUP_RANK", "")),
        "rank": rank,
        "world": world,
        "step": step,
        "gen": int(os.environ.get("EFDL_GENERATION", "0")),
        "pid": os.getpid(),
        "warm": os.environ.get("EFDL_WARM") == "1",
        "t": time.time(),
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "master": os.environ["MASTER_ADDR"],
    }
    with open(out / "events.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")
    if rank == 0:  # atomically: a worker killed mid-write must not leave an empty file
        tmp = state.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"step": step}))
        os.replace(tmp, state)
    if delay:
        time.sleep(delay)
dist.destroy_process_group()

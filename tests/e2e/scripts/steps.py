"""A plain torchrun DDP script for the e2e tests (no efdl import).

Writes one JSON line per step to $OUT_DIR/events.jsonl. Resumes its step counter from
$OUT_DIR/state.json (as a torchrun script resumes from a checkpoint).
Faults: FAIL_AT="rank:step[:restart]" exits 3 on that rank at that step (only at that
TORCHELASTIC_RESTART_COUNT, default 0).
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

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
state = out / "state.json"
start = json.loads(state.read_text())["step"] + 1 if state.exists() else 0
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(start, steps):
    if fail_at:
        f_rank, f_step, *f_restart = (int(x) for x in fail_at.split(":"))
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if rank == f_rank and step == f_step and restart == (f_restart[0] if f_restart else 0):
            raise SystemExit(3)
    loss = model(torch.ones(2, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    event = {
        "node": os.environ["EFDL_NODE_ID"],
        "rank": rank,
        "world": world,
        "step": step,
        "gen": int(os.environ["EFDL_GENERATION"]),
        "pid": os.getpid(),
        "t": time.time(),
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "master": os.environ["MASTER_ADDR"],
    }
    with open(out / "events.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")
    if rank == 0:
        state.write_text(json.dumps({"step": step}))
    time.sleep(delay)
dist.destroy_process_group()

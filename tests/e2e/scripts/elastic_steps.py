"""An efdl-aware DDP script for the e2e tests: rebuilds in place on every rescale.

One JSON line per committed step to $OUT_DIR/events.jsonl: node, pid, rank, world, generation,
step, epoch, a digest of the parameters, and the sample indices this rank trained on.
Faults: FAIL_AT="rank:step" makes that rank exit 3 at that step (first process only).
"""

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import efdl

out = Path(os.environ["OUT_DIR"])
epochs = int(os.environ.get("EPOCHS", "1000"))
delay = float(os.environ.get("STEP_SECONDS", "0.1"))
fail_at = os.environ.get("FAIL_AT", "")

efdl.init_process_group("gloo", timeout_s=15)
torch.manual_seed(int(os.environ.get("RANK", "0")))  # different inits: sync must fix them
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
n = int(os.environ.get("SAMPLES", "96"))
data = TensorDataset(torch.arange(n, dtype=torch.float32).repeat(4, 1).T / n, torch.arange(n))
sampler = efdl.ElasticSampler(data, batch_size=2, seed=1)
loader = DataLoader(data, batch_size=2, sampler=sampler)
state = efdl.elastic_state(model, optimizer, sampler, epoch=0)
spawned = os.environ.get("EFDL_GENERATION")


@efdl.elastic(state)
def train(state: efdl.ElasticState) -> None:
    for state.epoch in range(state.epoch, epochs):
        for x, idx in loader:
            rank, world = dist.get_rank(), dist.get_world_size()
            if fail_at and f"{rank}:{state.step}" == fail_at and spawned == "1":
                raise SystemExit(3)
            loss = state.ddp(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            digest = float(sum(p.detach().double().sum() for p in model.parameters()))
            # Logged before commit(): the commit where all ranks pause leaves train() at once.
            row = {
                "node": os.environ["EFDL_NODE_ID"],
                "pid": os.getpid(),
                "rank": rank,
                "world": world,
                "gen": state.generation,
                "step": state.step + 1,
                "epoch": state.epoch,
                "digest": digest,
                "samples": idx.tolist(),
                "t": time.time(),
                "rescales": state.rescales,
            }
            with open(out / "events.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            time.sleep(delay)
            state.commit()


train(state)

"""The steps.py job as one TorchFT replica group of one worker (gloo on CPU), for
benchmarks.recovery and benchmarks.outage: a TorchFT Manager (its lighthouse at
$TORCHFT_LIGHTHOUSE) around DDP and SGD, one JSON line per committed step to
$OUT_DIR/events.jsonl (replica r0's rows stand for the job's rank 0; "world" is the quorum's
replica count, "gen" its quorum id). Run under torchrun (the Manager joins torchrun's store),
one torchrun per replica group, as TorchFT's examples do.

Knobs as elastic_steps.py: STEP_SECONDS (sleep per step), MODEL_WIDTH (0: a 4-to-1 linear
layer; else the same 3-layer MLP), BATCH (rows per step), SAMPLES, STEPS (stop after that many
committed steps; default: never).
"""

import datetime
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

out = Path(os.environ["OUT_DIR"])
delay = float(os.environ.get("STEP_SECONDS", "0.1"))
replica = os.environ["REPLICA_ID"]
width = int(os.environ.get("MODEL_WIDTH", "0"))
batch = int(os.environ.get("BATCH", "2"))
steps = int(os.environ.get("STEPS", "0"))
if width:
    layers = [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)]
    model: torch.nn.Module = torch.nn.Sequential(
        *layers, torch.nn.ReLU(), torch.nn.Linear(width, 1)
    )
else:
    model = torch.nn.Linear(4, 1)
sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
samples = int(os.environ.get("SAMPLES", "96"))
loader = DataLoader(TensorDataset(torch.randn(samples, width or 4)), batch_size=batch)


def load(state: dict[str, object]) -> None:
    model.load_state_dict(state["model"])  # type: ignore[arg-type]
    sgd.load_state_dict(state["optimizer"])  # type: ignore[arg-type]


def save() -> dict[str, object]:
    return {"model": model.state_dict(), "optimizer": sgd.state_dict()}


timeout = datetime.timedelta(seconds=float(os.environ.get("TORCHFT_TIMEOUT", "60")))  # its default
manager = Manager(
    pg=ProcessGroupGloo(timeout=timeout),
    load_state_dict=load,
    state_dict=save,
    min_replica_size=1,
    replica_id=replica,
    timeout=timeout,
    quorum_timeout=timeout,
    connect_timeout=timeout,
)
ddp = DistributedDataParallel(manager, model)
optimizer = Optimizer(manager, sgd)


def batches():  # type: ignore[no-untyped-def]
    while True:
        yield from loader


for (x,) in batches():
    optimizer.zero_grad()  # starts this step's quorum
    ddp(x).pow(2).mean().backward()
    before = manager.current_step()
    optimizer.step()  # applies the update only if every replica's step succeeded
    step = manager.current_step()
    if step > before:  # committed
        row = {
            "node": replica,
            "rank": int(replica.removeprefix("r")),  # replica r0 stands for the job
            "pid": os.getpid(),
            "step": step,
            "world": manager.num_participants(),
            "gen": manager._quorum_id,  # no public accessor in 0.2.0
            "t": time.time(),
        }
        with open(out / "events.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if steps and step >= steps:
            break
    if delay:
        time.sleep(delay)
manager.shutdown()

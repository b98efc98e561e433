"""The steps.py job as one TorchFT replica group of one worker (gloo on CPU), for
benchmarks.outage: a TorchFT Manager (its lighthouse at $TORCHFT_LIGHTHOUSE) around DDP and
SGD, one JSON line per committed step to $OUT_DIR/events.jsonl. Run under torchrun (the
Manager joins torchrun's store), one torchrun per replica group, as TorchFT's examples do.
"""

import datetime
import json
import os
import time
from pathlib import Path

import torch
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

out = Path(os.environ["OUT_DIR"])
delay = float(os.environ.get("STEP_SECONDS", "0.1"))
replica = os.environ["REPLICA_ID"]
model = torch.nn.Linear(4, 1)
sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


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
x = torch.randn(2, 4)
while True:
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
            "gen": manager.num_participants(),
            "t": time.time(),
        }
        with open(out / "events.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    time.sleep(delay)

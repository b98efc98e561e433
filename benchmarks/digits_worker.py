"""The digits example (examples/digits/train_efdl.py) at a fixed global batch, instrumented for
benchmarks.convergence: the same data, model and optimizer; an ElasticBatchSampler instead of
the per-worker batch, so a step trains on GLOBAL_BATCH samples whatever the world size.

Rank 0 appends to $OUT_DIR/events.jsonl one row per step (time, step, world, generation) and,
every EVAL_EVERY steps, one row with the loss on the whole training set and the loss and
accuracy on the test set, against the samples seen (committed steps x GLOBAL_BATCH).
Knobs: SEED (model init and data order), EPOCHS, GLOBAL_BATCH, LR, EVAL_EVERY, STEP_SECONDS (a
sleep per step, so that a churn schedule has time to happen on a fast machine).
"""

import importlib.util
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import efdl

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("digits", ROOT / "examples/digits/train_efdl.py")
assert spec is not None and spec.loader is not None
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

out = Path(os.environ["OUT_DIR"])
seed = int(os.environ.get("SEED", "0"))
epochs = int(os.environ.get("EPOCHS", "15"))
global_batch = int(os.environ.get("GLOBAL_BATCH", "48"))
eval_every = int(os.environ.get("EVAL_EVERY", "10"))
delay = float(os.environ.get("STEP_SECONDS", "0"))

efdl.init_process_group("gloo", timeout_s=15)
torch.manual_seed(seed)
model = torch.nn.Sequential(
    torch.nn.Linear(64, 256),
    torch.nn.ReLU(),
    torch.nn.Linear(256, 256),
    torch.nn.ReLU(),
    torch.nn.Linear(256, 10),
)
optimizer = torch.optim.SGD(
    model.parameters(), lr=float(os.environ.get("LR", "0.05")), momentum=0.9
)
train_set, test_set = example.data()
sampler = efdl.ElasticBatchSampler(train_set, global_batch, seed=seed)
loader = DataLoader(train_set, batch_sampler=sampler)
state = efdl.elastic_state(model, optimizer, sampler, epoch=0)


def evaluate(step: int) -> dict[str, float]:
    with torch.no_grad():
        x, y = train_set.tensors
        train_loss = torch.nn.functional.cross_entropy(model(x), y).item()
        x, y = test_set.tensors
        logits = model(x)
        test_loss = torch.nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(1) == y).float().mean().item()
    return {
        "eval": 1,
        "samples": step * global_batch,
        "train_loss": train_loss,
        "test_loss": test_loss,
        "accuracy": accuracy,
    }


def log(row: dict[str, object]) -> None:
    with open(out / "events.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


@efdl.elastic(state)
def train(state: efdl.ElasticState) -> None:
    for state.epoch in range(state.epoch, epochs):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(state.ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            rank, world, step = dist.get_rank(), dist.get_world_size(), state.step + 1
            if rank == 0:  # before commit(): the commit where all pause leaves train() at once
                row = {"t": time.time(), "step": step, "world": world, "gen": state.generation}
                log(
                    {
                        **row,
                        "rank": 0,
                        "pid": os.getpid(),
                        **(evaluate(step) if step % eval_every == 0 else {}),
                    }
                )
            if delay:
                time.sleep(delay)
            state.commit()


train(state)
if not dist.is_initialized():  # asked to leave: the group is gone already
    raise SystemExit(0)
if dist.get_rank() == 0:
    end = {"t": time.time(), "step": state.step, "world": dist.get_world_size(), "done": 1}
    log({**end, "rank": 0, "pid": os.getpid(), **evaluate(state.step)})
dist.destroy_process_group()

"""Classify scikit-learn's 8x8 digits with DDP: the efdl version (in-place elasticity).

    efdl-run --standalone --nproc-per-node 2 examples/digits/train_efdl.py

train_torchrun.py plus the efdl change: when nodes join, leave or die, the workers are not
restarted; they pause at a step boundary, rebuild their group and sync state in place.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import efdl


def data() -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", help="default: digits-<job id>.pt in the temp directory")
    args = parser.parse_args()
    # One checkpoint per job (torchrun and efdl-run set TORCHELASTIC_RUN_ID), removed when the
    # job finishes: it serves the restarts of this job, not a later run of the example.
    job = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    args.checkpoint = args.checkpoint or os.path.join(tempfile.gettempdir(), f"digits-{job}.pt")

    efdl.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_epoch = 0
    if os.path.exists(args.checkpoint):
        snapshot = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        start_epoch = snapshot["epoch"] + 1
        if dist.get_rank() == 0:
            print(f"resumed from {args.checkpoint} at epoch {start_epoch}", flush=True)
    train_set, test_set = data()
    sampler = efdl.ElasticSampler(train_set, batch_size=args.batch, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler)
    state = efdl.elastic_state(model, optimizer, sampler, epoch=start_epoch)

    @efdl.elastic(state)
    def train(state: efdl.ElasticState) -> None:
        for state.epoch in range(state.epoch, args.epochs):
            epoch, ddp = state.epoch, state.ddp
            rank, world, t0 = dist.get_rank(), dist.get_world_size(), time.time()
            total, count = 0.0, 0
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total, count = total + loss.item() * len(y), count + len(y)
                state.commit()
            if rank == 0:
                with torch.no_grad():
                    hits = model(test_set.tensors[0]).argmax(1) == test_set.tensors[1]
                tmp = args.checkpoint + ".tmp"
                snapshot = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**snapshot, "epoch": epoch}, tmp)
                os.replace(tmp, args.checkpoint)
                print(
                    json.dumps(
                        {
                            "epoch": epoch,
                            "world": world,
                            "loss": round(total / count, 4),
                            "accuracy": round(hits.float().mean().item(), 4),
                            "seconds": round(time.time() - t0, 2),
                        }
                    ),
                    flush=True,
                )

    train(state)
    if dist.get_rank() == 0:  # finished: a later run of the example trains anew
        Path(args.checkpoint).unlink(missing_ok=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

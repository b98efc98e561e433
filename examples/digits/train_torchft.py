"""The digits example under TorchFT 0.2.0, changed from train_torchrun.py as TorchFT's own
examples change a DDP script: a Manager with the state's save and load, its DDP, optimizer
and sampler wrappers. One replica group of one worker per torchrun, on a lighthouse:

    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510 &
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 \
        torchrun --nproc-per-node 1 --master-port 29600 examples/digits/train_torchft.py
    (and REPLICA_GROUP_ID=1, --master-port 29601, in a second shell)

For benchmarks.recovery's count of the lines a user changes (efdl: train_efdl.py).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.data import DistributedSampler


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

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def load_state(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def save_state() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    group = int(os.environ["REPLICA_GROUP_ID"])
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=load_state,
        state_dict=save_state,
        min_replica_size=1,
        replica_id=f"digits_{group}",
    )
    start_epoch = 0
    if os.path.exists(args.checkpoint):
        snapshot = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        start_epoch = snapshot["epoch"] + 1
        if group == 0:
            print(f"resumed from {args.checkpoint} at epoch {start_epoch}", flush=True)
    train_set, test_set = data()
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, optimizer)
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    sampler = DistributedSampler(train_set, group, groups, 0, 1, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler)

    def train(start_epoch: int) -> None:
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch)
            rank, world, t0 = group, manager.num_participants(), time.time()
            total, count = 0.0, 0
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total, count = total + loss.item() * len(y), count + len(y)
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

    train(start_epoch)
    if group == 0:  # finished: a later run of the example trains anew
        Path(args.checkpoint).unlink(missing_ok=True)
    manager.shutdown()


if __name__ == "__main__":
    main()

"""Train on a streamed Parquet data set that survives rescales: efdl.ElasticStream.

    efdl-run --standalone --nproc-per-node 2 examples/stream/train.py

The run writes a synthetic data set (``--data``, default ``efdl-stream-example-<job id>`` in
the temp directory: 16 Parquet files of 4096 rows, 64 features and a label each, removed when
the job finishes; give ``--data DIR`` to keep one) and trains a classifier on it. The stream
reads each rank's share of every step straight from the files (the directory may as well be
``s3://bucket/prefix``); its position (epoch, samples consumed) is part of the elastic state,
so when workers join, leave or die mid-epoch the rest of the epoch is split over the new
world and every row is trained once per epoch. Rank 0 prints each epoch's training accuracy.

Without efdl-run's in-place mode (plain torchrun), the same stream resumes through the
script's checkpoint: ``stream.state_dict()`` in, ``stream.load_state_dict()`` out, and
``stream.advance()`` after each step (docs/data.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import efdl

FEATURES, CLASSES = 64, 8


def write_data(folder: Path, files: int = 16, rows: int = 4096) -> None:
    """A synthetic classification set: the label is the argmax of a fixed projection."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(FEATURES, CLASSES, generator=g)
    for i in range(files):
        x = torch.randn(rows, FEATURES, generator=g)
        y = (x @ proj).argmax(dim=1)
        table = pa.table(
            {
                "id": pa.array(range(i * rows, (i + 1) * rows), pa.int64()),
                "x": pa.FixedSizeListArray.from_arrays(pa.array(x.flatten().numpy()), FEATURES),
                "y": pa.array(y.numpy()),
            }
        )
        tmp = folder / f".part-{i:03d}.parquet.tmp"
        pq.write_table(table, tmp, row_group_size=1024)
        tmp.rename(folder / f"part-{i:03d}.parquet")  # whole files only, for other ranks


def main() -> None:
    parser = argparse.ArgumentParser()
    job = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # (this job's restarts share it)
    default = os.path.join(tempfile.gettempdir(), f"efdl-stream-example-{job}")
    parser.add_argument("--data", default=default, help="Parquet files (a directory or URL)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256, help="global batch (all ranks)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    args = parser.parse_args()

    efdl.init_process_group("gloo")
    if "://" not in args.data and not list(Path(args.data).glob("part-*.parquet")):
        if dist.get_rank() == 0:
            write_data(Path(args.data))
        dist.barrier()
    dev = efdl.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, CLASSES)
    ).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stream = efdl.ElasticStream(args.data, global_batch_size=args.batch, seed=0)
    loader = DataLoader(
        stream, batch_size=None, num_workers=args.workers, pin_memory=dev.type == "cuda"
    )
    state = efdl.elastic_state(model, optimizer, stream, epoch=0)

    @efdl.elastic(state)
    def train(state: efdl.ElasticState) -> None:
        for state.epoch in range(state.epoch, args.epochs):
            correct = torch.zeros(2, device=dev)
            for batch in loader:
                x, y = batch["x"].to(dev, non_blocking=True), batch["y"].to(dev)
                out = state.ddp(x)
                loss = torch.nn.functional.cross_entropy(out, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                correct += torch.stack(
                    [(out.argmax(1) == y).sum(), torch.tensor(len(y), device=dev)]
                )
                state.commit()
            dist.all_reduce(correct)
            if dist.get_rank() == 0:
                print(
                    f"epoch {state.epoch}: world {dist.get_world_size()}, train accuracy "
                    f"{correct[0] / correct[1]:.3f} (its rows since the last rescale: "
                    f"{int(correct[1])})",
                    flush=True,
                )

    train(state)
    if args.data == default:  # the data set this job wrote for itself goes with it
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(args.data, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

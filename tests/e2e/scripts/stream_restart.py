"""A plain torchrun script (no efdl API but the stream) that streams Parquet through
efdl.ElasticStream and resumes from its own checkpoint after a restart, as a torchrun user
would: ``stream.advance()`` after each step, ``stream.state_dict()`` in the checkpoint.

$STREAM: the Parquet directory (columns id and x); $OUT_DIR: one JSON line per step to
events.jsonl (rank, world, restart, epoch, step, sample ids) and the checkpoint (rank 0
writes it after every step). FAIL_AT="rank:step" exits 3 at that step once per job.
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import efdl

out = Path(os.environ["OUT_DIR"])
ckpt = out / "checkpoint.pt"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
stream = efdl.ElasticStream(os.environ["STREAM"], 16, lanes=8, window=32, seed=1)
epoch, step = 0, 0
if ckpt.exists():
    saved = torch.load(ckpt, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    stream.load_state_dict(saved["stream"])
    epoch, step = saved["epoch"], saved["step"]
ddp = DistributedDataParallel(model)
loader = DataLoader(stream, batch_size=None, num_workers=int(os.environ.get("NUM_WORKERS", "0")))
fail_rank, _, fail_step = os.environ.get("FAIL_AT", "").partition(":")
for epoch in range(epoch, int(os.environ.get("EPOCHS", "2"))):
    stream.set_epoch(epoch)
    for batch in loader:
        if f"{rank}:{step + 1}" == os.environ.get("FAIL_AT"):
            try:
                os.close(os.open(out / "failed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                raise SystemExit(3)
            except FileExistsError:
                pass
        loss = ddp(batch["x"]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stream.advance()
        step += 1
        row = {
            "rank": rank,
            "world": world,
            "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
            "epoch": epoch,
            "step": step,
            "samples": batch["id"].tolist(),
        }
        with open(out / "events.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if rank == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "stream": stream.state_dict(),
                "epoch": epoch,
                "step": step,
            }
            torch.save(state, out / "checkpoint.tmp")
            os.replace(out / "checkpoint.tmp", ckpt)
dist.destroy_process_group()

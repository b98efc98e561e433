"""One rank of the resume test: a newcomer (its own zeros) in a real gloo group, whose sync
resumes from the remote cache at $EFDL_CACHE_URL. Args: rank, world size, a FileStore path.
Prints one JSON line: the step, epoch and parameter sums it resumed, and the bytes it received
(or the StateLostError it raised).

RESUME_HOLDER_STEP=N: rank 0 is not new but holds step N (w all N, b all -N), as a stale
survivor would; RESUME_JOB_STEP=M: the job had committed step M (its agent's placement).
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from efdl.errors import StateLostError
from efdl.protocol.messages import Placement
from efdl.worker.runtime import get_runtime
from efdl.worker.state import ElasticState

rank, world, store_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.FileStore(store_path, world)
timeout = datetime.timedelta(seconds=120)  # a peer writing snapshots on a busy disk
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
get_runtime().side = dist.new_group(backend="gloo", timeout=timeout)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3072))
        self.b = torch.nn.Parameter(torch.zeros(1024))


model = Model()
state = ElasticState(model, epoch=0)
holder_step = int(os.environ.get("RESUME_HOLDER_STEP", "-1"))
if rank == 0 and holder_step >= 0:
    with torch.no_grad():
        model.w.fill_(holder_step)
        model.b.fill_(-holder_step)
    state._tree.step, state._tree.holds = holder_step, True
job_step = int(os.environ.get("RESUME_JOB_STEP", "0"))
get_runtime().placement = Placement(0, rank, world, rank, world, 0, 1, "127.0.0.1", 1, job_step)
try:
    state.sync()
except StateLostError as exc:
    print(json.dumps({"error": str(exc)}), flush=True)
    sys.exit(0)
moved = state.last_sync
result = {
    "step": state.step,
    "epoch": state.epoch,
    "w": float(model.w.detach().sum()),
    "b": float(model.b.detach().sum()),
    "received": moved.received if moved else None,
}
print(json.dumps(result), flush=True)
dist.destroy_process_group()

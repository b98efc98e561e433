"""One rank of the resume test: a newcomer (its own zeros) in a real gloo group, whose sync
resumes from the remote cache at $EFDL_CACHE_URL. Args: rank, world size, a FileStore path.
Prints one JSON line: the step, epoch and parameter sums it resumed, and the bytes it received.
"""

import datetime
import json
import sys

import torch
import torch.distributed as dist

from efdl.state.runtime import runtime
from efdl.state.state import ElasticState

rank, world, store_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.FileStore(store_path, world)
timeout = datetime.timedelta(seconds=60)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
runtime.side = dist.new_group(backend="gloo", timeout=timeout)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3072))
        self.b = torch.nn.Parameter(torch.zeros(1024))


model = Model()
state = ElasticState(model, epoch=0)
state.sync()
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

"""One rank of the sync test: records every collective and point-to-point operation of
efdl's in-place path.

Args: rank, world size, a FileStore path, an output JSON path. Rank 0 holds committed state
(it trained two steps); the others are newcomers. Every collective call is recorded with its
group (the training group or not) and its tensor's device.
"""

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from efdl.worker import state as elastic
from efdl.worker.runtime import get_runtime

rank, world, store_path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
calls: list[dict[str, object]] = []


def spy(name: str):  # type: ignore[no-untyped-def]
    real = getattr(dist, name)

    def call(tensor, *args, group=None, **kwargs):  # type: ignore[no-untyped-def]
        training = group is None or group is dist.group.WORLD
        first = tensor[0] if isinstance(tensor, list) else tensor
        calls.append({"op": name, "training": training, "device": first.device.type})
        return real(tensor, *args, group=group, **kwargs)

    setattr(dist, name, call)


ops = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "send", "recv")
for op in (*ops, "isend", "irecv"):
    spy(op)

store = dist.FileStore(store_path, world)
timeout = datetime.timedelta(seconds=60)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
get_runtime().side = dist.new_group(backend="gloo", timeout=timeout)

torch.manual_seed(rank)  # different parameters: sync must make them equal
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
state = elastic.elastic_state(model, opt, epoch=3)
if rank == 0:  # the survivor: two committed steps (Adam's state exists, steps on the CPU)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        state.commit()
calls.clear()  # what follows is the rebuild's sync
state.sync()
params = [p.detach().double().sum().item() for p in model.parameters()]
moments = [float(s["exp_avg"].double().sum()) for s in opt.state.values()]
result = {"calls": calls, "params": params, "moments": moments, "step": state.step}
Path(out).write_text(json.dumps({**result, "epoch": state.epoch}))
dist.destroy_process_group()

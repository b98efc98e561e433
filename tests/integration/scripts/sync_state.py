"""One rank of the sync tests: a real gloo group (FileStore), real ElasticState.sync().

Args: rank, world size, a FileStore path, an output JSON path. Standings: ranks 0 and 1 hold
step 5 (the same five SGD-momentum steps), rank 2 holds step 4 (a step behind), rank 3 and
up are newcomers (their own random init, no optimizer state). SYNC_HOLDERS=N: ranks below N
hold step 5; SYNC_CORRUPT=R: rank R changes one parameter element before the sync. Writes what
the sync moved, the state it left, and how much this rank's peak memory grew in the sync.
"""

import datetime
import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from efdl.worker.runtime import get_runtime
from efdl.worker.sampler import ElasticSampler
from efdl.worker.state import ElasticState

rank, world, store_path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
store = dist.FileStore(store_path, world)
timeout = datetime.timedelta(seconds=60)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
get_runtime().side = dist.new_group(backend="gloo", timeout=timeout)

torch.manual_seed(0 if rank < 3 else rank)  # holders start alike; newcomers do not
width = 1024  # 4 layers of 1024x1024: 16.8 MB of parameters, as much momentum
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
sampler = ElasticSampler(10_000, batch_size=4, seed=1)
state = ElasticState(model, opt, sampler, epoch=0, note="x")
holders = int(os.environ.get("SYNC_HOLDERS", "2"))
if rank < max(3, holders):
    data = torch.Generator().manual_seed(7)
    for _ in range(5 if rank < holders else 4):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, width, generator=data)).pow(2).mean().backward()
        opt.step()
        state.commit()
    model.zero_grad(set_to_none=True)  # as a rebuild drops the step's gradients
    state._tree.holds = True  # they synced in an earlier generation
    if rank == int(os.environ.get("SYNC_CORRUPT", "-1")):  # a replica gone its own way
        with torch.no_grad():
            next(model.parameters()).view(-1)[12345] += 1e-3
    state.note = f"rank {rank}"  # a declared value
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
state.sync()
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
moved = state.last_sync
result = {
    "sent": moved.sent if moved else None,
    "received": moved.received if moved else None,
    "grew": grew,
    "state_bytes": sum(p.nbytes for p in model.parameters()) * 2,
    "params": [p.detach().double().sum().item() for p in model.parameters()],
    "momentum": [float(s["momentum_buffer"].double().sum()) for s in opt.state.values()],
    "step": state.step,
    "cursor": sampler.cursor,
    "note": state.note,
    "same_params": all(
        a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters(), strict=True)
    ),
}
Path(out).write_text(json.dumps(result))
dist.destroy_process_group()

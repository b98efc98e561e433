"""One rank of the verdict-vote test: NCCL's asynchronous step, played on gloo.

Args: rank, a FileStore path, an output JSON path. Two ranks train an MLP with efdl's commit
agreement (a stand-in agent channel that never has news). The step verdicts see stand-in CUDA
events: on rank 1, step 3's work never completes before its group reports an error (as when
an all-reduce is aborted under an enqueued optimizer.step()), so rank 1 cannot vouch for
step 3 or any after it. Every rank must leave at the same commit (StepFailed), rank 1 must
take itself as torn and receive rank 0's state, and both must then hold the same tensors.
"""

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from efdl.worker.runtime import get_runtime
from efdl.worker.state import ElasticState, StepFailed

rt = get_runtime()

rank, store_path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
timeout = datetime.timedelta(seconds=60)
dist.init_process_group(
    "gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2, timeout=timeout
)
rt.side = dist.new_group(backend="gloo", timeout=timeout)


class Channel:
    """An agent with no news."""

    leave_requested = False

    def pending(self, generation: int) -> bool:
        return False

    def notify(self, message: object) -> None:
        pass


class Event:
    aborted = False

    def __init__(self, step: int) -> None:
        self.step = step

    def query(self) -> bool:  # rank 1's work from step 3 on ends only with the abort
        return rank != 1 or self.step < 3 or Event.aborted


rt.channel = Channel()  # type: ignore[assignment]
rt.step_event = lambda: Event(state.step)  # type: ignore[method-assign]
rt.errored = lambda: rank == 1 and state.step >= 3  # type: ignore[method-assign]

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = ElasticState(model, opt)
state._tree.holds = True  # synced in an earlier generation
ddp = torch.nn.parallel.DistributedDataParallel(model)
data = torch.Generator().manual_seed(rank)
left_at, action = None, None
for _ in range(10):
    opt.zero_grad(set_to_none=True)
    ddp(torch.randn(8, 64, generator=data)).pow(2).mean().backward()
    opt.step()
    if rank == 1 and state.step == 2:  # step 3's update comes from torn gradients
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1.0
    try:
        state.commit()
    except StepFailed:
        left_at = state.step
        Event.aborted = True
        action = str(state.recover())
        break
standing = state.standing()
state.sync()
result = {
    "left_at": left_at,
    "action": action,
    "held": standing.step,
    "torn": standing.torn,
    "step": state.step,
    "params": [p.detach().double().sum().item() for p in model.parameters()],
    "received": state.last_sync.received if state.last_sync else None,
}
Path(out).write_text(json.dumps(result))
dist.destroy_process_group()

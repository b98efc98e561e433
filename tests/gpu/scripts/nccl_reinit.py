"""NCCL at world size 1, the way efdl's in-place path drives it: make the group (eager,
non-blocking communicators), train, abort the communicators as the breaker does when a peer
hangs, see the next collective fail as a communication failure, see the step verdicts verify
the steps before and refuse the one after, destroy the group and make the next generation's,
train again. Prints one JSON line of what happened and how long.
"""

import json
import os
import threading
import time

import torch
import torch.distributed as dist

import efdl
from efdl._process import free_port
from efdl.protocol.messages import Placement
from efdl.worker.device import nccl_aborter
from efdl.worker.failure import classify
from efdl.worker.runtime import get_runtime
from efdl.worker.verdict import Verdicts

rt = get_runtime()


def placement(generation: int) -> Placement:
    return Placement(generation, 0, 1, 0, 1, 0, 1, "127.0.0.1", free_port())


os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
rt.backend = "nccl"
torch.cuda.set_device(efdl.device())
t0 = time.perf_counter()
rt.init_group(placement(1))
init_s = time.perf_counter() - t0
x = torch.ones(1 << 20, device=efdl.device())
# The step verdicts (efdl.worker.verdict): two steps, each an all-reduce and a commit; once
# their events completed with no error reported, both are verified.
verdicts = Verdicts(rt.errored, rt.step_event)
for step in (1, 2):
    dist.all_reduce(x)
    verdicts.committed(step)
torch.cuda.synchronize()
verdicts.settle()
verified_before = verdicts.verified

# Work that waits on a dead peer (a long kernel stands in, no error reported): after a failure
# its step is suspect once about two steps' time has passed, not the collective timeout.
stuck = Verdicts(lambda: False, rt.step_event)
stuck.committed(1)
torch.cuda.synchronize()
torch.cuda._sleep(6_000_000_000)  # type: ignore[no-untyped-call]  # about 3 s of GPU time
stuck.committed(2)
t_stuck = time.perf_counter()
stuck.after_failure(30)
stuck_wait_s = time.perf_counter() - t_stuck
stuck_suspect = stuck.failed and stuck.verified == 1 and stuck.holds(1) and not stuck.holds(2)
torch.cuda.synchronize()

# The breaker's abort runs on a side thread while the main thread trains.
t1 = time.perf_counter()
aborter = threading.Thread(target=nccl_aborter(dist.distributed_c10d._get_default_group()))
aborter.start()
aborter.join(timeout=60)
error = ""
exc_type = ""
try:
    dist.all_reduce(x)
    torch.cuda.synchronize()
except Exception as exc:
    error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    kind = classify(exc).value  # from what torch says alone, without efdl's record of a cut
    exc_type = type(exc).__mro__[0].__module__ + "." + type(exc).__qualname__
else:
    kind = "none"
# A step enqueued after the failure counts nowhere: the group is cut (efdl's record) and the
# step's tensors may come from torn gradients.
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
get_error = str(getattr(backend, "get_error", lambda: "n/a")())
rt.breaker.cut(below=2)
verdicts.committed(3)
verdicts.after_failure(30)
torn_after = not verdicts.holds(3) and verdicts.holds(2)
rt.destroy_group(abort=True)
rt.init_group(placement(2))
y = torch.full((1 << 20,), 2.0, device=efdl.device())
dist.all_reduce(y)
torch.cuda.synchronize()
reinit_s = time.perf_counter() - t1
print(
    json.dumps(
        {
            "device": str(efdl.device()),
            "name": torch.cuda.get_device_name(),
            "init_s": init_s,
            "abort_to_first_step_s": reinit_s,
            "after_abort": error,
            "kind": kind,
            "exc_type": exc_type,
            "value": float(y[0]),
            "aborter_done": not aborter.is_alive(),
            "verified_before": verified_before,
            "get_error_after_abort": get_error,
            "torn_after": torn_after,
            "stuck_suspect": stuck_suspect,
            "stuck_wait_s": stuck_wait_s,
        }
    ),
    flush=True,
)
dist.destroy_process_group()

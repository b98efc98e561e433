"""mlp_torchrun.py with the efdl change (benchmarks.state_scale): the same model, data and
optimizer, elastic in place. The model is built before ``efdl.init_process_group()``: a
newcomer counts itself in there, and the running workers pause as soon as every newcomer has.

One JSON line per step to $OUT_DIR/events.jsonl as mlp_torchrun.py writes it (plus the
generation); one line per entry into the training function (``"entry": true``) with what the
rebuild's sync sent and received here, and one (``"boot": true``) with when this process
started and when it reached ``efdl.init_process_group()``. Knobs: WIDTH, LAYERS, BATCH (per
worker), STEPS, SLOW_FILE (see slow()), EVAL_EVERY, EVAL_S, SAVE_AT, SAVE_S, FIRST_S
(see irregular()).
"""

import time

started = time.time()

import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import efdl  # noqa: E402

out = Path(os.environ["OUT_DIR"])
width, layers = int(os.environ["WIDTH"]), int(os.environ["LAYERS"])
batch, steps = int(os.environ.get("BATCH", "16")), int(os.environ.get("STEPS", "1000000"))

slow_file = os.environ.get("SLOW_FILE")


def slow() -> None:
    """While SLOW_FILE exists, sleep the seconds it holds before each forward pass (a node
    that became slow: benchmarks.stragglers)."""
    if slow_file and os.path.exists(slow_file):
        with contextlib.suppress(OSError, ValueError):  # being written: next step
            time.sleep(float(Path(slow_file).read_text() or 0))


# Ordinary irregularities that must name nobody slow (benchmarks.stragglers, "noise"): rank 0
# evaluates alone every EVAL_EVERY steps for EVAL_S seconds while the others wait; it saves a
# checkpoint for SAVE_S seconds once, at step SAVE_AT; each process's first step takes
# FIRST_S seconds more.
eval_every, eval_s = int(os.environ.get("EVAL_EVERY", "0")), float(os.environ.get("EVAL_S", "0"))
save_at, save_s = int(os.environ.get("SAVE_AT", "-1")), float(os.environ.get("SAVE_S", "0"))
first_s = [float(os.environ.get("FIRST_S", "0"))]


def irregular(step: int, rank: int) -> None:
    if first_s[0]:
        time.sleep(first_s[0])
        first_s[0] = 0.0
    if rank == 0 and eval_every and step % eval_every == 0:
        time.sleep(eval_s)
    if rank == 0 and step == save_at:
        time.sleep(save_s)


torch.manual_seed(0)
model = torch.nn.Sequential(
    *[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
data = TensorDataset(torch.randn(1024, width, generator=torch.Generator().manual_seed(1)))
ready = time.time()
efdl.init_process_group("gloo")
sampler = efdl.ElasticSampler(data, batch_size=batch, seed=0)
loader = DataLoader(data, batch_size=batch, sampler=sampler)
state = efdl.elastic_state(model, optimizer, sampler, epoch=0)


def log(row: dict[str, object]) -> None:
    row.update(
        t=time.time(),
        world=dist.get_world_size(),
        rank=dist.get_rank(),
        pid=os.getpid(),
        node=os.environ.get("EFDL_NODE_ID", ""),
        gen=state.generation,
        rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    with open(out / "events.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


@efdl.elastic(state)
def train(state: efdl.ElasticState) -> None:
    moved = state.last_sync
    sent, received, took = (moved.sent, moved.received, moved.seconds) if moved else (0, 0, 0.0)
    log({"entry": True, "step": state.step, "sent": sent, "received": received, "moved_s": took})
    log({"boot": True, "step": state.step, "started": started, "ready": ready})
    for state.epoch in range(state.epoch, 1_000_000):
        for (x,) in loader:
            slow()
            loss = state.ddp(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            log({"step": state.step + 1})
            state.commit()
            irregular(state.step, dist.get_rank())
            if state.step >= steps:
                return


train(state)
dist.destroy_process_group()

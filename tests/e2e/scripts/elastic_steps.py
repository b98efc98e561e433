"""An efdl-aware DDP script for the e2e tests: rebuilds in place on every rescale.

One JSON line per step to $OUT_DIR/events.jsonl (after optimizer.step(), before commit()):
node, pid, rank, world, generation, step, epoch, digests of the parameters before and after
the update ("before", "digest") and of the optimizer state, and the sample indices this rank
trained on.
Knobs as steps.py (STEP_SECONDS, MODEL_WIDTH, BATCH) plus SNAPSHOT_EVERY (efdl's rollback
copies, default 0: none) and DIGEST=0 (skip the parameter digest). USER_COLLECTIVE=1: every
rank all-reduces its loss after optimizer.step() (a user's collective between the step and the
commit); OPTIMIZER_COLLECTIVE=1: the optimizer all-reduces inside step(), after its update.
Faults fire once per job, in the first process to reach them (a file in $OUT_DIR claims
each; not "the first generation": when the agents' starts race, the first generation may be
restarted before it trains): FAIL_AT="rank:step" exits 3 at that step, before its
forward pass; KILL_IN="where:rank:step" exits 3 inside that step, where is "backward" (in the
backward pass: a gradient hook), "optimizer" (inside optimizer.step()), "after_step" (between
optimizer.step() and commit()) or "collective" (entering the USER_COLLECTIVE all-reduce).
PAUSE_SKEW="rank:s" makes the agent's news reach that rank s seconds late, the first time that
rank has news (once per job); each row says whether this rank itself had seen news at the
commit before it ("news").
SLOW_BELOW_WORLD="n:s": while the world is smaller than n, a step lasts s seconds instead of
STEP_SECONDS (a test that waits for a join before the data runs out, however slowly the
newcomer starts).
JOIN_DELAY=s: a worker not of the first generation sleeps s seconds before joining;
SETUP_GATE=1: such a worker, after joining (efdl.init_process_group), stands for a script that
builds its model there: it listens on $OUT_DIR/setup-<pid>.sock and goes on when the test
connects (up to 120 s).
CORRUPT_AT="rank:step" (once per job): that rank changes one parameter element after that
step's update (a replica gone its own way: a torn update, a flipped bit).
HANG_AT="rank:step" (once per job): that rank's main thread sleeps forever after committing
that step (its process and its agent live on: a hang, not a crash). FREEZE_AT="rank:step"
(once per job): after committing that step, that rank's main thread enters a C call that
holds the GIL (libc's sleep through ctypes.PyDLL): none of its threads runs, as in a native
call stuck in a driver. SAVE_AT="rank:step:seconds" (once per job): after committing that
step, that rank saves a checkpoint for that long (torch.save of 64 MB, again and again, as a
slow disk would make one save last: real work, mostly in C with the GIL held) while the others
wait for it in the next step. COLLECTIVE_TIMEOUT=default: efdl's default (torch's 600 s).
HANG_AT_ENTRY=step (once per job): a process that enters the training function again (after a
rescale), at that step or later and in a world of two or more, sleeps forever before its first
batch (a DataLoader that waits on a read at an iteration's start).
Errors that are not communication: OOM_AT="rank:step" (once per job) raises CUDA's
out-of-memory error there; SKIP_BARRIER_AT="rank:step" (first generation): every rank but
that one enters a dist.barrier() at that step, which times out after COLLECTIVE_TIMEOUT
(default 15) seconds.
STREAM=dir: the data is the Parquet files in dir (columns id and x, x 4 floats per row),
read through efdl.ElasticStream (GLOBAL_BATCH, LANES, WINDOW) by a DataLoader of NUM_WORKERS
worker processes (default 0).
COMM_HOOK=bf16: DDP options and a communication hook through elastic_state (bucket_cap_mb=1,
gradient_as_bucket_view, torch's bf16_compress_hook, counted); each row says how many times
the hook ran in its step ("hooked") and the wrapper's options ("ddp").
SLOW="node:seconds" makes that node's ranks sleep that much more in each step's forward pass
(a straggler: its peers wait for it in the gradient all-reduce); SLOW_FILE=path: only while
that file exists.
BACKEND=nccl (default gloo); DEVICE=cuda trains on efdl.device() (the GPU suite); each entry
row names the worker's GPU as the agent gave it ("gpu": its entry in CUDA_VISIBLE_DEVICES).
"""

import ctypes
import io
import json
import os
import select
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import efdl
import efdl.worker.channel

out = Path(os.environ["OUT_DIR"])
epochs = int(os.environ.get("EPOCHS", "1000"))
delay = float(os.environ.get("STEP_SECONDS", "0.1"))
fail_at = os.environ.get("FAIL_AT", "")

news = [False]


STUCK_S = 300.0  # a stuck main thread nobody replaced in this long ends its process


def stick(what: str) -> None:
    """The main thread stuck at ``what``, its process and agent alive (the channel's thread
    answers), until the agent kills the process. Bounded all the same: once its parent is
    gone (the test is over) it ends at once, and after STUCK_S it ends saying it was not
    replaced."""
    try:
        parent = os.pidfd_open(os.getppid())  # readable once the parent has exited
    except ProcessLookupError:
        os._exit(4)  # gone already
    if not select.select([parent], [], [], STUCK_S)[0]:
        print(f"stuck {what} for {STUCK_S:.0f} s: not replaced", file=sys.stderr, flush=True)
    os._exit(4)


def checkpoint(seconds: float) -> None:
    """A checkpoint save that lasts ``seconds``: 64 MB through torch.save again and again (a
    slow disk's one save), then a row saying how long it took."""
    data = {"weights": torch.randn(16 << 20)}
    started = time.monotonic()
    saves = 0
    while time.monotonic() - started < seconds:
        torch.save(data, io.BytesIO())
        saves += 1
    took = time.monotonic() - started
    with open(out / "saves.jsonl", "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "seconds": took, "saves": saves}) + "\n")


def once(fault: str) -> bool:
    """Whether this process is the first of the job to reach ``fault`` (it claims it)."""
    try:
        os.close(os.open(out / f"fault-{fault}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


_pending = efdl.worker.channel.AgentChannel.pending


def pending(self: efdl.worker.channel.AgentChannel, generation: int) -> bool:
    """The agent's news as this rank sees it: late on the PAUSE_SKEW rank."""
    value = _pending(self, generation)
    lag_rank, _, lag = os.environ.get("PAUSE_SKEW", "").partition(":")
    if value and lag_rank == os.environ.get("RANK"):
        if generation not in seen:
            seen[generation] = time.monotonic() if once("skew") else 0.0
        value = time.monotonic() - seen[generation] >= float(lag)
    news[0] = value
    return value


seen: dict[int, float] = {}
spawned = os.environ.get("EFDL_GENERATION")
efdl.worker.channel.AgentChannel.pending = pending  # type: ignore[method-assign]
if spawned != "1":  # a newcomer (or a replacement): JOIN_DELAY makes its start slow
    time.sleep(float(os.environ.get("JOIN_DELAY", "0")))
collective = os.environ.get("COLLECTIVE_TIMEOUT", "15")
timeout = None if collective == "default" else float(collective)
efdl.init_process_group(os.environ.get("BACKEND", "gloo"), timeout_s=timeout)
if spawned != "1" and os.environ.get("SETUP_GATE"):  # its setup lasts until the test says
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gate:
        gate.bind(str(out / f"setup-{os.getpid()}.sock"))
        gate.listen(1)
        gate.settimeout(120)
        gate.accept()[0].close()
torch.manual_seed(int(os.environ.get("RANK", "0")))  # different inits: sync must fix them
width = int(os.environ.get("MODEL_WIDTH", "0"))
dev = efdl.device() if os.environ.get("DEVICE") == "cuda" else torch.device("cpu")
visible, own = os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("EFDL_CUDA_DEVICE")
gpu = visible.split(",")[int(own)] if visible and own else None
if width:
    layers = [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)]
    model: torch.nn.Module = torch.nn.Sequential(
        *layers, torch.nn.ReLU(), torch.nn.Linear(width, 1)
    )
else:
    model = torch.nn.Linear(4, 1)
model.to(dev)


class CommunicatingSGD(torch.optim.SGD):
    """An optimizer that communicates inside step() after updating, as ZeRO's does."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        loss = super().step(closure)
        dist.all_reduce(torch.zeros(1))
        return loss


sgd = CommunicatingSGD if os.environ.get("OPTIMIZER_COLLECTIVE") == "1" else torch.optim.SGD
optimizer = sgd(model.parameters(), lr=0.01, momentum=0.9)
n = int(os.environ.get("SAMPLES", "96"))
batch = int(os.environ.get("BATCH", "2"))
features = torch.randn(n, width or 4) if width else torch.arange(n).float().repeat(4, 1).T / n
data = TensorDataset(features, torch.arange(n))
sampler: efdl.ElasticSampler | efdl.ElasticStream
if os.environ.get("STREAM"):
    sampler = efdl.ElasticStream(
        os.environ["STREAM"],
        int(os.environ.get("GLOBAL_BATCH", "16")),
        lanes=int(os.environ.get("LANES", "8")),
        window=int(os.environ.get("WINDOW", "32")),
        seed=1,
    )
    stream_loader = DataLoader(
        sampler, batch_size=None, num_workers=int(os.environ.get("NUM_WORKERS", "0"))
    )
else:
    sampler = efdl.ElasticSampler(data, batch_size=batch, seed=1)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)


def batches():  # type: ignore[no-untyped-def]
    """The epoch's (features, sample ids) from the cursor on."""
    if isinstance(sampler, efdl.ElasticStream):
        return ((b["x"], b["id"]) for b in stream_loader)
    return iter(loader)


snapshot_every = int(os.environ.get("SNAPSHOT_EVERY", "0"))
hooked = [0]
ddp_options: dict[str, object] = {}
if os.environ.get("COMM_HOOK") == "bf16":
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def bf16(process_group, bucket):  # type: ignore[no-untyped-def]
        hooked[0] += 1
        return default_hooks.bf16_compress_hook(process_group, bucket)

    ddp_options = {
        "ddp_kwargs": {"bucket_cap_mb": 1, "gradient_as_bucket_view": True},
        "comm_hook": bf16,
    }
state = efdl.elastic_state(
    model, optimizer, sampler, snapshot_every=snapshot_every, epoch=0, **ddp_options
)
digests = os.environ.get("DIGEST", "1") != "0"
user_collective = os.environ.get("USER_COLLECTIVE") == "1"
kill_where, _, kill_at = os.environ.get("KILL_IN", "").partition(":")


def kill_here(where: str) -> None:
    """A crash at this point of the step: gone at once, mid-step."""
    here = f"{dist.get_rank()}:{state.step}"
    if kill_where == where and here == kill_at and once(f"kill-{here}"):
        os._exit(3)


first_param = next(model.parameters())
first_param.register_hook(lambda grad: kill_here("backward"))
optimizer.register_step_pre_hook(lambda *_: kill_here("optimizer"))


def params_digest() -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def opt_digest() -> float:
    """A digest of the optimizer state (momentum buffers)."""
    total = 0.0
    for st in optimizer.state.values():
        buf = st.get("momentum_buffer")
        if buf is not None:
            total += float(buf.double().sum())
    return total


entries = [0]  # this process's entries into train()


@efdl.elastic(state)
def train(state: efdl.ElasticState) -> None:
    # Each (re)entry: the state this rank resumes from, to $OUT_DIR/enter.jsonl.
    entry = {
        "pid": os.getpid(),
        "rank": dist.get_rank(),
        "step": state.step,
        "epoch": state.epoch,
        "digest": params_digest(),
        "opt": opt_digest(),
        "t": time.time(),
        "gpu": gpu,
        "device": str(next(model.parameters()).device),
    }
    with open(out / "enter.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    entries[0] += 1
    at = os.environ.get("HANG_AT_ENTRY")
    again = entries[0] > 1 and dist.get_world_size() > 1
    if at and again and state.step >= int(at) and once("hang-entry"):
        (out / "hang-entry.pid").write_text(str(os.getpid()))
        stick("before its first batch")
    for state.epoch in range(state.epoch, epochs):
        for x, idx in batches():
            rank, world = dist.get_rank(), dist.get_world_size()
            here = f"{rank}:{state.step}"
            if here == fail_at and once(f"fail-{here}"):
                raise SystemExit(3)
            if here == os.environ.get("OOM_AT") and once(f"oom-{here}"):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            skip_rank, _, skip_step = os.environ.get("SKIP_BARRIER_AT", "").partition(":")
            if skip_step == str(state.step) and skip_rank != str(rank) and spawned == "1":
                dist.barrier()  # the user's own collective, which one rank never enters
            hooked[0] = 0
            slow_node, _, slow_s = os.environ.get("SLOW", "").partition(":")
            slow_file = os.environ.get("SLOW_FILE")
            if slow_node == os.environ["EFDL_NODE_ID"] and (
                not slow_file or os.path.exists(slow_file)
            ):
                time.sleep(float(slow_s))
            loss = state.ddp(x.to(dev)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            before = params_digest() if digests else 0.0
            optimizer.step()
            kill_here("after_step")
            if here == os.environ.get("CORRUPT_AT") and once(f"corrupt-{here}"):
                with torch.no_grad():  # a replica goes its own way; DDP cannot see it
                    first_param.view(-1)[0] += 1e-3
            # Logged before commit(): the commit where all ranks pause leaves train() at once.
            row = {
                "node": os.environ["EFDL_NODE_ID"],
                "pid": os.getpid(),
                "warm": os.environ.get("EFDL_WARM") == "1",
                "rank": rank,
                "world": world,
                "gen": state.generation,
                "step": state.step + 1,
                "epoch": state.epoch,
                "before": before,
                "digest": params_digest() if digests else 0.0,
                "opt": opt_digest() if digests else 0.0,
                "samples": idx.tolist(),
                "t": time.time(),
                "rescales": state.rescales,
                "news": news[0],
                "hooked": hooked[0],
                "ddp": [
                    getattr(state.ddp, "bucket_bytes_cap", None),
                    getattr(state.ddp, "gradient_as_bucket_view", None),
                ],
            }
            with open(out / "events.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if user_collective:
                kill_here("collective")
                dist.all_reduce(loss.detach())
            below, _, below_s = os.environ.get("SLOW_BELOW_WORLD", "").partition(":")
            pause = float(below_s) if below and world < int(below) else delay
            if pause:
                time.sleep(pause)
            state.commit()
            if here == os.environ.get("HANG_AT") and once(f"hang-{here}"):
                stick(f"after step {state.step}")
            if here == os.environ.get("FREEZE_AT") and once(f"freeze-{here}"):
                (out / "frozen.pid").write_text(str(os.getpid()))
                ctypes.PyDLL(None).sleep(int(STUCK_S))  # the GIL held throughout
                os._exit(4)  # not replaced within STUCK_S
            save_rank, _, save = os.environ.get("SAVE_AT", "::").rpartition(":")
            if here == save_rank and once(f"save-{here}"):
                checkpoint(float(save))


train(state)
if dist.is_initialized():  # as user scripts end
    dist.destroy_process_group()

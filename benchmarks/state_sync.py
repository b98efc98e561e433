"""The rebuild's sync alone: how long newcomers take to receive the committed state, against
the link's bandwidth, and what it costs them in memory.

A job of ``--world`` real ranks (gloo; FileStore) where ``--holders`` ranks hold the committed
state of an MLP of N million parameters with SGD + momentum (state = 2x the parameter bytes)
and the others are newcomers (their own initialisation, no optimizer state). Each run times
``state.sync()`` in fresh processes: the standings' all-gather, the structure's pickle, and the
tensors from the holders to the newcomers in bounded messages, received in place.

With ``--device cuda`` the model lives on the GPU (ranks share one GPU over gloo, which stages
CUDA tensors through a host bucket: a lower bound for NCCL between GPUs).

Usage: python -m benchmarks.state_sync [--sizes 25,100] [--repeat 3] [--world 2] [--holders 1]
       [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.report import spread


def make_model(millions: int, device: torch.device) -> torch.nn.Module:
    """An MLP of about ``millions`` million parameters in 2048x2048 layers (4.2M each)."""
    layers = max(1, round(millions * 1e6 / (2048 * 2049)))
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)]).to(device)


def worker(rank: int, world: int, holders: int, store_path: str, millions: int, dev: str) -> None:
    import torch.distributed as dist

    from efdl.worker.runtime import get_runtime
    from efdl.worker.state import ElasticState

    timeout = datetime.timedelta(seconds=600)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    get_runtime().side = dist.new_group(backend="gloo", timeout=timeout)
    device = torch.device(dev)
    torch.manual_seed(0 if rank < holders else rank)
    model = make_model(millions, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = ElasticState(model, opt)
    if rank < holders:  # the committed state: one step, momentum buffers made
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        opt.step()
        state.commit()
        model.zero_grad(set_to_none=True)
        state._tree.holds = True
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.barrier()
    t0 = time.perf_counter()
    state.sync()
    if dev == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    moved = state.last_sync
    print(
        json.dumps(
            {
                "rank": rank,
                "seconds": elapsed,
                "received": moved.received if moved else 0,
                "grew": grew,
                "state": sum(p.nbytes for p in model.parameters()) * 2,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()


def run(millions: int, world: int, holders: int, dev: str) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "benchmarks.state_sync", "--worker"]
        procs = [
            subprocess.Popen(
                [*argv, f"{r},{world},{holders},{tmp}/store,{millions},{dev}"],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank failed")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25,100")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--holders", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, world, holders, store, millions, dev = args.worker.split(",")
        worker(int(rank), int(world), int(holders), store, int(millions), dev)
        return
    newcomers = args.world - args.holders
    print(
        f"{args.world} ranks on {args.device} (gloo), {args.holders} holding the committed state, "
        f"{newcomers} newcomer(s); `state.sync()` timed on every rank, median of {args.repeat} "
        "runs (min-max); the newcomers' peak memory growth in the sync, beside what they lacked "
        "(the momentum buffers).\n"
    )
    print(
        "| params | state MB | sync (s) | newcomer GB/s | holder received | newcomer peak growth "
        "(MB) | of which momentum (MB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        seconds, speeds, grew, held = [], [], [], 0
        state = 0.0
        for _ in range(args.repeat):
            ranks = run(size, args.world, args.holders, args.device)
            seconds.append(max(r["seconds"] for r in ranks))
            new = [r for r in ranks if r["rank"] >= args.holders]
            state = ranks[0]["state"]
            speeds += [r["received"] / r["seconds"] / 1e9 for r in new]
            grew += [r["grew"] for r in new]
            held = max(held, int(max(r["received"] for r in ranks[: args.holders])))
        print(
            f"| {size}M | {state / 1e6:.0f} | {spread(seconds)} | {spread(speeds)} | {held} B | "
            f"{statistics.median(grew) / 1e6:.0f} | {state / 2e6:.0f} |",
            flush=True,
        )
    print()


if __name__ == "__main__":
    main()

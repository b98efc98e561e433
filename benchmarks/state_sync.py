"""In-place state sync: how long newcomers take to receive the committed state, and the memory
it costs them, efdl's per-tensor path against the pickled blob efdl 0.1 sent.

A job of ``--world`` real ranks (gloo; FileStore) where rank 0 holds the committed state of a
model of N million parameters with SGD+momentum (state = 2x the parameter bytes) and the
others are newcomers. Each run times ``state.sync()`` (the rebuild's sync: find the newest
state, send it), in fresh processes, the two methods interleaved:

- ``tensors`` (efdl now): structure and values as one small pickle over the CPU side group,
  then each tensor by itself, on its own device (CPU tensors over the side group, GPU tensors
  over the training group), received into tensors on the newcomer's own device.
- ``blob`` (efdl 0.1): the whole state moved to the CPU, pickled into one buffer, broadcast
  over the side group, unpickled, loaded.

With ``--device cuda`` the model lives on the GPU (several ranks share one GPU over gloo,
which stages CUDA tensors through the host: a lower bound for NCCL between GPUs).

Usage: python -m benchmarks.state_sync [--sizes 25,100] [--repeat 3] [--world 2]
       [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks.report import spread

METHODS = ("tensors", "blob")


def make_model(millions: int, device: torch.device) -> torch.nn.Module:
    """An MLP of about ``millions`` million parameters in 2048x2048 layers (4.2M each)."""
    layers = max(1, round(millions * 1e6 / (2048 * 2049)))
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)]).to(device)


def blob_sync(state: Any, side: Any) -> None:
    """efdl 0.1's sync: the newest state pickled whole and broadcast over the side group."""
    import torch.distributed as dist

    rank = dist.get_rank()
    blob = b""
    if rank == 0:
        buffer = io.BytesIO()
        snapshot = state._snapshot
        cpu = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), snapshot)
        torch.save(cpu, buffer)
        blob = buffer.getvalue()
    size = torch.tensor([len(blob)], dtype=torch.int64)
    dist.broadcast(size, 0, group=side)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    if rank == 0:
        data.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    dist.broadcast(data, 0, group=side)
    if rank != 0:
        received = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
        state._load(received)
        state._snapshot = state._save()


def worker(rank: int, world: int, store_path: str, millions: int, method: str, dev: str) -> None:
    import torch.distributed as dist

    from efdl.state import elastic

    timeout = datetime.timedelta(seconds=600)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    side = dist.new_group(backend="gloo", timeout=timeout)
    elastic._runtime.side = side
    device = torch.device(dev)
    torch.manual_seed(rank)
    model = make_model(millions, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = elastic.elastic_state(model, opt, epoch=0)
    if rank == 0:
        model(torch.randn(8, 2048, device=device)).sum().backward()
        opt.step()
        state.commit()
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 2
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.barrier(group=side)
    t0 = time.perf_counter()
    if method == "tensors":
        state.sync()
    else:
        blob_sync(state, side)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=side)
    took = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if rank == world - 1:
        print(
            json.dumps(
                {
                    "s": took,
                    "bytes": state_bytes,
                    "rss_mb": after / 1024,
                    "grow_mb": (after - before) / 1024,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def run_once(world: int, millions: int, method: str, dev: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="efdl-sync-") as tmp:
        argv = [sys.executable, "-m", "benchmarks.state_sync", "--worker"]
        common = [str(world), f"{tmp}/store", str(millions), method, dev]
        procs = [
            subprocess.Popen([*argv, str(r), *common], stdout=subprocess.PIPE, text=True)
            for r in range(world)
        ]
        try:
            outs = [p.communicate(timeout=900)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a rank failed ({[p.returncode for p in procs]})")
        result: dict[str, float] = json.loads(outs[-1].strip().splitlines()[-1])
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25,100", help="millions of parameters")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, world, store, millions, method, dev = args.worker
        worker(int(rank), int(world), store, int(millions), method, dev)
        return
    intro = __doc__.split("Usage:")[0].split("\n\n", 1)[1].strip()
    print(intro.replace("``", "`") + "\n")
    print(
        f"{args.world} ranks, {args.device}, medians of {args.repeat} runs (min-max); "
        "`grow` is how much the newcomer's peak memory rose during the sync.\n"
    )
    print("| parameters | state | method | sync s | GB/s | newcomer peak RSS MB | grow MB |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    summary = []
    for millions in (int(s) for s in args.sizes.split(",")):
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        for _ in range(args.repeat):  # interleaved: the machine's load falls on both alike
            for m in METHODS:
                runs[m].append(run_once(args.world, millions, m, args.device))
        size = runs["tensors"][0]["bytes"]
        for m in METHODS:
            secs = [r["s"] for r in runs[m]]
            rates = [size / s / 1e9 for s in secs]
            print(
                f"| {millions}M | {size / 1e6:.0f} MB | {m} | {spread(secs)} | {spread(rates)} "
                f"| {spread([r['rss_mb'] for r in runs[m]], 0)} "
                f"| {spread([r['grow_mb'] for r in runs[m]], 0)} |"
            )
        median = {m: statistics.median(r["s"] for r in runs[m]) for m in METHODS}
        grow = {m: statistics.median(r["grow_mb"] for r in runs[m]) for m in METHODS}
        summary.append(
            f"{millions}M: per-tensor {median['blob'] / median['tensors']:.1f}x as fast as the "
            f"blob, the newcomer's peak memory {grow['blob'] - grow['tensors']:.0f} MB lower"
        )
    print("\n" + "; ".join(summary) + ".")
    if args.device == "cpu" and not torch.cuda.is_available():
        print(
            "\nNo GPU here: `bash scripts/gpu-check.sh` on a GPU machine gives the `--device "
            "cuda` table and NCCL's abort -> first step of the next generation (docs/gpu.md)."
        )


if __name__ == "__main__":
    main()

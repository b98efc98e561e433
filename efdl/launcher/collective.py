"""The node's own collective, a health check before it joins (``--health-collective``).

One process per worker slot, on this host alone, over the backend the workers will use
(NCCL on the node's GPUs, gloo on a CPU node), all-reduce a tensor of a few MB and check the
sum. It runs as its own program (``python -m efdl.launcher.collective``) in its own process
group, killed with its children at its deadline, so that a collective that hangs (a GPU
that NCCL cannot reach, a bad interface, a wedged driver) costs the agent a timeout, not its
loop. Only before joining: while the node trains, its GPUs are the workers', and the job's
own collectives are under the hang watch.

What it catches: a node whose collective library cannot start or cannot reach its own
devices (a missing or mismatched NCCL, a bad ``NCCL_SOCKET_IFNAME`` or
``GLOO_SOCKET_IFNAME``, a GPU NCCL cannot open, peer-to-peer broken between two GPUs). What it
cannot: the links between hosts (the first collective of a round tests those), a slow NIC
(the straggler detector judges speed). Cost: one import of torch in a fresh process and a
CUDA context per GPU, 2-5 s of CPU, once per agent start.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from collections.abc import Sequence

from efdl.launcher.health import Finding, Severity, run_command

ELEMENTS = 1 << 20  # float32 elements all-reduced: 4 MB, enough to leave the small-message path


def command(ranks: int, gpus: Sequence[str], timeout_s: float) -> str:
    """The shell command that runs the check (through efdl.launcher.health.run_command)."""
    devices = ",".join(gpus) if gpus else "-"
    return (
        f"{sys.executable} -P -m efdl.launcher.collective --ranks {ranks} --devices {devices} "
        f"--timeout {timeout_s:g}"
    )


def check(ranks: int, gpus: Sequence[str], timeout_s: float) -> Finding | None:
    """Run the node's collective over ``ranks`` processes (on ``gpus``, CUDA names, one per
    rank, if any; else gloo on the CPU); a fault if it fails or outlasts ``timeout_s``."""
    backend = "nccl" if gpus else "gloo"
    try:
        code, output = run_command(command(ranks, gpus, timeout_s), timeout_s)
    except OSError as exc:
        code, output = 127, str(exc)
    if code == 0:
        return None
    what = f"the node's own all-reduce ({backend}, {ranks} rank{'' if ranks == 1 else 's'})"
    if code is None:
        return Finding("collective", Severity.FAULT, f"{what} did not finish in {timeout_s:g} s")
    tail = " ".join(output.split())[-300:]
    return Finding("collective", Severity.FAULT, f"{what} failed (exit {code}): {tail}")


def _rank(rank: int, ranks: int, devices: list[str], port: int, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    backend = "nccl" if devices else "gloo"
    device = torch.device("cuda", rank) if devices else torch.device("cpu")
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        t = torch.full((ELEMENTS,), float(rank + 1), device=device)
        dist.all_reduce(t)
        want = ranks * (ranks + 1) / 2
        got = float(t[0].item()), float(t[-1].item())
        if got != (want, want):
            raise SystemExit(f"rank {rank}: the all-reduce summed to {got}, not {want}")
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--devices", default="-", help="CUDA device names, comma-separated; - none")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    devices = [] if args.devices == "-" else args.devices.split(",")
    if devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    from torch.multiprocessing.spawn import start_processes

    with socket.socket() as s:  # (a port free now; the ranks meet there at once)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        start_processes(  # type: ignore[no-untyped-call]
            _rank,
            args=(args.ranks, devices, port, args.timeout),
            nprocs=args.ranks,
            start_method="fork",
        )
    except Exception as exc:  # a rank's error: its message, for the finding's reason
        print(f"efdl: the node's collective failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

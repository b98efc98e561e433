"""The in-place state path at the sizes users train: efdl against torchrun on the same script.

An MLP (benchmarks/mlp_torchrun.py; mlp_efdl.py is the same script with the efdl change)
trained with SGD + momentum on CPU (gloo), as a user would, at four sizes. For each:

- **steady state**: 2 workers on one node (`--standalone`), median step time of rank 0 and the
  workers' peak resident memory, torchrun and efdl interleaved, efdl at its defaults;
- **events** (efdl in place): a job of 2 nodes with one worker each (real etcd) meets a join
  (a third node), a graceful leave (SIGTERM), a worker SIGKILL or a node SIGKILL; training
  stood still from the last step before to the first step at the new size. What the rebuild's
  sync moved to the survivors and to the newcomer is read from the workers' entry rows;
- **link**: the bandwidth of a gloo point-to-point transfer between two processes here, which
  bounds how fast any state can move;
- **cache**: benchmarks.cache at the same sizes (2 ranks writing in parallel).

Usage: python -m benchmarks.state_scale [--sizes 4,25,100,300] [--repeat 3] [--event-repeat 2]
       [--events join,leave,kill,node] [--no-cache]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks import cache
from benchmarks.recovery import Rows, Run, efdl_launcher
from benchmarks.report import spread, verdict
from efdl.rendezvous.embedded import EmbeddedEtcd

HERE = Path(__file__).resolve().parent
PLAIN, ELASTIC = HERE / "mlp_torchrun.py", HERE / "mlp_efdl.py"
# millions of parameters -> (width, layers, steps measured in steady state)
SIZES = {4: (1024, 4, 600), 25: (2048, 6, 150), 100: (4096, 6, 30), 300: (4096, 18, 16)}
BATCH = 16
LEASE_TTL = 3


def env_for(size: int, steps: int | None = None) -> dict[str, str]:
    width, layers, default_steps = SIZES[size]
    return {
        "WIDTH": str(width),
        "LAYERS": str(layers),
        "BATCH": str(BATCH),
        "STEPS": str(steps or default_steps),
    }


def params(size: int) -> int:
    width, layers, _ = SIZES[size]
    return layers * (width * width + width)


def rows_of(out: Path) -> Rows:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_rows(rows: Rows) -> Rows:
    """The rows of training steps (not the entry and boot rows of mlp_efdl.py)."""
    return [r for r in rows if "entry" not in r and "boot" not in r]


# ---------------------------------------------------------------- steady state


def steady(launcher: str, size: int, tmp: Path, steps: int | None = None) -> tuple[float, int]:
    """(median step time of rank 0 in s, peak RSS of the larger worker in bytes)."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    env = {**os.environ, "OUT_DIR": str(out), **env_for(size, steps)}
    if launcher == "efdl":
        job = f"scale-{uuid.uuid4().hex[:6]}"
        argv = [
            sys.executable,
            "-c",
            "from efdl.cli.run import run_main; run_main()",
            "--standalone",
        ]
        argv += ["--job-id", job, "--nproc-per-node", "2", str(ELASTIC)]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc-per-node", "2", str(PLAIN)]
    subprocess.run(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=1800,
        check=True,
    )
    rows = step_rows(rows_of(out))
    times = sorted(float(r["t"]) for r in rows if r["rank"] == 0)  # type: ignore[arg-type]
    skip = max(3, len(times) // 5)  # warm-up
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False)]
    peak = max(int(r["rss"]) for r in rows)  # type: ignore[call-overload]
    return statistics.median(gaps), peak


# ---------------------------------------------------------------- events


def event_run(size: int, event: str, etcd: str, tmp: Path) -> dict[str, float]:
    """One event on a 2-node job: seconds training stood still, and bytes the sync moved."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    # efdl's default grace period (30 s): a leaving worker pauses at the commit after the one
    # where its news is agreed, up to two steps (9 s at 300M here) after the SIGTERM.
    launcher = efdl_launcher(etcd, f"scale-{uuid.uuid4().hex[:6]}", script=ELASTIC, grace=30)
    # One thread per worker: several agents share this machine (an agent gives its workers
    # the node's cores, as if each had a node of its own).
    run = Run(launcher, out, {**env_for(size, steps=10**9), "OMP_NUM_THREADS": "1"})
    try:
        run.start("a")
        run.start("b")
        rows = run.wait(lambda rs: sum(1 for r in rs if r["world"] == 2) >= 10, timeout_s=600)
        gen0 = max(int(r["gen"]) for r in rows)  # type: ignore[call-overload]
        target = {"join": 3, "leave": 1, "kill": 2, "node": 1}[event]
        t0 = time.time()
        if event == "join":
            run.start("c")
        elif event == "leave":
            run.procs["b"].send_signal(signal.SIGTERM)
        elif event == "kill":
            os.kill(run.workers_of("b")[0], signal.SIGKILL)
        else:
            run.kill_node("b")

        def entries(rs: Rows) -> Rows:
            return [r for r in rs if r.get("entry") and int(r["gen"]) > gen0]  # type: ignore[call-overload]

        def all_entered(rs: Rows) -> bool:  # every rank of a generation at the new size
            new = [r for r in entries(rs) if r["world"] == target]
            return any(
                len({r["rank"] for r in new if r["gen"] == g}) == target
                for g in {r["gen"] for r in new}
            )

        rows = run.wait(all_entered, timeout_s=600)
        time.sleep(0.5)  # the last entry rows are written
        rows = run.rows()
        new = [r for r in entries(rows) if r["world"] == target]
        gen = max(int(r["gen"]) for r in new)  # type: ignore[call-overload]
        new = [r for r in new if r["gen"] == gen]
        resumed = max(float(r["t"]) for r in new)  # type: ignore[arg-type]
        first = min(float(r["t"]) for r in new)  # type: ignore[arg-type]
        before = max(float(r["t"]) for r in step_rows(rows) if float(r["t"]) < first)  # type: ignore[arg-type]
        boots = [r for r in rows if r.get("boot") and r["pid"] in {e["pid"] for e in new}]
        waited = max(
            (float(r["ready"]) - before for r in boots if float(r["started"]) > t0), default=0.0
        )  # type: ignore[arg-type]
        return {
            "stood": resumed - before,
            "waited": max(0.0, waited),  # for a replacement process to reach init_process_group
            "event": resumed - t0,
            "survivor_received": float(max(r["received"] or 0 for r in new if r["node"] == "a")),  # type: ignore[type-var]
            "newcomer_received": float(
                max((r["received"] or 0 for r in new if r["node"] != "a"), default=0)
            ),  # type: ignore[type-var]
        }
    finally:
        run.stop()


# ---------------------------------------------------------------- link


def link_rank(rank: int, store_path: str, nbytes: int, repeat: int) -> None:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    t = torch.ones(nbytes, dtype=torch.uint8)
    speeds = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        dist.barrier()
        speeds.append(nbytes / (time.perf_counter() - t0))
    if rank == 0:
        print(json.dumps({"bytes_per_s": statistics.median(speeds)}), flush=True)
    dist.destroy_process_group()


def link_bandwidth(tmp: Path, nbytes: int = 512 << 20) -> float:
    """Bytes per second of one gloo send/recv of ``nbytes`` between two processes here."""
    store = tmp / f"link-{uuid.uuid4().hex[:6]}"
    argv = [sys.executable, "-m", "benchmarks.state_scale", "--link-rank"]
    procs = [
        subprocess.Popen(
            [*argv, f"{r},{store},{nbytes},5"], stdout=subprocess.PIPE, text=True, env=os.environ
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return float(json.loads(outs[0].strip().splitlines()[-1])["bytes_per_s"])


# ---------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,25,100,300")
    parser.add_argument("--repeat", type=int, default=3, help="steady-state runs per launcher")
    parser.add_argument(
        "--steps", type=int, help="steps per steady-state run (default: 600 at 4M, 150 at 25M...)"
    )
    parser.add_argument("--event-repeat", type=int, default=2)
    parser.add_argument("--events", default="join,leave,kill,node")
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--link-rank", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.link_rank:
        rank, store, nbytes, repeat = args.link_rank.split(",")
        link_rank(int(rank), store, int(nbytes), int(repeat))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    events = [e for e in args.events.split(",") if e]
    tmp = Path(tempfile.mkdtemp(prefix="efdl-scale-"))
    bw = link_bandwidth(tmp)
    print(
        "An MLP (`benchmarks/mlp_torchrun.py`; `benchmarks/mlp_efdl.py` is the same script with "
        "the efdl change, its model built before `efdl.init_process_group()`) of width x layers "
        f"linear layers with ReLUs, SGD + momentum (state = 2x the parameter bytes), batch "
        f"{BATCH} per worker, gloo on CPU, efdl at its defaults (no rollback copies, no cache). "
        f"Steady state: 2 workers on one node, torchrun and efdl interleaved, {args.repeat} runs "
        "each; step time is rank 0's median (warm-up skipped), memory the larger worker's peak "
        "RSS. Link: one gloo send/recv of 512 MiB between two processes here: "
        f"{bw / 1e9:.2f} GB/s.\n"
    )
    print(
        "| params | state MB | torchrun step (ms) | efdl step (ms) | efdl / torchrun | "
        "torchrun peak MB | efdl peak MB | efdl / torchrun |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    step_ratios, mem_ratios = [], []
    for size in sizes:
        t_steps, e_steps, t_mem, e_mem = [], [], [], []
        for i in range(args.repeat):  # each launcher first in every other pair
            for launcher in ("torchrun", "efdl") if i % 2 == 0 else ("efdl", "torchrun"):
                s, m = steady(launcher, size, tmp, args.steps)
                (t_steps if launcher == "torchrun" else e_steps).append(s)
                (t_mem if launcher == "torchrun" else e_mem).append(m)
        step_ratio = statistics.median(e_steps) / statistics.median(t_steps)
        mem_ratio = statistics.median(e_mem) / statistics.median(t_mem)
        step_ratios.append(step_ratio)
        mem_ratios.append(mem_ratio)
        print(
            f"| {params(size) / 1e6:.0f}M | {params(size) * 8 / 1e6:.0f} | "
            f"{spread(t_steps, 1, 1000)} | {spread(e_steps, 1, 1000)} | {step_ratio:.3f} | "
            f"{statistics.median(t_mem) / 1e6:.0f} | {statistics.median(e_mem) / 1e6:.0f} | "
            f"{mem_ratio:.3f} |",
            flush=True,
        )
    print(
        f"\nGoals: step time within 2% of torchrun at every size (largest ratio "
        f"{max(step_ratios):.3f}: {verdict(max(step_ratios) <= 1.02)}); peak worker memory "
        f"within 10% of torchrun's (largest ratio {max(mem_ratios):.3f}: "
        f"{verdict(max(mem_ratios) <= 1.10)}).\n"
    )
    if events:
        event_table(sizes, events, args.event_repeat, bw, tmp)
    if not args.no_cache:
        cache.table(sizes, 3, 2, None)


def event_table(sizes: list[int], events: list[str], repeat: int, bw: float, tmp: Path) -> None:
    print(
        "Events: a job of 2 nodes with one worker each (efdl-run, real etcd, lease TTL "
        f"{LEASE_TTL} s, settle 1 s) meets a join (a third node's agent starts), a leave (SIGTERM "
        "to node b), a kill (node b's worker SIGKILLed: its agent starts a replacement, which "
        "the job waits for), or a node kill (node b's agent and worker SIGKILLed: noticed when "
        "its lease expires). Training stood still: from the end of the last step before the "
        "event to the moment every rank of the new size is back in the training function "
        f"(rebuilt and synced, about to step) (s), median of {repeat} runs (min-max). "
        "Received: what the rebuild's sync moved to the survivor (node a) and to the newcomer "
        "(c, or b's replacement). The goal is 1 s + state bytes / link bandwidth; for a node "
        f"kill plus the lease TTL ({LEASE_TTL} s) that detects it; for a worker kill the job waits "
        'for the replacement process to start (python, torch, the model: "waiting", from the '
        "last step to the replacement reaching `init_process_group`), and the goal applies to "
        "the rest.\n"
    )
    print(
        "| params | state MB | state / link (s) | join | leave | worker kill | node kill | "
        "survivor received | newcomer received |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    verdicts: list[tuple[int, str, float, float, str]] = []
    with EmbeddedEtcd() as etcd:
        for size in sizes:
            state = params(size) * 8
            bound = 1.0 + state / bw
            cells, survivor, newcomer = [], 0.0, 0.0
            for event in ("join", "leave", "kill", "node"):
                if event not in events:
                    cells.append("-")
                    continue
                results = [event_run(size, event, etcd.endpoint.target, tmp) for _ in range(repeat)]
                stood = [r["stood"] for r in results]
                survivor = max(survivor, *(r["survivor_received"] for r in results))
                newcomer = max(newcomer, *(r["newcomer_received"] for r in results))
                median = statistics.median(stood)
                if event == "kill":
                    waited = statistics.median(r["waited"] for r in results)
                    cells.append(f"{spread(stood)}, {waited:.2f} waiting")
                    verdicts.append(
                        (size, "worker kill", median - waited, bound, "beyond the wait")
                    )
                else:
                    cells.append(spread(stood))
                    limit = bound + (LEASE_TTL if event == "node" else 0)
                    verdicts.append((size, event, median, limit, ""))
            print(
                f"| {params(size) / 1e6:.0f}M | {state / 1e6:.0f} | {state / bw:.2f} | "
                + " | ".join(cells)
                + f" | {survivor / 1e6:.0f} MB | {newcomer / 1e6:.0f} MB |",
                flush=True,
            )
    print()
    for size, event, stood, bound, what in verdicts:
        said = f"{stood:.2f} s {what}".rstrip()
        print(
            f"- {params(size) / 1e6:.0f}M, {event}: stood still {said} (goal < {bound:.2f} s: "
            f"{verdict(stood < bound)})."
        )
    print()


if __name__ == "__main__":
    main()

"""A node that turns slow: efdl evicting it in place, efdl naming it only, torchrun.

Three nodes (one worker each, gloo on CPU) train an MLP (benchmarks/mlp_efdl.py, the same
model as plain DDP under torchrun: benchmarks/mlp_torchrun.py). Once all three train, the
healthy rate is measured; then one node becomes twice as slow (its worker sleeps, before each
forward pass, the healthy step time: SLOW_FILE), and the rate is followed for ``--follow``
seconds. The goal (issue 57): back to at least 95 % of two healthy nodes' own rate (a job of
those two alone, measured in the same repeat) within 30 s of the slowdown, nothing committed
lost. Runs are interleaved per repeat; the table gives medians.

Usage: python -m benchmarks.stragglers [--repeat 3] [--width 1536] [--layers 6]
       [--window 10] [--follow 60]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from benchmarks.recovery import Launcher, Rows, Run, efdl_launcher, torchrun_launcher
from efdl._process import free_port
from efdl.history import read_events
from efdl.rendezvous.api import Endpoint, EtcdSettings
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.records import EventKind

ROOT = Path(__file__).resolve().parents[1]
EFDL = ROOT / "benchmarks" / "mlp_efdl.py"
PLAIN = ROOT / "benchmarks" / "mlp_torchrun.py"
NODES = ("node-a", "node-b", "node-c")
SLOW = "node-c"
BIN_S = 5.0  # the rate is followed in bins of this many seconds
GOAL_S = 30.0
GOAL_SHARE = 0.95
KINDS = {
    "evict": "efdl --evict-stragglers",
    "name": "efdl (names it only)",
    "torchrun": "torchrun (tuned)",
}


@dataclass
class Outcome:
    healthy: float  # steps/s with three healthy nodes
    slowed: float  # steps/s in the first bin after the slowdown
    after: float  # steps/s over the last half of the follow
    recovered_s: float | None  # slowdown to the first bin at >= 95 % of two nodes' rate
    lost: int  # committed steps trained again


def rank0(rows: Rows) -> Rows:
    return [
        r
        for r in rows
        if r.get("rank") == 0 and "step" in r and "t" in r and "entry" not in r and "boot" not in r
    ]


def rate(rows: Rows, start: float, end: float) -> float:
    """Steps per second of rank 0 between two wall-clock times (by step count)."""
    inside = [r for r in rank0(rows) if start <= float(r["t"]) < end]  # type: ignore[arg-type]
    return len(inside) / (end - start) if end > start else 0.0


def lost_steps(rows: Rows) -> int:
    """Steps trained again: a rank-0 step at or below one already logged by an earlier rank 0."""
    best, lost = 0, 0
    for r in sorted(rank0(rows), key=lambda r: float(r["t"])):  # type: ignore[arg-type]
        step = int(r["step"])  # type: ignore[call-overload]
        if step <= best:
            lost += 1
        best = max(best, step)
    return lost


def launcher_for(kind: str, etcd: str, job: str, window: int) -> Launcher:
    if kind == "torchrun":
        return torchrun_launcher(free_port(), job, True, max_nodes=3, script=PLAIN)
    extra = ["--warm-workers", "1", "--straggler-window", str(window)]
    if kind == "evict":
        extra.append("--evict-stragglers")
    return efdl_launcher(etcd, job, min_nodes=1, max_nodes=3, script=EFDL, extra=extra)


def wait_world(run: Run, world: int, steps: int, timeout_s: float = 180) -> float:
    """Wait until rank 0 logged ``steps`` steps at ``world``; the wall time it did."""

    def ready(rows: Rows) -> bool:
        return sum(1 for r in rank0(rows) if r.get("world") == world) >= steps

    run.wait(ready, timeout_s)
    return time.time()


def one(
    kind: str, etcd: str, env: dict[str, str], window: int, follow_s: float, two_rate: float
) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="efdl-straggler-") as tmp:
        out = Path(tmp)
        slow_file = out / "slow"
        run = Run(launcher_for(kind, etcd, f"straggler-{uuid.uuid4().hex[:8]}", window), out, env)
        try:
            for node in NODES:
                if node == SLOW:
                    run.env["SLOW_FILE"] = str(slow_file)
                run.start(node)
                run.env.pop("SLOW_FILE", None)
            t = wait_world(run, 3, 10)
            time.sleep(15)
            healthy = rate(run.rows(), t, time.time())
            slow_file.write_text(f"{1 / healthy:.4f}")  # twice its own step time
            t0 = time.time()
            time.sleep(follow_s)
            rows = run.rows()
            bins = [
                rate(rows, t0 + i * BIN_S, t0 + (i + 1) * BIN_S)
                for i in range(int(follow_s / BIN_S))
            ]
            recovered = next(
                ((i + 1) * BIN_S for i, b in enumerate(bins) if b >= GOAL_SHARE * two_rate), None
            )
            return Outcome(
                healthy,
                bins[0],
                rate(rows, t0 + follow_s / 2, t0 + follow_s),
                recovered,
                lost_steps(rows),
            )
        finally:
            run.stop()


def two_nodes(etcd: str, env: dict[str, str]) -> float:
    """Steps per second of a job of two healthy nodes alone."""
    with tempfile.TemporaryDirectory(prefix="efdl-straggler-") as tmp:
        run = Run(launcher_for("name", etcd, f"two-{uuid.uuid4().hex[:8]}", 20), Path(tmp), env)
        try:
            for node in NODES[:2]:
                run.start(node)
            t = wait_world(run, 2, 10)
            time.sleep(15)
            return rate(run.rows(), t, time.time())
        finally:
            run.stop()


@dataclass
class Noise:
    seconds: float
    steps: int
    slow_events: int
    worlds: list[int]  # the world sizes rank 0 trained at, in order


def noise(etcd: str, env: dict[str, str], window: int, seconds: float) -> Noise:
    """Three healthy nodes with --evict-stragglers, for ``seconds``, under what must name
    nobody: this machine's own noise (other work runs beside), rank 0 evaluating alone every
    10 steps for about one step's time (1 s), a 10 s checkpoint save on rank 0 at step 30,
    and every process's first step 10 s longer (about ten steps)."""
    irregular = {
        "EVAL_EVERY": "10",
        "EVAL_S": "1",
        "SAVE_AT": "30",
        "SAVE_S": "10",
        "FIRST_S": "10",
    }
    with tempfile.TemporaryDirectory(prefix="efdl-straggler-") as tmp:
        job = f"noise-{uuid.uuid4().hex[:8]}"
        run = Run(launcher_for("evict", etcd, job, window), Path(tmp), {**env, **irregular})
        try:
            for node in NODES:
                run.start(node)
            wait_world(run, 3, 10)
            time.sleep(seconds)
            rows = run.rows()
        finally:
            run.stop()
        with EtcdStore(EtcdSettings((Endpoint.parse(etcd),))) as store:
            events = read_events(store, job)[0]
        worlds: list[int] = []
        for r in rank0(rows):
            if not worlds or worlds[-1] != r["world"]:
                worlds.append(int(r["world"]))  # type: ignore[call-overload]
        slow = sum(1 for e in events if e.kind is EventKind.SLOW)
        return Noise(seconds, len(rank0(rows)), slow, worlds)


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(results: dict[str, list[Outcome]], two: list[float]) -> str:
    ref = med(two)
    lines = [
        f"Two healthy nodes alone: {ref:.2f} steps/s (median of {len(two)}); goal: "
        f">= {GOAL_SHARE:.0%} of it ({GOAL_SHARE * ref:.2f}) within {GOAL_S:.0f} s of the "
        "slowdown.",
        "",
        "| launcher | healthy (3 nodes) | first 5 s slowed | last half of the follow | "
        "back to 95 % of two nodes after | committed steps lost |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, outs in results.items():
        rec = [o.recovered_s for o in outs]
        got = [r for r in rec if r is not None]
        back = f"{med(got):.0f} s ({len(got)} of {len(rec)})" if got else f"never (0 of {len(rec)})"
        lines.append(
            f"| {KINDS[kind]} | {med([o.healthy for o in outs]):.2f} | "
            f"{med([o.slowed for o in outs]):.2f} | {med([o.after for o in outs]):.2f} | "
            f"{back} | {max(o.lost for o in outs)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--window", type=int, default=10, help="--straggler-window for efdl")
    ap.add_argument("--follow", type=float, default=60.0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--noise", type=float, default=300.0, help="seconds of the noise run (0: none)")
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    env = {"WIDTH": str(args.width), "LAYERS": str(args.layers), "BATCH": "32"}
    params = args.layers * (args.width * args.width + args.width)
    print(f"MLP {args.layers} x {args.width} ({params / 1e6:.1f}M parameters), 3 nodes x 1 worker")
    results: dict[str, list[Outcome]] = {k: [] for k in kinds}
    two: list[float] = []
    with EmbeddedEtcd() as etcd:
        target = etcd.endpoint.target
        for i in range(args.repeat):
            two.append(two_nodes(target, env))
            for kind in kinds:
                o = one(kind, target, env, args.window, args.follow, two[-1])
                results[kind].append(o)
                print(f"repeat {i + 1} {KINDS[kind]}: {o}", flush=True)
        quiet = noise(target, env, args.window, args.noise) if args.noise else None
    print()
    print(table(results, two))
    if quiet is not None:
        print()
        print(
            f"Noise: {quiet.seconds:.0f} s, {quiet.steps} steps of three healthy nodes with "
            f"--evict-stragglers (window {args.window}), rank 0 evaluating alone every 10 "
            "steps, a 10 s save at step 30, every first step 10 s long: "
            f"{quiet.slow_events} slow event(s); worlds trained at: {quiet.worlds}."
        )


if __name__ == "__main__":
    main()

"""Startup: launch to the first training step, efdl vs torchrun side by side in one run.

- 2 nodes x 1 worker on 127.0.0.1 (`--min 1 --max 3` / `--nnodes 1:3`): both agents are
  started at once; the time is from their start to the first step at world size 2. torchrun
  (c10d) waits out its last-call window (30 s by default) whenever min < max nodes; efdl
  batches joins for `--settle` (1 s by default, 0.5 s in the recovery runs).
- `--standalone` with 2 workers: launch to the first step.

The same plain DDP script for torchrun, the efdl-aware one for efdl
(tests/e2e/scripts/steps.py and elastic_steps.py). Runs are interleaved.

Usage: python -m benchmarks.startup [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.recovery import (
    Launcher,
    Run,
    efdl_launcher,
    fmt,
    free_port,
    standalone_argv,
    torchrun_launcher,
)
from efdl.rendezvous.embedded import EmbeddedEtcd


def two_nodes(launcher: Launcher, tmp: Path) -> float | str:
    out = Path(tempfile.mkdtemp(dir=tmp))
    run = Run(launcher, out, {"STEP_SECONDS": "0.05"})
    try:
        t0 = run.start("a")
        run.start("b")
        try:
            rows = run.wait(lambda rs: any(r["world"] == 2 for r in rs), timeout_s=90)
        except TimeoutError:
            return "no step within 90 s"
        return min(float(r["t"]) for r in rows if r["world"] == 2) - t0  # type: ignore[arg-type]
    finally:
        run.stop()


def standalone(which: str, tmp: Path) -> float | str:
    out = Path(tempfile.mkdtemp(dir=tmp))
    env = {
        **os.environ,
        "OUT_DIR": str(out),
        "STEP_SECONDS": "0",
        "STEPS": "3",
        "EPOCHS": "1",
        "SAMPLES": "12",
    }
    argv = standalone_argv(which, 2)
    t0 = time.time()
    done = subprocess.run(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=300,
        check=False,
    )
    path = out / "events.jsonl"
    if done.returncode != 0 or not path.exists():
        return f"failed (exit {done.returncode})"
    first = min(json.loads(line)["t"] for line in path.read_text().splitlines())
    return float(first) - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="efdl-start-"))
    results: dict[str, list[float | str]] = {}
    with EmbeddedEtcd() as etcd:
        for _ in range(args.repeat):
            job = f"start-{uuid.uuid4().hex[:6]}"
            launchers = {
                "efdl (settle 1 s)": efdl_launcher(etcd.endpoint.target, job, settle=1.0),
                "torchrun default": torchrun_launcher(free_port(), job, False),
                "torchrun tuned": torchrun_launcher(free_port(), job, True),
            }
            for name, launcher in launchers.items():
                results.setdefault(name, []).append(two_nodes(launcher, tmp))
            for name in ("efdl", "torchrun"):
                results.setdefault(f"{name} --standalone", []).append(standalone(name, tmp))
    print(f"Launch to the first training step (s), median of {args.repeat} runs (min-max).\n")
    print("| launcher | 2 nodes x 1 worker (min 1, max 3) |")
    print("|---|---:|")
    for name in ("efdl (settle 1 s)", "torchrun default", "torchrun tuned"):
        print(f"| {name} | {fmt(results[name])} |")
    print("\n| launcher | --standalone, 2 workers |")
    print("|---|---:|")
    for name in ("efdl --standalone", "torchrun --standalone"):
        print(f"| {name} | {fmt(results[name])} |")
    e = [v for v in results["efdl --standalone"] if isinstance(v, float)]
    t = [v for v in results["torchrun --standalone"] if isinstance(v, float)]
    if e and t:
        print(
            f"\nefdl / torchrun (--standalone): {statistics.median(e) / statistics.median(t):.2f}"
        )


if __name__ == "__main__":
    main()

"""Startup of `--standalone`: launch to the first training step, efdl vs torchrun.

Two workers on one machine; the plain DDP script for torchrun, the efdl-aware one for efdl
(tests/e2e/scripts/steps.py and elastic_steps.py); runs interleaved. The two-node startup
comes from the recovery runs (benchmarks.recovery), which start such jobs anyway.

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
from pathlib import Path

from benchmarks.recovery import (
    fmt,
    standalone_argv,
)


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
    results: dict[str, list[float | str]] = {"efdl": [], "torchrun": []}
    for _ in range(args.repeat):
        for name in results:
            results[name].append(standalone(name, tmp))
    print(
        "`--standalone` with 2 workers on 127.0.0.1: from launching the command to the first "
        f"training step (s), median of {args.repeat} interleaved runs (min-max); both "
        "commands run the same model (the plain script under torchrun, the efdl-aware one "
        "under efdl).\n"
    )
    print("| efdl-run --standalone | torchrun --standalone | efdl / torchrun |")
    print("|---:|---:|---:|")
    e = [v for v in results["efdl"] if isinstance(v, float)]
    t = [v for v in results["torchrun"] if isinstance(v, float)]
    share = f"{statistics.median(e) / statistics.median(t):.2f}" if e and t else "-"
    print(f"| {fmt(results['efdl'])} | {fmt(results['torchrun'])} | {share} |")


if __name__ == "__main__":
    main()

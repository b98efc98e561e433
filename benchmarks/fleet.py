"""The fleet on this machine: a real run of ``efdl node`` daemons sharing stand-in GPUs.

Three ``efdl node`` daemons with stand-in NVML (4 GPUs each) and one etcd; a low- and a
normal-priority job train the digits example (benchmarks/digits_worker.py); a process that is
not efdl's takes a GPU; a high-priority job arrives, then ends. Measured: the time from the
foreign process's start to the GPU's agent gone (the GPU back to inference), steps lost, and
a figure of who held which GPU when (efdl.timeline.draw_fleet). Then, on an otherwise idle
host, how soon a GPU a foreign process takes is free and the job trains on without it.

The allocator's policy over a simulated day of a thousand jobs, against gang scheduling with
backfill, is benchmarks/fleet_sim.py.

Usage: python -m benchmarks.fleet [--no-real] [--gpu-back 3] [--figures docs/img]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from benchmarks.report import FIGURES, spread, verdict
from efdl.fleet.holdings import holdings
from efdl.fleet.records import Phase
from efdl.fleet.registry import read_events
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.timeline import draw_fleet
from tests.e2e.fleet_harness import Fleet, step_rows

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the real run


DIGITS = ROOT / "benchmarks" / "digits_worker.py"
KNOBS = {"STEP_SECONDS": "0.1", "EVAL_EVERY": "1000000", "EFDL_SETTLE": "0.5",
         "EFDL_LEASE_TTL": "3", "EFDL_WARM_WORKERS": "0", "EFDL_CACHE_EVERY": "0"}  # fmt: skip


def steps_lost(rows: list[dict[str, object]]) -> int:
    """Committed steps trained again: a step logged while a later one had been (step N + 1
    logged means N was committed)."""
    lost, top = 0, 0
    for r in rows:
        s = int(str(r["step"]))
        lost += max(0, top - s)
        top = max(top, s)
    return lost


@contextmanager
def _real_fleet() -> Iterator[Fleet]:
    tmp = Path(tempfile.mkdtemp(prefix="efdl-fleet-bench-"))
    server = EmbeddedEtcd()
    server.start()
    fleet = Fleet(server, tmp, resize_interval_s=5.0)
    try:
        yield fleet
    finally:
        fleet.close()
        server.stop()
        if os.environ.get("EFDL_BENCH_KEEP"):
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def real_run(figures: Path) -> list[str]:
    with _real_fleet() as fleet:
        for c in "abc":
            fleet.host(f"gpu-{c}.us-central1-a.c.fleet.internal", 4)
        marks: list[tuple[float, str]] = []
        low = _digits(fleet, "low", 2, 8, 0, epochs=500)
        normal = _digits(fleet, "normal", 2, 4, 50, epochs=500)
        fleet.wait(
            "low at 8 and normal at 4 workers",
            lambda: _world(low) == 8 and _world(normal) == 4,
            600,
        )
        time.sleep(10)
        host, indices = fleet.status("low").gpus[0]
        agent = psutil.Process(fleet.agent_on(host, indices[0]))
        workers = _workers(agent)
        t_foreign = time.time()
        fleet.foreign(host, indices[0], 4_000_001)  # inference takes a GPU of the low job
        marks.append((t_foreign, "inference takes a GPU"))
        fleet.wait(
            "the worker on the taken GPU to exit", lambda: not any(map(_alive, workers)), 120
        )
        back_s = time.time() - t_foreign
        fleet.wait("its agent to exit", lambda: not agent.is_running(), 120)
        agent_s = time.time() - t_foreign
        status_s = _status_change(fleet, "low", t_foreign)
        seen = len(step_rows(low))
        fleet.wait(
            "low training on at 7", lambda: len(step_rows(low)) > seen and _world(low) == 7, 300
        )
        time.sleep(10)
        t_high = time.time()
        high = _digits(fleet, "high", 4, 4, 100, epochs=4)
        marks.append((t_high, "a high-priority job arrives"))
        seen = len(step_rows(low))
        fleet.wait("the high job training", lambda: _world(high) == 4, 600)
        high_start = float(str(step_rows(high)[0]["t"])) - t_high
        fleet.wait(
            "low training on at 3", lambda: len(step_rows(low)) > seen and _world(low) == 3, 300
        )
        low_back = (
            float(str(next(r["t"] for r in step_rows(low)[seen:] if r["world"] == 3))) - t_high
        )
        fleet.wait(
            "the high job finished", lambda: fleet.status("high").phase is Phase.FINISHED, 900
        )
        marks.append((time.time(), "it ends"))
        seen = len(step_rows(low))
        fleet.wait(
            "low training on 7 GPUs again",
            lambda: len(step_rows(low)) > seen + 5 and _world(low) == 7,
            600,
        )
        time.sleep(10)
        events, _ = read_events(fleet.store, fleet.keys)
        held = holdings(events, time.time())
        path = draw_fleet(
            held, figures / "fleet-real.png", "three efdl node hosts x 4 stand-in GPUs", marks
        )
        runs = {"low": low, "normal": normal, "high": high}
        lost = {n: steps_lost(step_rows(o)) for n, o in runs.items()}
        sizes = {n: sorted({int(str(r["world"])) for r in step_rows(o)}) for n, o in runs.items()}
        resizes = {n: sum(1 for e in events if e.job_id == fleet.job_ids[n]) - 1 for n in runs}
    return [
        "| measured | value |",
        "|---|---|",
        "| a GPU back to inference: the foreign process in NVML -> the job's status without "
        f"that GPU | {status_s:.1f} s |",
        f"| ... -> the worker on that GPU gone (the GPU free) | {back_s:.1f} s |",
        f"| ... -> its agent gone | {agent_s:.1f} s |",
        f"| the high-priority job: arrival -> its first step at 4 workers | {high_start:.1f} s |",
        f"| ... -> the low job's first step at 3 workers (shrunk in place) | {low_back:.1f} s |",
        "| world sizes trained at (low, normal, high) | "
        + ", ".join(" ".join(map(str, sizes[n])) for n in runs)
        + " |",
        "| status changes (low, normal, high) | " + ", ".join(str(resizes[n]) for n in runs) + " |",
        "| committed steps lost (low, normal, high) | "
        + ", ".join(str(lost[n]) for n in runs)
        + " |",
        "",
        f"![who held which GPU when]({os.path.relpath(path, ROOT / 'docs')})",
    ]


def gpu_back(repeat: int) -> list[str]:
    """A GPU back to inference, measured apart from the busy real run: one host x 4 stand-in
    GPUs, the digits job on all 4 (nothing else on the machine's 2 cores); a foreign process
    takes one of its GPUs, then ends (the job grows back), ``repeat`` times."""
    runs: list[tuple[float, float, float, float]] = []
    with _real_fleet() as fleet:
        host = "gpu-a.us-central1-a.c.fleet.internal"
        fleet.host(host, 4)
        out = _digits(fleet, "job", 2, 4, 0, epochs=500)
        for _ in range(repeat):
            runs.append(_take_gpu(fleet, host, out))
            fleet.wait("the job back at 4", lambda: _world(out) == 4, 300)
    step, status, gone, shrunk = (list(v) for v in zip(*runs, strict=True))
    worst = max(g - s for g, s in zip(gone, step, strict=True))
    return [
        f"| measured, {repeat} times: median (min-max) | value |",
        "|---|---|",
        f"| the job's step (its workers' step time before) | {spread(step, 2)} s |",
        f"| the foreign process in NVML -> the job's status without that GPU | "
        f"{spread(status, 2)} s |",
        f"| ... -> the worker on that GPU gone (the GPU free) | {spread(gone, 2)} s |",
        f"| ... -> the job's first step at 3 workers | {spread(shrunk, 2)} s |",
        "",
        f"Goal: the GPU back within 2 s plus one step: {verdict(worst <= 2)} (at worst "
        f"{worst:.2f} s plus one step).",
    ]


def _take_gpu(fleet: Fleet, host: str, out: Path) -> tuple[float, float, float, float]:
    """A foreign process takes a GPU of the job training at 4 on ``host``, then ends: the
    job's step time before, and the seconds to its status without the GPU, to the worker
    on it gone, to the job's first step at 3."""
    seen = len(step_rows(out))
    fleet.wait(
        "the job training at 4", lambda: len(step_rows(out)) > seen + 20 and _world(out) == 4
    )
    gpu = fleet.status("job").gpus[0][1][0]
    shell = psutil.Process(fleet.agent_on(host, gpu))
    workers = _workers(shell)
    times = sorted({float(str(r["t"])) for r in step_rows(out)[-40:]})
    step = statistics.median(b - a for a, b in itertools.pairwise(times) if b - a > 0.01)
    t0 = time.time()
    fleet.foreign(host, gpu, 4_000_002)
    fleet.wait("the worker on the taken GPU to exit", lambda: not any(map(_alive, workers)), 120)
    gone = time.time() - t0
    fleet.wait("the job training at 3", lambda: _world(out) == 3, 120)
    first = min(
        float(str(r["t"])) for r in step_rows(out) if r["world"] == 3 and float(str(r["t"])) > t0
    )
    fleet.foreign(host, gpu, None)
    return step, _status_change(fleet, "job", t0), gone, first - t0


def _workers(shell: psutil.Process) -> list[psutil.Process]:
    """The digits workers under an agent's shell (its children are efdl-run, ``python -c
    ...``, and under it the worker: the script is on both command lines)."""
    return [
        p
        for p in shell.children(recursive=True)
        if "digits_worker" in " ".join(p.cmdline()) and p.cmdline()[1:2] != ["-c"]
    ]


def _status_change(fleet: Fleet, name: str, since: float) -> float:
    """Seconds from ``since`` to job ``name``'s first status change after it (its event)."""
    events, _ = read_events(fleet.store, fleet.keys, since=since)
    return min(e.time for e in events if e.job_id == fleet.job_ids[name]) - since


def _digits(fleet: Fleet, name: str, lo: int, hi: int, priority: int, epochs: int) -> Path:
    """Submit the digits example as job ``name``, with a cache; its output directory."""
    env = {**KNOBS, "EPOCHS": str(epochs)}
    return fleet.submit(name, lo, hi, priority, True, (str(DIGITS),), ROOT, env)


def _alive(p: psutil.Process) -> bool:
    """Running (a worker that exited but is not reaped yet is gone: its GPU is free)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _world(out: Path) -> int:
    """The world size of the job's newest step (0 before its first)."""
    rows = step_rows(out)
    return int(str(rows[-1]["world"])) if rows else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-real", action="store_true")
    parser.add_argument(
        "--gpu-back", type=int, default=3, help="Times a GPU is taken apart from the real run."
    )
    parser.add_argument("--figures", type=Path, default=FIGURES)
    args = parser.parse_args()
    lines: list[str] = []
    if not args.no_real:
        lines += ["### A real run: three efdl node hosts x 4 stand-in GPUs, the digits example", ""]
        lines += real_run(args.figures)
    if args.gpu_back:
        lines += ["", "### A GPU back to inference, on an otherwise idle host", ""]
        lines += gpu_back(args.gpu_back)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

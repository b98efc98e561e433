"""FSDP2 in place: the GPT example (examples/gpt) under efdl against torchrun, side by side.

- **steady state**: 2 workers on one node (``--standalone``), median step time of rank 0,
  efdl (train_efdl.py), efdl with peer copies of every commit (``--peer-copies 1``) and of
  every 10th (``--peer-copies 10``), and torchrun (train_torchrun.py) interleaved, none
  checkpointing otherwise; and the peak resident memory of each job's processes together;
- **events**: a job of 2 nodes, one worker each (real etcd for efdl, c10d for torchrun at its
  best tuning), meets a join (a third node), a graceful leave (SIGTERM to one agent) or a
  node SIGKILL. efdl lays the shards out anew in place and resumes a crash from its peer
  copies (``--peer-copies 1``: each rank's snapshot in its own and another node's worker's
  memory, whenever the writer is free) or from its remote cache (``--cache-url``, a snapshot
  whenever the writer is free), each in its own run; torchrun restarts every
  worker, which reload the DCP checkpoint it saves every 5 steps (its best practice; the
  checkpoint's cost is not in the steady state). *Stood still*: from the last step logged at
  2 workers to the first at the new size (a step is logged as it ends: this counts that
  first step's own time too); *back*: to the first step past the last one trained before
  the event (the steps lost, trained again, counted in); *lost*: how many steps were
  trained again. Each event comes at a point of a step drawn at random (seeded), not as a
  step ends. A run with no step past the old one within 180 s did not recover;
- **churn**: the loss of a run whose workers go 2 -> 4 -> 3 -> 4 against fixed runs of 2 and 4
  workers, by samples seen, in a figure.

Usage: python -m benchmarks.fsdp [--sizes 25,100,300] [--repeat 2] [--event-sizes 25,100]
       [--events join,leave,node] [--launchers NAME,...] [--churn-size 25] [--no-churn]
       [--no-steady]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

from benchmarks.recovery import Launcher, Rows, Run, efdl_launcher, free_port, torchrun_launcher
from benchmarks.report import pyplot, save, spread
from efdl.rendezvous.embedded import EmbeddedEtcd

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt"
EFDL_SCRIPT, TORCHRUN_SCRIPT = GPT / "train_efdl.py", GPT / "train_torchrun.py"
# millions of parameters -> (layers, width, batch per worker); context 64, 8 heads
SIZES = {25: (6, 576, 2), 100: (12, 832, 1), 300: (24, 1024, 1)}
SAVE_EVERY = 5  # torchrun's DCP checkpoint, in steps
PLACE = random.Random(58)  # where in a step each event comes


def script_args(size: int, steps: int = 0, checkpoint: Path | None = None) -> list[str]:
    layers, width, batch = SIZES[size]
    args = ["--layers", str(layers), "--width", str(width), "--heads", "8", "--context", "64"]
    args += ["--batch", str(batch), "--data-mb", "2", "--log-every", "1", "--steps", str(steps)]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint), "--save-every", str(SAVE_EVERY)]
    return args


def lines(paths: list[Path]) -> Rows:
    """The JSON lines rank 0 printed (one per step), from the agents' logs."""
    rows: Rows = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            at = line.find('{"step"')
            if at >= 0:
                with contextlib.suppress(ValueError):
                    rows.append(json.loads(line[at:]))
    return sorted(rows, key=lambda r: float(r["t"]))  # type: ignore[arg-type]


class LogRun(Run):
    """A job whose steps are read from its agents' logs."""

    def rows(self) -> Rows:
        return lines(sorted(self.out.glob("*.log")))


# ---------------------------------------------------------------- steady state


STEADY = ("torchrun", "efdl", "efdl, peer copies", "efdl, peer copies every 10")


def steady(launcher: str, size: int, steps: int, tmp: Path) -> tuple[float, float]:
    """Median step time of rank 0 in s, 2 workers on one node; and the peak resident memory
    of the job's processes together (GB, sampled every 0.2 s)."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    if launcher.startswith("efdl"):
        argv = [
            sys.executable,
            "-c",
            "from efdl.cli.run import run_main; run_main()",
            "--standalone",
        ]
        argv += ["--job-id", f"fsdp-{uuid.uuid4().hex[:6]}", "--nproc-per-node", "2"]
        if launcher.startswith("efdl, peer copies"):
            argv += ["--peer-copies", "10" if launcher.endswith("every 10") else "1"]
        argv += [str(EFDL_SCRIPT)]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc-per-node", "2", str(TORCHRUN_SCRIPT)]
    log = out / "run.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*argv, *script_args(size, steps)], stdout=f, stderr=subprocess.STDOUT
        )
        peak = 0
        deadline = time.monotonic() + 1800
        while proc.poll() is None and time.monotonic() < deadline:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        if proc.wait() != 0:
            raise RuntimeError(f"{launcher} ended with {proc.returncode}: see {log}")
    times = [float(r["t"]) for r in lines([log])]  # type: ignore[arg-type]
    skip = max(2, len(times) // 5)  # warm-up
    step = statistics.median(b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False))
    return step, peak / 1e9


def tree_rss(pid: int) -> int:
    """The resident memory of ``pid`` and its descendants, in bytes (0 if it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


# ---------------------------------------------------------------- events


def launchers(size: int, etcd: str, tmp: Path) -> dict[str, Callable[[], Launcher]]:
    def peers() -> Launcher:
        return efdl_launcher(
            etcd,
            f"fsdp-{uuid.uuid4().hex[:6]}",
            script=EFDL_SCRIPT,
            grace=60,
            extra=["--peer-copies", "1"],
            script_args=script_args(size),
        )

    def efdl() -> Launcher:
        cache = Path(tempfile.mkdtemp(dir=tmp)) / "cache"
        extra = ["--cache-url", str(cache), "--cache-every-steps", "1", "--cache-every", "0"]
        return efdl_launcher(
            etcd,
            f"fsdp-{uuid.uuid4().hex[:6]}",
            script=EFDL_SCRIPT,
            grace=60,
            extra=extra,
            script_args=script_args(size),
        )

    def torchrun() -> Launcher:
        checkpoint = Path(tempfile.mkdtemp(dir=tmp)) / "dcp"
        return torchrun_launcher(
            free_port(),
            f"fsdp-{uuid.uuid4().hex[:6]}",
            tuned=True,
            script=TORCHRUN_SCRIPT,
            script_args=script_args(size, checkpoint=checkpoint),
        )

    return {
        "efdl + peer copies": peers,
        "efdl + remote cache": efdl,
        "torchrun tuned (DCP)": torchrun,
    }


RECOVER_S = 180.0  # a run with no step past the old one at the new size by then: failed


def recovered(run: LogRun, pred: Callable[[Rows], bool], timeout_s: float) -> Rows | None:
    """The rows once ``pred`` holds; None if it does not within ``timeout_s`` or every agent
    has exited (torchrun's agents all stop when the node hosting their c10d store leaves)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = run.rows()
        if pred(rows):
            return rows
        if all(p.poll() is not None for p in run.procs.values()):
            return None
        time.sleep(0.1)
    return None


def event_run(launcher: Launcher, event: str, tmp: Path) -> dict[str, float] | str:
    """One event on a 2-node job: seconds stood still and back, and steps lost; or why it
    did not recover."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    run = LogRun(launcher, out, {"OMP_NUM_THREADS": "1"})
    target = {"join": 3, "leave": 1, "node": 1}[event]
    try:
        run.start("a")
        run.start("b")
        rows = run.wait(lambda rs: sum(1 for r in rs if r["world"] == 2) >= SAVE_EVERY + 2, 900)
        # The event at a point of a step drawn at random (seeded), not just as one ends:
        # a crash right after a commit meets a snapshot of that step still being written.
        stamps = sorted(float(r["t"]) for r in rows if r["world"] == 2)  # type: ignore[arg-type]
        step_s = statistics.median(b - a for a, b in itertools.pairwise(stamps))
        time.sleep(PLACE.uniform(0, step_s))
        t0 = time.time()
        if event == "join":
            run.start("c")
        elif event == "leave":
            run.procs["b"].send_signal(signal.SIGTERM)
        else:
            run.kill_node("b")

        def back(rs: Rows) -> bool:
            new = [r for r in rs if r["world"] == target]
            last = max((int(r["step"]) for r in rs if r["world"] == 2), default=0)  # type: ignore[call-overload]
            return any(int(r["step"]) > last for r in new)  # type: ignore[call-overload]

        rows = recovered(run, back, RECOVER_S)
        if rows is None:
            return f"did not recover in {RECOVER_S:.0f} s"
        last = max(int(r["step"]) for r in rows if r["world"] == 2)  # type: ignore[call-overload]
        before = max(float(r["t"]) for r in rows if r["world"] == 2)  # type: ignore[arg-type]
        new = [r for r in rows if r["world"] == target]
        first = min(new, key=lambda r: float(r["t"]))  # type: ignore[arg-type]
        past = min(float(r["t"]) for r in new if int(r["step"]) > last)  # type: ignore[arg-type, call-overload]
        return {
            "stood": float(first["t"]) - before,  # type: ignore[arg-type]
            "back": past - before,
            "lost": float(last - (int(first["step"]) - 1)),  # type: ignore[call-overload]
            "event": float(first["t"]) - t0,  # type: ignore[arg-type]
        }
    finally:
        run.stop()


def cell(results: list[dict[str, float] | str], key: str, digits: int = 2) -> str:
    """The median (range) of the runs that recovered, and how many did not."""
    done = [r[key] for r in results if not isinstance(r, str)]
    failed = len(results) - len(done)
    text = spread(done, digits) if done else "-"
    return text + (f"; {failed} of {len(results)} did not recover" if failed else "")


# ---------------------------------------------------------------- churn


def churn_run(
    size: int, steps: int, schedule: list[tuple[int, str, str]], etcd: str, tmp: Path
) -> Rows:
    """An efdl job of up to 4 one-worker nodes; ``schedule``: (step, "start"|"stop", node)."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    launcher = efdl_launcher(
        etcd,
        f"churn-{uuid.uuid4().hex[:6]}",
        max_nodes=4,
        min_nodes=2,
        script=EFDL_SCRIPT,
        grace=60,
        script_args=script_args(size, steps),
    )
    run = LogRun(launcher, out, {"OMP_NUM_THREADS": "1"})
    try:
        run.start("a")
        run.start("b")
        for at, action, node in schedule:
            run.wait(lambda rs, at=at: any(int(r["step"]) >= at for r in rs), 1800)  # type: ignore[misc, call-overload]
            if action == "start":
                run.start(node)
            else:
                run.procs[node].send_signal(signal.SIGTERM)
        run.wait(lambda rs: any(int(r["step"]) >= steps for r in rs), 3600)  # type: ignore[call-overload]
        return run.rows()
    finally:
        run.stop()


def fixed_run(size: int, steps: int, nproc: int, tmp: Path) -> Rows:
    out = Path(tempfile.mkdtemp(dir=tmp))
    log = out / "run.log"
    argv = [sys.executable, "-c", "from efdl.cli.run import run_main; run_main()", "--standalone"]
    argv += ["--job-id", f"fixed-{uuid.uuid4().hex[:6]}", "--nproc-per-node", str(nproc)]
    with open(log, "wb") as f:
        subprocess.run(
            [*argv, str(EFDL_SCRIPT), *script_args(size, steps)],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=3600,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    return lines([log])


def by_samples(rows: Rows, batch: int) -> tuple[list[float], list[float]]:
    """(samples seen, loss) per step, each step's samples = batch x its world size."""
    seen, xs, ys = 0, [], []
    steps: dict[int, dict[str, object]] = {}
    for r in rows:  # a step trained again after a resume counts once, its last time
        steps[int(r["step"])] = r  # type: ignore[call-overload]
    for step in sorted(steps):
        r = steps[step]
        seen += batch * int(r["world"])  # type: ignore[call-overload]
        xs.append(float(seen))
        ys.append(float(r["loss"]))  # type: ignore[arg-type]
    return xs, ys


def smooth(ys: list[float], k: int = 9) -> list[float]:
    return [statistics.mean(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]


def churn_section(size: int, steps: int, etcd: str, tmp: Path) -> None:
    q = steps // 4
    schedule = [(q, "start", "c"), (q, "start", "d"), (2 * q, "stop", "d"), (3 * q, "start", "e")]
    runs = {
        "churn 2 -> 4 -> 3 -> 4": churn_run(size, steps, schedule, etcd, tmp),
        "fixed 2": fixed_run(size, steps, 2, tmp),
        "fixed 4": fixed_run(size, steps, 4, tmp),
    }
    batch = SIZES[size][2]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    print(f"\n### Loss with churn ({size}M, {steps} steps, batch {batch} per worker)\n")
    print("| run | worlds seen | samples | last loss (mean of last 10 steps) |")
    print("|---|---|---|---|")
    for name, rows in runs.items():
        xs, ys = by_samples(rows, batch)
        worlds = " -> ".join(
            str(w)
            for i, w in enumerate(r["world"] for r in rows)
            if i == 0 or w != rows[i - 1]["world"]
        )
        print(f"| {name} | {worlds} | {int(xs[-1])} | {statistics.mean(ys[-10:]):.3f} |")
        ax.plot(xs, smooth(ys), label=name)
    ax.set_xlabel("samples seen")
    ax.set_ylabel("training loss (mean of 9 steps)")
    ax.legend()
    print()
    print(save(fig, "fsdp_churn.png", f"GPT {size}M: loss with churn against fixed runs"))


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="25,100,300")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steady-steps", type=int, default=0, help="0: by size")
    ap.add_argument("--event-sizes", default="25,100")
    ap.add_argument("--events", default="join,leave,node")
    ap.add_argument(
        "--launchers",
        default="",
        help="comma-separated names of the events' launchers to run (default: all)",
    )
    ap.add_argument("--event-repeat", type=int, default=1)
    ap.add_argument("--churn-size", type=int, default=25)
    ap.add_argument("--churn-steps", type=int, default=160)
    ap.add_argument("--no-churn", action="store_true")
    ap.add_argument("--no-steady", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="efdl-fsdp-") as tmp_dir:
        tmp = Path(tmp_dir)
        print(__doc__.split("Usage:")[0])
        if not args.no_steady:
            print("### Steady state: median step time (s), 2 workers, no checkpoint\n")
            print(
                "| params | torchrun | efdl | efdl, peer copies | efdl, peer copies every 10 "
                "| efdl / torchrun | peer copies / torchrun | every 10 / torchrun "
                "| peak memory (GB): torchrun, efdl, peer copies, every 10 |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
        for size in sizes if not args.no_steady else []:
            steps = args.steady_steps or {25: 40, 100: 20, 300: 12}[size]
            got: dict[str, list[float]] = {name: [] for name in STEADY}
            memory: dict[str, list[float]] = {name: [] for name in STEADY}
            for _ in range(args.repeat):
                for launcher in STEADY:
                    step, peak = steady(launcher, size, steps, tmp)
                    got[launcher].append(step)
                    memory[launcher].append(peak)
            base = got["torchrun"]
            ratio = {n: [e / t for e, t in zip(got[n], base, strict=True)] for n in STEADY[1:]}
            peaks = ", ".join(f"{max(memory[n]):.1f}" for n in STEADY)
            print(
                f"| {size}M | {' | '.join(spread(got[n], 3) for n in STEADY)} "
                f"| {' | '.join(spread(ratio[n], 3) for n in STEADY[1:])} "
                f"| {peaks} |",
                flush=True,
            )
        with EmbeddedEtcd() as etcd:
            events = [e for e in args.events.split(",") if e]
            print("\n### Events: 2 nodes, one worker each (s; lost: steps trained again)\n")
            print("| params | event | launcher | stood still | back where it was | lost |")
            print("|---|---|---|---|---|---|")
            for size in (int(s) for s in args.event_sizes.split(",") if s):
                makers = launchers(size, etcd.endpoint.target, tmp)
                chosen = [n.strip() for n in args.launchers.split(",") if n.strip()]
                makers = {n: m for n, m in makers.items() if not chosen or n in chosen}
                for event in events:
                    results: dict[str, list[dict[str, float] | str]] = {n: [] for n in makers}
                    for _ in range(args.event_repeat):
                        for name, make in makers.items():
                            results[name].append(event_run(make(), event, tmp))
                    for name, rs in results.items():
                        print(
                            f"| {size}M | {event} | {name} | {cell(rs, 'stood')} "
                            f"| {cell(rs, 'back')} | {cell(rs, 'lost', 0)} |",
                            flush=True,
                        )
            if not args.no_churn:
                churn_section(args.churn_size, args.churn_steps, etcd.endpoint.target, tmp)


if __name__ == "__main__":
    main()

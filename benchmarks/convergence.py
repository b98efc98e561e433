"""Convergence under churn: does training that loses and gains workers end where fixed-size
training ends?

The digits example (benchmarks/digits_worker.py: the example's data, model and optimizer,
with a fixed global batch) trains for a fixed number of epochs three ways, for each seed:
(a) 4 workers throughout (`efdl-run --standalone --nproc-per-node 4`);
(b) 4 nodes of 1 worker (`efdl-run --min 2 --max 4`, real etcd) meeting a schedule: a node
    leaves (SIGTERM), a node crashes (agent and worker SIGKILLed), then two nodes join:
    4 -> 3 -> 2 -> 4 workers, rebuilt in place each time;
(c) 2 workers throughout.
Every step trains on the same global batch (an ElasticBatchSampler: the world size changes
each rank's share, not the step), so the three see the same samples in the same order and
differ only in how gradients are summed and in the steps a crash makes them train again.
The churn run sleeps STEP_SECONDS per step so that its schedule happens within the run.

Usage: python -m benchmarks.convergence [--seeds 3] [--epochs 12]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.recovery import Rows, Run, efdl_launcher, standalone_argv
from benchmarks.report import FIGURES, pyplot, save, spread, verdict
from efdl.rendezvous.embedded import EmbeddedEtcd

WORKER = Path(__file__).resolve().parent / "digits_worker.py"
TRAIN_SAMPLES = 1437  # examples/digits: 1797 images, 360 held out for the test set
CONFIGS = ("(a) fixed 4", "(b) churn 2-4", "(c) fixed 2")
CHURN_STEP_SECONDS = 0.1


@dataclass
class Outcome:
    config: str
    seed: int
    rows: Rows
    events: list[tuple[float, str]] = field(default_factory=list)
    seconds: float = 0.0

    def evals(self) -> dict[int, dict[str, float]]:
        """The last evaluation at each number of samples seen (a crash may repeat steps)."""
        return {int(r["samples"]): r for r in self.rows if r.get("eval")}  # type: ignore[call-overload, misc]

    def final(self) -> dict[str, float]:
        done = [r for r in self.rows if r.get("done")]
        if not done:
            raise RuntimeError(f"{self.config} seed {self.seed}: the run did not finish")
        return done[-1]  # type: ignore[return-value]

    def steps(self) -> Rows:
        return [r for r in self.rows if "step" in r and not r.get("done")]

    def repeated(self) -> int:
        """Steps trained more than once (rolled back by a crash)."""
        steps = [int(r["step"]) for r in self.steps()]  # type: ignore[call-overload]
        return len(steps) - len(set(steps))


def read_rows(out: Path) -> Rows:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def common_env(seed: int, epochs: int, out: Path) -> dict[str, str]:
    return {"SEED": str(seed), "EPOCHS": str(epochs), "GLOBAL_BATCH": "48", "OUT_DIR": str(out)}


def fixed(workers: int, seed: int, epochs: int, tmp: Path) -> Outcome:
    out = Path(tempfile.mkdtemp(dir=tmp))
    t0 = time.monotonic()
    subprocess.run(
        standalone_argv("efdl", workers, WORKER),
        env={**os.environ, **common_env(seed, epochs, out)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=600,
        check=True,
    )
    name = CONFIGS[0] if workers == 4 else CONFIGS[2]
    return Outcome(name, seed, read_rows(out), seconds=time.monotonic() - t0)


def world_now(rows: Rows) -> int:
    steps = [r for r in rows if "world" in r]
    return int(steps[-1]["world"]) if steps else 0  # type: ignore[call-overload]


def last_step(rows: Rows) -> int:
    return max((int(r["step"]) for r in rows if "step" in r), default=0)  # type: ignore[call-overload]


def churn(etcd: str, seed: int, epochs: int, tmp: Path) -> Outcome:
    out = Path(tempfile.mkdtemp(dir=tmp))
    job = f"churn-{uuid.uuid4().hex[:6]}"
    # Lease TTL 5 s: 8 processes on 2 cores can keep etcd from answering a refresh for 3 s.
    launcher = efdl_launcher(
        etcd, job, settle=1.0, max_nodes=4, min_nodes=2, script=WORKER, lease_ttl=5
    )
    env = {**common_env(seed, epochs, out), "STEP_SECONDS": str(CHURN_STEP_SECONDS)}
    run = Run(launcher, out, env)
    total = epochs * -(-TRAIN_SAMPLES // 48)
    leave: Callable[[], object] = lambda: run.procs["d"].send_signal(signal.SIGTERM)  # noqa: E731
    schedule: list[tuple[float, str, Callable[[], object], int]] = [
        (0.10, "d leaves (SIGTERM)", leave, 3),
        (0.20, "c crashes (SIGKILL)", lambda: run.kill_node("c"), 2),
        (0.35, "e and f join", lambda: (run.start("e"), run.start("f")), 4),
    ]
    events: list[tuple[float, str]] = []
    t0 = time.monotonic()
    try:
        for node in "abcd":
            run.start(node)
        run.wait(lambda rs: world_now(rs) == 4)
        for frac, label, act, world in schedule:
            run.wait(lambda rs, frac=frac: last_step(rs) >= frac * total)  # type: ignore[misc]
            t = time.time()
            act()
            events.append((t, label))
            run.wait(
                lambda rs, w=world, t=t: any(r.get("world") == w and float(r["t"]) > t for r in rs)
            )  # type: ignore[arg-type, misc]
        run.wait(lambda rs: any(r.get("done") for r in rs), timeout_s=300)
        for name, proc in run.procs.items():
            if name not in ("c", "d"):
                proc.wait(60)  # every agent ends when the job is done
        return Outcome(CONFIGS[1], seed, run.rows(), events, time.monotonic() - t0)
    finally:
        run.stop()


def plot_convergence(outcomes: list[Outcome]) -> str:
    plt = pyplot()
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for config, color in zip(CONFIGS, ("tab:blue", "tab:red", "tab:green"), strict=True):
        runs = [o.evals() for o in outcomes if o.config == config]
        xs = sorted(set.intersection(*(set(r) for r in runs)))
        for key, ax in (("train_loss", loss_ax), ("accuracy", acc_ax)):
            ys = [[r[x][key] for r in runs] for x in xs]
            ax.plot(xs, [statistics.median(y) for y in ys], color=color, label=config)
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=color, alpha=0.2)
    loss_ax.set(xlabel="samples seen", ylabel="loss on the training set", yscale="log")
    acc_ax.set(xlabel="samples seen", ylabel="test accuracy", ylim=(0.8, 1.0))
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"digits, global batch 48: median and min-max over {len(runs)} seeds")
    return save(fig, "convergence.png", "loss and accuracy against samples seen")


def plot_timeline(o: Outcome) -> str:
    plt = pyplot()
    steps = o.steps()
    start = min(float(r["t"]) for r in steps)  # type: ignore[arg-type]
    ts = [float(r["t"]) - start for r in steps]  # type: ignore[arg-type]
    fig, (world_ax, rate_ax) = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    world_ax.step(ts, [int(r["world"]) for r in steps], where="post")  # type: ignore[call-overload]
    world_ax.set(ylabel="world size", ylim=(0, 5))
    width = 1.0
    bins = [0] * (int(max(ts) / width) + 1)
    for t in ts:
        bins[int(t / width)] += 1
    rate_ax.plot(
        [i * width for i in range(len(bins))], [b / width for b in bins], drawstyle="steps-post"
    )
    rate_ax.set(xlabel="seconds since the first step", ylabel="steps/s (1 s bins)")
    for i, (t, label) in enumerate(o.events):
        for ax in (world_ax, rate_ax):
            ax.axvline(t - start, color="tab:red", linestyle="--", alpha=0.6)
        world_ax.annotate(label, (t - start, 4.55 - 0.45 * (i % 2)), fontsize=8, ha="left")
    for ax in (world_ax, rate_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(f"one churn run (seed {o.seed}): efdl rebuilding in place")
    return save(fig, "churn_timeline.png", "world size, steps/s and events of one churn run")


def event_effects(o: Outcome) -> list[tuple[str, float, float]]:
    """Per event: seconds to the first step at the new world size, and the longest gap
    between steps (training standing still) around it."""
    steps = o.steps()
    effects = []
    for i, (t, label) in enumerate(o.events):
        end = o.events[i + 1][0] if i + 1 < len(o.events) else float("inf")
        before = [r for r in steps if float(r["t"]) <= t]  # type: ignore[arg-type]
        after = [r for r in steps if t < float(r["t"]) < end]  # type: ignore[arg-type]
        world = int(before[-1]["world"]) if before else 0  # type: ignore[call-overload]
        changed = [float(r["t"]) for r in after if int(r["world"]) != world]  # type: ignore[arg-type, call-overload]
        times = [float(before[-1]["t"])] if before else []  # type: ignore[arg-type]
        times += [float(r["t"]) for r in after]  # type: ignore[arg-type]
        gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
        effects.append((label, (min(changed) - t) if changed else float("nan"), gap))
    return effects


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=12)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="efdl-conv-"))
    outcomes: list[Outcome] = []
    with EmbeddedEtcd() as etcd:
        for seed in range(args.seeds):
            outcomes.append(fixed(4, seed, args.epochs, tmp))
            outcomes.append(churn(etcd.endpoint.target, seed, args.epochs, tmp))
            outcomes.append(fixed(2, seed, args.epochs, tmp))
    print(_description(args))
    print(
        "| run | final test accuracy (%) | per seed | final training loss "
        "| steps trained again | wall time (s) |"
    )
    print("|---|---:|---|---:|---:|---:|")
    finals: dict[str, list[float]] = {}
    for config in CONFIGS:
        mine = [o for o in outcomes if o.config == config]
        acc = [o.final()["accuracy"] for o in mine]
        finals[config] = acc
        print(
            f"| {config} | {spread(acc, 2, 100)} | "
            f"{', '.join(f'{a * 100:.2f}' for a in acc)} | "
            f"{spread([o.final()['train_loss'] for o in mine], 4)} | "
            f"{sum(o.repeated() for o in mine)} | {spread([o.seconds for o in mine], 0)} |"
        )
    others = finals[CONFIGS[0]] + finals[CONFIGS[2]]
    low, high = min(others), max(others)
    inside = all(low <= a <= high for a in finals[CONFIGS[1]])
    pairs = zip(finals[CONFIGS[0]], finals[CONFIGS[1]], strict=True)
    largest = max(abs(b - a) for a, b in pairs)
    print(
        f"\nGoal: every churn run ends within the seed-to-seed spread of the fixed runs "
        f"({low * 100:.2f}-{high * 100:.2f}% test accuracy): {verdict(inside)}. "
        "Per seed, the largest difference in final accuracy between the churn run and the "
        f"fixed-4 run: {largest * 100:.2f} points.\n"
    )
    print(plot_convergence(outcomes) + "\n")
    first = next(o for o in outcomes if o.config == CONFIGS[1])
    print("The schedule of one churn run, as it happened:\n")
    print(
        "| event | to the first step at the new world size (s) | longest pause between steps (s) |"
    )
    print("|---|---:|---:|")
    for label, took, gap in event_effects(first):
        print(f"| {label} | {took:.2f} | {gap:.2f} |")
    print()
    print(plot_timeline(first))


def _description(args: argparse.Namespace) -> str:
    return (
        f"{args.seeds} seeds x 3 runs of {args.epochs} epochs of the digits example "
        f"({TRAIN_SAMPLES} training images, 360 test images), global batch 48 on every run, "
        "SGD lr 0.05 momentum 0.9. (a) 4 workers, (c) 2 workers, both `--standalone`; (b) 4 "
        "nodes of 1 worker with `--min 2 --max 4` meeting a schedule at 10/20/35% of the "
        "steps: a node leaves (SIGTERM), a node crashes (SIGKILL of its agent and worker), "
        "two nodes join (4 -> 3 -> 2 -> 4 workers). The three see "
        "the same samples in the same order (the global batch is fixed; the world size only "
        "changes each rank's share). The churn run sleeps "
        f"{CHURN_STEP_SECONDS} s per step so its schedule happens within the run; "
        f"figures are written to {FIGURES.relative_to(FIGURES.parents[1])}/.\n"
    )


if __name__ == "__main__":
    main()

"""What a control-plane outage costs training: efdl now, efdl before issue 34, and TorchFT.

Each run starts, side by side: an efdl-aware job in place and a plain script in restart mode
(two nodes each, one worker per node, lease TTL 3 s), the same efdl-aware job under efdl as
it was before the control plane left the training path (``--before``, a git ref, run from a
worktree; no cache, as in the issue's report), and a TorchFT job of two replica groups (one
worker each) on its own lighthouse. Then the fault, for ``--outage`` seconds, to etcd and
(where TorchFT has the same part) to the lighthouse. For each job: the longest time it stood
still (between two steps of rank 0, from the fault to 20 s after it ended), the share of the
steps it would have trained meanwhile that it did train, the workers it restarted, and the
committed steps it lost (trained again, or gone: a job that came back from step 0).

Usage: python -m benchmarks.outage [--outage 60] [--repeat 2] [--faults hung,killed,...]
       [--before 52f2202]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.recovery import Launcher, Lighthouse, Run, efdl_launcher, torchft_launcher
from benchmarks.report import spread
from efdl.rendezvous.embedded import EmbeddedEtcd, EtcdCluster
from tests.integration.test_etcd_cluster import leader_of

ROOT = Path(__file__).resolve().parents[1]
STEP_S = 0.1
AFTER_S = 20.0  # how long after the outage the jobs are watched
Rows = list[dict[str, object]]
FAULTS = {
    "hung": "the only etcd member SIGSTOPped (TorchFT: its lighthouse)",
    "killed": "the only etcd member SIGKILLed, started again on its data after the outage "
    "(TorchFT: its lighthouse, a new one)",
    "quorum": "a 3-member etcd without quorum (2 members SIGSTOPped, the raft leader among "
    "them); TorchFT's lighthouse is a single process: no such fault",
    "leader": "the raft leader of a 3-member etcd 3.5.1 SIGSTOPped for 12 s (it revokes the "
    "leases when it resumes); no such fault for TorchFT",
}


@dataclass
class Outcome:
    still_s: float
    trained: float  # share of the steps expected during the outage
    restarted: int  # workers that were not there before the fault
    lost: int  # committed steps trained again or gone
    came_back: bool  # trained again within AFTER_S of the outage's end


def measure(rows: Rows, before_pids: set[object], t0: float, t1: float) -> Outcome:
    """From one job's rows (rank 0's), around an outage from ``t0`` to ``t1``."""
    mine = sorted((r for r in rows if r.get("rank") == 0), key=lambda r: float(r["t"]))  # type: ignore[arg-type]
    stamps = [float(r["t"]) for r in mine]  # type: ignore[arg-type]
    earlier = [t for t in stamps if t0 - 10 <= t < t0]
    rate = (len(earlier) - 1) / (earlier[-1] - earlier[0]) if len(earlier) > 2 else 1 / STEP_S
    around = [t0, *[t for t in stamps if t0 < t <= t1 + AFTER_S]]
    came_back = around[-1] > t1
    if around[-1] < t1 + AFTER_S - 2:  # stopped, and not training at the end of the watch
        around.append(t1 + AFTER_S)
    still = max(b - a for a, b in itertools.pairwise(around))
    during = sum(1 for t in stamps if t0 < t <= t1)
    top = max((int(r["step"]) for r in mine if float(r["t"]) < t0), default=0)  # type: ignore[arg-type, call-overload]
    after = [int(r["step"]) for r in mine if float(r["t"]) >= t0]  # type: ignore[call-overload, arg-type]
    lost = max(0, top - min(after) + 1) if after else 0
    restarted = len({r["pid"] for r in rows if float(r["t"]) >= t0} - before_pids)  # type: ignore[arg-type]
    trained = min(1.0, during / max(1.0, rate * (t1 - t0)))
    return Outcome(still, trained, restarted, lost, came_back)


@contextlib.contextmanager
def before_tree(ref: str) -> Iterator[Path | None]:
    """A worktree of efdl at ``ref`` (None where there is no git repository)."""
    path = Path(tempfile.mkdtemp(prefix="efdl-before-"))
    made = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), ref],
        capture_output=True,
        check=False,
    )
    try:
        yield path if made.returncode == 0 else None
    finally:
        if made.returncode == 0:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False
            )
        shutil.rmtree(path, ignore_errors=True)


def old_efdl(tree: Path, etcd: str, job: str) -> Launcher:
    """The efdl-aware job under efdl as it is in ``tree`` (its own script). The agent's
    ``-c`` would import efdl from the working directory first: it puts ``tree`` first
    itself; its workers find efdl through PYTHONPATH."""
    script = tree / "tests" / "e2e" / "scripts" / "elastic_steps.py"
    base = efdl_launcher(etcd, job, script=script)
    first = f"import sys; sys.path.insert(0, {str(tree)!r}); "

    def cmd(node: str, i: int) -> list[str]:
        argv = base.command(node, i)
        return [argv[0], "-c", first + argv[2], *argv[3:]]

    env = {"PYTHONPATH": str(tree)}
    return Launcher("efdl before (in place)", cmd, env, True, base.script)


Etcd = EmbeddedEtcd | EtcdCluster


def make_etcd(kind: str) -> Etcd:
    return EmbeddedEtcd().start() if kind in ("hung", "killed") else EtcdCluster(3).start()


def break_etcd(kind: str, etcd: Etcd) -> Callable[[], None]:
    """Make the fault ``kind`` happen to ``etcd``; returns what ends it."""
    if isinstance(etcd, EmbeddedEtcd):
        if kind == "killed":
            etcd.kill()

            def restart() -> None:
                etcd.start()  # on the same data

            return restart
        victims = [etcd]
    else:
        leader = leader_of(etcd)
        victims = [leader]
        if kind == "quorum":
            victims.append(next(m for m in etcd.members if m is not leader))
    pids = [m.pid for m in victims if m.pid is not None]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)

    def resume() -> None:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    return resume


def one_run(
    kind: str, duration: float, tree: Path | None, torchft: bool = True
) -> dict[str, Outcome]:
    """One run of fault ``kind``: every job side by side; their outcomes by launcher name."""
    outage_s = 12.0 if kind == "leader" else duration
    out = Path(tempfile.mkdtemp(prefix=f"outage-{kind}-"))
    etcd = make_etcd(kind)
    endpoint = etcd.endpoints if isinstance(etcd, EtcdCluster) else etcd.endpoint.target
    # TorchFT's own heartbeat timeout (5 s), as this benchmark first measured it.
    lighthouse = (
        Lighthouse(out / "lighthouse.log", heartbeat_ms=5000)
        if kind in ("hung", "killed") and torchft
        else None
    )
    runs: list[Run] = []
    try:
        launchers = [
            efdl_launcher(endpoint, f"now-{uuid.uuid4().hex[:6]}", in_place=True),
            efdl_launcher(endpoint, f"restart-{uuid.uuid4().hex[:6]}", in_place=False),
        ]
        if tree is not None:
            launchers.append(old_efdl(tree, endpoint, f"before-{uuid.uuid4().hex[:6]}"))
        if lighthouse is not None:
            lighthouse.start()
            launchers.append(torchft_launcher(lighthouse))
        for i, launcher in enumerate(launchers):
            d = out / f"job{i}"
            d.mkdir()
            run = Run(launcher, d, {"STEP_SECONDS": str(STEP_S)})
            runs.append(run)
            for node in ("n1", "n2"):
                run.start(node)
        for run in runs:  # two workers stepping, for a while
            run.wait(lambda rs: len({r["pid"] for r in rs}) >= 2 and len(rs) > 40, 180)
        time.sleep(5)
        before = [{r["pid"] for r in run.rows()} for run in runs]
        t0 = time.time()
        end = break_etcd(kind, etcd)
        stopped_lh = lighthouse is not None and lighthouse.proc is not None
        if stopped_lh:
            assert lighthouse is not None and lighthouse.proc is not None
            if kind == "hung":
                os.kill(lighthouse.proc.pid, signal.SIGSTOP)
            else:
                lighthouse.proc.kill()
                lighthouse.proc.wait()
        time.sleep(outage_s)  # the outage's length, by design
        end()
        if stopped_lh:
            assert lighthouse is not None and lighthouse.proc is not None
            if kind == "hung":
                os.kill(lighthouse.proc.pid, signal.SIGCONT)
            else:
                lighthouse.start()
        t1 = time.time()
        time.sleep(AFTER_S)
        return {
            run.launcher.name: measure(run.rows(), pids, t0, t1)
            for run, pids in zip(runs, before, strict=True)
        }
    finally:
        for run in runs:
            run.stop()
        if lighthouse is not None:
            lighthouse.stop()
        etcd.stop()
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage", type=float, default=60.0, help="seconds")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--before", default="52f2202", help="git ref of efdl before issue 34")
    parser.add_argument(
        "--no-torchft", action="store_true", help="efdl alone (TorchFT not installed)"
    )
    args = parser.parse_args()
    kinds = [k for k in args.faults.split(",") if k]
    results: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    with before_tree(args.before) if args.before else contextlib.nullcontext() as tree:
        for _ in range(args.repeat):
            for kind in kinds:
                print(f"  {kind} ...", file=sys.stderr, flush=True)
                for name, o in one_run(kind, args.outage, tree, not args.no_torchft).items():
                    results[(kind, name)].append(o)
    print(
        f"Two-node jobs (one worker each, gloo on CPU, {STEP_S} s of sleep per step, lease TTL "
        f"3 s) train side by side while the control plane fails for {args.outage:g} s "
        "(the paused raft leader: 12 s). Stood still: the longest time between two steps of "
        f"rank 0 from the fault to {AFTER_S:g} s after it ended; trained: the steps trained "
        "during the outage, as a share of those the job trained in the same time before it; "
        "restarted: worker processes that were not there before; lost: committed steps trained "
        "again, or gone (a job that came back from step 0). Medians of "
        f"{args.repeat} runs with (min-max). efdl before: efdl at {args.before} (before issue "
        "34), no remote cache. TorchFT: its own timeouts (60 s), each replica group under "
        "torchrun --max-restarts 3. Faults:\n"
    )
    for kind in kinds:
        print(f"- `{kind}`: {FAULTS[kind]}")
    print()
    print(
        "| fault | job | stood still (s) | trained during the outage | workers restarted "
        "| steps lost |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for (kind, name), outs in results.items():
        gone = sum(not o.came_back for o in outs)
        still = spread([o.still_s for o in outs])
        if gone:
            still = f"{still}; did not train again in {gone} of {len(outs)} runs"
        print(
            f"| {kind} | {name} | {still} | "
            f"{spread([o.trained for o in outs], 0, 100)} % | "
            f"{spread([float(o.restarted) for o in outs], 0)} | "
            f"{spread([float(o.lost) for o in outs], 0)} |"
        )


if __name__ == "__main__":
    main()

"""What a crash-looping node costs its job, with and without the crash-loop quarantine.

Three real efdl-run agents (a plain torchrun script, restart mode, on a real etcd) train; the
workers of one node, c, exit 3 after five steps of every start, as on a node with a bad GPU.
c's agent is run under a supervisor that starts it again 2 s after it exits, as systemd's
``Restart=on-failure`` would. For each ``--quarantine-after`` (0: off), over the same window:
how many times c's workers crashed, how many rounds the job made after its first, and how long
training stood still (efdl's own account of the pauses: ``efdl status``).

Usage: python -m benchmarks.crash_loop [--window 90] [--settings 0,1,3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from efdl.history import read_events, stood_still
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.records import EventKind, RoundStatus
from tests.e2e.harness import Agent, Job

RESTART_AFTER_S = 2.0  # the supervisor's RestartSec


def measure(etcd: EmbeddedEtcd, after: int, window_s: float) -> dict[str, object]:
    out = Path(tempfile.mkdtemp(prefix="efdl-crash-loop-"))
    job = Job(
        out,
        etcd.endpoint.target,
        f"loop-{uuid.uuid4().hex[:8]}",
        ["--lease-ttl", "3", "--settle", "0.5", "--grace-period", "5"],
        env={"STEP_SECONDS": "0.1", "CRASH_NODE": "c:5"},
    )
    job.common += ["--min", "1", "--max", "3", "--nproc-per-node", "1"]
    job.common += ["--quarantine-after", str(after), "--max-restarts", "3"]
    starts = 0
    try:
        for name in "abc":
            job.start(name)
        starts = 1
        end = time.monotonic() + window_s
        exited_at: float | None = None
        while time.monotonic() < end:
            c: Agent = job.agents["c"]
            if c.proc.poll() is not None:
                exited_at = exited_at or time.monotonic()
                if time.monotonic() - exited_at >= RESTART_AFTER_S:
                    c.stop()
                    job.start("c")  # the same node id, as a unit with EFDL_NODE_ID
                    starts += 1
                    exited_at = None
            time.sleep(0.2)
        with EtcdStore(etcd.settings()) as store:
            events, _ = read_events(store, job.job_id)
        held = any(e.kind is EventKind.HOLD and e.node == "c" for e in events)
    finally:
        job.stop()
        shutil.rmtree(out, ignore_errors=True)
    active = [e for e in events if e.round_status is RoundStatus.ACTIVE]
    first_full = next((e for e in active if e.world_size == 3), None)
    rounds = len([e for e in active if first_full is not None and e.time > first_full.time])
    _, still = stood_still(events, time.time())
    return {
        "quarantine-after": after or "off",
        "c's crashes": sum(1 for e in events if e.kind is EventKind.CRASH and e.node == "c"),
        "rounds after the first": rounds,
        "stood still (s)": f"{still:.1f}",
        "c's agent started": starts,
        "c held at the end": "yes" if held else "no",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=float, default=90.0, help="Seconds per setting.")
    parser.add_argument("--settings", default="0,1,3", help="--quarantine-after values.")
    args = parser.parse_args()
    rows = []
    with EmbeddedEtcd() as etcd:
        for after in (int(x) for x in args.settings.split(",")):
            rows.append(measure(etcd, after, args.window))
    print(
        f"A node whose workers crash after five steps of every start, {args.window:g} s of a "
        "3-node job in restart mode (--max-restarts 3; its agent started again 2 s after it "
        "exits, as systemd would):\n"
    )
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * (len(keys) - 1))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    print(flush=True)


if __name__ == "__main__":
    main()

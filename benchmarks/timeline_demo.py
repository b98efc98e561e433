"""A real job's timeline for docs/img/job-timeline.png: three nodes meet a join, a worker crash,
a node SIGKILL and a graceful leave; the picture is drawn from the job's history in etcd.

Usage: python -m benchmarks.timeline_demo [--out docs/img/job-timeline.png]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

import psutil

from efdl.history import format_event, read_events
from efdl.launcher import warm
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.records import Event, EventKind
from efdl.timeline import draw

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "elastic_steps.py"
RUN = [sys.executable, "-c", "from efdl.cli.run import run_main; run_main()"]
FLAGS = ["--host", "127.0.0.1", "--lease-ttl", "5", "--settle", "0.5", "--min", "1", "--max", "4"]
FLAGS += ["--nproc-per-node", "1", str(SCRIPT)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "job-timeline.png")
    args = parser.parse_args()
    job = f"demo-{uuid.uuid4().hex[:6]}"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with (
        EmbeddedEtcd() as etcd,
        tempfile.TemporaryDirectory() as out,
        EtcdStore(etcd.settings()) as store,
    ):
        env = {**os.environ, "OUT_DIR": out, "STEP_SECONDS": "0.05"}

        logs: dict[str, IO[bytes]] = {}

        def start(node: str) -> None:
            logs[node] = open(Path(out) / f"{node}.log", "wb")  # noqa: SIM115
            procs[node] = subprocess.Popen(
                [*RUN, "--etcd", etcd.endpoint.target, "--job-id", job, "--node-id", node, *FLAGS],
                env=env,
                stdout=logs[node],
                stderr=subprocess.STDOUT,
            )

        def until(what: str, pred: Callable[[list[Event]], bool], timeout_s: float = 90) -> None:
            deadline = time.monotonic() + timeout_s
            while not pred(read_events(store, job)[0]):
                if time.monotonic() > deadline:
                    for e in read_events(store, job)[0]:
                        print(format_event(e))
                    for node, f in logs.items():
                        f.flush()
                        print(f"--- {node}\n" + (Path(out) / f"{node}.log").read_text()[-6000:])
                    raise SystemExit(f"timed out waiting for {what}")
                time.sleep(0.2)

        def world(n: int, after: int = 0) -> Callable[[list[Event]], bool]:
            return lambda es: (
                sum(e.kind is EventKind.RESCALE and e.world_size == n for e in es) > after
            )

        try:
            start("node-a")
            start("node-b")
            until(
                "two workers",
                lambda es: any(e.kind is EventKind.ROUND and e.world_size == 2 for e in es),
            )
            time.sleep(3)
            start("node-c")
            until("three workers", world(3))
            time.sleep(3)
            worker = next(
                p
                for p in psutil.Process(procs["node-c"].pid).children(recursive=True)
                if p.name() not in warm.NAMES
            )
            worker.kill()
            until("three again", world(3, 1))
            time.sleep(3)
            procs["node-b"].kill()  # the agent; its worker dies with it
            until("two after the node kill", world(2, 1))
            time.sleep(3)
            procs["node-c"].send_signal(signal.SIGTERM)
            until("one after the leave", world(1))
            time.sleep(3)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait(30)
        events, _ = read_events(store, job)
    for e in events:
        print(format_event(e))
    draw(events, args.out, f"job {job}: join, worker crash, node SIGKILL, leave")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

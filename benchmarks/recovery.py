"""Recovery and steady state: efdl in place vs torchrun restart, side by side in one run.

Recovery: a job of two nodes (one worker each, gloo on CPU, the same model) meets an event;
the time is from the event to the first training step at the new world size:
- join: a third node's agent is started (the time includes its start);
- leave: one agent gets SIGTERM;
- worker kill: one worker process is SIGKILLed (world size unchanged: to the first step of a
  new generation / new processes).
efdl runs tests/e2e/scripts/elastic_steps.py (the efdl change: rebuild in place); torchrun 2.13
runs tests/e2e/scripts/steps.py (restart, resuming from its checkpoint), with c10d rendezvous
at its defaults and tuned (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, --rdzv-conf
last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5).

Steady state: two workers on one node, no sleep, a 3-layer MLP; median step time of efdl in
place vs plain torchrun DDP.

Usage: python -m benchmarks.recovery [--repeat 3] [--events join,leave,kill]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from efdl.rendezvous.embedded import EmbeddedEtcd

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ROOT / "tests" / "e2e" / "scripts" / "steps.py"
ELASTIC = ROOT / "tests" / "e2e" / "scripts" / "elastic_steps.py"
TUNED_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TUNED_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"
Rows = list[dict[str, object]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Launcher:
    name: str
    command: Callable[[str, int], list[str]]  # (node name, index) -> argv
    env: dict[str, str]
    rebuilds_in_place: bool


def efdl_launcher(etcd: str, job: str, settle: float = 0.5, max_nodes: int = 3) -> Launcher:
    def cmd(node: str, i: int) -> list[str]:
        return [
            sys.executable,
            "-c",
            "from efdl.cli import run_main; run_main()",
            "--etcd",
            etcd,
            "--job-id",
            job,
            "--node-id",
            node,
            "--host",
            "127.0.0.1",
            "--min",
            "1",
            "--max",
            str(max_nodes),
            "--nproc-per-node",
            "1",
            "--lease-ttl",
            "3",
            "--settle",
            str(settle),
            "--grace-period",
            "10",
            str(ELASTIC),
        ]

    return Launcher("efdl (in place)", cmd, {}, True)


def torchrun_launcher(port: int, job: str, tuned: bool, max_nodes: int = 3) -> Launcher:
    def cmd(node: str, i: int) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            f"1:{max_nodes}",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            job,
            "--max-restarts",
            "5",
            "--local-addr",
            "127.0.0.1",
        ]
        if tuned:
            argv += ["--rdzv-conf", TUNED_CONF]
        return [*argv, str(PLAIN)]

    name = "torchrun tuned" if tuned else "torchrun default"
    return Launcher(name, cmd, TUNED_ENV if tuned else {}, False)


class Run:
    """Agents of one job and the steps their workers logged."""

    def __init__(self, launcher: Launcher, out: Path, extra_env: dict[str, str]) -> None:
        self.launcher, self.out = launcher, out
        self.env = {**os.environ, **launcher.env, **extra_env, "OUT_DIR": str(out)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str) -> float:
        log = open(self.out / f"{node}.log", "wb")  # noqa: SIM115 (closed with the process)
        t = time.time()
        self.procs[node] = subprocess.Popen(
            self.launcher.command(node, len(self.procs)),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        return t

    def rows(self) -> Rows:
        path = self.out / "events.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def wait(self, pred: Callable[[Rows], object], timeout_s: float = 120) -> Rows:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = self.rows()
            if pred(rows):
                return rows
            time.sleep(0.05)
        raise TimeoutError(f"{self.launcher.name}: no progress within {timeout_s} s")

    def workers_of(self, node: str) -> list[int]:
        try:
            return [
                p.pid
                for p in psutil.Process(self.procs[node].pid).children(recursive=True)
                if "steps.py" in " ".join(p.cmdline())
            ]
        except psutil.NoSuchProcess:
            return []

    def kill_node(self, node: str) -> None:
        """SIGKILL a node's agent and every process under it (workers of torchrun live in
        sessions of their own and would outlive their agent)."""
        pids = [self.procs[node].pid]
        with contextlib.suppress(psutil.NoSuchProcess):
            pids += [c.pid for c in psutil.Process(pids[0]).children(recursive=True)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.procs[node].wait()

    def stop(self) -> None:
        """Kill every agent and every process under it, by PID. torchrun starts its workers
        in sessions of their own and they do not die with a killed agent: collect them first."""
        pids: list[int] = []
        for p in self.procs.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                pids += [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        logged = {int(r["pid"]) for r in self.rows()}  # type: ignore[call-overload]
        for pid in set(pids) | logged:  # workers whose agent died earlier are orphans now
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                if "steps.py" in " ".join(psutil.Process(pid).cmdline()):
                    os.kill(pid, signal.SIGKILL)


def at_world(
    world: int, after_t: float, new: Callable[[dict[str, object]], bool]
) -> Callable[[Rows], float | None]:
    def first(rows: Rows) -> float | None:
        ts = [
            float(r["t"])
            for r in rows  # type: ignore[arg-type]
            if r["world"] == world and float(r["t"]) > after_t and new(r)
        ]  # type: ignore[arg-type]
        return min(ts) if ts else None

    return first


# (event to first step at the new size, stall, steps trained again) or why it did not recover
Result = tuple[float, float, float] | str


def measure(launcher_for: Callable[[], Launcher], event: str, tmp: Path) -> Result:
    """One run: (seconds from the event to the first step at the new world size, seconds
    training stood still: the last step before that one to it), or why it did not recover."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    launcher = launcher_for()
    run = Run(launcher, out, {"STEP_SECONDS": "0.05"})
    try:
        run.start("a")
        run.start("b")
        rows = run.wait(lambda rs: sum(1 for r in rs if r["world"] == 2) >= 10)
        if event == "spare":  # a third node waits beyond --max 2
            run.start("c")
            time.sleep(3)
            rows = run.rows()
        before_pids = {r["pid"] for r in rows}
        gen0 = max(int(r["gen"]) for r in rows)  # type: ignore[call-overload]
        if launcher.rebuilds_in_place:
            new: Callable[[dict[str, object]], bool] = lambda r: int(r["gen"]) > gen0  # type: ignore[call-overload]  # noqa: E731
        else:
            new = lambda r: r["pid"] not in before_pids  # noqa: E731
        if event == "join":
            t0 = run.start("c")
            target = 3
        elif event == "leave":
            t0 = time.time()
            run.procs["b"].send_signal(signal.SIGTERM)
            target = 1
        elif event in ("node", "spare"):  # node b dies: its agent and its workers
            t0 = time.time()
            run.kill_node("b")
            target = 1 if event == "node" else 2
            if event == "spare":  # the spare's worker takes b's place
                new = lambda r: r["pid"] not in before_pids  # noqa: E731
        else:
            victims = run.workers_of("b")
            t0 = time.time()
            os.kill(victims[0], signal.SIGKILL)
            target = 2
        first = at_world(target, t0, new)
        try:
            rows = run.wait(first, timeout_s=60)
        except TimeoutError:
            return "did not recover in 60 s"
        value = first(rows)
        assert value is not None
        earlier = [r for r in rows if float(r["t"]) < value]  # type: ignore[arg-type]
        before = max(float(r["t"]) for r in earlier)  # type: ignore[arg-type]
        last_step = max(int(r["step"]) for r in earlier)  # type: ignore[call-overload]
        resumed = min(
            int(r["step"])  # type: ignore[call-overload]
            for r in rows
            if r["world"] == target and float(r["t"]) >= value and new(r)  # type: ignore[arg-type]
        )
        return value - t0, value - before, float(max(0, last_step - resumed + 1))
    finally:
        run.stop()


def standalone_argv(launcher: str, nproc: int) -> list[str]:
    """``--standalone`` with ``nproc`` workers: efdl on the efdl-aware script, torchrun on the
    plain one."""
    if launcher == "efdl":
        job = f"standalone-{uuid.uuid4().hex[:6]}"
        run = [sys.executable, "-c", "from efdl.cli import run_main; run_main()"]
        return [*run, "--standalone", "--job-id", job, "--nproc-per-node", str(nproc), str(ELASTIC)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(PLAIN),
    ]


def steady(launcher: str, tmp: Path, steps: int = 300, width: int = 512) -> float:
    """Median step time (s) of two workers on one node, no sleep."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    env = {
        **os.environ,
        "OUT_DIR": str(out),
        "STEP_SECONDS": "0",
        "MODEL_WIDTH": str(width),
        "BATCH": "64",
        "STEPS": str(steps),
        "EPOCHS": "1",
        "SAMPLES": str(64 * 2 * steps),
        "DIGEST": "0",
        "SNAPSHOT_EVERY": os.environ.get("SNAPSHOT_EVERY", "10"),
    }
    argv = standalone_argv(launcher, 2)
    subprocess.run(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=True
    )
    rows = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    times = sorted(float(r["t"]) for r in rows if r["rank"] == 0)  # type: ignore[arg-type]
    gaps = [b - a for a, b in itertools.pairwise(times)][20:]  # skip warm-up
    return statistics.median(gaps)


def fmt(values: list[float | str]) -> str:
    nums = [v for v in values if isinstance(v, float)]
    fails = len(values) - len(nums)
    if not nums:
        return f"no recovery ({values[0]})"
    text = f"{statistics.median(nums):.2f} ({min(nums):.2f}-{max(nums):.2f})"
    return text + (f", {fails} of {len(values)} did not recover" if fails else "")


def column(results: list[Result], part: int) -> list[float | str]:
    return [r if isinstance(r, str) else r[part] for r in results]


def ratio(results: dict[str, list[Result]], part: int) -> str:
    e = [v for v in column(results["efdl"], part) if isinstance(v, float)]
    t = [v for v in column(results["tuned"], part) if isinstance(v, float)]
    if not e or not t or statistics.median(e) == 0:
        return "-"
    return f"{statistics.median(t) / statistics.median(e):.1f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--events", default="join,leave,kill,node,spare")
    parser.add_argument("--steady-repeat", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="efdl-bench-"))
    print(
        f"Recovery: median of {args.repeat} runs (min-max), seconds from the event to the "
        "first step at the new world size; 2 nodes x 1 worker on 127.0.0.1, gloo.\n"
    )
    table: dict[str, dict[str, list[Result]]] = {}
    with EmbeddedEtcd() as etcd:
        for event in args.events.split(","):
            results: dict[str, list[Result]] = {"efdl": [], "default": [], "tuned": []}
            for _ in range(args.repeat):  # interleaved, so noise hits all alike
                job = f"bench-{uuid.uuid4().hex[:6]}"
                most = 2 if event == "spare" else 3
                results["efdl"].append(
                    measure(
                        lambda job=job, most=most: efdl_launcher(
                            etcd.endpoint.target, job, max_nodes=most
                        ),
                        event,
                        tmp,
                    )
                )
                for name, tuned in (("default", False), ("tuned", True)):
                    port = free_port()
                    results[name].append(
                        measure(
                            lambda p=port, j=job, t=tuned, m=most: torchrun_launcher(p, j, t, m),
                            event,
                            tmp,
                        )
                    )
            table[event] = results
    for part, title in (
        (0, "Event to the first step at the new world size (s)"),
        (1, "Training stood still: last step before to first step at the new size (s)"),
        (2, "Work lost: steps trained again after the event (from the step counters)"),
    ):
        print(f"{title}:\n")
        print("| event | efdl (in place) | torchrun default | torchrun tuned | tuned / efdl |")
        print("|---|---:|---:|---:|---:|")
        for event, results in table.items():
            print(
                f"| {event} | {fmt(column(results['efdl'], part))} | "
                f"{fmt(column(results['default'], part))} | "
                f"{fmt(column(results['tuned'], part))} | {ratio(results, part)} |"
            )
        print(flush=True)
    if args.steady_repeat < 1:
        return
    print(
        "\nSteady state: median step time of 2 workers, 3-layer MLP width 512, batch 64, "
        f"median of {args.steady_repeat} runs; efdl commits every step, snapshot every "
        f"{os.environ.get('SNAPSHOT_EVERY', '10')} commits.\n"
    )
    print("| launcher | step time (ms) | efdl / torchrun |")
    print("|---|---:|---:|")
    plain, elastic = [], []
    for _ in range(args.steady_repeat):
        plain.append(steady("torchrun", tmp))
        elastic.append(steady("efdl", tmp))
    p, e = statistics.median(plain), statistics.median(elastic)
    print(f"| torchrun | {p * 1000:.2f} ({min(plain) * 1000:.2f}-{max(plain) * 1000:.2f}) | |")
    print(
        f"| efdl in place | {e * 1000:.2f} ({min(elastic) * 1000:.2f}-{max(elastic) * 1000:.2f})"
        f" | {e / p:.3f} |"
    )


if __name__ == "__main__":
    main()

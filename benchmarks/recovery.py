"""Recovery, startup and steady state: efdl in place vs torchrun restart, side by side.

Recovery: a job of two nodes meets an event (join, leave, worker kill, node kill, spare
replacing a dead node); the time is from the event to the first training step at the new
world size (the full description is printed with the tables: DESCRIPTION). Startup of the
same two-node jobs comes from the same runs. Steady state: two workers on one node, a small
and a medium MLP, median step time of efdl in place vs plain torchrun DDP.

Usage: python -m benchmarks.recovery [--repeat 3] [--default-repeat N] [--events join,...]
       [--steady-repeat 3] [--launchers efdl,restart,default,tuned,torchft]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.report import pyplot, save, spread, verdict
from efdl.launcher import warm
from efdl.rendezvous.embedded import EmbeddedEtcd
from tests.procs import run_together

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ROOT / "tests" / "e2e" / "scripts" / "steps.py"
ELASTIC = ROOT / "tests" / "e2e" / "scripts" / "elastic_steps.py"
TUNED_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TUNED_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"
Rows = list[dict[str, object]]
TORCHFT = ROOT / "benchmarks" / "torchft_steps.py"
LAUNCHERS = {
    "efdl": "efdl (in place)",
    "restart": "efdl (restart)",
    "default": "torchrun default",
    "tuned": "torchrun tuned",
    "torchft": "TorchFT 0.2.0",
}
DESCRIPTION = (
    "A job of two nodes (one worker each, gloo on CPU, 0.05 s of sleep per step) meets an event; "
    "the time is from the event to the first training step at the new world size. Events: "
    "`join` (a third node's agent is started: its start is included), `leave` (SIGTERM to one "
    "agent), `kill` (one worker process SIGKILLed: world size unchanged, to the first step of "
    "new processes or a new generation), `node` (one node's agent and workers SIGKILLed), "
    "`spare` (`--max 2`: a third node waits as a spare; node b is SIGKILLed and the spare takes "
    "its place). efdl agents fork their workers from a fork server (`--warm-workers 1`, the "
    "default on a GPU node), and events come once the job is steady: every agent's fork "
    "server ready. efdl in "
    "place runs tests/e2e/scripts/elastic_steps.py (rebuild in place, commit every step), efdl "
    "in restart mode the plain script below; torchrun 2.13 runs tests/e2e/scripts/steps.py "
    "(restart; resumes its step counter from a checkpoint written every step) with c10d "
    "rendezvous, at its defaults and tuned "
    "(`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, `--rdzv-conf " + TUNED_CONF + "`). Runs are "
    "interleaved (efdl, default, tuned, efdl, ...) so machine noise hits all three; medians of "
    "{repeat} runs (default torchrun: {default_repeat}, each costs its 30 s last-call window "
    "at start plus up to 60 s) with (min-max). A run with no step at the new size within 60 s "
    'counts as "did not recover". TorchFT 0.2.0 (`--launchers ...,torchft`) runs '
    "benchmarks/torchft_steps.py, the same model and sleep: each node is a replica group of one "
    "worker under its own torchrun (`--max-restarts 3`), its Manager, DDP and optimizer "
    "wrappers, on a lighthouse tuned as efdl is here (heartbeat timeout 3 s as `--lease-ttl 3`, "
    "join timeout 1 s as `--settle 1`); it has no `--max`, so no spare event. Its "
    "`world` is the quorum's replica count, its generation the quorum id.\n"
)


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
    script: Path
    close: Callable[[], None] = lambda: None  # stops what the launcher started besides agents


class Lighthouse:
    """TorchFT's lighthouse (its control plane), started and stopped by PID. Tuned as efdl
    is here: a dead replica noticed after ``heartbeat_ms`` (efdl: --lease-ttl 3), a quorum
    issued ``join_ms`` after the last replica joined (efdl: --settle 1)."""

    def __init__(self, log: Path | None, heartbeat_ms: int = 3000, join_ms: int = 1000) -> None:
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self._log = log
        self._heartbeat_ms, self._join_ms = heartbeat_ms, join_ms
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Lighthouse:
        binary = shutil.which("torchft_lighthouse")
        assert binary, "torchft_lighthouse is not on PATH: pip install torchft"
        log = open(self._log, "ab") if self._log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                binary,
                "--min_replicas",
                "1",
                "--quorum_tick_ms",
                "100",
                "--join_timeout_ms",
                str(self._join_ms),
                "--heartbeat_timeout_ms",
                str(self._heartbeat_ms),
                "--bind",
                f"127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        if log is not subprocess.DEVNULL:
            log.close()  # type: ignore[union-attr]
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


def torchft_launcher(lighthouse: Lighthouse) -> Launcher:
    """A replica group of one worker per node, each its own torchrun (TorchFT's examples),
    on ``lighthouse``: benchmarks/torchft_steps.py, replica ``r<index>``."""

    def cmd(node: str, i: int) -> list[str]:
        return [
            "env",
            f"REPLICA_ID=r{i}",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "3",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(TORCHFT),
        ]

    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address}
    return Launcher(LAUNCHERS["torchft"], cmd, env, True, TORCHFT, lighthouse.stop)


def efdl_launcher(
    etcd: str,
    job: str,
    settle: float = 1.0,  # efdl's default
    max_nodes: int = 3,
    min_nodes: int = 1,
    script: Path = ELASTIC,
    lease_ttl: int = 3,
    grace: float = 10,
    extra: Sequence[str] = (),
    script_args: Sequence[str] = (),
    in_place: bool = True,
) -> Launcher:
    """``extra``: more agent flags; ``script_args``: the script's own; ``in_place``: False
    runs the plain torchrun script (restart mode) unless ``script`` says otherwise."""
    if not in_place and script == ELASTIC:
        script = PLAIN

    def cmd(node: str, i: int) -> list[str]:
        return [
            sys.executable,
            "-c",
            "from efdl.cli.run import run_main; run_main()",
            "--etcd",
            etcd,
            "--job-id",
            job,
            "--node-id",
            node,
            "--host",
            "127.0.0.1",
            "--min",
            str(min_nodes),
            "--max",
            str(max_nodes),
            "--nproc-per-node",
            "1",
            "--lease-ttl",
            str(lease_ttl),
            "--settle",
            str(settle),
            "--grace-period",
            str(grace),
            *extra,
            str(script),
            *script_args,
        ]

    return Launcher(LAUNCHERS["efdl" if in_place else "restart"], cmd, {}, in_place, script)


def torchrun_launcher(
    port: int,
    job: str,
    tuned: bool,
    max_nodes: int = 3,
    script: Path = PLAIN,
    script_args: Sequence[str] = (),
) -> Launcher:
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
        return [*argv, str(script), *script_args]

    name = "torchrun tuned" if tuned else "torchrun default"
    return Launcher(name, cmd, TUNED_ENV if tuned else {}, False, script)


def launcher(name: str, etcd: str, job: str, max_nodes: int) -> Launcher:
    """The launcher ``name`` (a key of LAUNCHERS) for one run of ``job``."""
    if name in ("efdl", "restart"):  # the fork server: the default, said
        warm = ("--warm-workers", "1")
        return efdl_launcher(etcd, job, max_nodes=max_nodes, in_place=name == "efdl", extra=warm)
    if name == "torchft":
        return torchft_launcher(Lighthouse(None).start())
    return torchrun_launcher(free_port(), job, name == "tuned", max_nodes)


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
        """The node's workers that trained (logged a step): not warm processes waiting."""
        logged = {int(r["pid"]) for r in self.rows() if "pid" in r}  # type: ignore[call-overload]
        try:
            children = psutil.Process(self.procs[node].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [p.pid for p in children if p.pid in logged]

    def warm_ready(self) -> bool:
        """Whether every agent's fork server is ready (efdl; none under torchrun)."""
        for p in self.procs.values():
            try:
                names = [c.name() for c in psutil.Process(p.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                return False
            if warm.WAITING_NAME not in names:
                return False
        return True

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
        logged = {int(r["pid"]) for r in self.rows() if "pid" in r}  # type: ignore[call-overload]
        for pid in set(pids) | logged:  # workers whose agent died earlier are orphans now
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                cmd = " ".join(psutil.Process(pid).cmdline())
                if self.launcher.script.name in cmd or "efdl.launcher." in cmd:
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


def measure(launcher_for: Callable[[], Launcher], event: str, tmp: Path) -> tuple[Result, float]:
    """One run: (seconds from the event to the first step at the new world size, seconds
    training stood still: the last step before that one to it, steps trained again), or why
    it did not recover; and the seconds from starting both agents to the first step."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    launcher = launcher_for()
    run = Run(launcher, out, {"STEP_SECONDS": "0.05"})
    try:
        launched = run.start("a")
        run.start("b")
        rows = run.wait(lambda rs: sum(1 for r in rs if r["world"] == 2) >= 10)
        startup = min(float(r["t"]) for r in rows if r["world"] == 2) - launched  # type: ignore[arg-type]
        if launcher.name in (LAUNCHERS["efdl"], LAUNCHERS["restart"]):  # a steady job
            run.wait(lambda _: run.warm_ready(), timeout_s=60)
            rows = run.rows()  # the processes and generations before the event are these
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
            if event == "spare" and not launcher.rebuilds_in_place:  # new processes
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
            return "did not recover in 60 s", startup
        value = first(rows)
        assert value is not None
        return (value - t0, stood_still(rows, t0, value), float(trained_again(rows))), startup
    finally:
        run.stop()
        launcher.close()


def stood_still(rows: Rows, t0: float, until: float) -> float:
    """The longest time between two training steps (of any rank, at any size) from the last
    step before ``t0`` to the first at the new size (``until``): a job that shrinks first
    trains on while the rest of the event takes its course."""
    times = sorted({float(r["t"]) for r in rows})  # type: ignore[arg-type]
    start = max(t for t in times if t <= t0)
    span = [t for t in times if start <= t <= until]
    return max(b - a for a, b in itertools.pairwise(span))


def trained_again(rows: Rows) -> int:
    """How many steps were trained more than once: each try of a step has one rank 0."""
    tries = collections.Counter(r["step"] for r in rows if r["rank"] == 0)
    return sum(1 for n in tries.values() if n > 1)


def standalone_argv(launcher: str, nproc: int, script: Path = ELASTIC) -> list[str]:
    """``--standalone`` with ``nproc`` workers: efdl on the efdl-aware script, torchrun on the
    plain one."""
    if launcher == "efdl":
        job = f"standalone-{uuid.uuid4().hex[:6]}"
        run = [sys.executable, "-c", "from efdl.cli.run import run_main; run_main()"]
        return [*run, "--standalone", "--job-id", job, "--nproc-per-node", str(nproc), str(script)]
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
    """Median step time (s) of two workers on one node, no sleep (TorchFT: two replica
    groups of one worker, each its own torchrun, on one lighthouse)."""
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
        "SNAPSHOT_EVERY": os.environ.get("SNAPSHOT_EVERY", "0"),
    }
    if launcher == "torchft":  # two replica groups, each its own torchrun
        lighthouse = Lighthouse(None).start()
        ft = torchft_launcher(lighthouse)
        commands = [ft.command(f"r{i}", i) for i in range(2)]
        # one thread each, as torchrun and efdl-run give each of two workers on a node
        # (torchrun gives a replica group of one worker all the cores)
        env = {**env, **ft.env, "OMP_NUM_THREADS": "1"}
    else:
        lighthouse, commands = None, [standalone_argv(launcher, 2)]
    try:
        done = run_together(commands, 600, env=env)
    finally:
        if lighthouse is not None:
            lighthouse.stop()
    failed = [d for d in done if d.returncode != 0]
    assert not failed, f"{launcher} exited {failed[0].returncode}: {failed[0].stderr[-2000:]}"
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


def ratio(of: list[float | str], peer: list[float | str]) -> str:
    """A peer's median over ``of``'s ("-" when either never recovered)."""
    e = [v for v in of if isinstance(v, float)]
    t = [v for v in peer if isinstance(v, float)]
    if not e or not t or statistics.median(e) < 0.01:
        return "-"
    return f"{statistics.median(t) / statistics.median(e):.1f}x"


def launcher_table(
    rows: dict[str, dict[str, list[float | str]]], first: str | None, ratios: bool = True
) -> None:
    """A table of a row per key of ``rows`` (in a first column headed ``first``; None: no
    such column), a column per launcher that ran, then, with ``ratios``, tuned torchrun's
    median over each efdl launcher's."""
    keys = [k for k in LAUNCHERS if any(values.get(k) for values in rows.values())]
    # (peer, efdl launcher): the peer's median over efdl's
    versus = [
        (peer, k)
        for peer in ("tuned", "torchft")
        for k in ("efdl", "restart")
        if ratios and k in keys and peer in keys and (peer == "tuned" or k == "efdl")
    ]
    head = [*([first] if first is not None else []), *(LAUNCHERS[k] for k in keys)]
    head += [f"{LAUNCHERS[p] if p != 'tuned' else p} / {LAUNCHERS[k]}" for p, k in versus]
    print("| " + " | ".join(head) + " |")
    print("|" + ("---|" if first is not None else "") + "---:|" * (len(keys) + len(versus)))
    for name, values in rows.items():
        cells = [*([name] if first is not None else [])]
        cells += [fmt(values[k]) if values.get(k) else "-" for k in keys]
        cells += [ratio(values[k], values.get(p, [])) for p, k in versus]
        print("| " + " | ".join(cells) + " |")
    print(flush=True)


MODELS = {"small": (512, 300), "medium": (2048, 150)}  # MLP width, steps


def recovery_table(table: dict[str, dict[str, list[Result]]], part: int, title: str) -> None:
    print(f"{title}:\n")
    rows = {e: {k: column(r, part) for k, r in results.items()} for e, results in table.items()}
    launcher_table(rows, "event", ratios=part != 2)  # no ratio of steps trained again


def median_of(results: list[Result], part: int) -> float | None:
    nums = [v for v in column(results, part) if isinstance(v, float)]
    return statistics.median(nums) if nums else None


def plot_recovery(table: dict[str, dict[str, list[Result]]]) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    colors = {"efdl": "tab:blue", "restart": "tab:green", "tuned": "tab:orange"}
    colors["default"] = "tab:gray"
    colors["torchft"] = "tab:purple"
    events = list(table)
    names = {k: LAUNCHERS[k] for k in colors if any(table[e].get(k) for e in events)}
    width = 0.8 / len(names)
    for i, (key, label) in enumerate(names.items()):
        offset = (i - (len(names) - 1) / 2) * width
        xs, ys, lo, hi, failed = [], [], [], [], []
        for j, event in enumerate(events):
            if not table[event].get(key):
                continue
            nums = [v for v in column(table[event][key], 0) if isinstance(v, float)]
            if nums:
                m = statistics.median(nums)
                xs.append(j + offset)
                ys.append(m)
                lo.append(m - min(nums))
                hi.append(max(nums) - m)
            else:
                failed.append(j + offset)
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=label, color=colors[key])
        for n, x in enumerate(failed):
            shown = label if not xs and n == 0 else None  # one legend entry per launcher
            ax.bar([x], [60], width, color=colors[key], alpha=0.25, hatch="//", label=shown)
            ax.annotate("none in 60 s", (x, 2), ha="center", fontsize=7, rotation=90)
    ax.set_xticks(range(len(events)), events)
    ax.set(ylabel="event to first step at the new size (s)", yscale="log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title("recovery, 2 nodes x 1 worker: median and min-max")
    return save(fig, "recovery.png", "recovery time per event, efdl vs torchrun")


def steady_section(repeat: int, tmp: Path, peers: Sequence[str] = ()) -> None:
    """Step time of efdl in place and plain torchrun DDP (and each of ``peers``: torchft)."""
    names = {"torchrun": "torchrun", "efdl": "efdl", **{p: LAUNCHERS[p] for p in peers}}
    print(
        f"Steady state: 2 workers on one node, no sleep, batch 64 per worker, a 3-layer MLP "
        f"(small: width {MODELS['small'][0]}, medium: width {MODELS['medium'][0]}); median step "
        f"time of rank 0 (the first 20 steps skipped), median of {repeat} runs, launchers "
        "interleaved; efdl commits every step, with rollback copies every "
        f"{os.environ.get('SNAPSHOT_EVERY', '0')} commits (0: none, its default)"
        + (
            "; TorchFT: two replica groups of one worker on one lighthouse, its DDP and "
            "optimizer wrappers (a quorum and a commit vote per step)"
            if "torchft" in peers
            else ""
        )
        + ".\n"
    )
    others = [n for n in names if n != "torchrun"]
    head = ["model", "params", *(f"{names[n]} step (ms)" for n in names)]
    head += [f"{names[n]} / torchrun (time)" for n in others]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    worst = 0.0
    for name, (width, steps) in MODELS.items():
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(repeat):
            for n in names:
                times[n].append(steady(n, tmp, steps, width))
        medians = {n: statistics.median(v) for n, v in times.items()}
        worst = max(worst, medians["efdl"] / medians["torchrun"])
        params = 2 * (width * width + width) + width + 1
        cells = [name, f"{params / 1e6:.1f}M", *(spread(times[n], 2, 1000) for n in names)]
        cells += [f"{medians[n] / medians['torchrun']:.3f}" for n in others]
        print("| " + " | ".join(cells) + " |")
    print(
        f"\nGoal: steady-state overhead under 1%: {verdict(worst <= 1.01)} (largest "
        f"efdl / torchrun step-time ratio {worst:.3f}; run-to-run spread on this shared machine "
        "is of the same order, see the ranges).\n"
    )


def lines_section(peers: Sequence[str]) -> None:
    """How many lines of the digits example's torchrun script each elastic version changes."""
    from tests.e2e.harness import lines_changed_for_efdl

    digits = ROOT / "examples" / "digits"
    versions = {"efdl (in place)": "train_efdl.py"}
    if "torchft" in peers:
        versions[LAUNCHERS["torchft"]] = "train_torchft.py"
    print(
        "Lines a user changes: examples/digits/train_torchrun.py (a plain DDP script with "
        "its own checkpoint) made elastic in place, lines changed, added or removed "
        "(difflib, the module docstrings aside); efdl's restart mode changes none.\n"
    )
    print("| version | lines changed |\n|---|---:|")
    for name, file in versions.items():
        print(f"| {name} (`{file}`) | {lines_changed_for_efdl(digits, file)} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--default-repeat", type=int, default=0, help="0: as --repeat")
    parser.add_argument("--events", default="join,leave,kill,node,spare")
    parser.add_argument("--steady-repeat", type=int, default=3)
    parser.add_argument(
        "--launchers",
        default=",".join(LAUNCHERS),
        help="which of " + ", ".join(LAUNCHERS) + " to run (comma-separated)",
    )
    args = parser.parse_args()
    chosen = args.launchers.split(",")
    unknown = sorted(set(chosen) - set(LAUNCHERS))
    if unknown:
        parser.error(f"--launchers: unknown {unknown}; expected some of {list(LAUNCHERS)}")
    tmp = Path(tempfile.mkdtemp(prefix="efdl-bench-"))
    default_repeat = args.default_repeat or args.repeat
    print(DESCRIPTION.format(repeat=args.repeat, default_repeat=default_repeat))
    table: dict[str, dict[str, list[Result]]] = {}
    startups: dict[str, list[float | str]] = {k: [] for k in chosen}
    with EmbeddedEtcd() as etcd:
        for event in filter(None, args.events.split(",")):  # --events "": steady state only
            results: dict[str, list[Result]] = {k: [] for k in chosen}
            for i in range(args.repeat):  # interleaved, so noise hits all alike
                job = f"bench-{uuid.uuid4().hex[:6]}"
                most = 2 if event == "spare" else 3
                runs = [
                    (
                        name,
                        functools.partial(
                            launcher, name, etcd.endpoint.target, f"{job}-{name}", most
                        ),
                    )
                    for name in chosen
                    if not (name == "default" and i >= default_repeat)
                    and not (name == "torchft" and event == "spare")  # no --max to spare
                ]
                for name, launcher_for in runs:
                    result, startup = measure(launcher_for, event, tmp)
                    results[name].append(result)
                    if most == 3:
                        startups[name].append(startup)
            table[event] = results
    if table:  # --events "": the steady state alone
        recovery_sections(table, startups)
    peers = [p for p in chosen if p == "torchft"]
    if args.steady_repeat > 0:
        steady_section(args.steady_repeat, tmp, peers)
    lines_section(peers)


def recovery_sections(
    table: dict[str, dict[str, list[Result]]], startups: dict[str, list[float | str]]
) -> None:
    """The events' tables, figure and verdicts, and the startups measured in the same runs."""
    for part, title in (
        (0, "Event to the first step at the new world size (s)"),
        (
            1,
            "Training stood still: the longest time without a step, from the last step "
            "before the event to the first at the new size (s)",
        ),
        (2, "Work lost: steps trained again after the event (from the step counters)"),
    ):
        recovery_table(table, part, title)
    print(plot_recovery(table) + "\n")
    verdicts(table)
    print(
        "Startup, measured in the same runs (every event but spare): from starting both agents "
        "to the first step at world size 2 (s), `--min 1 --max 3` / `--nnodes 1:3`.\n"
    )
    launcher_table({"": startups}, None)
    print(
        "torchrun's c10d rendezvous waits its last-call window (30 s by default, 1 s tuned) "
        "whenever fewer than its max nodes have arrived; efdl waits its settle window only "
        "while joins keep coming and below `--max`, and binds the round's store port at once "
        "while it imports torch. The rest is process start (Python, torch import) on both.\n"
    )


def verdicts(table: dict[str, dict[str, list[Result]]]) -> None:
    """The issue's goals, from the numbers above."""
    lines = []
    for event, part, what in (
        ("leave", 0, "a graceful leave (SIGTERM)"),
        ("join", 1, "a join (training standing still)"),
    ):
        if event not in table:
            continue
        if not table[event].get("efdl") or not table[event].get("tuned"):
            continue
        e, t = median_of(table[event]["efdl"], part), median_of(table[event]["tuned"], part)
        if e is None:
            lines.append(f"- {what}: efdl did not recover: goal **not met**.")
            continue
        vs = f"{t / e:.0f}x faster than tuned torchrun" if t else "tuned torchrun did not recover"
        lines.append(
            f"- {what}: training resumes {e:.2f} s after the event (goal < 1 s: "
            f"{verdict(e < 1)}), {vs} (goal >= 10x: {verdict(t is None or t / e >= 10)})."
        )
    for event, what in (
        ("kill", "a worker SIGKILLed"),
        ("node", "a node SIGKILLed"),
        ("spare", "a spare replacing a dead node"),
        ("join", "a join, until the newcomer trains"),
    ):
        if event not in table or not table[event].get("efdl"):
            continue
        e, t = median_of(table[event]["efdl"], 0), median_of(table[event].get("tuned", []), 0)
        if e is None:
            lines.append(f"- {what}: efdl did not recover within 60 s.")
        elif not table[event].get("tuned"):
            lines.append(f"- {what}: efdl {e:.2f} s.")
        elif t is None:
            lines.append(f"- {what}: efdl {e:.2f} s; tuned torchrun did not recover within 60 s.")
        else:
            lines.append(f"- {what}: efdl {e:.2f} s, tuned torchrun {t:.2f} s ({t / e:.1f}x).")
        default = table[event].get("default", [])
        if default:
            d = median_of(default, 0)
            fails = sum(isinstance(v, str) for v in column(default, 0))
            lines[-1] += (
                f" Default torchrun: {d:.2f} s" if d is not None else " Default torchrun: none"
            ) + (f", {fails} of {len(default)} runs without recovery in 60 s." if fails else ".")
    ttl = 3.0  # the benchmark's --lease-ttl
    for event, what, goal, text in (
        ("kill", "a worker SIGKILLed", 1.0, "< 1 s"),
        # Its agent dies with it: the probe after the survivors' failed collective finds it.
        ("node", "a node SIGKILLed", 1.0, f"< 1 s with the evidence (lease TTL {ttl:g} s)"),
    ):
        still = median_of(table.get(event, {}).get("efdl", []), 1)
        if still is not None:
            lines.append(
                f"- {what}, in place: training stood still {still:.2f} s (goal {text}: "
                f"{verdict(still < goal)})."
            )
    lost = {
        event: max((v for v in column(r.get("efdl", []), 2) if isinstance(v, float)), default=0.0)
        for event, r in table.items()
    }
    lines.append(
        "- Work lost with efdl (most steps trained again in any run): "
        + ", ".join(f"{event} {int(v)}" for event, v in lost.items())
        + "; efdl commits every step, so a crash repeats at most the step in flight."
    )
    for event, results in table.items():  # TorchFT: efdl at or below it on every event
        if not results.get("torchft") or not results.get("efdl"):
            continue
        for part, what in ((0, "to the first step at the new size"), (1, "stood still")):
            e, f = median_of(results["efdl"], part), median_of(results["torchft"], part)
            if e is None or f is None:
                lines.append(
                    f"- {event} vs TorchFT, {what}: efdl "
                    f"{'did not recover' if e is None else f'{e:.2f} s'}, TorchFT "
                    f"{'did not recover' if f is None else f'{f:.2f} s'}."
                )
                continue
            lines.append(
                f"- {event} vs TorchFT, {what}: efdl {e:.2f} s, TorchFT {f:.2f} s (goal: efdl "
                f"at or below: {verdict(e <= f)})."
            )
    for event, results in table.items():  # restart mode: plain scripts, goal 1.5x tuned
        r, t = median_of(results.get("restart", []), 0), median_of(results.get("tuned", []), 0)
        if r is None or not results.get("tuned"):
            continue
        speedup = f"{t / r:.2f}x" if t is not None else "tuned torchrun did not recover"
        lines.append(
            f"- restart mode, {event}: efdl {r:.2f} s vs tuned torchrun "
            f"{'-' if t is None else f'{t:.2f}'} s: {speedup} (goal >= 1.5x: "
            f"{verdict(t is None or t / r >= 1.5)})."
        )
    print("Against the goals (computed from the tables above):\n")
    print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

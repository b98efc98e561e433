"""Real efdl-run processes on 127.0.0.1, and the JSON lines their workers write."""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from efdl.launcher import warm

SCRIPTS = Path(__file__).parent / "scripts"
# Worker lines labelled [rankN]: (the tests tell the ranks' lines apart by it).
EFDL_RUN = [sys.executable, "-c", "from efdl.cli.run import run_main; run_main()", "--rank-prefix"]


def standalone(
    script: Path,
    *args: str,
    script_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 200,
) -> subprocess.CompletedProcess[str]:
    """``efdl-run --standalone ARGS SCRIPT SCRIPT_ARGS`` to its end (its own embedded etcd); a
    run that hangs fails here, at ``timeout_s``, not at the suite's timeout."""
    return subprocess.run(
        [*EFDL_RUN, "--standalone", *args, str(script), *script_args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )


def lines_changed_for_efdl(example: Path, version: str = "train_efdl.py") -> int:
    """How many lines of ``example/train_torchrun.py`` the efdl version (``train_efdl.py``
    beside it; or another ``version``, such as TorchFT's) changes, adds or removes, the module
    docstrings aside."""

    def code(name: str) -> list[str]:
        return (example / name).read_text().split('"""', 2)[2].splitlines()

    matcher = difflib.SequenceMatcher(a=code("train_torchrun.py"), b=code(version))
    return sum(
        max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"
    )


def rank0_rows(output: str) -> list[dict[str, object]]:
    """The JSON lines rank 0 printed, as efdl-run passes them on (``[rank0]: {...}``)."""
    return [json.loads(line[9:]) for line in output.splitlines() if line.startswith("[rank0]: {")]


class Agent:
    """One ``efdl-run`` process; its output goes to a file; stopped by PID."""

    def __init__(
        self,
        name: str,
        args: list[str],
        out_dir: Path,
        env: dict[str, str],
        wrap: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.log = out_dir / f"agent-{name}.log"
        self._file = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(  # ``wrap`` must exec the command (same PID): ip netns exec
            [*wrap, *EFDL_RUN, *args],
            stdout=self._file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env, "OUT_DIR": str(out_dir)},
        )
        self.pid = self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        """The agent's workers (and their children), not warm processes waiting for a place."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        pids = []
        for p in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.name() not in warm.NAMES:
                    pids.append(p.pid)
        return pids

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout_s: float = 60) -> int:
        """Its exit code; a failure that shows the end of its output if it runs past
        ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {self.name} still runs after {timeout_s:g} s; its output ends:\n"
                + self.output()[-4000:]
            ) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._file.close()


def read_rows(out_dir: Path) -> list[dict[str, object]]:
    """The rows the workers wrote to ``out_dir/events.jsonl`` so far."""
    path = out_dir / "events.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return rows


class Job:
    """Agents of one job and the events their workers wrote."""

    def __init__(
        self,
        out_dir: Path,
        etcd: str,
        job_id: str,
        common: list[str],
        env: dict[str, str] | None = None,
    ) -> None:
        self.out = out_dir
        self.etcd = etcd
        self.job_id = job_id
        self.common = common
        self.env = env or {}
        self.agents: dict[str, Agent] = {}

    def start(
        self,
        name: str,
        *extra: str,
        script: str = "steps.py",
        host: str = "127.0.0.1",
        wrap: tuple[str, ...] = (),
    ) -> Agent:
        args = [
            "--etcd",
            self.etcd,
            "--job-id",
            self.job_id,
            "--node-id",
            name,
            "--host",
            host,
            *self.common,
            *extra,
            str(SCRIPTS / script),
        ]
        agent = Agent(name, args, self.out, self.env, wrap)
        self.agents[name] = agent
        return agent

    def events(self) -> list[dict[str, object]]:
        return read_rows(self.out)

    def wait_for(
        self, what: str, pred: Callable[[list[dict[str, object]]], bool], timeout_s: float = 90
    ) -> list[dict[str, object]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = self.events()
            if pred(rows):
                return rows
            time.sleep(0.2)
        logs = "\n".join(f"--- {n}\n{a.output()[-8000:]}" for n, a in self.agents.items())
        raise AssertionError(f"timed out waiting for {what}\n{logs}")

    def stop(self) -> None:
        for a in self.agents.values():
            a.stop()
        # An agent killed by signal leaves its run directory (efdl-<job>-*, its socket and
        # the workers' error files) behind: the job id is this job's alone.
        for d in Path(tempfile.gettempdir()).glob(f"efdl-{self.job_id}-*"):
            shutil.rmtree(d, ignore_errors=True)


def regrown(world: int) -> Callable[[list[dict[str, object]]], bool]:
    """True once a ``world``-sized generation after one with fewer workers (a worker was
    lost and the others went on without it) made 3 steps on every rank."""

    def pred(rows: list[dict[str, object]]) -> bool:
        smaller = [int(r["gen"]) for r in rows if int(r["world"]) < world]  # type: ignore[call-overload]
        return bool(smaller) and steps_at_world(world, max(smaller))(rows)

    return pred


def steps_at_world(world: int, since_gen: int = 0) -> Callable[[list[dict[str, object]]], bool]:
    """True once every rank of a ``world``-sized generation (after ``since_gen``) made 3 steps."""

    def pred(rows: list[dict[str, object]]) -> bool:
        by_gen: dict[int, dict[int, int]] = {}
        for r in rows:
            gen = int(r["gen"])  # type: ignore[call-overload]
            if r["world"] == world and gen > since_gen:
                ranks = by_gen.setdefault(gen, {})
                rank = int(r["rank"])  # type: ignore[call-overload]
                ranks[rank] = ranks.get(rank, 0) + 1
        return any(len(v) == world and min(v.values()) >= 3 for v in by_gen.values())

    return pred


def latest_gen(rows: list[dict[str, object]]) -> int:
    return max((int(r["gen"]) for r in rows), default=0)  # type: ignore[call-overload]


# The agent arguments of the in-place (efdl-aware script) tests, lease TTL aside.
ELASTIC_ARGS = [
    "--settle",
    "0.5",
    "--grace-period",
    "10",
    "--min",
    "1",
    "--max",
    "4",
    "--nproc-per-node",
    "1",
]


def restart_job(out_dir: Path, etcd: str, prefix: str) -> Job:
    """A job of plain torchrun scripts (restart mode): lease TTL 3 s, 0.1 s per step."""
    return Job(
        out_dir,
        etcd,
        f"{prefix}-{uuid.uuid4().hex[:8]}",
        ["--lease-ttl", "3", "--settle", "0.5", "--grace-period", "5"],
        env={"STEP_SECONDS": "0.1"},
    )


def in_place_job(out_dir: Path, etcd: str, prefix: str) -> Job:
    """A job of in-place (efdl-aware) workers: lease TTL 3 s, 0.1 s of sleep per step."""
    return Job(
        out_dir,
        etcd,
        f"{prefix}-{uuid.uuid4().hex[:8]}",
        ["--lease-ttl", "3", *ELASTIC_ARGS],
        env={"STEP_SECONDS": "0.1"},
    )


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for ``pids`` to exit; the ones still alive."""
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def check_consistent(rows: list[dict[str, object]]) -> None:
    """All ranks of a generation hold bit-identical parameters at every step; every update
    starts from parameters some rank held after the step before (an update applied twice, or
    applied and not counted, breaks that chain); and a worker's step never goes back beyond
    its last commit."""
    digests: dict[tuple[object, object], set[object]] = defaultdict(set)
    after: dict[int, set[object]] = defaultdict(set)
    for r in rows:
        digests[(r["gen"], r["step"])].add(r["digest"])
        after[int(r["step"])].add(r["digest"])  # type: ignore[call-overload]
    bad = {k: v for k, v in digests.items() if len(v) > 1}
    assert not bad, f"ranks disagree on parameters: {list(bad.items())[:3]}"
    missing = sorted(set(range(min(after, default=1), max(after, default=0) + 1)) - set(after))
    assert not missing, f"steps counted that no rank trained: {missing[:5]}"
    for r in rows:
        step = int(r["step"])  # type: ignore[call-overload]
        if step > 1 and "before" in r and (step - 1) in after:
            assert r["before"] in after[step - 1], (
                f"step {step} (pid {r['pid']}, generation {r['gen']}) started from parameters "
                f"no rank held after step {step - 1}"
            )
    last: dict[object, int] = {}
    for r in rows:
        pid, step = r["pid"], int(r["step"])  # type: ignore[call-overload]
        if pid in last:
            assert step > last[pid] - 1, f"pid {pid} went back from step {last[pid]} to {step}"
        last[pid] = step


def pids_of(rows: list[dict[str, object]], node: str) -> set[object]:
    return {r["pid"] for r in rows if r["node"] == node}


def last_step_of(rows: list[dict[str, object]], gen: int) -> dict[object, int]:
    """Each rank's last step in generation ``gen``."""
    out: dict[object, int] = {}
    for r in rows:
        if r["gen"] == gen:
            out[r["rank"]] = max(out.get(r["rank"], 0), int(r["step"]))  # type: ignore[call-overload]
    return out

"""A fleet of real ``efdl node`` daemons on one etcd, each host with stand-in GPUs
(tests/fakes/pynvml.py, reading a file this harness changes to start or end a "foreign"
process): what tests/e2e/test_fleet.py, tests/e2e/test_fleet_isolation.py and the fleet
benchmark's real run (benchmarks/fleet.py) drive. Every process the daemons start is stopped
by PID at the end.

The daemons run as root here, so they are told how to run jobs: as the daemon's own user
(``--job-uids shared``, the default here) or each as a uid of its own. This machine's Python
lives under a directory other users may not enter (/root, mode 0700); a daemon that runs
jobs under their own uids is started in a mount namespace of its own where that directory is
an empty one others may enter, with the Python's own directory bound into it (nothing
outside that daemon's processes sees it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

from efdl.fleet.records import FleetKeys, JobSpec, JobStatus
from efdl.fleet.registry import read_fleet, submit
from efdl.rendezvous.api import EtcdSettings
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from tests.e2e.harness import SCRIPTS, latest_gen, read_rows
from tests.wait import wait_until

FAKES = Path(__file__).parents[1] / "fakes"


class Fleet:
    """Host daemons of one fleet, each with its stand-in GPUs; every process they started is
    stopped by PID at the end."""

    def __init__(
        self,
        server: EmbeddedEtcd,
        tmp: Path,
        resize_interval_s: float = 1.0,
        job_uids: str = "shared",
        daemon_env: dict[str, str] | None = None,
        settings: EtcdSettings | None = None,
        daemon_args: tuple[str, ...] = (),
    ) -> None:
        """``job_uids``: the daemons' --job-uids; ``daemon_env``: more of their environment
        (etcd credentials); ``settings``: how this harness reaches etcd (default: as the
        server's, no credentials); ``daemon_args``: more of the daemons' flags."""
        self.server, self.tmp = server, tmp
        self.resize_interval_s = resize_interval_s
        self.job_uids, self.daemon_args = job_uids, daemon_args
        self.keys = FleetKeys(f"t{uuid.uuid4().hex[:8]}")
        self.store = EtcdStore(settings or server.settings())
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.gpus: dict[str, list[dict[str, object]]] = {}
        self.job_ids: dict[str, str] = {}
        base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        path = os.pathsep.join(p for p in (str(FAKES), base.get("PYTHONPATH", "")) if p)
        self.env = {**base, "PYTHONPATH": path, "EFDL_ETCD": str(server.endpoint)}
        self.env["EFDL_FLEET"] = self.keys.fleet
        self.env.update(daemon_env or {})

    def nvml_file(self, name: str) -> Path:
        return self.tmp / f"{name}.nvml.json"

    def host(self, name: str, gpus: int = 2) -> None:
        self.gpus[name] = [{"uuid": f"GPU-{name}-{i}", "processes": []} for i in range(gpus)]
        self.nvml_file(name).write_text(json.dumps(self.gpus[name]))
        self.start(name)

    def simulated_host(self, name: str, gpus: int) -> None:
        """A host as a user tries the fleet without GPUs: EFDL_SIMULATED_GPUS, no stand-in."""
        self.start(name, {"EFDL_SIMULATED_GPUS": str(gpus)})

    def start(self, name: str, env: dict[str, str] | None = None) -> None:
        """Start host ``name``'s daemon (``env``: instead of its stand-in NVML's file)."""
        log = open(self.tmp / f"node-{name}.log", "ab")  # noqa: SIM115
        argv = [
            sys.executable, "-m", "efdl", "node", "--host-id", name, "--host", "127.0.0.1",
            "--state-dir", str(self.tmp / f"state-{name}"), "--lease-ttl", "3",
            "--resize-interval", str(self.resize_interval_s), "--resume-after", "0",
            "--preempt-after", "0", "--protect", "0",
            "--job-uids", self.job_uids,
            *self.daemon_args,
        ]  # fmt: skip
        if self.job_uids != "shared":
            stash = self.tmp / f"stash-{name}"
            stash.mkdir(mode=0o700, exist_ok=True)
            argv = python_for_every_user(argv, stash)
        self.daemons[name] = subprocess.Popen(
            argv,
            env={**self.env, **(env or {"EFDL_FAKE_NVML_FILE": str(self.nvml_file(name))})},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()

    def foreign(self, name: str, gpu: int, pid: int | None = 4_000_000) -> None:
        """A process that is not efdl's starts on ``gpu`` of host ``name`` (None: it ends)."""
        self.gpus[name][gpu]["processes"] = [] if pid is None else [pid]
        tmp = self.nvml_file(name).with_suffix(".tmp")
        tmp.write_text(json.dumps(self.gpus[name]))
        os.replace(tmp, self.nvml_file(name))

    def submit(
        self,
        name: str,
        lo: int,
        hi: int,
        priority: int,
        cache: bool = False,
        argv: tuple[str, ...] = ("elastic_steps.py",),
        workdir: Path = SCRIPTS,
        env: dict[str, str] | None = None,
    ) -> Path:
        """Submit job ``name`` (its id gets a suffix); returns its output directory
        ($OUT_DIR). ``env``: the workers' knobs (default: elastic_steps.py's, 0.2 s steps)."""
        job_id = self.job_ids.setdefault(name, f"{name}-{uuid.uuid4().hex[:6]}")
        out = self.tmp / name
        out.mkdir()
        if self.job_uids != "shared":
            out.chmod(0o777)  # the job's uid writes there
        knobs = env if env is not None else {
            "STEP_SECONDS": "0.2", "EFDL_SETTLE": "0.5", "EFDL_LEASE_TTL": "3",
            "EFDL_GRACE_PERIOD": "15", "DIGEST": "0", "EFDL_WARM_WORKERS": "0",
        }  # fmt: skip
        url = f"file://{self.tmp}/cache-{name}" if cache else ""
        spec = JobSpec(
            job_id, argv, str(workdir), lo, hi, priority, url,
            tuple(sorted({**knobs, "OUT_DIR": str(out)}.items())), submitted=time.time(),
        )  # fmt: skip
        submit(self.store, self.keys, spec)
        return out

    def status(self, name: str) -> JobStatus:
        jobs = {j.spec.job_id: j.status for j in read_fleet(self.store, self.keys).jobs}
        return jobs[self.job_ids[name]]

    def agents(self, host: str = "*") -> list[dict[str, object]]:
        """The daemons' agents (of ``host``: all), as their state files have them (pid,
        job_id, gpus, stopping...)."""
        rows: list[dict[str, object]] = []
        for state in self.tmp.glob(f"state-{host}/agents.json"):
            try:
                rows += json.loads(state.read_text())
            except ValueError:
                continue
        return rows

    def agent_pids(self) -> list[int]:
        return [int(str(r["pid"])) for r in self.agents()]

    def agent_on(self, host: str, gpu: int) -> int:
        """The PID of the agent running on ``gpu`` of ``host``."""
        for row in self.agents(host):
            if gpu in row["gpus"] and not row["stopping"]:  # type: ignore[operator]
                return int(str(row["pid"]))
        raise LookupError(f"no agent on {host}:{gpu}")

    def logs(self) -> str:
        """What the daemons and agents said, the jobs' statuses and their newest steps."""
        parts = [f"--- {self.job_ids.get(n, n)}: {newest(self.tmp / n)}" for n in self.job_ids]
        try:
            parts += [
                f"--- {j.spec.job_id}: {j.status}" for j in read_fleet(self.store, self.keys).jobs
            ]
        except Exception as exc:  # the logs must come out whatever etcd says
            parts.append(f"--- the fleet could not be read: {exc}")
        return "\n".join([*parts, self._files()])

    def _files(self) -> str:
        parts = [
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in self.tmp.glob("node-*.log")
        ]
        parts += [
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in self.tmp.glob("state-*/logs/*.log")
        ]
        return "\n".join(parts)

    def wait(self, what: str, pred: Callable[[], object], timeout_s: float = 240) -> None:
        """wait_until, with the daemons' and agents' logs in the failure."""
        try:
            wait_until(what, pred, timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def close(self) -> None:
        for p in self.daemons.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=30)
        procs: list[psutil.Process] = []
        for pid in self.agent_pids():
            try:
                wrapper = psutil.Process(pid)  # efdl.fleet.wrap: the agent is its child
                procs += [wrapper, *wrapper.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(procs, timeout=30)
        self.store.close()
        # Agents killed by signal leave their run directories (efdl-<job>-*) behind.
        for job_id in self.job_ids.values():
            for d in Path(tempfile.gettempdir()).glob(f"efdl-{job_id}-*"):
                shutil.rmtree(d, ignore_errors=True)


def python_for_every_user(argv: list[str], stash: Path) -> list[str]:
    """``argv``, run in a mount namespace of its own where every user may start this Python:
    the first directory above it that others may not enter (/root here) is an empty tmpfs
    (mode 0755) there, with the real one's entry on the way to the Python bound into it
    (through ``stash``, a mount point of this harness's). The shell execs the command: it is
    no ancestor of the daemon's. Unchanged where every user may start it already."""
    named = Path(sys.executable).absolute()
    exe = named.resolve()  # where the interpreter is: a virtual environment's python links there
    shut = [d for d in reversed(named.parents) if not d.stat().st_mode & stat.S_IXOTH]
    assert all(d in exe.parents for d in shut), f"{shut[0]}: make it o+x (a venv's directory)"
    blocked = next((d for d in reversed(exe.parents) if not d.stat().st_mode & stat.S_IXOTH), None)
    if blocked is None:
        return argv
    inner = exe.relative_to(blocked).parts[0]
    script = (
        'set -e; mount --bind "$1" "$2"; mount -t tmpfs -o mode=0755 tmpfs "$1"; '
        'mkdir "$1/$3"; mount --bind "$2/$3" "$1/$3"; umount -l "$2"; shift 3; exec "$@"'
    )
    return [
        "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
        str(blocked), str(stash), inner, *argv,
    ]  # fmt: skip


def step_rows(out: Path) -> list[dict[str, object]]:
    """The job's rows of trained steps (not its workers' entries)."""
    return [r for r in read_rows(out) if "step" in r and "world" in r]


def newest(out: Path) -> dict[str, object]:
    """The newest step row's world size and generation, and the PIDs that trained in it."""
    steps = step_rows(out)
    if not steps:
        return {"world": 0, "gen": -1, "pids": set()}
    gen = latest_gen(steps)
    at = [r for r in steps if r["gen"] == gen]
    return {"world": at[-1]["world"], "gen": gen, "pids": {r["pid"] for r in at}}

"""A fleet of real ``efdl node`` daemons (stand-in NVML: tests/fakes/pynvml.py, its GPUs read
from a file the test changes) running real efdl-run agents and gloo workers, with a real
etcd: a job grows onto free GPUs, shrinks in place for a higher-priority job, gives a GPU
back to a foreign process and grows back when it ends, is suspended to its cache for a
higher-priority job and resumes from it, and trains on through its host daemon's SIGKILL and
restart."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from efdl.fleet.model import FleetKeys, JobSpec, JobStatus, Phase
from efdl.fleet.registry import cancel, read_events, read_fleet, submit
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from tests.e2e.harness import SCRIPTS, latest_gen, read_rows
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(420)
FAKES = Path(__file__).parents[1] / "fakes"


class Fleet:
    """Host daemons of one fleet, each with its stand-in GPUs; every process they started is
    stopped by PID at the end."""

    def __init__(self, server: EmbeddedEtcd, tmp: Path) -> None:
        self.server, self.tmp = server, tmp
        self.keys = FleetKeys(f"t{uuid.uuid4().hex[:8]}")
        self.store = EtcdStore(server.settings())
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.gpus: dict[str, list[dict[str, object]]] = {}
        self.job_ids: dict[str, str] = {}
        base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        path = os.pathsep.join(p for p in (str(FAKES), base.get("PYTHONPATH", "")) if p)
        self.env = {**base, "PYTHONPATH": path, "EFDL_ETCD": str(server.endpoint)}
        self.env["EFDL_FLEET"] = self.keys.fleet

    def nvml_file(self, name: str) -> Path:
        return self.tmp / f"{name}.nvml.json"

    def host(self, name: str, gpus: int = 2) -> None:
        self.gpus[name] = [{"uuid": f"GPU-{name}-{i}", "processes": []} for i in range(gpus)]
        self.nvml_file(name).write_text(json.dumps(self.gpus[name]))
        self.start(name)

    def start(self, name: str) -> None:
        log = open(self.tmp / f"node-{name}.log", "ab")  # noqa: SIM115
        self.daemons[name] = subprocess.Popen(
            [sys.executable, "-m", "efdl", "node", "--host-id", name, "--host", "127.0.0.1",
             "--state-dir", str(self.tmp / f"state-{name}"), "--lease-ttl", "3",
             "--resize-interval", "1"],
            env={**self.env, "EFDL_FAKE_NVML_FILE": str(self.nvml_file(name))},
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

    def submit(self, name: str, lo: int, hi: int, priority: int, cache: bool = False) -> Path:
        job_id = self.job_ids.setdefault(name, f"{name}-{uuid.uuid4().hex[:6]}")
        out = self.tmp / name
        out.mkdir()
        env = {"OUT_DIR": str(out), "STEP_SECONDS": "0.2", "EFDL_SETTLE": "0.5",
               "EFDL_LEASE_TTL": "3", "EFDL_GRACE_PERIOD": "15", "DIGEST": "0",
               "EFDL_WARM_WORKERS": "0"}  # fmt: skip
        url = f"file://{self.tmp}/cache-{name}" if cache else ""
        spec = JobSpec(
            job_id, ("elastic_steps.py",), str(SCRIPTS), lo, hi, priority, url,
            tuple(sorted(env.items())), submitted=time.time(),
        )  # fmt: skip
        submit(self.store, self.keys, spec)
        return out

    def status(self, name: str) -> JobStatus:
        jobs = {j.spec.job_id: j.status for j in read_fleet(self.store, self.keys).jobs}
        return jobs[self.job_ids[name]]

    def agents(self) -> list[dict[str, object]]:
        """Every daemon's agents, as its state file has them (pid, job_id, gpus...)."""
        rows: list[dict[str, object]] = []
        for state in self.tmp.glob("state-*/agents.json"):
            try:
                rows += json.loads(state.read_text())
            except ValueError:
                continue
        return rows

    def agent_pids(self) -> list[int]:
        return [int(str(r["pid"])) for r in self.agents()]

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
                shell = psutil.Process(pid)
                procs += [shell, *shell.children(recursive=True)]
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


@pytest.fixture()
def fleet(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(etcd_server, tmp_path)
    try:
        yield f
    finally:
        f.close()


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


def trains_at(out: Path, world: int) -> bool:
    n = newest(out)
    return n["world"] == world and len(n["pids"]) == world  # type: ignore[arg-type]


def test_a_job_fills_free_gpus_then_shrinks_in_place_for_priority_and_for_a_foreign_process(
    fleet: Fleet,
) -> None:
    fleet.host("gpu-a.us-central1-a.c.proj.internal")
    fleet.host("gpu-b.us-central1-a.c.proj.internal")
    low = fleet.submit("low", 1, 4, 0)
    fleet.wait("job low on all 4 GPUs", lambda: trains_at(low, 4), 240)
    before = newest(low)
    high = fleet.submit("high", 2, 2, 5)
    fleet.wait("job high to train", lambda: trains_at(high, 2), 240)
    fleet.wait("job low on 2 GPUs", lambda: trains_at(low, 2), 240)
    after = newest(low)
    assert after["pids"] <= before["pids"]  # type: ignore[operator]  # survivors, in place
    assert (
        f"shrunk by 2 GPUs for {fleet.job_ids['high']} (priority 5)" in fleet.status("low").reason
    )
    # inference takes one of low's GPUs: low goes on, in place, on the other
    host, indices = fleet.status("low").gpus[0]
    fleet.foreign(host, indices[0])
    fleet.wait("job low on 1 GPU", lambda: trains_at(low, 1), 240)
    one = newest(low)
    assert one["pids"] <= after["pids"]  # type: ignore[operator]
    assert "taken by a process that is not efdl's" in fleet.status("low").reason
    assert fleet.status("high").phase is Phase.RUNNING
    # inference ends: low grows back onto the freed GPU, in place
    fleet.foreign(host, indices[0], pid=None)
    fleet.wait("job low on 2 GPUs again", lambda: trains_at(low, 2), 240)
    assert one["pids"] <= newest(low)["pids"]  # type: ignore[operator]
    assert "grew by 1 GPU onto free GPUs" in fleet.status("low").reason


def test_a_job_suspended_for_a_higher_priority_one_resumes_from_its_cache(
    fleet: Fleet,
) -> None:
    """low cannot shrink below its min for high: it persists, stops, and resumes from its
    cache when high ends, at the step it had committed, on all the GPUs again."""
    fleet.host("gpu-d.us-central1-a.c.proj.internal")
    low = fleet.submit("low", 2, 2, 0, cache=True)
    fleet.wait("job low on 2 GPUs", lambda: trains_at(low, 2), 240)
    fleet.wait("a few steps of low", lambda: len(read_rows(low)) > 10, 120)
    high = fleet.submit("high", 2, 2, 5)
    fleet.wait("job low suspended", lambda: fleet.status("low").phase is Phase.SUSPENDED, 120)
    why = [e.status.reason for e in read_events(fleet.store, fleet.keys)[0]]  # (its status
    # moves on to why it waits; the history keeps why it was suspended)
    assert any(f"suspended to make room for {fleet.job_ids['high']}" in w for w in why), why
    fleet.wait("job high to train", lambda: trains_at(high, 2), 240)
    fleet.wait("low's agents gone", lambda: not any(
        a["job_id"] == fleet.job_ids["low"] for a in fleet.agents()), 120)  # fmt: skip
    before = step_rows(low)
    top = max(int(r["step"]) for r in before)
    cancel(fleet.store, fleet.keys, fleet.job_ids["high"])
    fleet.wait("job low resumed", lambda: fleet.status("low").phase is Phase.RUNNING, 240)
    assert "resumed" in fleet.status("low").reason
    fleet.wait(
        "job low training again on 2 GPUs",
        lambda: len(step_rows(low)) > len(before) and trains_at(low, 2),
        240,
    )
    resumed = step_rows(low)[len(before) :]
    first = min(int(r["step"]) for r in resumed)
    # step N logged means N - 1 was committed; all of low's ranks persisted on leaving
    assert top <= first <= top + 1, (top, first)  # no committed step lost, none skipped
    assert not {r["pid"] for r in resumed} & {r["pid"] for r in before}  # new workers


def test_a_host_daemon_killed_and_restarted_does_not_stop_training(fleet: Fleet) -> None:
    """Even when it comes back after its lease expired (under load, a restart can take
    longer than the TTL): it registers its host before it allocates, and adopts its agents."""
    name = "gpu-c.us-central1-a.c.proj.internal"
    fleet.host(name)
    job = fleet.submit("steady", 2, 2, 0)
    fleet.wait("job steady to train", lambda: trains_at(job, 2), 240)
    gen = newest(job)["gen"]
    fleet.daemons[name].send_signal(signal.SIGKILL)
    fleet.daemons[name].wait(timeout=30)
    steps = len(read_rows(job))
    wait_until("steps while the daemon is away", lambda: len(read_rows(job)) > steps + 5, 120)
    # Away longer than its lease: its host record is gone when it comes back.
    fleet.wait("the host record to expire", lambda: fleet.store.get(fleet.keys.host(name)) is None)
    fleet.start(name)
    fleet.wait(
        "the new daemon to adopt the agent",
        lambda: "adopted agent" in (fleet.tmp / f"node-{name}.log").read_text(),
        120,
    )
    steps = len(read_rows(job))
    wait_until("steps after the restart", lambda: len(read_rows(job)) > steps + 10, 120)
    assert newest(job)["gen"] == gen  # no rescale, no restart: the same generation trains
    assert fleet.status("steady").phase is Phase.RUNNING

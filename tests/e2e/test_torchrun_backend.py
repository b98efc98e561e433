"""Stock torchrun 2.13 with efdl's etcd v3 rendezvous (--rdzv-backend efdl), real etcd, gloo:
start, a node added (torchrun restarts for it), a node killed, a clean finish."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.records import JobKeys
from tests.e2e.harness import SCRIPTS, Job, steps_at_world, wait_gone

pytestmark = pytest.mark.timeout(300)


class Torchrun:
    """One torchrun agent; its workers live in sessions of their own, so it is stopped
    together with its descendants, by PID."""

    def __init__(self, name: str, job: Job, env: dict[str, str]) -> None:
        self.log = job.out / f"torchrun-{name}.log"
        self._file = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1:3",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "efdl",
                "--rdzv-endpoint",
                job.etcd,
                "--rdzv-id",
                job.job_id,
                "--rdzv-conf",
                f"node_id={name},last_call_timeout=0.5,lease_ttl=3,timeout=60",
                "--max-restarts",
                "10",
                "--monitor-interval",
                "0.5",
                "--local-addr",
                "127.0.0.1",
                str(SCRIPTS / "steps.py"),
            ],
            stdout=self._file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env, "OUT_DIR": str(job.out)},
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tree(self) -> list[int]:
        with contextlib.suppress(psutil.NoSuchProcess):
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        return []

    def kill(self) -> list[int]:
        """SIGKILL the agent and every process under it (a node dies)."""
        pids = self.tree()
        for pid in [self.proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        return pids

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._file.close()


@pytest.fixture()
def job(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[tuple[Job, dict[str, Torchrun]]]:
    j = Job(tmp_path, etcd_server.endpoint.target, f"tr-{uuid.uuid4().hex[:8]}", [])
    runs: dict[str, Torchrun] = {}
    yield j, runs
    for r in runs.values():
        r.stop()


def test_torchrun_starts_grows_and_survives_a_dead_node(
    job: tuple[Job, dict[str, Torchrun]],
) -> None:
    j, runs = job
    env = {"STEP_SECONDS": "0.05"}
    runs["a"] = Torchrun("a", j, env)
    runs["b"] = Torchrun("b", j, env)
    j.wait_for("torchrun with two nodes", steps_at_world(2, -1), timeout_s=120)
    runs["c"] = Torchrun("c", j, env)  # num_nodes_waiting > 0: a and b restart for it
    j.wait_for("torchrun with three nodes", steps_at_world(3, -1), timeout_s=120)
    before = {r["pid"] for r in j.events()}
    workers = runs["c"].kill()
    assert not wait_gone(workers, 10)  # SIGKILLed, but reaped by init a moment later
    rows = j.wait_for(  # a and b restarted their workers without c
        "torchrun back to two nodes",
        lambda rs: sum(1 for r in rs if r["world"] == 2 and r["pid"] not in before) >= 6,
        timeout_s=120,
    )
    assert {r["world"] for r in rows} == {2, 3}


def test_torchrun_finishes_cleanly_and_leaves_no_record(
    job: tuple[Job, dict[str, Torchrun]], etcd_server: EmbeddedEtcd
) -> None:
    from efdl.rendezvous.etcd_store import EtcdStore

    j, runs = job
    env = {"STEP_SECONDS": "0.02", "STEPS": "20"}
    runs["a"] = Torchrun("a", j, env)
    runs["b"] = Torchrun("b", j, env)
    for name in ("a", "b"):
        assert runs[name].proc.wait(timeout=120) == 0, runs[name].output()[-3000:]
    assert max(int(r["step"]) for r in j.events()) == 19  # type: ignore[call-overload]
    with EtcdStore(etcd_server.settings()) as store:
        assert store.get_prefix(JobKeys(j.job_id).nodes).kvs == ()  # both left (shutdown)


def test_efdl_stop_ends_torchrun_agents_calmly(job: tuple[Job, dict[str, Torchrun]]) -> None:
    j, runs = job
    env = {"STEP_SECONDS": "0.05"}
    runs["a"] = Torchrun("a", j, env)
    runs["b"] = Torchrun("b", j, env)
    j.wait_for("torchrun with two nodes", steps_at_world(2, -1), timeout_s=120)
    stop = subprocess.run(
        [sys.executable, "-m", "efdl", "stop", "--etcd", j.etcd, "--job-id", j.job_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stop.returncode == 0, stop.stderr
    for name in ("a", "b"):
        assert runs[name].proc.wait(timeout=60) == 0, runs[name].output()[-3000:]
        out = runs[name].output()
        assert f"ended (stopped by efdl stop): node {name} leaves" in out, out[-3000:]
        # The agents' lines: a worker whose peer on the other node was stopped a moment
        # earlier may print gloo's "Connection reset by peer" before its own SIGTERM comes
        # (torchrun's agents stop their workers each on its own; the wider apart, the
        # busier the machine).
        agent = "\n".join(x for x in out.splitlines() if not x.startswith("[rank"))
        assert "Traceback" not in agent and "RendezvousClosedError" not in out, out[-3000:]

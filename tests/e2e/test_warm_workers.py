"""Warm workers: the agent's fork server imports torch once, and every worker, a replacement
(in place) or a restart (plain script) is forked from it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from efdl.launcher import warm
from efdl.rendezvous.embedded import EmbeddedEtcd
from tests.e2e.harness import (
    Job,
    check_consistent,
    in_place_job,
    latest_gen,
    restart_job,
    steps_at_world,
)
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(240)


def server_pid(job: Job, node: str) -> int:
    """The pid of the node's fork server (the agent's child named for it)."""
    agent = psutil.Process(job.agents[node].proc.pid)
    found = [p for p in agent.children() if p.name() in warm.NAMES]
    assert len(found) == 1, found
    return found[0].pid


def pids_after(rows: list[dict[str, object]], gen: int, upto: int = 1 << 30) -> set[int]:
    """The pids of the workers that logged steps in generations ``gen+1..upto``."""
    return {int(str(r["pid"])) for r in rows if gen < int(str(r["gen"])) <= upto}


@pytest.fixture()
def in_place(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    j = in_place_job(tmp_path, etcd_server.endpoint.target, "warm")
    j.common += ["--warm-workers", "1"]  # as on a GPU node (cold by default on 2 cores)
    yield j
    j.stop()


@pytest.fixture()
def restart(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    j = restart_job(tmp_path, etcd_server.endpoint.target, "warmr")
    j.common += ["--nproc-per-node", "2", "--warm-workers", "1"]
    yield j
    j.stop()


def test_a_crashed_in_place_worker_is_replaced_by_a_warm_process(in_place: Job) -> None:
    job = in_place
    job.start("a", "--nproc-per-node", "2", script="elastic_steps.py")
    rows = job.wait_for("two workers", steps_at_world(2))
    assert all(r["warm"] for r in rows)  # the first workers were forked warm
    server = server_pid(job, "a")
    victim = next(int(r["pid"]) for r in rows if r["rank"] == 1)  # type: ignore[call-overload]
    g = latest_gen(rows)
    os.kill(victim, signal.SIGKILL)
    rows = job.wait_for("the replacement training", steps_at_world(2, g))
    new = pids_after(rows, g) - pids_after(rows, 0, g)
    assert len(new) == 1, new  # the survivor trains on in place
    assert all(r["warm"] for r in rows if int(str(r["pid"])) in new)
    assert all(psutil.Process(pid).ppid() == server for pid in new)  # forked by the server
    check_consistent(rows)


def test_a_restart_starts_every_worker_warm_and_a_killed_fork_server_is_started_again(
    restart: Job,
) -> None:
    """A worker's crash restarts both workers, forked by the one server. The server killed
    (out of memory, by hand): its workers die with it and are restarted, cold while no server
    is there, and the agent starts a new server for the later ones."""
    job = restart
    job.start("a")
    rows = job.wait_for("two workers", steps_at_world(2))
    server = server_pid(job, "a")
    victim = next(int(r["pid"]) for r in rows if r["rank"] == 1)  # type: ignore[call-overload]
    os.kill(victim, signal.SIGKILL)
    g = latest_gen(rows)
    rows = job.wait_for("the restarted workers", steps_at_world(2, g))
    assert len(pids_after(rows, g)) == 2
    assert all(r["warm"] for r in rows)  # type: ignore[call-overload]
    assert server_pid(job, "a") == server  # one server, all along

    g = latest_gen(rows)
    os.kill(server, signal.SIGKILL)
    rows = job.wait_for("the workers restarted after the server", steps_at_world(2, g))
    out = job.agents["a"].output
    wait_until("a new fork server", lambda: "started it again" in out(), 90)


def test_no_warm_processes_with_warm_workers_0(restart: Job) -> None:
    job = restart
    job.start("a", "--warm-workers", "0")
    rows = job.wait_for("two workers", steps_at_world(2))
    assert not any(r["warm"] for r in rows)
    out = job.agents["a"].output()
    assert "warm worker" not in out and "of them warm" not in out, out


def test_a_node_joins_a_job_in_place_at_once(in_place: Job) -> None:
    """Its rank 0 node says (at its probe port) that the job trains in place: a joining
    node does not wait for its warm processes' imports before it joins, since the others
    train on until its workers enter their training functions."""
    job = in_place
    job.start("a", script="elastic_steps.py")
    rows = job.wait_for("one worker", steps_at_world(1))
    job.start("b", script="elastic_steps.py")
    rows = job.wait_for("two workers", steps_at_world(2, latest_gen(rows)))
    out = job.agents["b"].output()
    assert "the job trains in place (generation" in out and "joining once" not in out, out
    check_consistent(rows)


def test_a_node_joining_a_job_by_restarts_waits_for_its_fork_server(restart: Job) -> None:
    """A plain script's job restarts every worker at the round that admits a node: the node
    joins once its warm processes have imported torch, so the others stop only then (here
    it joins as a spare: the job is at its --max)."""
    job = restart
    job.start("a")
    job.wait_for("two workers", steps_at_world(2))
    job.start("b")
    out = job.agents["b"].output
    wait_until("node b to join", lambda: "node b joined" in out(), 90)
    out = job.agents["b"].output()
    assert "joining once this node's fork server" in out and "trains in place" not in out, out

"""Fault rows for a 3-member etcd (the shape users run): losing the member the agents talk to,
or the raft leader, must be invisible to training: no new generation, no worker restarted,
no lease lost, and the longest stall between two steps is recorded. Losing the quorum, or a
paused leader that revokes the leases, is an outage: tests/faults/test_etcd_outage.py."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from efdl.rendezvous.embedded import EtcdCluster
from tests.e2e.harness import last_step_of, latest_gen, pids_of, steps_at_world
from tests.faults.conftest import Recorder
from tests.faults.netns import Net, NetnsCluster
from tests.faults.test_faults import Jobs, check_after, status, stepped_since
from tests.integration.test_etcd_cluster import break_member, leader_of, not_leading

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


class ClusterJobs(Jobs):
    """Jobs on a 3-member etcd, every agent given all three members, m0 first."""

    def __init__(self, cluster: EtcdCluster, tmp: Path) -> None:
        super().__init__(cluster.endpoints, tmp)
        self.cluster = cluster


# A fault done to the cluster; it returns what undoes it (if anything) once the row is done.
Fault = Callable[[EtcdCluster], Callable[[], None]]


def goes_on(
    jobs: ClusterJobs,
    record: Recorder,
    fault: Fault,
    wrap: tuple[str, ...] = (),
    host: str = "127.0.0.1",
) -> None:
    """Two nodes train; the fault happens; training must go on unseen (``wrap``: the command
    prefix the agents run under, e.g. a network namespace, where ``host`` is theirs)."""
    job = jobs.new()  # the agents list m0 first: they talk to it
    for name in ("a", "b"):
        job.start(name, script="elastic_steps.py", host=host, wrap=wrap)
    rows = job.wait_for("2 workers", steps_at_world(2))
    g = latest_gen(rows)
    workers = pids_of(rows, "a") | pids_of(rows, "b")
    committed = max(last_step_of(rows, g).values())
    t0 = time.time()
    undo = fault(jobs.cluster)
    try:
        # Well past a lease TTL (3 s here): a lost lease would show (and be registered again).
        rows = job.wait_for("steps 10 s after", lambda rs: stepped_since(rs, t0 + 10), 60)
    finally:
        undo()
    stamps = sorted(float(r["t"]) for r in rows if r["rank"] == 0)  # type: ignore[arg-type]
    around = [t0, *(t for t in stamps if t > t0)]
    record.recovered(max(b - a for a, b in itertools.pairwise(around)))  # the longest stall
    assert latest_gen(rows) == g, "a new generation: the fault was visible to training"
    assert pids_of(rows, "a") | pids_of(rows, "b") == workers, "a worker was restarted"
    for agent in job.agents.values():
        assert "registering again" not in agent.output(), agent.output()[-3000:]
    check_after(rows, g, committed, since_t=t0)
    assert "world size 2" in status(job, wrap)


@pytest.fixture()
def jobs_on(cluster: EtcdCluster, tmp_path: Path) -> Iterator[ClusterJobs]:
    js = ClusterJobs(cluster, tmp_path)
    yield js
    js.stop()


def test_etcd_member_in_use_sigkilled(jobs_on: ClusterJobs, record: Recorder, attempt: int) -> None:
    """3-member etcd: the member every agent talks to is SIGKILLed while the job trains: the
    agents go on through another member within the lease TTL; no new generation, no worker
    restarted, no lease lost (recovery: the longest stall between two steps)."""
    goes_on(jobs_on, record, lambda c: break_member(c.members[0], "kill"))


def test_etcd_member_in_use_hung(jobs_on: ClusterJobs, record: Recorder, attempt: int) -> None:
    """3-member etcd: the member every agent talks to hangs (SIGSTOP: nothing refuses, nothing
    answers; a follower: a paused leader that resumes revokes leases in etcd < 3.5.8): the
    agents leave it within the lease TTL; no new generation, no worker restarted, no lease
    lost (recovery: the longest stall between two steps)."""
    goes_on(jobs_on, record, lambda c: break_member(not_leading(c, c.members[0]), "stop"))


def test_etcd_leader_sigkilled(jobs_on: ClusterJobs, record: Recorder, attempt: int) -> None:
    """3-member etcd: the raft leader is SIGKILLed while the job trains: a new leader is
    elected and training goes on; no new generation, no worker restarted, no lease lost
    (recovery: the longest stall between two steps)."""
    goes_on(jobs_on, record, lambda c: break_member(leader_of(c), "kill"))


def test_etcd_member_in_use_partitioned(
    net: Net, tmp_path: Path, record: Recorder, attempt: int
) -> None:
    """3-member etcd: the member every agent talks to is cut off by a partition (its link goes
    down in a network namespace of the test's own: packets just stop, nothing refuses), from
    the agents and from the other two members: the agents go on through the majority within
    the lease TTL; no new generation, no worker restarted, no lease lost (recovery: the
    longest stall between two steps)."""

    def cut(_: EtcdCluster) -> Callable[[], None]:
        net.partition()
        return net.heal

    with NetnsCluster(net) as cluster:
        jobs = ClusterJobs(cluster, tmp_path)
        try:
            goes_on(jobs, record, cut, wrap=Net.exec(net.main), host=net.main_addr)
        finally:
            jobs.stop()

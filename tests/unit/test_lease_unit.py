"""LeaseSession on the in-memory store with a manual clock: expiry without a server."""

from __future__ import annotations

import pytest

from efdl.errors import ConfigError, LeaseLostError, StoreConnectionError
from efdl.rendezvous.lease import LeaseSession
from efdl.rendezvous.memory_store import MemoryStore
from tests.wait import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Unreachable(MemoryStore):
    """A store whose lease refreshes fail while ``away`` (etcd hung, or partitioned)."""

    def __init__(self) -> None:
        super().__init__()
        self.away = True
        self.refreshes = 0

    def refresh_lease(self, lease_id: int, timeout_s: float | None = None) -> int:
        self.refreshes += 1
        if self.away:
            raise StoreConnectionError("etcd did not answer")
        return super().refresh_lease(lease_id, timeout_s)


def test_silence_is_not_expiry_etcd_says_when_a_lease_is_gone() -> None:
    """Past the TTL without an answer the lease may or may not be gone (a restarted etcd, or
    a new raft leader, extends it): the session keeps asking, and only etcd's TTL 0 ends it."""
    clock = Clock()
    store = Unreachable()
    lost: list[str] = []
    session = LeaseSession(store, ttl_s=3, clock=clock, on_expired=lost.append)
    clock.now += 10  # three TTLs of silence
    wait_until("refreshes after the TTL", lambda: store.refreshes >= 3, 10)
    assert not session.expired and not lost
    assert session.silent_s >= 10
    store.away = False  # etcd is back and held the lease
    wait_until("a renewal", lambda: session.silent_s < 1, 10)
    assert not session.expired and not lost
    store.revoke_lease(session.lease_id)  # etcd let it expire meanwhile
    clock.now += 2
    wait_until("etcd's word", lambda: lost, 10)
    assert session.expired and "TTL 0" in lost[0]
    with pytest.raises(LeaseLostError):
        session.check()
    session.close(revoke=False)
    store.close()


def test_ttl_below_two_seconds_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"lease TTL \(1 s\) must be at least 2 seconds"):
        LeaseSession(MemoryStore(), ttl_s=1)


def test_a_grant_slower_than_the_ttl_is_refused_and_revoked() -> None:
    """A lease that may have expired before its grant was answered (etcd unreachable for a
    while) must not start a session that counts as lost from birth."""
    clock = Clock()
    store = MemoryStore()
    grant = store.grant_lease

    def slow_grant(ttl_s: int) -> int:
        lease = grant(ttl_s)
        granted.append(lease)
        clock.now += ttl_s + 0.1
        return lease

    granted: list[int] = []
    store.grant_lease = slow_grant  # type: ignore[method-assign]
    with pytest.raises(StoreConnectionError, match=r"took 3\.1 s to grant a lease of TTL 3 s"):
        LeaseSession(store, ttl_s=3, clock=clock)
    assert store.refresh_lease(granted[0], timeout_s=1.0) <= 0  # revoked
    store.close()

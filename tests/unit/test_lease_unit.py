"""LeaseSession on the in-memory store with a manual clock: fencing without a server."""

from __future__ import annotations

import pytest

from efdl.errors import ConfigError, StoreConnectionError
from efdl.rendezvous.lease import LeaseSession
from efdl.rendezvous.memory_store import MemoryStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_silence_for_a_whole_ttl_counts_as_lost() -> None:
    clock = Clock()
    store = MemoryStore()
    session = LeaseSession(store, ttl_s=30, clock=clock)  # the thread waits 10 s: never fires
    assert not session.expired
    clock.now += 29.9
    assert not session.expired
    clock.now += 0.2
    assert session.expired  # even before the keep-alive thread notices
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

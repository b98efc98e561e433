"""LeaseSession on the in-memory store with a manual clock: fencing without a server."""

from __future__ import annotations

import pytest

from efdl.errors import ConfigError
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
    assert not session.lost
    clock.now += 29.9
    assert not session.lost
    clock.now += 0.2
    assert session.lost  # even before the keep-alive thread notices
    session.close(revoke=False)
    store.close()


def test_ttl_below_two_seconds_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"lease TTL \(1 s\) must be at least 2 seconds"):
        LeaseSession(MemoryStore(), ttl_s=1)

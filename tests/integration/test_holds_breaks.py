"""Breaks of issue 57: hold records as untrusted input, with several agents on a real etcd."""

from __future__ import annotations

from collections.abc import Callable

from efdl.rendezvous.holds import HoldKind, hold, release
from efdl.rendezvous.records import JobKeys
from tests.integration.test_rendezvous import Cluster, cluster, shape

__all__ = ["cluster"]  # the fixture, shared


def test_a_quarantine_ending_centuries_from_now_does_not_stop_the_leader(
    cluster: Callable[..., Cluster],
) -> None:
    # A quarantine with a long TTL (an operator's script: "hold it out for good"), its
    # ``until`` within what a hold record accepts (< 1e11): the leader times the end of the
    # first quarantine with its inbox's get(timeout=...), past threading.TIMEOUT_MAX.
    c = cluster(min_workers=1, settle_s=0.2)
    for n in "abc":
        c.add(n)
    c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    keys = JobKeys(c.job)
    store = c.store()
    hold(store, keys, "c", HoldKind.QUARANTINE, "bad DIMM: out for good", 1e10)
    c.wait(shape(("a", 1), ("b", 1)))
    # The leader still decides: a release puts c back.
    assert release(store, keys, "c")
    c.wait(shape(("a", 1), ("b", 1), ("c", 1)), timeout_s=20)

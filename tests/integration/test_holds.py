"""Holds with several agents on a real etcd: the leader leaves a held node out of its rounds
(the node stays registered, the leader too when it is the one held), places it again when the
hold is released or its quarantine ends (the leader times the end itself), and a leader that
takes over reads the holds already there."""

from __future__ import annotations

import time
from collections.abc import Callable

from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.holds import HoldKind, hold, release
from efdl.rendezvous.records import JobKeys
from tests.integration.test_rendezvous import Cluster, cluster, shape

__all__ = ["cluster"]  # the fixture, shared


def three_nodes(cluster: Callable[..., Cluster]) -> tuple[Cluster, JobKeys, EtcdStore]:
    """A job of nodes a, b and c, one worker each, training; its keys and a store."""
    c = cluster(min_workers=1, settle_s=0.2)
    for n in "abc":
        c.add(n)
    c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    return c, JobKeys(c.job), c.store()


def test_a_held_leader_stays_leader_and_is_placed_again_when_its_quarantine_ends(
    cluster: Callable[..., Cluster],
) -> None:
    c, keys, store = three_nodes(cluster)
    held = hold(store, keys, "a", HoldKind.QUARANTINE, "GPU 0 has 1 uncorrectable ECC error", 2.0)
    r = c.wait(shape(("b", 1), ("c", 1)))
    assert "a held out (quarantine: GPU 0 has 1 uncorrectable ECC error)" in r.reason
    assert c.leaders() == ["a"]  # held, not gone: it still leads
    # Nothing but the clock ends it: the leader wakes for it.
    back = c.wait(shape(("b", 1), ("c", 1), ("a", 1)), timeout_s=20)
    assert held.until is not None and time.time() >= held.until
    assert back.generation == r.generation + 1


def test_a_drain_holds_until_released_and_a_new_leader_reads_it(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(min_workers=1, settle_s=0.2)
    for n in "abc":
        c.add(n, probe=True)
    c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    keys = JobKeys(c.job)
    store = c.store()
    hold(store, keys, "c", HoldKind.DRAIN, "kernel update", None)
    c.wait(shape(("a", 1), ("b", 1)))
    c.crash("a")  # b takes over: it reads c's drain as it begins to lead
    c.wait(shape(("b", 1)), "b", "c", timeout_s=30)
    assert c.leaders() == ["b"]
    assert release(store, keys, "c")
    c.wait(shape(("b", 1), ("c", 1)), "b", "c")


def test_a_quarantine_ending_centuries_from_now_does_not_stop_the_leader(
    cluster: Callable[..., Cluster],
) -> None:
    """A leader's timer for a quarantine's end past threading.TIMEOUT_MAX (a breaker's
    find): the leader decides on, and a release puts the node back."""
    # A quarantine with a long TTL (an operator's script: "hold it out for good"), its
    # ``until`` within what a hold record accepts (< 1e11): the leader times the end of the
    # first quarantine with its inbox's get(timeout=...), past threading.TIMEOUT_MAX.
    c, keys, store = three_nodes(cluster)
    hold(store, keys, "c", HoldKind.QUARANTINE, "bad DIMM: out for good", 1e10)
    c.wait(shape(("a", 1), ("b", 1)))
    # The leader still decides: a release puts c back.
    assert release(store, keys, "c")
    c.wait(shape(("a", 1), ("b", 1), ("c", 1)), timeout_s=20)

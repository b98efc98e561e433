"""The election the rendezvous and the fleet share (efdl.rendezvous.election), on the
in-memory store: order by creation, one watcher per key, the guard of a leader's writes."""

from __future__ import annotations

import threading

import pytest

from efdl.rendezvous.api import Put
from efdl.rendezvous.election import Candidate, Election, moved
from efdl.rendezvous.memory_store import MemoryStore

PREFIX = "/efdl/j/nodes/"


@pytest.fixture()
def store() -> MemoryStore:
    return MemoryStore()


def stand(store: MemoryStore, election: Election, name: str) -> Candidate:
    lease = store.grant_lease(60)
    campaign = election.campaign(PREFIX + name, name.encode(), lease)
    assert campaign.candidate is not None
    return campaign.candidate


def test_the_oldest_leads_and_each_other_watches_only_the_one_before_it(
    store: MemoryStore,
) -> None:
    election = Election(store, PREFIX, "Job j")
    a, b, c = (stand(store, election, n) for n in "abc")
    assert election.stand(a).leads
    before_c = election.stand(c)
    assert not before_c.leads and before_c.predecessor is not None
    assert before_c.predecessor.key == b.key  # not the leader: no herd when a goes
    store.revoke_lease(a.lease)
    assert election.stand(b).leads
    assert election.stand(c).predecessor is not None


def test_a_watch_on_the_predecessor_says_when_to_stand_again(store: MemoryStore) -> None:
    election = Election(store, PREFIX, "Job j")
    a, b = stand(store, election, "a"), stand(store, election, "b")
    with election.watch(election.stand(b)) as watch:
        store.put(a.key, b"a, changed", a.lease)  # a new offer: still before b
        changed = watch.get(timeout_s=1)
        assert changed is not None and not moved(changed)
        store.revoke_lease(a.lease)
        gone = watch.get(timeout_s=1)
        assert gone is not None and moved(gone)
    assert election.stand(b).leads


def test_a_campaign_retried_on_its_lease_keeps_its_place_and_another_lease_is_refused(
    store: MemoryStore,
) -> None:
    election = Election(store, PREFIX, "Job j")
    a = stand(store, election, "a")
    again = election.campaign(a.key, b"a", a.lease)  # the first answer was lost
    assert again.candidate == a
    other = election.campaign(a.key, b"a elsewhere", store.grant_lease(60))
    assert other.candidate is None and other.holder is not None
    assert other.holder.value == b"a"


def test_a_key_held_under_another_lease_is_waited_for_never_taken(store: MemoryStore) -> None:
    """A second candidate of the same id (or one restarted within its old lease's TTL) does
    not take the key over, where both would pass its guard: it waits for the key to go,
    then stands, after those already standing."""
    election = Election(store, PREFIX, "Fleet f")
    a, b = stand(store, election, "a"), stand(store, election, "b")
    lease = store.grant_lease(60)
    held = election.campaign(a.key, b"a again", lease)
    assert held.candidate is None and held.holder is not None and held.holder.lease == a.lease
    stop = threading.Event()
    gone = threading.Event()
    waiter = threading.Thread(
        target=lambda: election.wait_gone(held.holder, stop, 0.05) and gone.set()  # type: ignore[arg-type]
    )
    waiter.start()
    try:
        assert not gone.wait(0.3)  # the holder's lease lives: nothing to take
        store.revoke_lease(a.lease)
        assert gone.wait(10)
    finally:
        stop.set()
        waiter.join(10)
    again = election.campaign(a.key, b"a again", lease).candidate
    assert again is not None and again.create_revision > b.create_revision
    assert not election.stand(again).leads and election.stand(b).leads


def test_the_guard_refuses_the_writes_of_a_leader_whose_key_went(store: MemoryStore) -> None:
    election = Election(store, PREFIX, "Job j")
    a = stand(store, election, "a")
    assert store.txn([a.guard], [Put("/efdl/j/round", b"1")]).succeeded
    store.revoke_lease(a.lease)
    again = stand(store, election, "a")  # registered again: a new place
    assert not election.stands(a) and election.stands(again)
    assert not store.txn([a.guard], [Put("/efdl/j/round", b"2")]).succeeded


def test_wait_returns_when_the_predecessor_goes_or_at_stop(store: MemoryStore) -> None:
    election = Election(store, PREFIX, "Fleet f")
    a, b = stand(store, election, "a"), stand(store, election, "b")
    stop = threading.Event()
    stop.set()
    assert not election.wait(b, stop)
    led: list[bool] = []
    waiter = threading.Thread(target=lambda: led.append(election.wait(b, threading.Event())))
    waiter.start()
    store.revoke_lease(a.lease)
    waiter.join(timeout=5)
    assert led == [True]

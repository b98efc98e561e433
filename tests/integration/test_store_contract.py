"""The KVStore contract, run against the in-memory fake and a real etcd alike."""

from __future__ import annotations

import threading
import time

import pytest

from efdl.errors import CompactedError, LeaseLostError
from efdl.rendezvous.api import Compare, Delete, EventType, Get, KVStore, Put, WatchBatch
from efdl.rendezvous.lease import LeaseSession
from tests.wait import wait_until


def drain(watch_get: object, want: int, timeout_s: float = 10.0) -> list[WatchBatch]:
    """Read batches until ``want`` events arrived or the deadline passed."""
    batches: list[WatchBatch] = []
    deadline = time.monotonic() + timeout_s
    while sum(len(b.events) for b in batches) < want and time.monotonic() < deadline:
        batch = watch_get(timeout_s=max(0.01, deadline - time.monotonic()))  # type: ignore[operator]
        if batch is not None:
            batches.append(batch)
    return batches


def test_put_get_delete_and_prefix_with_revision(store: KVStore, prefix: str) -> None:
    r1 = store.put(prefix + "a", b"1")
    r2 = store.put(prefix + "b", b"2")
    store.put(prefix.rstrip("/") + "x/c", b"outside")  # shares the string prefix minus '/'
    assert r2 > r1
    kv = store.get(prefix + "a")
    assert kv is not None and kv.value == b"1" and kv.create_revision == r1 == kv.mod_revision
    snap = store.get_prefix(prefix)
    assert [k.key for k in snap.kvs] == [prefix + "a", prefix + "b"]
    assert snap.revision >= r2
    assert store.delete(prefix + "a") == 1
    assert store.delete(prefix + "a") == 0
    assert store.get(prefix + "a") is None
    assert store.delete(prefix, prefix=True) == 1
    assert store.get_prefix(prefix).kvs == ()


def test_reads_at_a_past_revision_until_it_is_compacted(store: KVStore, prefix: str) -> None:
    r1 = store.put(prefix + "a", b"1")
    store.put(prefix + "b", b"x")
    r3 = store.put(prefix + "a", b"2")
    store.delete(prefix + "b")
    r5 = store.put(prefix + "c", b"3")
    old = store.get(prefix + "a", revision=r1)
    assert old is not None and old.value == b"1" and old.mod_revision == r1
    assert [(kv.key, kv.value) for kv in store.get_prefix(prefix, revision=r3).kvs] == [
        (prefix + "a", b"2"),
        (prefix + "b", b"x"),
    ]
    assert store.get(prefix + "c", revision=r3) is None
    store.compact(r3)
    with pytest.raises(CompactedError, match="compacted"):
        store.get(prefix + "a", revision=r1)
    kv = store.get(prefix + "a", revision=r3)  # the compaction revision itself stays
    assert kv is not None and kv.value == b"2"
    assert [kv.key for kv in store.get_prefix(prefix, revision=r5).kvs] == [
        prefix + "a",
        prefix + "c",
    ]


def test_last_created_finds_the_one_key_before_a_revision(store: KVStore, prefix: str) -> None:
    """etcd's election pattern: one key in the answer however many nodes there are."""
    revs = [store.put(f"{prefix}n{i}", b"x") for i in (3, 1, 2)]
    store.put(prefix + "n3", b"y")  # a change keeps the create revision
    snap = store.last_created(prefix, revs[2])
    assert [kv.key for kv in snap.kvs] == [prefix + "n1"] and snap.revision >= revs[2]
    assert [kv.key for kv in store.last_created(prefix, revs[2] + 10).kvs] == [prefix + "n2"]
    assert store.last_created(prefix, revs[0]).kvs == ()
    assert store.last_created(prefix, 1).kvs == ()


def test_get_range_reads_from_start_up_to_end(store: KVStore, prefix: str) -> None:
    """Time-ordered keys read from a time on (the fleet's events), non-ASCII ones in UTF-8's
    order as etcd sorts them."""
    for k in ("e/001-a", "e/002-b", "e/010-c", "e/011-\u00e9", "e/011-\U0001f600", "f"):
        store.put(prefix + k, b"x")
    keys = [kv.key for kv in store.get_range(prefix + "e/002", prefix + "e/011").kvs]
    assert keys == [prefix + "e/002-b", prefix + "e/010-c"]
    keys = [kv.key for kv in store.get_range(prefix + "e/011", prefix + "e0").kvs]
    assert keys == [prefix + "e/011-\u00e9", prefix + "e/011-\U0001f600"]
    assert store.get_range(prefix + "e/5", prefix + "e/6").kvs == ()


def test_cas_on_create_and_mod_revision(store: KVStore, prefix: str) -> None:
    key = prefix + "round"
    first = store.txn([Compare.absent(key)], [Put(key, b"g1")], [Get(key)])
    assert first.succeeded
    second = store.txn([Compare.absent(key)], [Put(key, b"other")], [Get(key)])
    assert not second.succeeded
    (current,) = second.gets[0]
    assert current.value == b"g1"
    stale = store.txn([Compare.mod_revision_is(key, current.mod_revision - 1)], [Put(key, b"x")])
    assert not stale.succeeded
    ok = store.txn([Compare.mod_revision_is(key, current.mod_revision)], [Put(key, b"g2")])
    assert ok.succeeded
    kv = store.get(key)
    assert kv is not None and kv.value == b"g2" and kv.create_revision == current.create_revision
    assert store.txn([Compare.create_revision_is(key, current.create_revision)], []).succeeded
    assert store.txn(
        [Compare.create_revision_is(key, current.create_revision)], [Delete(key)]
    ).succeeded
    assert store.get(key) is None


def test_concurrent_cas_has_exactly_one_winner(store: KVStore, prefix: str) -> None:
    key = prefix + "leader"
    wins: list[int] = []
    barrier = threading.Barrier(8)

    def contend(i: int) -> None:
        barrier.wait()
        if store.txn([Compare.absent(key)], [Put(key, str(i).encode())]).succeeded:
            wins.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    kv = store.get(key)
    assert kv is not None and kv.value == str(wins[0]).encode()


def test_lease_expiry_removes_attached_keys(store: KVStore, prefix: str) -> None:
    lease = store.grant_lease(2)
    store.put(prefix + "node", b"alive", lease=lease)
    store.put(prefix + "free", b"stays")
    snap = store.get_prefix(prefix)
    with store.watch(prefix, prefix=True, start_revision=snap.revision + 1) as watch:
        t0 = time.monotonic()
        batches = drain(watch.get, 1, timeout_s=10)
        elapsed = time.monotonic() - t0
    events = [e for b in batches for e in b.events]
    assert [(e.type, e.kv.key) for e in events] == [(EventType.DELETE, prefix + "node")]
    assert 1.0 <= elapsed <= 8.0  # etcd expires on its own tick: 2 s TTL, bounded lateness
    assert store.get(prefix + "node") is None
    assert store.get(prefix + "free") is not None
    assert store.refresh_lease(lease) == 0  # a refresh after expiry answers TTL 0


def test_keep_alive_keeps_keys(store: KVStore, prefix: str) -> None:
    with LeaseSession(store, ttl_s=2) as session:
        store.put(prefix + "node", b"alive", lease=session.lease_id)
        time.sleep(5)  # two and a half TTLs: only the keep-alive thread holds it
        assert store.get(prefix + "node") is not None
        assert not session.expired
    # Closing revokes: the key goes at once, not after the TTL.
    assert store.get(prefix + "node") is None


def test_lease_session_reports_a_lost_lease(store: KVStore, prefix: str) -> None:
    reasons: list[str] = []
    session = LeaseSession(store, ttl_s=3, on_expired=reasons.append)
    store.put(prefix + "node", b"alive", lease=session.lease_id)
    store.revoke_lease(session.lease_id)  # what an expiry looks like from the inside
    wait_until("the keep-alive to find the lease revoked", lambda: reasons, 5)
    assert len(reasons) == 1 and "expired" in reasons[0]
    with pytest.raises(LeaseLostError):
        session.check()
    session.close()
    assert store.get(prefix + "node") is None


def test_watch_from_past_revision_replays_in_order(store: KVStore, prefix: str) -> None:
    start = store.get_prefix(prefix).revision + 1
    for i in range(5):
        store.put(prefix + f"k{i % 2}", str(i).encode())
    store.delete(prefix + "k0")
    store.put(prefix.rstrip("/") + "-other/k", b"not mine")
    with store.watch(prefix, prefix=True, start_revision=start) as watch:
        batches = drain(watch.get, 6)
        store.put(prefix + "live", b"new")
        batches += drain(watch.get, 1)
    events = [e for b in batches for e in b.events]
    seen = [(e.type.value, e.kv.key.removeprefix(prefix), e.kv.value) for e in events]
    assert seen == [
        ("put", "k0", b"0"),
        ("put", "k1", b"1"),
        ("put", "k0", b"2"),
        ("put", "k1", b"3"),
        ("put", "k0", b"4"),
        ("delete", "k0", b""),
        ("put", "live", b"new"),
    ]
    revisions = [e.kv.mod_revision for e in events]
    assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
    assert not any(b.reset for b in batches)


def test_transaction_is_one_revision_for_watchers(store: KVStore, prefix: str) -> None:
    start = store.get_prefix(prefix).revision + 1
    store.txn([], [Put(prefix + "a", b"1"), Put(prefix + "b", b"2")])
    with store.watch(prefix, prefix=True, start_revision=start) as watch:
        (batch,) = drain(watch.get, 2)
    assert {e.kv.mod_revision for e in batch.events} == {batch.revision}


def test_watch_from_compacted_revision_relists(store: KVStore, prefix: str) -> None:
    start = store.put(prefix + "a", b"1")
    store.put(prefix + "a", b"2")
    store.put(prefix + "b", b"3")
    store.delete(prefix + "b")
    now = store.put(prefix + "c", b"4")
    store.compact(now)
    with store.watch(prefix, prefix=True, start_revision=start) as watch:
        (batch,) = drain(watch.get, 2)
        assert batch.reset
        assert {(e.kv.key.removeprefix(prefix), e.kv.value) for e in batch.events} == {
            ("a", b"2"),
            ("c", b"4"),
        }
        store.put(prefix + "d", b"5")  # and the watch goes on after the re-list
        (after,) = drain(watch.get, 1)
    assert not after.reset and after.events[0].kv.key == prefix + "d"


def test_single_key_watch_ignores_siblings(store: KVStore, prefix: str) -> None:
    start = store.get_prefix(prefix).revision + 1
    with store.watch(prefix + "round", start_revision=start) as watch:
        store.put(prefix + "round-2", b"no")
        store.put(prefix + "round", b"yes")
        (batch,) = drain(watch.get, 1)
    assert [e.kv.value for e in batch.events] == [b"yes"]


def test_cancelled_watch_delivers_nothing(store: KVStore, prefix: str) -> None:
    watch = store.watch(prefix, prefix=True)
    watch.cancel()
    store.put(prefix + "a", b"1")
    assert watch.get(timeout_s=0.3) is None

"""A job's history in etcd: the same contract on the in-memory fake and a real etcd."""

from __future__ import annotations

import threading
import uuid

import pytest

from efdl.history import follow_events, format_event, read_events, stood_still
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.event_log import EventLog, trim
from efdl.rendezvous.records import Event, EventKind, JobKeys, RecordError
from tests.wait import wait_until


def _job() -> str:
    return f"hist-{uuid.uuid4().hex[:8]}"


def _wait_events(store: KVStore, job: str, n: int) -> list[Event]:
    wait_until(f"{n} events of {job}", lambda: len(read_events(store, job)[0]) >= n, 20)
    return read_events(store, job)[0]


def test_events_are_written_in_order_and_read_back(store: KVStore) -> None:
    job = _job()
    node = "ip-10-0-12-34.eu-west-1.compute.internal"
    log = EventLog(store, job, node)
    log.record(EventKind.JOIN, 0, "joined with 8 worker slots")
    log.record(EventKind.ROUND, 1, "active: ip-10-0-12-34 joined", world_size=8)
    log.record(EventKind.CRASH, 1, "worker rank 3 failed with signal SIGKILL", step=41)
    log.close()
    events = _wait_events(store, job, 3)
    assert [e.kind for e in events] == [EventKind.JOIN, EventKind.ROUND, EventKind.CRASH]
    assert events[2].step == 41 and events[1].world_size == 8 and events[0].node == node
    assert "gen 1" in format_event(events[2]) and "step 41" in format_event(events[2])
    since, _ = read_events(store, job, since=events[1].time)
    assert [e.kind for e in since] == [EventKind.ROUND, EventKind.CRASH]


def test_the_history_is_bounded(store: KVStore) -> None:
    job = _job()
    keys = JobKeys(job)
    for i in range(300):
        e = Event(1_000_000.0 + i, EventKind.PERSIST, "n1", 1, f"step {i}", step=i)
        store.put(e.key(keys), e.to_json())
    assert trim(store, keys, limit=100) == 200
    events, _ = read_events(store, job)
    assert [e.step for e in events] == list(range(200, 300))  # the newest kept


def test_follow_yields_new_events(store: KVStore) -> None:
    job = _job()
    _, revision = read_events(store, job)
    seen: list[Event] = []

    def follow() -> None:
        for e in follow_events(store, job, revision):
            seen.append(e)
            if len(seen) == 2:
                return

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    log = EventLog(store, job, "n1")
    log.record(EventKind.LEAVE, 3, "left on SIGTERM")
    log.record(EventKind.ROUND, 4, "active: n1 left", world_size=1)
    log.close()
    t.join(20)
    assert [e.kind for e in seen] == [EventKind.LEAVE, EventKind.ROUND]


def test_bad_events_are_refused_with_the_field_named() -> None:
    good = Event(1.0, EventKind.JOIN, "n1", 0, "joined").to_json()
    assert Event.from_json(good, "/efdl/j/events/1-n1").kind is EventKind.JOIN
    with pytest.raises(RecordError, match="kind 'explode'; expected one of round, join"):
        Event.from_json(good.replace(b'"join"', b'"explode"'), "k")
    with pytest.raises(RecordError, match="field 'generation' is 'x'"):
        Event.from_json(good.replace(b'"generation":0', b'"generation":"x"'), "k")
    with pytest.raises(RecordError, match="not valid JSON"):
        Event.from_json(b"{", "k")


def test_trained_and_stood_still() -> None:
    e = [
        Event(100.0, EventKind.ROUND, "a", 1, "active: a, b joined", 2),
        Event(110.0, EventKind.RESCALE, "a", 2, "went on at world size 3", 3, 50, 0.25),
        Event(120.0, EventKind.ROUND, "a", 3, "waiting: 1 of 2 workers", 1),
        Event(130.0, EventKind.ROUND, "a", 4, "active: c joined", 2),
    ]
    trained, still = stood_still(e, now=150.0)
    assert still == pytest.approx(10.25) and trained == pytest.approx(39.75)
    assert stood_still(e[:3], now=125.0) == pytest.approx((19.75, 5.25))  # still waiting
    assert stood_still([], now=1.0) == (0.0, 0.0)

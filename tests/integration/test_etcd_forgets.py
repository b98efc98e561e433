"""An etcd that forgets, under a client that watches it (real etcd 3.5.1): emptied (its data
directory lost) or restored from an older backup. The store finds out (a new cluster id, or a
revision below one it saw), tells its listeners, and every watch re-lists what is there now
and goes on from there: a watch that resumed at its old revision would wait on a revision
etcd does not have yet, and never deliver the events written after."""

from __future__ import annotations

import threading
from pathlib import Path

from efdl.rendezvous.api import EventType, Watch, WatchBatch
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from tests.etcd_memory import backup, restore, wipe

DEADLINE_S = 30.0


def next_batch(watch: Watch, timeout_s: float = DEADLINE_S) -> WatchBatch:
    batch = watch.get(timeout_s)
    assert batch is not None, f"no watch event within {timeout_s} s"
    return batch


def until_value(watch: Watch, key: str, value: bytes) -> list[WatchBatch]:
    """The batches up to the one that holds ``key`` at ``value`` (a re-list may come before
    the write, empty, or after it, holding it)."""
    batches: list[WatchBatch] = []
    while not any(e.kv.key == key and e.kv.value == value for b in batches for e in b.events):
        batches.append(next_batch(watch))
    return batches


class Told:
    """What a store's listeners were told (KVStore.on_forgot)."""

    def __init__(self, store: EtcdStore) -> None:
        self.reasons: list[str] = []
        self.event = threading.Event()
        store.on_forgot(self.heard)

    def heard(self, why: str) -> None:
        self.reasons.append(why)
        self.event.set()


def test_an_emptied_etcd_is_found_and_watches_go_on_from_what_is_there(
    own_etcd: EmbeddedEtcd,
) -> None:
    store = EtcdStore(own_etcd.settings())
    told = Told(store)
    try:
        for i in range(50):  # a revision well above what the emptied etcd will have
            store.put(f"/j/filler{i % 5}", b"x")
        watch = store.watch("/j/", prefix=True)
        store.put("/j/a", b"1")
        assert next_batch(watch).events[0].kv.key == "/j/a"
        wipe(own_etcd)  # same member and cluster: only the revisions say it
        store.put("/j/b", b"2")
        assert told.event.wait(DEADLINE_S), "the store did not find that etcd forgot"
        assert "below the" in told.reasons[0] or "cluster id changed" in told.reasons[0]
        batches = until_value(watch, "/j/b", b"2")
        assert any(b.reset for b in batches), batches  # re-listed, not resumed
        store.put("/j/c", b"3")  # and the watch goes on from there
        batch = next_batch(watch)
        assert [(e.type, e.kv.key) for e in batch.events] == [(EventType.PUT, "/j/c")]
    finally:
        store.close()


def test_an_etcd_restored_from_an_older_backup_is_found_by_its_revision(
    own_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    store = EtcdStore(own_etcd.settings())
    told = Told(store)
    try:
        store.put("/j/round", b"generation 1")
        backup(own_etcd, tmp_path / "backup.db")
        for i in range(40):  # the job goes on after the backup
            store.put("/j/round", f"generation {i + 2}".encode())
        watch = store.watch("/j/", prefix=True)
        store.put("/j/node", b"n")
        assert next_batch(watch).events[0].kv.key == "/j/node"
        restore(own_etcd, tmp_path / "backup.db")  # same member, same cluster id
        kv = store.get("/j/round")  # an answer whose revision is below those seen
        assert kv is not None and kv.value == b"generation 1"
        assert told.event.wait(DEADLINE_S), "the store did not find that etcd went back"
        assert "below the" in told.reasons[0], told.reasons
        batches = until_value(watch, "/j/round", b"generation 1")
        assert batches[-1].reset  # what the backup holds, as a re-list
        store.put("/j/round", b"generation 42")
        until_value(watch, "/j/round", b"generation 42")
    finally:
        store.close()

"""What only a real etcd can show: restarts, failover, unreachable endpoints."""

from __future__ import annotations

import time

import pytest

from efdl._process import free_port
from efdl.errors import StoreConnectionError
from efdl.rendezvous.api import Endpoint, EtcdSettings, EventType
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.lease import LeaseSession
from tests.integration.test_store_contract import drain


def test_watch_survives_an_etcd_restart(own_etcd: EmbeddedEtcd) -> None:
    with EtcdStore(own_etcd.settings()) as store:
        start = store.put("/job/round", b"g1") + 1
        watch = store.watch("/job/", prefix=True, start_revision=start)
        store.put("/job/round", b"g2")
        assert drain(watch.get, 1)[0].events[0].kv.value == b"g2"

        own_etcd.kill()  # a crash, not a clean stop; the data directory stays
        own_etcd.start()
        store.put("/job/round", b"g3")  # the client reconnects by itself
        store.put("/job/node", b"n")
        events = [e for b in drain(watch.get, 2, timeout_s=15) for e in b.events]
        watch.cancel()
    assert [(e.kv.key, e.kv.value) for e in events] == [("/job/round", b"g3"), ("/job/node", b"n")]


def test_watch_misses_nothing_written_while_it_was_disconnected(own_etcd: EmbeddedEtcd) -> None:
    with EtcdStore(own_etcd.settings()) as writer, EtcdStore(own_etcd.settings()) as reader:
        start = writer.put("/job/a", b"0") + 1
        watch = reader.watch("/job/", prefix=True, start_revision=start)
        own_etcd.restart()
        # Written before the watcher's stream is back: replayed from its last revision.
        for i in range(1, 4):
            writer.put("/job/a", str(i).encode())
        events = [e for b in drain(watch.get, 3, timeout_s=15) for e in b.events]
        watch.cancel()
    assert [e.kv.value for e in events] == [b"1", b"2", b"3"]


def test_lease_and_its_keys_survive_a_short_restart(own_etcd: EmbeddedEtcd) -> None:
    with EtcdStore(own_etcd.settings()) as store:
        session = LeaseSession(store, ttl_s=6)
        store.put("/job/nodes/a", b"a", lease=session.lease_id)
        own_etcd.restart()
        time.sleep(7)  # past the TTL: only the keep-alive after the restart holds it
        assert not session.expired
        assert store.get("/job/nodes/a") is not None
        session.close()
        assert store.get("/job/nodes/a") is None


def test_fails_over_to_the_next_endpoint(etcd_server: EmbeddedEtcd) -> None:
    dead = Endpoint("127.0.0.1", free_port())
    settings = EtcdSettings((dead, etcd_server.endpoint), request_timeout_s=3)
    with EtcdStore(settings) as store:
        store.put("/failover/k", b"v")
        kv = store.get("/failover/k")
        assert kv is not None and kv.value == b"v"
        start = kv.mod_revision
        with store.watch("/failover/k", start_revision=start) as watch:
            (batch,) = drain(watch.get, 1)
        assert batch.events[0].type is EventType.PUT


def test_unreachable_endpoint_is_a_clear_error_in_bounded_time() -> None:
    port = free_port()
    settings = EtcdSettings.from_list(f"127.0.0.1:{port}", connect_timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(StoreConnectionError) as info:
        EtcdStore(settings)
    assert time.monotonic() - t0 < 6
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "Cannot reach etcd" in message


def test_requests_fail_cleanly_while_etcd_is_down_and_work_after(own_etcd: EmbeddedEtcd) -> None:
    settings = own_etcd.settings(request_timeout_s=1.0)
    with EtcdStore(settings) as store:
        own_etcd.stop(remove_data=False)
        with pytest.raises(StoreConnectionError) as info:
            store.put("/down/k", b"v")
        assert str(own_etcd.endpoint.port) in str(info.value)
        own_etcd.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                store.put("/down/k", b"v")
                break
            except StoreConnectionError:
                assert time.monotonic() < deadline
        assert store.get("/down/k") is not None

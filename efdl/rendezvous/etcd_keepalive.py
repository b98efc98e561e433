"""The etcd store's lease keep-alive: one long-lived LeaseKeepAlive stream per store
(:class:`KeepAliveStream`), shared by all its leases."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
from etcd3 import etcdrpc

from efdl.errors import StoreConnectionError, StoreError
from efdl.rendezvous.etcd_channel import EtcdChannel, StreamOwner

log = logging.getLogger(__name__)


class KeepAliveStream:
    """One long-lived LeaseKeepAlive stream per store, shared by all its leases.

    A refresh is one message on it, not a new stream (and thread) per call: at hundreds of
    agents per process that is the difference between idle and busy. The stream is reopened,
    on the next endpoint if need be, after any error.
    """

    def __init__(self, store: StreamOwner) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._requests: queue.Queue[Any] | None = None
        self._call: Any = None
        self._channel: EtcdChannel | None = None  # where the open stream goes
        self._waiters: dict[int, list[_Waiter]] = {}

    def refresh(self, lease_id: int, timeout_s: float) -> int:
        waiter = _Waiter()
        with self._lock:
            requests = self._requests or self._open()
            self._waiters.setdefault(lease_id, []).append(waiter)
            ch = self._channel
        requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        if not waiter.done.wait(timeout_s):
            with self._lock:
                if waiter in self._waiters.get(lease_id, []):
                    self._waiters[lease_id].remove(waiter)
            self._reset(f"no answer within {timeout_s:g} s")
            if ch is not None:  # the next refresh goes to another member
                self._store._suspect(ch, f"a lease refresh got no answer in {timeout_s:.1f} s")
            raise StoreConnectionError(
                f"etcd at {self._store.settings.endpoint_list} did not answer the refresh of "
                f"lease {lease_id:x} within {timeout_s:g} s."
            )
        if waiter.error is not None:
            raise waiter.error
        return waiter.ttl

    def _open(self) -> queue.Queue[Any]:
        """Open the stream (caller holds the lock)."""
        ch, md = self._store._stream_channel()
        requests: queue.Queue[Any] = queue.Queue()
        call = ch.lease.LeaseKeepAlive(_drain(requests), metadata=md)
        self._requests, self._call, self._channel = requests, call, ch
        threading.Thread(
            target=self._read, args=(call, requests, ch), name="efdl-keepalive", daemon=True
        ).start()
        return requests

    def _read(self, call: Any, requests: queue.Queue[Any], ch: EtcdChannel) -> None:
        error: StoreError | None = None
        try:
            for resp in call:
                self._store._suspect_forgotten(resp.header)
                with self._lock:
                    waiters = self._waiters.pop(int(resp.ID), [])
                for w in waiters:
                    w.ttl = int(resp.TTL)  # 0: the lease has expired (not an error)
                    w.done.set()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self._store._watch_failed_over(ch, exc)
                error = self._store._translate(exc, ch.endpoint, "refresh a lease")
        with self._lock:
            if self._requests is requests:
                self._requests, self._call = None, None
            if self._requests is None:  # fail whoever still waits on this stream
                waiters = [w for ws in self._waiters.values() for w in ws]
                self._waiters.clear()
            else:
                waiters = []
        requests.put(None)
        for w in waiters:
            w.error = error or StoreConnectionError(
                f"The lease keep-alive stream to {self._store.description} ended."
            )
            w.done.set()

    def _reset(self, why: str) -> None:
        with self._lock:
            call, requests = self._call, self._requests
            self._requests, self._call = None, None
        if call is not None:
            log.debug("Reopening the lease keep-alive stream: %s.", why)
            call.cancel()
        if requests is not None:
            requests.put(None)

    def leave(self, ch: EtcdChannel) -> None:
        """Reopen the stream elsewhere if it goes to ``ch``."""
        with self._lock:
            on_it = self._channel is ch and self._call is not None
        if on_it:
            self._reset(f"leaving {ch.endpoint}")

    def close(self) -> None:
        self._reset("closing")


class _Waiter:
    __slots__ = ("done", "error", "ttl")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ttl = 0
        self.error: StoreError | None = None


def _drain(requests: queue.Queue[Any]) -> Iterator[Any]:
    """A request stream fed from a queue; ends at None."""
    while (item := requests.get()) is not None:
        yield item

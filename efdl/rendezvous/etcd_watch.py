"""The etcd store's watches: :class:`EtcdWatch`, a thread that keeps a gRPC watch stream
open, resumes it after errors from the last revision delivered, and re-lists where etcd
compacted that revision or forgot what it held."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2
from etcd3.utils import prefix_range_end

from efdl.errors import StoreAuthError, StoreError
from efdl.rendezvous.api import (
    Compare,
    EventType,
    Get,
    Op,
    PrefixSnapshot,
    TxnResult,
    Watch,
    WatchBatch,
    WatchEvent,
    WatchSink,
)
from efdl.rendezvous.etcd_channel import (
    REQUIRE_LEADER,
    EtcdChannel,
    StreamOwner,
    is_auth_failure,
    is_token_invalid,
    key_bytes,
    key_value,
)

log = logging.getLogger(__name__)


class WatchOwner(StreamOwner, Protocol):
    """What a watch asks of its store beyond a stream's: reads to resume or re-list from,
    and to be forgotten when it ends."""

    def get_prefix(self, prefix: str, revision: int = 0) -> PrefixSnapshot: ...

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult: ...

    def _revision_now(self, key: str) -> int: ...

    def _forget(self, w: EtcdWatch) -> None: ...


def _hold_open(first: Any, done: threading.Event) -> Iterator[Any]:
    """A request stream of one message that stays open until ``done`` (the stream ended)."""
    yield first
    done.wait()


class EtcdWatch(Watch):
    """One watch: a thread that keeps a gRPC watch stream open and resumes it after errors."""

    def __init__(
        self,
        store: WatchOwner,
        key: str,
        prefix: bool,
        start_revision: int,
        sink: WatchSink | None,
    ) -> None:
        super().__init__(
            f"watch {'prefix ' if prefix else ''}{key} on {store.description}", sink=sink
        )
        self._store = store
        self._key = key
        self._prefix = prefix
        self._next_revision = start_revision
        self._call: Any = None
        self._call_channel: EtcdChannel | None = None
        self._call_lock = threading.Lock()
        # Before the stream opens again, check that etcd has the revision to resume from (it
        # may have forgotten: then there is nothing to resume, and the watch re-lists).
        self._check = False
        self._thread = threading.Thread(target=self._run, name=f"efdl-watch{key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _create_request(self) -> Any:
        create = etcdrpc.WatchCreateRequest(
            key=key_bytes(self._key), start_revision=self._next_revision
        )
        if self._prefix:
            create.range_end = prefix_range_end(key_bytes(self._key))
        return etcdrpc.WatchRequest(create_request=create)

    def _run(self) -> None:
        backoff = 0.1
        failures = 0
        while not self.cancelled:
            ch, md = self._store._stream_channel()
            stream_done = threading.Event()
            try:
                if self._check or failures:
                    self._resume_or_relist()
                    self._check = False
                request_stream = _hold_open(self._create_request(), stream_done)
                call = ch.watch.Watch(request_stream, metadata=(*(md or ()), REQUIRE_LEADER))
                with self._call_lock:
                    self._call, self._call_channel = call, ch
                if self.cancelled or self._check:  # cancelled, or etcd forgot, meanwhile
                    call.cancel()
                for response in call:
                    backoff, failures = 0.1, 0
                    if not self._handle(response):
                        break
            except grpc.RpcError as exc:
                if self.cancelled:
                    break
                if is_auth_failure(exc) and not is_token_invalid(exc):
                    self._deliver(self._store._translate(exc, ch.endpoint, self.description))
                    break
                failures += 1
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "The %s broke (%s: %s); resuming from revision %d.",
                    self.description,
                    exc.code().name,
                    exc.details(),
                    self._next_revision,
                )
                self._store._watch_failed_over(ch, exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            except StoreError as exc:  # from a re-list (after compaction, or forgetting)
                if not self.cancelled:
                    log.warning("The %s could not re-list (%s); retrying.", self.description, exc)
                    time.sleep(backoff)
            finally:
                stream_done.set()
        self._store._forget(self)

    def _handle(self, response: Any) -> bool:
        """Deliver one response; False when the stream must be re-opened."""
        self._store._suspect_forgotten(response.header)
        if response.compact_revision:
            self._relist(response.compact_revision)
            return False
        if response.canceled:
            reason = response.cancel_reason or "no reason given"
            if "permission denied" in reason.lower():
                self._deliver(StoreAuthError(f"etcd refused the {self.description}: {reason}."))
                self.cancel()
            return False
        if not response.events:
            return True
        events = []
        for ev in response.events:
            kind = EventType.DELETE if ev.type == kv_pb2.Event.DELETE else EventType.PUT
            events.append(WatchEvent(kind, key_value(ev.kv)))
        last = max(e.kv.mod_revision for e in events)
        self._next_revision = last + 1
        self._deliver(WatchBatch(tuple(events), max(last, response.header.revision)))
        return True

    def _resume_or_relist(self) -> None:
        """Before resuming from ``_next_revision``: re-list if etcd's revision is below the
        last one delivered (it forgot: a resumed watch would wait for events that never
        come)."""
        now = self._store._revision_now(self._key)
        if now < self._next_revision - 1:
            log.warning(
                "The %s would resume from revision %d, but etcd is at revision %d; re-listing.",
                self.description,
                self._next_revision,
                now,
            )
            self._relist_now()

    def recheck(self) -> None:
        """etcd forgot: open the stream again, checking first where etcd stands."""
        self._check = True
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()

    def _relist(self, compact_revision: int) -> None:
        log.warning(
            "The %s asked for revision %d, compacted up to %d; re-listing.",
            self.description,
            self._next_revision,
            compact_revision,
        )
        self._relist_now()

    def _relist_now(self) -> None:
        """Deliver what is there now as a reset batch, and watch on from there."""
        if self._prefix:
            snap = self._store.get_prefix(self._key)
            kvs, revision = snap.kvs, snap.revision
        else:
            txn = self._store.txn([], [Get(self._key)])
            kvs, revision = txn.gets[0], txn.revision
        events = tuple(WatchEvent(EventType.PUT, kv) for kv in kvs)
        self._deliver(WatchBatch(events, revision, reset=True))
        self._next_revision = revision + 1

    def _on_cancel(self) -> None:
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()

    def leave(self, ch: EtcdChannel) -> None:
        """Resume on another member if the stream goes to ``ch`` (which does not answer)."""
        with self._call_lock:
            if self._call is not None and self._call_channel is ch:
                self._call.cancel()

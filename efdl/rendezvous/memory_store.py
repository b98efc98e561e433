"""An in-process :class:`~efdl.rendezvous.api.KVStore` with etcd's semantics, for fast tests.

It keeps every revision's events so watches can replay, expires leases on a clock, and
compacts like etcd. The contract tests in ``tests/integration/test_store_contract.py`` run
against it and against a real etcd, so code tested on it behaves the same on etcd.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from efdl.errors import CompactedError, StoreError
from efdl.rendezvous.api import (
    NO_LEASE,
    Compare,
    Delete,
    EventType,
    Get,
    KeyValue,
    KVStore,
    Op,
    PrefixSnapshot,
    Put,
    TxnResult,
    Watch,
    WatchBatch,
    WatchEvent,
    WatchSink,
)


@dataclass(slots=True)
class _Lease:
    ttl_s: int
    deadline: float
    keys: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Watcher:
    watch: Watch
    key: str
    prefix: bool

    def matches(self, key: str) -> bool:
        return key.startswith(self.key) if self.prefix else key == self.key


class MemoryStore(KVStore):
    """etcd's model in a dict. Thread-safe; leases expire on ``clock`` (monotonic seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, name: str = "memory") -> None:
        self._clock = clock
        self._name = name
        self._cond = threading.Condition()
        self._kvs: dict[str, KeyValue] = {}
        self._revision = 1
        self._compacted = 0
        self._history: list[WatchEvent] = []
        self._base: dict[str, KeyValue] = {}  # the keys before revision _compacted
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x1000)
        self._watchers: list[_Watcher] = []
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="efdl-memstore-reaper", daemon=True)
        self._reaper.start()

    @property
    def description(self) -> str:
        return f"in-memory store {self._name!r}"

    # ---------------------------------------------------------------- internals (hold _cond)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"The {self.description} is closed.")

    def _apply(self, ops: Sequence[Op], events: list[WatchEvent]) -> list[tuple[KeyValue, ...]]:
        """Apply ops at revision ``self._revision + 1`` (if any write happens)."""
        gets: list[tuple[KeyValue, ...]] = []
        rev = self._revision + 1
        for op in ops:
            if isinstance(op, Get):
                gets.append(self._range(op.key, op.prefix))
            elif isinstance(op, Put):
                if op.lease != NO_LEASE and op.lease not in self._leases:
                    raise StoreError(f"The {self.description} has no lease {op.lease:x}.")
                old = self._kvs.get(op.key)
                if old is not None and old.lease != NO_LEASE and old.lease in self._leases:
                    self._leases[old.lease].keys.discard(op.key)
                kv = KeyValue(
                    op.key,
                    op.value,
                    create_revision=old.create_revision if old else rev,
                    mod_revision=rev,
                    version=old.version + 1 if old else 1,
                    lease=op.lease,
                )
                self._kvs[op.key] = kv
                if op.lease != NO_LEASE:
                    self._leases[op.lease].keys.add(op.key)
                events.append(WatchEvent(EventType.PUT, kv))
            else:
                for kv in self._range(op.key, op.prefix):
                    self._delete_key(kv.key, rev, events)
        return gets

    def _delete_key(self, key: str, rev: int, events: list[WatchEvent]) -> None:
        old = self._kvs.pop(key)
        if old.lease != NO_LEASE and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        gone = KeyValue(key, b"", create_revision=0, mod_revision=rev, version=0)
        events.append(WatchEvent(EventType.DELETE, gone))

    def _commit(self, events: list[WatchEvent]) -> None:
        if not events:
            return
        self._revision += 1
        self._history.extend(events)
        for w in self._watchers:
            mine = tuple(e for e in events if w.matches(e.kv.key))
            if mine:
                w.watch._deliver(WatchBatch(mine, self._revision))
        self._cond.notify_all()

    def _range(self, key: str, prefix: bool) -> tuple[KeyValue, ...]:
        if not prefix:
            kv = self._kvs.get(key)
            return (kv,) if kv else ()
        return tuple(self._kvs[k] for k in sorted(self._kvs) if k.startswith(key))

    def _holds(self, c: Compare) -> bool:
        kv = self._kvs.get(c.key)
        actual: int = getattr(kv, c.target.value) if kv else 0  # the values are the field names
        return actual == c.revision

    def _expire(self) -> None:
        now = self._clock()
        for lease_id in [i for i, le in self._leases.items() if le.deadline <= now]:
            self._drop_lease(lease_id)

    def _drop_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        events: list[WatchEvent] = []
        for key in sorted(lease.keys):
            if key in self._kvs:
                self._delete_key(key, self._revision + 1, events)
        self._commit(events)

    def _reap(self) -> None:
        with self._cond:
            while not self._closed:
                self._expire()
                deadlines = [le.deadline for le in self._leases.values()]
                wait = min(deadlines) - self._clock() if deadlines else None
                self._cond.wait(timeout=None if wait is None else max(wait, 0.01))

    # ---------------------------------------------------------------- KVStore

    def get(self, key: str, revision: int = 0) -> KeyValue | None:
        with self._cond:
            self._check_open()
            self._expire()
            if revision:
                return self._at(revision).get(key)
            return self._kvs.get(key)

    def get_prefix(self, prefix: str, revision: int = 0) -> PrefixSnapshot:
        with self._cond:
            self._check_open()
            self._expire()
            if revision:
                kvs = self._at(revision)
                return PrefixSnapshot(
                    tuple(kvs[k] for k in sorted(kvs) if k.startswith(prefix)), self._revision
                )
            return PrefixSnapshot(self._range(prefix, True), self._revision)

    def _at(self, revision: int) -> dict[str, KeyValue]:
        """Every key as it was at ``revision`` (hold _cond)."""
        if revision < self._compacted:
            raise CompactedError(
                f"The {self.description} compacted revision {revision} (compacted up to "
                f"{self._compacted})."
            )
        return _replay(self._base, (e for e in self._history if e.kv.mod_revision <= revision))

    def get_range(self, start: str, end: str) -> PrefixSnapshot:
        with self._cond:
            self._check_open()
            self._expire()
            keys = sorted(k for k in self._kvs if start <= k < end)  # str order is UTF-8's
            return PrefixSnapshot(tuple(self._kvs[k] for k in keys), self._revision)

    def last_created(self, prefix: str, before: int) -> PrefixSnapshot:
        with self._cond:
            self._check_open()
            self._expire()
            older = [kv for kv in self._range(prefix, True) if kv.create_revision < before]
            newest = max(older, key=lambda kv: kv.create_revision, default=None)
            return PrefixSnapshot((newest,) if newest else (), self._revision)

    def put(self, key: str, value: bytes, lease: int = NO_LEASE) -> int:
        return self.txn([], [Put(key, value, lease)]).revision

    def delete(self, key: str, *, prefix: bool = False) -> int:
        with self._cond:
            self._check_open()
            self._expire()
            count = len(self._range(key, prefix))
            events: list[WatchEvent] = []
            self._apply([Delete(key, prefix)], events)
            self._commit(events)
            return count

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        with self._cond:
            self._check_open()
            self._expire()
            ok = all(self._holds(c) for c in compare)
            events: list[WatchEvent] = []
            gets = self._apply(success if ok else failure, events)
            self._commit(events)
            return TxnResult(ok, self._revision, tuple(gets))

    def grant_lease(self, ttl_s: int) -> int:
        with self._cond:
            self._check_open()
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = _Lease(ttl_s, self._clock() + ttl_s)
            self._cond.notify_all()
            return lease_id

    def refresh_lease(self, lease_id: int, timeout_s: float | None = None) -> int:
        with self._cond:
            self._check_open()
            self._expire()
            lease = self._leases.get(lease_id)
            if lease is None:
                return 0
            lease.deadline = self._clock() + lease.ttl_s
            return lease.ttl_s

    def revoke_lease(self, lease_id: int) -> None:
        with self._cond:
            self._check_open()
            if lease_id in self._leases:
                self._drop_lease(lease_id)

    def watch(
        self,
        key: str,
        *,
        prefix: bool = False,
        start_revision: int | None = None,
        sink: WatchSink | None = None,
    ) -> Watch:
        with self._cond:
            self._check_open()
            self._expire()
            watcher = _Watcher(
                Watch(
                    f"watch {'prefix ' if prefix else ''}{key} on {self.description}",
                    on_cancel=lambda: self._unwatch(watcher),
                    sink=sink,
                ),
                key,
                prefix,
            )
            w = watcher.watch
            if start_revision is not None and start_revision < self._compacted:
                kvs = self._range(key, prefix)
                events = tuple(WatchEvent(EventType.PUT, kv) for kv in kvs)
                w._deliver(WatchBatch(events, self._revision, reset=True))
            elif start_revision is not None:
                past = [
                    e
                    for e in self._history
                    if e.kv.mod_revision >= start_revision and watcher.matches(e.kv.key)
                ]
                for _, group in itertools.groupby(past, key=lambda e: e.kv.mod_revision):
                    batch = tuple(group)
                    w._deliver(WatchBatch(batch, batch[0].kv.mod_revision))
            self._watchers.append(watcher)
            return w

    def _unwatch(self, watcher: _Watcher) -> None:
        with self._cond:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def compact(self, revision: int) -> None:
        with self._cond:
            self._check_open()
            if revision > self._revision:
                raise StoreError(
                    f"Cannot compact the {self.description} to revision {revision}: "
                    f"it is only at {self._revision}."
                )
            if revision > self._compacted:
                self._base = _replay(
                    self._base, (e for e in self._history if e.kv.mod_revision < revision)
                )
                self._compacted = revision
            self._history = [e for e in self._history if e.kv.mod_revision >= revision]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for w in self._watchers:
                w.watch.cancel()
            self._watchers.clear()
            self._cond.notify_all()


def _replay(base: dict[str, KeyValue], events: Iterable[WatchEvent]) -> dict[str, KeyValue]:
    kvs = dict(base)
    for e in events:
        if e.type is EventType.PUT:
            kvs[e.kv.key] = e.kv
        else:
            kvs.pop(e.kv.key, None)
    return kvs


__all__ = ["MemoryStore"]

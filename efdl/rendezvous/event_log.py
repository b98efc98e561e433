"""A job's history, written: each agent's events to etcd under ``events/``, bounded, off
the hot path (efdl.history reads them).

A writer keeps the newest :data:`LIMIT` events: after every :data:`TRIM_EVERY` of its own
writes it deletes the oldest beyond that (any agent may; deleting twice is harmless). Writes
go through a queue to a daemon thread, so nothing on an agent's path to the next step waits
for etcd; an event that cannot be written is dropped with a warning.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from efdl.errors import StoreError
from efdl.rendezvous.api import Delete, KVStore
from efdl.rendezvous.records import Event, EventKind, JobKeys, Round

log = logging.getLogger(__name__)

LIMIT = 2000  # events kept per job (about 200 bytes each)
TRIM_EVERY = 64  # a writer trims after this many of its own writes
_TXN_OPS = 128  # etcd's default --max-txn-ops


class EventLog:
    """Writes one agent's events to etcd from a daemon thread; :meth:`record` never blocks."""

    def __init__(self, store: KVStore, job_id: str, node_id: str) -> None:
        self._store = store
        self._keys = JobKeys(job_id)
        self._node = node_id
        self._queue: queue.Queue[Event | None] = queue.Queue(maxsize=10_000)
        self._written = 0
        self._thread = threading.Thread(target=self._run, name="efdl-events", daemon=True)
        self._thread.start()

    def event(
        self,
        kind: EventKind,
        generation: int,
        text: str,
        world_size: int = 0,
        step: int = -1,
        seconds: float = -1.0,
        node: str = "",
    ) -> Event:
        """An event of this node (or of ``node``: an eviction names the evicted), now."""
        return Event(
            time.time(), kind, node or self._node, generation, text, world_size, step, seconds
        )

    def record(self, kind: EventKind, generation: int, text: str, **fields: Any) -> None:
        """:meth:`event`, written."""
        self.write(self.event(kind, generation, text, **fields))

    def round(self, r: Round) -> None:
        """A round this node wrote (or saw end the job)."""
        self.write(Event.of_round(time.time(), self._node, r))

    def write(self, event: Event) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            log.warning("Dropping the event %s: too many not written yet.", event.kind.value)

    def _run(self) -> None:
        while (event := self._queue.get()) is not None:
            try:
                self._store.put(event.key(self._keys), event.to_json())
                self._written += 1
                if self._written % TRIM_EVERY == 0:
                    trim(self._store, self._keys)
            except StoreError as exc:
                log.warning("Could not record the event %s (%s).", event.kind.value, exc)

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued, for up to ``timeout_s``."""
        self._queue.put(None)
        self._thread.join(timeout_s)


def trim(store: KVStore, keys: JobKeys, limit: int = LIMIT) -> int:
    """Delete the job's oldest events beyond ``limit``; how many were deleted."""
    snap = store.get_prefix(keys.events)
    doomed = sorted(kv.key for kv in snap.kvs)[: max(0, len(snap.kvs) - limit)]
    for i in range(0, len(doomed), _TXN_OPS):
        store.txn([], [Delete(k) for k in doomed[i : i + _TXN_OPS]])
    return len(doomed)

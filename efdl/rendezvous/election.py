"""Leader election over a key prefix, after etcd's ``clientv3/concurrency`` election.

Each candidate puts a key under the prefix, bound to its lease; the one whose key was created
first leads, and each other watches only the key created just before its own (one sorted,
limited range read finds it), so a leader's death hands over to exactly one successor, with
no herd. A lease proves liveness, the create revision gives the order, and a leader's every
write carries :attr:`Candidate.guard`: a leader whose lease went writes nothing. The job's
rendezvous (efdl.rendezvous.participant) and the fleet's allocator (efdl.fleet.leader) both
elect through it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from efdl.rendezvous.api import (
    Compare,
    EventType,
    Get,
    KeyValue,
    KVStore,
    Put,
    Watch,
    WatchBatch,
    WatchSink,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A candidate's key as campaigned: its place in the order is ``create_revision``."""

    key: str
    create_revision: int
    lease: int

    @property
    def guard(self) -> Compare:
        """The condition of a leader's every write: this key stands as campaigned (not gone
        with its lease, nor made again since)."""
        return Compare.create_revision_is(self.key, self.create_revision)


@dataclass(frozen=True, slots=True)
class Campaign:
    """What a campaign came to: ``candidate``, or None when ``holder``, the key under another
    lease, stands (None too: it went as it was read)."""

    candidate: Candidate | None
    holder: KeyValue | None = None


@dataclass(frozen=True, slots=True)
class Standing:
    """Whom a candidate waits for: ``predecessor``, the key created just before its own (None:
    it leads), read at ``revision``; watch it from ``revision + 1``."""

    predecessor: KeyValue | None
    revision: int

    @property
    def leads(self) -> bool:
        return self.predecessor is None


class Election:
    """The election among the keys under ``prefix``; ``label`` begins its log lines (the job
    and node, or the fleet). Thread-safe: it keeps no state of its own."""

    def __init__(self, store: KVStore, prefix: str, label: str) -> None:
        self._store = store
        self._prefix = prefix
        self._label = label

    def campaign(self, key: str, value: bytes, lease: int) -> Campaign:
        """Put ``key`` (under the prefix) bound to ``lease`` unless it exists, in one
        transaction. A key already under ``lease`` is this candidate's (an earlier attempt
        was applied and its answer lost). A key under another lease is never taken over:
        it may be an earlier run of this candidate whose lease has not expired yet, or
        another candidate given the same id and alive, and two holders of one key would
        both pass its guard. Wait for it to go (:meth:`wait_gone`), then campaign again.

        Raises:
            StoreError: etcd failed, or ``lease`` has ended.
        """
        result = self._store.txn([Compare.absent(key)], [Put(key, value, lease)], [Get(key)])
        if result.succeeded:
            return Campaign(Candidate(key, result.revision, lease))
        holder = result.gets[0][0] if result.gets and result.gets[0] else None
        if holder is None:
            return Campaign(None)
        if holder.lease == lease:
            return Campaign(Candidate(key, holder.create_revision, lease), holder)
        return Campaign(None, holder)

    def wait_gone(self, holder: KeyValue, stop: threading.Event, slice_s: float = 1.0) -> bool:
        """Block until ``holder``'s key goes or is made again (True), or ``stop`` is set
        (False): a watch from the revision after it was read, read in slices of
        ``slice_s`` (how late ``stop`` may be seen).

        Raises:
            StoreError: etcd failed.
        """
        with self._store.watch(holder.key, start_revision=holder.mod_revision + 1) as watch:
            while not stop.is_set():
                batch = watch.get(timeout_s=slice_s)
                if batch is not None and (
                    moved(batch) or any(ev.type is EventType.PUT for ev in batch.events)
                ):
                    return True
        return False

    def stand(self, me: Candidate) -> Standing:
        """Where ``me`` stands now: one limited read, whatever the number of candidates."""
        snap = self._store.last_created(self._prefix, me.create_revision)
        return Standing(snap.kvs[0] if snap.kvs else None, snap.revision)

    def watch(self, standing: Standing, sink: WatchSink | None = None) -> Watch:
        """Watch the predecessor of ``standing`` from the revision it was read at (into
        ``sink``, or for :meth:`Watch.get`); a batch for which :func:`moved` holds means:
        stand again. ``standing`` must not lead."""
        assert standing.predecessor is not None, "a leader waits for nobody"
        return self._store.watch(
            standing.predecessor.key, start_revision=standing.revision + 1, sink=sink
        )

    def stands(self, me: Candidate) -> bool:
        """Whether ``me``'s key stands as campaigned (one read)."""
        kv = self._store.get(me.key)
        return kv is not None and kv.create_revision == me.create_revision

    def wait(self, me: Candidate, stop: threading.Event, slice_s: float = 1.0) -> bool:
        """Block until ``me`` leads (True) or ``stop`` is set (False). Each wait is a watch
        on the predecessor from the revision it was found at, read in slices of ``slice_s``
        (how late ``stop`` may be seen); for callers with a thread to spare.

        Raises:
            StoreError: etcd failed (stand again on the same lease).
        """
        while not stop.is_set():
            standing = self.stand(me)
            if standing.predecessor is None:
                return True
            log.info("%s: %s follows %s.", self._label, me.key, standing.predecessor.key)
            with self.watch(standing) as watch:
                while not stop.is_set():
                    batch = watch.get(timeout_s=slice_s)
                    if batch is not None and moved(batch):
                        break
        return False


def moved(batch: WatchBatch) -> bool:
    """Whether a batch of the predecessor's watch means: stand again. The predecessor is
    gone, or made again (a new create revision, after ours: no longer before us), or the
    watch re-listed after a compaction (its batch says what is there now)."""
    return batch.reset or any(ev.type is EventType.DELETE for ev in batch.events)

"""This node's own hold (efdl.rendezvous.holds), as its agent sees and writes it.

The agent watches one key, ``holds/<its node>``, from before it joins: whoever holds the node
out (``efdl drain``, or the agent itself: SIGUSR2, a failed health check, a crash loop, a
straggler) the agent hears of it, says what it waits for, and knows when a quarantine ends.
The leader, which watches every hold, is the one that leaves the node out of its rounds: the
node's workers leave at a step boundary as those of any node a round leaves out, and the
agent stays, registered, waiting, as a spare that is not offered. Waiting has no deadline of
its own: a drain lasts until released (an agent under systemd waits for the operator, which is
the point of a drain), a quarantine until its ``until``; a job that cannot go on without the
node fails at the job's own join timeout, which ends every agent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from efdl.errors import ConfigError, StoreError
from efdl.rendezvous.api import EventType, KVStore, Watch, WatchBatch
from efdl.rendezvous.event_log import EventLog
from efdl.rendezvous.holds import Hold, HoldKind, hold, parse_holds
from efdl.rendezvous.records import EventKind, JobKeys

log = logging.getLogger(__name__)


class OwnHold:
    """Node ``node_id``'s hold in job ``keys``: read and watched (:meth:`start`), changes
    handed to ``changed`` (from the watch's thread: post them to the agent's loop), written
    by :meth:`hold_out`.

    Args:
        store: the job's etcd.
        keys: the job.
        node_id: this node.
        history: the job's history, where holds and their ends are recorded.
        changed: told the node's hold as it is now (None: none), from the watch's thread.
        tag: says the job, node and generation, for the log.
    """

    def __init__(
        self,
        store: KVStore,
        keys: JobKeys,
        node_id: str,
        history: EventLog,
        changed: Callable[[Hold | None], None],
        tag: Callable[[], str],
    ) -> None:
        self._store = store
        self._keys = keys
        self._node = node_id
        self._history = history
        self._changed = changed
        self._tag = tag
        self._watch: Watch | None = None
        self._lock = threading.Lock()
        self.current: Hold | None = None  # as last heard of (ended ones too)

    def start(self) -> Hold | None:
        """Read the node's hold and watch it from there on; returns it (None: none, or
        etcd did not answer: the watch then says).

        A watch that cannot start is said and not retried: the leader, which watches every
        hold, still leaves the node out; only this agent's words about it are lost."""
        key = self._keys.hold(self._node)
        try:
            snap = self._store.get_prefix(key)
            self.current = parse_holds(
                tuple(kv for kv in snap.kvs if kv.key == key), self._keys
            ).get(self._node)
            self._watch = self._store.watch(
                key, start_revision=snap.revision + 1, sink=self._on_batch
            )
        except StoreError as exc:
            log.warning("%s: cannot read this node's hold (%s).", self._tag(), exc)
        return self.current

    def _on_batch(self, item: WatchBatch | StoreError) -> None:
        if isinstance(item, StoreError):
            log.warning("%s: the watch of this node's hold failed: %s", self._tag(), item)
            return
        now: Hold | None = self.current
        if item.reset:
            now = None
        key = self._keys.hold(self._node)
        for ev in item.events:
            if ev.kv.key != key:
                continue
            if ev.type is EventType.DELETE:
                now = None
            else:
                now = parse_holds((ev.kv,), self._keys).get(self._node)
        self.current = now
        self._changed(now)

    def active(self, wall: float | None = None) -> Hold | None:
        """The node's hold in force now (None: none, or it ended)."""
        h = self.current
        return h if h is not None and h.active(time.time() if wall is None else wall) else None

    def hold_out(
        self, kind: HoldKind, reason: str, ttl_s: float | None, generation: int
    ) -> Hold | None:
        """Hold this node out (written at once, one put): the leader's next round leaves it
        out. A drain in force is not turned into a quarantine (an operator's hold is kept;
        the finding is recorded); a quarantine in force is renewed. Returns the hold in
        force, None if etcd did not take it (said; the caller goes on: training is not
        stopped for etcd's sake)."""
        existing = self.active()
        if kind is HoldKind.QUARANTINE and existing is not None and existing.kind is HoldKind.DRAIN:
            log.warning(
                "%s: %s; this node is drained already, so it stays drained.", self._tag(), reason
            )
            self._history.record(EventKind.HEALTH, generation, f"while drained: {reason}")
            return existing
        try:
            written = hold(self._store, self._keys, self._node, kind, reason, ttl_s)
        except (StoreError, ConfigError) as exc:
            log.error(
                "%s: could not hold this node out (%s: %s): %s",
                self._tag(),
                kind.value,
                reason,
                exc,
            )
            return None
        self.current = written
        log.warning(
            "%s: held this node out of the job: %s.", self._tag(), written.describe(written.since)
        )
        self._history.record(EventKind.HOLD, generation, f"{kind.value}: {written.reason}")
        return written

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

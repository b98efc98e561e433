"""Evidence that a node of the job is dead, faster than its lease (efdl.rendezvous.probe).

The leader probes every node when it leads, each newcomer when it joins, and every node again
when a member's workers saw a collective fail (a failure report, ``failures/<id>``); a
follower probes the node just before it (the leader may be the dead one). A node whose probe
port answered before and refuses now has lost its agent: its lease is ended at once, and its
keys go as if the lease had expired.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

from efdl.errors import StoreError
from efdl.rendezvous.api import KeyValue, KVStore
from efdl.rendezvous.decide import NodeView
from efdl.rendezvous.event_log import EventLog
from efdl.rendezvous.participant.rounds import Rounds
from efdl.rendezvous.probe import Reply, knock_all
from efdl.rendezvous.records import EventKind, JobKeys, NodeRecord, RecordError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Target:
    """A node to probe: its id, its agent's probe port, and its lease as read."""

    node_id: str
    host: str
    port: int
    lease: int


def targets(nodes: Mapping[str, NodeView], me: str, only: Set[str] | None = None) -> list[Target]:
    """The nodes of ``nodes`` (``only`` those, if given) to probe: all but ``me``, with a port."""
    return [
        Target(n, v.record.host, v.record.probe_port, v.lease)
        for n, v in sorted(nodes.items())
        if n != me and v.record.probe_port and (only is None or n in only)
    ]


def target_of(kv: KeyValue | None) -> list[Target]:
    """The node whose record ``kv`` is (as read, with its lease); none for a bad record."""
    if kv is None:
        return []
    try:
        record = NodeRecord.from_json(kv.value, kv.key)
    except RecordError:
        return []
    return [Target(record.node_id, record.host, record.probe_port, kv.lease)]


class Liveness:
    """This node's probes and what they found, for as long as it takes part in the job.

    Args:
        store: the job's etcd: failure reports, and the leases ended.
        keys: the job.
        node_id: this node.
        lease_ttl_s: the lease TTL, for log lines (how long a dead node would have taken).
        rounds: the rounds seen (the generation an eviction is recorded in; log lines).
        events: the job's history, where evictions are recorded.
        on_probed: called from a probing thread with each batch of replies; it must only
            hand them on to the rendezvous thread (which then calls :meth:`on_probed`).
    """

    def __init__(
        self,
        store: KVStore,
        keys: JobKeys,
        node_id: str,
        lease_ttl_s: int,
        rounds: Rounds,
        events: EventLog | None,
        on_probed: Callable[[tuple[tuple[Target, Reply], ...]], None],
    ) -> None:
        self._store = store
        self._keys = keys
        self._node_id = node_id
        self._ttl_s = lease_ttl_s
        self._rounds = rounds
        self._events = events
        self._post = on_probed
        self._lock = threading.Lock()
        # The node just before this one (its record as read), the nodes whose probe port
        # answered (and their lease then), the targets not probed yet and whether a probe
        # runs (at most one at a time).
        self.predecessor: KeyValue | None = None
        self._answered: dict[str, int] = {}
        self._to_probe: dict[str, Target] = {}
        self._probing = False
        self._closed = False

    def close(self) -> None:
        """Probe no more (a probe under way ends with its batch)."""
        with self._lock:
            self._closed = True

    def forget(self, node_id: str) -> None:
        """``node_id``'s record went: a refusal from its port is no longer evidence."""
        self._answered.pop(node_id, None)

    def report(self, generation: int, lease: int) -> None:
        """As a follower: this node's workers saw a collective fail in ``generation``. Report
        it for the leader (bound to ``lease``), and probe the node before this one (the
        leader may be the dead one)."""
        try:
            self._store.put(self._keys.failure(self._node_id), str(generation).encode(), lease)
        except StoreError as exc:  # only a hint: the lease still decides
            log.warning("%s: could not report the failed collective (%s).", self._rounds.tag(), exc)
        self.probe_predecessor()

    def probe_predecessor(self) -> None:
        self.probe(target_of(self.predecessor))

    def probe(self, todo: list[Target]) -> None:
        """Probe ``todo`` on a thread, one probe at a time (targets asked for meanwhile wait
        for the next); the replies come back through ``on_probed``."""
        with self._lock:
            self._to_probe.update((t.node_id, t) for t in todo if t.port)
            if self._probing or not self._to_probe:
                return
            self._probing = True

        def run() -> None:
            while True:
                with self._lock:
                    batch, self._to_probe = list(self._to_probe.values()), {}
                    if not batch or self._closed:
                        self._probing = False
                        return
                replies = knock_all((t.node_id, t.host, t.port) for t in batch)
                self._post(tuple((t, replies[t.node_id]) for t in batch))

        threading.Thread(target=run, name="efdl-probe", daemon=True).start()

    def on_probed(self, replies: tuple[tuple[Target, Reply], ...]) -> None:
        """Remember who answered; end the lease of a node whose port answered before and
        refuses now: its agent is gone, and its keys go as if the lease had expired."""
        for t, reply in replies:
            if reply is Reply.ANSWERED:
                self._answered[t.node_id] = t.lease
                continue
            if reply is not Reply.REFUSED:
                continue
            if self._answered.get(t.node_id) != t.lease:
                log.info(
                    "%s: node %s refused a connection at %s:%d, which never answered (a "
                    "firewall?): its lease decides.",
                    self._rounds.tag(),
                    t.node_id,
                    t.host,
                    t.port,
                )
                continue
            del self._answered[t.node_id]
            log.warning(
                "%s: node %s is gone: its agent at %s:%d refused a connection after a "
                "collective failed; ending its lease instead of waiting up to %d s for it "
                "to expire.",
                self._rounds.tag(),
                t.node_id,
                t.host,
                t.port,
                self._ttl_s,
            )
            if self._events is not None:
                latest = self._rounds.latest
                self._events.record(
                    EventKind.EVICT,
                    latest.generation if latest else 0,
                    f"evicted by {self._node_id}: its agent refused a connection",
                    node=t.node_id,
                )
            try:
                self._store.revoke_lease(t.lease)
            except StoreError as exc:
                log.warning(
                    "%s: could not end the lease of %s (%s).", self._rounds.tag(), t.node_id, exc
                )

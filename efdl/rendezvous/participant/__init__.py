"""One node's part in a job's rendezvous: register, elect, follow (or write) rounds.

The etcd I/O around :func:`~efdl.rendezvous.decide.decide`, on one thread per node that reads
typed messages (``inbox.py``) from the watches, the lease and the agent. Traffic per agent is
O(1) per round, in requests and in bytes: every agent watches the round key and reads its own
member record once per round (``rounds.py``), and, for the election
(efdl.rendezvous.election), watches only the node key just before its own; only the leader
reads and watches all node records (``leading.py``). Evidence of dead agents, faster than
their leases, is ``liveness.py``; the node record and its lease, ``registration.py``.

Keys (``/efdl/<job>/``): ``nodes/<id>`` (the node record, bound to the agent's lease; the
oldest is the leader), ``members/<id>`` (the node's place in the newest active round,
written by the leader before the round), ``failures/<id>`` (the generation in which a
collective of the node's workers failed, bound to the lease; the leader then probes the
nodes: efdl.rendezvous.probe), ``holds/<id>`` (a node held out: drained or quarantined,
efdl.rendezvous.holds; not bound to a lease; the leader watches them and never places a held
node), ``round`` (written by the leader with compare-and-swap on its
previous revision and on the leader's own node record, so a leader whose lease is gone
cannot write).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from efdl.errors import RendezvousError, StoreError
from efdl.rendezvous.api import KVStore, Watch, WatchSink
from efdl.rendezvous.decide import Policy
from efdl.rendezvous.election import Candidate, Election, moved
from efdl.rendezvous.event_log import EventLog
from efdl.rendezvous.lease import LeaseSession
from efdl.rendezvous.participant.inbox import (
    Asked,
    FailureSeen,
    Forgot,
    LeaseExpired,
    Message,
    Probed,
    Publish,
    Serve,
    Stop,
    Wake,
    Watched,
    WatchKind,
)
from efdl.rendezvous.participant.leading import REJOIN_TTLS, Absences, Leadership
from efdl.rendezvous.participant.liveness import Liveness, target_of
from efdl.rendezvous.participant.registration import (
    Registration,
    check_not_held,
    register,
    write_record,
)
from efdl.rendezvous.participant.rounds import Rounds
from efdl.rendezvous.reading import BLIP_S, retried
from efdl.rendezvous.records import JobKeys, Member, NodeRecord, Round

__all__ = ["REJOIN_TTLS", "Participant"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# How soon the node record is written again after etcd failed to.
WRITE_RETRY_S = 0.5


class Participant:
    """Takes part in the rounds of job ``job_id`` as node ``node.node_id``.

    Args:
        store: the etcd (or fake) store.
        job_id: the job; all its keys live under ``/efdl/<job_id>/``.
        node: this node's record (registered on :meth:`join`).
        policy: min/max workers, settle window, join timeout (used while leader).
        lease_ttl_s: a crashed node is noticed this long after its last keep-alive.
        clock: monotonic seconds: the settle window and every wait (a wall clock set back
            would stall them). Rounds are stamped with ``wall`` seconds (the join timeout
            spans leaders, on other hosts).
        on_lease_expired: called (from the lease's thread) each time etcd says the lease has
            expired: the node then registers again by itself, with ``holds``; the workers
            need not stop (a generation's workers can only train with each other).
        on_etcd_silent: called (from the lease's thread) when etcd has not answered for a
            lease TTL: no round can come until it does; in-place workers waiting for one
            should wait longer.
        holds: the ``round_id`` of the round whose workers the node runs now ("" if none, or
            leaving), asked when it registers again after a lost lease, and by a leader that
            saw the record of a member go (through the probe port). Default: "".
        on_round: called (from the rendezvous thread) with each newer served round; keep it
            short.
        serve_tcpstore: called (from the rendezvous thread) when this node holds rank 0 of a new
            active round: start the generation's fresh c10d store and return its port, which
            the agent then publishes in the round. Default: the record's fixed ``store_port``.
        on_failure: called once if the rendezvous fails on this node (it has left the job).
        events: the job's history, where the rounds this node writes as leader and the
            evictions it makes are recorded.
        on_forgot: called (from the rendezvous thread) when etcd forgot what it held (it came
            back empty, or older: :meth:`KVStore.on_forgot`), after this node has taken in
            what is there now: publish again what only this node's memory still holds.
        on_contact: called (from the lease's thread) with the monotonic time this node last
            reached etcd with its lease alive (efdl.worker.fence).
    """

    def __init__(
        self,
        store: KVStore,
        job_id: str,
        node: NodeRecord,
        policy: Policy,
        lease_ttl_s: int = 5,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_lease_expired: Callable[[str], None] | None = None,
        on_etcd_silent: Callable[[], None] | None = None,
        holds: Callable[[], str] | None = None,
        on_round: Callable[[Round], None] | None = None,
        serve_tcpstore: Callable[[Round], int] | None = None,
        on_failure: Callable[[str], None] | None = None,
        events: EventLog | None = None,
        on_forgot: Callable[[], None] | None = None,
        on_contact: Callable[[float], None] | None = None,
    ) -> None:
        self.keys = keys = JobKeys(job_id)
        self._on_forgot = on_forgot
        self._on_contact = on_contact
        self._on_failure = on_failure
        if serve_tcpstore is None and node.store_port == 0:
            raise RendezvousError(
                f"Node {node.node_id} has neither a store server nor a fixed store port."
            )
        self._store = store
        self._node = node
        self._ttl_s = lease_ttl_s
        self._clock = clock
        self._on_lease_expired = on_lease_expired
        self._on_etcd_silent = on_etcd_silent
        self._holds = holds or (lambda: "")
        # etcd calls of the rendezvous thread wait for etcd as long as the job may wait for
        # its members: an outage is outlived, not failed on.
        self._wait_s = max(BLIP_S, policy.join_timeout_s)
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._lock = threading.Lock()  # the record offered, and the lease it is bound to
        self._stopped = False
        self._session: LeaseSession | None = None
        self._registration: Registration | None = None
        self._unpublished = False  # self._node has changes not written to etcd yet
        self._write_failing = False  # the last write of the node record failed
        self._term = 0  # bumped when this node follows or leads anew
        self._thread: threading.Thread | None = None
        self._election = Election(store, keys.nodes, f"Job {job_id}: node {node.node_id}")
        self._rounds = Rounds(
            store,
            keys,
            node.node_id,
            self._wait_s,
            on_round,
            serve_tcpstore or (lambda _round: node.store_port),
            on_unserved=lambda: self._inbox.put(Serve()),
        )
        self._liveness = Liveness(
            store,
            keys,
            node.node_id,
            lease_ttl_s,
            self._rounds,
            events,
            on_probed=lambda replies: self._inbox.put(Probed(replies)),
        )
        self._leading = Leadership(
            store,
            keys,
            node.node_id,
            policy,
            lease_ttl_s,
            self._wait_s,
            clock,
            wall,
            self._rounds,
            self._liveness,
            events,
            post=self._inbox.put,
        )
        store.on_forgot(lambda why: self._inbox.put(Forgot(why)))

    # ---------------------------------------------------------------- public

    @property
    def node_id(self) -> str:
        return self._node.node_id

    @property
    def is_leader(self) -> bool:
        return self._leading.active

    @property
    def lease_healthy(self) -> bool:
        """Whether the lease was renewed within its TTL (etcd answers, the keys stand)."""
        session = self._session
        return session is not None and not session.expired and session.silent_s < self._ttl_s

    @property
    def current_round(self) -> Round | None:
        """The newest served round (see :attr:`Round.served`)."""
        return self._rounds.served

    @property
    def node(self) -> NodeRecord:
        """This node's record as it offers itself now (written, or about to be)."""
        with self._lock:
            return self._node

    def join(self) -> None:
        """Register this node (bound to a new lease) and start following rounds.

        Raises:
            DuplicateNodeError: a live node with the same id is already in the job (its
                record stands, or it runs the current round while its lease is lost).
            StoreError: etcd failed.
        """
        check_not_held(self._store, self.keys, self.node_id, self._wait_s)
        self._register()
        self._thread = threading.Thread(
            target=self._run, name=f"efdl-rdzv-{self.node_id}", daemon=True
        )
        self._thread.start()

    def next_round(self, after: int, timeout_s: float | None = None) -> Round | None:
        """The newest round with a generation above ``after``, waiting up to ``timeout_s``.

        A round superseded before the caller asked is skipped: each round is acted on at
        most once, and the newest one always is.

        Raises:
            RendezvousError: the rendezvous failed on this node (it has left the job).
        """
        return self._rounds.next(after, timeout_s)

    def report_failure(self, generation: int) -> None:
        """A collective of this node's workers failed in ``generation`` (a peer's connection
        closed, or a worker died): have the nodes probed for dead agents, so that a node
        whose agent died with its workers leaves the job before its lease expires."""
        self._inbox.put(FailureSeen(generation))

    def request_restart(self) -> None:
        """Ask for a new round with the same members (this node restarted its workers)."""
        with self._lock:
            node = self._node
        self._publish(replace(node, incarnation=node.incarnation + 1, down=0))

    def set_down(self, down: int) -> None:
        """Offer ``slots - down`` workers: ``down`` in-place workers died and their
        replacements are not ready yet. A rise asks for a new round at once (the survivors go
        on without them); a fall (a replacement is ready) is an ordinary offer of more."""
        with self._lock:
            node = self._node
        if down > node.down:
            self._publish(replace(node, incarnation=node.incarnation + 1, down=down))
        elif down < node.down:
            self._publish(replace(node, down=down))

    def leave(self) -> None:
        """Leave gracefully: revoke the lease, so the node's keys go and the next round comes
        at once instead of after the lease TTL."""
        self._stop()
        if self._session is not None:
            self._session.close(revoke=True)
        log.info("Job %s: node %s left.", self.keys.job_id, self.node_id)

    def abandon(self) -> None:
        """Stop without revoking (as a crash would): the keys go when the lease expires."""
        self._stop()
        if self._session is not None:
            self._session.close(revoke=False)

    # ---------------------------------------------------------------- the node record

    def _register(self, holds: str = "", again: bool = False) -> None:
        """Write this node's record, bound to a new lease; ``holds``: see NodeRecord;
        ``again``: after a lost lease, where an earlier attempt may have been applied."""
        with self._lock:
            node = replace(self._node, holds=holds)
        done = register(
            self._store,
            self.keys,
            self._election,
            node,
            self._ttl_s,
            again=again,
            on_expired=self._lease_gone,
            on_silent=self._on_etcd_silent,
            on_contact=self._on_contact,
        )
        with self._lock:
            self._registration, self._session = done, done.session
            self._node, self._unpublished = node, False

    def _register_again(self) -> None:
        """etcd said the lease has expired: every key bound to it is gone. Register again
        under a new lease, saying which round's workers this node still runs: a leader takes
        it for the member it was (no round follows) if that round is still the job's; if the
        job moved on without it, it is a newcomer. Waits for etcd (``_wait_s``)."""
        self._leading.active = False
        old = self._session
        if old is not None:
            old.close(revoke=False)
        holds = self._holds()
        log.warning(
            "%s: the lease is gone; registering again (%s).",
            self._rounds.tag(),
            f"its workers run round {holds} still" if holds else "as a newcomer",
        )
        self._retried("register this node again", lambda: self._register(holds, again=True))

    def _publish(self, node: NodeRecord) -> None:
        """Offer ``node`` from now on: the rendezvous thread writes it, while the record is
        this node's, as soon as etcd answers (a node that registers again writes it too).
        Returns at once: the caller (the agent's event loop) never waits for etcd."""
        with self._lock:
            self._node, self._unpublished = node, True
        self._inbox.put(Publish())

    def _write_node(self) -> bool:
        """Write the newest record (:meth:`_publish`); False if etcd failed (try again)."""
        with self._lock:
            node, registration = self._node, self._registration
            self._unpublished = False
        assert registration is not None
        try:
            ok = write_record(self._store, self.keys, node, registration)
        except StoreError as exc:
            # Said once until a write succeeds: an etcd away for minutes would fill the log.
            level = logging.DEBUG if self._write_failing else logging.WARNING
            log.log(
                level,
                "%s: could not update the node record (%s); retrying.",
                self._rounds.tag(),
                exc,
            )
            with self._lock:
                self._unpublished, self._write_failing = True, True
            return False
        self._write_failing = False
        if not ok:  # the lease is gone with the record: registering again writes it
            log.info(
                "%s: the node record is gone; registering again writes it.", self._rounds.tag()
            )
        return True

    # ---------------------------------------------------------------- internals

    def _stop(self) -> None:
        self._stopped = True
        self._leading.active = False
        self._liveness.close()
        self._rounds.close()
        self._inbox.put(Stop())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _retried(self, what: str, fn: Callable[[], T]) -> T:
        """:func:`retried` for as long as the job may wait for its members (an etcd outage
        is outlived; training does not need etcd meanwhile)."""
        return retried(what, fn, timeout_s=self._wait_s)

    def _lease_gone(self, reason: str) -> None:
        """From the lease's thread: etcd said the lease has expired."""
        self._leading.active = False
        self._inbox.put(LeaseExpired())
        if self._on_lease_expired is not None:
            self._on_lease_expired(reason)

    def own_member(self, r: Round) -> Member | None:
        """This node's record in active round ``r``; ``rounds.SUPERSEDED`` while a newer
        round's records replace it (see :meth:`Rounds.own_member`)."""
        return self._rounds.own_member(r)

    def absences(self) -> Absences:
        """What this node, while it leads, holds of members whose record went (a copy)."""
        return self._leading.absences()

    def _on_forgot_etcd(self) -> None:
        """etcd forgot what it held (the watches re-list by themselves): take the round key
        as it is now (the next write compares its revision, which may have gone down), write
        this node's record again where it stands (a lost lease registers anew by itself), and
        let the agent publish what only its memory holds."""
        self._rounds.read(adopt=True)
        with self._lock:
            self._unpublished = True
        self._leading.forgot()
        if self._on_forgot is not None:
            self._on_forgot()

    # ---------------------------------------------------------------- the rendezvous thread

    def _run(self) -> None:
        watches: list[Watch] = []
        try:
            # Two small reads, not the job's prefix: O(1) bytes per agent at any fleet size.
            revision = self._rounds.read()
            watches.append(
                self._store.watch(
                    self.keys.round,
                    start_revision=revision + 1,
                    sink=self._sink(WatchKind.ROUND),
                )
            )
            self._loop()
        except Exception as exc:
            log.error("%s: the rendezvous failed: %s", self._rounds.tag(), exc, exc_info=True)
            self._leading.active = False
            if self._session is not None:
                self._session.close(revoke=True)  # leave first, so the others go on without us
            failure = f"The rendezvous of node {self.node_id} failed: {exc}"
            self._rounds.close(failure)
            if self._on_failure is not None:
                self._on_failure(failure)
        finally:
            for w in watches:
                w.cancel()

    def _sink(self, kind: WatchKind) -> WatchSink:
        """A watch's sink into the inbox, for this node's current election (the round's
        watch is for good)."""
        term = self._term
        return lambda item: self._inbox.put(Watched(kind, item, term))

    def _elect(self, watches: list[Watch]) -> None:
        """Follow the node before this one, or lead if there is none, replacing the watches
        of an earlier election."""
        for w in watches:
            w.cancel()
        watches.clear()
        self._term += 1  # what the old watches still deliver is dropped
        self._leading.active = False
        with self._lock:
            assert self._registration is not None
            me: Candidate = self._registration.candidate
        standing = self._retried("find the node before this one", lambda: self._election.stand(me))
        self._liveness.predecessor = standing.predecessor
        if standing.leads:
            watches += self._leading.begin(me, self._sink)
            return
        # Once now: a later refusal is evidence (efdl.rendezvous.probe.knock_all).
        self._liveness.probe(target_of(standing.predecessor))
        watches.append(self._election.watch(standing, sink=self._sink(WatchKind.PREDECESSOR)))

    def _loop(self) -> None:
        watches: list[Watch] = []  # this election's: the predecessor's, or the leader's two
        self._elect(watches)
        wake_at: float | None = None
        retry_at: float | None = None  # write the node record again then (etcd failed)
        try:
            while True:
                due = [t for t in (wake_at, retry_at) if t is not None]
                # (at most an hour: a deadline years away, as a hold's end may be, would
                # overflow the queue's timeout; a wake with nothing due decides nothing new)
                timeout = min(max(0.0, min(due) - self._clock()), 3600.0) if due else None
                try:
                    msg = self._inbox.get(timeout=timeout)
                except queue.Empty:
                    msg = Wake()
                if isinstance(msg, Stop) or self._stopped:
                    break
                self._take(msg, watches)
                if self._unpublished and (retry_at is None or self._clock() >= retry_at):
                    retry_at = None if self._write_node() else self._clock() + WRITE_RETRY_S
                wake_at = self._leading.step() if self._leading.active else None
        finally:
            for w in watches:
                w.cancel()

    def _take(self, msg: Message, watches: list[Watch]) -> None:
        """Act on one message of the inbox (the loop then writes the record, and decides)."""
        match msg:
            case Watched():
                self._on_watched(msg, watches)
            case LeaseExpired() if self._session is not None and self._session.expired:
                self._register_again()
                self._elect(watches)
            case Serve():
                self._retried("publish the store's port", self._rounds.serve)
            case Forgot():
                self._on_forgot_etcd()
            case FailureSeen(generation=generation):
                if self._leading.active:
                    self._leading.probe_all()
                else:
                    assert self._session is not None
                    self._liveness.report(generation, self._session.lease_id)
            case Probed(replies=replies):
                self._liveness.on_probed(replies)
            case Asked():
                self._leading.on_asked(msg)

    def _on_watched(self, msg: Watched, watches: list[Watch]) -> None:
        """A batch of one of the watches; one of an earlier election is dropped, and a watch
        failed for good fails the rendezvous."""
        if msg.kind is not WatchKind.ROUND and msg.term != self._term:
            return
        if isinstance(msg.item, StoreError):
            raise msg.item
        batch = msg.item
        if msg.kind is WatchKind.ROUND:
            self._rounds.on_batch(batch)
        elif msg.kind is WatchKind.PREDECESSOR:
            if moved(batch):  # gone, or made again, or re-listed: follow anew, or lead
                self._elect(watches)
        elif msg.kind is WatchKind.NODES:
            self._leading.on_nodes(batch)
        elif msg.kind is WatchKind.HOLDS:
            self._leading.on_holds(batch)
        else:
            self._leading.on_failures(batch)

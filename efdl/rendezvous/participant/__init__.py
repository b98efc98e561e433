"""One node's part in a job's rendezvous: register, elect, follow (or write) rounds.

The etcd I/O around :func:`~efdl.rendezvous.decide.decide`. Traffic per agent is O(1) per
round, in requests and in bytes: every agent watches the round key (whose size does not grow
with the fleet), reads its own member record once per round, and, for the election, watches
only the node key just before its own (etcd's election pattern, found with one sorted,
limited range request); only the leader reads and watches all node records.

Keys (``/efdl/<job>/``): ``nodes/<id>`` (the node record, bound to the agent's lease; the
oldest is the leader), ``members/<id>`` (the node's place in the newest active round,
written by the leader before the round), ``failures/<id>`` (the generation in which a
collective of the node's workers failed, bound to the lease; the leader then probes the
nodes: efdl.rendezvous.probe), ``round`` (written by the leader with compare-and-swap on its
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
from typing import NoReturn, TypeVar

from efdl.errors import (
    CompactedError,
    DuplicateNodeError,
    LeaseLostError,
    RendezvousError,
    StoreConnectionError,
    StoreError,
)
from efdl.rendezvous.api import (
    Compare,
    Delete,
    EventType,
    Get,
    KeyValue,
    KVStore,
    Put,
    Watch,
    WatchBatch,
)
from efdl.rendezvous.decide import FENCE_MARGIN_S, JobView, NodeView, Policy, decide
from efdl.rendezvous.event_log import EventLog
from efdl.rendezvous.lease import LeaseSession
from efdl.rendezvous.probe import Reply, ask, ask_all, knock_all
from efdl.rendezvous.reading import (
    BLIP_S,
    parse_nodes,
    parse_round,
    read_members,
    retried,
)
from efdl.rendezvous.records import (
    EventKind,
    JobKeys,
    Member,
    NodeRecord,
    RecordError,
    Round,
    RoundStatus,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
# What happened, its payload, and the election it belongs to (watches of an earlier election
# of this node may still deliver; their items are dropped).
_InboxItem = tuple[str, object, int]
_Target = tuple[str, str, int, int]  # a node to probe: id, host, probe port, lease
# How long the leader waits for the answer of a member whose record went (see _await), and,
# in lease TTLs, for such a member to register again once its agent said it runs the round
# still: etcd revoked its lease, or the lease expired while etcd was away.
ASK_S = 3.0
REJOIN_TTLS = 2.0
# Operations per transaction when the leader writes the members' records: etcd's default
# --max-txn-ops.
TXN_OPS = 128
# A leader whose round write was refused decides again after this long, doubling with each
# refusal in a row up to the maximum.
CAS_BACKOFF_S = 0.05
# How long, in lease TTLs, a leader that finds the active round's member records lost (etcd
# forgot them) waits for its members to register again claiming it.
RECORDS_LOST_TTLS = 3.0
CAS_BACKOFF_MAX_S = 2.0


# What _own_member says of a round whose member records are being replaced by a newer one's.
_SUPERSEDED = Member("", 1, 0)


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
            reached etcd with its lease alive (efdl.state.fence).
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
        self.keys = JobKeys(job_id)
        self._on_forgot = on_forgot
        self._on_contact = on_contact
        self._events = events
        self._on_round = on_round
        self._on_failure = on_failure
        if serve_tcpstore is None and node.store_port == 0:
            raise RendezvousError(
                f"Node {node.node_id} has neither a store server nor a fixed store port."
            )
        self._serve_tcpstore = serve_tcpstore or (lambda _round: node.store_port)
        self._store = store
        self._node = node
        self._policy = policy
        self._ttl_s = lease_ttl_s
        self._clock = clock
        self._wall = wall
        self._on_lease_expired = on_lease_expired
        self._on_etcd_silent = on_etcd_silent
        self._holds = holds or (lambda: "")
        # etcd calls of the rendezvous thread wait for etcd as long as the job may wait for
        # its members: an outage is outlived, not failed on.
        self._wait_s = max(BLIP_S, policy.join_timeout_s)
        self._inbox: queue.Queue[_InboxItem] = queue.Queue()
        self._cond = threading.Condition()
        self._round: Round | None = None  # the newest round seen, served or not
        self._served: Round | None = None  # the newest served round: what the node acts on
        self._round_mod_revision = 0
        # The members of the newest active round, while this node leads (it wrote them, or
        # read them when it took over), and that round's id.
        self._members: tuple[Member, ...] = ()
        self._members_of = ""
        self._is_leader = False
        self._stopped = False
        self._failure = ""  # why the rendezvous thread died, if it did
        self._session: LeaseSession | None = None
        self._my_revision = 0
        self._unpublished = False  # self._node has changes not written to etcd yet
        self._write_failing = False  # the last write of the node record failed
        self._election = 0  # bumped when this node follows or leads anew
        # Leader: members whose record went, and until when to wait for them (clock time):
        # first for their agent's answer, then for them to register again (see decide).
        self._returning: dict[str, float] = {}
        # Leader: members whose record went with no evidence that their workers stopped, and
        # until when they may be training still, cut off from etcd (see decide: fencing).
        self._silent: dict[str, float] = {}
        # Leader: members already waited for in this generation, and those waited for now
        # (see _on_asked).
        self._waited: set[str] = set()
        self._rejoining: set[str] = set()
        # Leader: rounds whose member records etcd lost, and since when (see _decide).
        self._records_lost: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        # Evidence of dead nodes (efdl.rendezvous.probe): the node just before this one (its
        # record as read), the nodes whose probe port answered (and their lease then), the
        # targets not probed yet and whether a probe runs.
        self._pred: KeyValue | None = None
        self._answered: dict[str, int] = {}
        self._to_probe: dict[str, _Target] = {}
        self._probing = False
        self._cas_failures = 0  # round writes refused in a row (backed off)
        store.on_forgot(lambda why: self._inbox.put(("forgot", why, 0)))

    # ---------------------------------------------------------------- public

    @property
    def node_id(self) -> str:
        return self._node.node_id

    @property
    def is_leader(self) -> bool:
        return self._is_leader

    @property
    def lease_healthy(self) -> bool:
        """Whether the lease was renewed within its TTL (etcd answers, the keys stand)."""
        session = self._session
        return session is not None and not session.expired and session.silent_s < self._ttl_s

    @property
    def current_round(self) -> Round | None:
        """The newest served round (see :attr:`Round.served`)."""
        with self._cond:
            return self._served

    def _tag(self) -> str:
        gen = self._served.generation if self._served else 0
        return f"job {self.keys.job_id} node {self.node_id} gen {gen}"

    @property
    def node(self) -> NodeRecord:
        """This node's record as it offers itself now (written, or about to be)."""
        with self._cond:
            return self._node

    def join(self) -> None:
        """Register this node (bound to a new lease) and start following rounds.

        Raises:
            DuplicateNodeError: a live node with the same id is already in the job (its
                record stands, or it runs the current round while its lease is lost).
            StoreError: etcd failed.
        """
        self._check_not_held()
        self._register()
        self._thread = threading.Thread(
            target=self._run, name=f"efdl-rdzv-{self.node_id}", daemon=True
        )
        self._thread.start()

    def _check_not_held(self) -> None:
        """Refuse this node's id if a live agent holds it: a member of the current round
        whose record went (its lease was lost: cut off from etcd, or etcd revoked it) while
        its agent still runs the round's workers, and registers again by itself. Taken by a
        second agent meanwhile, the id would make two nodes one. Two small reads, and one
        question to that agent's probe port (an agent that does not answer may be alive: it
        is fenced, efdl.state.fence, and its generation waited out)."""
        read = self._retried(
            "read the round and this node's place",
            lambda: self._store.txn(
                [], [Get(self.keys.round), Get(self.keys.member(self.node_id))]
            ),
        )
        current = parse_round(read.gets[0][0] if read.gets[0] else None, self.keys)
        if current is None or current.status is not RoundStatus.ACTIVE or not read.gets[1]:
            return
        kv = read.gets[1][0]
        try:
            member = Member.from_json(kv.value, kv.key)
        except RecordError:
            return
        if member.round_id != current.round_id or not member.probe_port:
            return
        reply, said = ask(member.host, member.probe_port)
        if reply is not Reply.ANSWERED or said is None:
            return
        if said.get("node_id") == self.node_id and said.get("holds") == current.round_id:
            raise DuplicateNodeError(
                f"Node id {self.node_id!r} is held by a live agent of job {self.keys.job_id!r} "
                f"at {member.host} (probe port {member.probe_port}, pid {said.get('pid')}), "
                f"which runs round {current.generation} while it registers again after losing "
                "its lease; give this node another --node-id."
            )

    def _register(self, holds: str = "", again: bool = False) -> None:
        """Write this node's record, bound to a new lease; ``holds``: see NodeRecord;
        ``again``: after a lost lease, where an earlier attempt may have been applied."""
        # Contact counts only once this lease's record is written (efdl.state.fence): a lease
        # granted while the record cannot be written (its id held, etcd refusing) proves
        # nothing a leader can see, and must not move the workers' fence on.
        registered = threading.Event()
        on_contact = self._on_contact

        def contact(at: float) -> None:
            if registered.is_set() and on_contact is not None:
                on_contact(at)

        session = LeaseSession(
            self._store,
            self._ttl_s,
            on_expired=self._lease_gone,
            on_silent=self._on_etcd_silent,
            on_contact=contact,
        )
        with self._cond:
            node = replace(self._node, holds=holds)
        key = self.keys.node(self.node_id)
        try:
            result = self._store.txn(
                [Compare.absent(key)],
                [Put(key, node.to_json(), session.lease_id)],
                [Get(key)],
            )
        except BaseException:
            session.close()
            raise
        existing = result.gets[0][0] if not result.succeeded and result.gets[0] else None
        if existing is not None and existing.lease == session.lease_id:
            # Our own record: a first attempt was applied, its answer lost, and retried.
            result = replace(result, succeeded=True, revision=existing.create_revision)
        if not result.succeeded:
            session.close()
            other = ""
            if existing is not None:
                try:
                    theirs = NodeRecord.from_json(existing.value, key)
                except RecordError:
                    theirs = None
                same = theirs is not None and theirs.start_time == node.start_time
                if again and same and theirs is not None and theirs.host == node.host:
                    # Ours, from an attempt whose answer was lost: nobody renews its lease,
                    # so it goes within a TTL (a StoreError: the caller tries again).
                    raise StoreConnectionError(
                        f"The node record {key} of an earlier attempt to register is still "
                        f"there (lease {existing.lease:x}); it goes within {self._ttl_s} s."
                    )
                other = f" (host {theirs.host})" if theirs is not None else ""
            raise DuplicateNodeError(
                f"A live node with id {self.node_id!r} is already in job {self.keys.job_id!r}"
                f"{other}; give this node another --node-id."
            )
        with self._cond:
            self._session, self._my_revision = session, result.revision
            self._node, self._unpublished = node, False
        registered.set()
        log.info(
            "Job %s: node %s %s (lease %x).",
            self.keys.job_id,
            self.node_id,
            f"registered again, still running round {holds}" if holds else "joined",
            session.lease_id,
        )

    def next_round(self, after: int, timeout_s: float | None = None) -> Round | None:
        """The newest round with a generation above ``after``, waiting up to ``timeout_s``.

        A round superseded before the caller asked is skipped: each round is acted on at
        most once, and the newest one always is.

        Raises:
            RendezvousError: the rendezvous failed on this node (it has left the job).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._failure:
                    raise RendezvousError(self._failure)
                if self._served is not None and self._served.generation > after:
                    return self._served
                if self._stopped:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(timeout=min(remaining, 1.0) if remaining is not None else 1.0)

    def report_failure(self, generation: int) -> None:
        """A collective of this node's workers failed in ``generation`` (a peer's connection
        closed, or a worker died): have the nodes probed for dead agents, so that a node
        whose agent died with its workers leaves the job before its lease expires."""
        self._inbox.put(("report", generation, 0))

    def request_restart(self) -> None:
        """Ask for a new round with the same members (this node restarted its workers)."""
        with self._cond:
            node = self._node
        self._publish(replace(node, incarnation=node.incarnation + 1, down=0))

    def set_down(self, down: int) -> None:
        """Offer ``slots - down`` workers: ``down`` in-place workers died and their
        replacements are not ready yet. A rise asks for a new round at once (the survivors go
        on without them); a fall (a replacement is ready) is an ordinary offer of more."""
        with self._cond:
            node = self._node
        if down > node.down:
            self._publish(replace(node, incarnation=node.incarnation + 1, down=down))
        elif down < node.down:
            self._publish(replace(node, down=down))

    def _publish(self, node: NodeRecord) -> None:
        """Offer ``node`` from now on: the rendezvous thread writes it, while the record is
        this node's, as soon as etcd answers (a node that registers again writes it too).
        Returns at once: the caller (the agent's event loop) never waits for etcd."""
        with self._cond:
            self._node, self._unpublished = node, True
        self._inbox.put(("publish", None, 0))

    def _write_node(self) -> bool:
        """Write the newest record (:meth:`_publish`); False if etcd failed (try again)."""
        with self._cond:
            node, session, revision = self._node, self._session, self._my_revision
            self._unpublished = False
        assert session is not None
        key = self.keys.node(self.node_id)
        try:
            ok = self._store.txn(
                [Compare.create_revision_is(key, revision)],
                [Put(key, node.to_json(), session.lease_id)],
            ).succeeded
        except StoreError as exc:
            # Said once until a write succeeds: an etcd away for minutes would fill the log.
            level = logging.DEBUG if self._write_failing else logging.WARNING
            log.log(level, "%s: could not update the node record (%s); retrying.", self._tag(), exc)
            with self._cond:
                self._unpublished, self._write_failing = True, True
            return False
        self._write_failing = False
        if not ok:  # the lease is gone with the record: registering again writes it
            log.info("%s: the node record is gone; registering again writes it.", self._tag())
        return True

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

    # ---------------------------------------------------------------- internals

    def _stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._is_leader = False
            self._cond.notify_all()
        self._inbox.put(("stop", None, 0))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _retried(self, what: str, fn: Callable[[], T]) -> T:
        """:func:`retried` for as long as the job may wait for its members (an etcd outage
        is outlived; training does not need etcd meanwhile)."""
        return retried(what, fn, timeout_s=self._wait_s)

    def _lease_gone(self, reason: str) -> None:
        """From the lease's thread: etcd said the lease has expired."""
        with self._cond:
            self._is_leader = False
            self._cond.notify_all()
        self._inbox.put(("lease", None, 0))
        if self._on_lease_expired is not None:
            self._on_lease_expired(reason)

    def _sink(self, tag: str) -> Callable[[WatchBatch | StoreError], None]:
        """A watch's sink into the inbox, for this node's current election (``tag`` pred,
        nodes, failures) or for good (round)."""
        election = self._election
        return lambda item: self._inbox.put((tag, item, election))

    def _register_again(self) -> None:
        """etcd said the lease has expired: every key bound to it is gone. Register again
        under a new lease, saying which round's workers this node still runs: a leader takes
        it for the member it was (no round follows) if that round is still the job's; if the
        job moved on without it, it is a newcomer. Waits for etcd (``_wait_s``)."""
        with self._cond:
            self._is_leader = False
            old = self._session
        if old is not None:
            old.close(revoke=False)
        holds = self._holds()
        log.warning(
            "%s: the lease is gone; registering again (%s).",
            self._tag(),
            f"its workers run round {holds} still" if holds else "as a newcomer",
        )
        self._retried("register this node again", lambda: self._register(holds, again=True))

    def _set_round(self, kv: KeyValue | None, adopt: bool = False) -> None:
        """Take in the round key as read or watched; events may arrive late, never go back,
        unless ``adopt``: what a read or a re-list says etcd holds now (etcd may have gone
        back: restored from a backup), whose revision the next write must compare."""
        parsed = parse_round(kv, self.keys)
        if kv is None:
            return
        with self._cond:
            if adopt or kv.mod_revision > self._round_mod_revision:
                # Also for a bad record: the leader's next round replaces it (its write
                # compares this revision), instead of failing that compare forever.
                self._round_mod_revision = kv.mod_revision
            if parsed is None:
                return
            latest = self._round
            if (
                latest is None
                or parsed.generation > latest.generation
                or (parsed.generation == latest.generation and parsed.served and not latest.served)
            ):
                self._round = latest = parsed
            acted = self._served.generation if self._served is not None else 0
        if not latest.served:
            if latest.head == self.node_id:
                self._inbox.put(("serve", None, 0))
            return
        if acted >= latest.generation:
            return
        if latest.status is RoundStatus.ACTIVE:
            member = self._own_member(latest)
            if member is _SUPERSEDED:
                log.info(
                    "%s: round %d is being replaced (this node's record is of a newer one): "
                    "acting on the newer round when it comes.",
                    self._tag(),
                    latest.generation,
                )
                return
            latest = replace(latest, member=member)
        with self._cond:
            self._served = latest
            self._cond.notify_all()
        log.info(
            "Job %s: node %s sees round %d, %s (world size %d): %s.",
            self.keys.job_id,
            self.node_id,
            latest.generation,
            latest.status.value,
            latest.world_size,
            latest.reason,
        )
        if self._on_round is not None:
            self._on_round(latest)

    def _own_member(self, r: Round) -> Member | None:
        """This node's record in active round ``r`` (None: not a member), as it was when the
        leader had written them all: one small read, unless this node wrote the round. When
        that revision was compacted, the record as it is now: one of a newer round than ``r``
        means that ``r`` is being replaced (:data:`_SUPERSEDED`: do not act on ``r``; taking
        the node for no member would send its in-place workers away for nothing)."""
        if self._members_of == r.round_id:
            return next((m for m in self._members if m.node_id == self.node_id), None)
        key = self.keys.member(self.node_id)
        try:
            kv = self._retried(
                "read this node's place in the round",
                lambda: self._store.get(key, revision=r.members_revision),
            )
        except CompactedError:  # an old round: nothing has been written since, as a rule
            kv = self._retried("read this node's place in the round", lambda: self._store.get(key))
        if kv is None:
            return None
        try:
            member = Member.from_json(kv.value, key)
        except RecordError as exc:
            log.error("%s: ignoring a bad member record: %s", self._tag(), exc)
            return None
        if member.round_id == r.round_id:
            return member
        return _SUPERSEDED if member.generation > r.generation else None

    def _serve(self, r: Round) -> int:
        try:
            port = self._serve_tcpstore(r)
        except Exception as exc:
            raise RendezvousError(
                f"Node {self.node_id} could not serve the c10d store of round {r.generation}: {exc}"
            ) from exc
        if not 0 < port < 65536:
            raise RendezvousError(f"The store of round {r.generation} got port {port}.")
        return port

    def _publish_tcpstore(self) -> None:
        """As rank 0 of a new round: serve its fresh store, put the port into the round."""
        with self._cond:
            current, mod_revision = self._round, self._round_mod_revision
        if current is None or current.served or current.head != self.node_id:
            return
        done = replace(current, store_port=self._serve(current))
        result = self._store.txn(
            [Compare.mod_revision_is(self.keys.round, mod_revision)],
            [Put(self.keys.round, done.to_json())],
        )
        if result.succeeded:
            self._set_round(KeyValue(self.keys.round, done.to_json(), 0, result.revision))
        else:
            log.info(
                "%s: round %d was superseded before its store was published.",
                self._tag(),
                current.generation,
            )

    def _on_forgot_etcd(self) -> None:
        """etcd forgot what it held (the watches re-list by themselves): take the round key
        as it is now (the next write compares its revision, which may have gone down), write
        this node's record again where it stands (a lost lease registers anew by itself), and
        let the agent publish what only its memory holds."""
        read = self._retried("read the round", lambda: self._store.txn([], [Get(self.keys.round)]))
        if read.gets[0]:
            self._set_round(read.gets[0][0], adopt=True)
        else:
            self._round_deleted()
        with self._cond:
            self._unpublished = True
        self._cas_failures = 0
        if self._on_forgot is not None:
            self._on_forgot()

    def _round_deleted(self) -> None:
        """Someone deleted the round key: the next round is written on its absence; the
        generations go on from the last one seen."""
        with self._cond:
            self._round_mod_revision = 0
        log.warning("Job %s: the round key was deleted.", self.keys.job_id)

    def _run(self) -> None:
        watches: list[Watch] = []
        try:
            # Two small reads, not the job's prefix: O(1) bytes per agent at any fleet size.
            read = self._retried(
                "read the round", lambda: self._store.txn([], [Get(self.keys.round)])
            )
            self._set_round(read.gets[0][0] if read.gets[0] else None)
            watches.append(
                self._store.watch(
                    self.keys.round, start_revision=read.revision + 1, sink=self._sink("round")
                )
            )
            self._loop()
        except Exception as exc:
            log.error("%s: the rendezvous failed: %s", self._tag(), exc, exc_info=True)
            with self._cond:
                self._is_leader = False
            if self._session is not None:
                self._session.close(revoke=True)  # leave first, so the others go on without us
            with self._cond:
                self._failure = f"The rendezvous of node {self.node_id} failed: {exc}"
                self._cond.notify_all()
            if self._on_failure is not None:
                self._on_failure(self._failure)
        finally:
            for w in watches:
                w.cancel()

    def _follow(self) -> Watch | None:
        """Watch the node just before ours; None if there is none: we lead."""
        snap = self._retried(
            "find the node before this one",
            lambda: self._store.last_created(self.keys.nodes, self._my_revision),
        )
        if not snap.kvs:
            self._pred = None
            return None
        self._pred = snap.kvs[0]
        self._probe(self._pred_target())  # once now: a later refusal is evidence (knock_all)
        return self._store.watch(
            snap.kvs[0].key, start_revision=snap.revision + 1, sink=self._sink("pred")
        )

    def _elect(self, watches: list[Watch]) -> dict[str, NodeView] | None:
        """Follow the node before this one, or lead if there is none, replacing the watches
        of an earlier election; the nodes as read when leading (None: following)."""
        for w in watches:
            w.cancel()
        watches.clear()
        self._election += 1  # what the old watches still deliver is dropped
        with self._cond:
            self._is_leader = False
        pred = self._follow()
        if pred is not None:
            watches.append(pred)
            return None
        nodes_watch, failures_watch, nodes = self._lead()
        watches += [nodes_watch, failures_watch]
        return nodes

    def _loop(self) -> None:
        watches: list[Watch] = []  # this election's: the predecessor's, or the leader's two
        nodes = self._elect(watches) or {}
        last_change = self._clock()
        wake_at: float | None = None
        retry_at: float | None = None  # write the node record again then (etcd failed)
        try:
            while True:
                due = [t for t in (wake_at, retry_at) if t is not None]
                timeout = max(0.0, min(due) - self._clock()) if due else None
                try:
                    tag, item, election = self._inbox.get(timeout=timeout)
                except queue.Empty:
                    tag, item, election = "wake", None, 0
                if tag == "stop" or self._stopped:
                    break
                if tag in ("pred", "nodes", "failures") and election != self._election:
                    continue  # a watch of an earlier election
                if isinstance(item, StoreError):
                    raise item
                if tag == "lease" and self._session is not None and self._session.expired:
                    self._register_again()
                    nodes, last_change = self._elect(watches) or {}, self._clock()
                elif tag == "serve":
                    self._retried("publish the store's port", self._publish_tcpstore)
                elif tag == "round" and isinstance(item, WatchBatch):
                    self._on_round_batch(item)
                elif tag == "forgot" and isinstance(item, str):
                    self._on_forgot_etcd()
                elif tag == "pred" and isinstance(item, WatchBatch):
                    # Gone (a reset batch, after a compaction, says what is there now: our
                    # predecessor's record, or nothing), or made again (a new create revision,
                    # after ours: not our predecessor any more): follow anew, or lead.
                    if item.reset or any(ev.type is EventType.DELETE for ev in item.events):
                        found = self._elect(watches)
                        if found is not None:
                            nodes, last_change = found, self._clock()
                elif tag == "nodes" and isinstance(item, WatchBatch):
                    self._on_nodes_batch(item, nodes)
                    last_change = self._clock()
                elif tag == "failures" and isinstance(item, WatchBatch):
                    if self._is_leader and any(ev.type is EventType.PUT for ev in item.events):
                        self._probe(self._targets(nodes))
                elif tag == "report" and isinstance(item, int):
                    self._on_report(item, nodes)
                elif tag == "probed" and isinstance(item, list):
                    self._on_probed(item)
                elif tag == "asked" and isinstance(item, dict):
                    self._on_asked(item)
                if self._unpublished and (retry_at is None or self._clock() >= retry_at):
                    retry_at = None if self._write_node() else self._clock() + 0.5
                if self._is_leader:
                    try:
                        wake_at = self._decide(nodes, last_change)
                    except StoreError as exc:
                        log.warning(
                            "%s: could not write the next round (%s); retrying.", self._tag(), exc
                        )
                        wake_at = self._clock() + 0.5
                else:
                    wake_at = None
        finally:
            for w in watches:
                w.cancel()

    def _on_round_batch(self, batch: WatchBatch) -> None:
        """The round key changed; a reset batch (after a compaction, or etcd forgetting) holds
        it as it is now, and no PUT in it means that it was deleted."""
        for ev in batch.events:
            if ev.type is EventType.PUT:
                self._set_round(ev.kv, adopt=batch.reset)
            else:
                self._round_deleted()
        if batch.reset and not any(ev.kv.key == self.keys.round for ev in batch.events):
            self._round_deleted()

    def _on_nodes_batch(self, batch: WatchBatch, nodes: dict[str, NodeView]) -> None:
        """Leader: the node records changed (a reset batch holds them all as they are now).
        A member of the active round whose record went is asked whether it comes back."""
        if batch.reset:
            nodes.clear()
        for ev in batch.events:
            node_id = self.keys.node_id_of(ev.kv.key)
            if ev.type is EventType.DELETE:
                nodes.pop(node_id, None)
                self._answered.pop(node_id, None)
            else:
                known = nodes.get(node_id)
                nodes.update(parse_nodes((ev.kv,), self.keys))
                self._returning.pop(node_id, None)
                self._rejoining.discard(node_id)
                claim = nodes.get(node_id)
                current = self._round
                if (
                    claim is not None
                    and current is not None
                    and claim.record.holds == (current.round_id)
                ):
                    # The member it was, back: its workers are on etcd's side again. (A new
                    # agent under its id, claiming nothing, says nothing of the old workers.)
                    self._silent.pop(node_id, None)
                if known is None or known.lease != ev.kv.lease:  # a newcomer
                    self._probe(self._targets(nodes, {node_id}))
        self._await([m for m in self._current_members(self._round) if m.node_id not in nodes])

    def _lead(self) -> tuple[Watch, Watch, dict[str, NodeView]]:
        """Become the leader: read every node record (the one agent that does) and watch them,
        and the failure reports. Members of the active round without a record are asked
        whether they come back (their lease may be what went, not their node)."""
        with self._cond:
            self._is_leader = True
        log.info("%s: this node leads the job.", self._tag())
        snap = self._retried(
            "list the job's nodes", lambda: self._store.get_prefix(self.keys.nodes)
        )
        start = snap.revision + 1
        watch = self._store.watch(
            self.keys.nodes, prefix=True, start_revision=start, sink=self._sink("nodes")
        )
        failures = self._store.watch(
            self.keys.failures, prefix=True, start_revision=start, sink=self._sink("failures")
        )
        nodes = parse_nodes(snap.kvs, self.keys)
        self._returning.clear()
        self._silent.clear()
        self._waited.clear()
        self._rejoining.clear()
        self._await([m for m in self._current_members(self._round) if m.node_id not in nodes])
        self._inbox.put(("wake", None, 0))
        self._probe(self._targets(nodes))  # what answers now may be evidence later
        return watch, failures, nodes

    # ---------------------------------------------------------------- members coming back

    def _await(self, missing: list[Member]) -> None:
        """Leader: members of the active round whose record is gone. Each is waited for (no
        round is written) until its agent has answered on its probe port (at most ASK_S):
        if it says it runs the round's workers still, its lease was lost, not its node, and
        it registers again; a refusal, silence, or another answer means it has left. Until
        a refusal, or an answer that it runs none of the round's workers, it may be training
        still, cut off from etcd: silent, for its fence timeout and a margin from now (see
        decide: fencing). A leader that takes over learns of them now: their records went
        before, so this wait ends later than their fences close, never sooner."""
        now = self._clock()
        for m in missing:
            # Newly missing only: one asked already may have been found gone since.
            if m.fence_s > 0 and m.node_id != self.node_id and m.node_id not in self._returning:
                self._silent[m.node_id] = now + m.fence_s + FENCE_MARGIN_S
        targets = []
        for m in missing:
            if m.probe_port and m.node_id not in self._returning and m.node_id != self.node_id:
                self._returning[m.node_id] = now + ASK_S
                targets.append((m.node_id, m.host, m.probe_port))
        if not targets:
            return
        election = self._election

        def run() -> None:
            self._inbox.put(("asked", ask_all(targets), election))

        threading.Thread(target=run, name="efdl-ask", daemon=True).start()

    def _on_asked(self, replies: dict[str, tuple[Reply, dict[str, object] | None]]) -> None:
        """The answers of members whose record went (see :meth:`_await`)."""
        with self._cond:
            current = self._round
        for node_id, (reply, said) in replies.items():
            if node_id not in self._returning or node_id in self._rejoining:
                continue  # registered again meanwhile, or waited for already (a 2nd answer)
            holds = said.get("holds") if said else None
            if (
                reply is Reply.ANSWERED
                and current is not None
                and holds == current.round_id
                and node_id not in self._waited
            ):
                # Once per member and generation: an agent whose lease keeps being lost (or
                # anything that answers on its port) cannot hold every round back for good.
                self._waited.add(node_id)
                self._rejoining.add(node_id)
                wait_s = REJOIN_TTLS * self._ttl_s
                self._returning[node_id] = self._clock() + wait_s
                log.warning(
                    "%s: the record of node %s went, but its agent runs round %d still: "
                    "waiting up to %.0f s for it to register again.",
                    self._tag(),
                    node_id,
                    current.generation,
                    wait_s,
                )
            else:
                self._returning[node_id] = 0.0  # not waited for again, nor asked again
                runs_it = current is not None and holds == current.round_id
                said_none = reply is Reply.ANSWERED and said is not None and not runs_it
                if reply is Reply.REFUSED or said_none:
                    # Its agent is gone (nothing listens: its workers died with it), or says,
                    # in so many words, that it runs none of the round's workers: nothing of
                    # it trains. Anything else (silence, a connection that says nothing: a
                    # stopped or hung agent, or one that runs the round but was waited for
                    # once already) leaves it to its fence.
                    self._silent.pop(node_id, None)
                log.info(
                    "%s: node %s %s.",
                    self._tag(),
                    node_id,
                    "has left (its agent refused the connection: it is gone)"
                    if reply is Reply.REFUSED
                    else "has left (its agent answered that it runs no round of ours)"
                    if said_none
                    else "is not waited for (its agent runs the round still, and was waited "
                    "for once this generation): its generation is replaced once it stopped"
                    if runs_it
                    else f"is not waited for (its agent's probe port: {reply.value}, nothing "
                    "said): its generation is replaced once it stopped",
                )

    # ---------------------------------------------------------------- evidence of dead nodes

    def _on_report(self, generation: int, nodes: dict[str, NodeView]) -> None:
        """This node's workers saw a collective fail in ``generation``: as leader, probe every
        node; else report it for the leader, and probe the node before this one (the leader
        may be the dead one)."""
        if self._is_leader:
            self._probe(self._targets(nodes))
            return
        assert self._session is not None
        lease = self._session.lease_id
        try:
            self._store.put(self.keys.failure(self.node_id), str(generation).encode(), lease)
        except StoreError as exc:  # only a hint: the lease still decides
            log.warning("%s: could not report the failed collective (%s).", self._tag(), exc)
        self._probe(self._pred_target())

    def _targets(self, nodes: dict[str, NodeView], only: set[str] | None = None) -> list[_Target]:
        return [
            (n, v.record.host, v.record.probe_port, v.lease)
            for n, v in sorted(nodes.items())
            if n != self.node_id and v.record.probe_port and (only is None or n in only)
        ]

    def _pred_target(self) -> list[_Target]:
        kv = self._pred
        if kv is None:
            return []
        try:
            record = NodeRecord.from_json(kv.value, kv.key)
        except RecordError:
            return []
        return [(record.node_id, record.host, record.probe_port, kv.lease)]

    def _probe(self, targets: list[_Target]) -> None:
        """Probe ``targets`` on a thread, one probe at a time (targets asked for meanwhile
        wait for the next); the replies come back to the loop as ``probed``."""
        with self._cond:
            self._to_probe.update((t[0], t) for t in targets if t[2])
            if self._probing or not self._to_probe:
                return
            self._probing = True

        def run() -> None:
            while True:
                with self._cond:
                    todo, self._to_probe = list(self._to_probe.values()), {}
                    if not todo or self._stopped:
                        self._probing = False
                        return
                replies = knock_all((n, host, port) for n, host, port, _ in todo)
                self._inbox.put(("probed", [(t, replies[t[0]]) for t in todo], 0))

        threading.Thread(target=run, name="efdl-probe", daemon=True).start()

    def _on_probed(self, replies: list[tuple[_Target, Reply]]) -> None:
        """Remember who answered; end the lease of a node whose port answered before and
        refuses now: its agent is gone, and its keys go as if the lease had expired."""
        for (node_id, host, port, lease), reply in replies:
            if reply is Reply.ANSWERED:
                self._answered[node_id] = lease
                continue
            if reply is not Reply.REFUSED:
                continue
            if self._answered.get(node_id) != lease:
                log.info(
                    "%s: node %s refused a connection at %s:%d, which never answered (a "
                    "firewall?): its lease decides.",
                    self._tag(),
                    node_id,
                    host,
                    port,
                )
                continue
            del self._answered[node_id]
            log.warning(
                "%s: node %s is gone: its agent at %s:%d refused a connection after a "
                "collective failed; ending its lease instead of waiting up to %d s for it "
                "to expire.",
                self._tag(),
                node_id,
                host,
                port,
                self._ttl_s,
            )
            if self._events is not None:
                gen = self._round.generation if self._round else 0
                self._events.record(
                    EventKind.EVICT,
                    gen,
                    f"evicted by {self.node_id}: its agent refused a connection",
                    node=node_id,
                )
            try:
                self._store.revoke_lease(lease)
            except StoreError as exc:
                log.warning("%s: could not end the lease of %s (%s).", self._tag(), node_id, exc)

    def _current_members(self, r: Round | None) -> tuple[Member, ...]:
        """The members of round ``r``: known if this node wrote it, else read (once)."""
        if r is None or r.status is not RoundStatus.ACTIVE:
            return ()
        if self._members_of != r.round_id:
            self._members = read_members(self._store, self.keys, r)
            self._members_of = r.round_id
        return self._members

    def _decide(self, nodes: dict[str, NodeView], last_change: float) -> float | None:
        """Decide once as leader; write the round if there is one. Returns when to wake."""
        with self._cond:
            current = self._round
        now = self._clock()
        members = self._current_members(current)
        if current is not None and current.status is RoundStatus.ACTIVE:
            if len(members) < current.nodes:
                members = self._recovered(current, members, nodes)
            if len(members) < current.nodes:
                lost_at = self._records_lost.setdefault(current.round_id, now)
                until = lost_at + RECORDS_LOST_TTLS * self._ttl_s
                if now < until:
                    if lost_at == now:
                        log.warning(
                            "%s: etcd holds %d of round %d's %d member records (it forgot): "
                            "waiting up to %.0f s for its members to register again, "
                            "claiming it.",
                            self._tag(),
                            len(members),
                            current.generation,
                            current.nodes,
                            until - now,
                        )
                    return until
        view = JobView(
            nodes,
            current,
            last_change=last_change,
            leader=self.node_id,
            members=members,
            returning=dict(self._returning),
            silent=dict(self._silent),
        )
        decision = decide(view, self._policy, now, self._wall())
        if decision.round is None:
            return decision.wake_at
        new = decision.round
        if decision.members:
            gone = {m.node_id for m in view.members} - {m.node_id for m in decision.members}
            new = replace(new, members_revision=self._write_members(decision.members, gone))
        # The rank-0 node serves the new round's store once the round is written (as a leader
        # that is itself the head, too): a write refused here must not have replaced the store
        # the current generation trains on.
        value = new.to_json()
        result = self._store.txn(
            [
                Compare.mod_revision_is(self.keys.round, self._round_mod_revision),
                Compare.create_revision_is(self.keys.node(self.node_id), self._my_revision),
            ],
            [Put(self.keys.round, value)],
            [Get(self.keys.round), Get(self.keys.node(self.node_id))],
        )
        if result.succeeded:
            self._cas_failures = 0
            self._silent.clear()  # the generation they may train in is replaced now
            self._waited.clear()
            self._rejoining.clear()
            if decision.members:
                self._members, self._members_of = decision.members, new.round_id
            if self._events is not None:
                self._events.round(new)
            kv = KeyValue(self.keys.round, value, 0, result.revision)
            self._set_round(kv)
            return None
        round_kvs, mine = result.gets
        if not mine or mine[0].create_revision != self._my_revision:
            self._not_leading()
        # Decide again on what etcd holds now, whatever its revision (an etcd restored from a
        # backup holds an older one: never adopting it failed this write forever), and back
        # off: another leader's writes win meanwhile.
        self._cas_failures += 1
        pause = min(CAS_BACKOFF_MAX_S, CAS_BACKOFF_S * 2.0 ** (self._cas_failures - 1))
        log.info("%s: the round changed under us; deciding again in %.2f s.", self._tag(), pause)
        if round_kvs:
            self._set_round(round_kvs[0], adopt=True)
        else:
            self._round_deleted()
        return self._clock() + pause

    def _recovered(
        self, r: Round, members: tuple[Member, ...], nodes: dict[str, NodeView]
    ) -> tuple[Member, ...]:
        """Round ``r``'s members when etcd lost some of their records: those read, then the
        nodes that registered again claiming ``r`` (their workers run it: their state must
        not be sent away for a spare's), in join order, ranked after them. Taken for the
        members they were; their worker counts are what their records offer."""
        known = {m.node_id for m in members}
        claimants = sorted(
            (n for n, v in nodes.items() if v.record.holds == r.round_id and n not in known),
            key=lambda n: (nodes[n].joined_revision, n),
        )
        out = list(members)
        rank = sum(m.workers for m in members)
        for n in claimants:
            v = nodes[n]
            out.append(
                Member(
                    n,
                    max(1, v.record.offered),
                    rank,
                    v.record.host,
                    v.record.incarnation,
                    v.joined_revision,
                    len(out),
                    r.generation,
                    r.round_id,
                    v.record.probe_port,
                    v.record.fence_s,
                )
            )
            rank += out[-1].workers
        return tuple(out)

    def _write_members(self, members: tuple[Member, ...], gone: set[str]) -> int:
        """Write the members' records of the next round (and delete those of the nodes that
        left), TXN_OPS per transaction, each only while this node's record stands (a leader
        whose lease is gone cannot write); returns the revision after the last."""
        ops: list[Put | Delete] = [Put(self.keys.member(m.node_id), m.to_json()) for m in members]
        ops += [Delete(self.keys.member(n)) for n in sorted(gone)]
        revision = 0
        for i in range(0, len(ops), TXN_OPS):
            result = self._store.txn(
                [Compare.create_revision_is(self.keys.node(self.node_id), self._my_revision)],
                ops[i : i + TXN_OPS],
            )
            if not result.succeeded:
                self._not_leading()
            revision = result.revision
        return revision

    def _not_leading(self) -> NoReturn:
        log.warning(
            "%s: our node record is gone (its lease expired); no longer leading.", self._tag()
        )
        with self._cond:
            self._is_leader = False
        raise LeaseLostError("The node record is gone.")

"""The job's rounds as one node sees them: the newest seen (served or not) and its revision,
the newest served one (what the node acts on) with the node's place in it, and the serving of
a new round's store by its head node. Every agent watches the round key (its size does not
grow with the fleet) and reads its own member record once per round."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from efdl.errors import CompactedError, RendezvousError
from efdl.rendezvous.api import Compare, EventType, Get, KeyValue, KVStore, Put, WatchBatch
from efdl.rendezvous.reading import parse_round, read_members, retried
from efdl.rendezvous.records import JobKeys, Member, RecordError, Round, RoundStatus

log = logging.getLogger(__name__)

# What Rounds.own_member says of a round whose member records are being replaced by a newer
# one's.
SUPERSEDED = Member("", 1, 0)


class Rounds:
    """What node ``node_id`` knows of job ``keys``'s rounds. The rendezvous thread takes
    rounds in; any thread reads them or waits for the next (:meth:`next`).

    Args:
        store: the job's etcd.
        keys: the job.
        node_id: this node.
        wait_s: how long a read waits for etcd (an outage is outlived, not failed on).
        on_round: called (from the rendezvous thread) with each newer served round.
        serve_tcpstore: called (from the rendezvous thread) when this node heads a new
            round: start its fresh c10d store and return the port.
        on_unserved: called when this node heads the newest round, not served yet: have
            the rendezvous thread call :meth:`serve`.
    """

    def __init__(
        self,
        store: KVStore,
        keys: JobKeys,
        node_id: str,
        wait_s: float,
        on_round: Callable[[Round], None] | None,
        serve_tcpstore: Callable[[Round], int],
        on_unserved: Callable[[], None],
    ) -> None:
        self._store = store
        self._keys = keys
        self._node_id = node_id
        self._wait_s = wait_s
        self._on_round = on_round
        self._serve_tcpstore = serve_tcpstore
        self._on_unserved = on_unserved
        self._cond = threading.Condition()
        self._round: Round | None = None  # the newest round seen, served or not
        self._served: Round | None = None  # the newest served round: what the node acts on
        self._mod_revision = 0
        # The members of the newest active round, while this node leads (it wrote them, or
        # read them when it took over), and that round's id.
        self._members: tuple[Member, ...] = ()
        self._members_of = ""
        self._closed = False
        self._failure = ""  # why the rendezvous failed on this node, if it did

    # ---------------------------------------------------------------- any thread

    @property
    def latest(self) -> Round | None:
        """The newest round seen, served or not."""
        with self._cond:
            return self._round

    @property
    def mod_revision(self) -> int:
        """The round key's revision as last taken in: the next write of the round compares it."""
        with self._cond:
            return self._mod_revision

    @property
    def served(self) -> Round | None:
        """The newest served round (see :attr:`Round.served`)."""
        with self._cond:
            return self._served

    def tag(self) -> str:
        """What a log line says first: the job, the node, the generation it acts on."""
        served = self.served
        gen = served.generation if served else 0
        return f"job {self._keys.job_id} node {self._node_id} gen {gen}"

    def next(self, after: int, timeout_s: float | None = None) -> Round | None:
        """The newest served round with a generation above ``after``, waiting up to
        ``timeout_s``; None once closed without one.

        Raises:
            RendezvousError: the rendezvous failed on this node (see :meth:`close`).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._failure:
                    raise RendezvousError(self._failure)
                if self._served is not None and self._served.generation > after:
                    return self._served
                if self._closed:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(timeout=min(remaining, 1.0) if remaining is not None else 1.0)

    def close(self, failure: str = "") -> None:
        """No more rounds: the node left, or (``failure``) the rendezvous failed on it."""
        with self._cond:
            self._closed = True
            self._failure = self._failure or failure
            self._cond.notify_all()

    # ---------------------------------------------------------------- the rendezvous thread

    def read(self, *, adopt: bool = False) -> int:
        """Read the round key and take it in; returns the revision read (watch from the next).
        ``adopt``: etcd forgot what it held; what it holds now replaces what was seen (its
        revision may have gone down), and no round key means that it was deleted."""
        read = retried(
            "read the round",
            lambda: self._store.txn([], [Get(self._keys.round)]),
            timeout_s=self._wait_s,
        )
        if read.gets[0]:
            self.take(read.gets[0][0], adopt=adopt)
        elif adopt:
            self.deleted()
        return read.revision

    def on_batch(self, batch: WatchBatch) -> None:
        """The round key changed; a reset batch (after a compaction, or etcd forgetting) holds
        it as it is now, and no PUT in it means that it was deleted."""
        for ev in batch.events:
            if ev.type is EventType.PUT:
                self.take(ev.kv, adopt=batch.reset)
            else:
                self.deleted()
        if batch.reset and not any(ev.kv.key == self._keys.round for ev in batch.events):
            self.deleted()

    def deleted(self) -> None:
        """Someone deleted the round key: the next round is written on its absence; the
        generations go on from the last one seen."""
        with self._cond:
            self._mod_revision = 0
        log.warning("Job %s: the round key was deleted.", self._keys.job_id)

    def take(self, kv: KeyValue | None, adopt: bool = False) -> None:
        """Take in the round key as read or watched; events may arrive late, never go back,
        unless ``adopt``: what a read or a re-list says etcd holds now (etcd may have gone
        back: restored from a backup), whose revision the next write must compare."""
        parsed = parse_round(kv, self._keys)
        if kv is None:
            return
        with self._cond:
            if adopt or kv.mod_revision > self._mod_revision:
                # Also for a bad record: the leader's next round replaces it (its write
                # compares this revision), instead of failing that compare forever.
                self._mod_revision = kv.mod_revision
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
            if latest.head == self._node_id:
                self._on_unserved()
            return
        if acted >= latest.generation:
            return
        if latest.status is RoundStatus.ACTIVE:
            member = self.own_member(latest)
            if member is SUPERSEDED:
                log.info(
                    "%s: round %d is being replaced (this node's record is of a newer one): "
                    "acting on the newer round when it comes.",
                    self.tag(),
                    latest.generation,
                )
                return
            latest = replace(latest, member=member)
        with self._cond:
            self._served = latest
            self._cond.notify_all()
        log.info(
            "Job %s: node %s sees round %d, %s (world size %d): %s.",
            self._keys.job_id,
            self._node_id,
            latest.generation,
            latest.status.value,
            latest.world_size,
            latest.reason,
        )
        if self._on_round is not None:
            self._on_round(latest)

    def own_member(self, r: Round) -> Member | None:
        """This node's record in active round ``r`` (None: not a member), as it was when the
        leader had written them all: one small read, unless this node wrote the round. When
        that revision was compacted, the record as it is now: one of a newer round than ``r``
        means that ``r`` is being replaced (:data:`SUPERSEDED`: do not act on ``r``; taking
        the node for no member would send its in-place workers away for nothing)."""
        if self._members_of == r.round_id:
            return next((m for m in self._members if m.node_id == self._node_id), None)
        key = self._keys.member(self._node_id)
        what = "read this node's place in the round"
        try:
            kv = retried(
                what,
                lambda: self._store.get(key, revision=r.members_revision),
                timeout_s=self._wait_s,
            )
        except CompactedError:  # an old round: nothing has been written since, as a rule
            kv = retried(what, lambda: self._store.get(key), timeout_s=self._wait_s)
        if kv is None:
            return None
        try:
            member = Member.from_json(kv.value, key)
        except RecordError as exc:
            log.error("%s: ignoring a bad member record: %s", self.tag(), exc)
            return None
        if member.round_id == r.round_id:
            return member
        return SUPERSEDED if member.generation > r.generation else None

    def members(self, r: Round | None) -> tuple[Member, ...]:
        """The members of round ``r``: known if this node wrote it, else read (once)."""
        if r is None or r.status is not RoundStatus.ACTIVE:
            return ()
        if self._members_of != r.round_id:
            self._members = read_members(self._store, self._keys, r)
            self._members_of = r.round_id
        return self._members

    def wrote(self, round_id: str, members: tuple[Member, ...]) -> None:
        """This node, leading, wrote ``members`` for round ``round_id``."""
        self._members, self._members_of = members, round_id

    def serve(self) -> None:
        """As rank 0 of a new round: serve its fresh store, put the port into the round."""
        with self._cond:
            current, mod_revision = self._round, self._mod_revision
        if current is None or current.served or current.head != self._node_id:
            return
        done = replace(current, store_port=self._port(current))
        result = self._store.txn(
            [Compare.mod_revision_is(self._keys.round, mod_revision)],
            [Put(self._keys.round, done.to_json())],
        )
        if result.succeeded:
            self.take(KeyValue(self._keys.round, done.to_json(), 0, result.revision))
        else:
            log.info(
                "%s: round %d was superseded before its store was published.",
                self.tag(),
                current.generation,
            )

    def _port(self, r: Round) -> int:
        try:
            port = self._serve_tcpstore(r)
        except Exception as exc:
            raise RendezvousError(
                f"Node {self._node_id} could not serve the c10d store of round "
                f"{r.generation}: {exc}"
            ) from exc
        if not 0 < port < 65536:
            raise RendezvousError(f"The store of round {r.generation} got port {port}.")
        return port

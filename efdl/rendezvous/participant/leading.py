"""The leader's part of a job's rendezvous: watch every node record and the failure reports,
wait for members whose record went, decide the next round (the pure
:func:`~efdl.rendezvous.decide.decide`) and write it.

The leader is the one agent that reads and watches all node records. It writes each member's
``members/<id>`` first, then ``round`` with compare-and-swap on the round's revision, and
every write only while its own node record stands as it campaigned (its election key:
efdl.rendezvous.election): a leader whose lease is gone writes nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import NoReturn

from efdl.errors import LeaseLostError, StoreError
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
    WatchSink,
)
from efdl.rendezvous.decide import FENCE_MARGIN_S, JobView, NodeView, Policy, decide
from efdl.rendezvous.election import Candidate
from efdl.rendezvous.event_log import EventLog
from efdl.rendezvous.holds import Hold, parse_holds
from efdl.rendezvous.participant.inbox import Asked, Message, Wake, WatchKind
from efdl.rendezvous.participant.liveness import Liveness, targets
from efdl.rendezvous.participant.rounds import Rounds
from efdl.rendezvous.probe import Reply, ask_all
from efdl.rendezvous.reading import parse_nodes, retried
from efdl.rendezvous.records import JobKeys, Member, Round, RoundStatus

log = logging.getLogger(__name__)

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
CAS_BACKOFF_MAX_S = 2.0
# How long, in lease TTLs, a leader that finds the active round's member records lost (etcd
# forgot them) waits for its members to register again claiming it.
RECORDS_LOST_TTLS = 3.0
# How soon a leader whose write failed on etcd tries again.
RETRY_S = 0.5


def _short(reason: str, limit: int = 80) -> str:
    """A hold's reason cut for a round's reason (the whole one is in ``efdl nodes``)."""
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class Absences:
    """What a leader holds of the active round's members whose record went (a copy).

    Args:
        returning: node id -> until when (clock time) it is waited for: its agent's answer,
            then its registering again.
        silent: node id -> until when it may be training still, cut off from etcd (its
            fence timeout and a margin).
        waited: the members already waited for in this generation.
    """

    returning: Mapping[str, float]
    silent: Mapping[str, float]
    waited: frozenset[str]


class Leadership:
    """Node ``node_id``'s work while it leads job ``keys`` (:attr:`active`), and what it
    keeps from one term to the next. Called from the rendezvous thread only, but for
    :attr:`active`, which any thread reads and the lease's thread clears.

    Args:
        store: the job's etcd.
        keys: the job.
        node_id: this node.
        policy: min/max workers, settle window, join timeout.
        lease_ttl_s: the lease TTL (how long to wait for members to register again).
        wait_s: how long a read waits for etcd.
        clock: monotonic seconds (the settle window and every wait).
        wall: wall-clock seconds, stamped on the rounds (the join timeout spans leaders).
        rounds: the rounds this node sees; the leader's writes are taken in there.
        liveness: the probes, of every node and of newcomers.
        events: the job's history, where the rounds written are recorded.
        post: hands a message to the rendezvous thread (watches, answers of members).
    """

    def __init__(
        self,
        store: KVStore,
        keys: JobKeys,
        node_id: str,
        policy: Policy,
        lease_ttl_s: int,
        wait_s: float,
        clock: Callable[[], float],
        wall: Callable[[], float],
        rounds: Rounds,
        liveness: Liveness,
        events: EventLog | None,
        post: Callable[[Message], None],
    ) -> None:
        self._store = store
        self._keys = keys
        self._node_id = node_id
        self._policy = policy
        self._ttl_s = lease_ttl_s
        self._wait_s = wait_s
        self._clock = clock
        self._wall = wall
        self._rounds = rounds
        self._liveness = liveness
        self._events = events
        self._post = post
        self.active = False
        self._me: Candidate | None = None  # this node's record as campaigned, while leading
        # The node records as read and watched, and when they last changed (the settle
        # window starts then).
        self.nodes: dict[str, NodeView] = {}
        self.last_change = 0.0
        # Members whose record went, and until when to wait for them (clock time): first for
        # their agent's answer, then for them to register again (see decide).
        self.returning: dict[str, float] = {}
        # Members whose record went with no evidence that their workers stopped, and until
        # when they may be training still, cut off from etcd (see decide: fencing).
        self.silent: dict[str, float] = {}
        # Members already waited for in this generation, and those waited for now (see
        # on_asked).
        self.waited: set[str] = set()
        self.rejoining: set[str] = set()
        # The nodes held out (efdl.rendezvous.holds) as read and watched, ended ones too:
        # the decision takes those in force at its wall-clock time.
        self.holds: dict[str, Hold] = {}
        # Rounds whose member records etcd lost, and since when (see step).
        self._records_lost: dict[str, float] = {}
        self._cas_failures = 0  # round writes refused in a row (backed off)

    def absences(self) -> Absences:
        """A copy of what this leader holds of members whose record went."""
        return Absences(dict(self.returning), dict(self.silent), frozenset(self.waited))

    def begin(self, me: Candidate, sink: Callable[[WatchKind], WatchSink]) -> list[Watch]:
        """Lead from now on, as ``me``: read every node record (the one agent that does) and
        watch them, and the failure reports (into ``sink`` of each kind); returns the two
        watches. Members of the active round without a record are asked whether they come
        back (their lease may be what went, not their node)."""
        self.active, self._me = True, me
        log.info("%s: this node leads the job.", self._rounds.tag())
        snap = retried(
            "list the job's nodes",
            lambda: self._store.get_prefix(self._keys.nodes),
            timeout_s=self._wait_s,
        )
        start = snap.revision + 1
        held = retried(
            "list the job's holds",
            lambda: self._store.get_prefix(self._keys.holds),
            timeout_s=self._wait_s,
        )
        watches = [
            self._store.watch(prefix, prefix=True, start_revision=begin, sink=sink(kind))
            for prefix, kind, begin in (
                (self._keys.nodes, WatchKind.NODES, start),
                (self._keys.failures, WatchKind.FAILURES, start),
                (self._keys.holds, WatchKind.HOLDS, held.revision + 1),
            )
        ]
        self.nodes = parse_nodes(snap.kvs, self._keys)
        self.holds = parse_holds(held.kvs, self._keys)
        self.returning.clear()
        self.silent.clear()
        self.waited.clear()
        self.rejoining.clear()
        self._await(self._missing())
        self._post(Wake())
        self.probe_all()  # what answers now may be evidence later
        self.last_change = self._clock()
        return watches

    def forgot(self) -> None:
        """etcd forgot what it held: the next write of the round is not a retry."""
        self._cas_failures = 0

    def probe_all(self) -> None:
        """Probe every node but this one (a member's workers saw a collective fail)."""
        self._liveness.probe(targets(self.nodes, self._node_id))

    def _missing(self) -> list[Member]:
        """The members of the active round whose node record is gone."""
        return [m for m in self._rounds.members(self._rounds.latest) if m.node_id not in self.nodes]

    # ---------------------------------------------------------------- what the watches say

    def on_nodes(self, batch: WatchBatch) -> None:
        """The node records changed (a reset batch holds them all as they are now). A member
        of the active round whose record went is asked whether it comes back."""
        nodes = self.nodes
        if batch.reset:
            nodes.clear()
        for ev in batch.events:
            node_id = self._keys.node_id_of(ev.kv.key)
            if ev.type is EventType.DELETE:
                nodes.pop(node_id, None)
                self._liveness.forget(node_id)
            else:
                known = nodes.get(node_id)
                nodes.update(parse_nodes((ev.kv,), self._keys))
                self.returning.pop(node_id, None)
                self.rejoining.discard(node_id)
                claim = nodes.get(node_id)
                current = self._rounds.latest
                if (
                    claim is not None
                    and current is not None
                    and claim.record.holds == (current.round_id)
                ):
                    # The member it was, back: its workers are on etcd's side again. (A new
                    # agent under its id, claiming nothing, says nothing of the old workers.)
                    self.silent.pop(node_id, None)
                if known is None or known.lease != ev.kv.lease:  # a newcomer
                    self._liveness.probe(targets(nodes, self._node_id, {node_id}))
        self._await(self._missing())
        self.last_change = self._clock()

    def on_holds(self, batch: WatchBatch) -> None:
        """The holds changed: a node held out leaves the next round; one released (or whose
        quarantine ended) is a newcomer again, after the settle window."""
        if batch.reset:
            self.holds.clear()
        for ev in batch.events:
            node_id = self._keys.node_id_of(ev.kv.key)
            if ev.type is EventType.DELETE:
                if self.holds.pop(node_id, None) is not None:
                    log.info("%s: node %s is no longer held.", self._rounds.tag(), node_id)
            else:
                self.holds.pop(node_id, None)
                self.holds.update(parse_holds((ev.kv,), self._keys))
                h = self.holds.get(node_id)
                if h is not None:
                    log.info(
                        "%s: node %s is held out: %s.",
                        self._rounds.tag(),
                        node_id,
                        h.describe(self._wall()),
                    )
        self.last_change = self._clock()

    def held(self, wall: float) -> tuple[dict[str, str], float | None]:
        """The nodes held out at wall-clock ``wall`` (each with a few words saying why), and
        the wall-clock time the first of their quarantines ends (None: none ends)."""
        now_held = {n: h for n, h in self.holds.items() if h.active(wall)}
        ends = [h.until for h in now_held.values() if h.until is not None]
        return (
            {n: f"{h.kind.value}: {_short(h.reason)}" for n, h in now_held.items()},
            min(ends) if ends else None,
        )

    def on_failures(self, batch: WatchBatch) -> None:
        """A failure report came: probe every node."""
        if self.active and any(ev.type is EventType.PUT for ev in batch.events):
            self.probe_all()

    # ---------------------------------------------------------------- members coming back

    def _await(self, missing: list[Member]) -> None:
        """Members of the active round whose record is gone. Each is waited for (no round is
        written) until its agent has answered on its probe port (at most ASK_S): if it says
        it runs the round's workers still, its lease was lost, not its node, and it
        registers again; a refusal, silence, or another answer means it has left. Until a
        refusal, or an answer that it runs none of the round's workers, it may be training
        still, cut off from etcd: silent, for its fence timeout and a margin from now (see
        decide: fencing). A leader that takes over learns of them now: their records went
        before, so this wait ends later than their fences close, never sooner."""
        now = self._clock()
        me = self._node_id
        for m in missing:
            # Newly missing only: one asked already may have been found gone since.
            if m.fence_s > 0 and m.node_id != me and m.node_id not in self.returning:
                self.silent[m.node_id] = now + m.fence_s + FENCE_MARGIN_S
        asked = []
        for m in missing:
            if m.probe_port and m.node_id not in self.returning and m.node_id != me:
                self.returning[m.node_id] = now + ASK_S
                asked.append((m.node_id, m.host, m.probe_port))
        if not asked:
            return
        post = self._post

        def run() -> None:
            post(Asked(ask_all(asked)))

        threading.Thread(target=run, name="efdl-ask", daemon=True).start()

    def on_asked(self, replies: Asked) -> None:
        """The answers of members whose record went (see :meth:`_await`)."""
        current = self._rounds.latest
        for node_id, (reply, said) in replies.replies.items():
            if node_id not in self.returning or node_id in self.rejoining:
                continue  # registered again meanwhile, or waited for already (a 2nd answer)
            holds = said.get("holds") if said else None
            if (
                reply is Reply.ANSWERED
                and current is not None
                and holds == current.round_id
                and node_id not in self.waited
            ):
                # Once per member and generation: an agent whose lease keeps being lost (or
                # anything that answers on its port) cannot hold every round back for good.
                self.waited.add(node_id)
                self.rejoining.add(node_id)
                wait_s = REJOIN_TTLS * self._ttl_s
                self.returning[node_id] = self._clock() + wait_s
                log.warning(
                    "%s: the record of node %s went, but its agent runs round %d still: "
                    "waiting up to %.0f s for it to register again.",
                    self._rounds.tag(),
                    node_id,
                    current.generation,
                    wait_s,
                )
            else:
                self.returning[node_id] = 0.0  # not waited for again, nor asked again
                runs_it = current is not None and holds == current.round_id
                said_none = reply is Reply.ANSWERED and said is not None and not runs_it
                if reply is Reply.REFUSED or said_none:
                    # Its agent is gone (nothing listens: its workers died with it), or says,
                    # in so many words, that it runs none of the round's workers: nothing of
                    # it trains. Anything else (silence, a connection that says nothing: a
                    # stopped or hung agent, or one that runs the round but was waited for
                    # once already) leaves it to its fence.
                    self.silent.pop(node_id, None)
                log.info(
                    "%s: node %s %s.",
                    self._rounds.tag(),
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

    # ---------------------------------------------------------------- the next round

    def step(self) -> float | None:
        """Decide once; write the round if there is one. Returns when to wake (None: at the
        next message); an etcd failure is tried again after RETRY_S."""
        try:
            return self._decide()
        except StoreError as exc:
            log.warning(
                "%s: could not write the next round (%s); retrying.", self._rounds.tag(), exc
            )
            return self._clock() + RETRY_S

    def _decide(self) -> float | None:
        current = self._rounds.latest
        now = self._clock()
        members = self._rounds.members(current)
        if current is not None and current.status is RoundStatus.ACTIVE:
            if len(members) < current.nodes:
                members = self._recovered(current, members)
            if len(members) < current.nodes:
                lost_at = self._records_lost.setdefault(current.round_id, now)
                until = lost_at + RECORDS_LOST_TTLS * self._ttl_s
                if now < until:
                    if lost_at == now:
                        log.warning(
                            "%s: etcd holds %d of round %d's %d member records (it forgot): "
                            "waiting up to %.0f s for its members to register again, "
                            "claiming it.",
                            self._rounds.tag(),
                            len(members),
                            current.generation,
                            current.nodes,
                            until - now,
                        )
                    return until
        wall = self._wall()
        held, ends = self.held(wall)
        view = JobView(
            self.nodes,
            current,
            last_change=max(self.last_change, self._expired_since(wall, now)),
            leader=self._node_id,
            members=members,
            returning=dict(self.returning),
            silent=dict(self.silent),
            held=held,
        )
        decision = decide(view, self._policy, now, wall)
        if decision.round is None:
            if ends is not None:  # decide again when the first quarantine ends
                due = now + max(0.0, ends - wall) + 0.01
                return due if decision.wake_at is None else min(decision.wake_at, due)
            return decision.wake_at
        new = decision.round
        if decision.members:
            gone = {m.node_id for m in view.members} - {m.node_id for m in decision.members}
            new = replace(new, members_revision=self._write_members(decision.members, gone))
        # The rank-0 node serves the new round's store once the round is written (as a leader
        # that is itself the head, too): a write refused here must not have replaced the store
        # the current generation trains on.
        value = new.to_json()
        me = self._candidate()
        result = self._store.txn(
            [Compare.mod_revision_is(self._keys.round, self._rounds.mod_revision), me.guard],
            [Put(self._keys.round, value)],
            [Get(self._keys.round), Get(me.key)],
        )
        if result.succeeded:
            self._cas_failures = 0
            self.silent.clear()  # the generation they may train in is replaced now
            self.waited.clear()
            self.rejoining.clear()
            if decision.members:
                self._rounds.wrote(new.round_id, decision.members)
            if self._events is not None:
                self._events.round(new)
            self._rounds.take(KeyValue(self._keys.round, value, 0, result.revision))
            return None
        round_kvs, mine = result.gets
        if not mine or mine[0].create_revision != me.create_revision:
            self._not_leading()
        # Decide again on what etcd holds now, whatever its revision (an etcd restored from a
        # backup holds an older one: never adopting it failed this write forever), and back
        # off: another leader's writes win meanwhile.
        self._cas_failures += 1
        pause = min(CAS_BACKOFF_MAX_S, CAS_BACKOFF_S * 2.0 ** (self._cas_failures - 1))
        log.info(
            "%s: the round changed under us; deciding again in %.2f s.", self._rounds.tag(), pause
        )
        if round_kvs:
            self._rounds.take(round_kvs[0], adopt=True)
        else:
            self._rounds.deleted()
        return self._clock() + pause

    def _expired_since(self, wall: float, now: float) -> float:
        """The clock time the newest quarantine that has ended ended (0.0: none): its node
        joins as a newcomer, after the settle window from then."""
        ended = [h.until for h in self.holds.values() if h.until is not None and h.until <= wall]
        return now - (wall - max(ended)) if ended else 0.0

    def _recovered(self, r: Round, members: tuple[Member, ...]) -> tuple[Member, ...]:
        """Round ``r``'s members when etcd lost some of their records: those read, then the
        nodes that registered again claiming ``r`` (their workers run it: their state must
        not be sent away for a spare's), in join order, ranked after them. Taken for the
        members they were; their worker counts are what their records offer."""
        nodes = self.nodes
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
        ops: list[Put | Delete] = [Put(self._keys.member(m.node_id), m.to_json()) for m in members]
        ops += [Delete(self._keys.member(n)) for n in sorted(gone)]
        guard = self._candidate().guard
        revision = 0
        for i in range(0, len(ops), TXN_OPS):
            result = self._store.txn([guard], ops[i : i + TXN_OPS])
            if not result.succeeded:
                self._not_leading()
            revision = result.revision
        return revision

    def _candidate(self) -> Candidate:
        assert self._me is not None, "only a leader writes"
        return self._me

    def _not_leading(self) -> NoReturn:
        log.warning(
            "%s: our node record is gone (its lease expired); no longer leading.",
            self._rounds.tag(),
        )
        self.active = False
        raise LeaseLostError("The node record is gone.")

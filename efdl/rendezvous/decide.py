"""The rendezvous decision: given what the leader sees, which round (if any) comes next.

Pure functions of their arguments, the clock included, so every rule is tested without a
store: ``decide(view, policy, now) -> Decision``.

Rules:

- Workers are counted across the job; ``min``/``max`` bound them. A node may run fewer
  workers than its slots so the job stays within ``max``; nodes left over are spares.
- Survivors of the last active round come first, in their old rank order, with their old
  worker counts; then they grow into free slots; then newcomers join in join order.
- Rank 0 is the first of that order: it need not hold the newest state, as the workers'
  sync takes it from whichever rank holds the newest committed step.
- A node offers its slots less those whose in-place worker died and is being replaced
  (``NodeRecord.down``): the survivors go on at once without it, and the replacement joins
  later as a newcomer would (shrink, then grow), unless that would take the job below
  ``min``: then the round keeps the node's full count and waits for the replacement.
- A departure (or a member asking for a restart) makes a round at once, unless no member
  stays (then nobody waits for it, and the nodes taking over settle as at a start). Joins alone wait
  for a settle window after the last change, so joins close together make one round, unless
  the job is already at ``max``.
- The store of the generation lives with rank 0; the leader leaves its port 0 and the
  rank-0 node's agent publishes it (see :attr:`Round.served`).
- Below ``min`` the job waits (a WAITING round stops training) until ``join_timeout_s``
  after the wait began; then a FAILED round ends it.
- A member whose record went while its agent says it still runs the round's workers (its
  lease was lost, not its node: etcd revoked it, or it expired while etcd was away) is
  waited for until the leader's deadline (``JobView.returning``): no round is written
  meanwhile. Registered again with ``holds`` naming the round, it is the member it was, and
  nothing changes; not back by the deadline, it has left.
- Fencing (efdl.worker.fence): when no member of the active round is left on etcd's side
  (none has its record still, or again claiming the round), members whose records went
  without evidence that their workers stopped may be training still, cut off from etcd;
  no round is written until their fence timeouts (and a margin) have passed since their
  records went (``JobView.silent``): by then they have stopped committing. A generation with
  a member on etcd's side needs no such wait: that member leaves it for the next round, and
  its collectives need every member.

- A held node (drained or quarantined: efdl.rendezvous.holds; ``JobView.held``) is never
  placed, and is no spare: it is as if it were not there, so a member that becomes held
  leaves the round at once (its in-place workers are sent away at the next step boundary,
  as any node's that a round leaves out), and a hold released makes it a newcomer.

Two clocks: ``now`` measures durations (monotonic: the settle window, the waits, and
``wake_at``), ``wall`` stamps rounds and times the join timeout across leaders.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from efdl.errors import ConfigError
from efdl.rendezvous.records import Member, NodeRecord, Round, RoundStatus

# Added to a silent member's fence timeout before its generation is replaced: a snapshot
# whose manifest was being written when the member's fence closed lands within it.
FENCE_MARGIN_S = 5.0


@dataclass(frozen=True, slots=True)
class Policy:
    """The job's admission rules.

    Attributes:
        min_workers: fewer than this and the job waits.
        max_workers: never more than this; nodes beyond it are spares.
        settle_s: how long after the last join to wait for more joins before a round.
            Longer batches more joins into one rescale; shorter starts training sooner.
        join_timeout_s: how long the job may wait below ``min_workers`` before it fails.
    """

    min_workers: int
    max_workers: int
    settle_s: float = 1.0
    join_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ConfigError(
                f"The minimum number of workers ({self.min_workers}) must be at least 1."
            )
        if self.max_workers < self.min_workers:
            raise ConfigError(
                f"The maximum number of workers ({self.max_workers}) must be at least the "
                f"minimum ({self.min_workers})."
            )
        if self.settle_s < 0:
            raise ConfigError(f"The settle window ({self.settle_s} s) must not be negative.")
        if self.join_timeout_s <= 0:
            raise ConfigError(f"The join timeout ({self.join_timeout_s} s) must be positive.")


@dataclass(frozen=True, slots=True)
class NodeView:
    """A live node as the leader sees it: its record, when it joined (create revision) and
    the lease its record is bound to."""

    record: NodeRecord
    joined_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class JobView:
    """Everything the decision needs.

    Attributes:
        nodes: live nodes by id.
        round: the newest round, or None before the first.
        last_change: when the leader last saw a node join (for the settle window).
        leader: the deciding node's id (written into the round).
        members: the members of ``round`` when it is active, in rank order.
        returning: members whose record went but whose agent said it runs the round's
            workers still and registers again, each with the time until which to wait.
        silent: members whose record went without evidence that their workers stopped
            (no refused probe, no answer that they run none of the round's), each with the
            time until which they may still be training (the record's going, plus their
            fence timeout and a margin: see the module rules).
        held: nodes held out of the job (drained or quarantined), each with a few words
            saying why (for the round's reason); never placed, never counted as spares.
    """

    nodes: Mapping[str, NodeView]
    round: Round | None
    last_change: float = 0.0
    leader: str = ""
    members: tuple[Member, ...] = ()
    returning: Mapping[str, float] = field(default_factory=dict)
    silent: Mapping[str, float] = field(default_factory=dict)
    held: Mapping[str, str] = field(default_factory=dict)

    def placeable(self) -> dict[str, NodeView]:
        """The live nodes that may be placed: those not held."""
        return {n: v for n, v in self.nodes.items() if n not in self.held}


@dataclass(frozen=True, slots=True)
class Decision:
    """What the leader does now.

    Attributes:
        round: the round to write (compare-and-swap on the current one), or None.
        members: its members, in rank order, each stamped with the round (written first).
        wake_at: decide again at this time even if nothing happens (settle, timeout).
        reason: why, for the log line and the round record.
    """

    round: Round | None
    wake_at: float | None
    reason: str
    members: tuple[Member, ...] = ()


@dataclass(frozen=True, slots=True)
class Assignment:
    members: tuple[Member, ...]
    spares: tuple[str, ...]

    @property
    def workers(self) -> int:
        return sum(m.workers for m in self.members)


def assign(view: JobView, policy: Policy, replaced_count: bool = False) -> Assignment:
    """Who trains, with how many workers, at which ranks (see the module rules).
    ``replaced_count``: count the slots being replaced (``down``) as if they were ready."""

    nodes = view.placeable()

    def offer(node_id: str) -> int:
        record = nodes[node_id].record
        return record.slots if replaced_count else record.offered

    prev = view.round
    prev_members = view.members if prev and prev.status is RoundStatus.ACTIVE else ()
    survivors = [m for m in prev_members if m.node_id in nodes]
    surviving = {m.node_id for m in survivors}
    newcomers = sorted(
        (n for n in nodes if n not in surviving),
        key=lambda n: (nodes[n].joined_revision, n),
    )
    budget = policy.max_workers
    counts: dict[str, int] = {}
    for m in survivors:
        take = min(m.workers, offer(m.node_id), budget)
        if take > 0:
            counts[m.node_id] = take
            budget -= take
    for node_id in list(counts):
        extra = min(offer(node_id) - counts[node_id], budget)
        counts[node_id] += extra
        budget -= extra
    for node_id in newcomers:
        take = min(offer(node_id), budget)
        if take > 0:
            counts[node_id] = take
            budget -= take
    order = list(counts)  # survivors in rank order, then newcomers
    members: list[Member] = []
    rank = 0
    for node_id in order:
        node = nodes[node_id]
        members.append(
            Member(
                node_id,
                counts[node_id],
                rank,
                node.record.host,
                node.record.incarnation,
                node.joined_revision,
                group_rank=len(members),
                probe_port=node.record.probe_port,
                fence_s=node.record.fence_s,
            )
        )
        rank += counts[node_id]
    spares = tuple(
        sorted((n for n in nodes if n not in counts), key=lambda n: nodes[n].joined_revision)
    )
    return Assignment(tuple(members), spares)


@dataclass(frozen=True, slots=True)
class _Changes:
    """How the members differ from the current active round's."""

    departed: list[str]
    held: list[tuple[str, str]]  # members held out (drained, quarantined), and why
    lost: list[str]  # lost in-place workers, being replaced (higher incarnation, ``down``)
    restarted: list[str]  # restarted their workers (same record, higher incarnation)
    rejoined: list[str]  # a new record under the same id: new agent, new workers
    joined: list[str]

    def reason(self) -> str:
        parts = [f"{names(self.departed)} left"] if self.departed else []
        parts += [f"{n} held out ({why})" for n, why in self.held[:3]]
        parts += [f"{len(self.held) - 3} more held out"] if len(self.held) > 3 else []
        parts += [
            f"{names(nodes)} {what}"
            for nodes, what in (
                (self.lost, "lost workers being replaced"),
                (self.restarted, "restarted its workers"),
                (self.rejoined, "joined again"),
                (self.joined, "joined"),
            )
            if nodes
        ]
        return "; ".join(parts) or "the workers per node changed"


def names(nodes: list[str], limit: int = 3) -> str:
    """``nodes`` for a log line or a record: the first ``limit`` and how many more, so that
    nothing grows with the fleet (a round's reason at 4096 nodes is one line)."""
    shown = ", ".join(nodes[:limit])
    return f"{shown} and {len(nodes) - limit} more" if len(nodes) > limit else shown


def _changes(view: JobView, assignment: Assignment) -> _Changes:
    prev = view.round
    if prev is None or prev.status is not RoundStatus.ACTIVE:
        return _Changes([], [], [], [], [], [m.node_id for m in assignment.members])
    kept = [m for m in view.members if m.node_id in view.nodes and m.node_id not in view.held]
    # A member whose record was made again (its agent restarted under the same id, and the
    # leader never saw the old record go) is a new member, unless the record says it still
    # runs this round's workers (its lease was lost, not its node). Revision 0: a round
    # written before revisions were recorded, which says nothing.
    rejoined = [
        m.node_id
        for m in kept
        if m.revision not in (0, view.nodes[m.node_id].joined_revision)
        and view.nodes[m.node_id].record.holds != prev.round_id
    ]
    before = {m.node_id for m in view.members}
    bumped = [
        m.node_id
        for m in kept
        if m.node_id not in rejoined and view.nodes[m.node_id].record.incarnation > m.incarnation
    ]
    return _Changes(
        departed=[m.node_id for m in view.members if m.node_id not in view.nodes],
        held=[
            (m.node_id, view.held[m.node_id])
            for m in view.members
            if m.node_id in view.nodes and m.node_id in view.held
        ],
        lost=[n for n in bumped if view.nodes[n].record.down],
        restarted=[n for n in bumped if not view.nodes[n].record.down],
        rejoined=rejoined,
        joined=[m.node_id for m in assignment.members if m.node_id not in before],
    )


def decide(view: JobView, policy: Policy, now: float, wall: float | None = None) -> Decision:
    """The next round to write, if any; see the module docstring for the rules (and the
    clocks: ``wall`` defaults to ``now``)."""
    wall = now if wall is None else wall
    prev = view.round
    generation = (prev.generation if prev else 0) + 1
    if prev is not None and prev.status.final:
        return Decision(None, None, f"the job is {prev.status.value}")
    awaited = [
        m.node_id
        for m in view.members
        if m.node_id not in view.nodes and view.returning.get(m.node_id, now) > now
    ]
    if awaited and prev is not None and prev.status is RoundStatus.ACTIVE:
        until = min(view.returning[n] for n in awaited)
        return Decision(None, until, f"waiting for {names(awaited)} to register again")
    fenced = _fenced(view, now)
    if fenced:
        until = max(view.silent[n] for n in fenced)
        return Decision(
            None,
            until,
            f"waiting {until - now:.0f} s for {names(fenced)} to stop training: cut off from "
            "etcd with no member left on its side, the generation stops committing at its "
            "fence timeout",
        )
    assignment = assign(view, policy)
    if assignment.workers < policy.min_workers:  # keep the replaced slots: wait for them
        assignment = assign(view, policy, replaced_count=True)
    base = Round(
        generation=generation,
        status=RoundStatus.WAITING,
        spares=len(assignment.spares),
        leader=view.leader,
        created=wall,
        since=wall,
    )
    have = assignment.workers
    if have < policy.min_workers:
        waiting = f"{have} of the {policy.min_workers} workers needed are here"
        if prev is not None and prev.status is RoundStatus.WAITING:
            deadline = prev.since + policy.join_timeout_s  # wall: leaders share it
            if wall >= deadline:
                reason = (
                    f"only {have} of the {policy.min_workers} workers needed joined within "
                    f"the join timeout ({policy.join_timeout_s:g} s)"
                )
                return Decision(_with(base, status=RoundStatus.FAILED, reason=reason), None, reason)
            return Decision(None, now + (deadline - wall), f"waiting: {waiting}")
        lost = ""
        if prev is not None and prev.status is RoundStatus.ACTIVE:
            gone = [m.node_id for m in view.members if m.node_id not in view.nodes]
            out = [
                m.node_id
                for m in view.members
                if m.node_id in view.nodes and m.node_id in view.held
            ]
            lost = f"{names(gone)} left; " if gone else ""
            lost += f"{names(out)} held out; " if out else ""
        reason = f"{lost}{waiting}"  # its event reads "waiting: <reason>"
        return Decision(
            _with(base, spares=len(view.placeable()), reason=reason), None, f"waiting: {reason}"
        )

    changes = _changes(view, assignment)
    same_shape = (
        prev is not None
        and prev.status is RoundStatus.ACTIVE
        and _shape(view.members) == _shape(assignment.members)
    )
    if same_shape and not (changes.lost or changes.restarted or changes.rejoined):
        return Decision(None, None, "no change")
    reason = changes.reason()
    # Urgent when members that stay wait for it; when none stays (every member left: a job
    # resumed by new nodes) the round settles like a first one.
    stays = any(m.node_id in view.placeable() for m in view.members)
    urgent = stays and bool(
        changes.departed or changes.held or changes.lost or changes.restarted or changes.rejoined
    )
    urgent = urgent or have >= policy.max_workers
    settle_until = view.last_change + policy.settle_s
    if not urgent and now < settle_until:
        return Decision(None, settle_until, f"settling ({reason})")
    head = view.nodes[assignment.members[0].node_id].record
    round_id = hashlib.blake2b(
        f"{view.leader}|{generation}|{wall!r}|{now!r}".encode(), digest_size=8
    ).hexdigest()
    new = _with(
        base,
        status=RoundStatus.ACTIVE,
        world_size=assignment.workers,
        nodes=len(assignment.members),
        head=head.node_id,
        round_id=round_id,
        store_host=head.host,
        store_port=0,  # the rank-0 node's agent fills it in once its fresh store serves
        reason=reason,
    )
    members = tuple(
        replace(m, generation=generation, round_id=round_id) for m in assignment.members
    )
    return Decision(new, None, reason, members)


def _fenced(view: JobView, now: float) -> list[str]:
    """Members of the active round that may be training still, cut off from etcd with no
    member of their generation left on its side (see the module rules); [] if none, or if
    one is left."""
    prev = view.round
    if prev is None or prev.status is not RoundStatus.ACTIVE:
        return []
    for m in view.members:
        node = view.nodes.get(m.node_id)
        if node is not None and (
            m.revision in (0, node.joined_revision) or node.record.holds == prev.round_id
        ):
            return []  # on etcd's side, in the generation: it leaves it for the next round
    return [m.node_id for m in view.members if view.silent.get(m.node_id, now) > now]


def _shape(members: tuple[Member, ...]) -> tuple[tuple[str, int], ...]:
    """The (node, workers) layout in rank order: equal shapes need no new round."""
    return tuple((m.node_id, m.workers) for m in members)


def _with(base: Round, **changes: object) -> Round:
    return replace(base, **changes)  # type: ignore[arg-type]

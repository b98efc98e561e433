"""The rendezvous decision, with no store and a clock passed in."""

from __future__ import annotations

from dataclasses import replace

import pytest

from efdl.errors import ConfigError
from efdl.rendezvous.decide import Decision, JobView, NodeView, Policy, decide
from efdl.rendezvous.records import Member, NodeRecord, Round, RoundStatus

T0 = 1_000.0


def node(
    node_id: str,
    slots: int = 1,
    rev: int = 0,
    incarnation: int = 0,
    down: int = 0,
    holds: str = "",
) -> tuple[str, NodeView]:
    record = NodeRecord(
        node_id,
        host=f"10.0.0.{ord(node_id[-1]) % 250}",
        store_port=29500,
        slots=slots,
        incarnation=incarnation,
        down=down,
        holds=holds,
    )
    return node_id, NodeView(record, joined_revision=rev or ord(node_id[-1]))


def view(
    *nodes: tuple[str, NodeView],
    round: Decision | None = None,
    last_change: float = T0,
) -> JobView:
    """What the leader sees after writing ``round`` (a decision: the round and its members)."""
    current = round.round if round else None
    members = round.members if round else ()
    return JobView(dict(nodes), current, last_change, leader="a", members=members)


def layout(d: Decision) -> list[tuple[str, int, int]]:
    assert d.round is not None
    return [(m.node_id, m.workers, m.first_rank) for m in d.members]


def settled(v: JobView, policy: Policy) -> Decision:
    """The round written once the settle window has passed."""
    d = decide(v, policy, T0 + policy.settle_s + 0.01)
    assert d.round is not None, d.reason
    return d


P = Policy(min_workers=2, max_workers=4, settle_s=1.0, join_timeout_s=60)


def test_policy_validation() -> None:
    with pytest.raises(ConfigError, match=r"minimum number of workers \(0\) must be at least 1"):
        Policy(0, 2)
    with pytest.raises(
        ConfigError, match=r"maximum number of workers \(1\) must be at least the minimum \(2\)"
    ):
        Policy(2, 1)
    with pytest.raises(ConfigError, match="settle window"):
        Policy(1, 2, settle_s=-1)


def test_below_min_writes_a_waiting_round_then_waits_then_fails() -> None:
    d = decide(view(node("a")), P, T0)
    assert d.round is not None and d.round.status is RoundStatus.WAITING
    assert d.round.generation == 1 and d.round.spares == 1
    assert "1 of the 2 workers needed" in d.reason
    assert d.round.reason == "1 of the 2 workers needed are here"  # the event adds "waiting: "
    waiting = d
    d2 = decide(view(node("a"), round=waiting), P, T0 + 30)
    assert d2.round is None and d2.wake_at == T0 + 60  # no new round while waiting
    d3 = decide(view(node("a"), round=waiting), P, T0 + 60)
    assert d3.round is not None and d3.round.status is RoundStatus.FAILED
    assert "within the join timeout (60 s)" in d3.round.reason


def test_joins_settle_into_one_round() -> None:
    v = view(node("a"), node("b"), last_change=T0)
    early = decide(v, P, T0 + 0.5)
    assert early.round is None and early.wake_at == T0 + 1.0 and "settling" in early.reason
    d = settled(v, P)
    r = d.round
    assert r is not None and r.status is RoundStatus.ACTIVE
    assert layout(d) == [("a", 1, 0), ("b", 1, 1)] and (r.nodes, r.head) == (2, "a")
    assert r.world_size == 2 and (r.store_host, r.store_port) == ("10.0.0.97", 0)
    assert not r.served  # until the rank-0 node's agent publishes its fresh store
    assert [(m.group_rank, m.generation, m.round_id) for m in d.members] == [
        (0, 1, r.round_id),
        (1, 1, r.round_id),
    ]


def test_reaching_max_skips_the_settle_window() -> None:
    d = decide(view(node("a", 2), node("b", 2)), P, T0)
    assert d.round is not None and layout(d) == [("a", 2, 0), ("b", 2, 2)]


def test_partial_node_keeps_the_job_within_max() -> None:
    r = settled(view(node("a", 3), node("b", 8)), P)
    assert layout(r) == [("a", 3, 0), ("b", 1, 3)]
    assert r.round is not None and r.round.world_size == 4 and r.round.spares == 0


def test_spares_wait_and_take_a_departed_members_place_at_once() -> None:
    r1 = settled(view(node("a", 2), node("b", 2), node("c", 2)), P)
    assert layout(r1) == [("a", 2, 0), ("b", 2, 2)] and r1.round and r1.round.spares == 1
    # c is a spare: nothing changes while a and b stay
    assert decide(view(node("a", 2), node("b", 2), node("c", 2), round=r1), P, T0 + 5).round is None
    # b dies: c is admitted in the very next round, no settle wait
    d = decide(view(node("a", 2), node("c", 2), round=r1, last_change=T0 + 5), P, T0 + 5)
    assert d.round is not None and layout(d) == [("a", 2, 0), ("c", 2, 2)]
    assert "b left" in d.reason and "c joined" in d.reason and d.round.generation == 2


def test_survivors_keep_order_and_ranks_newcomers_appended() -> None:
    r1 = settled(view(node("a"), node("b"), node("c")), Policy(2, 8, settle_s=1))
    assert layout(r1) == [("a", 1, 0), ("b", 1, 1), ("c", 1, 2)]
    d = decide(
        view(node("a"), node("c"), node("d"), node("e"), round=r1, last_change=T0),
        Policy(2, 8, 1),
        T0,
    )
    assert d.round is not None
    assert layout(d) == [("a", 1, 0), ("c", 1, 1), ("d", 1, 2), ("e", 1, 3)]


def test_rank0_goes_to_the_first_survivor_and_the_store_moves_with_it() -> None:
    r1 = settled(view(node("a"), node("b"), node("c")), Policy(2, 8, 1))
    # a (rank 0) died: the survivors keep their order
    d = decide(view(node("b"), node("c"), round=r1), Policy(2, 8, 1), T0)
    assert d.round is not None and layout(d) == [("b", 1, 0), ("c", 1, 1)]
    assert d.round.store_host == "10.0.0.98"  # the store moves with rank 0


def test_rank0_is_never_a_newcomer_without_state() -> None:
    r1 = settled(view(node("a"), node("b")), Policy(2, 8, 1))
    d = decide(
        view(node("a"), node("b"), node("c"), round=r1),
        Policy(2, 8, 1),
        T0 + 2,
    )
    assert d.round is not None and layout(d)[0][0] == "a"


def test_survivor_grows_into_free_slots_before_newcomers() -> None:
    p = Policy(2, 4, 1)
    r1 = settled(view(node("a", 3), node("b", 4)), p)
    assert layout(r1) == [("a", 3, 0), ("b", 1, 3)]
    d = decide(view(node("b", 4), node("c", 4), round=r1), p, T0)
    assert d.round is not None and layout(d) == [("b", 4, 0)] and d.round.spares == 1


def test_nothing_changes_when_nothing_changed() -> None:
    r1 = settled(view(node("a"), node("b")), P)
    d = decide(view(node("a"), node("b"), round=r1), P, T0 + 100)
    assert d.round is None and d.reason == "no change"


def test_a_member_restarting_its_workers_gets_a_new_round_at_once() -> None:
    r1 = settled(view(node("a"), node("b")), P)
    d = decide(view(node("a"), node("b", incarnation=1), round=r1, last_change=T0 + 5), P, T0 + 5)
    assert d.round is not None and d.round.generation == 2 and "b restarted its workers" in d.reason
    assert layout(d) == layout(r1) and d.members[1].incarnation == 1
    # and that incarnation is not acted on twice
    assert decide(view(node("a"), node("b", incarnation=1), round=d), P, T0 + 6).round is None


def test_a_lost_worker_shrinks_the_job_at_once_and_its_replacement_grows_it_back() -> None:
    p = Policy(min_workers=2, max_workers=8, settle_s=1.0, join_timeout_s=60)
    r1 = settled(view(node("a", 2), node("b", 2), node("c", 1)), p)
    assert layout(r1) == [("a", 2, 0), ("b", 2, 2), ("c", 1, 4)]
    # one of b's workers died: b offers one worker fewer, at once (no settle window)
    lost = view(node("a", 2), node("b", 2, incarnation=1, down=1), node("c", 1), round=r1)
    shrunk = decide(lost, p, T0 + 5)
    assert shrunk.round is not None and shrunk.round.status is RoundStatus.ACTIVE
    assert layout(shrunk) == [("a", 2, 0), ("b", 1, 2), ("c", 1, 3)]
    assert "b lost workers being replaced" in shrunk.reason
    assert (
        decide(replace(lost, round=shrunk.round, members=shrunk.members), p, T0 + 6).round is None
    )
    # the replacement is ready: an ordinary offer of more, settled like a join
    ready = view(node("a", 2), node("b", 2, incarnation=1), node("c", 1), round=shrunk)
    ready = replace(ready, last_change=T0 + 7)
    assert decide(ready, p, T0 + 7.5).round is None
    grown = decide(ready, p, T0 + 8.1)
    assert layout(grown) == layout(r1)
    # a node whose only worker died sits out until its replacement is ready
    alone = view(node("a", 2), node("b", 2), node("c", 1, incarnation=1, down=1), round=r1)
    assert layout(decide(alone, p, T0 + 5)) == [("a", 2, 0), ("b", 2, 2)]


def test_nodes_taking_over_from_members_that_all_left_settle_as_at_a_start() -> None:
    p = Policy(min_workers=1, max_workers=4, settle_s=1.0, join_timeout_s=60)
    r1 = settled(view(node("a"), node("b")), p)
    v = view(node("c"), node("d"), round=r1, last_change=T0 + 10)  # a, b preempted
    early = decide(v, p, T0 + 10.2)
    assert early.round is None and early.wake_at == T0 + 11  # more of them may be coming
    later = decide(replace(v, nodes={**v.nodes, **dict([node("e")])}), p, T0 + 11.01)
    assert [m.node_id for m in later.members] == ["c", "d", "e"]


def test_a_lost_worker_does_not_take_the_job_below_min() -> None:
    r1 = settled(view(node("a"), node("b")), P)  # min 2: both are needed
    lost = view(node("a"), node("b", incarnation=1, down=1), round=r1)
    d = decide(lost, P, T0 + 5)
    # a round at once with b's full count: the survivor waits for the replacement there
    assert d.round is not None and d.round.status is RoundStatus.ACTIVE
    assert layout(d) == layout(r1) and d.members[1].incarnation == 1
    # and neither the wait for it nor its readiness makes another round
    assert (
        decide(view(node("a"), node("b", incarnation=1, down=1), round=d), P, T0 + 6).round is None
    )
    assert decide(view(node("a"), node("b", incarnation=1), round=d), P, T0 + 9).round is None


def test_members_registered_again_with_their_workers_running_make_no_round() -> None:
    """etcd ended every member's lease (an outage, or etcd 3.5.1's paused leader): each
    registers again under a new revision, saying that it runs the round still. Nothing
    changed for the job: no round."""
    r1 = settled(view(node("a"), node("b")), P)
    assert r1.round is not None
    held = r1.round.round_id
    again = view(node("a", rev=500, holds=held), node("b", rev=501, holds=held), round=r1)
    assert decide(again, P, T0 + 5).round is None
    # A stale claim (of an older round) is no claim: a new member.
    stale = view(node("a", rev=500, holds="0123"), node("b", rev=501, holds=held), round=r1)
    d = decide(stale, P, T0 + 5)
    assert d.round is not None and "a joined again" in d.reason


def test_a_member_awaited_holds_every_round_until_its_deadline() -> None:
    """A member whose record went while its agent says it runs the round is waited for:
    no round (not for its absence, nor for a join) until the deadline; then it has left."""
    r1 = settled(view(node("a"), node("b")), P)
    awaited = replace(view(node("a"), node("c"), round=r1), returning={"b": T0 + 8})
    d = decide(awaited, P, T0 + 5)
    assert d.round is None and d.wake_at == T0 + 8 and "waiting for b to register" in d.reason
    late = decide(awaited, P, T0 + 8)
    assert late.round is not None and "b left" in late.reason
    # An answer that it has left (a deadline passed, 0): no wait at all.
    gone = replace(view(node("a"), round=r1), returning={"b": 0.0})
    assert decide(gone, P, T0 + 5).round is not None


def test_members_that_joined_again_under_their_ids_get_a_new_round_at_once() -> None:
    """Agents restarted under the same ids (their workers new) join again with new records:
    the leader never saw them leave, yet their workers are new (found by the fault suite:
    the job stood still with no worker)."""
    r1 = settled(view(node("a"), node("b")), P)
    again = view(node("a", rev=500), node("b", rev=501), round=r1, last_change=T0 + 5)
    d = decide(again, P, T0 + 5)
    assert d.round is not None and d.round.generation == 2 and "a, b joined again" in d.reason
    assert [(m.node_id, m.revision) for m in d.members] == [("a", 500), ("b", 501)]
    assert decide(replace(again, round=d.round, members=d.members), P, T0 + 6).round is None
    # A round written before revisions were recorded: no news, no round.
    old = replace(r1, members=tuple(replace(m, revision=0) for m in r1.members))
    assert decide(view(node("a", rev=500), node("b"), round=old), P, T0 + 6).round is None


def test_dropping_below_min_stops_training_then_recovers() -> None:
    r1 = settled(view(node("a"), node("b")), P)
    d = decide(view(node("a"), round=r1), P, T0 + 10)
    assert d.round is not None and d.round.status is RoundStatus.WAITING
    assert "b left" in d.reason and d.round.since == T0 + 10
    v = view(node("a"), node("c"), round=d, last_change=T0 + 20)
    back = decide(v, P, T0 + 21.5)
    assert back.round is not None and back.round.status is RoundStatus.ACTIVE
    assert back.round.generation == 3 and layout(back) == [("a", 1, 0), ("c", 1, 1)]


def test_a_new_leader_decides_the_same_and_doubles_nothing() -> None:
    r1 = settled(view(node("a"), node("b"), node("c")), P)
    # a (the leader) crashes; b takes over with a fresh view of its own
    d = decide(replace(view(node("b"), node("c"), round=r1), leader="b"), P, T0 + 7)
    assert d.round is not None and d.round.generation == 2 and d.round.leader == "b"
    assert layout(d) == [("b", 1, 0), ("c", 1, 1)]
    # once written, the same view yields nothing more
    assert decide(replace(view(node("b"), node("c"), round=d), leader="b"), P, T0 + 8).round is None


def test_closed_and_failed_jobs_get_no_more_rounds() -> None:
    for status in (RoundStatus.CLOSED, RoundStatus.FAILED):
        d = decide(view(node("a"), node("b"), round=Decision(Round(5, status), None, "")), P, T0)
        assert d.round is None and status.value in d.reason


def test_round_roundtrips_through_json() -> None:
    d = settled(view(node("a", 2), node("b", 2)), P)
    assert d.round is not None and Round.from_json(d.round.to_json(), "/efdl/j/round") == d.round
    for m in d.members:
        assert Member.from_json(m.to_json(), f"/efdl/j/members/{m.node_id}") == m


def test_reasons_name_a_few_nodes_and_count_the_rest() -> None:
    """A round's reason stays one line at any fleet size (85 cloud host names once made a
    round its own codec refused, and the leader rewrote it in a loop)."""
    ids = [f"ip-10-0-{i // 250}-{i % 250}.us-west-2.compute.internal-{i:06x}" for i in range(400)]
    p = Policy(1, 4096, 1)
    nodes = [node(n, rev=i + 1) for i, n in enumerate(ids)]
    r1 = settled(view(*nodes), p)
    assert r1.reason == f"{ids[0]}, {ids[1]}, {ids[2]} and 397 more joined"
    d = decide(view(*nodes[:100], round=r1), p, T0 + 10)
    assert d.round is not None and d.reason.startswith(
        f"{ids[100]}, {ids[101]}, {ids[102]} and 297 more left"
    )
    assert len(d.reason) < 300


# Fencing: a generation cut off from etcd whole is replaced only once it stopped committing.

ONE = Policy(min_workers=1, max_workers=1, settle_s=0.0, join_timeout_s=60)


def fencing(fence_s: float = 90.0) -> Decision:
    """Round 1: node a trains alone (fence timeout ``fence_s``); b waits as a spare."""
    a = replace(node("a")[1], record=replace(node("a")[1].record, fence_s=fence_s))
    d = decide(view(("a", a), node("b")), ONE, T0)
    assert layout(d) == [("a", 1, 0)] and d.members[0].fence_s == fence_s
    return d


def test_a_generation_cut_off_whole_is_replaced_only_after_its_fence() -> None:
    """a's record went (its lease expired: cut off from etcd, maybe training still) and its
    agent did not prove otherwise: the spare's round waits until a's workers have stopped
    committing (the leader's silent deadline), then comes."""
    r1 = fencing()
    until = T0 + 10 + 90 + 5  # its record went at T0 + 10; fence 90 s, margin 5 s
    v = replace(view(node("b"), round=r1), silent={"a": until})
    d = decide(v, ONE, T0 + 20)
    assert d.round is None and d.wake_at == until, d
    assert "to stop training" in d.reason and "a" in d.reason
    d = decide(v, ONE, until + 0.01)
    assert layout(d) == [("b", 1, 0)]


def test_a_generation_with_a_member_on_etcds_side_is_replaced_at_once() -> None:
    """Two members; a went silent, b is still registered (on etcd's side, in the
    generation): b leaves the generation for the next round, and its collectives need b, so
    the round without a comes at once."""
    two = Policy(min_workers=1, max_workers=2, settle_s=0.0, join_timeout_s=60)
    r1 = decide(view(node("a"), node("b")), two, T0)
    v = replace(view(node("b"), round=r1), silent={"a": T0 + 500})
    d = decide(v, two, T0 + 20)
    assert layout(d) == [("b", 1, 0)]


def test_a_member_back_claiming_the_round_anchors_it_and_a_rejoined_one_does_not() -> None:
    r1 = fencing()
    rid = r1.round.round_id if r1.round else ""
    back = node("a", rev=77, holds=rid)  # registered again, its workers run the round still
    v = replace(view(back, node("b"), round=r1), silent={"b": T0 + 500})
    assert decide(v, ONE, T0 + 20).round is None  # no change: a is the member it was
    rejoined = node("a", rev=77)  # a new agent under a's id: not in the generation
    v = replace(view(rejoined, node("b"), round=r1), silent={"a": T0 + 500})
    d = decide(v, ONE, T0 + 20)
    assert d.round is None and "to stop training" in d.reason


def test_waits_are_timed_on_the_monotonic_clock_and_rounds_stamped_on_the_wall() -> None:
    """The wall clock was set back an hour: the settle window and every wait run on the
    monotonic clock (``now``); rounds carry wall times (``wall``), and the join timeout,
    which spans leaders, is timed on the wall clock."""
    d = decide(view(node("a"), node("b")), P, T0 + 5.0, wall=T0 - 3600)
    assert d.round is not None and d.round.created == T0 - 3600
    waiting = decide(view(node("a")), P, T0, wall=50_000.0)
    assert waiting.round is not None and waiting.round.since == 50_000.0
    d = decide(view(node("a"), round=waiting), P, T0 + 1, wall=50_010.0)
    assert d.round is None and d.wake_at == pytest.approx(T0 + 1 + 50)  # 50 s left, monotonic

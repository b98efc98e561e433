"""The rendezvous protocol with several agents (threads, each with its own etcd client)."""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from efdl.errors import RendezvousError
from efdl.rendezvous.api import EtcdSettings, KVStore
from efdl.rendezvous.decide import Policy
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.lifecycle import close_job
from efdl.rendezvous.participant import REJOIN_TTLS, Participant
from efdl.rendezvous.participant.rounds import SUPERSEDED
from efdl.rendezvous.probe import ProbeListener
from efdl.rendezvous.reading import read_members
from efdl.rendezvous.records import JobKeys, NodeRecord, Round, RoundStatus
from efdl.rendezvous.status import read_status
from tests.proxy import Proxy
from tests.wait import wait_until

Layout = list[tuple[str, int]]


class Cluster:
    """Agents of one job, each on its own connection, all stopped at the end."""

    def __init__(self, server: EmbeddedEtcd, policy: Policy, ttl_s: int = 2) -> None:
        self.server = server
        self.job = f"job-{uuid.uuid4().hex[:8]}"
        self.policy = policy
        self.ttl_s = ttl_s
        self.agents: dict[str, Participant] = {}
        self.stores: list[KVStore] = []
        self.lost: dict[str, str] = {}
        self.probes: dict[str, ProbeListener] = {}
        # What a node says it runs when it registers again or is asked (default: the round
        # it sees, if it is a member, as an agent whose workers run says).
        self.holding: dict[str, str] = {}

    def holds(self, node_id: str) -> str:
        if node_id in self.holding:
            return self.holding[node_id]
        r = self.agents[node_id].current_round if node_id in self.agents else None
        return r.round_id if r is not None and r.member is not None else ""

    def store(self) -> EtcdStore:
        s = EtcdStore(self.server.settings(request_timeout_s=3))
        self.stores.append(s)
        return s

    def add(
        self,
        node_id: str,
        slots: int = 1,
        probe: bool = False,
        probe_port: int = 0,
        store: EtcdStore | None = None,
        fence_s: float = 0.0,
    ) -> Participant:
        record = NodeRecord(node_id, "127.0.0.1", 29500 + len(self.agents), slots, fence_s=fence_s)
        if probe:  # listens for liveness probes, as efdl-run's agent does
            self.probes[node_id] = ProbeListener(
                "127.0.0.1", lambda n=node_id: {"node_id": n, "holds": self.holds(n)}
            )
            probe_port = self.probes[node_id].port
        record = replace(record, probe_port=probe_port)
        if store is not None:
            self.stores.append(store)
        agent = Participant(
            store or self.store(),
            self.job,
            record,
            self.policy,
            lease_ttl_s=self.ttl_s,
            on_lease_expired=lambda reason, n=node_id: self.lost.__setitem__(n, reason),
            holds=lambda n=node_id: self.holds(n),
        )
        agent.join()
        self.agents[node_id] = agent
        return agent

    def wait(self, pred: Callable[[Round], bool], *names: str, timeout_s: float = 15) -> Round:
        """Until every named agent (default: all) sees a round satisfying ``pred``; that round."""
        deadline = time.monotonic() + timeout_s
        names = names or tuple(self.agents)
        seen: dict[str, Round] = {}
        while time.monotonic() < deadline:
            for n in names:
                r = self.agents[n].current_round
                placed = not isinstance(pred, shape) or (r is not None and pred.sees_itself(n, r))
                if r is not None and pred(r) and placed:
                    seen[n] = r
            if len(seen) == len(names):
                gens = {r.generation for r in seen.values()}
                assert len(gens) == 1, f"agents disagree: {gens}"
                return next(iter(seen.values()))
            time.sleep(0.02)
        state = {n: a.current_round for n, a in self.agents.items()}
        raise AssertionError(f"no matching round within {timeout_s} s: {state}")

    def leaders(self) -> list[str]:
        return [n for n, a in self.agents.items() if a.is_leader]

    def crash(self, node_id: str) -> None:
        """As a SIGKILL of the node's agent: its probe port refuses, its lease is not
        revoked."""
        if node_id in self.probes:
            self.probes[node_id].close()
        self.agents[node_id].abandon()

    def close(self) -> None:
        for a in self.agents.values():
            a.abandon()
        for p in self.probes.values():
            p.close()
        for s in self.stores:
            s.close()


class shape:
    """An active round of these (node, workers) in rank order, as an agent sees it: the
    round's totals and its own place (from its member record; none for a spare)."""

    def __init__(self, *pairs: tuple[str, int]) -> None:
        self.pairs = pairs

    def __call__(self, r: Round) -> bool:
        pairs = self.pairs
        if r.status is not RoundStatus.ACTIVE or r.nodes != len(pairs):
            return False
        if r.world_size != sum(w for _, w in pairs) or r.head != pairs[0][0]:
            return False
        m = r.member
        if m is None:
            return True
        first = sum(w for _, w in pairs[: m.group_rank])
        return (m.node_id, m.workers, m.first_rank) == (*pairs[m.group_rank], first)

    def sees_itself(self, name: str, r: Round) -> bool:
        """A node of the shape finds its own place in the round."""
        named = any(n == name for n, _ in self.pairs)
        return not named or (r.member is not None and r.member.node_id == name)


@pytest.fixture()
def cluster(etcd_server: EmbeddedEtcd) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(
        min_workers: int = 2,
        max_workers: int = 8,
        settle_s: float = 0.5,
        join_timeout_s: float = 60,
        ttl_s: int = 2,
    ) -> Cluster:
        c = Cluster(etcd_server, Policy(min_workers, max_workers, settle_s, join_timeout_s), ttl_s)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_two_join_then_a_third_then_one_leaves_gracefully(cluster: Callable[..., Cluster]) -> None:
    c = cluster(ttl_s=10)
    c.add("a")
    c.add("b")
    r1 = c.wait(shape(("a", 1), ("b", 1)))
    assert c.leaders() == ["a"] and r1.world_size == 2
    assert (r1.store_host, r1.store_port) == ("127.0.0.1", 29500)
    c.add("c")
    r2 = c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    assert r2.generation == r1.generation + 1 and "c joined" in r2.reason
    t0 = time.monotonic()
    c.agents["b"].leave()
    r3 = c.wait(shape(("a", 1), ("c", 1)), "a", "c")
    # Well before the 10 s lease would have expired: the leave is seen at once.
    assert time.monotonic() - t0 < 5
    assert r3.generation == r2.generation + 1 and "b left" in r3.reason


def test_a_crashed_node_goes_when_its_lease_expires(cluster: Callable[..., Cluster]) -> None:
    c = cluster(ttl_s=2)
    for n in "abc":
        c.add(n)
    r1 = c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    t0 = time.monotonic()
    c.agents["c"].abandon()  # no revoke: as if the process was SIGKILLed
    r2 = c.wait(shape(("a", 1), ("b", 1)), "a", "b")
    assert 1.0 < time.monotonic() - t0 < 8
    assert r2.generation == r1.generation + 1 and "c left" in r2.reason


def _gone_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is gone: its agent" in r.getMessage()]


def test_a_reported_failure_ends_a_dead_nodes_lease_at_once(
    cluster: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    """A member's workers saw a collective fail: the leader probes the nodes and ends the
    lease of the one whose agent is gone, long before that lease would expire (60 s)."""
    c = cluster(ttl_s=60)
    for n in "abc":
        c.add(n, probe=True)
    r1 = c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    c.crash("c")
    c.agents["b"].report_failure(r1.generation)  # not the leader: it reports through etcd
    r2 = c.wait(shape(("a", 1), ("b", 1)), "a", "b", timeout_s=30)
    assert r2.generation == r1.generation + 1 and "c left" in r2.reason
    assert len(_gone_lines(caplog)) == 1 and "node c is gone" in _gone_lines(caplog)[0]


def test_a_dead_leader_is_found_by_the_node_after_it(
    cluster: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    c = cluster(ttl_s=60)
    for n in "abc":
        c.add(n, probe=True)
    r1 = c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    c.crash("a")
    for n in "bc":
        c.agents[n].report_failure(r1.generation)
    r2 = c.wait(shape(("b", 1), ("c", 1)), "b", "c", timeout_s=30)
    assert r2.leader == "b" and "a left" in r2.reason
    assert ["node a is gone" in line for line in _gone_lines(caplog)] == [True]


def test_a_hung_node_is_left_to_its_lease(
    cluster: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    """Its agent stops refreshing the lease but its port still accepts (a stopped process):
    no evidence, so it leaves when the lease expires, not at the report."""
    c = cluster(ttl_s=4)
    for n in "abc":
        c.add(n, probe=True)
    r1 = c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    c.agents["c"].abandon()  # its listener stays open
    knocked = c.probes["c"].knocks  # the leader's probe when c joined
    c.agents["b"].report_failure(r1.generation)
    # The report's probe reached c (and c was found alive): then its lease decides.
    wait_until("the leader to probe c", lambda: c.probes["c"].knocks > knocked, 20)
    r2 = c.wait(shape(("a", 1), ("b", 1)), "a", "b", timeout_s=30)
    assert "c left" in r2.reason
    assert _gone_lines(caplog) == []  # the lease decided, not a probe


def test_a_port_that_never_answered_is_no_evidence(
    cluster: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    """A firewall that rejects connections refuses a live node's port as a dead one's: a
    node whose port refused from the start is left to its lease."""
    caplog.set_level(logging.INFO, logger="efdl.rendezvous.participant")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        rejecting = s.getsockname()[1]
    c = cluster(ttl_s=4)
    c.add("a", probe=True)
    c.add("b", probe=True)
    c.add("c", probe_port=rejecting)
    r1 = c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    c.crash("c")
    c.agents["b"].report_failure(r1.generation)
    r2 = c.wait(shape(("a", 1), ("b", 1)), "a", "b", timeout_s=30)
    assert "c left" in r2.reason
    assert _gone_lines(caplog) == []
    assert any("node c refused a connection" in r.getMessage() for r in caplog.records)


def test_leader_crash_hands_over_without_losing_or_doubling_a_round(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(ttl_s=2)
    for n in "abc":
        c.add(n)
    r1 = c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    assert c.leaders() == ["a"]
    c.agents["a"].abandon()
    r2 = c.wait(shape(("b", 1), ("c", 1)), "b", "c")
    assert r2.generation == r1.generation + 1  # exactly one round for the loss
    assert r2.leader == "b" and c.leaders() == ["b"]
    c.add("d")  # the next change makes the next generation: none came in between
    r3 = c.wait(shape(("b", 1), ("c", 1), ("d", 1)), "b", "c", "d")
    assert r3.generation == r2.generation + 1


def test_a_spare_replaces_a_departed_member(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_workers=2, max_workers=4)
    c.add("a", slots=2)
    c.add("b", slots=2)
    c.add("s", slots=2)
    r1 = c.wait(shape(("a", 2), ("b", 2)))
    # s registered, and as a spare it changes nothing: s sees r1 as the newest round
    wait_until("s to read the round", lambda: c.agents["s"].current_round is not None, 15)
    assert c.agents["s"].current_round is not None
    assert c.agents["s"].current_round.generation == r1.generation
    assert c.agents["s"].current_round.member is None
    c.agents["b"].leave()
    r2 = c.wait(shape(("a", 2), ("s", 2)), "a", "s")
    assert r2.generation == r1.generation + 1 and r2.spares == 0


def test_a_partial_node_grows_into_its_free_slots(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_workers=2, max_workers=3)
    c.add("a", slots=2)
    c.add("b", slots=4)
    c.wait(shape(("a", 2), ("b", 1)))
    c.add("c", slots=1)  # a spare: the job is at max; b, leading next, reads every node
    c.agents["a"].leave()
    r = c.wait(shape(("b", 3)), "b", "c")
    assert r.store_port == 29501 and r.spares == 1


def test_concurrent_joins_converge_on_one_round(cluster: Callable[..., Cluster]) -> None:
    import threading

    c = cluster(min_workers=2, max_workers=16, settle_s=0.3)
    c.add("n00")
    threads = [threading.Thread(target=c.add, args=(f"n{i:02d}",)) for i in range(1, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = c.wait(lambda r: r.status is RoundStatus.ACTIVE and r.world_size == 10)
    members = read_status(c.stores[0], c.job).members
    assert [m.first_rank for m in members] == list(range(10))
    assert {m.round_id for m in members} == {final.round_id}
    assert len(c.leaders()) == 1
    # Every generation is written once, and an active one served once by its head (after
    # the round is written: a refused write must not replace the live store): no round was
    # written twice by racing leaders.
    kv = c.stores[0].get(JobKeys(c.job).round)
    assert kv is not None and final.generation <= kv.version <= 2 * final.generation


def test_below_min_waits_then_fails_after_the_join_timeout(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_workers=3, join_timeout_s=1.5)
    c.add("a")
    c.add("b")
    waiting = c.wait(lambda r: r.status is RoundStatus.WAITING)
    assert "2 of the 3 workers needed" in waiting.reason or "1 of the 3" in waiting.reason
    failed = c.wait(lambda r: r.status is RoundStatus.FAILED)
    assert "join timeout (1.5 s)" in failed.reason


def test_below_min_then_recovers_when_a_node_comes(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_workers=2, ttl_s=2)
    c.add("a")
    c.add("b")
    c.wait(shape(("a", 1), ("b", 1)))
    c.agents["b"].leave()
    c.wait(lambda r: r.status is RoundStatus.WAITING, "a")
    c.add("c")
    r = c.wait(shape(("a", 1), ("c", 1)), "a", "c")
    assert r.status is RoundStatus.ACTIVE


def _revoke(c: Cluster, *names: str) -> None:
    """etcd ends these nodes' leases (as etcd 3.5.1 does when a paused raft leader resumes,
    or for a node cut off from it for longer than the TTL); wait until each node hears it."""
    for n in names:
        c.stores[0].revoke_lease(c.agents[n]._session.lease_id)  # type: ignore[union-attr]
    wait_until(f"{names} to hear that etcd ended the lease", lambda: set(names) <= set(c.lost), 10)


def _same(r: Round | None, r1: Round) -> bool:
    return r is not None and (r.generation, r.round_id) == (r1.generation, r1.round_id)


def _registered_again(c: Cluster, *names: str) -> None:
    wait_until(
        f"{names} to register again",
        lambda: all(c.agents[n].lease_healthy for n in names),
        20,
    )


def test_a_member_whose_lease_etcd_ended_registers_again_and_no_round_follows(
    cluster: Callable[..., Cluster],
) -> None:
    """etcd ends the lease of a member whose workers train on: it registers again saying
    so; the leader, which saw its record go, asks its agent, waits for it, and writes no
    round: the generation goes on."""
    c = cluster(ttl_s=3)
    for n in "ab":
        c.add(n, probe=True)
    r1 = c.wait(shape(("a", 1), ("b", 1)))
    _revoke(c, "b")
    _registered_again(c, "b")
    assert c.agents["b"].node.holds == r1.round_id
    # The leader decides after b is back: give it a settle window and more to be wrong in.
    time.sleep(c.policy.settle_s + 1)
    for n in "ab":
        assert _same(c.agents[n].current_round, r1), c.agents[n].current_round


def test_every_lease_ended_at_once_no_round_follows(cluster: Callable[..., Cluster]) -> None:
    """Every member's lease ended together (etcd 3.5.1 does this when its paused leader
    resumes): the leader too registers again; whoever leads now waits for the others, and
    the job stays in its generation."""
    c = cluster(ttl_s=3)
    for n in "abc":
        c.add(n, probe=True)
    r1 = c.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    _revoke(c, "a", "b", "c")
    _registered_again(c, "a", "b", "c")
    time.sleep(c.policy.settle_s + 1)
    for n in "abc":
        assert _same(c.agents[n].current_round, r1), c.agents[n].current_round
    assert len(c.leaders()) == 1


def test_a_node_whose_workers_are_gone_registers_again_as_a_newcomer(
    cluster: Callable[..., Cluster],
) -> None:
    """A node that lost its lease and runs no round's workers is not held for: the others go
    on without it at once, and it joins again as a new member."""
    c = cluster(min_workers=1, ttl_s=3)
    for n in "ab":
        c.add(n, probe=True)
    r1 = c.wait(shape(("a", 1), ("b", 1)))
    c.holding["b"] = ""
    _revoke(c, "b")
    r2 = c.wait(lambda r: r.generation > r1.generation and r.world_size == 2, "a", "b")
    assert "b" in r2.reason and "joined" in r2.reason


def test_a_member_that_says_it_comes_back_but_does_not_is_left_out(
    cluster: Callable[..., Cluster],
) -> None:
    """Its agent answers that it runs the round, but it never registers again (it cannot
    reach etcd): after the leader's wait the others go on without it."""
    c = cluster(min_workers=1, ttl_s=2)
    for n in "ab":
        c.add(n, probe=True)
    r1 = c.wait(shape(("a", 1), ("b", 1)))
    c.holding["b"] = r1.round_id
    c.agents["b"].abandon()  # its probe port answers on; it never registers again
    lease = c.agents["b"]._session.lease_id  # type: ignore[union-attr]
    t0 = time.monotonic()
    c.stores[0].revoke_lease(lease)
    r2 = c.wait(shape(("a", 1)), "a", timeout_s=30)
    waited = time.monotonic() - t0
    assert "b left" in r2.reason
    assert REJOIN_TTLS * c.ttl_s <= waited < REJOIN_TTLS * c.ttl_s + 10, waited


def test_a_successor_takes_over_after_a_compaction_in_its_watch_gap(
    cluster: Callable[..., Cluster], etcd_server: EmbeddedEtcd
) -> None:
    """The node after the leader loses its link to etcd (its watch of the leader's record
    breaks); meanwhile the leader leaves and etcd compacts past it. When the link is back the
    watch resumes from a compacted revision and re-lists: a reset batch of what is there now,
    which does not hold the leader's record. The successor takes that for "gone" and leads."""
    c = cluster(min_workers=1, ttl_s=10)
    c.add("a")
    with Proxy(("127.0.0.1", etcd_server.client_port)) as link:
        settings = EtcdSettings.from_list(link.address, request_timeout_s=3)
        c.add("b", store=EtcdStore(settings))
        r1 = c.wait(shape(("a", 1), ("b", 1)))
        link.cut()
        c.agents["a"].leave()  # its record goes, while b hears nothing
        admin = c.store()
        for i in range(3):  # etcd moves on, and compacts past the delete
            admin.put(f"/t/gap-{c.job}/{i}", b"x")
        admin.compact(admin.get_prefix(f"/t/gap-{c.job}/").revision)
        link.heal()
        r2 = c.wait(shape(("b", 1)), "b", timeout_s=30)
    assert c.leaders() == ["b"] and r2.generation == r1.generation + 1
    assert "a left" in r2.reason


def test_duplicate_node_id_is_refused(cluster: Callable[..., Cluster]) -> None:
    c = cluster()
    c.add("a")
    with pytest.raises(
        RendezvousError, match=r"A live node with id 'a' is already in job .* \(host 127.0.0.1\)"
    ):
        c.add("a")


def test_bad_records_are_ignored_not_fatal(cluster: Callable[..., Cluster]) -> None:
    c = cluster(ttl_s=5)
    c.add("a")
    s = c.store()
    keys = JobKeys(c.job)
    lease = s.grant_lease(30)
    s.put(keys.node("zz-garbage"), b"{not json", lease=lease)
    s.put(keys.member("b"), b"NaN?")  # overwritten by the leader's next round
    s.put(keys.failure("zz-garbage"), b"[]", lease=lease)
    s.put(keys.round, b"not a round")  # the leader's next round replaces it
    c.add("b")
    c.wait(shape(("a", 1), ("b", 1)))
    s.revoke_lease(lease)


def test_two_jobs_in_one_etcd_never_see_each_other(cluster: Callable[..., Cluster]) -> None:
    one, two = cluster(), cluster()
    for n in "ab":
        one.add(n)
        two.add(n)  # the same node ids, another job
    r_one = one.wait(shape(("a", 1), ("b", 1)))
    two.add("c")
    r_two = two.wait(shape(("a", 1), ("b", 1), ("c", 1)))
    assert one.agents["a"].current_round == r_one
    one.add("d")  # one's next round follows r_one, not two's
    r = one.wait(shape(("a", 1), ("b", 1), ("d", 1)))
    assert r.generation == r_one.generation + 1 and r.round_id != r_two.round_id


def test_close_job_ends_every_agent(cluster: Callable[..., Cluster]) -> None:
    c = cluster()
    c.add("a")
    c.add("b")
    r1 = c.wait(shape(("a", 1), ("b", 1)))
    closed = close_job(c.store(), c.job)
    r2 = c.wait(lambda r: r.status is RoundStatus.CLOSED)
    assert r2 == closed and r2.generation == r1.generation + 1
    c.add("c")  # a late joiner gets no round after the close
    wait_until("c to read the round", lambda: c.agents["c"].current_round is not None, 15)
    assert c.agents["c"].current_round == closed
    assert c.agents["c"].next_round(closed.generation, timeout_s=0.5) is None


def test_next_round_returns_each_round_once(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_workers=1)
    a = c.add("a")
    r1 = a.next_round(after=0, timeout_s=10)
    assert r1 is not None and r1.status is RoundStatus.ACTIVE
    assert a.next_round(after=r1.generation, timeout_s=0.5) is None
    c.add("b")
    r2 = a.next_round(after=r1.generation, timeout_s=10)
    assert r2 is not None and r2.world_size == 2


def test_etcd_restart_in_the_middle_of_rounds(own_etcd: EmbeddedEtcd) -> None:
    c = Cluster(own_etcd, Policy(2, 8, settle_s=0.5), ttl_s=6)
    try:
        c.add("a")
        c.add("b")
        r1 = c.wait(shape(("a", 1), ("b", 1)))
        own_etcd.kill()
        own_etcd.start()
        c.add("c")  # joins right after the restart, while the others reconnect
        r2 = c.wait(shape(("a", 1), ("b", 1), ("c", 1)), timeout_s=20)
        assert r2.generation == r1.generation + 1
        assert not c.lost
    finally:
        c.close()


def test_rank0_serves_a_fresh_store_before_anyone_acts(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_workers=1, max_workers=3, settle_s=0)
    a = c.add("a")  # the leader and rank 0; b will be rank 0 once a offers no worker
    c.wait(shape(("a", 1)))
    served: list[int] = []
    ports = iter(range(41000, 41100))

    def serve(r: Round) -> int:
        assert not r.served  # nobody can act on the round before its store serves
        served.append(r.generation)
        return next(ports)

    b = Participant(
        c.store(),
        c.job,
        NodeRecord("b", "127.0.0.1", 0, 1),
        c.policy,
        lease_ttl_s=2,
        serve_tcpstore=serve,
    )
    b.join()
    c.agents["b"] = b
    c.wait(shape(("a", 1), ("b", 1)))
    assert served == []  # a, rank 0, served that round's store
    a.set_down(1)  # a's worker is being replaced: b goes on alone, as rank 0
    r = c.wait(shape(("b", 1)))
    assert r.head == "b" and r.leader == "a"
    assert served == [r.generation] and (r.store_host, r.store_port) == ("127.0.0.1", 41000)
    # A member restarting its workers makes a new round: rank 0 serves a new store for it.
    b.request_restart()
    r2 = c.wait(lambda x: x.generation > r.generation and x.status is RoundStatus.ACTIVE)
    assert served == [r.generation, r2.generation] and r2.store_port == 41001


def test_a_store_that_cannot_start_makes_the_node_leave(cluster: Callable[..., Cluster]) -> None:
    c = cluster(min_workers=1, max_workers=1, settle_s=0)

    def broken(r: Round) -> int:
        raise OSError("Address already in use")

    a = Participant(
        c.store(),
        c.job,
        NodeRecord("a", "127.0.0.1", 0, 1),
        c.policy,
        lease_ttl_s=2,
        serve_tcpstore=broken,
    )
    a.join()
    c.agents["a"] = a
    with pytest.raises(RendezvousError, match=r"could not serve the c10d store .*Address already"):
        a.next_round(after=0, timeout_s=10)
    assert c.stores[0].get(JobKeys(c.job).node("a")) is None  # it left the job


def test_a_node_reads_its_place_as_it_was_when_the_round_was_written(
    cluster: Callable[..., Cluster],
) -> None:
    """The leader may already be writing the next round's member records when a node reads its
    own: it reads at the revision the round names, so it gets this round's place; the status
    reads every member there too. Once that revision is compacted, the newest record counts:
    one of a newer round means that this one is being replaced (the node waits for the newer
    round: taking itself for no member of this one would send its in-place workers away for
    nothing); one of an older round means: not a member of this one."""
    c = cluster(ttl_s=10)
    c.add("a")
    c.add("b")
    r = c.wait(shape(("a", 1), ("b", 1)))
    store, keys = c.stores[0], JobKeys(c.job)
    mine = c.agents["b"].current_round
    assert mine is not None and mine.member is not None and mine.member.first_rank == 1
    next_round = replace(mine.member, generation=r.generation + 1, round_id="next", first_rank=0)
    store.put(keys.member("b"), next_round.to_json())
    assert c.agents["b"].own_member(mine) == mine.member
    assert [m.node_id for m in read_members(store, keys, r)] == ["a", "b"]
    store.compact(store.put(keys.prefix + "tick", b"1"))
    assert c.agents["b"].own_member(mine) is SUPERSEDED
    assert [m.node_id for m in read_members(store, keys, r)] == ["a"]
    older = replace(mine.member, generation=max(1, r.generation - 1), round_id="older")
    store.put(keys.member("b"), older.to_json())
    assert c.agents["b"].own_member(mine) is None


def test_a_node_id_held_by_a_live_agent_is_refused_to_a_second_one(
    cluster: Callable[..., Cluster],
) -> None:
    """Agent a runs the round; its lease is lost (etcd revoked it) and its record gone while
    it lives, about to register again: a second agent started with id a is refused, naming
    the live one, rather than made a member in its place. Once a's agent is gone (its probe
    port refuses), a new agent may take the id (a restart under a fixed --node-id)."""
    from efdl.errors import DuplicateNodeError

    c = cluster(min_workers=1, max_workers=2, ttl_s=10)
    first = c.add("a", probe=True)
    r = c.wait(shape(("a", 1)))
    first.abandon()  # it stops renewing, as one cut off from etcd; its agent lives on
    admin = c.store()
    kv = admin.get(JobKeys(c.job).node("a"))
    assert kv is not None
    admin.revoke_lease(kv.lease)
    with pytest.raises(DuplicateNodeError, match=r"held by a live agent .* round"):
        c.add("a")
    c.probes["a"].close()  # now a's agent is gone
    del c.agents["a"]
    second = c.add("a")
    assert second.node_id == "a" and r.generation >= 1


def test_a_member_that_keeps_saying_it_comes_back_is_waited_for_once_a_generation(
    cluster: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    """An agent whose lease keeps being lost, or anything that answers on its probe port
    that it runs the round, cannot hold every round back: the leader waits for a member to
    register again once per generation. The second time the round without it comes."""
    c = cluster(min_workers=1, ttl_s=3)
    for n in "ab":
        c.add(n, probe=True)
    r1 = c.wait(shape(("a", 1), ("b", 1)))
    c.holding["b"] = r1.round_id
    with caplog.at_level(logging.INFO, logger="efdl.rendezvous.participant"):
        _revoke(c, "b")
        _registered_again(c, "b")  # waited for, came back: nothing changes
        assert _same(c.agents["a"].current_round, r1)
        c.agents["b"].abandon()  # the next time it answers again, but does not come back
        c.stores[0].revoke_lease(c.agents["b"]._session.lease_id)  # type: ignore[union-attr]
        r2 = c.wait(lambda r: r.generation > r1.generation, "a")
    assert r2.world_size == 1
    waits = [m for m in caplog.messages if "for it to register again" in m]
    assert len(waits) == 1, waits


class Mute:
    """A probe port whose agent is stopped or hung: the kernel completes connections into
    the listen backlog, and nothing is ever said (nor refused)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", port), backlog=64, reuse_port=False)
        self.port: int = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()


def mute(c: Cluster, node: str) -> Mute:
    """``node``'s agent stops: its probe port goes on accepting, and says nothing."""
    port = c.probes[node].port
    c.probes[node].close()
    return Mute(port)


def _fenced_spare(c: Cluster, fence_s: float) -> tuple[Participant, Round]:
    """Node a trains alone (fence ``fence_s``); s waits as a spare and leads once a's record
    is gone. Returns s and the round."""
    c.add("a", probe=True, fence_s=fence_s)
    r = c.wait(shape(("a", 1)))
    spare = c.add("s", probe=True, fence_s=fence_s)
    wait_until("s to see the round", lambda: spare.current_round is not None, 15)
    return spare, r


def _asked(spare: Participant, node: str) -> None:
    wait_until(
        f"the leader to have asked {node}",
        lambda: spare.is_leader and spare.absences().returning.get(node) == 0.0,
        20,
    )


def test_a_stopped_agent_that_says_nothing_is_no_evidence_its_workers_stopped(
    cluster: Callable[..., Cluster],
) -> None:
    """a's agent is stopped (its probe port accepts, says nothing): its workers may train on.
    The spare that leads keeps a silent, and waits its fence out: no round at once."""
    c = cluster(min_workers=1, max_workers=1, ttl_s=3)
    spare, r = _fenced_spare(c, fence_s=60)
    stopped = mute(c, "a")
    try:
        c.agents["a"].abandon()
        c.stores[0].revoke_lease(c.agents["a"]._session.lease_id)  # type: ignore[union-attr]
        _asked(spare, "a")
        assert "a" in spare.absences().silent, "a stopped agent's silence taken for evidence"
        assert _same(spare.current_round, r)
    finally:
        stopped.close()


def test_a_member_cut_off_again_is_waited_out_though_its_agent_answers(
    cluster: Callable[..., Cluster],
) -> None:
    """a's link flaps: cut off, it says it runs the round, comes back (waited for once);
    cut off again in the same generation, it says so again: not waited for again, but still
    training, cut off: its fence is waited out before a round replaces it."""
    c = cluster(min_workers=1, max_workers=1, ttl_s=3)
    spare, r = _fenced_spare(c, fence_s=60)
    c.holding["a"] = r.round_id
    _revoke(c, "a")
    _registered_again(c, "a")  # waited for, back
    wait_until("s to lead", lambda: spare.is_leader, 15)

    def back() -> bool:
        away = spare.absences()
        return "a" not in away.silent and "a" in away.waited

    wait_until("a back", back, 15)
    c.agents["a"].abandon()  # cut off again; its agent still answers that it runs the round
    c.stores[0].revoke_lease(c.agents["a"]._session.lease_id)  # type: ignore[union-attr]
    _asked(spare, "a")
    assert "a" in spare.absences().silent
    assert _same(spare.current_round, r)


def test_a_new_agent_under_a_silent_members_id_does_not_end_its_fence_wait(
    cluster: Callable[..., Cluster],
) -> None:
    """a is cut off (its probe silent too: a partition), and an agent is started under id a
    elsewhere (a pod rescheduled under the same name): its record claims nothing of the old
    round's workers, so the leader keeps waiting out a's fence."""
    c = cluster(min_workers=1, max_workers=1, ttl_s=3)
    spare, r = _fenced_spare(c, fence_s=60)
    silent = mute(c, "a")  # partitioned: nothing answers (a timeout, as for a stopped agent)
    try:
        c.agents["a"].abandon()
        c.stores[0].revoke_lease(c.agents["a"]._session.lease_id)  # type: ignore[union-attr]
        _asked(spare, "a")
        del c.agents["a"]
        c.add("a", fence_s=60)  # the second agent, claiming nothing
        wait_until(
            "the new record", lambda: c.stores[0].get(JobKeys(c.job).node("a")) is not None, 15
        )
        assert "a" in spare.absences().silent
        assert _same(spare.current_round, r)
    finally:
        silent.close()

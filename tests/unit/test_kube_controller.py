"""The fleet's controller on Kubernetes (efdl.fleet.kube.controller) against an in-memory API
server (tests/fakes/kube.py, the official client's models) and an in-memory etcd: jobs
submitted as ``efdl submit`` does, decided by the fleet's allocator, made into pods; what the
kube-scheduler and the kubelet would do is played by the test. No real API server runs here
(docs/kubernetes.md)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from efdl.fleet.kube.api import KubeConflict, KubeError
from efdl.fleet.kube.cluster import KubeSettings, fleet_pod
from efdl.fleet.kube.controller import KubeController, TickReport
from efdl.fleet.kube.pods import CreatePod, DeletePod
from efdl.fleet.policy import FleetPolicy
from efdl.fleet.records import FleetKeys, JobSpec, Phase
from efdl.fleet.registry import cancel, read_fleet, submit
from efdl.rendezvous.api import Compare
from efdl.rendezvous.election import Election
from efdl.rendezvous.memory_store import MemoryStore
from tests.fakes.kube import FakeKube, serving_pod
from tests.unit.test_kube_cluster import template

KEYS = FleetKeys("default")
POLICY = FleetPolicy(resize_interval_s=0.0, resume_after_s=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def fake() -> FakeKube:
    fake = FakeKube()
    fake.add_node("gpu-1", 4)
    fake.add_node("gpu-2", 4)
    fake.templates[("efdl", "efdl-fleet-job")] = template()
    return fake


class Rig:
    """A controller that leads, with its store, API server and clock."""

    def __init__(self, store: MemoryStore, fake: FakeKube) -> None:
        self.store, self.fake, self.clock = store, fake, Clock()
        self.lease = store.grant_lease(10)
        self.controller = KubeController(
            store, KEYS, fake, KubeSettings(), "ctl-0", self.lease, POLICY, clock=self.clock
        )
        me = Election(store, KEYS.leader, "test").campaign(KEYS.leader + "ctl-0", b"{}", self.lease)
        assert me.candidate is not None
        self.leading: Compare = me.candidate.guard

    def submit(self, job_id: str, lo: int, hi: int, priority: int = 0) -> None:
        self.clock.now += 1
        s = JobSpec(job_id, ("train.py",), "/srv/code", lo, hi, priority, "s3://c/" + job_id,
                    submitted=self.clock.now)  # fmt: skip
        submit(self.store, KEYS, s)

    def tick(self) -> TickReport:
        self.clock.now += 1
        report = self.controller.tick(self.leading)
        assert report.errors == [], report.errors
        return report

    def settle(self) -> TickReport:
        """Tick, let the scheduler bind, tick until nothing is left to do."""
        report = self.tick()
        for _ in range(5):
            self.fake.schedule()
            self.fake.gone()
            report = self.tick()
            if not report.actions:
                return report
        raise AssertionError(f"no fixed point: {report}")

    def status(self, job_id: str) -> Any:
        return {j.spec.job_id: j.status for j in read_fleet(self.store, KEYS).jobs}[job_id]

    def pods(self, job_id: str) -> list[Any]:
        read = [fleet_pod(p, KubeSettings()) for p in self.fake.list_pods("efdl")]
        return sorted((p for p in read if p and p.job_id == job_id), key=lambda p: p.name)

    def alive(self, job_id: str) -> list[Any]:
        return [p for p in self.pods(job_id) if p.state.alive]


@pytest.fixture
def rig(store: MemoryStore, fake: FakeKube) -> Rig:
    return Rig(store, fake)


def test_a_submitted_job_is_placed_as_one_pod_per_gpu_and_a_tick_after_writes_nothing(
    rig: Rig,
) -> None:
    rig.submit("a", 2, 6)
    report = rig.tick()
    st = rig.status("a")
    assert st.phase is Phase.RUNNING and st.size == 6
    creates = [a for a in report.actions if isinstance(a, CreatePod)]
    assert len(creates) == 6 and sum(a.core for a in creates) == 2
    hosts = read_fleet(rig.store, KEYS).hosts
    assert sorted(h.host_id for h in hosts) == ["gpu-1", "gpu-2"]
    assert all(len(h.gpus) == 4 and not any(g.foreign for g in h.gpus) for h in hosts)
    rig.fake.schedule()
    revision, writes = rig.store.get_prefix(KEYS.prefix).revision, rig.fake.writes
    again = rig.tick()  # the same cluster and fleet: nothing to write anywhere
    assert again.actions == [] and again.etcd_writes == 0
    assert rig.store.get_prefix(KEYS.prefix).revision == revision and rig.fake.writes == writes


def test_a_node_that_inference_fills_gets_no_pod(rig: Rig) -> None:
    rig.fake.add_pod(serving_pod("llm-0", "gpu-1", 3))
    rig.submit("a", 2, 8)
    rig.settle()
    assert rig.status("a").size == 5
    assert sorted(p.host for p in rig.alive("a")) == ["gpu-1"] + ["gpu-2"] * 4
    host = next(h for h in read_fleet(rig.store, KEYS).hosts if h.host_id == "gpu-1")
    assert sum(g.foreign for g in host.gpus) == 3
    rig.fake.add_pod(serving_pod("llm-1", "gpu-1", 1))  # bound past the fleet's pod
    rig.settle()
    assert rig.status("a").size == 4 and {p.host for p in rig.alive("a")} == {"gpu-2"}


def test_two_jobs_whose_mins_do_not_both_fit_one_waits_with_no_pod(rig: Rig) -> None:
    rig.submit("a", 5, 5)
    rig.submit("b", 5, 5)
    rig.settle()
    phases = {j: rig.status(j).phase for j in ("a", "b")}
    assert sorted(phases.values()) == [Phase.QUEUED, Phase.RUNNING]
    waiting = next(j for j, p in phases.items() if p is Phase.QUEUED)
    assert rig.pods(waiting) == []  # not a fraction of its min: nothing
    running = next(j for j, p in phases.items() if p is Phase.RUNNING)
    assert [p.state.value for p in rig.alive(running)] == ["running"] * 5


def test_a_higher_priority_job_shrinks_a_lower_one_by_the_controller_not_by_preemption(
    rig: Rig,
) -> None:
    rig.submit("low", 2, 8, priority=-10)
    rig.settle()
    assert len(rig.alive("low")) == 8
    rig.submit("high", 3, 3, priority=10)
    report = rig.tick()
    deletes = [a for a in report.actions if isinstance(a, DeletePod)]
    assert {a.job_id for a in deletes} == {"low"} and len(deletes) == 3
    for host in ("gpu-1", "gpu-2"):  # on each host given back, growth pods leave first
        here = [p for p in rig.pods("low") if p.host == host]
        left = [p for p in here if p.state.value == "terminating"]
        assert not (any(p.core for p in left) and any(not p.core and p.state.alive for p in here))
    assert rig.status("high").phase is Phase.RUNNING
    # the new pods wait (Pending) while the leaving ones hold their GPUs, then are bound
    assert rig.fake.schedule() == []
    rig.fake.gone()
    assert len(rig.fake.schedule()) == 3
    rig.settle()
    assert len(rig.alive("high")) == 3 and len(rig.alive("low")) == 5
    classes = {p.name: p.core for p in rig.alive("high")}
    assert all(classes.values())  # its min: core pods


def test_inference_that_preempts_a_growth_pod_is_seen_and_the_job_goes_on_smaller(
    rig: Rig,
) -> None:
    rig.submit("a", 2, 8)
    rig.settle()
    growth = next(p for p in rig.alive("a") if not p.core and p.host == "gpu-2")
    rig.fake.preempt(growth.name, serving_pod("llm-0", "gpu-2", 1))
    report = rig.tick()
    assert report.actions == []  # no pod made again on the GPU inference takes
    st = rig.status("a")
    assert st.size == 7 and "gpu-2" in dict(st.gpus) and len(dict(st.gpus)["gpu-2"]) == 3
    rig.fake.gone()
    assert rig.settle().actions == [] and len(rig.alive("a")) == 7


def test_a_finished_job_ends_its_pods_and_nothing_crash_loops(rig: Rig) -> None:
    rig.submit("a", 2, 4)
    rig.settle()
    first, *others = rig.alive("a")
    rig.fake.finish(first.name, 0)
    report = rig.tick()
    assert rig.status("a").phase is Phase.FINISHED
    assert {a.name for a in report.actions if isinstance(a, DeletePod)} == {p.name for p in others}
    rig.fake.gone()
    assert rig.alive("a") == [] and [p.state.value for p in rig.pods("a")] == ["succeeded"]
    assert rig.tick().actions == []  # kept for kubectl logs, not restarted
    rig.clock.now += 3600
    assert [type(a) for a in rig.tick().actions] == [DeletePod]


def test_a_cancelled_job_leaves_gracefully(rig: Rig) -> None:
    rig.submit("a", 2, 4)
    rig.settle()
    cancel(rig.store, KEYS, "a")
    report = rig.tick()
    assert len([a for a in report.actions if isinstance(a, DeletePod)]) == 4
    assert {p.state.value for p in rig.pods("a")} == {"terminating"}


def test_without_the_pod_template_no_pod_is_made_and_it_is_said_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    template = rig.fake.templates.pop(("efdl", "efdl-fleet-job"))
    rig.submit("a", 2, 4)
    assert rig.tick().actions == [] and rig.tick().actions == []
    assert rig.status("a").phase is Phase.RUNNING and rig.pods("a") == []
    assert caplog.text.count("pod template efdl/efdl-fleet-job not found") == 1
    rig.fake.templates[("efdl", "efdl-fleet-job")] = template
    assert len(rig.tick().actions) == 4


def test_a_failed_read_decides_nothing_and_writes_nothing(rig: Rig) -> None:
    rig.submit("a", 2, 4)
    rig.fake.fail["list_pods"] = KubeError("Kubernetes: listing the pods failed: 503.")
    revision = rig.store.get_prefix(KEYS.prefix).revision
    report = rig.controller.tick(rig.leading)
    assert not report.decided and "503" in report.errors[0]
    assert rig.store.get_prefix(KEYS.prefix).revision == revision and rig.fake.writes == 0
    assert rig.status("a").phase is Phase.QUEUED


def test_a_pod_that_changed_since_it_was_read_is_left_to_the_next_tick(rig: Rig) -> None:
    rig.submit("a", 2, 4)
    rig.settle()
    cancel(rig.store, KEYS, "a")
    rig.fake.fail["delete_pod"] = KubeConflict("Kubernetes: pod efdl/x changed since it was read.")
    report = rig.controller.tick(rig.leading)
    assert report.applied == 3 and "efdl/x" in report.errors[0]
    assert [type(a) for a in rig.tick().actions] == [DeletePod]


def test_a_controller_that_no_longer_leads_writes_nothing(rig: Rig) -> None:
    rig.submit("a", 2, 4)
    rig.store.delete(KEYS.leader + "ctl-0")  # its lease went; another leads
    report = rig.controller.tick(rig.leading)
    assert not report.leading and rig.fake.writes == 0
    assert read_fleet(rig.store, KEYS).hosts == ()


def test_a_node_that_is_drained_gives_its_gpus_back_and_the_job_is_placed_elsewhere(
    rig: Rig,
) -> None:
    rig.fake.add_node("gpu-3", 4)
    rig.submit("a", 4, 4)
    rig.settle()
    (host,) = {p.host for p in rig.alive("a")}
    rig.fake.drain(host)
    rig.settle()
    assert {p.host for p in rig.alive("a")} != {host} and len(rig.alive("a")) == 4
    assert rig.status("a").phase is Phase.RUNNING


def test_a_pod_that_finds_no_room_gives_its_gpu_up_there_and_the_node_is_held_out(
    rig: Rig,
) -> None:
    rig.fake.add_node("gpu-3", 4)
    rig.submit("a", 4, 4)
    rig.tick()
    pods = rig.alive("a")
    (host,) = {p.host for p in pods}
    for p in pods:  # another tenant's pods took the node's memory meanwhile
        rig.fake.unschedulable(
            p.name, rig.clock.now, "0/3 nodes are available: Insufficient memory"
        )
    rig.tick()
    assert {p.host for p in rig.alive("a")} == {host}  # not yet: 120 s
    rig.clock.now += 120
    report = rig.tick()
    assert {a.name for a in report.actions if isinstance(a, DeletePod)} == {p.name for p in pods}
    moved = {p.host for p in rig.alive("a")}
    assert moved and host not in moved and rig.status("a").size == 4
    held = next(h for h in read_fleet(rig.store, KEYS).hosts if h.host_id == host)
    assert all(g.foreign for g in held.gpus)  # nothing placed there again at once
    rig.settle()
    rig.clock.now += 600
    rig.tick()
    held = next(h for h in read_fleet(rig.store, KEYS).hosts if h.host_id == host)
    assert not any(g.foreign for g in held.gpus)


def test_two_controllers_one_leads_and_the_other_takes_over(
    store: MemoryStore, fake: FakeKube
) -> None:
    """The elected loop: one tick per interval while leading; a successor leads when the
    leader's key goes."""
    submit(store, KEYS, JobSpec("a", ("train.py",), "/srv", 1, 2, submitted=1.0))
    stop = threading.Event()
    leases = [store.grant_lease(10), store.grant_lease(10)]
    controllers = [
        KubeController(
            store, KEYS, fake, KubeSettings(), f"ctl-{i}", leases[i], POLICY, interval_s=0.05
        )
        for i in range(2)
    ]
    threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in controllers]
    for t in threads:
        t.start()
    try:
        assert controllers[0].leading.wait(5)
        for _ in range(100):
            if len(fake.pods) == 2:
                break
            stop.wait(0.05)
        assert len(fake.pods) == 2 and not controllers[1].leading.is_set()
        store.revoke_lease(leases[0])  # the leader dies
        assert controllers[1].leading.wait(5)
        fake.schedule()
        stop.wait(0.2)
        assert len(fake.pods) == 2  # the successor keeps what runs: no pod made twice
    finally:
        stop.set()
        for t in threads:
            t.join(5)

"""The fleet controller's pure part (efdl.fleet.kube.cluster and .pods): the cluster read as host
records, a job's pods that ended as its end, and the allocator's statuses as pods to create
and delete, on the official client's model objects (no API server: tests/fakes/kube.py is one
in memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from kubernetes import client as k

from efdl.cli import main
from efdl.cli.run import launch_config, run_main
from efdl.fleet.allocate import Job
from efdl.fleet.kube.cluster import (
    FleetPod,
    KubeSettings,
    PodState,
    cluster_hosts,
    endings,
    fleet_pod,
    hold_out,
)
from efdl.fleet.kube.pods import CreatePod, DeletePod, agent_command, plan
from efdl.fleet.records import Gpus, JobSpec, JobStatus, Phase
from tests.fakes.kube import FakeKube, node, round_trip, serving_pod

NOW = 1_000_000.0
S = KubeSettings()
GPU = S.gpu_resource


def spec(job_id: str, lo: int, hi: int, priority: int = 0, at: float = 1.0, **kw: Any) -> JobSpec:
    return JobSpec(job_id, ("train.py", "--lr", "0.1"), "/srv/code", lo, hi, priority, **kw,
                   submitted=at)  # fmt: skip


def running(s: JobSpec, gpus: Gpus) -> Job:
    return Job(s, JobStatus(Phase.RUNNING, gpus, NOW - 100, "placed"))


def template() -> Any:
    return k.V1PodTemplate(
        metadata=k.V1ObjectMeta(name="efdl-fleet-job", namespace="efdl"),
        template=k.V1PodTemplateSpec(
            metadata=k.V1ObjectMeta(labels={"team": "ml"}),
            spec=k.V1PodSpec(
                termination_grace_period_seconds=90,
                containers=[
                    k.V1Container(
                        name="efdl",
                        image="registry.example.com/ml/train:1",
                        env=[k.V1EnvVar(name="EFDL_ETCD", value="etcd-client.efdl.svc:2379")],
                        resources=k.V1ResourceRequirements(requests={"cpu": "8"}),
                    )
                ],
            ),
        ),
    )


def pods_of(actions: list[Any], fake: FakeKube | None = None) -> list[FleetPod]:
    """The pods the plan's creates make, as the API server stores and the controller reads
    them (bound and running where ``fake`` schedules them)."""
    fake = fake or FakeKube()
    for a in actions:
        if isinstance(a, CreatePod):
            fake.nodes.setdefault(a.host, node(a.host, 8))
            fake.create_pod("efdl", a.pod)
    fake.schedule()
    return [p for p in (fleet_pod(raw, S) for raw in fake.list_pods("efdl")) if p is not None]


# ---------------------------------------------------------------- hosts


def test_a_gpu_node_is_a_host_of_slots_and_inference_marks_free_slots_first() -> None:
    job = running(spec("a", 1, 4), (("gpu-1", (0, 1)),))
    nodes = [node("gpu-1", 8), node("cpu-1", 0), node("gpu-2", 4, ready=False)]
    pods = pods_of(plan([job], [], ["gpu-1"], template(), S, NOW))
    serving = [serving_pod("llm-0", "gpu-1", 3)]
    hosts, problems = cluster_hosts(nodes, pods, serving, [job], S.gpu_resource)
    assert problems == [] and [h.host_id for h in hosts] == ["gpu-1"]  # no GPU / not Ready: out
    (h,) = hosts
    assert len(h.gpus) == 8 and h.address.startswith("10.0.0.")
    assert sorted(g.index for g in h.gpus if g.foreign) == [5, 6, 7]  # not the job's 0, 1


def test_a_slot_whose_pod_inference_preempted_is_the_one_marked_foreign() -> None:
    """gpu-1's 4 GPUs are all the fleet's; inference preempted one of a's pods and is
    nominated there: a's missing slot is foreign, not b's."""
    a = running(spec("a", 1, 2, priority=10), (("gpu-1", (0, 1)),))
    b = running(spec("b", 1, 2, priority=0), (("gpu-1", (2, 3)),))
    fake = FakeKube()
    pods = pods_of(plan([a, b], [], ["gpu-1"], template(), S, NOW), fake)
    victim = next(p for p in pods if p.job_id == "a")
    fake.preempt(victim.name, serving_pod("llm-0", "gpu-1", 1))
    read = [fleet_pod(p, S) for p in fake.list_pods("efdl")]
    others = [p for p in fake.list_pods(None, active=True) if p.metadata.namespace != "efdl"]
    assert others[0].status.nominated_node_name == "gpu-1"
    hosts, _ = cluster_hosts([node("gpu-1", 4)], [p for p in read if p], others, [a, b], GPU)
    assert [g.index for g in hosts[0].gpus if g.foreign] == [1]


def test_more_inference_than_free_slots_takes_the_lowest_priority_jobs_slots() -> None:
    a = running(spec("a", 1, 2, priority=10), (("gpu-1", (0, 1)),))
    b = running(spec("b", 1, 2, priority=-5), (("gpu-1", (2, 3)),))
    pods = pods_of(plan([a, b], [], ["gpu-1"], template(), S, NOW))
    serving = [serving_pod("llm-0", "gpu-1", 1)]  # bound past the fleet (nodeName set by hand)
    hosts, _ = cluster_hosts([node("gpu-1", 4)], pods, serving, [a, b], S.gpu_resource)
    assert [g.index for g in hosts[0].gpus if g.foreign] == [3]


def test_a_cordoned_node_takes_nothing_new_and_keeps_what_runs() -> None:
    a = running(spec("a", 1, 2), (("gpu-1", (0, 1)),))
    pods = pods_of(plan([a], [], ["gpu-1"], template(), S, NOW))
    hosts, _ = cluster_hosts([node("gpu-1", 4, unschedulable=True)], pods, [], [a], S.gpu_resource)
    assert [g.index for g in hosts[0].gpus if not g.foreign] == [0, 1]


def test_a_node_whose_name_is_no_host_id_is_left_out_with_a_sentence() -> None:
    hosts, problems = cluster_hosts([node("a..b", 4)], [], [], [], S.gpu_resource)
    assert hosts == [] and "a..b" in problems[0] and "left out" in problems[0]


# ---------------------------------------------------------------- pods


def test_a_jobs_min_is_a_gang_of_core_pods_then_growth_pods_pinned_never_restarted() -> None:
    job = running(spec("llama", 3, 6), (("gpu-1", (0, 1, 2, 3)), ("gpu-2", (0, 1))))
    queued = Job(spec("later", 2, 2), JobStatus())
    actions = plan([job, queued], [], ["gpu-1", "gpu-2"], template(), S, NOW)
    assert all(isinstance(a, CreatePod) and a.job_id == "llama" for a in actions)  # none of later
    assert [(a.host, a.core) for a in actions if isinstance(a, CreatePod)] == [
        ("gpu-1", True), ("gpu-1", True), ("gpu-1", True), ("gpu-1", False),
        ("gpu-2", False), ("gpu-2", False),
    ]  # fmt: skip
    pod = round_trip(actions[0].pod, "V1Pod")  # nothing lost in the client's models
    assert pod.spec.priority_class_name == "efdl-fleet-core"
    assert round_trip(actions[-1].pod, "V1Pod").spec.priority_class_name == "efdl-fleet-growth"
    assert pod.spec.restart_policy == "Never"
    term = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    req = term.node_selector_terms[0].match_fields[0]
    assert (req.key, req.operator, req.values) == ("metadata.name", "In", ["gpu-1"])
    (c,) = pod.spec.containers
    assert c.resources.limits == {"nvidia.com/gpu": "1"} and c.resources.requests == {"cpu": "8"}
    assert c.working_dir == "/srv/code" and c.image == "registry.example.com/ml/train:1"
    assert pod.metadata.labels["team"] == "ml"
    assert pod.metadata.annotations["efdl.dev/job-id"] == "llama"
    assert pod.spec.termination_grace_period_seconds == 90


def test_a_pod_runs_one_efdl_run_agent_on_one_gpu_and_the_jobs_command_after_dashes() -> None:
    mine = (("LR", "$(X)"), ("EFDL_ETCD", "elsewhere:2379"), ("POD_NAME", "x"))
    s = JobSpec("j", ("-m", "pkg.train", "--etcd", "$(HOME)", "a$b"), "/w", 2, 4,
                cache_url="s3://c/j", env=mine, submitted=1.0)  # fmt: skip
    cmd = agent_command(Job(s, JobStatus()))
    # Kubernetes expands $(NAME) and makes $$ a $: the job's text arrives as it was given
    assert cmd[0] == "efdl-run"
    assert cmd[cmd.index("--") + 1 :] == ["pkg.train", "--etcd", "$$(HOME)", "a$$b"]
    pod = [a.replace("$(POD_NAME)", "j-0").replace("$(POD_IP)", "10.0.0.7") for a in cmd[1:]]
    params = run_main.make_context("efdl-run", pod).params
    assert params["script"] == "pkg.train" and params["module"]
    assert (params["job_id"], params["min_workers"], params["max_workers"]) == ("j", 2, 4)
    assert params["nproc_per_node"] == "1" and params["cache_url"] == "s3://c/j"
    cfg = launch_config(params, None, {"EFDL_ETCD": "etcd-client.efdl.svc:2379"})  # the template's
    assert (cfg.etcd, cfg.node_id, cfg.host, cfg.min_workers) == (
        "etcd-client.efdl.svc:2379", "j-0", "10.0.0.7", 2
    )  # fmt: skip
    (made,) = plan([running(s, (("n", (0,)),))], [], ["n"], template(), S, NOW)
    assert isinstance(made, CreatePod)
    env = {e.name: e for e in made.pod.spec.containers[0].env}
    assert env["LR"].value == "$$(X)"
    assert env["POD_NAME"].value_from.field_ref.field_path == "metadata.name"
    assert env["EFDL_ETCD"].value == "etcd-client.efdl.svc:2379"  # the template's, not the job's
    assert len(made.pod.spec.containers[0].env) == 4  # the template's, LR, POD_NAME, POD_IP


def test_pod_names_and_labels_are_valid_for_any_job_id() -> None:
    odd = "Llama_7B.run" + "x" * 100
    actions = plan([running(spec(odd, 1, 1), (("n", (0,)),))], [], ["n"], template(), S, NOW)
    pods = pods_of(actions)  # the fake refuses a bad name or label value, as a server would
    assert pods[0].job_id == odd and len(pods[0].name) < 63


def test_a_plan_made_again_from_the_pods_it_made_is_empty() -> None:
    job = running(spec("a", 2, 5), (("gpu-1", (0, 1, 2)), ("gpu-2", (4, 5))))
    pods = pods_of(plan([job], [], ["gpu-1", "gpu-2"], template(), S, NOW))
    assert len(pods) == 5 and plan([job], pods, ["gpu-1", "gpu-2"], template(), S, NOW) == []


def test_a_shrink_deletes_on_the_host_given_back_pending_then_growth_then_newest() -> None:
    big = running(spec("a", 2, 8), (("gpu-1", (0, 1, 2, 3)), ("gpu-2", (0, 1, 2, 3))))
    fake = FakeKube()
    fake.add_node("gpu-1", 8)
    fake.add_node("gpu-2", 3)  # one of its four pods stays pending
    pods = pods_of(plan([big], [], ["gpu-1", "gpu-2"], template(), S, NOW), fake)
    pending = [p.name for p in pods if p.state is PodState.PENDING]
    assert len(pending) == 1
    small = running(big.spec, (("gpu-1", (0, 1, 2, 3)), ("gpu-2", (0, 1))))
    actions = plan([small], pods, ["gpu-1", "gpu-2"], template(), S, NOW)
    assert all(isinstance(a, DeletePod) for a in actions) and len(actions) == 2
    gone = {p.name: p for p in pods if p.name in {a.name for a in actions}}
    assert {p.host for p in gone.values()} == {"gpu-2"} and pending[0] in gone
    assert not any(p.core for p in gone.values())  # a's 2 core pods are on gpu-1
    assert "holds 2 GPU(s) on gpu-2" in actions[0].why


def test_a_job_that_lost_a_core_pod_gets_a_core_pod_back() -> None:
    job = running(spec("a", 2, 3), (("gpu-1", (0, 1, 2)),))
    pods = pods_of(plan([job], [], ["gpu-1"], template(), S, NOW))
    core = [p for p in pods if p.core]
    rest = [p for p in pods if p is not core[0]]
    (again,) = plan([job], rest, ["gpu-1"], template(), S, NOW)
    assert isinstance(again, CreatePod) and again.core and again.name == core[0].name


def test_a_suspended_or_cancelled_job_has_no_pods_left() -> None:
    job = running(spec("a", 1, 2), (("gpu-1", (0, 1)),))
    pods = pods_of(plan([job], [], ["gpu-1"], template(), S, NOW))
    for phase in (Phase.SUSPENDED, Phase.CANCELLED, Phase.QUEUED):
        j = Job(job.spec, JobStatus(phase, (), NOW, "why"))
        actions = plan([j], pods, ["gpu-1"], template(), S, NOW)
        assert [type(a) for a in actions] == [DeletePod, DeletePod], phase


def test_no_pod_is_made_on_a_node_that_is_gone_and_none_without_a_template() -> None:
    job = running(spec("a", 1, 4), (("gpu-1", (0, 1)), ("gone", (0, 1))))
    actions = plan([job], [], ["gpu-1"], template(), S, NOW)
    assert {a.host for a in actions if isinstance(a, CreatePod)} == {"gpu-1"}
    assert plan([job], [], ["gpu-1"], None, S, NOW) == []


# ---------------------------------------------------------------- endings


def _ended(exit_code: int) -> tuple[Job, FakeKube, list[FleetPod]]:
    job = running(spec("a", 2, 2), (("gpu-1", (0, 1)),))
    fake = FakeKube()
    pods = pods_of(plan([job], [], ["gpu-1"], template(), S, NOW), fake)
    fake.finish(pods[0].name, exit_code)
    return job, fake, [p for p in (fleet_pod(r, S) for r in fake.list_pods("efdl")) if p]


def test_a_pod_that_exits_0_finishes_its_job_and_the_jobs_pods_end() -> None:
    job, _, pods = _ended(0)
    (status,) = endings([job], pods, NOW).values()
    assert status.phase is Phase.FINISHED and "finished (exit 0)" in status.reason
    done = Job(job.spec, status)
    actions = plan([done], pods, ["gpu-1"], template(), S, NOW)
    assert [(type(a), a.why) for a in actions] == [(DeletePod, "the job finished")]  # the alive one
    later = plan([done], pods, ["gpu-1"], template(), S, NOW + S.keep_ended_s)
    assert len(later) == 2  # the ended one is kept an hour (kubectl logs), then deleted


def test_a_pod_that_fails_fails_its_job_naming_the_pod_and_the_exit_code() -> None:
    job, _, pods = _ended(3)
    (status,) = endings([job], pods, NOW).values()
    assert status.phase is Phase.FAILED and "exit code 3" in status.reason
    assert pods[0].name in status.reason and "kubectl logs" in status.reason


def test_an_evicted_pod_ends_nothing_and_is_made_again() -> None:
    job = running(spec("a", 2, 2), (("gpu-1", (0, 1)),))
    fake = FakeKube()
    pods = pods_of(plan([job], [], ["gpu-1"], template(), S, NOW), fake)
    fake.evict(pods[0].name)
    read = [p for p in (fleet_pod(r, S) for r in fake.list_pods("efdl")) if p]
    assert endings([job], read, NOW) == {}
    actions = plan([job], read, ["gpu-1"], template(), S, NOW)
    assert [type(a) for a in actions] == [DeletePod, CreatePod] and "Evicted" in actions[0].why


def test_the_pods_of_an_earlier_submission_end_nothing_and_go() -> None:
    _, _, pods = _ended(3)
    again = running(spec("a", 2, 2, at=2.0), (("gpu-1", (0, 1)),))  # submitted anew
    assert endings([again], pods, NOW) == {}
    actions = plan([again], pods, ["gpu-1"], template(), S, NOW)
    assert sum(isinstance(a, DeletePod) for a in actions) == 2
    assert sum(isinstance(a, CreatePod) for a in actions) == 2


def test_a_pod_stuck_on_its_node_gives_its_slot_up_and_the_node_is_held_out_a_while() -> None:
    job = running(spec("a", 1, 2), (("gpu-1", (0, 1)),))
    fake = FakeKube()
    fake.add_node("gpu-1", 1)  # the second pod is not bound
    pods = pods_of(plan([job], [], ["gpu-1"], template(), S, NOW), fake)
    stuck = next(p for p in pods if p.state is PodState.PENDING)
    fake.unschedulable(stuck.name, NOW - 100, "0/1 nodes are available: Insufficient cpu")
    read = [p for p in (fleet_pod(r, S) for r in fake.list_pods("efdl")) if p]
    assert hold_out({}, read, NOW, S) == {}  # 100 s: not yet
    held = hold_out({}, read, NOW + 20, S)
    assert held["gpu-1"].gpus == 1 and held["gpu-1"].pods == {stuck.name}
    assert "Insufficient cpu" in held["gpu-1"].why
    hosts, _ = cluster_hosts([node("gpu-1", 4)], read, [], [job], GPU, held)
    assert [g.index for g in hosts[0].gpus if g.foreign] == [1]  # the stuck pod's slot
    later = hold_out(held, [], NOW + 20 + S.hold_out_s - 1, S)  # the pod went; still held
    assert later["gpu-1"].gpus == 1 and later["gpu-1"].pods == frozenset()
    assert hold_out(later, [], NOW + 20 + S.hold_out_s, S) == {}
    fewer = running(job.spec, (("gpu-1", (0,)),))
    (gone,) = plan([fewer], read, ["gpu-1"], template(), S, NOW)
    assert isinstance(gone, DeletePod) and gone.name == stuck.name  # the stuck one leaves


def test_the_controller_with_no_api_server_to_reach_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    result = CliRunner().invoke(main, ["kube-controller", "--etcd", "127.0.0.1:9"])
    assert result.exit_code != 0 and "no API server to reach" in result.output, result.output
    bad = CliRunner().invoke(main, ["kube-controller", "--etcd", "127.0.0.1:9", "--interval", "0"])
    assert bad.exit_code != 0 and "--interval 0.0 is not a number of seconds > 0" in bad.output

"""The fleet's controller on Kubernetes: the allocator's statuses as pods to create and delete.
Pure (efdl.fleet.kube.controller runs what :func:`plan` returns).

**A job is a set of pods the controller owns, one GPU each**, pinned to the node the allocator
chose (a required node affinity on the node's name: the kube-scheduler still checks that the
GPU is free, and waits while a leaving pod holds it). Not a StatefulSet: its pods share one
template, so they cannot be pinned one by one to the allocator's hosts, and its scale-down
removes the highest ordinal wherever it runs, not the pod on the host the allocator gives
back. What that costs: nothing restarts a pod that dies but this controller (it does, at its
next interval), and ``kubectl scale`` is not the way to resize (the allocator is).

A running job gets one pod per GPU on each host of its status; a job that holds nothing
(queued, suspended) or has ended has none (its pods get SIGTERM: a graceful leave, persisting
with a cache; ``restartPolicy: Never``, so an ended job's pods never crash-loop on its GPUs).
A job's min comes as a gang: the allocator gives a job its min or nothing, and its pods are
made in the decision that gives it. Its first ``min`` pods are of the *core* priority class,
the others *growth*, lower: both preempt nothing (``preemptionPolicy: Never``: only the
controller shrinks jobs), and inference preempts a job's growth pods before its core. A
shrink deletes, on each host that gives GPUs back, pods the kube-scheduler found no room for
first, then pending pods, then growth pods, then the newest. Deletes come before creates; a
plan made again from the cluster it made is empty (no writes).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from efdl.fleet.allocate import Job
from efdl.fleet.kube.cluster import (
    CONTAINER,
    HOST_NOTE,
    JOB_LABEL,
    JOB_NOTE,
    SUBMITTED_NOTE,
    FleetPod,
    KubeSettings,
    PodState,
    label_value,
    pod_base,
    pods_by_job,
    submission,
)
from efdl.fleet.launch import daemon_only, split_command
from efdl.fleet.records import Phase

# ---------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class CreatePod:
    """Create ``pod`` (a ``V1Pod``) for ``job_id`` on ``host``."""

    job_id: str
    host: str
    name: str
    core: bool
    pod: Any


@dataclass(frozen=True, slots=True)
class DeletePod:
    """Delete pod ``name`` (if still ``uid`` at ``resource_version``), because ``why``."""

    job_id: str
    name: str
    uid: str
    resource_version: str
    why: str


Action = CreatePod | DeletePod


def plan(
    jobs: Sequence[Job],
    pods: Sequence[FleetPod],
    hosts: Iterable[str],
    template: Any,
    settings: KubeSettings,
    now: float,
) -> list[Action]:
    """The deletes, then the creates, that bring the fleet's pods to the jobs' statuses.

    Args:
        jobs: the jobs as etcd holds them after the decision.
        pods: the fleet's pods (:func:`fleet_pod`).
        hosts: the nodes present (no pod is made on a node that is gone).
        template: the ``V1PodTemplate`` the pods are made from (None: none is made).
        settings: the mapping.
        now: wall-clock seconds.
    """
    present = set(hosts)
    by_job = {j.spec.job_id: j for j in jobs}
    pods_of = pods_by_job(pods)
    deletes: list[DeletePod] = []
    creates: list[CreatePod] = []
    for p in pods:  # ended pods, and pods of no job
        j = by_job.get(p.job_id)
        why = _doomed(p, j, settings, now)
        if why:
            deletes.append(DeletePod(p.job_id, p.name, p.uid, p.resource_version, why))
    for j in jobs:
        all_mine = pods_of.get(j.spec.job_id, [])
        mine = [p for p in all_mine if p.submitted == submission(j) and p.state.alive]
        want = dict(j.status.gpus) if j.status.phase is Phase.RUNNING else {}
        keep: list[FleetPod] = []
        for host in sorted({p.host for p in mine} | set(want)):
            here = [p for p in mine if p.host == host]
            n = len(want.get(host, ()))
            if host not in present and host in want:
                keep += here  # a node gone: its pods go with it (no pod made there)
                continue
            # one found no room first, pending ("pending" < "running"), growth, the newest
            order = sorted(
                here,
                key=lambda p: (p.unschedulable_since is None, p.state.value, p.core, -p.ordinal),
            )
            for p in order[: max(0, len(here) - n)]:
                why = _why_fewer(j, host, n)
                deletes.append(DeletePod(p.job_id, p.name, p.uid, p.resource_version, why))
            keep += order[max(0, len(here) - n) :]
        if template is None:
            continue
        core = sum(p.core for p in keep)
        used = {p.ordinal for p in all_mine}
        ordinal = 0
        for host in sorted(want, key=lambda h: (-len(want[h]), h)):
            if host not in present:
                continue
            for _ in range(len(want[host]) - sum(p.host == host for p in keep)):
                while ordinal in used:
                    ordinal += 1
                used.add(ordinal)
                is_core = core < j.spec.min_workers
                core += is_core
                name = f"{pod_base(j.spec.job_id)}-{ordinal}"
                pod = job_pod(j, host, name, is_core, template, settings)
                creates.append(CreatePod(j.spec.job_id, host, name, is_core, pod))
    return [*deletes, *creates]


def _doomed(p: FleetPod, j: Job | None, settings: KubeSettings, now: float) -> str:
    """Why ``p`` goes regardless of its job's size ('' if it does not)."""
    if p.state is PodState.TERMINATING:
        return ""
    if j is None:
        return "the fleet has no such job"
    if p.submitted != submission(j):
        return "a pod of an earlier submission of the job"
    if p.state is PodState.LOST:
        return f"the kubelet ended it ({p.why}); made again where the job still holds the GPU"
    if p.state.alive:
        return ""
    if j.status.phase.final:
        if now - j.status.changed >= settings.keep_ended_s:
            return f"the job {j.status.phase.value} more than {settings.keep_ended_s:.0f} s ago"
        return ""
    if j.status.phase is Phase.RUNNING:
        return ""  # its ending is this pod's to tell (endings): kept until it is written
    return f"ended, and the job is {j.status.phase.value}"


def _why_fewer(j: Job, host: str, n: int) -> str:
    st = j.status
    if st.phase.final:
        return f"the job {st.phase.value}"
    if st.phase is not Phase.RUNNING:
        return f"the job is {st.phase.value} ({st.reason})"
    return f"the job holds {n} GPU(s) on {host} now ({st.reason})"


# ---------------------------------------------------------------- a pod


def _escaped(text: str) -> str:
    """``text`` as Kubernetes passes it on: ``$(NAME)`` in a command or an environment value
    is expanded, and ``$$`` is a ``$``."""
    return text.replace("$", "$$")


def agent_command(job: Job) -> list[str]:
    """efdl-run's command line in a job's pod: one agent, one worker on the pod's one GPU;
    etcd's endpoints and credentials come from the template's ``EFDL_ETCD*`` variables. The
    job's command follows ``--`` (nothing in it is one of efdl-run's options)."""
    spec = job.spec
    flags, command = split_command(spec.job_id, spec.argv)
    out = [
        "efdl-run",
        "--job-id", spec.job_id,
        "--node-id", "$(POD_NAME)",
        "--host", "$(POD_IP)",
        "--min", str(spec.min_workers),
        "--max", str(spec.max_workers),
        "--nproc-per-node", "1",
    ]  # fmt: skip
    if spec.cache_url:
        out += ["--cache-url", _escaped(spec.cache_url)]
    return [*out, *flags, "--", *(_escaped(a) for a in command)]


def _template_only(name: str) -> bool:
    """Whether the job's environment may not set ``name``: how its agent reaches etcd and its
    credentials are the template's (as a host daemon's flags override a job's
    ``EFDL_ETCD*``), and the pod's own name and address are the controller's."""
    return daemon_only(name) or name in ("POD_NAME", "POD_IP")


def job_pod(
    job: Job, host: str, name: str, core: bool, template: Any, settings: KubeSettings
) -> Any:
    """A pod of ``job`` on ``host`` (a ``V1Pod``), made from ``template`` (a
    ``V1PodTemplate``): its container ``efdl`` (else its first) runs :func:`agent_command`
    in the job's working directory with the job's environment (less :func:`_template_only`),
    on one GPU; the pod is pinned
    to ``host``, of the core or growth priority class, and never restarted."""
    from kubernetes import client as k

    spec = job.spec
    body = copy.deepcopy(template.template) if template.template else k.V1PodTemplateSpec()
    meta = body.metadata or k.V1ObjectMeta()
    pod_spec = body.spec or k.V1PodSpec(containers=[k.V1Container(name=CONTAINER)])
    labels = {**(meta.labels or {}), **settings.selector, JOB_LABEL: label_value(spec.job_id)}
    notes = {
        **(meta.annotations or {}),
        JOB_NOTE: spec.job_id,
        HOST_NOTE: host,
        SUBMITTED_NOTE: submission(job),
    }
    containers = pod_spec.containers or [k.V1Container(name=CONTAINER)]
    c = next((c for c in containers if c.name == CONTAINER), containers[0])
    c.command = agent_command(job)
    c.args = None
    c.working_dir = spec.workdir
    env = [e for e in c.env or () if e.name not in ("POD_NAME", "POD_IP")]
    env += [
        k.V1EnvVar(
            name="POD_NAME",
            value_from=k.V1EnvVarSource(
                field_ref=k.V1ObjectFieldSelector(field_path="metadata.name")
            ),
        ),
        k.V1EnvVar(
            name="POD_IP",
            value_from=k.V1EnvVarSource(
                field_ref=k.V1ObjectFieldSelector(field_path="status.podIP")
            ),
        ),
    ]
    job_env = [(n, v) for n, v in spec.env if not _template_only(n)]
    names = {n for n, _ in job_env}
    c.env = [e for e in env if e.name not in names]
    c.env += [k.V1EnvVar(name=n, value=_escaped(v)) for n, v in job_env]
    res = c.resources or k.V1ResourceRequirements()
    res.limits = {**(res.limits or {}), settings.gpu_resource: "1"}
    if res.requests and settings.gpu_resource in res.requests:
        res.requests = {**res.requests, settings.gpu_resource: "1"}
    c.resources = res
    pod_spec.containers = containers
    pod_spec.restart_policy = "Never"
    pod_spec.priority_class_name = settings.core_class if core else settings.growth_class
    pod_spec.priority = None
    pod_spec.preemption_policy = None  # the class's: Never
    pod_spec.node_name = None
    pod_spec.affinity = _pinned(pod_spec.affinity, host)
    return k.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k.V1ObjectMeta(
            name=name, namespace=settings.namespace, labels=labels, annotations=notes
        ),
        spec=pod_spec,
    )


def _pinned(affinity: Any, host: str) -> Any:
    """``affinity`` with its node affinity replaced: the node named ``host`` (by its name, as
    the DaemonSet controller pins its pods: a node's hostname label may differ)."""
    from kubernetes import client as k

    term = k.V1NodeSelectorTerm(
        match_fields=[
            k.V1NodeSelectorRequirement(key="metadata.name", operator="In", values=[host])
        ]
    )
    out = affinity or k.V1Affinity()
    out.node_affinity = k.V1NodeAffinity(
        required_during_scheduling_ignored_during_execution=k.V1NodeSelector(
            node_selector_terms=[term]
        )
    )
    return out

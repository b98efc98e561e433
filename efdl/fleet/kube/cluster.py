"""The fleet's controller on Kubernetes, its pure part: the cluster read as the allocator's
records (efdl.fleet.kube.pods turns the allocator's statuses into pods). No I/O
(efdl.fleet.kube.controller reads the API server and etcd).

- **Pods read** (:func:`fleet_pod`): a pod the controller made carries its job, its node and
  its job's submission in annotations; its state (:class:`PodState`) says whether it holds a
  GPU, is leaving, ended by itself (exit 0 or not), or was ended by the kubelet.
- **Hosts** (:func:`cluster_hosts`): each Ready GPU node is a host whose GPUs are slots
  ``0..allocatable-1`` (the device plugin, not efdl, picks the physical GPU). As many slots as
  pods that are not this fleet's hold (inference), or are nominated to take, are marked
  ``foreign``: first slots no job holds, then slots a job holds but has no pod on any more
  (inference preempted it), then the lowest-priority job's (and, before all of them, the
  slots of pods stuck there: below). A cordoned node takes nothing new: its slots that no
  pod of a job holds are foreign too (a drain's evictions take a job's GPUs there, and the
  allocator places it elsewhere).
- **Stuck pods** (:func:`hold_out`): a job's pod that the kube-scheduler finds no room for on
  its node (CPU, memory, a taint) for ``stuck_s`` gives its GPU up there, and the node is
  held out for ``hold_out_s`` on as many GPUs (foreign), so that the allocator places the job
  elsewhere and not there again at once.
- **Endings** (:func:`endings`): a pod of a running job that ended by itself ends the job, as
  an agent does on a host: exit 0 finished, else failed (the status names the pod). A pod the
  kubelet ended for its own reasons (evicted, out of GPUs at admission, its node lost) does
  not: it is deleted and made again.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from efdl import __version__
from efdl.fleet.allocate import Job
from efdl.fleet.records import FleetGpu, Host, JobStatus, Phase
from efdl.rendezvous.records import HOST_RE, ID_RE

MANAGED_BY = "app.kubernetes.io/managed-by"
CONTROLLER = "efdl-fleet"
FLEET_LABEL = "efdl.dev/fleet"
JOB_LABEL = "efdl.dev/job"
# Annotations: the exact values (a label is 63 characters at most).
JOB_NOTE = "efdl.dev/job-id"
HOST_NOTE = "efdl.dev/host"
SUBMITTED_NOTE = "efdl.dev/submitted"  # the job's submission: a resubmitted job's pods are new
CONTAINER = "efdl"
# Why a kubelet ends a pod that is not the job's doing (PodStatus.reason).
_KUBELET_REASONS = frozenset(
    {"Evicted", "NodeLost", "Shutdown", "Terminated", "NodeShutdown", "UnexpectedAdmissionError"}
)
_LABEL_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")


@dataclass(frozen=True, slots=True)
class KubeSettings:
    """How the controller maps the fleet onto a cluster.

    Attributes:
        namespace: where the jobs' pods and their template live.
        fleet: the fleet's name (its records: ``/efdl-fleet/<fleet>/``).
        gpu_resource: the device plugin's extended resource.
        pod_template: the ``PodTemplate`` the jobs' pods are made from (image, the etcd
            settings as ``EFDL_ETCD*`` variables, volumes, grace period).
        core_class / growth_class: the priority classes of a job's first ``min`` pods and of
            the others (both ``preemptionPolicy: Never``; growth below core).
        keep_ended_s: how long the pods of an ended job are kept, ended (``kubectl logs``).
        stuck_s: how long a job's pod may find no room on its node (CPU, memory, a taint)
            before its GPU is given up there.
        hold_out_s: how long a node where a pod was stuck is given no new job's pod on as
            many GPUs (so that the allocator does not place it there again at once).
    """

    namespace: str = "efdl"
    fleet: str = "default"
    gpu_resource: str = "nvidia.com/gpu"
    pod_template: str = "efdl-fleet-job"
    core_class: str = "efdl-fleet-core"
    growth_class: str = "efdl-fleet-growth"
    keep_ended_s: float = 3600.0
    stuck_s: float = 120.0
    hold_out_s: float = 600.0

    @property
    def selector(self) -> dict[str, str]:
        """The labels of every pod of this fleet's jobs."""
        return {MANAGED_BY: CONTROLLER, FLEET_LABEL: label_value(self.fleet)}


def label_value(text: str) -> str:
    """``text`` as a label value: itself where it is one, else a digest of it."""
    if _LABEL_RE.match(text):
        return text
    return "h-" + hashlib.sha256(text.encode()).hexdigest()[:20]


def _dns_part(text: str) -> str:
    """A lower-case DNS label's worth of ``text`` (at most 40 characters)."""
    part = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40].strip("-")
    return part or "job"


def pod_base(job_id: str) -> str:
    """The prefix of a job's pod names: readable, and distinct for ids that read alike."""
    return f"{_dns_part(job_id)}-{hashlib.sha256(job_id.encode()).hexdigest()[:6]}"


# ---------------------------------------------------------------- the pods read


class PodState(StrEnum):
    PENDING = "pending"  # not running yet (unscheduled, or starting): holds its slot
    RUNNING = "running"
    TERMINATING = "terminating"  # deleted, leaving within its grace period
    SUCCEEDED = "succeeded"  # ended by itself, exit 0
    FAILED = "failed"  # ended by itself, with an error
    LOST = "lost"  # ended by the kubelet (evicted, node lost...): not the job's doing

    @property
    def alive(self) -> bool:
        return self in (PodState.PENDING, PodState.RUNNING)


@dataclass(frozen=True, slots=True)
class FleetPod:
    """One pod of a fleet job, as read.

    Attributes:
        name / uid / resource_version: the object (a delete names the version it read).
        job_id / host / submitted: its job, the node it is pinned to, its job's submission.
        core: of the core priority class (a job's first ``min`` pods).
        state: where it stands (:class:`PodState`).
        ordinal: the number that ends its name.
        why: how it ended (an exit code and reason), when it did; why it is not scheduled,
            while it is not.
        unschedulable_since: wall-clock seconds since the kube-scheduler found no room for
            it on its node (None: it did not, or it is bound).
    """

    name: str
    uid: str
    resource_version: str
    job_id: str
    host: str
    submitted: str
    core: bool
    state: PodState
    ordinal: int
    why: str = ""
    unschedulable_since: float | None = None

    def stuck(self, now: float, after_s: float) -> bool:
        """Pending, and found no room on its node for ``after_s`` or longer."""
        since = self.unschedulable_since
        return self.state is PodState.PENDING and since is not None and now - since >= after_s


def fleet_pod(pod: Any, settings: KubeSettings) -> FleetPod | None:
    """``pod`` (a ``V1Pod`` labelled as this fleet's) read, or None where it does not carry
    the controller's annotations (not made by it)."""
    meta = pod.metadata
    notes = meta.annotations or {}
    job_id, host = notes.get(JOB_NOTE, ""), notes.get(HOST_NOTE, "")
    if not job_id or not host:
        return None
    tail = meta.name.rsplit("-", 1)[-1]
    status = pod.status
    phase = (status.phase if status else None) or "Pending"
    why = ""
    if meta.deletion_timestamp is not None:
        state = PodState.TERMINATING
    elif phase in ("Succeeded", "Failed") and status.reason in _KUBELET_REASONS:
        state, why = PodState.LOST, f"{status.reason}: {status.message or ''}".rstrip(": ")
    elif phase == "Succeeded":
        state, why = PodState.SUCCEEDED, "exit 0"
    elif phase == "Failed":
        state, why = PodState.FAILED, _exit(status) or (status.reason or "failed")
    elif phase == "Unknown":
        state = PodState.LOST
    else:
        state = PodState.RUNNING if phase == "Running" else PodState.PENDING
    since = None
    for cond in (status.conditions if status else None) or ():
        if (
            cond.type == "PodScheduled"
            and cond.status == "False"
            and cond.reason == "Unschedulable"
        ):
            when = cond.last_transition_time
            since = when.timestamp() if when is not None else None
            why = why or (cond.message or "Unschedulable")
    return FleetPod(
        name=meta.name,
        uid=meta.uid or "",
        resource_version=meta.resource_version or "",
        job_id=job_id,
        host=host,
        submitted=notes.get(SUBMITTED_NOTE, ""),
        core=(pod.spec.priority_class_name == settings.core_class),
        state=state,
        ordinal=int(tail) if tail.isdigit() else 0,
        why=why,
        unschedulable_since=since if state is PodState.PENDING else None,
    )


def _exit(status: Any) -> str:
    for c in status.container_statuses or ():
        term = c.state.terminated if c.state else None
        if c.name == CONTAINER and term is not None:
            text = f"exit code {term.exit_code}"
            return f"{text} ({term.reason})" if term.reason else text
    return ""


# ---------------------------------------------------------------- hosts


def gpus_of(pod: Any, resource: str) -> int:
    """The GPUs ``pod`` holds: its containers' together, or its largest init container's."""

    def one(c: Any) -> int:
        res = c.resources
        if res is None:
            return 0
        value = (res.limits or {}).get(resource) or (res.requests or {}).get(resource) or 0
        try:
            return int(float(str(value)))
        except ValueError:
            return 0

    spec = pod.spec
    main = sum(one(c) for c in spec.containers or ())
    init = max((one(c) for c in spec.init_containers or ()), default=0)
    return max(main, init)


def _ready(node: Any) -> bool:
    conditions = node.status.conditions if node.status else None
    return any(c.type == "Ready" and c.status == "True" for c in conditions or ())


def _address(node: Any) -> str:
    for a in (node.status.addresses if node.status else None) or ():
        if a.type == "InternalIP" and HOST_RE.match(a.address):
            return str(a.address)
    return str(node.metadata.name)


def cluster_hosts(
    nodes: Sequence[Any],
    pods: Sequence[FleetPod],
    others: Sequence[Any],
    jobs: Sequence[Job],
    resource: str,
    held_out: Mapping[str, HeldOut] | None = None,
) -> tuple[list[Host], list[str]]:
    """The fleet's hosts: each Ready node with GPUs (``resource``), its slots marked
    ``foreign`` as this module's docstring says; and a sentence per node left out (a name
    that is no host id).

    Args:
        nodes: every node (``V1Node``).
        pods: the fleet's pods (:func:`fleet_pod`).
        others: every pod that is not the fleet's and not ended (``V1Pod``).
        jobs: the fleet's jobs as etcd holds them now.
        resource: the GPUs' extended resource.
        held_out: nodes where a job's pod found no room (:func:`hold_out`): as many of
            their GPUs are foreign too, and a pod stuck there holds no slot.
    """
    held_out = held_out or {}
    foreign = {host: h.gpus for host, h in held_out.items()}
    stuck = {name for h in held_out.values() for name in h.pods}
    for p in others:
        node = p.spec.node_name or (p.status.nominated_node_name if p.status else None)
        if node:
            foreign[node] = foreign.get(node, 0) + gpus_of(p, resource)
    alive: dict[tuple[str, str], int] = {}
    stuck_of: dict[tuple[str, str], int] = {}
    for fp in pods:
        if fp.state.alive:
            into = stuck_of if fp.name in stuck else alive
            into[(fp.job_id, fp.host)] = into.get((fp.job_id, fp.host), 0) + 1
    on_host: dict[str, list[Job]] = {}  # the running jobs on each host
    for j in jobs:
        if j.status.phase is Phase.RUNNING:
            for h, _ in j.status.gpus:
                on_host.setdefault(h, []).append(j)
    hosts: list[Host] = []
    problems: list[str] = []
    for node in sorted(nodes, key=lambda n: n.metadata.name):
        name = node.metadata.name
        count = gpus_of_node(node, resource)
        if count == 0 or not _ready(node):
            continue
        if not ID_RE.match(name) or ".." in name:
            problems.append(f"Node {name[:64]!r}: its name is not a host id; left out.")
            continue
        here = on_host.get(name, [])
        taken = _foreign_slots(name, count, foreign.get(name, 0), alive, stuck_of, here)
        if node.spec is not None and node.spec.unschedulable:  # cordoned: nothing new
            taken |= set(range(count)) - _kept_slots(name, alive, here)
        gpus = tuple(FleetGpu(i, "", i in taken) for i in range(count))
        hosts.append(Host(name, _address(node), gpus, __version__))
    return hosts, problems


@dataclass(frozen=True, slots=True)
class HeldOut:
    """A node where a job's pods found no room: ``gpus`` of its GPUs are given no job's pod
    until ``until`` (wall-clock seconds); ``pods``: the pods stuck there now."""

    gpus: int
    until: float
    pods: frozenset[str] = frozenset()
    why: str = ""


def hold_out(
    before: Mapping[str, HeldOut], pods: Sequence[FleetPod], now: float, settings: KubeSettings
) -> dict[str, HeldOut]:
    """The nodes held out now: where a pod has been unschedulable for ``settings.stuck_s``
    (held out ``settings.hold_out_s`` from now, for as many GPUs as pods stuck there, or as
    were before), and those held out ``before`` whose time has not run out."""
    stuck: dict[str, list[FleetPod]] = {}
    for p in pods:
        if p.stuck(now, settings.stuck_s):
            stuck.setdefault(p.host, []).append(p)
    out = {
        h: HeldOut(v.gpus, v.until, frozenset(), v.why) for h, v in before.items() if v.until > now
    }
    for host, mine in stuck.items():
        old = out.get(host)
        out[host] = HeldOut(
            max(len(mine), old.gpus if old else 0),
            now + settings.hold_out_s,
            frozenset(p.name for p in mine),
            mine[0].why,
        )
    return out


def gpus_of_node(node: Any, resource: str) -> int:
    value = ((node.status.allocatable if node.status else None) or {}).get(resource, 0)
    try:
        return max(0, int(float(str(value))))
    except ValueError:
        return 0


def _kept_slots(host: str, alive: Mapping[tuple[str, str], int], jobs: Sequence[Job]) -> set[int]:
    """The slots of ``host`` that a running job holds and still has a pod on (as many of its
    slots there as it has pods alive)."""
    kept: set[int] = set()
    for j in jobs:
        if j.status.phase is Phase.RUNNING:
            mine = sorted(i for h, ix in j.status.gpus if h == host for i in ix)
            kept.update(mine[: alive.get((j.spec.job_id, host), 0)])
    return kept


def _foreign_slots(
    host: str,
    count: int,
    k: int,
    alive: Mapping[tuple[str, str], int],
    stuck: Mapping[tuple[str, str], int],
    jobs: Sequence[Job],
) -> set[int]:
    """Which ``k`` of ``host``'s slots the pods that are not the fleet's hold, or are held out:
    first the slots of a job's pods stuck there, then slots no job holds, then slots a job
    holds without a pod (inference preempted it), then the lowest-priority job's."""
    held: dict[str, list[int]] = {}
    taken: set[int] = set()
    for j in sorted(jobs, key=lambda j: j.spec.job_id):
        if j.status.phase is Phase.RUNNING:
            mine = sorted((i for h, ix in j.status.gpus if h == host for i in ix if i < count),
                          reverse=True)  # fmt: skip
            if mine:
                held[j.spec.job_id] = mine
                taken.update(mine)
    by_id = {j.spec.job_id: j for j in jobs}
    first: list[int] = []
    missing: list[int] = []
    rest: list[tuple[int, float, int]] = []
    for job_id, mine in held.items():
        n_stuck = min(len(mine), stuck.get((job_id, host), 0))
        n_missing = max(0, len(mine) - alive.get((job_id, host), 0) - n_stuck)
        first += mine[:n_stuck]
        missing += mine[n_stuck : n_stuck + n_missing]
        spec = by_id[job_id].spec
        rest += [(spec.priority, -spec.submitted, i) for i in mine[n_stuck + n_missing :]]
    free = [i for i in range(count - 1, -1, -1) if i not in taken]
    order = first + free + missing
    order += [i for _, _, i in sorted(rest, key=lambda r: (r[0], r[1], -r[2]))]
    return set(order[:k])


# ---------------------------------------------------------------- endings


def endings(jobs: Sequence[Job], pods: Sequence[FleetPod], now: float) -> dict[str, JobStatus]:
    """The running jobs that a pod of theirs ended (by itself, not the kubelet): failed if
    one failed, else finished."""
    out: dict[str, JobStatus] = {}
    ended = pods_by_job(p for p in pods if p.state in (PodState.SUCCEEDED, PodState.FAILED))
    for j in jobs:
        if j.status.phase is not Phase.RUNNING:
            continue
        mine = sorted(
            (p for p in ended.get(j.spec.job_id, ()) if p.submitted == submission(j)),
            key=lambda p: (p.state is not PodState.FAILED, p.name),
        )
        if not mine:
            continue
        p = mine[0]
        if p.state is PodState.FAILED:
            out[j.spec.job_id] = JobStatus(
                Phase.FAILED, (), now, f"its pod {p.name} on {p.host} ended: {p.why} "
                f"(kubectl logs {p.name})"
            )  # fmt: skip
        else:
            out[j.spec.job_id] = JobStatus(
                Phase.FINISHED, (), now, f"its pod {p.name} on {p.host} finished (exit 0)"
            )
    return out


def submission(job: Job) -> str:
    """What a job's pods carry of its submission (a job id submitted again is a new job)."""
    return repr(job.spec.submitted)


def pods_by_job(pods: Iterable[FleetPod]) -> dict[str, list[FleetPod]]:
    """``pods`` by their job's id."""
    out: dict[str, list[FleetPod]] = {}
    for p in pods:
        out.setdefault(p.job_id, []).append(p)
    return out

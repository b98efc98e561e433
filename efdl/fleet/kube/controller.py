"""The fleet's controller on Kubernetes (``efdl kube-controller``): elected as the fleet's
allocator is (the same election, efdl.rendezvous.election), and while leading, once per
interval, one :meth:`KubeController.tick`:

1. read the cluster: the nodes, the fleet's pods, every pod that holds GPUs, the jobs' pod
   template (a read that fails skips the tick: a decision from half a cluster could place a
   job on inference's GPUs);
2. publish each GPU node as the fleet's host record (efdl.fleet.kube.cluster.cluster_hosts),
   bound to the controller's lease, only where it changed; a node where a job's pod found no
   room is held out a while (efdl.fleet.kube.cluster.hold_out: kept in this controller's
   memory; a new leader learns it again);
3. end the jobs whose pods ended by themselves (their statuses, with compare-and-swap);
4. decide: the fleet's allocator (efdl.fleet.leader.Allocator.decide: ``allocate()`` on the
   records, written with compare-and-swap while this controller leads);
5. make the pods match the statuses (efdl.fleet.kube.pods.plan): deletes, then creates.

Every write is one that changes something: a tick on a cluster and fleet that already match
writes nothing, to etcd or to the API server. A write that fails (a pod that changed since it
was read, the API server away) is logged naming the object and left to the next tick, which
reads everything again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from efdl.fleet.kube.api import KubeApi, KubeConflict, KubeError, KubeNotFound
from efdl.fleet.kube.cluster import (
    MANAGED_BY,
    FleetPod,
    HeldOut,
    KubeSettings,
    cluster_hosts,
    endings,
    fleet_pod,
    hold_out,
)
from efdl.fleet.kube.pods import Action, CreatePod, DeletePod, plan
from efdl.fleet.leader import Allocator, stand
from efdl.fleet.policy import FleetPolicy
from efdl.fleet.records import FleetKeys, Host
from efdl.fleet.registry import FleetView, read_fleet, status_writes
from efdl.rendezvous.api import Compare, Delete, KVStore, Op, Put
from efdl.rendezvous.election import Election

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClusterRead:
    """The cluster as one tick read it.

    Attributes:
        nodes: every node (``V1Node``).
        pods: the fleet's pods, read.
        others: every pod not of the fleet that has not ended (``V1Pod``).
        template: the jobs' ``V1PodTemplate`` (None: there is none; no pod is made).
    """

    nodes: tuple[Any, ...]
    pods: tuple[FleetPod, ...]
    others: tuple[Any, ...]
    template: Any


@dataclass(slots=True)
class TickReport:
    """What one tick did (logged; the tests read it).

    Attributes:
        leading: this controller still leads.
        decided: the tick read the cluster and decided (False: a read failed; nothing done).
        etcd_writes: host records and job endings written (the decision's are the
            allocator's).
        actions: the pods to create and delete that the tick found.
        applied: how many of them the API server took.
        errors: a sentence per call that failed.
    """

    leading: bool = True
    decided: bool = False
    etcd_writes: int = 0
    actions: list[Action] = field(default_factory=list)
    applied: int = 0
    errors: list[str] = field(default_factory=list)


def read_cluster(api: KubeApi, settings: KubeSettings) -> ClusterRead:
    """Read the cluster for one tick (four calls).

    Raises:
        KubeError: a call failed (not a missing template: that is ``template=None``).
    """
    nodes = api.list_nodes()
    mine = api.list_pods(settings.namespace, settings.selector)
    active = api.list_pods(None, active=True)
    try:
        template = api.read_pod_template(settings.namespace, settings.pod_template)
    except KubeNotFound:
        template = None
    pods = tuple(p for p in (fleet_pod(raw, settings) for raw in mine) if p is not None)
    others = tuple(p for p in active if not _ours(p, settings))
    return ClusterRead(tuple(nodes), pods, others, template)


def _ours(pod: Any, settings: KubeSettings) -> bool:
    labels = pod.metadata.labels or {}
    return all(labels.get(k) == v for k, v in settings.selector.items()) and MANAGED_BY in labels


class KubeController:
    """One candidate for the fleet's controller; :meth:`run` until ``stop`` is set.

    Args:
        store: the fleet's etcd.
        keys: the fleet.
        api: the API server.
        settings: how the fleet maps onto the cluster.
        candidate_id: this candidate's id (its pod's name), unique in the fleet.
        lease: the candidate's lease: its election key and the host records go with it.
        policy: the allocator's settings.
        interval_s: one tick per interval while leading.
        clock: wall-clock seconds (the records' times).
    """

    def __init__(
        self,
        store: KVStore,
        keys: FleetKeys,
        api: KubeApi,
        settings: KubeSettings,
        candidate_id: str,
        lease: int,
        policy: FleetPolicy | None = None,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._keys = keys
        self._api = api
        self._settings = settings
        self._key = keys.leader + candidate_id
        self._lease = lease
        self._interval_s = interval_s
        self._clock = clock
        self._election = Election(store, keys.leader, f"Fleet {keys.fleet}")
        self._allocator = Allocator(store, keys, candidate_id, lease, policy, clock=clock)
        self._mine: set[str] = set()  # the host records put under this lease
        self._held_out: dict[str, HeldOut] = {}  # nodes where a pod found no room
        self._warned: set[str] = set()  # what the last tick warned of (said once)
        self.leading = threading.Event()

    # ---------------------------------------------------------------- the election

    def run(self, stop: threading.Event) -> None:
        """Stand for election, and tick once per interval while leading, until ``stop``
        (efdl.fleet.leader.stand)."""
        stand(self._election, self._key, self._lease, stop, self._lead, self.leading)

    def _lead(self, leading: Compare, stop: threading.Event) -> None:
        log.info("Fleet %s: %s leads the controller.", self._keys.fleet, self._key)
        self.leading.set()
        while not stop.is_set():
            started = time.monotonic()
            if not self.tick(leading).leading:
                return
            stop.wait(max(0.0, started + self._interval_s - time.monotonic()))

    # ---------------------------------------------------------------- one tick

    def tick(self, leading: Compare) -> TickReport:
        """Read, decide and act once (this module's docstring), while ``leading`` holds.

        Raises:
            StoreError: etcd failed.
        """
        report = TickReport()
        try:
            cluster = read_cluster(self._api, self._settings)
        except KubeError as exc:
            log.warning("Fleet %s: %s; not deciding this time.", self._keys.fleet, exc)
            report.errors.append(str(exc))
            return report
        warnings = [] if cluster.template is not None else [
            f"pod template {self._settings.namespace}/{self._settings.pod_template} not "
            "found: no job's pod can be made until it exists (deploy/kubernetes/fleet.yaml)."
        ]  # fmt: skip
        view = read_fleet(self._store, self._keys)
        self._hold_out(cluster.pods)
        hosts, problems = cluster_hosts(
            cluster.nodes,
            cluster.pods,
            cluster.others,
            view.jobs,
            self._settings.gpu_resource,
            self._held_out,
        )
        for warning in sorted(set(warnings + problems) - self._warned):  # once, not per tick
            log.warning("Fleet %s: %s", self._keys.fleet, warning)
        self._warned = set(warnings + problems)
        if not self._publish(view.hosts, hosts, leading, report):
            report.leading = False
            return report
        self._end_jobs(view, cluster.pods, leading, report)
        if not self._allocator.decide(leading):
            report.leading = False
            return report
        report.decided = True
        after = read_fleet(self._store, self._keys)
        report.actions = plan(
            after.jobs,
            cluster.pods,
            [h.host_id for h in hosts],
            cluster.template,
            self._settings,
            self._clock(),
        )
        for action in report.actions:
            self._apply(action, report)
        return report

    def _hold_out(self, pods: Sequence[FleetPod]) -> None:
        now = self._clock()
        held = hold_out(self._held_out, pods, now, self._settings)
        for host, h in held.items():
            if h.pods and not self._held_out.get(host, HeldOut(0, 0.0)).pods >= h.pods:
                log.warning(
                    "Fleet %s: pod(s) %s found no room on node %s for %.0f s (%s); giving "
                    "their GPUs up there, and holding %d GPU(s) of it out for %.0f s.",
                    self._keys.fleet, ", ".join(sorted(h.pods)), host, self._settings.stuck_s,
                    h.why, h.gpus, self._settings.hold_out_s,
                )  # fmt: skip
        self._held_out = held

    def _publish(
        self, before: Sequence[Host], hosts: Sequence[Host], leading: Compare, report: TickReport
    ) -> bool:
        """Put the host records that changed (or that another leader put, under its lease),
        delete those of nodes gone; False if this controller no longer leads."""
        old = {h.host_id: h for h in before}
        ops: list[Op] = [
            Put(self._keys.host(h.host_id), h.to_json(), self._lease)
            for h in hosts
            if old.get(h.host_id) != h or h.host_id not in self._mine
        ]
        ops += [Delete(self._keys.host(h)) for h in sorted(set(old) - {h.host_id for h in hosts})]
        for start in range(0, len(ops), 100):
            chunk = ops[start : start + 100]
            if not self._store.txn([leading], chunk).succeeded:
                return False
            report.etcd_writes += len(chunk)
        self._mine = {h.host_id for h in hosts}
        return True

    def _end_jobs(
        self, view: FleetView, pods: Sequence[FleetPod], leading: Compare, report: TickReport
    ) -> None:
        for job_id, status in endings(view.jobs, pods, self._clock()).items():
            key = self._keys.status(job_id)
            compare = [leading, Compare.mod_revision_is(key, view.status_revisions[job_id])]
            if self._store.txn(compare, status_writes(self._keys, job_id, status)).succeeded:
                report.etcd_writes += 1
                log.info(
                    "Fleet %s: job %s %s: %s.",
                    self._keys.fleet, job_id, status.phase.value, status.reason,
                )  # fmt: skip

    def _apply(self, action: Action, report: TickReport) -> None:
        ns = self._settings.namespace
        try:
            if isinstance(action, DeletePod):
                self._api.delete_pod(ns, action.name, action.uid, action.resource_version)
                log.info(
                    "Fleet %s: job %s: deleted pod %s/%s: %s.",
                    self._keys.fleet, action.job_id, ns, action.name, action.why,
                )  # fmt: skip
            elif isinstance(action, CreatePod):
                self._api.create_pod(ns, action.pod)
                log.info(
                    "Fleet %s: job %s: created pod %s/%s on %s (%s).",
                    self._keys.fleet, action.job_id, ns, action.name, action.host,
                    "core" if action.core else "growth",
                )  # fmt: skip
            report.applied += 1
        except (KubeConflict, KubeNotFound) as exc:
            log.info("Fleet %s: %s; the next tick reads it again.", self._keys.fleet, exc)
            report.errors.append(str(exc))
        except KubeError as exc:
            log.warning("Fleet %s: %s; trying again next tick.", self._keys.fleet, exc)
            report.errors.append(str(exc))

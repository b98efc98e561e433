"""An in-memory Kubernetes API server for the fleet controller's tests, behind
efdl.fleet.kube.api.KubeApi: it stores the official client's model objects (each pod sent is
serialized and parsed back, so a misspelt field is lost as a real server would refuse it),
keeps a resourceVersion per object and refuses a stale delete (409) or a second pod of a
name, as the API server does. The kube-scheduler and the kubelet are the tests' to play:
:meth:`FakeKube.schedule` binds pending pods where their node affinity and the free GPUs
allow, :meth:`finish` ends a pod by itself, :meth:`evict`, :meth:`preempt`, :meth:`gone`.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import re
from collections.abc import Mapping
from typing import Any

from kubernetes import client as k

from efdl.fleet.kube.api import KubeConflict, KubeError, KubeNotFound

GPU = "nvidia.com/gpu"
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_RE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$")


class Response:
    """A body for ``ApiClient.deserialize``."""

    def __init__(self, doc: Any) -> None:
        self.data = json.dumps(doc)


def round_trip(obj: Any, model: str) -> Any:
    """``obj`` serialized and parsed back as ``model``: what the API server would store."""
    api = k.ApiClient()
    return api.deserialize(Response(api.sanitize_for_serialization(obj)), model)


def node(name: str, gpus: int, ready: bool = True, unschedulable: bool = False) -> Any:
    return k.V1Node(
        metadata=k.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name}),
        spec=k.V1NodeSpec(unschedulable=unschedulable or None),
        status=k.V1NodeStatus(
            allocatable={GPU: str(gpus), "cpu": "64"},
            addresses=[k.V1NodeAddress(type="InternalIP", address=f"10.0.0.{len(name)}")],
            conditions=[k.V1NodeCondition(type="Ready", status="True" if ready else "False")],
        ),
    )


def serving_pod(name: str, node_name: str, gpus: int, namespace: str = "serving") -> Any:
    """A pod that is not efdl's (inference), bound to ``node_name``, running."""
    return k.V1Pod(
        metadata=k.V1ObjectMeta(name=name, namespace=namespace),
        spec=k.V1PodSpec(
            node_name=node_name,
            priority_class_name="online-serving",
            containers=[
                k.V1Container(
                    name="serve", resources=k.V1ResourceRequirements(limits={GPU: str(gpus)})
                )
            ],
        ),
        status=k.V1PodStatus(phase="Running"),
    )


class FakeKube:
    """The API server (the KubeApi calls) and handles for the tests to act as the cluster."""

    def __init__(self) -> None:
        self.nodes: dict[str, Any] = {}
        self.pods: dict[tuple[str, str], Any] = {}
        self.templates: dict[tuple[str, str], Any] = {}
        self.calls: list[str] = []  # every call made through the KubeApi interface
        self.writes = 0  # the calls that changed something
        self.fail: dict[str, KubeError] = {}  # call name -> the error its next call raises
        self._rv = itertools.count(1)
        self._uid = itertools.count(1)

    # ------------------------------------------------------------ KubeApi

    def _enter(self, call: str) -> None:
        self.calls.append(call)
        error = self.fail.pop(call, None)
        if error is not None:
            raise error

    def list_nodes(self) -> list[Any]:
        self._enter("list_nodes")
        return [copy.deepcopy(n) for _, n in sorted(self.nodes.items())]

    def list_pods(
        self, namespace: str | None, labels: Mapping[str, str] | None = None, active: bool = False
    ) -> list[Any]:
        self._enter("list_pods")
        out = []
        for (ns, _), p in sorted(self.pods.items()):
            if namespace is not None and ns != namespace:
                continue
            have = p.metadata.labels or {}
            if labels and any(have.get(key) != v for key, v in labels.items()):
                continue
            if active and p.status.phase in ("Succeeded", "Failed"):
                continue
            out.append(copy.deepcopy(p))
        return out

    def read_pod_template(self, namespace: str, name: str) -> Any:
        self._enter("read_pod_template")
        if (namespace, name) not in self.templates:
            raise KubeNotFound(f"Kubernetes: pod template {namespace}/{name} not found.")
        return copy.deepcopy(self.templates[(namespace, name)])

    def create_pod(self, namespace: str, pod: Any) -> Any:
        self._enter("create_pod")
        stored = round_trip(pod, "V1Pod")
        name = stored.metadata.name
        assert name and len(name) <= 253 and _NAME_RE.match(name), f"pod name {name!r}"
        for key, value in (stored.metadata.labels or {}).items():
            assert _LABEL_RE.match(value), f"label {key}={value!r}"
        if (namespace, name) in self.pods:
            raise KubeConflict(f"Kubernetes: pod {namespace}/{name} already exists.")
        stored.metadata.namespace = namespace
        stored.metadata.uid = f"uid-{next(self._uid)}"
        stored.metadata.creation_timestamp = datetime.datetime.now(datetime.UTC)
        stored.status = k.V1PodStatus(phase="Pending")
        self._bump(stored)
        self.pods[(namespace, name)] = stored
        self.writes += 1
        return copy.deepcopy(stored)

    def delete_pod(self, namespace: str, name: str, uid: str, resource_version: str) -> None:
        self._enter("delete_pod")
        p = self.pods.get((namespace, name))
        if p is None:
            raise KubeNotFound(f"Kubernetes: pod {namespace}/{name} not found.")
        if p.metadata.uid != uid or p.metadata.resource_version != resource_version:
            raise KubeConflict(
                f"Kubernetes: pod {namespace}/{name} changed since it was read (409 Conflict)."
            )
        self.writes += 1
        self._terminate(p)

    # ------------------------------------------------------------ the cluster's side

    def _bump(self, obj: Any) -> None:
        obj.metadata.resource_version = str(next(self._rv))

    def _terminate(self, p: Any) -> None:
        """A graceful delete: a pod that runs on a node leaves within its grace period (its
        GPU held until :meth:`gone`); another goes at once."""
        if p.spec.node_name and p.status.phase in ("Pending", "Running"):
            p.metadata.deletion_timestamp = datetime.datetime.now(datetime.UTC)
            self._bump(p)
        else:
            del self.pods[(p.metadata.namespace, p.metadata.name)]

    def add_node(self, name: str, gpus: int, **kw: Any) -> None:
        self.nodes[name] = node(name, gpus, **kw)

    def add_pod(self, pod: Any) -> None:
        pod = copy.deepcopy(pod)
        pod.metadata.uid = f"uid-{next(self._uid)}"
        self._bump(pod)
        self.pods[(pod.metadata.namespace, pod.metadata.name)] = pod

    def pod(self, name: str, namespace: str = "efdl") -> Any:
        return self.pods[(namespace, name)]

    def free_gpus(self, node_name: str) -> int:
        """What the kube-scheduler sees free on a node: its allocatable GPUs less those of
        the pods bound to it that have not ended (leaving ones too) or are nominated to it."""
        from efdl.fleet.kube.cluster import gpus_of, gpus_of_node

        used = sum(
            gpus_of(p, GPU)
            for p in self.pods.values()
            if (p.spec.node_name or p.status.nominated_node_name) == node_name
            and p.status.phase in ("Pending", "Running")
        )
        return gpus_of_node(self.nodes[node_name], GPU) - used

    def schedule(self) -> list[str]:
        """Bind each pending pod to the node its affinity names where a GPU is free (no
        preemption: the fleet's classes preempt nothing), and start it; the names bound."""
        bound = []
        for p in sorted(self.pods.values(), key=lambda p: p.metadata.name):
            if p.spec.node_name or p.status.phase != "Pending":
                continue
            na = p.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
            (term,) = na.node_selector_terms
            (req,) = term.match_fields
            assert req.key == "metadata.name" and req.operator == "In"
            (target,) = req.values
            there = self.nodes.get(target)
            if there is not None and not there.spec.unschedulable and self.free_gpus(target) >= 1:
                p.spec.node_name = target
                p.status.phase = "Running"
                self._bump(p)
                bound.append(p.metadata.name)
        return bound

    def finish(self, name: str, exit_code: int, namespace: str = "efdl") -> None:
        """The pod's container ended by itself with ``exit_code``."""
        p = self.pod(name, namespace)
        p.status.phase = "Succeeded" if exit_code == 0 else "Failed"
        p.status.container_statuses = [
            k.V1ContainerStatus(
                name="efdl",
                image="x",
                image_id="x",
                ready=False,
                restart_count=0,
                state=k.V1ContainerState(
                    terminated=k.V1ContainerStateTerminated(
                        exit_code=exit_code, reason="Completed" if exit_code == 0 else "Error"
                    )
                ),
            )
        ]
        self._bump(p)

    def unschedulable(self, name: str, since: float, message: str, namespace: str = "efdl") -> None:
        """The kube-scheduler found no room for the pending pod since ``since`` (seconds)."""
        p = self.pod(name, namespace)
        assert p.status.phase == "Pending" and not p.spec.node_name
        p.status.conditions = [
            k.V1PodCondition(
                type="PodScheduled",
                status="False",
                reason="Unschedulable",
                message=message,
                last_transition_time=datetime.datetime.fromtimestamp(since, datetime.UTC),
            )
        ]
        self._bump(p)

    def evict(self, name: str, namespace: str = "efdl") -> None:
        """The kubelet evicted the pod (node pressure): Failed, reason Evicted."""
        p = self.pod(name, namespace)
        p.status.phase, p.status.reason, p.status.message = "Failed", "Evicted", "low memory"
        self._bump(p)

    def drain(self, node_name: str) -> None:
        """``kubectl drain``: the node cordoned, its pods evicted (deleted gracefully)."""
        self.nodes[node_name].spec = k.V1NodeSpec(unschedulable=True)
        for p in self.pods.values():
            if p.spec.node_name == node_name and p.metadata.deletion_timestamp is None:
                p.metadata.deletion_timestamp = datetime.datetime.now(datetime.UTC)
                self._bump(p)

    def preempt(self, name: str, by: Any, namespace: str = "efdl") -> None:
        """The kube-scheduler preempted the pod for ``by`` (a pending pod, nominated to the
        victim's node until the victim is gone)."""
        p = self.pod(name, namespace)
        p.metadata.deletion_timestamp = datetime.datetime.now(datetime.UTC)
        self._bump(p)
        by = copy.deepcopy(by)
        by.status = k.V1PodStatus(phase="Pending", nominated_node_name=by.spec.node_name)
        by.spec.node_name = None
        self.add_pod(by)

    def gone(self) -> list[str]:
        """Every leaving pod is gone (its grace period over), and a pod nominated to a node
        is bound there; the names that went."""
        went = [
            name for (ns, name), p in self.pods.items() if p.metadata.deletion_timestamp is not None
        ]
        self.pods = {
            key: p for key, p in self.pods.items() if p.metadata.deletion_timestamp is None
        }
        for p in self.pods.values():
            if p.status.nominated_node_name and not p.spec.node_name:
                p.spec.node_name, p.status.nominated_node_name = p.status.nominated_node_name, None
                p.status.phase = "Running"
                self._bump(p)
        return sorted(went)

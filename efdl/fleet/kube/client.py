"""The fleet controller's calls (efdl.fleet.kube.api.KubeApi) on the official ``kubernetes``
client: every call with a timeout (``_request_timeout``), every failure a
:class:`~efdl.fleet.kube.api.KubeError` that names the call and the object.

The RBAC the calls need is :data:`RBAC`; deploy/kubernetes/fleet.yaml grants it, and
tests/unit/test_kubernetes_manifests.py checks that it does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from efdl.fleet.kube.api import KubeConflict, KubeError, KubeNotFound

T = TypeVar("T")

# (API group, resource, verb, cluster-wide): what the controller asks of RBAC.
RBAC: tuple[tuple[str, str, str, bool], ...] = (
    ("", "nodes", "list", True),  # the GPU nodes and their allocatable GPUs
    ("", "pods", "list", True),  # every namespace's pods that hold GPUs (inference)
    ("", "pods", "create", False),  # the jobs' pods, in the controller's namespace
    ("", "pods", "delete", False),
    ("", "podtemplates", "get", False),  # the jobs' pod template
)


class ClientApi:
    """:class:`~efdl.fleet.kube.api.KubeApi` on ``kubernetes.client.CoreV1Api``.

    Args:
        core: the client (None: from the pod's service account, else ``~/.kube/config``,
            with no retries of its own: the controller's next tick is its retry).
        timeout_s: the most any one call may take to connect, and to read (a client with
            retries takes it once per try).
    """

    def __init__(self, core: Any = None, timeout_s: float = 10.0) -> None:
        if core is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                try:
                    config.load_kube_config()
                except (config.ConfigException, OSError) as exc:
                    raise KubeError(
                        "Kubernetes: no API server to reach: not in a pod with a service "
                        f"account, and no kubeconfig ({exc}); run the controller as "
                        "deploy/kubernetes/fleet.yaml does, or set KUBECONFIG."
                    ) from None
            conf = client.Configuration.get_default_copy()
            conf.retries = 0  # a call takes its timeout at most; the next tick is the retry
            core = client.CoreV1Api(client.ApiClient(conf))
        self._core = core
        self._timeout_s = timeout_s

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            # (connect, read): the client ignores a float timeout (it takes an int or a pair)
            return fn(*args, _request_timeout=(self._timeout_s, self._timeout_s), **kw)
        except ApiException as exc:
            text = f"Kubernetes: {what} failed: {exc.status} {exc.reason}"
            body = (exc.body or "")[:300] if isinstance(exc.body, str) else ""
            if exc.status == 409:
                raise KubeConflict(f"{text} (changed since read, or exists already).") from exc
            if exc.status == 404:
                raise KubeNotFound(f"{text} (not found).") from exc
            if exc.status in (401, 403):
                raise KubeError(
                    f"{text}: the controller's service account may not do this; see the "
                    f"ClusterRole and Role in deploy/kubernetes/fleet.yaml. {body}"
                ) from exc
            raise KubeError(f"{text}. {body}".rstrip(". ") + ".") from exc
        except (HTTPError, OSError) as exc:
            raise KubeError(
                f"Kubernetes: {what} failed: the API server did not answer within "
                f"{self._timeout_s:g} s, or the connection failed ({exc})."
            ) from exc

    def list_nodes(self) -> list[Any]:
        return list(self._call("listing the nodes", self._core.list_node).items)

    def list_pods(
        self, namespace: str | None, labels: Mapping[str, str] | None = None, active: bool = False
    ) -> list[Any]:
        kw: dict[str, str] = {}
        if labels:
            kw["label_selector"] = ",".join(f"{key}={v}" for key, v in sorted(labels.items()))
        if active:
            kw["field_selector"] = "status.phase!=Succeeded,status.phase!=Failed"
        if namespace is None:
            found = self._call(
                "listing the pods of every namespace", self._core.list_pod_for_all_namespaces, **kw
            )
        else:
            found = self._call(
                f"listing the pods of namespace {namespace}",
                self._core.list_namespaced_pod,
                namespace,
                **kw,
            )
        return list(found.items)

    def read_pod_template(self, namespace: str, name: str) -> Any:
        return self._call(
            f"reading pod template {namespace}/{name}",
            self._core.read_namespaced_pod_template,
            name,
            namespace,
        )

    def create_pod(self, namespace: str, pod: Any) -> Any:
        return self._call(
            f"creating pod {namespace}/{pod.metadata.name}",
            self._core.create_namespaced_pod,
            namespace,
            pod,
        )

    def delete_pod(self, namespace: str, name: str, uid: str, resource_version: str) -> None:
        from kubernetes import client

        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid=uid, resource_version=resource_version)
        )
        self._call(
            f"deleting pod {namespace}/{name}",
            self._core.delete_namespaced_pod,
            name,
            namespace,
            body=options,
        )

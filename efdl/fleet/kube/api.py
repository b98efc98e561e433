"""The calls the fleet's controller makes to a Kubernetes API server: five, on the official
client's model objects (``kubernetes.client.V1Node``, ``V1Pod``, ``V1PodTemplate``).

Implementations: :class:`efdl.fleet.kube.client.ClientApi` (the official client) and, for the
tests, an in-memory API server (``tests/fakes/kube.py``). Every call either answers or raises
:class:`KubeError` with a sentence naming the object; none blocks longer than its timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from efdl.errors import EfdlError


class KubeError(EfdlError):
    """A call to the Kubernetes API failed (unreachable, refused, timed out); the message names
    the call and the object."""


class KubeConflict(KubeError):
    """The object changed since it was read (its resourceVersion or uid is not the one given),
    or one of that name exists already: read again, decide again."""


class KubeNotFound(KubeError):
    """No such object (a pod deleted meanwhile, a pod template not made yet)."""


class KubeApi(Protocol):
    """What the controller needs of the API server (docs/kubernetes.md lists the RBAC verbs)."""

    def list_nodes(self) -> list[Any]:
        """Every node (``V1Node``)."""

    def list_pods(
        self, namespace: str | None, labels: Mapping[str, str] | None = None, active: bool = False
    ) -> list[Any]:
        """The pods (``V1Pod``) of ``namespace`` (every namespace: None) that carry
        ``labels``; ``active``: only those not Succeeded or Failed."""

    def read_pod_template(self, namespace: str, name: str) -> Any:
        """The ``V1PodTemplate`` ``namespace/name``.

        Raises:
            KubeNotFound: there is none.
        """

    def create_pod(self, namespace: str, pod: Any) -> Any:
        """Create ``pod`` (a ``V1Pod``) in ``namespace``; the created pod.

        Raises:
            KubeConflict: a pod of its name exists.
        """

    def delete_pod(self, namespace: str, name: str, uid: str, resource_version: str) -> None:
        """Delete pod ``namespace/name`` gracefully (its grace period: SIGTERM, then SIGKILL),
        if it is still the object read (``uid`` and ``resource_version``).

        Raises:
            KubeConflict: it changed since it was read.
            KubeNotFound: it is gone.
        """

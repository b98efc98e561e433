"""The fleet controller's API (efdl.fleet.kube.api.KubeApi): one contract, two implementations,
the in-memory API server and the official client (efdl.fleet.kube.client.ClientApi) reaching
that server over HTTP on 127.0.0.1 (tests/fakes/kube_http.py: Kubernetes' REST paths and
JSON), so the client's URLs, selectors, bodies, status codes and timeouts are exercised.
No real API server runs here (docs/kubernetes.md)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k

from efdl.fleet.kube.api import KubeApi, KubeConflict, KubeError, KubeNotFound
from efdl.fleet.kube.client import ClientApi
from efdl.fleet.kube.cluster import KubeSettings
from efdl.fleet.kube.controller import KubeController
from efdl.fleet.policy import FleetPolicy
from efdl.fleet.records import FleetKeys, JobSpec, Phase
from efdl.fleet.registry import read_fleet, submit
from efdl.rendezvous.election import Election
from efdl.rendezvous.memory_store import MemoryStore
from tests.fakes.kube import FakeKube, serving_pod
from tests.fakes.kube_http import KubeHttp
from tests.unit.test_kube_cluster import template


def _client(url: str, timeout_s: float = 5.0) -> ClientApi:
    conf = k.Configuration()
    conf.host = url
    conf.retries = 0  # as ClientApi makes its own
    return ClientApi(k.CoreV1Api(k.ApiClient(conf)), timeout_s=timeout_s)


@pytest.fixture
def fake() -> FakeKube:
    fake = FakeKube()
    fake.add_node("gpu-1", 4)
    fake.templates[("efdl", "efdl-fleet-job")] = template()
    return fake


@pytest.fixture
def http(fake: FakeKube) -> Iterator[KubeHttp]:
    server = KubeHttp(fake)
    yield server
    server.close()


@pytest.fixture(params=["memory", "client"])
def api(request: pytest.FixtureRequest, fake: FakeKube) -> KubeApi:
    if request.param == "memory":
        return fake
    server: KubeHttp = request.getfixturevalue("http")
    return _client(server.url)


def _pod(name: str, fleet: str = "default") -> Any:
    return k.V1Pod(
        metadata=k.V1ObjectMeta(name=name, labels={"efdl.dev/fleet": fleet}),
        spec=k.V1PodSpec(containers=[k.V1Container(name="efdl", image="x")]),
    )


def test_nodes_and_the_template_are_read_as_the_clients_models(api: KubeApi) -> None:
    (node,) = api.list_nodes()
    assert isinstance(node, k.V1Node) and node.status.allocatable["nvidia.com/gpu"] == "4"
    t = api.read_pod_template("efdl", "efdl-fleet-job")
    assert isinstance(t, k.V1PodTemplate) and t.template.spec.containers[0].name == "efdl"
    with pytest.raises(KubeNotFound, match="efdl/nope"):
        api.read_pod_template("efdl", "nope")


def test_a_pod_made_is_listed_by_its_labels_and_a_second_of_its_name_is_refused(
    api: KubeApi, fake: FakeKube
) -> None:
    made = api.create_pod("efdl", _pod("a-0"))
    assert made.metadata.uid and made.metadata.resource_version
    api.create_pod("efdl", _pod("b-0", fleet="other"))
    fake.add_pod(serving_pod("llm-0", "gpu-1", 2))
    assert [p.metadata.name for p in api.list_pods("efdl", {"efdl.dev/fleet": "default"})] == [
        "a-0"
    ]
    fake.finish("b-0", 0)
    active = {p.metadata.name for p in api.list_pods(None, active=True)}
    assert active == {"a-0", "llm-0"}  # every namespace; not the ended one
    with pytest.raises(KubeConflict, match="efdl/a-0"):
        api.create_pod("efdl", _pod("a-0"))


def test_a_delete_names_the_version_it_read(api: KubeApi, fake: FakeKube) -> None:
    made = api.create_pod("efdl", _pod("a-0"))
    fake.pod("a-0").spec.node_name = "gpu-1"
    fake.pod("a-0").status.phase = "Running"
    fake.pod("a-0").metadata.resource_version = "999"  # the kubelet wrote meanwhile
    with pytest.raises(KubeConflict, match="efdl/a-0"):
        api.delete_pod("efdl", "a-0", made.metadata.uid, made.metadata.resource_version)
    api.delete_pod("efdl", "a-0", made.metadata.uid, "999")
    assert fake.pod("a-0").metadata.deletion_timestamp is not None  # leaving, gracefully
    with pytest.raises(KubeNotFound, match="efdl/b-0"):
        api.delete_pod("efdl", "b-0", "uid", "1")


def test_every_call_has_a_timeout_and_names_its_object(http: KubeHttp) -> None:
    http.delay_s = 1.0
    api = _client(http.url, timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(KubeError, match=r"listing the nodes failed: .* within 0.2 s"):
        api.list_nodes()
    assert time.monotonic() - started < 0.6
    http.delay_s = 0.0
    http.forbidden.add("POST")
    with pytest.raises(KubeError, match=r"creating pod efdl/a-0 failed: 403.*Role"):
        _client(http.url).create_pod("efdl", _pod("a-0"))


def test_the_controller_through_the_official_client(fake: FakeKube, http: KubeHttp) -> None:
    """A job submitted, placed as pods over HTTP, and a tick after that writes nothing."""
    store = MemoryStore()
    keys = FleetKeys("default")
    lease = store.grant_lease(10)
    policy = FleetPolicy(resize_interval_s=0.0)
    ctl = KubeController(store, keys, _client(http.url), KubeSettings(), "c", lease, policy)
    me = Election(store, keys.leader, "t").campaign(keys.leader + "c", b"{}", lease).candidate
    assert me is not None
    submit(store, keys, JobSpec("a", ("train.py",), "/srv", 2, 4, submitted=1.0))
    report = ctl.tick(me.guard)
    assert report.errors == [] and report.applied == 4
    assert read_fleet(store, keys).jobs[0].status.phase is Phase.RUNNING
    fake.schedule()
    posts = sum(r.startswith(("POST", "DELETE")) for r in http.requests)
    again = ctl.tick(me.guard)
    assert again.actions == [] and again.errors == []
    assert sum(r.startswith(("POST", "DELETE")) for r in http.requests) == posts
    assert any("labelSelector=" in r for r in http.requests)

"""deploy/kubernetes/: every manifest parses into the official kubernetes client's models with
nothing dropped (a misspelt or misplaced field would be), and the commands in them are ones
efdl-run accepts. No cluster runs here: docs/kubernetes.md says what was and was not run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from kubernetes.client import ApiClient

from efdl.cli import main
from efdl.cli.fleet import kube_controller
from efdl.cli.run import launch_config, run_main
from efdl.fleet.allocate import Job
from efdl.fleet.kube.client import RBAC
from efdl.fleet.kube.cluster import KubeSettings
from efdl.fleet.kube.pods import job_pod
from efdl.fleet.records import JobSpec, JobStatus, Phase

ROOT = Path(__file__).parents[2] / "deploy" / "kubernetes"
MODELS = {
    ("v1", "Service"): "V1Service",
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("scheduling.k8s.io/v1", "PriorityClass"): "V1PriorityClass",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "PodTemplate"): "V1PodTemplate",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
}
# The PyTorchJob CRD (kubeflow.org/v1) is not in the client: its fields are checked here.
ELASTIC_POLICY = {
    "rdzvBackend",
    "rdzvHost",
    "rdzvPort",
    "minReplicas",
    "maxReplicas",
    "maxRestarts",
}


class _Response:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.data = json.dumps(doc)


def _parsed(doc: dict[str, Any], model: str) -> Any:
    api = ApiClient()
    obj = api.deserialize(_Response(doc), model)
    back = api.sanitize_for_serialization(obj)
    assert back == doc, (
        f"{model} {doc.get('metadata', {}).get('name')}: fields lost or changed in parsing"
    )
    return obj


def _docs() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(ROOT.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


@pytest.mark.parametrize(("name", "doc"), _docs(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_manifest_parses(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] == "PyTorchJob":
        assert doc["apiVersion"] == "kubeflow.org/v1"
        spec = doc["spec"]
        assert set(spec) == {"elasticPolicy", "pytorchReplicaSpecs"}
        assert set(spec["elasticPolicy"]) <= ELASTIC_POLICY
        assert spec["elasticPolicy"]["rdzvBackend"] in ("etcd", "etcd-v2", "c10d")
        for replica in spec["pytorchReplicaSpecs"].values():
            assert set(replica) == {"replicas", "restartPolicy", "template"}
            _parsed(replica["template"], "V1PodTemplateSpec")
        return
    _parsed(doc, MODELS[(doc["apiVersion"], doc["kind"])])


def _efdl_run_args() -> list[list[str]]:
    commands = []
    for _, doc in _docs():
        spec = doc.get("spec", {})
        templates = [spec["template"]] if "template" in spec else []
        templates += [r["template"] for r in spec.get("pytorchReplicaSpecs", {}).values()]
        for t in templates:
            for c in t["spec"]["containers"]:
                if c.get("command", [""])[0] == "efdl-run":
                    commands.append(c["command"][1:])
    return commands


@pytest.mark.parametrize("args", _efdl_run_args())
def test_the_commands_are_efdl_runs(args: list[str]) -> None:
    """efdl-run's own parser takes every option and value (parsed, not run)."""
    pod = [a.replace("$(POD_NAME)", "resnet-0").replace("$(POD_IP)", "10.0.0.7") for a in args]
    ctx = run_main.make_context("efdl-run", pod)
    assert ctx.params["script"] == "train.py"


def test_the_statefulsets_fit_together() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _docs()}
    job = docs[("StatefulSet", "resnet")]["spec"]["template"]["spec"]
    grace = next(
        int(a.split("=")[1])
        for a in job["containers"][0]["command"]
        if a.startswith("--grace-period")
    )
    assert job["terminationGracePeriodSeconds"] > grace  # the leave finishes before SIGKILL
    classes = {n for k, n in docs if k == "PriorityClass"}
    assert job["priorityClassName"] in classes
    etcd = docs[("StatefulSet", "etcd")]["spec"]
    assert etcd["replicas"] == 3 and etcd["template"]["spec"]["priorityClassName"] in classes


def _fleet() -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (d["kind"], d["metadata"]["name"]): d
        for n, d in _docs()
        if n in ("fleet.yaml", "priority.yaml")
    }


def test_the_fleets_pods_preempt_nobody_and_growth_goes_before_core() -> None:
    docs = _fleet()
    value = {n: d["value"] for (k, n), d in docs.items() if k == "PriorityClass"}
    settings = KubeSettings()
    assert value[settings.growth_class] < value[settings.core_class] < value["online-serving"]
    assert value["online-serving"] < value["efdl-control"]
    for name in (settings.core_class, settings.growth_class):
        assert docs[("PriorityClass", name)]["preemptionPolicy"] == "Never"


def test_the_controllers_rbac_grants_what_its_calls_need_and_no_more() -> None:
    docs = _fleet()
    granted: set[tuple[str, str, str, bool]] = set()
    for kind, cluster in (("ClusterRole", True), ("Role", False)):
        for rule in docs[(kind, "efdl-fleet-controller")]["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted |= {(group, resource, verb, cluster) for verb in rule["verbs"]}
    assert granted == set(RBAC)
    deployment = docs[("Deployment", "efdl-fleet-controller")]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        binding = docs[(kind, "efdl-fleet-controller")]
        assert binding["roleRef"]["name"] == "efdl-fleet-controller"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": "efdl"}
        ]
    assert ("ServiceAccount", account) in docs


def test_the_controllers_command_is_efdls() -> None:
    pod = _fleet()[("Deployment", "efdl-fleet-controller")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][:2] == ["efdl", "kube-controller"]
    assert main.get_command(click.Context(main), "kube-controller") is kube_controller
    ctx = kube_controller.make_context("kube-controller", c["command"][2:])
    assert ctx.params["pod_template"] == "efdl-fleet-job"
    assert pod["priorityClassName"] in {n for k, n in _fleet() if k == "PriorityClass"}


def test_a_job_pod_made_from_the_template_is_one_efdl_run_agent_on_one_gpu() -> None:
    """The pod the controller makes from fleet.yaml's PodTemplate: efdl-run takes its command
    with the template's environment (etcd, its TLS files, the grace period), and its grace
    period outlasts efdl-run's."""
    doc = _fleet()[("PodTemplate", "efdl-fleet-job")]
    template = _parsed(doc, "V1PodTemplate")
    spec = JobSpec("llama-7b", ("train.py", "--lr", "3e-4"), "/srv/code", 8, 64, 10,
                   "s3://ckpt/llama-7b", submitted=1.0)  # fmt: skip
    job = Job(spec, JobStatus(Phase.RUNNING, (("gpu-1", (0,)),)))
    pod = _parsed(
        ApiClient().sanitize_for_serialization(
            job_pod(job, "gpu-1", "llama-7b-0", True, template, KubeSettings())
        ),
        "V1Pod",
    )
    (c,) = pod.spec.containers
    assert c.command[0] == "efdl-run" and c.resources.limits == {"nvidia.com/gpu": "1"}
    args = [a.replace("$(POD_NAME)", "llama-7b-0").replace("$(POD_IP)", "10.0.0.7")
            for a in c.command[1:]]  # fmt: skip
    env = {e.name: e.value for e in c.env if e.value is not None}
    cfg = launch_config(run_main.make_context("efdl-run", args).params, None, env)
    assert (cfg.job_id, cfg.min_workers, cfg.max_workers) == ("llama-7b", 8, 64)
    assert cfg.etcd == "etcd-client.efdl.svc:2379" and cfg.cache_url == "s3://ckpt/llama-7b"
    assert pod.spec.termination_grace_period_seconds > cfg.grace_period_s
    assert pod.spec.restart_policy == "Never" and pod.spec.priority_class_name == "efdl-fleet-core"

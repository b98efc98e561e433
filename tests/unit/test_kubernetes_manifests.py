"""deploy/kubernetes/: every manifest parses into the official kubernetes client's models with
nothing dropped (a misspelt or misplaced field would be), and the commands in them are ones
efdl-run accepts. No cluster runs here: docs/kubernetes.md says what was and was not run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import ApiClient

from efdl.cli import run_main

ROOT = Path(__file__).parents[2] / "deploy" / "kubernetes"
MODELS = {
    ("v1", "Service"): "V1Service",
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("scheduling.k8s.io/v1", "PriorityClass"): "V1PriorityClass",
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


def test_the_fleet_job_is_one_gpu_per_pod_at_its_max_under_the_fleets_priorities() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _docs()}
    value = {n: d["value"] for (k, n), d in docs.items() if k == "PriorityClass"}
    assert value["efdl-fleet-low"] < value["efdl-fleet-normal"] < value["efdl-fleet-high"]
    assert value["efdl-fleet-high"] < value["online-serving"] < value["efdl-control"]
    assert docs[("PriorityClass", "efdl-fleet-low")]["preemptionPolicy"] == "Never"
    job = docs[("StatefulSet", "llama-7b")]["spec"]
    pod = job["template"]["spec"]
    args = dict(a.split("=", 1) for a in pod["containers"][0]["command"][1:] if "=" in a)
    assert job["replicas"] == int(args["--max"]) and job["podManagementPolicy"] == "Parallel"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert args["--nproc-per-node"] == "1" and args["--cache-url"]
    assert pod["terminationGracePeriodSeconds"] > int(args["--grace-period"])
    assert pod["priorityClassName"] in value

"""The PET_* contract of Kubeflow's PyTorchJob, variable by variable."""

from __future__ import annotations

import pytest

from efdl.errors import ConfigError
from efdl.kubeflow import PET, pet_params

UNSET: dict[str, object] = {name: None for name in PET.values()}


@pytest.mark.parametrize(
    ("var", "value", "param"),
    [
        ("PET_NNODES", "2:8", "nnodes"),
        ("PET_NPROC_PER_NODE", "4", "nproc_per_node"),
        ("PET_RDZV_ENDPOINT", "etcd-0.etcd.training.svc:2379", "rdzv_endpoint"),
        ("PET_RDZV_ID", "pytorchjob-resnet", "job_id"),
        ("PET_RDZV_BACKEND", "etcd-v2", "rdzv_backend"),
        ("PET_MAX_RESTARTS", "5", "max_restarts"),
        ("PET_RDZV_CONF", "join_timeout=900,last_call_timeout=2", "rdzv_conf"),
    ],
)
def test_each_variable_fills_its_option(var: str, value: str, param: str) -> None:
    assert pet_params(UNSET, {var: value})[param] == value
    # A flag beats the variable.
    assert pet_params({**UNSET, param: "flag"}, {var: value})[param] == "flag"


@pytest.mark.parametrize(
    ("var", "own"),
    [
        ("PET_RDZV_ID", "EFDL_JOB_ID"),
        ("PET_MAX_RESTARTS", "EFDL_MAX_RESTARTS"),
        ("PET_NPROC_PER_NODE", "EFDL_NPROC_PER_NODE"),
    ],
)
def test_efdls_own_variable_beats_pet(var: str, own: str) -> None:
    param = PET[var]
    assert pet_params(UNSET, {var: "3", own: "7"})[param] is None  # left to EFDL_*


def test_empty_variables_are_ignored_and_static_ones_are_the_static_rendezvous() -> None:
    assert pet_params(UNSET, {"PET_NNODES": ""}) == UNSET
    env = {"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}
    got = pet_params(UNSET, env)
    assert (got["node_rank"], got["master_addr"], got["master_port"]) == (
        "1",
        "job-master-0",
        "23456",
    )


def test_a_bad_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="PET_MAX_RESTARTS is 'x'; expected a whole number"):
        pet_params(UNSET, {"PET_MAX_RESTARTS": "x"})

"""torchrun's ``PET_*`` environment variables, as Kubeflow's PyTorchJob sets them.

torchrun reads any of its options from ``PET_<OPTION>`` when the flag is not given; the
training operator sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_RDZV_ENDPOINT``,
``PET_RDZV_ID``, ``PET_RDZV_BACKEND``, ``PET_MAX_RESTARTS`` and ``PET_RDZV_CONF`` (and
``PET_NODE_RANK``/``PET_MASTER_*`` for static jobs: efdl's static rendezvous, an etcd that
the pod of rank 0 serves). So a PyTorchJob whose rendezvous points at an etcd v3 service,
or a static one, runs ``efdl-run`` unchanged. A flag beats its ``PET_*`` variable, and
efdl's own ``EFDL_*`` variable (more specific) beats it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from efdl.config import LaunchConfig
from efdl.errors import ConfigError
from efdl.options import env_name

# PET_* variable -> efdl-run's parameter (the name click passes).
PET = {
    "PET_NNODES": "nnodes",
    "PET_NPROC_PER_NODE": "nproc_per_node",
    "PET_RDZV_ENDPOINT": "rdzv_endpoint",
    "PET_RDZV_ID": "job_id",
    "PET_RDZV_BACKEND": "rdzv_backend",
    "PET_MAX_RESTARTS": "max_restarts",
    "PET_RDZV_CONF": "rdzv_conf",
    "PET_NODE_RANK": "node_rank",
    "PET_MASTER_ADDR": "master_addr",
    "PET_MASTER_PORT": "master_port",
}
# The parameters with an EFDL_* variable of their own (it wins over PET_*).
_OWN_ENV = frozenset({"job_id", "max_restarts", "nproc_per_node"})


def pet_params(params: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """``params`` (efdl-run's, as click parsed them) with the unset ones filled from
    ``PET_*`` variables in ``env``; values stay strings (validated like the flags)."""
    out = dict(params)
    for var, name in PET.items():
        value = env.get(var)
        if value is None or value == "" or out.get(name) is not None:
            continue
        if name in _OWN_ENV and env.get(env_name(name, LaunchConfig)):
            continue
        if name == "max_restarts" and not value.strip().isdigit():
            raise ConfigError(f"{var} is {value!r}; expected a whole number of restarts.")
        out[name] = value
    return out

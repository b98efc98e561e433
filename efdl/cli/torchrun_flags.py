"""torchrun's flags in efdl-run: its rendezvous backends and --rdzv-conf as efdl's flags,
and the flags efdl does not need, each with what it does instead (docs/torchrun.md)."""

from __future__ import annotations

import socket
from typing import Any

from efdl.cli.common import log
from efdl.errors import ConfigError
from efdl.rendezvous.api import Endpoint

_RDZV_ETCD = ("etcd", "etcd-v2", "etcd-v3", "efdl")


_RDZV_STORE = ("c10d", "static")  # torchrun's rendezvous on a node's TCPStore


IGNORED = {
    "monitor_interval": "workers are watched without polling",
    "start_method": "workers are started with exec",
    "run_path": "each worker runs SCRIPT as `python SCRIPT` in a process of its own, as "
    "--run-path's runpy.run_path does",
    "logs_specs": "worker output goes where --log-dir, --redirects, --tee and "
    "--local-ranks-filter say; LogsSpecs plugins are not loaded",
    "numa_binding": "workers are not bound to NUMA nodes (bind them with --no-python numactl "
    "... or in the script)",
    "event_log_handler": "efdl's events go to etcd: `efdl events --job-id JOB` lists them",
}


def rendezvous_flags(backend: str | None, endpoint: str | None, params: dict[str, Any]) -> None:
    """torchrun's --rdzv-backend and --rdzv-endpoint, as efdl's flags (into ``params``).

    Every etcd backend's endpoint is an etcd's, which efdl speaks v3 to. ``c10d`` and
    ``static`` are torchrun's store-based rendezvous: with ``--etcd`` efdl's runs there;
    without, their endpoint is a node's address, not an etcd, and one node runs standalone.
    """
    if backend is None or backend in _RDZV_ETCD:
        if backend not in (None, "etcd-v3", "efdl"):
            log.info(
                "--rdzv-backend %s: efdl's rendezvous speaks etcd's v3 API to that etcd "
                "(etcd 3.6 has no v2 API).",
                backend,
            )
        if endpoint and not params.get("etcd"):
            params["etcd"] = endpoint
        return
    if backend in _RDZV_STORE:
        if params.get("etcd") or not endpoint:
            where = "the etcd at --etcd" if params.get("etcd") else "a static rendezvous"
            log.info("--rdzv-backend %s: efdl's rendezvous runs on %s.", backend, where)
            return
        if endpoint.rpartition(":")[2] == "0":  # what torchrun --standalone expands to
            params["standalone"] = True
            log.info(
                "--rdzv-backend %s --rdzv-endpoint %s: torchrun's single-node line "
                "(--standalone); efdl runs it standalone, on an etcd of its own.",
                backend,
                endpoint,
            )
            return
        # c10d's store is served by the node at the endpoint: efdl's etcd is, there.
        at = Endpoint.parse(endpoint if ":" in endpoint.strip("[]") else f"{endpoint}:29400")
        params["master_addr"] = params.get("master_addr") or at.host
        params["master_port"] = params.get("master_port") or at.port
        if params.get("node_rank") is None:
            params["node_rank"] = 0 if _can_serve(at.host, at.port) else 1
        log.info(
            "--rdzv-backend %s --rdzv-endpoint %s: the node that can listen there serves the "
            "job's etcd (%s).",
            backend,
            endpoint,
            "this one" if params["node_rank"] == 0 else "not this one",
        )
        return
    raise ConfigError(
        f"--rdzv-backend {backend!r} is not efdl's: efdl's rendezvous is etcd v3. Pass "
        "--etcd host:port (or --rdzv-backend etcd --rdzv-endpoint host:2379), or --standalone."
    )


def apply_rdzv_conf(text: str, flags: dict[str, Any]) -> None:
    """torchrun's --rdzv-conf k=v,...: the keys that mean something here."""
    mapping = {
        "join_timeout": "join_timeout_s",
        "timeout": "join_timeout_s",
        "last_call_timeout": "settle_s",
        "lease_ttl": "lease_ttl_s",
    }
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--rdzv-conf item {item!r} is not key=value.")
        if key in mapping:
            if flags.get(mapping[key]) is None:  # an explicit efdl flag wins
                flags[mapping[key]] = value
        else:
            log.info("Ignoring --rdzv-conf %s: it has no meaning for efdl.", key)


def _can_serve(host: str, port: int) -> bool:
    """Whether this node can listen at host:port now (an address of its own, the port free):
    torchrun's c10d backend makes such a node the store's host."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.bind(address)
    except OSError:
        return False
    return True

"""What this machine offers: CPUs, the address peers reach it at, its worker slots (GPUs are
found by efdl.launcher.gpus)."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence

import psutil

from efdl import __version__
from efdl.errors import ConfigError
from efdl.launcher.gpus import Selected
from efdl.rendezvous.api import Endpoint
from efdl.rendezvous.records import GpuInfo, NodeRecord, check_id

log = logging.getLogger(__name__)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_slots(
    nproc_per_node: str, gpus: tuple[GpuInfo, ...]
) -> tuple[int, tuple[GpuInfo, ...]]:
    """How many workers this node offers, and the GPUs behind them (none on a CPU host).

    Raises:
        ConfigError: ``gpu`` on a host without GPUs, or more workers than GPUs.
    """
    word = nproc_per_node.strip().lower()
    if word == "gpu":
        if not gpus:
            raise ConfigError("--nproc-per-node gpu was given, but this host has no visible GPU.")
        return len(gpus), gpus
    if word == "cpu":
        return cpu_count(), ()
    if word == "auto":
        return (len(gpus), gpus) if gpus else (1, ())
    n = int(word)
    if gpus and n > len(gpus):
        raise ConfigError(
            f"--nproc-per-node {n} asks for more workers than the {len(gpus)} visible GPUs; "
            "use --nproc-per-node gpu or fewer workers."
        )
    return n, gpus[:n] if gpus else ()


def interface_of(address: str) -> str | None:
    """The name of the local network interface that holds ``address`` (None: no such one,
    e.g. a name rather than an address, or an address behind NAT)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def default_host(endpoints: tuple[Endpoint, ...]) -> str:
    """The local address that routes to etcd: what peers on the same network can reach.

    Uses a UDP socket's connect (no packet is sent) to ask the kernel for the route.
    """
    target = endpoints[0].host if endpoints else "127.0.0.1"
    if target in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, endpoints[0].port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def default_node_id() -> str:
    """Host name plus a short random suffix, so a restarted agent never collides with the
    record its predecessor left until that record's lease expires."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host.strip('-.') or 'node'}-{uuid.uuid4().hex[:6]}"


def gpu_infos(gpus: Sequence[Selected]) -> tuple[GpuInfo, ...]:
    """What a node record says of the GPUs ``--gpus`` gives the job."""
    return tuple(GpuInfo(s.gpu.index, s.gpu.model, s.gpu.memory_mb, s.gpu.uuid) for s in gpus)


def local_node(
    node_id: str | None,
    host: str,
    store_port: int,
    nproc_per_node: str,
    gpus: Sequence[Selected] = (),
) -> NodeRecord:
    """This node's record: ``gpus`` are the GPUs ``--gpus`` gives the job (see
    efdl.launcher.gpus.select); the first ``slots`` of them back its workers."""
    slots, used = resolve_slots(nproc_per_node, gpu_infos(gpus))
    return NodeRecord(
        node_id=check_id(node_id or default_node_id(), "node id"),
        host=host,
        store_port=store_port,
        slots=slots,
        gpus=used,
        cpus=cpu_count(),
        version=__version__,
        start_time=time.time(),
    )

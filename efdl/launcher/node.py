"""What this machine offers: GPUs, CPUs, the address peers reach it at, its worker slots."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping

import psutil

from efdl import __version__
from efdl.errors import ConfigError
from efdl.rendezvous.api import Endpoint
from efdl.rendezvous.model import GpuInfo, NodeRecord, check_node_id

log = logging.getLogger(__name__)


def detect_gpus(env: Mapping[str, str] | None = None) -> tuple[GpuInfo, ...]:
    """The GPUs this agent may use (``nvidia-smi``, limited by ``CUDA_VISIBLE_DEVICES``).

    Reads NVML through nvidia-smi rather than initialising CUDA in the agent process.
    """
    env = os.environ if env is None else env
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("nvidia-smi failed (%s); treating this host as CPU-only.", exc)
        return ()
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            memory = int(float(parts[2])) if parts[2].replace(".", "").isdigit() else 0
            gpus.append(GpuInfo(int(parts[0]), parts[1], memory))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        if all(v.isdigit() for v in wanted):
            by_index = {g.index: g for g in gpus}
            gpus = [by_index[int(v)] for v in wanted if int(v) in by_index]
        else:
            log.warning(
                "CUDA_VISIBLE_DEVICES=%s is not a list of indices; using it as is.", visible
            )
    return tuple(gpus)


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


def local_node(
    node_id: str | None,
    host: str,
    store_port: int,
    nproc_per_node: str,
    env: Mapping[str, str] | None = None,
) -> NodeRecord:
    gpus = detect_gpus(env)
    slots, used = resolve_slots(nproc_per_node, gpus)
    return NodeRecord(
        node_id=check_node_id(node_id or default_node_id()),
        host=host,
        store_port=store_port,
        slots=slots,
        gpus=used,
        cpus=cpu_count(),
        version=__version__,
        start_time=time.time(),
    )

"""The environment of one worker: torchrun's contract plus ``EFDL_*``. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from efdl.launcher.gpus import worker_devices
from efdl.protocol.env import (
    DEVICE_ENV,
    GENERATION_ENV,
    JOB_ID_ENV,
    LOCAL_RANK_ENV,
    NODE_HOST_ENV,
    NODE_ID_ENV,
    SECRET_VARIABLES,
)
from efdl.rendezvous.records import NodeRecord, Round

SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True, slots=True)
class JobContext:
    """What every worker of this node shares across rounds."""

    job_id: str
    node: NodeRecord
    max_restarts: int
    role: str = "default"
    # The interface holding the node's address (--host): gloo and NCCL's sockets use it, so
    # that they listen where the store does, not on whatever the host name resolves to.
    ifname: str | None = None
    # The node's GPUs for the job, in slot order, as CUDA_VISIBLE_DEVICES names them (indices,
    # or UUIDs where the user named them so; MIG instances by UUID). Empty on a CPU host.
    gpu_ids: tuple[str, ...] = ()
    # torchrun's --virtual-local-rank: LOCAL_RANK is 0 and the worker sees its own GPU alone.
    virtual_local_rank: bool = False


def worker_env(
    base: Mapping[str, str],
    ctx: JobContext,
    rnd: Round,
    local_rank: int,
    restart_count: int,
    error_file: Path,
    slot: int | None = None,
) -> dict[str, str]:
    """The environment for local worker ``local_rank`` of this node in round ``rnd``, which
    holds GPU ``slot`` of ``ctx.gpu_ids`` (default: its local rank's, as torchrun).

    Raises:
        ValueError: this node is not a member of ``rnd``.
    """
    member = rnd.member
    if member is None:
        raise ValueError(f"Node {ctx.node.node_id} is not in round {rnd.generation}.")
    group_rank = member.group_rank
    rank = member.first_rank + local_rank
    env = {k: v for k, v in base.items() if k not in SECRET_VARIABLES}  # workers never see etcd
    env.update(
        RANK=str(rank),
        LOCAL_RANK="0" if ctx.virtual_local_rank else str(local_rank),
        WORLD_SIZE=str(rnd.world_size),
        LOCAL_WORLD_SIZE=str(member.workers),
        GROUP_RANK=str(group_rank),
        GROUP_WORLD_SIZE=str(rnd.nodes),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(rnd.world_size),
        ROLE_NAME=ctx.role,
        MASTER_ADDR=rnd.store_host,
        MASTER_PORT=str(rnd.store_port),
        TORCHELASTIC_RUN_ID=ctx.job_id,
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(ctx.max_restarts),
        # The rank-0 node's agent serves this generation's store: every worker is a client.
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_ERROR_FILE=str(error_file),
    )
    env[JOB_ID_ENV] = ctx.job_id
    env[NODE_ID_ENV] = ctx.node.node_id
    env[NODE_HOST_ENV] = ctx.node.host
    env[GENERATION_ENV] = str(rnd.generation)
    env[LOCAL_RANK_ENV] = str(local_rank)
    if ctx.ifname:
        for name in SOCKET_IFNAME_VARIABLES:
            env.setdefault(name, ctx.ifname)  # the user's own choice wins
    if ctx.gpu_ids:
        own_slot = local_rank if slot is None else slot
        if ctx.virtual_local_rank:
            visible, own = ctx.gpu_ids[own_slot], 0
        else:
            visible, own = worker_devices(ctx.gpu_ids, own_slot, local_rank)
        env["CUDA_VISIBLE_DEVICES"] = visible
        env[DEVICE_ENV] = str(own)
        # NVML's indices (nvidia-smi's, what --gpus names) are CUDA's in PCI bus order only.
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    # As torchrun: an NCCL error or timeout tears the worker down (the agent restarts it)
    # rather than leaving it hung. In-place workers switch to 2 (see efdl.worker.runtime).
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if member.workers > 1:
        # As torchrun: one OpenMP thread per worker unless the user set a number (several
        # workers each using every core of the host slow each other down). Nothing else,
        # and never over the user's own setting (docs/deploy.md, Threads).
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the log prefixer as they are printed
    return env

"""Which GPUs this agent gives its workers, and how each worker sees its own.

Discovery reads NVML (``nvidia-ml-py``), never CUDA: the agent must not make a CUDA context
on a GPU its workers will use. The rest is pure: which of the found GPUs the agent's own
``CUDA_VISIBLE_DEVICES`` lets it see (indices, UUIDs or MIG UUIDs), which of those ``--gpus``
picks (a list, ``all`` or ``free``), and the ``CUDA_VISIBLE_DEVICES`` each worker gets.

The device contract is torchrun's: every worker of a node sees the node's GPUs in
``CUDA_VISIBLE_DEVICES`` and ``cuda:LOCAL_RANK`` is its own. efdl adds one guarantee: a worker
keeps its GPU for its whole life (in place, a survivor never changes device), so a newcomer
gets a GPU no running worker holds, and its ``CUDA_VISIBLE_DEVICES`` lists that GPU at
position ``LOCAL_RANK``. MIG instances are the exception CUDA imposes: a process can use only
one, so a worker on MIG sees its own instance alone, as ``cuda:0``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from efdl.errors import ConfigError
from efdl.protocol.env import SIMULATED_GPUS_ENV

log = logging.getLogger(__name__)

ALL, FREE = "all", "free"
MAX_SIMULATED = 64


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU (or a MIG instance) as NVML reports it.

    Attributes:
        index: NVML's index (nvidia-smi's; PCI bus order); a MIG instance has its parent's.
        uuid: ``GPU-...``, or ``MIG-...`` for a MIG instance.
        model: the product name.
        memory_mb: total memory.
        busy: some compute process runs on it.
        pids: the compute processes on it (which the fleet's host daemon tells apart from
            its own workers).
    """

    index: int
    uuid: str
    model: str = ""
    memory_mb: int = 0
    busy: bool = False
    pids: tuple[int, ...] = ()

    @property
    def mig(self) -> bool:
        return self.uuid.startswith("MIG-")


@dataclass(frozen=True, slots=True)
class Selected:
    """A GPU this agent gives to its workers, and its name in ``CUDA_VISIBLE_DEVICES``."""

    gpu: Gpu
    visible_id: str


def discover(nvml: Any = None) -> list[Gpu]:
    """Every GPU and MIG instance on this host, from NVML; [] where there is no NVIDIA driver.
    With ``EFDL_SIMULATED_GPUS=N``, N simulated GPUs instead (:func:`simulated`).

    Args:
        nvml: the ``pynvml`` module (default: import it).

    Raises:
        ConfigError: ``EFDL_SIMULATED_GPUS`` is not a number of GPUs.
    """
    fake = os.environ.get(SIMULATED_GPUS_ENV)
    if fake is not None and nvml is None:
        return simulated(fake)
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            log.debug("nvidia-ml-py is not installed: no GPUs.")
            return []
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        log.debug("NVML is not available (%s): no GPUs.", exc)
        return []
    try:
        found: list[Gpu] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            model = _text(nvml.nvmlDeviceGetName(handle))
            instances = _mig_instances(nvml, handle)
            if instances:
                found.extend(_describe(nvml, h, index, model) for h in instances)
            else:
                found.append(_describe(nvml, handle, index, model))
        return found
    except nvml.NVMLError as exc:
        log.warning("NVML failed while listing GPUs (%s): treating this host as CPU-only.", exc)
        return []
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def simulated(count: str) -> list[Gpu]:
    """``count`` simulated GPUs (``EFDL_SIMULATED_GPUS``): the fleet and efdl-run place
    workers on them as on GPUs, and the workers, which find no CUDA, train on the CPU. For
    trying the fleet on hosts without GPUs; nothing ever runs on them, and no process of
    another's is ever seen on them."""
    if not count.strip().isdigit() or not 0 <= int(count) <= MAX_SIMULATED:
        raise ConfigError(
            f"{SIMULATED_GPUS_ENV}={count!r} is not a number of simulated GPUs; expected "
            f"0..{MAX_SIMULATED}."
        )
    host = socket.gethostname()
    tag = hashlib.sha256(host.encode()).hexdigest()[:8]
    return [
        Gpu(i, f"GPU-{tag}-0000-0000-0000-{i:012d}", "simulated GPU (EFDL_SIMULATED_GPUS)", 0)
        for i in range(int(count))
    ]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mig_instances(nvml: Any, handle: Any) -> list[Any]:
    """The MIG instances of a GPU in MIG mode; [] otherwise (or where NVML cannot tell)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # NVML_ERROR_NOT_SUPPORTED: no MIG on this GPU
        return []
    if current != nvml.NVML_DEVICE_MIG_ENABLE:
        return []
    out = []
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            out.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
        except nvml.NVMLError:  # NVML_ERROR_NOT_FOUND: an empty slot
            continue
    return out


def _describe(nvml: Any, handle: Any, index: int, model: str) -> Gpu:
    try:
        pids = tuple(int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except nvml.NVMLError:
        pids = ()
    return Gpu(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        model=model,
        memory_mb=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1 << 20),
        busy=bool(pids),
        pids=pids,
    )


def _find(gpus: Sequence[Gpu], token: str, where: str) -> Gpu:
    """The GPU ``token`` names: an index, or a UUID (or a unique prefix of one, as CUDA
    accepts)."""
    if token.isdigit():
        matches = [g for g in gpus if g.index == int(token) and not g.mig]
        if not matches and any(g.index == int(token) for g in gpus):
            raise ConfigError(
                f"{where} names GPU {token}, which is in MIG mode; name its MIG instances by "
                f"UUID: {', '.join(g.uuid for g in gpus if g.index == int(token))}."
            )
    else:
        matches = [g for g in gpus if g.uuid.startswith(token)]
    if len(matches) != 1:
        known = ", ".join(f"{g.index} ({g.uuid})" for g in gpus) or "none"
        what = "no GPU" if not matches else "more than one GPU"
        raise ConfigError(
            f"{where} names {token!r}, but that matches {what} here; expected an index or UUID "
            f"of these GPUs: {known}."
        )
    return matches[0]


def _tokens(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def visible(gpus: Sequence[Gpu], cuda_visible_devices: str | None) -> list[tuple[Gpu, str]]:
    """The GPUs that the agent's ``CUDA_VISIBLE_DEVICES`` lets it see, in its order, each with
    the spelling it was named by (None: all of them, named by index).

    CUDA stops at the first entry it cannot find (``-1`` hides every GPU); so does this.
    Indices are taken in NVML's (PCI bus) order, which is CUDA's too under
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, the order efdl gives its workers.
    """
    if cuda_visible_devices is None:
        return [(g, g.uuid if g.mig else str(g.index)) for g in gpus]
    out: list[tuple[Gpu, str]] = []
    for token in _tokens(cuda_visible_devices):
        try:
            out.append((_find(gpus, token, f"CUDA_VISIBLE_DEVICES={cuda_visible_devices}"), token))
        except ConfigError:
            if out or token != "-1":
                log.warning(
                    "CUDA_VISIBLE_DEVICES=%s: %r matches no GPU here; CUDA ignores it and "
                    "every entry after it.",
                    cuda_visible_devices,
                    token,
                )
            break
    return out


def select(
    gpus: Sequence[Gpu], cuda_visible_devices: str | None, spec: str | None
) -> list[Selected]:
    """The GPUs ``--gpus`` gives this agent's workers, in slot order.

    Args:
        gpus: every GPU NVML found.
        cuda_visible_devices: the agent's own ``CUDA_VISIBLE_DEVICES`` (None: unset).
        spec: ``all`` (or None: every visible GPU), ``free`` (visible GPUs no compute process
            runs on), or a comma-separated list of indices and UUIDs, all visible.

    Raises:
        ConfigError: an entry names no visible GPU, names one twice, or ``free``/a list finds
            none.
    """
    seen = visible(gpus, cuda_visible_devices)
    word = (spec or ALL).strip()
    if word.lower() == ALL:
        return [Selected(g, name) for g, name in seen]
    if word.lower() == FREE:
        if not seen:
            raise ConfigError(_none_visible("--gpus free", cuda_visible_devices))
        free = [Selected(g, name) for g, name in seen if not g.busy]
        if not free:
            busy = ", ".join(name for _, name in seen)
            raise ConfigError(
                f"--gpus free: every GPU this agent can see ({busy}) has a compute process on "
                "it; nothing is free to offer the job."
            )
        return free
    tokens = _tokens(word)
    if not tokens:
        raise ConfigError(f"--gpus is {spec!r}; expected 'all', 'free' or a list like 0,3.")
    if not seen:
        raise ConfigError(_none_visible(f"--gpus {word}", cuda_visible_devices))
    chosen: list[Selected] = []
    for token in tokens:
        gpu = _find([g for g, _ in seen], token, f"--gpus {word}")
        if any(c.gpu == gpu for c in chosen):
            raise ConfigError(f"--gpus {word} names GPU {token!r} twice.")
        chosen.append(Selected(gpu, gpu.uuid if gpu.mig or not token.isdigit() else token))
    return chosen


def _none_visible(what: str, cuda_visible_devices: str | None) -> str:
    hidden = (
        f" (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides them)"
        if cuda_visible_devices is not None
        else ""
    )
    return f"{what}: this agent sees no GPU{hidden}; is the NVIDIA driver installed?"


def cuda_ids(selected: Sequence[Selected], device_order: str | None) -> tuple[str, ...]:
    """How workers' ``CUDA_VISIBLE_DEVICES`` names the ``selected`` GPUs: as they were named,
    except by UUID where the user's ``CUDA_DEVICE_ORDER`` makes CUDA's indices differ from
    NVML's."""
    by_index = device_order in (None, "", "PCI_BUS_ID")
    return tuple(s.visible_id if by_index else s.gpu.uuid for s in selected)


def worker_devices(ids: Sequence[str], slot: int, local_rank: int) -> tuple[str, int]:
    """``CUDA_VISIBLE_DEVICES`` for a worker holding GPU ``slot`` as local rank
    ``local_rank``, and the index of its own GPU in that list.

    The node's GPUs in slot order, with the worker's own moved to position ``local_rank``
    (swapped with the one there), so that ``cuda:LOCAL_RANK`` is its GPU even when a
    newcomer's local rank is not its slot. On MIG, only its own instance (CUDA uses one).
    """
    if ids[slot].startswith("MIG-"):
        return ids[slot], 0
    order = list(ids)
    if local_rank < len(order):
        order[slot], order[local_rank] = order[local_rank], order[slot]
        return ",".join(order), local_rank
    return ",".join(order), slot


def free_slot(local_rank: int, held: set[int], slots: int) -> int:
    """The GPU slot for a new worker: its own local rank's if no running worker holds it,
    else the lowest free one (a survivor never moves); its local rank's if all are held
    (a worker sent away still runs its last step there)."""
    if local_rank < slots and local_rank not in held:
        return local_rank
    return next((s for s in range(slots) if s not in held), local_rank % max(1, slots))

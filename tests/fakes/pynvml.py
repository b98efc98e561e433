"""A stand-in for nvidia-ml-py's ``pynvml`` on hosts without GPUs: the GPUs it reports come
from ``EFDL_FAKE_NVML``, a JSON list of ``{"uuid", "name", "memory_mb", "processes", "mig"}``
(``processes``: how many compute processes, or their PIDs; ``mig``: a list of instances, each
``{"uuid", "memory_mb", "processes"}``), or from the file ``EFDL_FAKE_NVML_FILE`` names, read
at every ``nvmlInit()`` (a test changes it to start a foreign process on a GPU). Without that
variable it behaves as NVML does with no driver. Put this directory first on PYTHONPATH to
make an ``efdl-run`` process see those GPUs; only the calls efdl makes exist here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

NVML_DEVICE_MIG_ENABLE = 1
NVML_DEVICE_MIG_DISABLE = 0
_gpus: list[dict[str, Any]] = []


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


def nvmlInit() -> None:
    path = os.environ.get("EFDL_FAKE_NVML_FILE")
    text = Path(path).read_text() if path else os.environ.get("EFDL_FAKE_NVML")
    if text is None:
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
    _gpus[:] = json.loads(text)


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_gpus)


def nvmlDeviceGetHandleByIndex(index: int) -> dict[str, Any]:
    return _gpus[index]


def nvmlDeviceGetName(handle: dict[str, Any]) -> str:
    return str(handle.get("name", "NVIDIA H100 80GB HBM3"))


def nvmlDeviceGetUUID(handle: dict[str, Any]) -> str:
    return str(handle["uuid"])


def nvmlDeviceGetMemoryInfo(handle: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(total=int(handle.get("memory_mb", 81559)) << 20)


def nvmlDeviceGetComputeRunningProcesses(handle: dict[str, Any]) -> list[SimpleNamespace]:
    procs = handle.get("processes", 0)
    pids = procs if isinstance(procs, list) else [1000 + i for i in range(int(procs))]
    return [SimpleNamespace(pid=int(p)) for p in pids]


def nvmlDeviceGetMigMode(handle: dict[str, Any]) -> tuple[int, int]:
    if "mig" not in handle:
        raise NVMLError_NotSupported("Not Supported")
    mode = NVML_DEVICE_MIG_ENABLE if handle["mig"] else NVML_DEVICE_MIG_DISABLE
    return mode, mode


def nvmlDeviceGetMaxMigDeviceCount(handle: dict[str, Any]) -> int:
    return 7


def nvmlDeviceGetMigDeviceHandleByIndex(handle: dict[str, Any], index: int) -> dict[str, Any]:
    instances = handle["mig"]
    if index >= len(instances):
        raise NVMLError("Not Found")
    return dict(instances[index])
